"""A producer or consumer engine for the two-host test; run inside a network namespace.

producer: prints ``READY <address>`` and serves until stdin closes.
consumer: reads ``--requests`` seeded requests from ``--address``, verifies every byte,
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
from kvxfer.layout.presets import spec_for
from kvxfer.testing.pattern import fill, mismatches

PRESET, BLOCKS = "tiny-gqa", 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["producer", "consumer"])
    p.add_argument("--bind", default="tcp://0.0.0.0:0")
    p.add_argument("--advertise", default=None)
    p.add_argument("--address", default="")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    if a.role == "producer":
        from kvxfer.engine.producer import Producer

        spec = spec_for(PRESET, tp_rank=0, tp_size=1, num_blocks=BLOCKS)
        bufs = allocate_cache(spec)
        fill(spec, bufs)
        cfg = EngineConfig(
            "host-a", side_channel_addr=a.bind, advertise_addr=a.advertise, model_name=PRESET
        )
        with Producer(cfg, [(spec, bufs)]) as prod:
            print(f"READY {prod.address}", flush=True)
            sys.stdin.read()  # serve until the test closes our stdin
        return
    from kvxfer.engine.consumer import Consumer

    specs = [spec_for(PRESET, tp_rank=d, tp_size=2, num_blocks=BLOCKS) for d in range(2)]
    ranks = [(s, allocate_cache(s)) for s in specs]
    cfg = EngineConfig(
        "host-b",
        side_channel_addr=a.bind,
        advertise_addr=a.advertise,
        model_name=PRESET,
        deadline_s=20,
    )
    remote = spec_for(PRESET, tp_rank=0, tp_size=1, num_blocks=BLOCKS)
    rng = np.random.default_rng(7)
    out = {"done": 0, "bad": 0, "states": []}
    with Consumer(cfg, ranks) as cons:
        for i in range(a.requests):
            lids = rng.choice(BLOCKS, 4, replace=False)
            rids = rng.choice(BLOCKS, 4, replace=False)
            start = cons.push if a.write else cons.read
            t = start(f"r{i}", a.address, local_block_ids=lids, remote_block_ids=rids)
            state = t.wait(30)
            out["states"].append(state.value if t.error is None else f"{state.value}: {t.error}")
            if state is RequestState.DONE:
                out["done"] += 1
                out["bad"] += sum(mismatches(s, b, remote, lids, rids) for s, b in ranks)
        out["first_contact_ms"] = {k: v * 1e3 for k, v in cons.connect(a.address).timings_s.items()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
