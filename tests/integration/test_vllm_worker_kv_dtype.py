"""The KV cache's own dtype in the compatibility hash: vLLM's fp8 caches (``fp8_e4m3``,
``fp8_e5m2``) are one byte an element under any model dtype, so layouts alone cannot
tell them apart; a decode that read the other format would take every byte as another
number. Real NIXL and ZMQ in one process; no vLLM."""

from __future__ import annotations

import logging

import pytest

from kvxfer.integrations.vllm.layouts import spec_from_vllm_tensors
from kvxfer.integrations.vllm.worker import (
    WorkerSettings,
    WorkerSide,
    kv_cache_dtype,
    model_identity,
)
from kvxfer.testing import fill, mismatches
from tests.integration.vllm_worker_util import load_held

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

NB, H, T, D, LAYERS = 16, 2, 16, 8, 2
BLOCKS = (3, 4, 5)


def test_the_cache_dtype_is_the_models_unless_vllm_was_given_one() -> None:
    assert kv_cache_dtype("bfloat16", "auto") == "bfloat16"
    assert kv_cache_dtype("float32", "") == "float32"
    assert kv_cache_dtype("bfloat16", "fp8_e5m2") == "fp8_e5m2"
    assert kv_cache_dtype("float16", "fp8") == "fp8_e4m3"  # vLLM: "fp8" is e4m3
    assert kv_cache_dtype("float16", "fp8_e4m3") == "fp8_e4m3"
    assert kv_cache_dtype("float16", "bfloat16") == "bfloat16"


def test_the_default_model_name_is_where_the_weights_came_from() -> None:
    # not the architecture's model_type ("llama"): fine-tunes share it (and KV shapes)
    assert model_identity("/models/llama-ft-a") == "/models/llama-ft-a"
    assert model_identity("org/llama-ft-b", "main") == "org/llama-ft-b@main"
    assert model_identity("org/llama-ft-b", None) == "org/llama-ft-b"
    assert model_identity("org/llama-ft-b", "v2") != model_identity("org/llama-ft-b", "v1")


def _side(role: str, cache_dtype: str) -> WorkerSide:
    prod = role == "p"
    return WorkerSide(WorkerSettings(f"kvd-{role}", 0, 1, T, H, "CPU_ATTN", prod, not prod,
                                     "tiny", "bfloat16",
                                     kv_dtype=kv_cache_dtype("bfloat16", cache_dtype)))  # fmt: skip


def _tensors() -> list[object]:
    return [torch.zeros(NB, H, T, 2 * D, dtype=torch.uint8) for _ in range(LAYERS)]


def test_a_decode_never_reads_an_fp8_cache_of_the_other_format(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p_tensors = _tensors()
    prefill = _side("p", "fp8_e5m2")
    prefill.register(p_tensors)
    spec, p_bufs = spec_from_vllm_tensors(p_tensors, backend="CPU_ATTN", block_size=T,
                                          num_kv_heads=H)  # fmt: skip
    fill(spec, p_bufs)
    decodes = {"same": _side("d", "fp8_e5m2"), "other": _side("d", "fp8")}
    d_tensors = {name: _tensors() for name in decodes}
    try:
        prod = prefill.producer
        assert prod is not None
        for name, side in decodes.items():
            side.register(d_tensors[name])
            with caplog.at_level(logging.WARNING, logger="kvxfer"):
                errors = load_held(prod, side, name, BLOCKS, T)
            _, d_bufs = spec_from_vllm_tensors(d_tensors[name], backend="CPU_ATTN",
                                               block_size=T, num_kv_heads=H)  # fmt: skip
            if name == "same":
                assert errors == set()
                assert mismatches(spec, d_bufs, spec, list(BLOCKS), list(BLOCKS)) == 0
            else:
                assert errors == set(BLOCKS)  # to vLLM's kv_load_failure_policy
                assert all(int(t.sum()) == 0 for t in d_tensors[name])  # not a byte
                (line,) = [r.getMessage() for r in caplog.records if "d-other" in r.getMessage()]
                assert "IncompatibleError" in line and "compat hash mismatch" in line, line
                assert "the models differ in kv_dtype: 'fp8_e5m2' there, 'fp8_e4m3' here" in line
    finally:
        for side in (prefill, *decodes.values()):
            side.close()
