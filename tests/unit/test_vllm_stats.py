"""The vLLM connector's transfer statistics (pure): the worker's tally, and the merge
and summary vLLM's stats path applies to the dicts it carries."""

from __future__ import annotations

import pytest

from kvxfer.integrations.vllm.stats import MAX_SAMPLES, StatsTally, empty, is_empty, merge, summary


def test_a_tally_counts_loads_contacts_and_releases_then_starts_over() -> None:
    t = StatsTally()
    assert t.take() is None  # nothing happened: vLLM gets no stats object
    t.record_load("done", 0.010, 4096)
    t.record_load("done", 0.030, 1024)
    t.record_load("timeout", 5.0, 0)
    t.record_load("peer_lost", 0.2, 0)
    t.record_contact(0.004)
    t.record_release("read")
    t.record_release("expired")
    d = t.take()
    assert d is not None
    assert (d["loads_done"], d["loads_timeout"], d["loads_peer_lost"], d["loads_failed"]) == (
        2,
        1,
        1,
        0,
    )
    assert d["load_bytes"] == 5120
    assert d["load_s"] == [0.010, 0.030]  # the durations of DONE loads only
    assert (d["first_contacts"], d["first_contact_s"]) == (1, [0.004])
    assert (d["released_read"], d["released_expired"], d["released_aborted"]) == (1, 1, 0)
    assert t.take() is None


def test_an_unknown_state_or_reason_is_counted_as_other() -> None:
    t = StatsTally()
    t.record_load("exploded", 1.0, 0)
    t.record_release("weird")
    d = t.take()
    assert d is not None and d["loads_other"] == 1 and d["released_other"] == 1


def test_merge_sums_counters_and_joins_samples_keeping_the_newest() -> None:
    a, b = empty(), empty()
    a["loads_done"], b["loads_done"] = 2, 3
    a["load_bytes"], b["load_bytes"] = 10, 5
    a["load_s"] = [1.0] * (MAX_SAMPLES - 1)
    b["load_s"] = [2.0, 3.0]
    m = merge(a, b)
    assert m["loads_done"] == 5 and m["load_bytes"] == 15
    assert len(m["load_s"]) == MAX_SAMPLES and m["load_s"][-2:] == [2.0, 3.0]
    assert a["loads_done"] == 2 and len(a["load_s"]) == MAX_SAMPLES - 1  # inputs untouched


def test_merge_takes_a_partial_or_foreign_dict_without_failing() -> None:
    # another kvxfer version's worker may send fewer or more keys, or odd values
    m = merge(empty(), {"loads_done": 4, "new_key": 9, "load_s": [0.5, "x"], "load_bytes": "7"})
    assert m["loads_done"] == 4 and "new_key" not in m
    assert m["load_s"] == [0.5] and m["load_bytes"] == 0


def test_summary_of_an_interval() -> None:
    d = empty()
    d.update(loads_done=10, loads_timeout=1, loads_failed=1, load_bytes=3 * 2**20,
             load_s=[i / 1000 for i in range(1, 11)], first_contacts=2,
             first_contact_s=[0.004, 0.006], released_read=9, released_expired=1)  # fmt: skip
    s = summary(d)
    assert s["loads"] == 12 and s["failed_loads"] == 2
    assert s["load_MiB"] == 3.0
    assert s["avg_load_ms"] == pytest.approx(5.5)
    assert s["p50_load_ms"] == pytest.approx(5.0) and s["p90_load_ms"] == pytest.approx(9.0)
    assert s["max_load_ms"] == pytest.approx(10.0)
    assert s["first_contacts"] == 2 and s["avg_first_contact_ms"] == pytest.approx(5.0)
    assert (s["released_read"], s["released_expired"]) == (9, 1)
    assert all(isinstance(v, int | float) for v in s.values())


def test_summary_without_samples_and_emptiness() -> None:
    assert is_empty(empty())
    d = empty()
    d["released_read"] = 1  # a prefill: it only releases holds
    assert not is_empty(d)
    s = summary(d)
    assert s["loads"] == 0 and "avg_load_ms" not in s and s["released_read"] == 1
