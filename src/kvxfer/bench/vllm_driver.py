"""The vLLM side of ``kvxfer bench vllm``: runs under the vLLM environment's Python.

    python -m kvxfer.bench.vllm_driver --sizes 1 2 --out /tmp/vllm-bench.json

1. Builds a deep, narrow random Llama (``tiny_model.build``: many layers, 1 KV head,
   head_dim 32, float32) so that one block of one layer is 8 KiB and a KV pool of
   ``S`` GiB holds ``S * 2**30 / 8 KiB`` (layer, block) pairs: NixlConnector's
   per-block descriptor count on the CPU backend (K and V are packed per block, one
   region per layer, one descriptor per (layer, block)).
2. Runs every prompt colocated (no connector): the reference tokens.
3. Per pool size and connector: a fresh prefill (core 0) and decode (core 1);
   one local request on each (warms the forward pass, touches no connector); then per
   prompt a prefill request (``do_remote_decode``, 1 token) and a decode request with
   the returned ``kv_transfer_params``. Request 0 is the first to the new prefill peer;
   the others are warm. Then the prefill is replaced ``first_samples - 1`` times (a new
   instance, the decode kept) and one more first request goes to each new incarnation
   (a fresh prompt of request 0's length: the decode's prefix cache cannot serve it).
   Tokens are compared with the colocated run. Connectors:
   ``nixl`` (vLLM's NixlConnector), ``kvxfer`` (first contact on the first request) and
   ``kvxfer-pre`` (the decode's ``prefill_peers`` names the prefill: contacted at start)
   and, on request, ``kvxfer-push`` (the decode in push mode: the prefill WRITEs; first
   contact both ways on the first request) and ``kvxfer-push-pre`` (push, the prefill
   in ``prefill_peers``: both contacts made when the decode or prefill starts).

kvxfer runs through :class:`~kvxfer.bench.vllm_probe.ProfiledKvxferConnector` (the
connector plus one log line per finished load), whose lines give the first request's
timeline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kvxfer.testing.tiny_model import build
from kvxfer.testing.vllm_pd import Instance, make_prompts

__all__ = ["MODEL_SHAPE", "main", "nixl_descriptors", "pool_blocks", "run_driver"]

MODEL_SHAPE = {"layers": 64, "kv_heads": 1, "heads": 2, "head_dim": 32, "intermediate": 128,
               "vocab": 1024}  # fmt: skip
BLOCK_SIZE = 32
DTYPE_BYTES = 4  # float32
PROMPT_LENGTHS = (200, 256, 131, 300, 77, 224, 161, 288, 250)
NIXL_PORT_BASE = 5610
# kvxfer: first contact on the first request (what a decode that is told nothing pays);
# kvxfer-pre: the decode lists its prefill in ``prefill_peers`` and contacts it at start
# kvxfer-push(-pre): the decode's transfer_mode is "push" (not in the default set)
KVXFER_VARIANTS = ("kvxfer", "kvxfer-pre", "kvxfer-push", "kvxfer-push-pre")
DEFAULT_CONNECTORS = ("nixl", "kvxfer", "kvxfer-pre")
PROBE = {"kv_connector": "ProfiledKvxferConnector",
         "kv_connector_module_path": "kvxfer.bench.vllm_probe"}  # fmt: skip
_PROFILE = re.compile(r"KVXFER_PROFILE (\{.*\})")
_BLOCKS = re.compile(r"kvxfer worker rank \d+: \S+, (\d+) layers x (\d+) blocks")
_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def page_bytes(shape: dict[str, int] = MODEL_SHAPE) -> int:
    """Bytes of one block of one layer (K and V): block x kv_heads x 2 x head_dim x 4 B."""
    return BLOCK_SIZE * shape["kv_heads"] * 2 * shape["head_dim"] * DTYPE_BYTES


def pool_blocks(kv_gib: float, shape: dict[str, int] = MODEL_SHAPE) -> int:
    """Blocks vLLM's CPU backend makes of ``kv_gib`` GiB (whole blocks over all layers)."""
    return int(kv_gib * (1 << 30)) // (page_bytes(shape) * shape["layers"])


