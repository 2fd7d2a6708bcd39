"""The connector's two roles, built from vLLM's own config and role classes (under the
vLLM venv's Python, no instance started: a few seconds): the deployment key is read
where the engines use it, in the workers, and never in the scheduler's process;
pipeline parallelism is refused by name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.vllm.conftest import _env, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BUILD = """
import json, sys, types
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm.connector import KvxferConnector

kv = KVTransferConfig(
    kv_connector="KvxferConnector", kv_role="kv_both", engine_id="roles",
    kv_connector_module_path="kvxfer.integrations.vllm.connector",
    kv_connector_extra_config={"auth_key_file": sys.argv[1]},
)
config = types.SimpleNamespace(
    kv_transfer_config=kv, cache_config=types.SimpleNamespace(block_size=32),
    parallel_config=types.SimpleNamespace(tensor_parallel_size=1,
                                          pipeline_parallel_size=int(sys.argv[2])),
)
out = {}
for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
    try:
        key = KvxferConnector(config, role, None)._extra.auth_key
        out[role.name] = "started, key " + ("none" if key is None else f"of {len(key)} bytes")
    except ConfigError as e:
        out[role.name] = f"ConfigError: {e}"
print(json.dumps(out))
"""


def _roles(key_file: Path, pp_size: int = 1) -> dict[str, str]:
    r = subprocess.run([vllm_python(), "-c", BUILD, str(key_file), str(pp_size)], capture_output=True,
                       text=True, timeout=240, env=_env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, str] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_only_the_worker_role_reads_the_key_file(vllm_ready: None, tmp_path: Path) -> None:
    key = tmp_path / "kvxfer.key"
    key.write_text("0123456789abcdef0123456789abcdef\n")
    key.chmod(0o600)
    assert _roles(key) == {"SCHEDULER": "started, key none", "WORKER": "started, key of 32 bytes"}
    # a file the scheduler would fail to read: it opens none, the workers refuse it by name
    got = _roles(tmp_path / "missing.key")
    assert got["SCHEDULER"] == "started, key none"
    assert got["WORKER"].startswith("ConfigError: kv_connector_extra_config.auth_key_file")
    assert "missing.key" in got["WORKER"] and "cannot read it" in got["WORKER"]
    # pipeline parallelism: each stage's workers hold other layers under the same TP
    # ranks (a decode would read another stage's layers); refused by name in both roles
    for role, text in _roles(key, pp_size=2).items():
        assert text.startswith(
            "ConfigError: kvxfer's connector does not support pipeline "
            "parallelism (pipeline_parallel_size 2)"
        ), (role, text)


GROUPS = """
import json, sys, types
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
    MLAAttentionSpec, SlidingWindowSpec,
)
from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm.connector import KvxferConnector

kv = KVTransferConfig(
    kv_connector="KvxferConnector", kv_role="kv_both", engine_id="groups",
    kv_connector_module_path="kvxfer.integrations.vllm.connector",
)
config = types.SimpleNamespace(
    kv_transfer_config=kv, cache_config=types.SimpleNamespace(block_size=32),
    parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
)
shape = dict(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
specs = {
    "full": FullAttentionSpec(**shape),
    "mla": MLAAttentionSpec(**{**shape, "num_kv_heads": 1}),
    "sliding": SlidingWindowSpec(**shape, sliding_window=64),
    "chunked": ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64),
}
out = {}
for name, spec in specs.items():
    kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.attn"], spec)])
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        try:
            KvxferConnector(config, role, kcc)
            out[f"{name} {role.name}"] = "started"
        except ConfigError as e:
            out[f"{name} {role.name}"] = f"ConfigError: {e}"
print(json.dumps(out))
"""


def test_caches_that_drop_blocks_are_refused_at_start(vllm_ready: None) -> None:
    # a sliding-window (or chunked local) cache: vLLM swaps the blocks a request no
    # longer attends to for its null block, in the prefill's offer and in the decode's
    # allocation; loads would name that one block many times, and a failed one would
    # report it as an error of every request that holds it
    r = subprocess.run([vllm_python(), "-c", GROUPS], capture_output=True, text=True,
                       timeout=240, env=_env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, str] = json.loads(r.stdout.strip().splitlines()[-1])
    for role in ("SCHEDULER", "WORKER"):
        assert out[f"full {role}"] == "started"
        assert out[f"mla {role}"] == "started"
        for name, spec in (
            ("sliding", "SlidingWindowSpec"),
            ("chunked", "ChunkedLocalAttentionSpec"),
        ):
            text = out[f"{name} {role}"]
            assert text.startswith("ConfigError: kvxfer's connector supports full-attention KV "
                                   f"caches only; group 0 is a {spec}"), (name, role, text)  # fmt: skip


SHUTDOWN = """
import json, logging, sys, types
logging.basicConfig(level=logging.WARNING)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvxfer.engine import Consumer, EngineConfig, allocate_cache
from kvxfer.integrations.vllm.connector import KvxferConnector
from kvxfer.integrations.vllm.extra import ExtraConfig
from kvxfer.integrations.vllm.worker import WorkerSettings, WorkerSide
from kvxfer.layout.presets import spec_for

kv = KVTransferConfig(kv_connector="KvxferConnector", kv_role="kv_both", engine_id="shut",
                      kv_connector_module_path="kvxfer.integrations.vllm.connector")
config = types.SimpleNamespace(
    kv_transfer_config=kv, cache_config=types.SimpleNamespace(block_size=32),
    parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
)
conn = KvxferConnector(config, KVConnectorRole.WORKER, None)
spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
cons = Consumer(EngineConfig("d", model_name="tiny-gqa"), [(spec, allocate_cache(spec))])
side = WorkerSide(WorkerSettings("e", 0, 1, 8, 2, "CPU_ATTN", True, True, "tiny-gqa",
                                 "float16", extra=ExtraConfig()))
side.consumer = cons
conn._worker = side
rank = cons.ranks[0]
close, calls = rank.close, []
fails = int(sys.argv[1])
def failing():
    calls.append(1)
    if len(calls) <= fails:
        raise RuntimeError("injected")
    close()
rank.close = failing
out = []
conn.shutdown()
out.append([conn._worker is side, side.consumer is cons, len(calls)])
conn.shutdown()
out.append([conn._worker is None, side.consumer is None, len(calls)])
print(json.dumps(out))
"""


def _shutdown(fails: int) -> tuple[list[list[object]], str]:
    r = subprocess.run([vllm_python(), "-c", SHUTDOWN, str(fails)], capture_output=True,
                       text=True, timeout=240, env=_env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_a_shutdown_that_failed_to_close_an_engine_tries_again(vllm_ready: None) -> None:
    """vLLM calls the worker connector's shutdown once, then drops it: an engine whose
    close raised (logged) is closed by a second try within that call; one that fails
    twice is kept (logged as left open), and a later shutdown closes it, instead of the
    connector dropping the only reference to an agent and memory still registered."""
    out, err = _shutdown(1)  # fails once: closed within the one shutdown vLLM makes
    assert out == [[False, False, 2], [True, True, 2]]
    assert "kvxfer close of the consumer failed" in err
    out, err = _shutdown(2)  # fails twice: kept, then closed by the next call
    assert out == [[True, True, 2], [True, True, 3]]
    assert "failed to close twice" in err
