"""kvxfer inside vLLM: a v1 KV connector (:class:`KvxferConnector`).

Load it with ``"kv_connector_module_path": "kvxfer.integrations.vllm"`` and
``"kv_connector": "KvxferConnector"``. Importing this package does not import vLLM;
the connector class does (on first access).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    if name in {"KvxferConnector", "KvxferMetadata", "KvxferHandshake"}:
        return getattr(importlib.import_module("kvxfer.integrations.vllm.connector"), name)
    raise AttributeError(f"module 'kvxfer.integrations.vllm' has no attribute {name!r}")
