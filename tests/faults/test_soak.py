"""Chaos soak (issue 9, acceptance): mixed pull and push requests over several producer
processes while producers are SIGSTOPped, killed and restarted at the same address, the
consumer restarts, and a third agent sends forged and replayed notifications. Run
unkeyed, and keyed (every engine shares a deployment key; the forger, which holds every
agent's metadata but not the key, also sends forged ReadDone and Abort notices for live
requests to the producers: all of them must be dropped unauthenticated).

Every request that ends DONE is byte-verified at once (0 wrong bytes may be DONE); every
request ends within its deadline + LATE_S; afterwards nothing is held and no transfer
handle is left. CI size: ``pytest tests/faults/test_soak.py``; a longer run::

    KVXFER_SOAK_REQUESTS=20000 KVXFER_SOAK_SECONDS=600 pytest -s tests/faults/test_soak.py
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter

import numpy as np
import pytest

from kvxfer.engine.config import RequestState
from kvxfer.errors import KvxferError
from kvxfer.transport.nixl import NixlBackend
from kvxfer.transport.side_client import fetch_records
from kvxfer.wire import Abort, ReadDone, WriteDone, encode_msg

from .procs import ProducerProc, free_port, make_consumer, verify

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NUM_REQUESTS = int(os.environ.get("KVXFER_SOAK_REQUESTS", "1000"))
DURATION_S = float(os.environ.get("KVXFER_SOAK_SECONDS", "30"))  # requests spread over it
NUM_PRODUCERS = int(os.environ.get("KVXFER_SOAK_PRODUCERS", "4"))
IN_FLIGHT = 48
DEADLINE_S = 1.5
LATE_S = 0.1
NB_REMOTE, NB_LOCAL = 128, 1024


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


KEY = b"chaos-soak-deployment-key-0001"


def _producer(addr: str, i: int, key: bytes | None) -> ProducerProc:
    return ProducerProc(engine_id=f"p{i}", num_blocks=NB_REMOTE, address=addr, lease_s=3.0,
                        auth_key=key)  # fmt: skip


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_chaos_soak(keyed: bool, closing) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(9)
    key = KEY if keyed else None
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(NUM_PRODUCERS)]
    procs = [_producer(a, i, key).launch() for i, a in enumerate(addrs)]
    procs = [p.wait_ready() for p in procs]
    ready = [True] * NUM_PRODUCERS
    stopped_until = [0.0] * NUM_PRODUCERS
    cons, ranks = make_consumer("tiny-gqa", NB_LOCAL, handshake_timeout_s=1.0, heartbeat_s=0.3,
                                auth_key=key)  # fmt: skip
    forger = NixlBackend("forger", progress_delay_us=200)  # never has the key
    forged_to = forger.add_remote(cons.ranks[0].backend.metadata())
    # producer i -> (its generation, its agent as the forger knows it): keyed runs only
    forged_prod: dict[int, tuple[int, str]] = {}
    forger_unauth_at_consumer = 0
    rss0 = _rss_mb()
    free_slots = list(range(NB_LOCAL // 2))
    live: list[tuple[object, int, int, np.ndarray]] = []  # (transfer, producer, slot, rids)
    parked: list[tuple[object, int]] = []  # quarantined push blocks
    ends: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    wrong = worst_late = 0.0
    started = 0
    next_chaos = time.monotonic() + 1.0
    restarted_consumer = False
    t_start = time.monotonic()
    t_end = t_start + DURATION_S + 120
    try:
        while (started < NUM_REQUESTS or live) and time.monotonic() < t_end:
            now = time.monotonic()
            for i, p in enumerate(procs):  # resume stopped ones, notice restarted ones
                if stopped_until[i] and now >= stopped_until[i]:
                    p.signal(signal.SIGCONT)
                    stopped_until[i] = 0.0
                if not ready[i] and p.conn.poll(0):
                    p.wait_ready(1)
                    ready[i] = True
            if now >= next_chaos:  # one fault at a time, ~every 0.7 s
                next_chaos = now + 0.4
                i = rng.randrange(NUM_PRODUCERS)
                action = rng.choice(["stop", "stop", "kill", "forge", "forge"])
                if action == "stop" and ready[i] and not stopped_until[i]:
                    procs[i].stop_process()
                    faults["sigstop"] += 1
                    stopped_until[i] = now + rng.uniform(0.2, 2.0)
                elif action == "kill" and ready[i] and not stopped_until[i]:
                    procs[i].kill()
                    faults["kill+restart"] += 1
                    procs[i].close()
                    procs[i] = _producer(addrs[i], i, key).launch()  # same address, new generation
                    ready[i] = False
            for t, i, *_ in live[:8]:  # forged and replayed notices for live attempts
                att = rng.choice([t.attempt, rng.getrandbits(63)])  # type: ignore[attr-defined]
                gen = next(iter(t.peer.generations.values()), 1)  # type: ignore[attr-defined]
                forger.send_notif(forged_to, encode_msg(WriteDone(t.request_id, gen, 0, 1, att)))  # type: ignore[attr-defined]
                faults["forged"] += 1
                if keyed and ready[i] and not stopped_until[i]:
                    if forged_prod.get(i, (0, ""))[0] != procs[i].generation:
                        # the forger holds the producer's metadata (fetched here with the
                        # key, standing for a leak), never the key itself
                        (rec,) = fetch_records(addrs[i], None, cons.compat_hash, 1.0, auth_key=KEY)
                        forged_prod[i] = (rec.generation, forger.add_remote(rec.agent_metadata))
                    pgen, agent = forged_prod[i]
                    rid, live_att = t.request_id, t.attempt  # type: ignore[attr-defined]
                    for msg in (
                        ReadDone(rid, pgen, 0, 1, live_att),
                        Abort(rid, pgen, "forged", live_att),
                    ):
                        try:
                            forger.send_notif(agent, encode_msg(msg))
                            faults["forged to producers"] += 1
                        except KvxferError:  # the producer died since: its agent is gone
                            faults["forged to dead producers"] += 1
            if not restarted_consumer and started >= NUM_REQUESTS // 2:
                restarted_consumer = True  # consumer restart: live requests end ABORTED
                faults["consumer restart"] += 1
                forger_unauth_at_consumer += cons.ranks[0].backend.num_unauthenticated
                cons.close()
                for t, _, _, _ in live:
                    ends[t.poll().value] += 1  # type: ignore[attr-defined]
                live, parked = [], []
                free_slots = list(range(NB_LOCAL // 2))
                forger.remove_remote(forged_to)
                cons, ranks = make_consumer("tiny-gqa", NB_LOCAL, handshake_timeout_s=1.0,
                                            heartbeat_s=0.3, auth_key=key)  # fmt: skip
                forged_to = forger.add_remote(cons.ranks[0].backend.metadata())
            due = NUM_REQUESTS * (now - t_start) / DURATION_S  # paced: faults meet requests
            while started < min(NUM_REQUESTS, due) and len(live) < IN_FLIGHT and free_slots:
                i = rng.randrange(NUM_PRODUCERS)
                if not ready[i] or stopped_until[i]:
                    break  # holds go over a pipe to the producer: only to running ones
                slot = free_slots.pop()
                lids = np.array([2 * slot, 2 * slot + 1])
                rids = np.array(rng.sample(range(NB_REMOTE), 2))
                rid = f"s{started}"
                if rng.random() < 0.5:
                    (exp,) = procs[i].hold([(rid, 2)])
                    t = cons.read(rid, addrs[i], local_block_ids=lids, remote_block_ids=rids,
                                  deadline_s=DEADLINE_S, generation=procs[i].generation,
                                  lease_expires_at_ns=exp,
                                  hold_ticket=procs[i].tickets[rid])  # fmt: skip
                elif rng.random() < 0.5:  # push from a hold, with its ticket
                    procs[i].hold([(rid, 2)])
                    t = cons.push(rid, addrs[i], local_block_ids=lids, remote_block_ids=rids,
                                  deadline_s=DEADLINE_S,
                                  hold_ticket=procs[i].tickets[rid])  # fmt: skip
                else:  # push without a hold
                    t = cons.push(rid, addrs[i], local_block_ids=lids, remote_block_ids=rids,
                                  deadline_s=DEADLINE_S)  # fmt: skip
                live.append((t, i, slot, rids))
                started += 1
            still = []
            for t, i, slot, rids in live:
                state = t.poll()  # type: ignore[attr-defined]
                if not state.is_terminal:
                    still.append((t, i, slot, rids))
                    continue
                ends[state.value] += 1
                late = t.finished_at - (t.started_at + DEADLINE_S)  # type: ignore[attr-defined]
                worst_late = max(worst_late, late)
                lids = np.array([2 * slot, 2 * slot + 1])
                if state is RequestState.DONE:
                    wrong += verify(ranks, procs[i].remote_spec(), lids, rids)
                for _, bufs in ranks:  # zero the blocks before they are reused
                    n = ranks[0][0].kernel_block_bytes
                    for b in bufs:
                        b[2 * slot * n : (2 * slot + 2) * n] = 0
                parked.append((t, slot))
            live = still
            keep = []
            for t, slot in parked:
                if t.quarantined:  # type: ignore[attr-defined]
                    keep.append((t, slot))
                else:
                    free_slots.append(slot)
            parked = keep
            time.sleep(0.001)
        for i, p in enumerate(procs):
            if stopped_until[i]:
                p.signal(signal.SIGCONT)
        end_stats = [p.wait_free(8) if ready[i] else None for i, p in enumerate(procs)]
        held = [s["held_blocks"] if s else 0 for s in end_stats]
        prod_unauth = sum(s["num_unauthenticated"] for s in end_stats if s)
        cons_unauth = forger_unauth_at_consumer + cons.ranks[0].backend.num_unauthenticated
        handles = sum(len(c.backend._xfers) for c in cons.ranks.values())
        rss1 = _rss_mb()
        print(f"\n[measure] soak: {started} requests over {NUM_PRODUCERS} producers: {dict(ends)}; "
              f"wrong bytes DONE {wrong:.0f}; worst lateness {worst_late * 1e3:.1f} ms; "
              f"held after {held}; handles {handles}; rejected notices {cons.num_rejected}; "
              f"RSS {rss0:.0f} -> {rss1:.0f} MB; faults {dict(faults)}; dropped unauthenticated: "
              f"consumer {cons_unauth}, live producers {prod_unauth}")  # fmt: skip
        assert wrong == 0
        assert sum(ends.values()) == started
        assert ends["done"] > started // 3
        assert worst_late < LATE_S
        assert held == [0] * NUM_PRODUCERS
        assert handles == 0
        if keyed:  # every forged notice was dropped before the engines saw it
            assert faults["forged to producers"] > 0 and prod_unauth > 0
            assert cons_unauth > 0
        else:
            assert cons_unauth == prod_unauth == 0
    finally:
        for i, p in enumerate(procs):
            if stopped_until[i]:
                p.signal(signal.SIGCONT)
            p.close()
        cons.close()
        forger.close()
