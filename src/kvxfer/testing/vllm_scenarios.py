"""P/D scenarios with kvxfer's vLLM connector in a real vLLM; results as JSON.

Runs under the vLLM environment's Python (``scripts/_vllm_venv.sh``); the tests in
``tests/vllm`` launch it as a subprocess and assert on the JSON it writes.

    python -m kvxfer.testing.vllm_scenarios ci --json out.json
    python -m kvxfer.testing.vllm_scenarios tokens --pairs 1-1,2-1,1-2 --json out.json
    python -m kvxfer.testing.vllm_scenarios faults --json out.json
    python -m kvxfer.testing.vllm_scenarios http --json out.json

Scenarios:
    ci: one prefill and one decode (TP 1); 4 prompts, decode tokens vs colocated; the
        negative control (prompt A decoded with the KV of a model of other weights
        that names itself as this one); B's params as they are with prompt A (computed
        locally) and re-stamped with A's prompt hash (refused by B's hold binding);
        parallel sampling (n=2: one child reads, the other computes locally); the same
        params on a second decode engine after the prefill reused the blocks (its hold
        check refuses the read; recomputed); params naming a prefill outside the
        decode's ``allowed_prefills`` (computed locally); a push decode. Every
        instance is keyed (``auth_key_file``); the prefill's side channel refuses a
        request without the key and one with another key. The first decode's and the
        prefill's kvxfer metrics through vLLM's own stats path (``log_stats``).
    tokens: a colocated reference, then each TP pair ``P-D`` over 18 prompts.
    faults: lease expiry, a prefill killed before the decode reads, a restarted
        prefill on the same port (fresh and stale params), a prefill hung then killed
        mid-load; one decode instance (pull, or push with ``--decode-extra``).
    http: two OpenAI servers and ``examples/vllm/proxy.py`` between them, keyed by
        ``KVXFER_AUTH_KEY`` in their environment; the transfers in the servers'
        ``/metrics`` and stats log lines.
The colocated reference of ``ci``, ``faults`` and ``http`` is the prefill instance
serving a request without ``kv_transfer_params`` (its connector stays idle).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvxfer.integrations.vllm.params import prompt_hash
from kvxfer.testing.ports import free_port
from kvxfer.testing.tiny_model import build
from kvxfer.testing.vllm_pd import Instance, make_prompts, side_channel_refusals, write_key_file

__all__ = ["SCENARIOS", "main", "prompt_set"]

VOCAB = 1024
MAX_TOKENS = 8
PREFILL = {"do_remote_decode": True}


def prompt_set(n: int = 18, seed: int = 0) -> list[list[int]]:
    """``n`` prompts from 5 to 200 tokens, many not multiples of 32; every sixth one
    shares 64 (or 32) tokens with the one before it, so the decode hits its prefix cache."""
    lengths = [5, 17, 31, 32, 33, 40, 63, 64, 65, 70, 96, 100, 129, 150, 200, 45, 77, 160]
    prompts = make_prompts(n, VOCAB, lengths, seed=seed)
    for i in range(5, n, 6):
        prev = prompts[i - 1]
        shared = 64 if len(prev) >= 64 else 32 if len(prev) >= 32 else 0
        prompts[i] = prev[:shared] + prompts[i][: max(8, len(prompts[i]) - shared)]
    return prompts


def _pd(p: Instance, d: Instance, prompt: Sequence[int], ref: Sequence[int] | None,
        params: dict[str, Any] | None = None, salt: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Prefill on ``p`` (unless ``params`` are given), decode on ``d`` (``salt``: the
    decode request's ``cache_salt``); one record."""
    t0 = time.perf_counter()
    if params is None:
        params = p.gen(prompt, 1, PREFILL)["kv_transfer_params"]
    r = d.gen(prompt, MAX_TOKENS, params, salt=salt)
    return {
        "prompt_len": len(prompt), "tokens": r["tokens"], "ref": list(ref or []),
        "equal": ref is not None and r["tokens"] == list(ref), "finish_reason": r["finish_reason"],
        "ttft_ms": None if r["ttft_s"] is None else round(r["ttft_s"] * 1e3, 1),
        "num_cached_tokens": r["num_cached_tokens"], "elapsed_s": round(time.perf_counter() - t0, 2),
        "params": params,
    }  # fmt: skip