def nixl_descriptors(num_blocks: int, shape: dict[str, int] = MODEL_SHAPE) -> int:
    """NixlConnector's descriptors per list on the CPU backend: one per (layer, block)."""
    return shape["layers"] * num_blocks


def _scan_log(path: str) -> dict[str, Any]:
    text = Path(path).read_text(errors="replace") if os.path.exists(path) else ""
    out: dict[str, Any] = {"profile": [json.loads(m) for m in _PROFILE.findall(text)]}
    if m := _BLOCKS.search(text):
        out["layers"], out["num_blocks"] = int(m.group(1)), int(m.group(2))
    if m := _TOKENS.search(text):
        out["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    return out


def _timeline(req: dict[str, Any], prof: dict[str, Any] | None) -> dict[str, float] | None:
    """Where one decode request's TTFT went (s): from add_request to the read's start,
    the peer's first-contact phases, the wire, and from completion to the first token."""
    if prof is None or not prof.get("posted_at"):
        return None
    t_add, ttft = req["t_add"], req["ttft_s"]
    # paid once per peer, by the first request unless the peer was contacted at start
    on_path = req["first"] and not prof.get("peer_ready_at_read", False)
    contact = prof["peer_timings_s"] if on_path else {}
    start_to_post = prof["posted_at"] - prof["started_at"]
    split = {}  # the contact's own wait: before its thread began, and after it was ready
    if contact and prof.get("peer_ready_at"):
        began = prof["peer_ready_at"] - sum(contact.values())
        split = {"read_to_contact": began - prof["started_at"],
                 "ready_to_post": prof["posted_at"] - prof["peer_ready_at"]}  # fmt: skip
    return {
        "schedule_to_read": prof["started_at"] - t_add,
        **split,
        **{f"contact_{k}": float(v) for k, v in contact.items()},
        "read_to_post_other": start_to_post - sum(contact.values()) - sum(split.values()),
        "post_to_done": prof["finished_at"] - prof["posted_at"],
        "done_to_first_token": t_add + ttft - prof["finished_at"],
    }


def _one_pair(connector: str, kv_gib: float, model: str, prompts: list[list[int]],
              ref: list[list[int]], max_tokens: int, log_dir: str,
              firsts: list[tuple[list[int], list[int]]],
              kvxfer_extra: dict[str, Any] | None = None,
              paired: list[list[tuple[list[int], list[int]]]] | None = None) -> dict[str, Any]:  # fmt: skip
    """One decode and its prefill: request 0 first, then warm; then one first request to
    each replacement prefill in ``firsts`` (prompt, colocated tokens), followed by the
    warm requests ``paired[n - 1]`` to that same (n-th) incarnation (a warm baseline taken under the
    same conditions as its first: a new prefill process on the same two cores).
    ``kvxfer_extra``: more ``kv_connector_extra_config`` keys for both kvxfer instances."""
    tag = f"{connector}-{kv_gib:g}g"
    kvxfer = connector in KVXFER_VARIANTS
    extra = {"kv_transfer_overrides": PROBE} if kvxfer else {}
    common: dict[str, Any] = {"model": model, "connector": "kvxfer" if kvxfer else connector,
              "kv_cache_gib": kv_gib, "log_dir": log_dir, "block_size": BLOCK_SIZE,
              "max_model_len": 512, "max_num_seqs": 4, **extra}  # fmt: skip
    t0 = time.perf_counter()
    # NixlConnector's side channel listens on VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600)
    # in every kv_both instance: one port each, new ones per pair
    port = NIXL_PORT_BASE + 2 * len(os.listdir(log_dir))
    more = dict(kvxfer_extra or {}) if kvxfer else {}
    p_extra: dict[str, Any] = {"extra": more} if more else {}
    d_extra: dict[str, Any] = {"extra": more} if more else {}
    if connector.endswith("-pre"):  # the decode knows its prefill peer from the start
        sc_port = port + 1000
        p_extra = {"extra": {**more, "side_channel_port": sc_port}}
        d_extra = {"extra": {**more, "prefill_peers": [f"tcp://127.0.0.1:{sc_port}"]}}
    if "-push" in connector:
        d_extra = {"extra": {**d_extra.get("extra", {}), "transfer_mode": "push"}}

    def prefill(n: int) -> Instance:  # the kvxfer-pre one takes the same port each time
        return Instance(f"{tag}-prefill{n or ''}", cpus="0",
                        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}, **common, **p_extra)  # fmt: skip

    p = prefill(0)
    d = Instance(
        f"{tag}-decode", cpus="1", env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 1)},
        **common, **d_extra,
    )  # fmt: skip
    try:
        init = {"prefill": p.wait_ready(900), "decode": d.wait_ready(900)}
        warm_prompt = make_prompts(1, MODEL_SHAPE["vocab"], [64], seed=99)[0]
        d.gen(warm_prompt, 2)  # the decode's forward pass is warm; no connector involved
        p.gen(warm_prompt, 1)
        reqs = []

        def one(prompt: list[int], want: list[int], first: bool, sample: int) -> None:
            pr = p.gen(prompt, 1, {"do_remote_decode": True}, timeout_s=120)
            dr = d.gen(prompt, max_tokens, pr["kv_transfer_params"], timeout_s=120)
            reqs.append({
                "first": first, "sample": sample, "ttft_s": dr["ttft_s"], "t_add": dr["t_add"],
                "total_s": dr["total_s"], "prompt_len": len(prompt),
                "num_cached_tokens": dr["num_cached_tokens"], "tokens_equal": dr["tokens"] == want,
                "prefill_ttft_s": pr["ttft_s"],
            })  # fmt: skip

        for i, prompt in enumerate(prompts):
            one(prompt, ref[i], i == 0, 0)
        for n, (prompt, want) in enumerate(firsts, 1):  # a new prefill peer each time
            p.stop(60)
            p = prefill(n)
            init[f"prefill{n}"] = p.wait_ready(900)
            p.gen(warm_prompt, 1)
            one(prompt, want, True, n)
            for w_prompt, w_want in paired[n - 1] if paired else ():
                one(w_prompt, w_want, False, n)
    finally:
        p.stop(60)
        d.stop(60)
    dlog, plog = _scan_log(d.log_path), _scan_log(p.log_path)
    profs = dlog["profile"]
    for r, prof in zip(reqs, profs if len(profs) == len(reqs) else [None] * len(reqs), strict=True):
        r["timeline_s"] = _timeline(r, prof)
    return {
        "connector": connector, "kv_gib": kv_gib, "init_s": init, "requests": reqs,
        "num_blocks_logged": dlog.get("num_blocks") or plog.get("num_blocks"),
        "kv_cache_tokens_logged": dlog.get("kv_cache_tokens"),
        "peer_descriptors": profs[0]["peer_descriptors"] if profs else None,
        "peer_rows": profs[0]["peer_rows"] if profs else None,
        "wall_s": time.perf_counter() - t0, "decode_log": d.log_path,
    }  # fmt: skip


