"""The connector's pure parts: kv_transfer_params round trip and refusal, and the
scheduler side's token matching, block pairing and hold bookkeeping."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from kvxfer.errors import ProtocolError
from kvxfer.integrations.vllm.params import (
    RemotePrefill,
    compose_params,
    parse_params,
    prompt_context,
    prompt_hash,
)
from kvxfer.integrations.vllm.scheduler import ProducerRank, SchedulerSide

PROMPT = list(range(1000, 1070))  # the prompt REMOTE's prefill computed (70 tokens)
REMOTE = RemotePrefill(
    engine_id="prefill-0",
    request_id="cmpl-7",
    address="tcp://127.0.0.1:5601,tcp://127.0.0.1:5602",
    generations=(2**63 - 5, 17),
    block_ids=(9, 4, 11),
    block_size=32,
    tp_size=2,
    num_tokens=70,
    lease_expires_at_ms=time.time_ns() // 1_000_000 + 3_600_000,
    prompt_hash=prompt_hash(PROMPT),
    hold_ticket=41,
)


def test_params_round_trip_through_json() -> None:
    params = json.loads(json.dumps(compose_params(REMOTE)))  # what a proxy passes on
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [9, 4, 11]
    assert params["kvxfer"]["generations"] == ["7ffffffffffffffb", "11"]  # hex: JS-safe
    assert parse_params(params) == REMOTE
    assert REMOTE.generation_map == {0: 2**63 - 5, 1: 17}


def test_params_without_remote_prefill_name_none() -> None:
    assert parse_params(None) is None
    assert parse_params({"do_remote_decode": True}) is None


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda p: p.pop("kvxfer"), "kvxfer is missing"),
        (lambda p: p["kvxfer"].update(version=2), "version is 2, expected 3"),
        (lambda p: p["kvxfer"].pop("hold_ticket"), "kvxfer.hold_ticket is missing"),
        (lambda p: p["kvxfer"].update(hold_ticket=0), r"hold_ticket 0 not in \[1, 2\*\*53\)"),
        (lambda p: p["kvxfer"].update(hold_ticket="7"), "hold_ticket must be an integer"),
        (lambda p: p["kvxfer"].pop("prompt_hash"), "kvxfer.prompt_hash is missing"),
        (lambda p: p["kvxfer"].update(prompt_hash="ab" * 15), "32 lowercase hex"),
        (lambda p: p["kvxfer"].update(prompt_hash="AB" * 16), "32 lowercase hex"),
        (lambda p: p.update(remote_block_ids=[1, -1]), "remote_block_ids"),
        (lambda p: p.update(remote_block_ids="1,2"), "must be a list"),
        (lambda p: p.update(tp_size=3), "tp_size 3"),
        (lambda p: p["kvxfer"].update(generations=["zz", "1"]), "hex strings"),
        (lambda p: p["kvxfer"].update(num_tokens=97), "does not fit"),
        (lambda p: p["kvxfer"].update(block_size=True), "must be an integer"),
        (lambda p: p["kvxfer"].update(address="a,b,c"), "endpoints"),
        (lambda p: p["kvxfer"].update(request_id=7), "must be a string"),
        (lambda p: p["kvxfer"].update(lease_expires_at_ms="soon"), "lease_expires_at_ms"),
    ],
)
def test_bad_params_are_refused_by_name(mutate, match: str) -> None:
    params = json.loads(json.dumps(compose_params(REMOTE)))
    mutate(params)
    with pytest.raises(ProtocolError, match=match):
        parse_params(params)


@pytest.mark.parametrize("bad", ["x", [1], 5, 1.5, True, ["do_remote_prefill"]])
def test_params_that_are_not_an_object_are_refused_by_name(bad: object) -> None:
    # any client of vLLM's API can send them (vllm_xargs takes strings, numbers, lists)
    with pytest.raises(ProtocolError, match=r"kv_transfer_params must be an object, got"):
        parse_params(bad)  # type: ignore[arg-type]
    assert parse_params("") is None and parse_params([]) is None  # empty: names none


@pytest.mark.parametrize("bad", ["x", [1], 5, ["do_remote_decode"]])
def test_params_that_are_not_an_object_never_stop_either_side(bad: object) -> None:
    # a decode computes such a request locally; a prefill offers nothing for it
    assert _decode_side().matched_tokens("r", PROMPT, bad, 0) == (0, False)  # type: ignore[arg-type]
    s = _prefill_side()
    assert s.finished("a", bad, [1, 2, 3], 70, True, PROMPT) == (False, None)  # type: ignore[arg-type]
    assert s.take_step().holds == []
    # and the same sides still serve well-formed params afterwards
    assert _decode_side().matched_tokens("r", PROMPT, compose_params(REMOTE), 0) == (70, True)
    assert s.finished("b", {"do_remote_decode": True}, [1, 2, 3], 70, True, PROMPT)[0] is True


def _decode_side() -> SchedulerSide:
    return SchedulerSide(
        engine_id="d", block_size=32, tp_size=1, is_producer=False, is_consumer=True
    )


def test_decode_matches_every_prefilled_prompt_token() -> None:
    s = _decode_side()
    params = compose_params(REMOTE)
    assert s.matched_tokens("r1", PROMPT, params, 0) == (70, True)
    s.after_alloc("r1", [5, 6, 7], 70)
    (job,) = s.take_step().loads
    assert (job.request_id, job.local_block_ids, job.remote_block_ids) == (
        "r1",
        (5, 6, 7),
        (9, 4, 11),
    )
    assert job.remote == REMOTE
    assert s.take_step().loads == []  # one step's jobs are taken once


def test_decode_with_local_prefix_hit_loads_only_the_rest() -> None:
    s = _decode_side()
    # two whole blocks (64 tokens) cached locally: only the third block is read
    assert s.matched_tokens("r2", PROMPT, compose_params(REMOTE), 64) == (6, True)
    s.after_alloc("r2", [5, 6, 7], 6)
    (job,) = s.take_step().loads
    assert (job.local_block_ids, job.remote_block_ids) == ((7,), (11,))


def test_decode_never_takes_tokens_the_prefill_did_not_compute() -> None:
    s = _decode_side()
    # the prefill computed 70 tokens of its 90-token prompt: the rest is computed locally
    longer = [*PROMPT, *range(20)]
    remote = dataclasses.replace(REMOTE, prompt_hash=prompt_hash(longer))
    assert s.matched_tokens("r3", longer, compose_params(remote), 0) == (70, True)
    # a second allocation (after the load) brings no external tokens: no second load
    s.after_alloc("r3", [1, 2, 3], 70)
    s.after_alloc("r3", [1, 2, 3, 4], 0)
    assert len(s.take_step().loads) == 1


def test_decode_ignores_bad_or_foreign_params() -> None:
    s = _decode_side()
    bad = compose_params(REMOTE) | {"tp_size": 5}
    assert s.matched_tokens("r4", PROMPT, bad, 0) == (0, False)
    other_block = compose_params(dataclasses.replace(REMOTE, block_size=64))
    assert s.matched_tokens("r5", PROMPT, other_block, 0) == (0, False)
    assert s.matched_tokens("r6", PROMPT, {"do_remote_decode": True}, 0) == (0, False)


def test_prefill_holds_finished_requests_and_names_its_ranks() -> None:
    s = SchedulerSide(engine_id="p", block_size=32, tp_size=2, is_producer=True, is_consumer=False)
    # before the workers published their endpoints nothing is offered
    assert s.finished("a", {"do_remote_decode": True}, [1, 2, 3], 70, True, PROMPT) == (
        False,
        None,
    )
    s.set_producers([ProducerRank(1, "tcp://h:2", 22, 64), ProducerRank(0, "tcp://h:1", 11, 64)])
    delay, params = s.finished("b", {"do_remote_decode": True}, [1, 2, 3], 70, True, PROMPT)
    assert delay is True
    remote = parse_params(params)
    assert remote is not None
    assert (remote.address, remote.generations, remote.block_ids) == (
        "tcp://h:1,tcp://h:2",
        (11, 22),
        (1, 2, 3),
    )
    assert (remote.request_id, remote.num_tokens, remote.tp_size) == ("b", 70, 2)
    assert remote.prompt_hash == prompt_hash(PROMPT)
    # the decode never reads past the prefill's lease (120 s from the finish, or later)
    now_ms = time.time_ns() // 1_000_000
    assert remote.lease_expires_at_ms is not None
    assert now_ms + 119_000 <= remote.lease_expires_at_ms <= now_ms + 120_000
    (hold,) = s.take_step().holds
    assert (hold.request_id, hold.block_ids) == ("b", (1, 2, 3))
    # aborted prefills and requests without do_remote_decode keep vLLM's own freeing
    assert s.finished("c", {"do_remote_decode": True}, [4], 10, False, PROMPT) == (False, None)
    assert s.finished("d", None, [4], 10, True, PROMPT) == (False, None)
    # a prompt given as embeddings (no token ids): no params a decode could check
    assert s.finished("e", {"do_remote_decode": True}, [4], 10, True, None) == (False, None)
    assert s.take_step().holds == []


def test_a_request_asked_again_after_its_load_is_computed_locally() -> None:
    # vLLM asks again after a failed load under kv_load_failure_policy="recompute"
    # (or after a preemption): offering the same KV again would loop forever
    s = _decode_side()
    params = compose_params(REMOTE)
    assert s.matched_tokens("r7", PROMPT, params, 0) == (70, True)
    s.after_alloc("r7", [5, 6, 7], 70)
    assert len(s.take_step().loads) == 1
    assert s.matched_tokens("r7", PROMPT, params, 0) == (0, False)
    # once finished, the id may be reused by a new request, with new params
    s.finished("r7", params, [5, 6, 7], 70, True, PROMPT)
    fresh = compose_params(dataclasses.replace(REMOTE, request_id="cmpl-8"))
    assert s.matched_tokens("r7", PROMPT, fresh, 0) == (70, True)


def test_params_are_single_use() -> None:
    """The producer frees a prefill's blocks at its first reader's ReadDone: a second
    request reading them could get blocks the prefill has reused, reported DONE. vLLM
    gives parallel sampling's children (n > 1) their parent's params, and a client may
    resend them: the first request to ask takes the KV, every other computes locally."""
    s = _decode_side()
    params = compose_params(REMOTE)
    assert s.matched_tokens("child-0", PROMPT, params, 0) == (70, True)
    # the sibling, before and after the first one's allocation and load
    assert s.matched_tokens("child-1", PROMPT, params, 0) == (0, False)
    assert s.matched_tokens("child-0", PROMPT, params, 0) == (70, True)  # asked again: still its
    s.after_alloc("child-0", [5, 6, 7], 70)
    assert [j.request_id for j in s.take_step().loads] == ["child-0"]
    assert s.matched_tokens("child-1", PROMPT, params, 0) == (0, False)
    s.finished("child-0", params, [5, 6, 7], 70, True, PROMPT)
    assert s.matched_tokens("resent", PROMPT, params, 0) == (0, False)  # read already
    # the same prefill request id from a restarted prefill (new generation) is new KV
    restarted = compose_params(dataclasses.replace(REMOTE, generations=(3, 4)))
    assert s.matched_tokens("other", PROMPT, restarted, 0) == (70, True)


def test_a_claim_that_never_loaded_still_ends_the_params() -> None:
    # child-0 took the params, then was aborted before its blocks were allocated: its
    # sibling still computes locally (the prefill may free the blocks at any ReadDone
    # or abort, so reading them later is never safe)
    s = _decode_side()
    params = compose_params(REMOTE)
    assert s.matched_tokens("child-0", PROMPT, params, 0) == (70, True)
    s.finished("child-0", params, [], 0, False, PROMPT)
    assert s.matched_tokens("child-1", PROMPT, params, 0) == (0, False)
    assert s.take_step().loads == []


def test_params_made_for_another_prompt_are_not_taken() -> None:
    # one prefill's params sent with a list of prompts: only its own prompt takes them
    s = _decode_side()
    params = compose_params(REMOTE)
    other = [*PROMPT[:-1], 7]  # same length, last token differs
    assert s.matched_tokens("b", other, params, 0) == (0, False)
    assert s.matched_tokens("c", PROMPT[:64], params, 0) == (0, False)  # a prefix of it
    assert s.matched_tokens("d", None, params, 0) == (0, False)  # embeddings: no ids
    # refusals claim nothing: the prompt the params were made for still takes them
    assert s.matched_tokens("a", PROMPT, params, 0) == (70, True)


def test_the_prompt_hash_covers_what_else_decides_the_kv() -> None:
    # the same token ids under another LoRA adapter, cache salt or image have other KV
    # (vLLM keys its own prefix cache on them too)
    base = prompt_hash(PROMPT)
    assert prompt_hash(PROMPT, ()) == base  # a text prompt: the token ids alone
    variants = [("lora", "a"), ("lora", "b"), ("salt", "a"), ("mm", "img1", "3", "16"),
                ("mm", "img2", "3", "16"), ("mm", "img1", "4", "16")]  # fmt: skip
    hashes = {prompt_hash(PROMPT, [v]) for v in variants} | {base}
    assert len(hashes) == len(variants) + 1
    # unambiguous: two entries never hash as one entry holding their text
    assert prompt_hash(PROMPT, [("lora", "a"), ("salt", "b")]) != prompt_hash(
        PROMPT, [("lora", "a", "salt", "b")]
    )


def test_the_prompt_context_is_read_from_a_request() -> None:
    from types import SimpleNamespace as NS

    plain = NS(lora_request=None, cache_salt=None, mm_features=[])
    assert prompt_context(plain) == ()
    assert prompt_context(NS()) == ()  # an engine whose requests have none of these
    full = NS(
        lora_request=NS(lora_name="sql", lora_int_id=3, lora_path="/x"),
        cache_salt="tenant-a",
        mm_features=[NS(identifier="h1", mm_position=NS(offset=5, length=16)),
                     NS(identifier="h2", mm_position=NS(offset=40, length=8))],
    )  # fmt: skip
    assert prompt_context(full) == (("lora", "sql"), ("salt", "tenant-a"),
                                    ("mm", "h1", "5", "16"), ("mm", "h2", "40", "8"))  # fmt: skip


def test_params_made_under_another_lora_salt_or_image_are_not_taken() -> None:
    ctx = (("lora", "sql"), ("salt", "tenant-a"))
    remote = dataclasses.replace(REMOTE, prompt_hash=prompt_hash(PROMPT, ctx))
    params = compose_params(remote)
    s = _decode_side()
    assert s.matched_tokens("x", PROMPT, params, 0) == (0, False)  # no context
    assert s.matched_tokens("y", PROMPT, params, 0, (("lora", "sql"),)) == (0, False)
    assert s.matched_tokens("z", PROMPT, params, 0, ctx) == (70, True)
    # the prefill stamps its request's context into the params it offers
    p = _prefill_side()
    offered = p.finished("a", {"do_remote_decode": True}, [1, 2, 3], 70, True, PROMPT, ctx)[1]
    assert offered is not None and offered["kvxfer"]["prompt_hash"] == prompt_hash(PROMPT, ctx)


def test_params_past_their_lease_are_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _decode_side()
    lease_ms = REMOTE.lease_expires_at_ms
    assert lease_ms is not None
    assert s.matched_tokens("a", PROMPT, compose_params(REMOTE), 0) == (70, True)
    s.finished("a", None, [], 0, False, PROMPT)
    # after the lease the prefill may have reused the blocks: refused, and the claim on
    # them is forgotten (claims live no longer than leases)
    monkeypatch.setattr(time, "time", lambda: lease_ms / 1000 + 1)
    assert s.matched_tokens("b", PROMPT, compose_params(REMOTE), 0) == (0, False)
    fresh = dataclasses.replace(REMOTE, request_id="cmpl-9", lease_expires_at_ms=lease_ms + 60_000)
    assert s.matched_tokens("c", PROMPT, compose_params(fresh), 0) == (70, True)
    assert [key[1] for key in s._claims] == ["cmpl-9"]


def test_prefill_does_not_offer_a_request_id_that_is_still_held() -> None:
    # a client reusing request ids: a second hold under the same id would be freed by
    # the first one's ReadDone, so its KV is not offered until vLLM freed the first
    s = SchedulerSide(engine_id="p", block_size=32, tp_size=1, is_producer=True, is_consumer=False)
    s.set_producers([ProducerRank(0, "tcp://h:1", 11, 64)])
    want = {"do_remote_decode": True}
    assert s.finished("x", want, [1, 2, 3], 70, True, PROMPT)[0] is True
    assert s.finished("x", want, [4, 5, 6], 70, True, PROMPT) == (False, None)
    assert [h.block_ids for h in s.take_step().holds] == [(1, 2, 3)]
    s.freed({"x"})
    assert s.finished("x", want, [4, 5, 6], 70, True, PROMPT)[0] is True


def test_prefill_peers_config_is_a_list_of_addresses() -> None:
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.extra import peer_list

    both = "tcp://10.0.0.6:5700,tcp://10.0.0.6:5701"
    assert peer_list(["tcp://10.0.0.5:5700", both]) == ("tcp://10.0.0.5:5700", both)
    assert peer_list([]) == ()
    with pytest.raises(ConfigError, match=r"prefill_peers must be a list of addresses"):
        peer_list("tcp://10.0.0.5:5700")  # a bare string would be split into characters
    with pytest.raises(ConfigError, match=r"prefill_peers: not all non-empty strings"):
        peer_list(["tcp://10.0.0.5:5700", " "])
    with pytest.raises(ConfigError, match=r"prefill_peers: not all non-empty strings"):
        peer_list([5700])


def test_idle_wait_config_is_seconds_up_to_one() -> None:
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.extra import idle_wait

    assert idle_wait(0.002) == 0.002
    assert idle_wait(0) == 0.0  # off: every step returns at once, as vLLM's own connectors
    assert idle_wait("0.005") == 0.005  # JSON from a command line may quote it
    for bad in (-1, float("nan"), float("inf"), 1.5, "soon", None, True):
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config.idle_wait_s"):
            idle_wait(bad)


def test_seconds_keys_name_the_key_for_bad_values() -> None:
    # deadline_s, lease_s, heartbeat_s, silence_s: a bad value is refused at start with
    # the key's name (float() alone raised "could not convert string to float: 'soon'")
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.extra import seconds

    assert seconds("deadline_s", 30) == 30.0
    assert seconds("silence_s", "12.5", allow_zero=True) == 12.5  # JSON may quote it
    assert seconds("silence_s", 0, allow_zero=True) == 0.0
    for bad in (-1, float("nan"), float("inf"), "soon", None, True, [1]):
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.silence_s"):
            seconds("silence_s", bad, allow_zero=True)
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.deadline_s .* > 0"):
        seconds("deadline_s", 0)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
    reason="needs Linux thread affinity and two CPUs",
)
def test_engine_threads_are_not_pinned_to_the_workers_cores() -> None:
    """vLLM pins its worker thread to its OpenMP cores; threads the engines start there
    must not inherit that pin (they would wait for the forward pass), and the worker
    thread keeps its own."""
    import threading

    from kvxfer.integrations.vllm.worker import threads_on_every_cpu

    everyone = set(range(os.cpu_count() or 1)) & os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def worker() -> None:  # stands for vLLM's pinned worker thread
        os.sched_setaffinity(0, {0})
        with threads_on_every_cpu():
            th = threading.Thread(target=lambda: seen.update(engine=os.sched_getaffinity(0)))
            th.start()
            th.join()
        seen["worker"] = os.sched_getaffinity(0)

    th = threading.Thread(target=worker)  # affinity is per thread: not pytest's
    th.start()
    th.join()
    assert seen == {"engine": everyone, "worker": {0}}


def test_claims_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer.integrations.vllm import scheduler

    monkeypatch.setattr(scheduler, "MAX_CLAIMS", 3)
    s = _decode_side()
    for i in range(5):
        fresh = compose_params(dataclasses.replace(REMOTE, request_id=f"cmpl-{i}"))
        assert s.matched_tokens(f"r{i}", PROMPT, fresh, 0) == (70, True)
    assert [key[1] for key in s._claims] == ["cmpl-2", "cmpl-3", "cmpl-4"]


def _prefill_side(slots: int = 4) -> SchedulerSide:
    s = SchedulerSide(engine_id="p", block_size=32, tp_size=2, is_producer=True, is_consumer=False)
    s.set_producers(
        [ProducerRank(0, "tcp://h:1", 11, slots + 3), ProducerRank(1, "tcp://h:2", 22, slots)]
    )
    return s


def test_prefill_hands_each_hold_a_ticket_the_params_and_the_workers_share() -> None:
    s = _prefill_side()
    want = {"do_remote_decode": True}
    params = [s.finished(f"q{i}", want, [i], 20, True, PROMPT)[1] for i in range(3)]
    tickets = [parse_params(p).hold_ticket for p in params]  # type: ignore[union-attr]
    assert tickets == [1, 2, 3]  # increasing, so a slot's word only grows
    assert [(h.request_id, h.ticket) for h in s.take_step().holds] == [
        ("q0", 1),
        ("q1", 2),
        ("q2", 3),
    ]


def test_prefill_offers_nothing_when_every_hold_slot_is_in_use() -> None:
    s = _prefill_side(slots=4)  # the smaller table of the two ranks
    want = {"do_remote_decode": True}
    for i in range(4):
        assert s.finished(f"q{i}", want, [i], 20, True, PROMPT)[0] is True
    assert s.finished("q4", want, [4], 20, True, PROMPT) == (False, None)  # computed locally
    s.freed({"q1"})  # vLLM freed one: its slot is free again, under a newer ticket
    delay, params = s.finished("q5", want, [5], 20, True, PROMPT)
    assert delay is True
    ticket = parse_params(params).hold_ticket  # type: ignore[union-attr]
    assert ticket > 4 and ticket % 4 == 2  # q1 had ticket 2: slot 2


def test_prefill_without_hold_tables_offers_nothing() -> None:
    s = SchedulerSide(engine_id="p", block_size=32, tp_size=1, is_producer=True, is_consumer=False)
    s.set_producers([ProducerRank(0, "tcp://h:1", 11)])  # an older worker: no table
    assert s.finished("q", {"do_remote_decode": True}, [1], 20, True, PROMPT) == (False, None)


def test_hold_slots_config_is_a_bounded_integer() -> None:
    from kvxfer.errors import ConfigError
    from kvxfer.integrations.vllm.extra import hold_slots

    assert hold_slots(1 << 16) == 65536
    assert hold_slots("1024") == 1024
    for bad in (0, -1, 1 << 25, 2.5, True, "many"):
        with pytest.raises(ConfigError, match="hold_slots must be an integer"):
            hold_slots(bad)


def test_forged_params_re_stamped_with_another_prompt_do_not_take_the_genuine_claim() -> None:
    """A forger re-stamps a request's params with its own prompt's hash and reaches the
    decode engine first: its load fails the hold binding, but it had claimed the params,
    and the genuine request then computed its prompt ("already took it"). The claim
    names the prompt now."""
    s = _decode_side()
    params = compose_params(REMOTE)
    forger = [*PROMPT[:-1], 7]
    forged = json.loads(json.dumps(params))
    forged["kvxfer"]["prompt_hash"] = prompt_hash(forger)
    assert s.matched_tokens("forger", forger, forged, 0) == (70, True)
    s.after_alloc("forger", list(range(5)), 70)
    assert s.matched_tokens("genuine", PROMPT, params, 0) == (70, True)


def test_a_prefill_whose_request_id_the_wire_cannot_carry_offers_nothing() -> None:
    """vLLM takes a request id from the client's X-Request-Id header: one past the
    wire's limit cannot be held (nor named by the decode): no offer, the blocks are
    freed at once and the decode computes the prompt."""
    from kvxfer.wire import MAX_REQUEST_ID_LEN

    s = _prefill_side()
    long_id = "x" * (MAX_REQUEST_ID_LEN + 1)
    assert s.finished(long_id, {"do_remote_decode": True}, [1], 16, True, PROMPT) == (False, None)
    assert s.take_step().holds == []
    ok = "x" * MAX_REQUEST_ID_LEN
    delay, params = s.finished(ok, {"do_remote_decode": True}, [1], 16, True, PROMPT)
    assert delay and params is not None and params["kvxfer"]["request_id"] == ok
