"""The full vLLM P/D matrix (``-m full``): 18 prompts over TP pairs (pull, and push), a
killed and a restarted prefill (pull and push), lease expiry, and two OpenAI servers behind
examples/vllm/proxy.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import run_scenario

pytestmark = [pytest.mark.full, pytest.mark.vllm, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def tokens(vllm_ready: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario("tokens", tmp_path_factory.mktemp("vllm-tokens"), timeout_s=3000)


@pytest.fixture(scope="module", params=["pull-fail", "pull-recompute", "push-fail"])
def faults(
    vllm_ready: None, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """One decode (transfer mode and kv_load_failure_policy from ``request.param``),
    prefills killed/restarted."""
    mode, policy = request.param.split("-")
    tmp = tmp_path_factory.mktemp(f"vllm-faults-{request.param}")
    extra = json.dumps({"transfer_mode": mode})
    return run_scenario("faults", tmp, "--policy", policy, "--decode-extra", extra)


@pytest.fixture(scope="module")
def tokens_push(vllm_ready: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same TP pairs with the decodes in push mode (the prefill WRITEs)."""
    tmp = tmp_path_factory.mktemp("vllm-tokens-push")
    return run_scenario("tokens", tmp, "--decode-extra", '{"transfer_mode": "push"}',
                        timeout_s=3000)  # fmt: skip


@pytest.mark.parametrize("pair", ["1-1", "2-1", "1-2"])
def test_tp_pair_tokens_equal_colocated(tokens: dict[str, Any], pair: str) -> None:
    _pair_equal(tokens, pair)


@pytest.mark.parametrize("pair", ["1-1", "2-1", "1-2"])
def test_tp_pair_tokens_equal_colocated_push(tokens_push: dict[str, Any], pair: str) -> None:
    _pair_equal(tokens_push, pair)


def _pair_equal(tokens: dict[str, Any], pair: str) -> None:
    res = tokens["pairs"][pair]
    if "error" in res:
        ok = sum(r["tokens"] == r["ref"] for r in res["records"])
        pytest.skip(
            f"P{pair[0]}->D{pair[-1]} did not finish in vLLM-CPU here ({res['error'][-300:]}; "
            f"{ok} of {len(res['records'])} prompts equal before): {res['evidence'][-4:]}"
        )
    recs = res["records"]
    assert len(recs) >= 16
    lens = [r["prompt_len"] for r in recs]
    assert min(lens) < 32 < max(lens) and any(n % 32 for n in lens)
    bad = [(r["prompt_len"], r["tokens"], r["ref"]) for r in recs if r["tokens"] != r["ref"]]
    assert not bad, f"{len(bad)} of {len(recs)} prompts differ: {bad[:3]}"
    assert all(r["finish_reason"] == "length" for r in recs)


def _never_wrong(rec: dict[str, Any], policy: str) -> None:
    """A failed load ends in an error (policy fail) or in recomputed tokens (recompute)."""
    if policy == "fail":
        assert rec["finish_reason"] == "error" and rec["tokens"] == [], rec
    else:
        assert rec["tokens"] == rec["ref"], rec


def test_killed_prefill_fails_cleanly_within_deadline(faults: dict[str, Any]) -> None:
    assert faults["warm"]["tokens"] == faults["warm"]["ref"]
    rec = faults["killed"]
    _never_wrong(rec, faults["policy"])
    assert rec["elapsed_s"] < faults["deadline_s"] + 15, rec["elapsed_s"]


def test_decode_preconnects_to_a_prefill_that_starts_later(faults: dict[str, Any]) -> None:
    # the decode started before prefill #1 and listed it in prefill_peers: it retried
    # until the prefill was up, and the first request then read from the contacted peer
    ready = [ln for ln in faults["preconnect_log"] if "ready" in ln]
    assert len(ready) == 1 and "tcp://127.0.0.1:" in ready[0], faults["preconnect_log"]
    assert faults["warm"]["tokens"] == faults["warm"]["ref"]


