"""The vLLM worker side with a deployment key: engines built by ``register`` from vLLM-
shaped tensors seal their control plane, a keyed decode reads a keyed prefill's bytes
exactly, and a decode without the key, or with another key, gets a failed load (vLLM's
``kv_load_failure_policy``), never a byte. Real NIXL and ZMQ in one process; no vLLM
(the real-vLLM case is in tests/vllm)."""

from __future__ import annotations

import logging
import time

import pytest

from kvxfer.errors import AuthError
from kvxfer.integrations.vllm.extra import ExtraConfig
from kvxfer.integrations.vllm.layouts import spec_from_vllm_tensors
from kvxfer.integrations.vllm.worker import WorkerSettings, WorkerSide
from kvxfer.testing import fill, mismatches
from kvxfer.transport.side_client import fetch_records
from tests.integration.vllm_worker_util import load_held

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

KEY = b"K" * 32
NB, H, T, D, LAYERS = 16, 2, 16, 8, 3
BLOCKS = (3, 4, 5)


def _tensors() -> list[object]:
    return [torch.zeros(NB, H, T, 2 * D) for _ in range(LAYERS)]


def _side(role: str, key: bytes | None) -> WorkerSide:
    prod = role == "p"
    return WorkerSide(WorkerSettings(f"auth-{role}", 0, 1, T, H, "CPU_ATTN", prod, not prod,
                                     "tiny", "float32", extra=ExtraConfig(auth_key=key)))  # fmt: skip


def test_settings_never_show_the_key() -> None:
    assert "KKKK" not in repr(_side("d", KEY).settings)


def test_keyed_vllm_engines_move_exact_bytes_and_refuse_the_unkeyed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p_tensors = _tensors()
    prefill = _side("p", KEY)
    prefill.register(p_tensors)
    spec, p_bufs = spec_from_vllm_tensors(p_tensors, backend="CPU_ATTN", block_size=T,
                                          num_kv_heads=H)  # fmt: skip
    fill(spec, p_bufs)  # (layer, block, head, token, byte) into vLLM's tensors
    decodes = {name: _side("d", key) for name, key in
               [("keyed", KEY), ("unkeyed", None), ("other-key", b"O" * 32)]}  # fmt: skip
    d_tensors = {name: _tensors() for name in decodes}
    try:
        assert prefill.producer is not None
        prod = prefill.producer
        with pytest.raises(AuthError, match="requires authentication"):  # keyed
            fetch_records(prod.address, None, prod.compat_hash, 2.0)
        for name, side in decodes.items():
            side.register(d_tensors[name])
        for name, side in decodes.items():
            with caplog.at_level(logging.WARNING, logger="kvxfer"):
                errors = load_held(prod, side, name, BLOCKS, T)
            _, d_bufs = spec_from_vllm_tensors(d_tensors[name], backend="CPU_ATTN",
                                               block_size=T, num_kv_heads=H)  # fmt: skip
            bad = mismatches(spec, d_bufs, spec, list(BLOCKS), list(BLOCKS))
            if name == "keyed":
                assert errors == set() and bad == 0
            else:
                assert errors == set(BLOCKS), name  # to kv_load_failure_policy
                assert all(float(t.abs().sum()) == 0 for t in d_tensors[name]), name
                (line,) = [r.getMessage() for r in caplog.records if f"d-{name}" in r.getMessage()]
                assert "AuthError" in line, line
            caplog.clear()
        # what vLLM's stats path gets (get_kv_connector_stats): loads by end, bytes,
        # the first contact the keyed load waited for; the failed contacts count none
        block_bytes = sum(t[0].numel() * t.element_size() for t in d_tensors["keyed"])
        keyed = decodes["keyed"].take_stats()
        assert keyed is not None
        assert (keyed["loads_done"], keyed["load_bytes"]) == (1, len(BLOCKS) * block_bytes)
        assert keyed["first_contacts"] == 1 and len(keyed["first_contact_s"]) == 1
        for name in ("unkeyed", "other-key"):
            other = decodes[name].take_stats()
            assert other is not None
            assert (other["loads_failed"], other["loads_done"], other["first_contacts"]) == (
                1,
                0,
                0,
            )
        end = time.monotonic() + 5
        while (held := prefill.take_stats()) is None and time.monotonic() < end:
            prefill.finished()
            time.sleep(0.01)
        assert held is not None and held["released_read"] == 1  # the keyed decode's ReadDone
    finally:
        for side in (prefill, *decodes.values()):
            side.close()
