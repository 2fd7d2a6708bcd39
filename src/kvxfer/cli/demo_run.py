"""``kvxfer demo``: a producer and a consumer process move KV blocks and verify every byte.

The parent is the "router": it draws each request's block ids on both sides (seeded),
tells the producer to hold them, and hands the stream to the consumer. The producer
fills its cache with a pattern encoding (layer, block, head, token, byte); the
consumer reads every request over NIXL and checks every byte it received.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
from kvxfer.errors import ConfigError, IncompatibleError, KvxferError
from kvxfer.layout.presets import spec_for
from kvxfer.layout.spec import AttnKind, LayoutSpec
from kvxfer.testing.pattern import fill, mismatches

__all__ = ["DemoOptions", "run_demo"]


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What the demo moves. Block ids are drawn from pools of ``num_blocks`` blocks."""

    preset: str = "tiny-gqa"
    kind: str | None = None  # override the preset's attention layout (an AttnKind value)
    producer_tp: int = 1
    consumer_tp: int = 2
    producer_block_size: int | None = None
    consumer_block_size: int | None = None
    num_blocks: int = 256
    num_requests: int = 64
    blocks_per_request: int = 8
    inflight: int = 4
    seed: int = 0
    strided: bool = True
    write: bool = False  # push mode: the producer WRITEs into the consumer's blocks
    deadline_s: float = 30.0
    timeout_s: float = 120.0

    def spec(self, side: str, rank: int = 0) -> LayoutSpec:
        tp = self.producer_tp if side == "p" else self.consumer_tp
        bs = self.producer_block_size if side == "p" else self.consumer_block_size
        nb = self.num_blocks if side == "p" else self.num_blocks * self.bsr
        kind = AttnKind(self.kind) if self.kind else None
        return spec_for(
            self.preset, tp_rank=rank, tp_size=tp, num_blocks=nb, block_size=bs, kind=kind
        )

    def check(self) -> None:
        """Raise ConfigError naming the first option (as ``kvxfer demo`` spells it) that
        the demo cannot run with; the shapes are checked by :meth:`spec`."""
        for flag, value in (("--requests", self.num_requests), ("--inflight", self.inflight),
                            ("--num-blocks", self.num_blocks)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value!r}")
        # a request's remote ids are drawn without repeats from the attention blocks:
        # all of them, or the low half of a hybrid pool (state pages use the high half)
        pool = self.num_blocks // 2 if self.is_hybrid else self.num_blocks
        n = self.blocks_per_request
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= pool:
            raise ConfigError(f"--blocks-per-request must be in [1, {pool}], got {n!r}")

    @property
    def bsr(self) -> int:
        p = self.producer_block_size or 0
        c = self.consumer_block_size or 0
        return c // p if p and c and c > p else 1

    @property
    def is_hybrid(self) -> bool:
        return self.spec("p").state is not None


def _requests(o: DemoOptions) -> list[dict[str, Any]]:
    """Seeded remote block ids: hybrids keep attention in the low half, state in the high half.

    Local ids are drawn later by the consumer from its free blocks (like an allocator):
    requests in flight at once never share a local block.
    """
    rng = np.random.default_rng(o.seed)
    p_nb = o.spec("p").num_blocks
    half_p = p_nb // 2 if o.is_hybrid else p_nb
    out = []
    for i in range(o.num_requests):
        r: dict[str, Any] = {
            "request_id": f"req-{i}",
            "remote_block_ids": rng.choice(half_p, o.blocks_per_request, replace=False),
        }
        if o.is_hybrid:
            r["remote_state_ids"] = half_p + rng.choice(p_nb - half_p, 1, replace=False)
        out.append(r)
    return out