def run_driver(sizes: list[int], n_prompts: int, max_tokens: int, model_dir: str, log_dir: str,
               connectors: list[str], first_samples: int = 1,
               kvxfer_extra: dict[str, Any] | None = None, paired_warm: int = 0) -> dict[str, Any]:  # fmt: skip
    """Every (size, connector) pair, fresh instances each; the colocated reference first.
    ``first_samples``: first requests per pair (each to a new prefill incarnation);
    ``paired_warm``: warm requests to each replacement incarnation after its first;
    ``kvxfer_extra``: more extra-config keys for the kvxfer instances."""
    os.makedirs(log_dir, exist_ok=True)
    digest = build(model_dir, **MODEL_SHAPE)
    prompts = make_prompts(n_prompts, MODEL_SHAPE["vocab"], PROMPT_LENGTHS, seed=0)
    more = make_prompts(first_samples - 1, MODEL_SHAPE["vocab"], PROMPT_LENGTHS[:1], seed=5)
    n_paired = (first_samples - 1) * paired_warm  # fresh prompts: no local prefix hit
    extra = make_prompts(n_paired, MODEL_SHAPE["vocab"], PROMPT_LENGTHS[1:2], seed=6)
    t0 = time.perf_counter()
    with Instance("colocated", model=model_dir, connector=None, cpus="0", kv_cache_gib=1,
                  log_dir=log_dir, block_size=BLOCK_SIZE, max_model_len=512,
                  max_num_seqs=4) as colo:  # fmt: skip
        colo.wait_ready(900)
        ref = [colo.gen(pr, max_tokens)["tokens"] for pr in prompts]
        firsts = [(pr, colo.gen(pr, max_tokens)["tokens"]) for pr in more]
        warms = [(pr, colo.gen(pr, max_tokens)["tokens"]) for pr in extra]
    paired = [warms[i * paired_warm : (i + 1) * paired_warm] for i in range(first_samples - 1)]
    pairs = []
    for kv_gib in sizes:
        for conn in connectors:
            print(f"vllm bench: {conn} at {kv_gib:g} GiB ...", file=sys.stderr, flush=True)
            try:
                pairs.append(_one_pair(conn, kv_gib, model_dir, prompts, ref, max_tokens, log_dir,
                                       firsts, kvxfer_extra, paired))  # fmt: skip
            except Exception as e:  # one failed pair must not lose the others' figures
                traceback.print_exc()
                pairs.append({"connector": conn, "kv_gib": kv_gib, "error": repr(e)})
    import vllm

    return {
        "config": {
            **MODEL_SHAPE,
            "block_size": BLOCK_SIZE,
            "dtype": "float32",
            "page_bytes_per_layer": page_bytes(),
            "prompt_lengths": [len(p) for p in prompts],
            "max_tokens": max_tokens,
            "first_samples": first_samples,
            "paired_warm": paired_warm,
            "kvxfer_extra": dict(kvxfer_extra or {}),
            "sizes_gib": sizes,
            "weights_sha256": digest,
            "vllm": vllm.__version__,
            "colocated_s": time.perf_counter() - t0,
        },
        "pairs": pairs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", required=True, help="KV pool GiB per instance")
    ap.add_argument("--prompts", type=int, default=9, help="1 first + warm requests")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--connectors", nargs="+", default=list(DEFAULT_CONNECTORS),
                    choices=["nixl", *KVXFER_VARIANTS])  # fmt: skip
    ap.add_argument("--model-dir", default="/tmp/kvxfer-vllm-bench-model")
    ap.add_argument("--log-dir", default="/tmp/kvxfer-vllm-bench-logs")
    ap.add_argument("--first-samples", type=int, default=1,
                    help="first requests per pair, each to a new prefill (default 1)")  # fmt: skip
    ap.add_argument("--paired-warm", type=int, default=0,
                    help="warm requests to each replacement prefill after its first")  # fmt: skip
    ap.add_argument("--kvxfer-extra", type=json.loads, default=None,
                    help="JSON object of more kv_connector_extra_config keys for kvxfer")  # fmt: skip
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    doc = run_driver(a.sizes, a.prompts, a.max_tokens, a.model_dir, a.log_dir, a.connectors,
                     a.first_samples, a.kvxfer_extra, a.paired_warm)  # fmt: skip
    Path(a.out).write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
