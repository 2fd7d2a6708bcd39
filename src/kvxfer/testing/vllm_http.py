"""The HTTP P/D scenario: two vLLM OpenAI servers and ``examples/vllm/proxy.py``.

Runs under the vLLM environment's Python (from :mod:`kvxfer.testing.vllm_scenarios`).
Prompts are token ids (the servers run with ``--skip-tokenizer-init``); responses carry
token ids (``return_token_ids``). The colocated reference is the prefill server
answering a request without ``kv_transfer_params``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvxfer.testing.vllm_pd import kv_transfer_config, side_channel_refusals

__all__ = ["completion", "run_http", "start_server"]

PROXY = Path(__file__).resolve().parents[3] / "examples" / "vllm" / "proxy.py"


def start_server(model: str, port: int, cpus: str, log_path: str,
                 env: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
    """One OpenAI API server with the kvxfer connector (its own process group), with
    ``env`` added to this process's environment and ``extra`` as the connector's
    extra config."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--dtype", "float32", "--block-size", "32", "--enforce-eager",
           "--max-model-len", "1024", "--max-num-seqs", "8", "--seed", "0",
           "--kv-transfer-config", json.dumps(kv_transfer_config("kvxfer", extra))]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
           "VLLM_LOG_STATS_INTERVAL": "1", **(env or {})}  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _wait_health(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{url}: not healthy after {timeout_s} s")


def completion(url: str, model: str, prompt: Sequence[int], max_tokens: int,
               params: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """A greedy ``/v1/completions`` with a token-id prompt; the response JSON."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def kvxfer_metrics(url: str) -> dict[str, float]:
    """The server's ``vllm:kvxfer_*`` samples from ``/metrics``: ``name{label=value,...}``
    (labels sorted, without ``model_name``) -> value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:kvxfer_") or "_created" in line.split("{")[0]:
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}")
        pairs = sorted(re.findall(r'(\w+)="([^"]*)"', labels))
        key = ",".join(f"{k}={v}" for k, v in pairs if k != "model_name")
        out[f"{name}{{{key}}}"] = float(value)
    return out


def _metrics_after(p_url: str, d_url: str, model: str, n: int) -> dict[str, Any]:
    """Both servers' kvxfer metrics once the prefill counts ``n`` holds released by
    reads (up to 10 s). vLLM carries a step's stats to its front end with the next
    outputs: a one-token local request on the prefill (no KV held) makes some."""
    end = time.monotonic() + 10
    key = "vllm:kvxfer_holds_released_total{engine=0,reason=read}"
    while (pre := kvxfer_metrics(p_url)).get(key, 0) < n and time.monotonic() < end:
        completion(p_url, model, [5, 6, 7], 1)
        time.sleep(0.2)
    return {"decode": kvxfer_metrics(d_url), "prefill": pre}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_http(a: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
             free_port: Callable[[], int], other: str) -> dict[str, Any]:  # fmt: skip
    """Start P, D and the proxy; compare proxied decode tokens with the colocated ones.
    Every server holds one deployment key, from ``KVXFER_AUTH_KEY`` in its environment.
    ``other``: a model of other weights, the negative control's prefill server."""
    import secrets

    pp, dp, op, xp = free_port(), free_port(), free_port(), free_port()
    p_url, d_url, o_url, x_url = (f"http://127.0.0.1:{x}" for x in (pp, dp, op, xp))
    keyed = {"KVXFER_AUTH_KEY": secrets.token_hex(32)}
    # requests name the model as served: by its path. The third server, the negative
    # control's prefill, runs other weights under this model's name (model_name)
    procs = [start_server(a.model, pp, "0", os.path.join(a.log_dir, "http-prefill.log"), keyed),
             start_server(a.model, dp, "1", os.path.join(a.log_dir, "http-decode.log"), keyed),
             start_server(other, op, "0", os.path.join(a.log_dir, "http-prefill-other.log"),
                          keyed, {"model_name": a.model})]  # fmt: skip
    try:
        t0 = time.perf_counter()
        _wait_health(p_url, procs[0], 600)
        _wait_health(d_url, procs[1], 600)
        _wait_health(o_url, procs[2], 600)
        init_s = time.perf_counter() - t0
        procs.append(subprocess.Popen(
            [sys.executable, str(PROXY), "--prefill", p_url, "--decode", d_url, "--port", str(xp)],
            start_new_session=True))  # fmt: skip
        _wait_health(x_url, procs[3], 30)
        records = []
        for q in prompts:
            ref = completion(p_url, a.model, q, max_tokens)["choices"][0]
            t = time.perf_counter()
            got = completion(x_url, a.model, q, max_tokens)
            choice = got["choices"][0]
            records.append({
                "prompt_len": len(q), "tokens": choice.get("token_ids"),
                "ref": ref.get("token_ids"), "equal": choice.get("token_ids") == ref.get("token_ids"),
                "finish_reason": choice.get("finish_reason"),
                "elapsed_s": round(time.perf_counter() - t, 3),
            })  # fmt: skip
        # negative control: prompt A decoded (directly on D) with the KV of A from the
        # server of other weights: right shapes, every check passes, other numbers. A is
        # new to D (a prefix D has cached would be served from its own KV)
        a_prompt = [(t * 7 + 3) % 1000 + 3 for t in prompts[-1]] + [11] * 32
        a_ref = completion(p_url, a.model, a_prompt, max_tokens)["choices"][0]["token_ids"]
        o_params = completion(o_url, other, a_prompt, 1, {"do_remote_decode": True})
        neg = completion(d_url, a.model, a_prompt, max_tokens, o_params["kv_transfer_params"])
        negative = {"tokens": neg["choices"][0].get("token_ids"), "ref": a_ref,
                    "finish_reason": neg["choices"][0].get("finish_reason")}  # fmt: skip
        auth = side_channel_refusals(o_params["kv_transfer_params"]["kvxfer"]["address"])
        metrics = _metrics_after(p_url, d_url, a.model, len(records))
        time.sleep(1.5)  # one more VLLM_LOG_STATS_INTERVAL: the decode logs its stats
        with open(os.path.join(a.log_dir, "http-decode.log"), errors="replace") as f:
            stats_log = [ln.strip()[-300:] for ln in f if "KV Transfer metrics" in ln]
        return {"init_s": round(init_s, 1), "records": records, "negative": negative,
                "auth": auth, "metrics": metrics, "stats_log": stats_log}  # fmt: skip
    finally:
        for proc in reversed(procs):
            _stop(proc)
