"""The vLLM connector's transfer statistics (pure; no vLLM import).

vLLM asks each worker's connector for its stats after every step, carries the dict
(``KVConnectorStats.data``) to its logger process, merges the workers' and the steps'
dicts, logs a summary every interval (``KV Transfer metrics: ...``) and feeds its
Prometheus metrics. This module is that dict: :class:`StatsTally` fills it on the
worker (owned by vLLM's worker thread, like the rest of the worker side), :func:`merge`
and :func:`summary` are what the connector's stats class does with it.

Keys: ``loads_<end state>`` (``done``, ``failed``, ``timeout``, ``peer_lost``,
``aborted``, ``other``): the decode's loads by how they ended; ``load_bytes``: bytes
of DONE loads; ``load_s``: DONE loads' durations (start to end, seconds);
``first_contacts`` / ``first_contact_s``: producers a load waited to contact, and how
long each contact took; ``released_<reason>`` (``read``, ``aborted``, ``expired``,
``other``): the prefill's holds released, by why. Sample lists keep the newest
:data:`MAX_SAMPLES`; counters are exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_SAMPLES", "StatsTally", "empty", "is_empty", "merge", "summary"]

MAX_SAMPLES = 4096  # per sample list and interval: a stalled logger costs bounded memory
LOAD_ENDS = ("done", "failed", "timeout", "peer_lost", "aborted", "other")
RELEASES = ("read", "aborted", "expired", "other")
COUNTERS = (
    *(f"loads_{s}" for s in LOAD_ENDS),
    "load_bytes",
    "first_contacts",
    *(f"released_{r}" for r in RELEASES),
)
SAMPLES = ("load_s", "first_contact_s")


def empty() -> dict[str, Any]:
    """A dict with every key at zero."""
    return {**dict.fromkeys(COUNTERS, 0), **{k: [] for k in SAMPLES}}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _samples(value: Any) -> list[float]:
    if not isinstance(value, list | tuple):
        return []
    return [float(v) for v in value if isinstance(v, int | float) and not isinstance(v, bool)]


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: counters summed, sample lists joined (the newest ``MAX_SAMPLES``).

    Either side may come from another kvxfer version: a missing key counts as zero, an
    unknown key or a value of the wrong type is left out (stats never fail a step).
    """
    out = empty()
    for k in COUNTERS:
        out[k] = _count(a.get(k)) + _count(b.get(k))
    for k in SAMPLES:
        out[k] = (_samples(a.get(k)) + _samples(b.get(k)))[-MAX_SAMPLES:]
    return out


def is_empty(d: Mapping[str, Any]) -> bool:
    """True if nothing was counted."""
    return not any(_count(d.get(k)) for k in COUNTERS)


def _ms(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank, lower) of ``values``, in ms."""
    ordered = sorted(values)
    return round(ordered[max(0, int(q * len(ordered) + 0.5) - 1)] * 1e3, 3)


def summary(d: Mapping[str, Any]) -> dict[str, int | float]:
    """What vLLM logs for an interval: loads and failed loads, MiB moved, DONE loads'
    mean / p50 / p90 / max duration (ms), first contacts and their mean (ms), and the
    prefill's releases by reason. Durations are left out when there were none."""
    d = merge(empty(), d)
    loads = sum(d[f"loads_{s}"] for s in LOAD_ENDS)
    out: dict[str, int | float] = {
        "loads": loads,
        "failed_loads": loads - d["loads_done"],
        "load_MiB": round(d["load_bytes"] / 2**20, 3),
    }
    if times := d["load_s"]:
        out["avg_load_ms"] = round(sum(times) / len(times) * 1e3, 3)
        out["p50_load_ms"], out["p90_load_ms"] = _ms(times, 0.5), _ms(times, 0.9)
        out["max_load_ms"] = round(max(times) * 1e3, 3)
    out["first_contacts"] = d["first_contacts"]
    if contacts := d["first_contact_s"]:
        out["avg_first_contact_ms"] = round(sum(contacts) / len(contacts) * 1e3, 3)
    for r in RELEASES:
        if d[f"released_{r}"]:
            out[f"released_{r}"] = d[f"released_{r}"]
    return out


class StatsTally:
    """What one worker counts between two of vLLM's stats calls (one owner thread)."""

    def __init__(self) -> None:
        self._data = empty()

    def record_load(self, state: str, seconds: float, nbytes: int) -> None:
        """One load that ended in ``state`` (a :class:`~kvxfer.engine.RequestState` value)."""
        key = f"loads_{state}" if state in LOAD_ENDS else "loads_other"
        self._data[key] += 1
        if state == "done":
            self._data["load_bytes"] += max(0, nbytes)
            self._add("load_s", seconds)

    def record_contact(self, seconds: float) -> None:
        """One first contact a load waited for."""
        self._data["first_contacts"] += 1
        self._add("first_contact_s", seconds)

    def record_release(self, reason: str) -> None:
        """One hold released (a :class:`~kvxfer.engine.leases.FreeReason` value)."""
        key = f"released_{reason}" if reason in RELEASES else "released_other"
        self._data[key] += 1

    def _add(self, key: str, seconds: float) -> None:
        samples: list[float] = self._data[key]
        samples.append(max(0.0, float(seconds)))
        if len(samples) > MAX_SAMPLES:
            del samples[0]

    def take(self) -> dict[str, Any] | None:
        """The counts since the last call (None when nothing happened), and start over."""
        if is_empty(self._data):
            return None
        out, self._data = self._data, empty()
        return out