# The decodes of the healthy-path scenarios (ci, tokens) size their liveness for this
# host, not for production: this VM stalls whole processes, and at times both CPUs, for
# tens of seconds (the kernel reported "BUG: workqueue lockup - pool cpus=0 ... stuck for
# 64s!" during a run whose prefill went 60.7 s without serving its side channel). Those
# scenarios test tokens, not verdicts, so a stall shorter than this costs them time, not
# a failed load; the faults scenario keeps tight settings (its verdicts are what it tests).
STALL_TOLERANT = {"silence_s": 60.0, "deadline_s": 90.0}  # the prefill holds 120 s


def _start(role: str, a: argparse.Namespace, connector: str | None, cpus: str, tp: int = 1,
           model: str | None = None, **opts: Any) -> Instance:  # fmt: skip
    return Instance(role, model=model or a.model, connector=connector, cpus=cpus,
                    log_dir=a.log_dir, tp_size=tp, **opts)  # fmt: skip


def _other_model(a: argparse.Namespace) -> str:
    """A second tiny model: the same architecture and shapes as ``a.model``, other
    weights (another seed), as a fine-tune of the same base model would be."""
    path = f"{a.model.rstrip('/')}-other"
    build(path, layers=2, kv_heads=2, seed=4321)
    return path


def _refs(inst: Instance, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(inst.gen(q, MAX_TOKENS)["tokens"]) for q in prompts]


def _negative(p_other: Instance, d: Instance, a_prompt: list[int], a_ref: list[int]
              ) -> dict[str, Any]:  # fmt: skip
    """The negative control: prompt A prefilled by ``p_other``, a model of other weights
    that names itself as this one (``model_name`` set by hand, as a deployment that
    loads one model from two paths does), decoded on ``d``: the KV has the right shapes
    and passes every check, so the tokens must differ from A's colocated ones, or the
    decode did not really use the KV it was handed."""
    rec = _pd(p_other, d, a_prompt, a_ref)
    return {**rec, "differs": rec["tokens"] != a_ref}


def _forged(p: Instance, d: Instance, a_prompt: list[int], a_ref: list[int]) -> dict[str, Any]:
    """Prompt A with the params of prompt B (same length): as they are, the decode sees
    they were made for another prompt and computes A locally; re-stamped with A's prompt
    hash (what a client forging params, or a proxy mixing them up, would send), the
    decode reads B's blocks, but B's hold was bound to B's prompt, so the load fails
    (``HoldMismatchError``) and A is recomputed or failed by the decode's policy: never
    decoded from B's KV. (Until 2026-12-07 this was the negative control: the decode
    took the forged params and decoded A from B's KV.)"""
    b_prompt = make_prompts(1, VOCAB, [len(a_prompt)], seed=99)[0]
    b_params = p.gen(b_prompt, 1, PREFILL)["kv_transfer_params"]
    mismatch = _pd(p, d, a_prompt, a_ref, params=b_params)
    b_params = p.gen(b_prompt, 1, PREFILL)["kv_transfer_params"]  # a fresh hold of B's KV
    forged = {**b_params, "kvxfer": {**b_params["kvxfer"], "prompt_hash": prompt_hash(a_prompt)}}
    seen = len(_log_lines(d, "HoldMismatchError"))
    rec = _pd(p, d, a_prompt, a_ref, params=forged)
    return {**rec, "mismatch": mismatch, "log": _log_lines(d, "HoldMismatchError")[seen:],
            "mismatch_log": _log_lines(d, "made for another prompt")}  # fmt: skip