class _FreeBlocks:
    """A seeded allocator over the consumer's pool (attention low half / state high half)."""

    def __init__(self, o: DemoOptions) -> None:
        nb = o.spec("d").num_blocks
        half = nb // 2 if o.is_hybrid else nb
        self.rng = np.random.default_rng(o.seed + 1)
        self.attn, self.state = set(range(half)), set(range(half, nb))
        self.n_local = -(-o.blocks_per_request // o.bsr)
        self.is_hybrid = o.is_hybrid

    def can_allocate(self) -> bool:
        return len(self.attn) >= self.n_local and (not self.is_hybrid or bool(self.state))

    def allocate(self, r: dict[str, Any]) -> dict[str, Any]:
        ids = self.rng.choice(sorted(self.attn), self.n_local, replace=False)
        self.attn -= set(ids.tolist())
        r = {**r, "local_block_ids": ids}
        if self.is_hybrid:
            sid = self.rng.choice(sorted(self.state), 1)
            self.state -= set(sid.tolist())
            r["local_state_ids"] = sid
        return r

    def free(self, r: dict[str, Any]) -> None:
        self.attn |= set(r["local_block_ids"].tolist())
        if "local_state_ids" in r:
            self.state |= set(r["local_state_ids"].tolist())


def _producer_main(o: DemoOptions, conn: Connection) -> None:
    from kvxfer.engine.producer import Producer

    ranks = []
    for p in range(o.producer_tp):
        spec = o.spec("p", p)
        bufs = allocate_cache(spec)
        nb = spec.num_blocks
        fill(spec, bufs, np.arange(nb // 2, nb) if spec.state is not None else None)
        ranks.append((spec, bufs))
    with Producer(EngineConfig("demo-p", model_name=o.preset, strided=o.strided), ranks) as prod:
        conn.send(("address", prod.address))
        freed = 0
        while True:
            cmd = conn.recv()
            if cmd[0] == "hold":
                for rid, n in cmd[1]:
                    prod.hold(rid, n)
            elif cmd[0] == "stop":
                deadline = time.monotonic() + 5
                while prod.held_blocks and time.monotonic() < deadline:
                    time.sleep(0.01)
                freed += len(prod.pop_freed())
                conn.send(("stats", {"freed": freed, "held_blocks": prod.held_blocks}))
                return


def _consumer_main(
    o: DemoOptions, address: str, reqs: list[dict[str, Any]], conn: Connection
) -> None:
    try:
        _consume(o, address, reqs, conn)
    except Exception as e:  # report to the parent instead of dying with a traceback
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _consume(o: DemoOptions, address: str, reqs: list[dict[str, Any]], conn: Connection) -> None:
    from kvxfer.engine.consumer import Consumer

    ranks = [(o.spec("d", d), allocate_cache(o.spec("d", d))) for d in range(o.consumer_tp)]
    remote = o.spec("p")
    cfg = EngineConfig("demo-d", model_name=o.preset, strided=o.strided, deadline_s=o.deadline_s)
    with Consumer(cfg, ranks) as cons:
        todo = list(reqs)
        pool = _FreeBlocks(o)
        wall = 0.0
        while todo:
            # one window: launch, poll tightly until all end (timed), then verify (untimed)
            window: list[dict[str, Any]] = []
            while todo and len(window) < o.inflight and pool.can_allocate():
                window.append(pool.allocate(todo.pop(0)))
            t0 = time.perf_counter()
            start = cons.push if o.write else cons.read
            xfers = [start(address=address, **r) for r in window]
            while not all(t.poll().is_terminal for t in xfers):
                pass
            wall += time.perf_counter() - t0
            for t in xfers:  # an incompatible peer fails every request alike: stop here
                if isinstance(t.error, IncompatibleError):
                    raise t.error
            for r, t in zip(window, xfers, strict=True):
                kw = {k: r[k] for k in ("local_state_ids", "remote_state_ids") if k in r}
                bad = sum(
                    mismatches(spec, bufs, remote, r["local_block_ids"], r["remote_block_ids"], **kw)
                    for spec, bufs in ranks
                ) if t.state is RequestState.DONE else -1  # fmt: skip
                conn.send(("done", r["request_id"], t.state.value, str(t.error or ""), t.latency_s,
                           t.num_descriptors, t.num_bytes, bad))  # fmt: skip
                pool.free(r)
        # the summary reads the engine's own statistics snapshot
        stats = cons.stats()
        fc = next(f for f in stats.first_contacts if f.address == address)
        conn.send(("end", wall, dict(fc.phases_s), fc.num_rows, fc.num_descriptors,
                   dict(stats.requests), stats.bytes_moved))  # fmt: skip


def run_demo(o: DemoOptions, progress: Any = None) -> dict[str, Any]:
    """Run the demo; return the summary (``verify_ok`` says whether every byte matched).

    Args:
        o: what to move.
        progress: optional callable ``(done, total)`` for a progress bar.

    Raises:
        ConfigError: an option the demo cannot run with (before any process starts).
    """
    o.check()
    ctx = mp.get_context("spawn")
    reqs = _requests(o)
    p_conn, p_child = ctx.Pipe()
    producer = ctx.Process(target=_producer_main, args=(o, p_child), name="kvxfer-demo-producer")
    producer.start()
    consumer = None
    try:
        if not p_conn.poll(o.timeout_s):
            raise TimeoutError("producer did not start")
        _, address = p_conn.recv()
        p_conn.send(("hold", [(r["request_id"], len(r["remote_block_ids"])) for r in reqs]))
        c_conn, c_child = ctx.Pipe()
        consumer = ctx.Process(
            target=_consumer_main, args=(o, address, reqs, c_child), name="kvxfer-demo-consumer"
        )
        consumer.start()
        results, end = [], None
        deadline = time.monotonic() + o.timeout_s
        while end is None:
            while not c_conn.poll(0.1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"demo did not finish within {o.timeout_s} s")
                if not consumer.is_alive() and not c_conn.poll(0):
                    raise KvxferError(f"consumer process exited with code {consumer.exitcode}")
            msg = c_conn.recv()
            if msg[0] == "error":
                raise KvxferError(f"consumer: {msg[1]}")
            if msg[0] == "done":
                results.append(msg[1:])
                if progress is not None:
                    progress(len(results), len(reqs))
            else:
                end = msg[1:]
        p_conn.send(("stop",))
        pstats = p_conn.recv() if p_conn.poll(10) else {}
        pstats = pstats[1] if pstats else {}
    finally:
        for proc in (consumer, producer):
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    return _summary(o, results, end, pstats)


def _summary(
    o: DemoOptions, results: list[tuple[Any, ...]], end: tuple[Any, ...], pstats: dict[str, Any]
) -> dict[str, Any]:
    wall, timings, num_rows, num_desc, by_state, moved = end
    # the first window waits for first contact: its latencies are reported apart
    warm = results[o.inflight :] or results
    lat = np.array([r[3] for r in warm] or [0.0]) * 1e3
    ok = [r for r in results if r[1] == "done"]
    bad = sum(r[6] for r in ok)
    total_bytes = int(moved)  # the consumer's stats(): bytes of requests that ended DONE
    return {
        "options": asdict(o),
        "requests": len(results),
        "requests_by_state": by_state,
        "done": len(ok),
        "failed": [(r[0], r[1], r[2]) for r in results if r[1] != "done"],
        "first_contact_ms": {k: v * 1e3 for k, v in timings.items()}
        | {"total": sum(timings.values()) * 1e3},
        "first_request_ms": results[0][3] * 1e3 if results else 0.0,
        "strided_rows": num_rows,
        "dense_descriptors": num_desc,
        "descriptors_per_request": float(np.mean([r[4] for r in ok])) if ok else 0.0,
        "bytes": total_bytes,
        "gb_per_s": total_bytes / wall / 1e9 if wall else 0.0,
        "latency_ms_p50": float(np.percentile(lat, 50)),
        "latency_ms_p99": float(np.percentile(lat, 99)),
        "bad_bytes": bad,
        "producer": pstats,
        "verify_ok": bad == 0 and len(ok) == len(results) == o.num_requests,
    }