def test_prefill_hung_then_killed_mid_load_fails_cleanly(faults: dict[str, Any]) -> None:
    # SIGSTOP before the decode's load starts, SIGKILL a second into it: the load ends by
    # its deadline in vLLM's failure path (or, if the bytes were all read before the
    # kill, with tokens equal colocated): never tokens from partial KV
    rec = faults["killed_mid_load"]
    assert "error" not in rec, rec
    if rec["tokens"] != rec["ref"]:  # the load failed: the policy decides, never bad tokens
        _never_wrong(rec, faults["policy"])
    assert rec["finish_reason"] in ("error", "length"), rec
    assert rec["elapsed_s"] < faults["deadline_s"] + 15, rec["elapsed_s"]


def test_restarted_prefill_serves_the_same_decode(faults: dict[str, Any]) -> None:
    for key in ("restarted", "restarted_after_stale"):
        rec = faults[key]
        assert rec["finish_reason"] == "length" and rec["tokens"] == rec["ref"], (key, rec)


def test_stale_params_from_killed_prefill_fail_cleanly(faults: dict[str, Any]) -> None:
    _never_wrong(faults["stale"], faults["policy"])
    (line,) = faults["stale_log"]  # the load was tried and refused: the pin, not the lease
    assert "generation" in line, line


def test_expired_lease_never_yields_tokens_from_reused_blocks(faults: dict[str, Any]) -> None:
    # the prefill released the blocks at lease expiry and other requests reused them: the
    # decode must not read them (its params carry the lease end; measured before the
    # lease-aware reads: wrong tokens with no error, as vLLM's own NixlConnector gives).
    # Params past their lease are not taken at all: the prompt is computed locally
    rec = faults["lease"]
    assert rec["finish_reason"] == "length" and rec["tokens"] == rec["ref"], rec
    assert any("lease has ended" in ln for ln in faults["lease_log"]), faults["lease_log"]


def test_http_proxy_tokens_equal_colocated(vllm_ready: None, tmp_path: Path) -> None:
    res = run_scenario("http", tmp_path)
    recs = res["records"]
    assert len(recs) >= 4
    for r in recs:
        assert r["tokens"] is not None and len(r["tokens"]) == 8, r
        assert r["tokens"] == r["ref"], r
    neg = res["negative"]  # the decode server really uses the KV it is handed
    assert neg["finish_reason"] == "length" and neg["tokens"] != neg["ref"], neg
    # both servers are keyed by KVXFER_AUTH_KEY: the prefill answers no one without it
    auth = res["auth"]
    assert auth["unkeyed"].startswith("AuthError") and "requires authentication" in auth["unkeyed"]
    assert auth["other_key"].startswith("AuthError") and "same deployment key" in auth["other_key"]
    # the transfers in vLLM's own stats path (get_kv_connector_stats -> /metrics and the
    # periodic log line): one DONE load per proxied request and the negative control,
    # two first contacts (the prefill, the negative control's); the prefill released
    # each hold when its reader was done
    n = len(recs) + 1
    dec, pre = res["metrics"]["decode"], res["metrics"]["prefill"]
    assert dec["vllm:kvxfer_loads_total{engine=0,outcome=done}"] == n, dec
    assert not any("outcome=" in k and "outcome=done" not in k for k in dec), dec
    assert dec["vllm:kvxfer_load_seconds_count{engine=0}"] == n, dec
    assert dec["vllm:kvxfer_load_bytes_total{engine=0}"] > 0, dec
    assert dec["vllm:kvxfer_first_contacts_total{engine=0}"] == 2, dec
    assert pre["vllm:kvxfer_holds_released_total{engine=0,reason=read}"] == len(recs), pre
    assert any("KV Transfer metrics: loads=" in ln for ln in res["stats_log"]), res["stats_log"]
