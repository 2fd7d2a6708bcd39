"""The coalescing experiment of ``kvxfer bench per-request`` (pure).

:func:`coalesced_rows` prepares extra strided rows of run-width descriptors (``2^k``
blocks) so that a contiguous run of ``n`` blocks is sent as ``popcount(n)`` descriptors
per view instead of ``n``; :func:`coalesced_ids` maps a request onto them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.planning.descriptors import COUNT, LEN, STRIDE
from kvxfer.planning.plans import SourcePlan
from kvxfer.planning.request import expand_ids

__all__ = ["coalesced_ids", "coalesced_rows"]

I64 = npt.NDArray[np.int64]


def _coalescible(src: SourcePlan) -> bool:
    """Every row dense on both sides (stride == len): neighbouring blocks touch."""
    return bool(
        np.all(src.local_rows[:, STRIDE] == src.local_rows[:, LEN])
        and np.all(src.remote_rows[:, STRIDE] == src.remote_rows[:, LEN])
    )


def coalesced_rows(rows: np.ndarray, max_log2: int) -> tuple[np.ndarray, I64]:
    """Strided rows of run-width descriptors over dense ``rows`` (stride == len).

    NIXL refuses strided rows whose ``len`` exceeds their ``stride`` (overlapping
    descriptors), so a width of ``2^w`` blocks is prepared as ``2^w`` phase rows: phase
    ``j`` = ``(addr + j * len, len * 2^w, dev, len * 2^w, (count - j) >> w)``; its
    descriptor ``m`` covers blocks ``j + m * 2^w .. j + m * 2^w + 2^w - 1``.

    Args:
        rows: ``(N, 5) uint64`` dense rows.
        max_log2: widest run in blocks is ``2^max_log2`` (capped so every row has a
            descriptor: ``2^(K+1) <= min count``).

    Returns:
        ``((2^(K+1) - 1) * N, 5) uint64`` rows ordered (width, phase, view), and a
        ``(K+1, 2^K, N) int64`` table: flat index of descriptor 0 of each (w, j, v)
        (entries with ``j >= 2^w`` are unused).
    """
    k_max = min(max_log2, int(np.log2(int(rows[:, COUNT].min()))) - 1)
    k_max = max(k_max, 0)
    parts = []
    for w in range(k_max + 1):
        phase = np.arange(1 << w, dtype=np.uint64)[:, None]  # (2^w, 1) broadcast over views
        r = np.broadcast_to(rows, (1 << w, *rows.shape)).copy()  # (2^w, N, 5)
        r[:, :, 0] += phase * rows[:, LEN]
        r[:, :, LEN] = rows[:, LEN] << np.uint64(w)
        r[:, :, STRIDE] = r[:, :, LEN]
        r[:, :, COUNT] = (rows[:, COUNT] - phase) >> np.uint64(w)
        parts.append(r.reshape(-1, 5))
    out = np.ascontiguousarray(np.concatenate(parts))  # ((2^(K+1) - 1) * N, 5)
    flat = np.zeros(out.shape[0] + 1, dtype=np.int64)
    np.cumsum(out[:, COUNT], out=flat[1:])
    n = rows.shape[0]
    table = np.zeros((k_max + 1, 1 << k_max, n), dtype=np.int64)
    at = 0
    for w in range(k_max + 1):
        table[w, : 1 << w] = flat[at : at + (n << w)].reshape(1 << w, n)
        at += n << w
    return out, table


def _chunks(lk: I64, rk: I64, k_max: int) -> tuple[I64, I64, I64]:
    """Split id pairs into runs contiguous on both sides, runs into power-of-two chunks.

    Returns ``(width_log2, local_block, remote_block)`` per chunk, ``(C,)`` each.
    """
    brk = np.flatnonzero((np.diff(lk) != 1) | (np.diff(rk) != 1)) + 1
    first = np.concatenate(([0], brk))  # (R,) run starts
    n = np.diff(np.concatenate((first, [lk.size])))  # (R,) run lengths
    full = n >> k_max  # chunks of the widest width per run
    rem = n & ((1 << k_max) - 1)
    run_of = np.repeat(np.arange(first.size), full)
    rank_in = np.arange(run_of.size) - np.repeat(np.cumsum(full) - full, full)
    ws, offs, runs = [np.full(run_of.size, k_max)], [rank_in << k_max], [run_of]
    for w in range(k_max - 1, -1, -1):  # one chunk per set bit, high bits first
        sel = np.flatnonzero((rem >> w) & 1)
        ws.append(np.full(sel.size, w))
        offs.append((full[sel] << k_max) + (rem[sel] & ~((2 << w) - 1)))
        runs.append(sel)
    w_c, off, run = (np.concatenate(x).astype(np.int64) for x in (ws, offs, runs))
    pos = first[run] + off  # (C,) position of the chunk's first block in the request
    return w_c, lk[pos], rk[pos]


def coalesced_ids(
    l_table: I64, r_table: I64, lids: I64, rids: I64, ppl: int = 1
) -> tuple[I64, I64]:
    """Descriptor ids of one request against :func:`coalesced_rows` lists (both sides).

    Returns ``(C * N,)`` local and remote ids: a chunk of ``2^w`` blocks starting at block
    ``b`` of view ``v`` is descriptor ``table[w, b mod 2^w, v] + b >> w``.
    """
    lk, rk = expand_ids(lids, ppl), expand_ids(rids, ppl)
    w, lb, rb = _chunks(lk, rk, l_table.shape[0] - 1)
    mask = (1 << w) - 1
    loc = l_table[w, lb & mask, :] + (lb >> w)[:, None]  # (C, N): chunk x view
    rem = r_table[w, rb & mask, :] + (rb >> w)[:, None]
    return loc.ravel(), rem.ravel()
