#!/usr/bin/env python3
"""Offline P/D with kvxfer's vLLM connector: a prefill and a decode ``vllm.LLM``, each
in its own process (one CPU core each), greedy tokens compared with a colocated run.

Run it with the vLLM environment (``scripts/vllm-demo.sh`` makes it and runs this):

    python examples/vllm/pd_offline.py [--prompts 6] [--max-tokens 8]
"""

from __future__ import annotations

import argparse

from kvxfer.testing.tiny_model import build
from kvxfer.testing.vllm_pd import Instance, make_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="/tmp/kvxfer-tiny-llama", help="built if missing")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--log-dir", default="/tmp")
    a = ap.parse_args()
    build(a.model, layers=2, kv_heads=2)  # tiny random Llama, float32, fixed seed
    prompts = make_prompts(a.prompts, 1024, [17, 40, 70, 100, 129, 200])
    print("starting 3 vLLM instances (about a minute each on 2 cores)...", flush=True)
    with Instance("colocated", model=a.model, connector=None, cpus="0", log_dir=a.log_dir) as c:
        c.wait_ready()
        refs = [c.gen(p, a.max_tokens)["tokens"] for p in prompts]
    # both instances take the same kv_transfer_config: KvxferConnector, kv_both
    prefill = Instance("prefill", model=a.model, connector="kvxfer", cpus="0", log_dir=a.log_dir)
    decode = Instance("decode", model=a.model, connector="kvxfer", cpus="1", log_dir=a.log_dir)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        print(f"{'prompt':>6} {'P ms':>6} {'D TTFT ms':>9}  same  decode tokens")
        for p, ref in zip(prompts, refs, strict=True):
            # what a proxy does: prefill 1 token keeping the KV, pass the params on unchanged
            pre = prefill.gen(p, 1, {"do_remote_decode": True})
            out = decode.gen(p, a.max_tokens, pre["kv_transfer_params"])
            same = "yes" if out["tokens"] == ref else "NO"
            print(f"{len(p):>6} {pre['total_s'] * 1e3:>6.0f} {out['ttft_s'] * 1e3:>9.1f}  "
                  f"{same:>4}  {out['tokens']}")  # fmt: skip
    finally:
        prefill.stop()
        decode.stop()


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
