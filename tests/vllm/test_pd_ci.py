"""The CI case: P1->D1 in a real vLLM, 4 prompts, token equality and the negative
control, in one pair of instance lifetimes (~3 min with start-up on 2 cores)."""

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


def test_negative_control_decode_uses_transferred_kv(ci: dict[str, Any]) -> None:
    neg = ci["negative"]
    assert neg["finish_reason"] == "length"
    assert len(neg["tokens"]) == 8
    assert neg["tokens"] != neg["ref"], "decoding A with B's KV gave A's tokens"
