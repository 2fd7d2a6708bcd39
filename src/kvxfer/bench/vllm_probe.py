"""A profiling wrapper of :class:`~kvxfer.integrations.vllm.connector.KvxferConnector`
for ``kvxfer bench vllm`` (imports vLLM; runs inside vLLM's worker processes).

Behaves exactly like the connector; in addition, each decode-side load that ends is
written to the worker's log as one ``KVXFER_PROFILE {json}`` line: when the read was
started, posted and finished (``time.perf_counter``, CLOCK_MONOTONIC, so comparable with
the driver's clock), the peer's first-contact phases (``PeerInfo.timings_s``), whether
the peer was already contacted when the read started, and sizes.
Load it with ``kv_connector_module_path="kvxfer.bench.vllm_probe"``,
``kv_connector="ProfiledKvxferConnector"``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from kvxfer.engine import Transfer
from kvxfer.integrations.vllm.connector import KvxferConnector

__all__ = ["PROFILE_TAG", "ProfiledKvxferConnector"]

PROFILE_TAG = "KVXFER_PROFILE"
log = logging.getLogger(__name__)


class ProfiledKvxferConnector(KvxferConnector):
    """:class:`KvxferConnector` that logs the timeline of every finished load."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._probe_live: dict[str, Transfer] = {}
        self._probe_ready: dict[str, bool] = {}
        consumer = self._worker.consumer if self._worker is not None else None
        if consumer is None:
            return
        read = consumer.read

        def traced_read(request_id: str, *args: Any, **kwargs: Any) -> Transfer:
            t = read(request_id, *args, **kwargs)
            self._probe_live[request_id] = t
            self._probe_ready[request_id] = t.peer.ready.is_set()  # contact already done
            return t

        consumer.read = traced_read  # type: ignore[method-assign]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        out = super().get_finished(finished_req_ids)
        now = time.perf_counter()
        for rid, t in list(getattr(self, "_probe_live", {}).items()):
            if not t.state.is_terminal:
                continue
            del self._probe_live[rid]
            rec = {
                "request_id": rid, "state": t.state.value, "started_at": t.started_at,
                "posted_at": t.posted_at, "finished_at": t.finished_at, "reported_at": now,
                "num_descriptors": t.num_descriptors, "num_bytes": t.num_bytes,
                "peer_timings_s": dict(t.peer.timings_s), "peer_rows": t.peer.num_rows,
                "peer_descriptors": t.peer.num_descriptors,
                "peer_ready_at_read": self._probe_ready.pop(rid, False),
            }  # fmt: skip
            print(f"{PROFILE_TAG} {json.dumps(rec)}", file=sys.stderr, flush=True)
        return out
