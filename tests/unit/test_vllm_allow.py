"""``allowed_prefills``: the prefills a decode may contact. vLLM's API takes
``kv_transfer_params`` from any client, so without a list a client can point the decode
at any address; with one, params naming another prefill are not loaded (computed
locally), before any block is allocated or any connection made."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm.allow import allowed_prefills, refuse_address
from kvxfer.integrations.vllm.params import RemotePrefill, compose_params, prompt_hash
from kvxfer.integrations.vllm.scheduler import SchedulerSide

PROMPT = list(range(1000, 1070))
REMOTE = RemotePrefill("prefill-0", "cmpl-7", "tcp://10.0.0.5:5700,tcp://10.0.0.5:5701",
                       (5, 6), (9, 4, 11), 32, 2, 70, prompt_hash=prompt_hash(PROMPT),
                       hold_ticket=3)  # fmt: skip


@pytest.mark.parametrize(
    ("entries", "address", "why"),
    [
        (["10.0.0.5"], "tcp://10.0.0.5:5700", ""),  # a host: any port
        (["10.0.0.5:5700"], "tcp://10.0.0.5:5700", ""),
        (["10.0.0.5:5700"], "tcp://10.0.0.5:5701", "tcp://10.0.0.5:5701"),
        (["tcp://10.0.0.5:5700"], "tcp://10.0.0.5:5700", ""),
        (["10.0.0.0/24"], "tcp://10.0.0.77:1", ""),  # a network
        (["10.0.0.0/24"], "tcp://10.0.1.77:1", "tcp://10.0.1.77:1"),
        (["Prefill-A.example"], "tcp://prefill-a.example:5700", ""),  # names: any case
        (["prefill-a.example"], "tcp://prefill-b.example:5700", "prefill-b.example"),
        (["[::1]:5700"], "tcp://[::1]:5700", ""),
        (["::1"], "tcp://[::1]:9", ""),
        (["fd00::/8"], "tcp://[fd00::7]:9", ""),
        (["ipc:///run/p0"], "ipc:///run/p0", ""),
        (["ipc:///run/p0"], "ipc:///run/p1", "ipc:///run/p1"),
        # every endpoint of a TP prefill must be allowed
        (["10.0.0.5:5700"], "tcp://10.0.0.5:5700,tcp://10.0.0.6:5700", "tcp://10.0.0.6:5700"),
        (["10.0.0.5"], "tcp://10.0.0.5", "tcp://10.0.0.5"),  # not an endpoint: refused
        (["10.0.0.5"], "tcp://10.0.0.5:x", "tcp://10.0.0.5:x"),
        # digits str.isdigit takes but int() does not: refused, never a ValueError
        (["10.0.0.5"], "tcp://10.0.0.5:\u00b2", "tcp://10.0.0.5:\u00b2"),
        (["10.0.0.5"], "tcp://10.0.0.5:\u0667", "tcp://10.0.0.5:\u0667"),
    ],
)
def test_an_address_is_allowed_only_if_every_endpoint_matches(
    entries: list[str], address: str, why: str
) -> None:
    got = refuse_address(address, allowed_prefills(entries))
    if why:
        assert why in got and "allowed_prefills" in got
    else:
        assert got == ""


def test_unset_allows_every_prefill() -> None:
    assert allowed_prefills(None) is None
    assert refuse_address("tcp://203.0.113.9:1", None) == ""


@pytest.mark.parametrize(
    "bad", ["10.0.0.5", [""], [3], ["tcp://"], ["h:port"], ["10.0.0.0/33"], {}, ["h:\u00b2"]]
)
def test_a_bad_list_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ConfigError, match="allowed_prefills"):
        allowed_prefills(bad)


def test_the_decode_computes_locally_what_names_another_prefill(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = SchedulerSide(engine_id="d", block_size=32, tp_size=1, is_producer=False,
                      is_consumer=True, allowed=allowed_prefills(["10.0.0.5"]))  # fmt: skip
    assert s.matched_tokens("ok", PROMPT, compose_params(REMOTE), 0) == (70, True)
    forged = dataclasses.replace(REMOTE, request_id="cmpl-8", address="tcp://192.0.2.7:80")
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert s.matched_tokens("forged", PROMPT, compose_params(forged), 0) == (0, False)
    (line,) = [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]
    assert (
        "endpoint tcp://192.0.2.7:80 is not in allowed_prefills" in line
        and "computing locally" in line
    )
    s.after_alloc("forged", [1, 2, 3], 0)
    s.after_alloc("ok", [5, 6, 7], 70)
    assert [j.request_id for j in s.take_step().loads] == ["ok"]  # nothing for the forged one


def test_prefill_peers_outside_the_list_are_refused_at_start() -> None:
    from kvxfer.integrations.vllm.extra import peer_list

    allowed = allowed_prefills(["10.0.0.0/24"])
    assert peer_list(["tcp://10.0.0.5:5700"], allowed) == ("tcp://10.0.0.5:5700",)
    with pytest.raises(
        ConfigError, match=r"prefill_peers: tcp://10.0.1.5:5700: .*allowed_prefills"
    ):
        peer_list(["tcp://10.0.0.5:5700", "tcp://10.0.1.5:5700"], allowed)


def test_a_check_that_breaks_on_client_params_computes_locally(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the params come from any client: an exception in their checks must not reach
    # vLLM's scheduler (it would stop the engine for every user)
    import kvxfer.integrations.vllm.scheduler as sched

    def broken(address: str, allowed: object) -> str:
        raise ValueError(f"cannot read {address}")

    monkeypatch.setattr(sched, "refuse_address", broken)
    s = SchedulerSide(engine_id="d", block_size=32, tp_size=1, is_producer=False,
                      is_consumer=True, allowed=allowed_prefills(["10.0.0.5"]))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert s.matched_tokens("r", PROMPT, compose_params(REMOTE), 0) == (0, False)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "checking its kv_transfer_params failed" in text
    assert "params could not be checked (ValueError)" in text and "computing locally" in text
    s.after_alloc("r", [1, 2, 3], 0)
    assert s.take_step().loads == []
