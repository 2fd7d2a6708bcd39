"""The CI case: P1->D1 in a real vLLM, 4 prompts, token equality, the negative
control, params made for another prompt, parallel sampling, the same params on a
second decode engine, push mode (a third decode with ``transfer_mode`` "push"), and a
decode of another model of the same architecture, in one set of instance lifetimes
(~3 min with start-up on 2 cores). All five instances hold one deployment key
(``auth_key_file``): every transfer below is authenticated."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.conftest import run_scenario

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ci(vllm_ready: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario("ci", tmp_path_factory.mktemp("vllm-ci"))


def test_decode_tokens_equal_colocated(ci: dict[str, Any]) -> None:
    recs = ci["records"]
    assert [r["prompt_len"] for r in recs] == [40, 70, 129, 17]
    for r in recs:
        assert r["finish_reason"] == "length", r
        assert len(r["tokens"]) == 8
        assert r["tokens"] == r["ref"], f"prompt of {r['prompt_len']} tokens: {r}"
        assert r["params"]["do_remote_prefill"] is True
        assert r["params"]["kvxfer"]["num_tokens"] == r["prompt_len"]


def test_an_unknown_extra_config_key_stops_the_instance_naming_it(ci: dict[str, Any]) -> None:
    bad = ci["bad_config"]
    assert bad["started"] is False
    want = "extra_config.deadline is not a kvxfer key; did you mean 'deadline_s'?"  # cut at 300
    assert any(want in line for line in bad["log"]), bad["log"]


def test_a_sliding_window_model_is_refused_at_start_naming_its_cache(ci: dict[str, Any]) -> None:
    sw = ci["sliding_window"]
    assert sw["started"] is False
    want = (
        "kvxfer's connector supports full-attention KV caches only; group 0 is a SlidingWindowSpec"
    )
    assert any(want in line for line in sw["log"]), sw["log"]


def test_negative_control_decode_uses_transferred_kv(ci: dict[str, Any]) -> None:
    # prompt A's KV from a prefill of other weights that names itself as this model
    neg = ci["negative"]
    assert neg["finish_reason"] == "length"
    assert len(neg["tokens"]) == 8
    # computed here, A's tokens would equal its colocated ones (greedy, float32): they
    # differ only if the decode used the KV it was handed
    assert neg["tokens"] != neg["ref"], "decoding A with another model's KV gave A's tokens"


def _refused_forgery(forged: dict[str, Any]) -> None:
    # B's params re-stamped with A's prompt hash (a forging client): the decode READ
    # B's blocks, but B's hold is bound to B's prompt: the load fails, A is recomputed
    assert forged["finish_reason"] == "length"
    assert forged["tokens"] == forged["ref"], "prompt A decoded from the KV of B's params"
    (line,) = forged["log"]
    assert "do not match these (forged or mixed-up params)" in line, line


def test_params_made_for_another_prompt_compute_locally(ci: dict[str, Any]) -> None:
    # B's params as a proxy could mix them up: the decode sees they name another prompt
    mis = ci["forged"]["mismatch"]
    assert mis["finish_reason"] == "length"
    assert mis["tokens"] == mis["ref"], "prompt A decoded from the KV of B's params"
    assert any("made for another prompt" in ln for ln in ci["forged"]["mismatch_log"])


def test_forged_params_are_refused_by_the_hold_binding(ci: dict[str, Any]) -> None:
    _refused_forgery(ci["forged"])


def test_parallel_sampling_children_take_the_kv_once(ci: dict[str, Any]) -> None:
    # n=2: vLLM gives both children the parent's params; one reads, one computes
    par = ci["parallel"]
    assert len(par["all_tokens"]) == 2
    assert par["equal"], par
    assert sum("already took it" in ln for ln in ci["log"]) == 1, ci["log"]


def test_params_read_again_on_another_engine_are_refused(ci: dict[str, Any]) -> None:
    # a router retrying the same params on a second decode engine, after the prefill
    # freed (first reader's ReadDone) and reused the blocks: the second READ copies
    # other prompts' KV; its hold check refuses it, and the prompt is recomputed
    two = ci["two_engines"]
    assert two["first"]["tokens"] == two["first"]["ref"], two["first"]
    assert two["second"]["finish_reason"] == "length"
    assert two["second"]["tokens"] == two["second"]["ref"], "decoded from reused blocks"
    (line,) = [ln for ln in two["log"] if "had ended hold" in ln]
    assert "another reader read these params first" in line


def test_push_mode_decode_tokens_equal_colocated(ci: dict[str, Any]) -> None:
    # transfer_mode "push": the prefill WRITEs each prompt's KV into the decode's blocks
    push = ci["push"]
    for r in push["records"]:
        assert r["finish_reason"] == "length", r
        assert r["tokens"] == r["ref"], f"prompt of {r['prompt_len']} tokens (push): {r}"
    # the decode never saw these prompts: its full blocks' KV came from the push, as in pull
    cached = [r["num_cached_tokens"] for r in push["records"]]
    assert cached == [r["prompt_len"] // 32 * 32 for r in push["records"]] == [32, 64, 128, 0]
    assert push["log"] == [], push["log"]  # no load failed
    neg = push["negative"]  # another model's KV of A pushed: differs
    assert neg["finish_reason"] == "length" and len(neg["tokens"]) == 8
    assert neg["tokens"] != neg["ref"], "decoding A with another model's pushed KV gave A's tokens"
    _refused_forgery(push["forged"])


def test_push_of_params_read_by_another_engine_is_refused(ci: dict[str, Any]) -> None:
    # the pull decode read the params first; the push decode gets them again after the
    # prefill reused the blocks: the prefill refuses to write from the ended hold
    two = ci["push_two_engines"]
    assert two["first"]["tokens"] == two["first"]["ref"], two["first"]
    assert two["second"]["finish_reason"] == "length"
    assert two["second"]["tokens"] == two["second"]["ref"], "decoded from reused blocks"
    (line,) = [ln for ln in two["log"] if "had ended hold" in ln]
    assert "HoldEndedError" in line


def test_the_keyed_prefill_answers_no_one_without_the_key(ci: dict[str, Any]) -> None:
    # the transfers above ran with the key; a records request without it, or sealed with
    # another key, gets a refusal and no record (no agent metadata, no addresses)
    auth = ci["auth"]
    assert auth["unkeyed"].startswith("AuthError"), auth
    assert "requires authentication" in auth["unkeyed"], auth
    assert auth["other_key"].startswith("AuthError"), auth
    assert "same deployment key" in auth["other_key"], auth


def test_params_naming_a_prefill_outside_allowed_prefills_compute_locally(
    ci: dict[str, Any],
) -> None:
    # any client of vLLM's API can send params; this decode may contact 127.0.0.1 only
    rec = ci["elsewhere"]
    assert rec["finish_reason"] == "length"
    assert rec["tokens"] == rec["ref"], rec
    assert rec["num_cached_tokens"] == 0, rec  # nothing loaded
    (line,) = rec["log"]
    assert "endpoint tcp://192.0.2.7:5700 is not in allowed_prefills" in line
    assert "computing locally" in line


def test_params_made_under_another_cache_salt_compute_locally(ci: dict[str, Any]) -> None:
    # the same token ids under tenant B's salt have other KV (vLLM's prefix cache keys
    # on the salt too): tenant A's params are refused, the same salt takes them
    salt = ci["salt"]
    other, same = salt["other_salt"], salt["same_salt"]
    assert other["tokens"] == other["ref"] and other["num_cached_tokens"] == 0, other
    (line,) = salt["log"]
    assert "made for another prompt" in line and "computing locally" in line
    assert same["tokens"] == same["ref"], same
    # loaded: vLLM counts a load's whole blocks as cached (the 4 records: 40 -> 32 ...)
    assert same["num_cached_tokens"] == same["prompt_len"] // 32 * 32 > 0, same


def test_transfers_show_in_vllms_own_metrics(ci: dict[str, Any]) -> None:
    # vLLM's stats path (get_kv_connector_stats -> its loggers and Prometheus): the 4
    # loads above, their bytes (every block the prefill computed: the tiny model has 2
    # layers, 2 KV heads of 32 float32 values, K and V: 32 KiB per 32-token block), the
    # one first contact they waited for, and the prefill's 4 holds released by reads
    dec, pre = ci["metrics"]["decode"], ci["metrics"]["prefill"]
    blocks = sum(-(-r["prompt_len"] // 32) for r in ci["records"])
    assert dec["vllm:kvxfer_loads{engine=0,outcome=done}"] == 4, dec
    assert not any("outcome=" in k and "outcome=done" not in k for k in dec), dec
    assert dec["vllm:kvxfer_load_seconds_count{engine=0}"] == 4, dec
    assert dec["vllm:kvxfer_load_bytes{engine=0}"] == blocks * 32 * 2 * 2 * 2 * 32 * 4, dec
    assert dec["vllm:kvxfer_first_contacts{engine=0}"] == 1, dec
    assert 0 < dec["vllm:kvxfer_first_contact_seconds_sum{engine=0}"] < 5, dec
    assert pre["vllm:kvxfer_holds_released{engine=0,reason=read}"] == 4, pre
    assert any("KV Transfer metrics: loads=4, failed_loads=0" in ln for ln in ci["stats_log"])
    print(f"[measure] prefill silences forgiven by silence_s: {ci['silences']}")


def test_a_decode_of_another_model_never_takes_its_kv(ci: dict[str, Any]) -> None:
    # a decode of other weights under the same architecture (a fine-tune of the same
    # base): the KV's shapes agree, so only the model's identity can refuse it
    other = ci["other_weights"]
    assert other["prefill_ref"] != other["ref"], "the two models decode alike: no control"
    assert other["finish_reason"] == "length"
    assert other["tokens"] == other["ref"], "decoded from another model's KV"
    assert any("the models differ in model_name" in ln for ln in other["log"]), other["log"]
