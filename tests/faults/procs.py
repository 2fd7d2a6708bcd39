"""Fault-test helpers: producer engines in spawned processes, the consumer in this one.

A :class:`ProducerProc` runs :class:`kvxfer.engine.producer.Producer` in a process started
with ``multiprocessing`` 'spawn'. It fills its cache (byte pattern by default), sends
back its side-channel address and generation over a Pipe, then obeys commands:
``hold`` (acknowledged, so a ReadDone never races its hold), ``stats``, ``wait_free``
and ``stop``. The test can SIGKILL, SIGSTOP and SIGCONT it. Every wait is bounded.

The consumer runs in the test process (:func:`make_consumer`); :func:`verify` counts
mismatching bytes of a received request with :func:`kvxfer.testing.pattern.mismatches`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
from kvxfer.layout.presets import spec_for
from kvxfer.layout.spec import LayoutSpec
from kvxfer.testing.pattern import mismatches
from tests.engines import free_port

START_TIMEOUT_S = 60.0  # spawn + import nixl + fill + agent creation, on a busy 2-core box
REPLY_TIMEOUT_S = 20.0
MODEL = "model"  # model_name on both sides (in the compat hash)


def spec(preset: str, num_blocks: int, tp_rank: int = 0, tp_size: int = 1) -> LayoutSpec:
    return spec_for(preset, tp_rank=tp_rank, tp_size=tp_size, num_blocks=num_blocks)


# ------------------------------------------------------------------ producer process


def _stats(prod: Any, freed: Counter[str]) -> dict[str, Any]:
    for _, reason in prod.pop_freed():
        freed[reason.value] += 1
    return {
        "held_blocks": prod.held_blocks,
        "freed": sum(freed.values()),
        "freed_by_reason": dict(freed),
        "num_rejected": prod.num_rejected,
        "num_unknown_acks": sum(t.num_unknown_acks for t in prod._tables.values()),
        "server_rejected": prod.server.num_rejected,
        "server_served": prod.server.num_served,
        "num_unauthenticated": sum(
            getattr(r.backend, "num_unauthenticated", 0) for r in prod.ranks
        ),
        "thread_alive": prod._thread.is_alive(),
        "generation": prod.generation,
    }


def _producer_main(conn: Connection, opts: dict[str, Any]) -> None:
    from kvxfer.engine.producer import Producer
    from kvxfer.testing.pattern import fill

    ranks = []
    for p in opts["ranks"] if opts.get("ranks") is not None else range(opts["tp"]):
        s = spec(opts["preset"], opts["num_blocks"], p, opts["tp"])
        bufs = allocate_cache(s)
        if opts["fill"] == "pattern":
            fill(s, bufs)
        elif opts["fill"] == "const":
            for b in bufs:
                b[:] = 0xAB
        ranks.append((s, bufs))
    cfg = EngineConfig(
        opts["engine_id"],
        side_channel_addr=opts["address"],
        model_name=MODEL,
        lease_s=opts["lease_s"],
        auth_key=opts.get("auth_key"),
    )
    freed: Counter[str] = Counter()
    with Producer(cfg, ranks) as prod:
        conn.send(("ready", prod.address, prod.generation, prod.ranks[0].backend.name))
        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # the test process went away
                return
            op = cmd[0]
            if op == "hold":
                leases = [prod.hold(rid, n, cmd[2]) for rid, n in cmd[1]]
                conn.send(("ok", [x.expires_at_ns for x in leases], [x.ticket for x in leases]))
            elif op == "stats":
                conn.send(("stats", _stats(prod, freed)))
            elif op in ("wait_free", "stop"):
                until = time.monotonic() + cmd[1]
                while prod.held_blocks and time.monotonic() < until:
                    time.sleep(0.005)
                time.sleep(0.002)  # let the engine thread move the last release to pop_freed
                conn.send(("stats", _stats(prod, freed)))
                if op == "stop":
                    return


class ProducerProc:
    """A producer engine in a spawned process; see the module docstring.

    Args:
        preset, num_blocks, tp: what each rank's pool looks like.
        address: side-channel endpoint to bind (port 0: any free port).
        fill: "pattern" (verifiable bytes), "const" (0xAB everywhere) or "none" (zeros).
        lease_s: default lease on held requests.
        auth_key: deployment key of the producer (None: unkeyed).
    """

    def __init__(
        self,
        *,
        preset: str = "tiny-gqa",
        num_blocks: int = 64,
        tp: int = 1,
        address: str = "tcp://127.0.0.1:0",
        engine_id: str = "prefill",
        fill: str = "pattern",
        lease_s: float = 60.0,
        ranks: Sequence[int] | None = None,
        auth_key: bytes | None = None,
    ) -> None:
        self.opts = dict(
            preset=preset, num_blocks=num_blocks, tp=tp, address=address,
            engine_id=engine_id, fill=fill, lease_s=lease_s,
            ranks=None if ranks is None else list(ranks), auth_key=auth_key,
        )  # fmt: skip
        self.preset, self.num_blocks, self.tp = preset, num_blocks, tp
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, self.opts), daemon=True)
        self.address = ""
        self.generation = 0
        self.agent_name = ""
        self.tickets: dict[str, int] = {}  # held request -> its hold ticket

    def launch(self) -> ProducerProc:
        self.proc.start()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> ProducerProc:
        _, self.address, self.generation, self.agent_name = self._reply(timeout_s, "ready")
        return self

    def start(self) -> ProducerProc:
        return self.launch().wait_ready()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def remote_spec(self) -> LayoutSpec:
        return spec(self.preset, self.num_blocks, 0, self.tp)

    def _reply(self, timeout_s: float, want: str) -> tuple[Any, ...]:
        until = time.monotonic() + timeout_s
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise RuntimeError(f"producer {self.pid} exited with {self.proc.exitcode}")
            if time.monotonic() > until:
                raise TimeoutError(f"producer {self.pid}: no {want!r} reply in {timeout_s} s")
        msg: tuple[Any, ...] = self.conn.recv()
        assert msg[0] == want, msg
        return msg

    def hold(self, items: Iterable[tuple[str, int]], lease_s: float | None = None) -> list[Any]:
        """Hold requests ``(request_id, num_blocks)``; returns once the producer did, with
        each lease's end (``Lease.expires_at_ns``, producer wall clock); each hold's
        ticket goes to :attr:`tickets`."""
        items = list(items)
        self.conn.send(("hold", items, lease_s))
        reply = self._reply(REPLY_TIMEOUT_S, "ok")
        self.tickets.update(zip((rid for rid, _ in items), reply[2], strict=True))
        return list(reply[1])

    def stats(self) -> dict[str, Any]:
        self.conn.send(("stats",))
        return dict(self._reply(REPLY_TIMEOUT_S, "stats")[1])

    def wait_free(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Wait (bounded) until nothing is held; return the stats."""
        self.conn.send(("wait_free", timeout_s))
        return dict(self._reply(timeout_s + REPLY_TIMEOUT_S, "stats")[1])

    def stop(self, timeout_s: float = 5.0) -> dict[str, Any]:
        self.conn.send(("stop", timeout_s))
        out = dict(self._reply(timeout_s + REPLY_TIMEOUT_S, "stats")[1])
        self.proc.join(10)
        return out

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop_process(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP and wait (bounded) until the kernel reports the process stopped."""
        self.signal(signal.SIGSTOP)
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            with open(f"/proc/{self.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.001)
        raise TimeoutError(f"producer {self.pid} did not stop")

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.signal(signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        """Kill if still running (a stopped process is continued so it can die)."""
        if self.proc.pid is None:
            return
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
            os.kill(self.pid, signal.SIGCONT)
            self.proc.join(10)
        self.conn.close()


def start_all(procs: Sequence[ProducerProc]) -> list[ProducerProc]:
    """Launch every producer, then wait for each (they start in parallel)."""
    for p in procs:
        p.launch()
    return [p.wait_ready() for p in procs]


# ------------------------------------------------------------------ consumer (this process)


def make_consumer(
    preset: str,
    num_blocks: int,
    *,
    tp: int = 1,
    engine_id: str = "decode",
    deadline_s: float = 30.0,
    handshake_timeout_s: float = 5.0,
    heartbeat_s: float = 1.0,
    silence_s: float = 0.0,
    side_channel_addr: str = "tcp://127.0.0.1:0",
    auth_key: bytes | None = None,
) -> tuple[Any, list[tuple[LayoutSpec, list[Any]]]]:
    """A :class:`kvxfer.engine.consumer.Consumer` over zeroed buffers; returns it and its ranks."""
    from kvxfer.engine.consumer import Consumer

    ranks = []
    for d in range(tp):
        s = spec(preset, num_blocks, d, tp)
        ranks.append((s, allocate_cache(s)))
    cfg = EngineConfig(
        engine_id,
        model_name=MODEL,
        deadline_s=deadline_s,
        handshake_timeout_s=handshake_timeout_s,
        heartbeat_s=heartbeat_s,
        silence_s=silence_s,
        side_channel_addr=side_channel_addr,
        auth_key=auth_key,
    )
    return Consumer(cfg, ranks), ranks


def verify(
    ranks: Sequence[tuple[LayoutSpec, Sequence[Any]]],
    remote: LayoutSpec,
    local_ids: Any,
    remote_ids: Any,
) -> int:
    """Mismatching bytes of a received request over every local rank (0: byte-exact)."""
    return sum(mismatches(s, bufs, remote, local_ids, remote_ids) for s, bufs in ranks)


def clear(ranks: Sequence[tuple[LayoutSpec, Sequence[Any]]]) -> None:
    for _, bufs in ranks:
        for b in bufs:
            b[:] = 0


def wait_all(transfers: Sequence[Any], timeout_s: float) -> float:
    """Poll until every transfer is terminal or ``timeout_s``; return the seconds taken."""
    t0 = time.monotonic()
    pending = list(transfers)
    while pending and time.monotonic() - t0 < timeout_s:
        pending = [t for t in pending if not t.poll().is_terminal]
        if pending:
            time.sleep(0.0005)
    return time.monotonic() - t0


def states(transfers: Iterable[Any]) -> Counter[str]:
    return Counter(t.state.value for t in transfers)


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


__all__ = [
    "ProducerProc",
    "RequestState",
    "clear",
    "free_port",
    "ids",
    "make_consumer",
    "spec",
    "start_all",
    "states",
    "verify",
    "wait_all",
]