def _parallel(p: Instance, d: Instance, prompt: list[int], ref: list[int]) -> dict[str, Any]:
    """Parallel sampling (n=2) on the decode: vLLM hands both children their parent's
    params; one reads the KV, the other computes locally (params are single-use)."""
    params = p.gen(prompt, 1, PREFILL)["kv_transfer_params"]
    r = d.gen(prompt, MAX_TOKENS, params, n=2)
    return {"all_tokens": r["all_tokens"], "ref": ref,
            "equal": all(t == ref for t in r["all_tokens"])}  # fmt: skip


def _two_engines(p: Instance, d: Instance, d2: Instance, prompt: list[int], ref: list[int],
                 pool_blocks: int) -> dict[str, Any]:  # fmt: skip
    """The same params on two decode engines (a router retrying elsewhere): ``d`` reads
    the KV and the prefill frees its blocks; the prefill then serves other prompts
    (``pool_blocks`` is its pool: every block is reallocated and overwritten); ``d2``
    reads with the same params. Its READ copies the other prompts' KV, and the hold
    check must refuse it: its load fails (recomputed or failed, by policy), never
    decoded from those bytes."""
    params = p.gen(prompt, 1, PREFILL)["kv_transfer_params"]
    first = _pd(p, d, prompt, ref, params=params)
    n = -(-pool_blocks // 7) + 2  # 200-token prompts of 7 blocks each, past the pool
    for q in make_prompts(n, VOCAB, [200], seed=21):
        p.gen(q, 1)
    second = _pd(p, d2, prompt, ref, params=params)
    return {"first": first, "second": second, "log": _log_lines(d2, "KV load ended")}


def _elsewhere(p: Instance, d: Instance, prompt: list[int], ref: list[int]) -> dict[str, Any]:
    """Params that name a prefill outside the decode's ``allowed_prefills`` (what any
    client of vLLM's API can send): the decode computes the prompt locally and never
    contacts that address."""
    params = p.gen(prompt, 1, PREFILL)["kv_transfer_params"]
    forged = {**params, "kvxfer": {**params["kvxfer"], "address": "tcp://192.0.2.7:5700"}}
    rec = _pd(p, d, prompt, ref, params=forged)
    return {**rec, "log": _log_lines(d, "192.0.2.7")}


def _other_salt(p: Instance, d: Instance, prompt: list[int], ref: list[int]) -> dict[str, Any]:
    """Params made under one ``cache_salt`` (tenant A) on a decode request of the same
    token ids under another salt: other KV by vLLM's own prefix-cache rules, so the
    decode computes locally; the same salt on both sides takes the KV."""
    seen = len(_log_lines(d, "made for another prompt"))  # the negative control's line
    salted = p.gen(prompt, 1, PREFILL, salt="tenant-a")["kv_transfer_params"]
    other = _pd(p, d, prompt, ref, params=salted, salt="tenant-b")
    salted = p.gen(prompt, 1, PREFILL, salt="tenant-a")["kv_transfer_params"]
    same = _pd(p, d, prompt, ref, params=salted, salt="tenant-a")
    return {"other_salt": other, "same_salt": same,
            "log": _log_lines(d, "made for another prompt")[seen:]}  # fmt: skip


def _other_weights(p: Instance, d: Instance, prompt: list[int], ref: list[int]) -> dict[str, Any]:
    """The prefill's params on a decode of another model of the same architecture
    (``d``): its KV has the same shapes, so only the model's identity can tell it is
    not this model's. The decode must compute the prompt itself (tokens equal its own
    colocated run), never decode from the other model's KV."""
    own = list(d.gen(prompt, MAX_TOKENS)["tokens"])  # its own colocated run
    rec = _pd(p, d, prompt, own)
    return {**rec, "prefill_ref": ref, "log": _log_lines(d, "differ in")}


def _released(p: Instance, n: int, timeout_s: float = 10) -> dict[str, float]:
    """The prefill's kvxfer metrics once ``n`` holds were released by reads, or as they
    are at ``timeout_s``. The last ReadDone may reach the prefill after the decode's
    tokens, and vLLM carries a step's stats to its front end with the next outputs: a
    one-token local request (no KV held) makes some."""
    key = "vllm:kvxfer_holds_released{engine=0,reason=read}"
    end = time.monotonic() + timeout_s
    while (m := p.metrics()).get(key, 0) < n and time.monotonic() < end:
        p.gen([5, 6, 7], 1)
        time.sleep(0.1)
    return m


def _refused_start(inst: Instance) -> dict[str, Any]:
    """Wait for ``inst`` to start (it should not); whether it did, and its ConfigError lines."""
    try:
        inst.wait_ready()
        started = True
    except RuntimeError:
        started = False
    finally:
        inst.stop()
    return {"started": started, "log": _log_lines(inst, "ConfigError")}


def _bad_config(a: argparse.Namespace) -> dict[str, Any]:
    """Start an instance whose extra config has a typo (``deadline`` for ``deadline_s``):
    it must refuse to start, and its log must name the key (an unknown key used to be
    ignored, the load running with the default deadline)."""
    return _refused_start(_start("badconfig", a, "kvxfer", "0", extra={"deadline": 5}))


def _sliding_window(a: argparse.Namespace) -> dict[str, Any]:
    """Start a kvxfer instance of a model whose every layer uses sliding-window attention
    (vLLM keeps its blocks outside the window as a shared null block): it must refuse to
    start, naming the cache it cannot pair."""
    path = f"{a.model.rstrip('/')}-swa"
    build(path, layers=2, kv_heads=2, sliding_window=64)
    return _refused_start(_start("swa", a, "kvxfer", "0", model=path))


def scenario_ci(a: argparse.Namespace) -> dict[str, Any]:
    bad_config = _bad_config(a)  # first, alone: it fails in its workers' start-up
    sliding = _sliding_window(a)  # alone too: refused when its KV cache is known
    prompts = make_prompts(4, VOCAB, [40, 70, 129, 17], seed=1)
    neg = make_prompts(1, VOCAB, [70], seed=7)[0]
    # its own prompt: the negative control leaves the other model's KV of ``neg`` in the
    # decode's prefix cache (as any decode keeps what it loaded), which a later request
    # of ``neg`` there would reuse
    forge = make_prompts(1, VOCAB, [70], seed=31)[0]
    par = make_prompts(1, VOCAB, [100], seed=5)[0]
    two = make_prompts(1, VOCAB, [90], seed=13)[0]
    two_push = make_prompts(1, VOCAB, [90], seed=17)[0]
    elsewhere = make_prompts(1, VOCAB, [60], seed=23)[0]
    salted = make_prompts(1, VOCAB, [50], seed=29)[0]
    pool = 128  # the prefill's blocks: a small pool, so freed blocks are reused soon
    other = _other_model(a)
    keyed = {"auth_key_file": write_key_file(a.log_dir)}  # one deployment key for all six
    # the prefill and the first decode with vLLM's stats path on (its metrics are checked)
    p = _start("prefill", a, "kvxfer", "0", num_gpu_blocks_override=pool, extra=keyed,
               log_stats=True)  # fmt: skip
    # the decode may contact prefills on this host only (the prefill binds 127.0.0.1)
    d = _start("decode", a, "kvxfer", "1",
               extra={**keyed, **STALL_TOLERANT, "allowed_prefills": ["127.0.0.1"]},
               log_stats=True)  # fmt: skip
    d2 = _start("decode2", a, "kvxfer", "1", failure_policy="recompute",
                extra={**keyed, **STALL_TOLERANT})  # fmt: skip
    # push mode: the prefill WRITEs into this decode's blocks
    d3 = _start("decode3", a, "kvxfer", "1", failure_policy="recompute",
                extra={"transfer_mode": "push", **keyed, **STALL_TOLERANT})  # fmt: skip
    # another model of the same architecture (other weights)
    d4 = _start("decode-other", a, "kvxfer", "1", model=other, failure_policy="recompute",
                extra={**keyed, **STALL_TOLERANT})  # fmt: skip
    # the same other weights as a prefill that names itself as the first model: the
    # negative control's KV (right shapes, passes every check, other numbers)
    p_other = _start("prefill-other", a, "kvxfer", "0", model=other,
                     extra={**keyed, "model_name": a.model})  # fmt: skip
    try:
        init = {"prefill_s": p.wait_ready(), "decode_s": d.wait_ready(),
                "decode2_s": d2.wait_ready(), "decode3_s": d3.wait_ready(),
                "decode_other_s": d4.wait_ready(), "prefill_other_s": p_other.wait_ready()}  # fmt: skip
        refs = _refs(p, [*prompts, neg, forge, par, two, two_push, elsewhere, salted])
        ref = dict(zip(("neg", "forge", "par", "two", "two_push", "elsewhere", "salted"),
                       refs[len(prompts):], strict=True))  # fmt: skip
        records = [_pd(p, d, q, r) for q, r in zip(prompts, refs, strict=False)]
        metrics = {"decode": d.metrics(), "prefill": _released(p, len(records))}
        pushed = [_pd(p, d3, q, r) for q, r in zip(prompts, refs, strict=False)]
        return {
            "init": init, "records": records, "negative": _negative(p_other, d, neg, ref["neg"]),
            "forged": _forged(p, d2, forge, ref["forge"]),
            "bad_config": bad_config, "sliding_window": sliding,
            "parallel": _parallel(p, d, par, ref["par"]),
            "log": _log_lines(d, "already took it", "made for another prompt"),
            "two_engines": _two_engines(p, d, d2, two, ref["two"], pool),
            "elsewhere": _elsewhere(p, d, elsewhere, ref["elsewhere"]),
            "push": {"records": pushed, "log": _log_lines(d3, "KV load ended"),
                     "negative": _negative(p_other, d3, neg, ref["neg"]),
                     "forged": _forged(p, d3, forge, ref["forge"])},
            "push_two_engines": _two_engines(p, d, d3, two_push, ref["two_push"], pool),
            "salt": _other_salt(p, d, salted, ref["salted"]),
            "other_weights": _other_weights(p, d4, prompts[1], refs[1]),
            "auth": side_channel_refusals(records[0]["params"]["kvxfer"]["address"]),
            "metrics": metrics, "stats_log": _log_lines(d, "KV Transfer metrics"),
            # silences of the prefill that silence_s forgave (measured, not asserted)
            "silences": [*_log_lines(d, "answered again"), *_log_lines(d3, "answered again")],
        }  # fmt: skip
    finally:
        p.stop()
        d.stop()
        d2.stop()
        d3.stop()
        d4.stop()
        p_other.stop()


def _evidence(*insts: Instance, n: int = 4) -> list[str]:
    """The last KV-load outcomes and vLLM hang warnings in the instances' logs."""
    keys = ("KV load ended", "Failing", "shared memory broadcast", "Error")
    lines: list[str] = []
    for inst in insts:
        try:
            with open(inst.log_path, errors="replace") as f:
                hits = [ln.strip()[:300] for ln in f if any(k in ln for k in keys)]
        except OSError:
            continue
        lines += [f"{inst.role}: {ln}" for ln in hits if "Tokenizer" not in ln][-n:]
    return lines


def scenario_tokens(a: argparse.Namespace) -> dict[str, Any]:
    prompts = prompt_set()
    with _start("colocated", a, None, "0") as c:
        c.wait_ready()
        refs = _refs(c, prompts)
    live: dict[str, Instance] = {}
    pairs: dict[str, Any] = {}
    for pair in a.pairs.split(","):
        tp_p, tp_d = (int(x) for x in pair.split("-"))
        want = {f"p{tp_p}", f"d{tp_d}"}
        for k in [k for k in live if k not in want]:
            live.pop(k).stop()
        recs: list[dict[str, Any]] = []
        try:
            for k, tp in ((f"p{tp_p}", tp_p), (f"d{tp_d}", tp_d)):
                if k not in live:
                    cpus = "0|1" if tp > 1 else ("0" if k[0] == "p" else "1")
                    # a TP 2 side puts three vLLM workers on two cores: OpenMP threads
                    # that spin while waiting starve the others (and their side channels)
                    env = (
                        {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
                        if a.passive_omp
                        else {}
                    )
                    extra = {**STALL_TOLERANT, **json.loads(a.decode_extra)} if k[0] == "d" else {}
                    live[k] = _start(f"{k}-for-{pair}", a, "kvxfer", cpus, tp, env=env,
                                     extra=extra)  # fmt: skip
            init = {k: live[k].wait_ready() if live[k].init_s is None else 0.0 for k in want}
            t0 = time.perf_counter()
            for q, r in zip(prompts, refs, strict=False):
                if time.perf_counter() - t0 > a.pair_budget_s:
                    raise TimeoutError(f"pair budget {a.pair_budget_s} s spent after "
                                       f"{len(recs)} prompts")  # fmt: skip
                recs.append(_pd(live[f"p{tp_p}"], live[f"d{tp_d}"], q, r))
            pairs[pair] = {"init": init, "records": recs, "run_s": time.perf_counter() - t0}
        except Exception as e:  # a pair vLLM cannot run is reported, not hidden
            pairs[pair] = {"error": f"{type(e).__name__}: {e}"[-2000:], "records": recs,
                           "evidence": _evidence(*live.values())}  # fmt: skip
            for k in list(live):
                live.pop(k).kill()
    for inst in live.values():
        inst.stop()
    return {"pairs": pairs, "num_prompts": len(prompts)}


def scenario_faults(a: argparse.Namespace) -> dict[str, Any]:
    """One decode; prefill #1 (short lease, fixed port) is killed; prefill #2 takes the port.

    The decode starts first and lists the prefill's address in ``prefill_peers``: it
    keeps trying until prefill #1 is up, and its first request finds the peer contacted.
    """
    port = a.port or free_port()
    extra = {"side_channel_port": port, "lease_s": a.lease_s}
    popts: dict[str, Any] = {"extra": extra, "num_gpu_blocks_override": 256}
    prompts = make_prompts(7, VOCAB, [70, 100, 65, 129, 96, 40, 250], seed=3)
    warm, lease_q, kill_q, stale_q, fresh_q, fresh2_q, mid_q = prompts
    address = f"tcp://127.0.0.1:{port}"
    d = _start("decode", a, "kvxfer", "1", failure_policy=a.policy,
               extra={**json.loads(a.decode_extra), "deadline_s": a.deadline_s,
                      "prefill_peers": [address]})  # fmt: skip
    p = _start("prefill1", a, "kvxfer", "0", **popts)
    out: dict[str, Any] = {"policy": a.policy, "deadline_s": a.deadline_s, "lease_s": a.lease_s}
    try:
        d.wait_ready()
        p.wait_ready()
        refs = _refs(p, prompts)
        out["warm"] = _pd(p, d, warm, refs[0])
        out["preconnect_log"] = _log_lines(d, "preconnect:")
        # lease: never decoded in time; its blocks are released, then reused by others
        lease_params = p.gen(lease_q, 1, PREFILL)["kv_transfer_params"]
        time.sleep(a.lease_s + 2)
        for q in make_prompts(48, VOCAB, [200], seed=11):  # 48 x 7 blocks > 256
            p.gen(q, 1)
        out["lease"] = _pd(p, d, lease_q, refs[1], params=lease_params)
        out["lease_log"] = _log_lines(d, "lease has ended")
        # kill the prefill after its prefill, before the decode reads
        kill_params = p.gen(kill_q, 1, PREFILL)["kv_transfer_params"]
        stale_params = p.gen(stale_q, 1, PREFILL)["kv_transfer_params"]
        p.kill()
        out["killed"] = _pd(p, d, kill_q, refs[2], params=kill_params)
        # a new prefill incarnation on the same port; the decode is not restarted
        p = _start("prefill2", a, "kvxfer", "0", **popts)
        p.wait_ready()
        out["restarted"] = _pd(p, d, fresh_q, refs[4])
        # stale: the params of a killed incarnation whose lease has not ended (this
        # scenario's 3 s lease is over by now: re-stamped with the end a 120 s lease
        # would give), so the decode tries, and the generation pin must refuse the read
        x = stale_params["kvxfer"]
        stale_params["kvxfer"] = {**x, "lease_expires_at_ms": x["lease_expires_at_ms"] + 120_000}
        out["stale"] = _pd(p, d, stale_q, refs[3], params=stale_params)
        out["stale_log"] = _log_lines(d, "KV load ended")[-1:]
        out["restarted_after_stale"] = _pd(p, d, fresh2_q, refs[5])
        # the decode's load starts while the prefill hangs (SIGSTOP: its side channel and
        # UCX progress are frozen, its sockets open), then the prefill is killed mid-load
        mid_params = p.gen(mid_q, 1, PREFILL)["kv_transfer_params"]
        p.freeze()
        box: dict[str, Any] = {}
        th = threading.Thread(target=lambda: box.update(rec=_pd(p, d, mid_q, refs[6], mid_params)))
        th.start()
        time.sleep(1.0)
        p.kill()
        th.join(a.deadline_s + 120)
        out["killed_mid_load"] = box.get("rec", {"error": "decode request did not return"})
        return out
    finally:
        p.stop()
        d.stop()


def _log_lines(inst: Instance, *keys: str) -> list[str]:
    """The lines of ``inst``'s log that hold any of ``keys`` (their last 300 characters)."""
    with open(inst.log_path, errors="replace") as f:
        return [ln.strip()[-300:] for ln in f if any(k in ln for k in keys)]


def scenario_http(a: argparse.Namespace) -> dict[str, Any]:
    from kvxfer.testing.vllm_http import run_http

    return run_http(a, prompt_set()[:6], MAX_TOKENS, free_port, _other_model(a))


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "ci": scenario_ci, "tokens": scenario_tokens, "faults": scenario_faults, "http": scenario_http,
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--json", help="write the results here (else stdout)")
    ap.add_argument("--model", default="/tmp/kvxfer-tiny-llama", help="built if missing")
    ap.add_argument("--log-dir", default="/tmp/kvxfer-vllm-logs")
    ap.add_argument("--pairs", default="1-1,1-2,2-1", help="tokens: TP pairs P-D")
    ap.add_argument(
        "--passive-omp",
        action="store_true",
        help="tokens: OpenMP threads sleep instead of spinning while they wait",
    )
    ap.add_argument("--decode-extra", default="{}",
                    help="tokens, faults: the decode's kv_connector_extra_config (JSON)")  # fmt: skip
    ap.add_argument("--pair-budget-s", type=float, default=600, help="tokens: per TP pair")
    ap.add_argument("--policy", default="fail", choices=["fail", "recompute"])
    ap.add_argument("--deadline-s", type=float, default=5.0, help="decode load deadline")
    ap.add_argument("--lease-s", type=float, default=3.0, help="prefill lease (faults)")
    ap.add_argument("--port", type=int, default=0, help="prefill side-channel port (faults)")
    a = ap.parse_args(argv)
    os.makedirs(a.log_dir, exist_ok=True)
    t0 = time.perf_counter()
    build(a.model, layers=2, kv_heads=2)
    res = {"scenario": a.scenario, **SCENARIOS[a.scenario](a)}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
