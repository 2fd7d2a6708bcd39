"""Run vLLM instances (colocated, prefill, decode) in child processes and drive requests
through them: the harness behind the vLLM tests, example and benchmark.

Runs under the vLLM environment's Python (``scripts/_vllm_venv.sh`` makes it); each
:class:`Instance` is a spawned child holding one ``vllm.LLM`` (which spawns vLLM's own
engine-core and worker processes), driven over a pipe. A request's TTFT is measured
in the child: from ``add_request`` to the first step that returns a token.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CONNECTORS",
    "Instance",
    "kv_transfer_config",
    "make_prompts",
    "side_channel_refusals",
    "write_key_file",
]

CONNECTORS = ("kvxfer", "nixl")


def kv_transfer_config(connector: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` of a P/D instance using ``connector`` (kv_both)."""
    if connector == "kvxfer":
        return {
            "kv_connector": "KvxferConnector",
            "kv_connector_module_path": "kvxfer.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(extra or {}),
        }
    if connector == "nixl":  # vLLM's own NixlConnector, the baseline
        return {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": dict(extra or {}),
        }
    raise ValueError(f"connector must be one of {CONNECTORS}, got {connector!r}")


def write_key_file(directory: str) -> str:
    """A fresh deployment key (64 hex characters) in a file only its owner may read."""
    import secrets

    path = os.path.join(directory, "kvxfer-auth.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def side_channel_refusals(address: str) -> dict[str, str]:
    """What a keyed prefill's side channel (its first endpoint in ``address``) answers a
    records request without a key and with another key: the error each fetch raised,
    or "answered" if it got records."""
    from kvxfer.transport.side_client import fetch_records

    out: dict[str, str] = {}
    for name, key in (("unkeyed", None), ("other_key", b"x" * 32)):
        try:
            fetch_records(address.split(",")[0], None, "", 5.0, auth_key=key)
            out[name] = "answered"
        except Exception as e:  # the refusal is the result
            out[name] = f"{type(e).__name__}: {e}"
    return out


def make_prompts(n: int, vocab: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of the given lengths (cycled), from a seeded generator."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _make_llm(opts: dict[str, Any]) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {
        "model": opts["model"],
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "block_size": opts.get("block_size", 32),
        "enforce_eager": True,
        "max_model_len": opts.get("max_model_len", 1024),
        "max_num_seqs": opts.get("max_num_seqs", 8),
        "tensor_parallel_size": opts.get("tp_size", 1),
        "seed": 0,
    }
    if opts.get("log_stats"):  # vLLM's stats path: LLM.get_metrics(), the periodic log line
        kw["disable_log_stats"] = False
    if opts.get("num_gpu_blocks_override"):  # a small pool: freed blocks are reused soon
        kw["num_gpu_blocks_override"] = int(opts["num_gpu_blocks_override"])
    if opts.get("connector"):
        kw["kv_transfer_config"] = kv_transfer_config(opts["connector"], opts.get("extra"))
        if opts.get("failure_policy"):
            kw["kv_transfer_config"]["kv_load_failure_policy"] = opts["failure_policy"]
        # e.g. another connector class (the benchmark's profiling subclass)
        kw["kv_transfer_config"].update(opts.get("kv_transfer_overrides") or {})
    return LLM(**kw)


def _run_one(llm: Any, prompt: Sequence[int], max_tokens: int, params: Mapping[str, Any] | None,
             n: int = 1, salt: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One request; ``params``: its kv_transfer_params; ``salt``: its ``cache_salt``."""
    from vllm.sampling_params import RequestOutputKind

    from vllm import SamplingParams

    sp = SamplingParams(
        # greedy: vLLM refuses n > 1 with temperature 0, so n > 1 samples with top_k=1
        # (always the most likely token: greedy's tokens, barring exact ties)
        max_tokens=max_tokens, n=n, temperature=0.0 if n == 1 else 1.0, top_k=1 if n > 1 else 0,
        ignore_eos=True, detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": dict(params)} if params else None,
    )  # fmt: skip
    engine = llm.llm_engine
    rid = f"r{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": list(prompt),
                             **({"cache_salt": salt} if salt else {})}, sp)  # fmt: skip
    by_index: dict[int, list[int]] = {i: [] for i in range(n)}  # parallel sampling's children
    ttft = None
    out_params = None
    finish_reason = None
    cached = None
    while True:
        outs = engine.step()
        now = time.perf_counter()
        done = False
        for o in outs:
            for c in o.outputs:
                if c.token_ids and ttft is None:
                    ttft = now - t0
                by_index[c.index] += list(c.token_ids)
            if o.kv_transfer_params is not None:
                out_params = o.kv_transfer_params
            if o.num_cached_tokens is not None:
                cached = o.num_cached_tokens
            if o.finished:
                done = True
                finish_reason = o.outputs[0].finish_reason if o.outputs else None
        if done:
            break
    return {
        "tokens": by_index[0], "all_tokens": [by_index[i] for i in range(n)], "ttft_s": ttft,
        "total_s": time.perf_counter() - t0, "t_add": t0,
        "kv_transfer_params": json.loads(json.dumps(out_params)) if out_params else None,
        "num_cached_tokens": cached, "finish_reason": finish_reason,
    }  # fmt: skip


def _metrics(llm: Any, prefix: str) -> dict[str, float]:
    """vLLM's own metrics whose name starts with ``prefix``, as ``name{label=value,...}``
    -> value (histograms: ``name_count`` and ``name_sum``); first logs the stats (vLLM's
    ``KV Transfer metrics: ...`` line goes to the instance's log)."""
    llm.llm_engine.do_log_stats()
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith(prefix):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k != "model_name")
        if hasattr(m, "count"):
            out[f"{m.name}_count{{{labels}}}"] = float(m.count)
            out[f"{m.name}_sum{{{labels}}}"] = float(m.sum)
        elif hasattr(m, "value"):
            out[f"{m.name}{{{labels}}}"] = float(m.value)
    return out


def _die_with_parent() -> None:
    """When the process that made this instance dies (a killed test or benchmark), take
    this instance's whole process group with it: vLLM's engine and worker processes would
    otherwise live on, holding GBs and spinning on cores (seen: a stray instance for 30
    min). Linux only (``PR_SET_PDEATHSIG``); elsewhere a no-op."""
    import ctypes

    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl: nobody would send the signal
        os.killpg(0, signal.SIGKILL)


def _child(conn: Any, opts: dict[str, Any]) -> None:
    log = open(opts["log_path"], "w")  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(opts.get("env", {}))
    os.setsid()  # a process group of its own: kill() takes vLLM's children with it
    _die_with_parent()
    try:
        t0 = time.perf_counter()
        llm = _make_llm(opts)
        conn.send(("ready", time.perf_counter() - t0))
        while True:
            cmd, payload = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "metrics":
                    conn.send(("ok", _metrics(llm, payload)))
                    continue
                r = _run_one(llm, payload["prompt"], payload["max_tokens"], payload.get("params"),
                             payload.get("n", 1), payload.get("salt"))  # fmt: skip
                conn.send(("ok", r))
            except Exception:
                conn.send(("err", traceback.format_exc()))
        llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    except Exception:
        conn.send(("err", traceback.format_exc()))
        raise


class Instance:
    """One vLLM instance in a child process.

    Args:
        role: a name for logs (``colocated``, ``prefill``, ``decode``...).
        model: path of the model directory.
        connector: ``"kvxfer"``, ``"nixl"`` or None (no KV transfer).
        cpus: ``VLLM_CPU_OMP_THREADS_BIND`` for this instance (``"0"``, ``"1"``,
            ``"0|1"`` for TP 2); one core each keeps two instances from spinning on
            one core.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        log_dir: where ``<role>.log`` goes.
        opts: more ``LLM`` settings: block_size, tp_size, max_model_len, extra
            (kv_connector_extra_config), failure_policy, num_gpu_blocks_override,
            kv_transfer_overrides (keys merged into the kv_transfer_config, e.g. another
            connector class), log_stats (vLLM's stats path on, for :meth:`metrics`).
    """

    def __init__(self, role: str, *, model: str, connector: str | None, cpus: str = "0",
                 kv_cache_gib: float = 1, log_dir: str = "/tmp", env: Mapping[str, str] | None = None,
                 **opts: Any) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")
        self.role = role
        self.log_path = os.path.join(log_dir, f"{role}.log")
        tp = int(opts.get("tp_size", 1))
        child_env = {
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            **({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if tp > 1 else {}),
            **dict(env or {}),
        }
        options = {**opts, "model": model, "connector": connector, "env": child_env,
                   "log_path": self.log_path}  # fmt: skip
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_conn, options), name=f"vllm-{role}")
        self.proc.start()
        self.init_s: float | None = None

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Wait for the LLM to load; return its init time (s)."""
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role}: not ready after {timeout_s} s (log: {self.log_path})")
        kind, val = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"{self.role} failed to start:\n{val}")
        self.init_s = float(val)
        return self.init_s

    def gen(self, prompt: Sequence[int], max_tokens: int, params: Mapping[str, Any] | None = None,
            timeout_s: float = 300, n: int = 1, salt: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Run one greedy request (``n`` > 1: parallel sampling, every child's tokens in
        ``all_tokens``; ``salt``: its ``cache_salt``); return tokens, ttft_s, total_s,
        kv_transfer_params..."""
        payload = {"prompt": list(prompt), "max_tokens": max_tokens, "params": params, "n": n,
                   "salt": salt}  # fmt: skip
        return dict(self._ask("gen", payload, timeout_s, "request not done"))

    def metrics(self, prefix: str = "vllm:kvxfer", timeout_s: float = 60) -> dict[str, float]:
        """This instance's vLLM metrics named ``prefix...`` (it needs ``log_stats=True``)."""
        return dict(self._ask("metrics", prefix, timeout_s, "no metrics"))

    def _ask(self, cmd: str, payload: Any, timeout_s: float, late: str) -> Any:
        self.conn.send((cmd, payload))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role}: {late} after {timeout_s} s")
        kind, val = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"{self.role}: {val}")
        return val

    def freeze(self) -> None:
        """SIGSTOP the instance and every vLLM process under it (a hung host: sockets
        stay open, nothing answers); :meth:`kill` still works afterwards."""
        if self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL the instance and every vLLM process under it."""
        if self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self, timeout_s: float = 60) -> None:
        """Stop politely; kill what is left after ``timeout_s``."""
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(("stop", None))
        self.proc.join(timeout_s)
        self.kill()

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use kvxfer.testing.vllm_pd from a script (see tests/vllm and kvxfer bench vllm)")
