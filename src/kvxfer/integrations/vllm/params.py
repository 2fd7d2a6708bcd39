"""The ``kv_transfer_params`` a prefill returns and a decode request carries (pure).

vLLM's request-side convention is kept, so proxies and routers work unchanged: the
prefill request carries ``{"do_remote_decode": true}``; the prefill's output carries
the dict composed here, which the proxy passes unchanged to the decode request.
Every field is plain JSON (the producer generations travel as hex strings: 63-bit
integers do not survive a JavaScript proxy).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.errors import ProtocolError

__all__ = [
    "PARAMS_VERSION",
    "RemotePrefill",
    "compose_params",
    "parse_params",
    "prompt_context",
    "prompt_hash",
]

PARAMS_VERSION = 3  # 2: prompt_hash (params name their prompt); 3: hold_ticket
PROMPT_HASH_HEX = 32
MAX_BLOCK_IDS = 1 << 20  # blocks of one request
MAX_RANKS = 4096
MAX_STR = 4096


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """What a decode needs to read a request's KV from the prefill engine that holds it.

    Attributes:
        engine_id: the prefill engine's id (its ``kv_transfer_config.engine_id``).
        request_id: the prefill's request id: the producer holds the blocks under it.
        address: the producer's side-channel endpoints, comma-separated, one per TP rank.
        generations: the incarnation of each producer rank that holds the blocks.
        block_ids: the prefill's block ids of the request, in token order.
        block_size: tokens per block on the prefill.
        tp_size: the prefill engine's tensor-parallel size.
        num_tokens: prompt tokens whose KV the prefill computed.
        lease_expires_at_ms: no later than this (prefill wall clock, ms since the epoch)
            the prefill may reuse the blocks: the decode never reads after it. None:
            not stated.
        prompt_hash: :func:`prompt_hash` of the prefill's prompt: a decode request
            with another prompt does not take this KV.
        hold_ticket: the producers' hold ticket for the blocks
            (:mod:`kvxfer.engine.holds`): the decode's READ is DONE only if the hold was
            alive after the bytes were copied.
    """

    engine_id: str
    request_id: str
    address: str
    generations: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_size: int
    tp_size: int
    num_tokens: int
    lease_expires_at_ms: int | None = None
    prompt_hash: str = ""
    hold_ticket: int = 0

    @property
    def generation_map(self) -> dict[int, int]:
        """``{producer rank: generation}`` as :meth:`kvxfer.engine.Consumer.read` takes it."""
        return dict(enumerate(self.generations))


def compose_params(remote: RemotePrefill) -> dict[str, Any]:
    """The prefill's ``kv_transfer_params`` for the decode request (JSON-safe)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": remote.engine_id,
        "remote_block_ids": list(remote.block_ids),
        "tp_size": remote.tp_size,
        "kvxfer": {
            "version": PARAMS_VERSION,
            "request_id": remote.request_id,
            "address": remote.address,
            "generations": [f"{g:x}" for g in remote.generations],
            "block_size": remote.block_size,
            "num_tokens": remote.num_tokens,
            "lease_expires_at_ms": remote.lease_expires_at_ms,
            "prompt_hash": remote.prompt_hash,
            "hold_ticket": remote.hold_ticket,
        },
    }


def _field(d: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in d:
        raise ProtocolError(f"kv_transfer_params: {where}{key} is missing")
    v = d[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ProtocolError(f"kv_transfer_params: {where}{key} must be an integer, got {v!r:.80}")
    if kind is str and (not isinstance(v, str) or len(v) > MAX_STR):
        raise ProtocolError(f"kv_transfer_params: {where}{key} must be a string (<= {MAX_STR})")
    if kind is list and not isinstance(v, list | tuple):
        raise ProtocolError(f"kv_transfer_params: {where}{key} must be a list")
    if kind is dict and not isinstance(v, Mapping):
        raise ProtocolError(f"kv_transfer_params: {where}{key} must be an object")
    return v


def _ints(v: Sequence[Any], name: str, limit: int, upper: int) -> tuple[int, ...]:
    if len(v) > limit:
        raise ProtocolError(f"kv_transfer_params: {name} has {len(v)} entries (max {limit})")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < upper for x in v):
        raise ProtocolError(f"kv_transfer_params: {name} must hold integers in [0, {upper})")
    return tuple(int(x) for x in v)


def prompt_hash(token_ids: Sequence[int], context: Sequence[Sequence[str]] = ()) -> str:
    """A prompt's fingerprint in the params: BLAKE2b-128 of its token ids as little-endian
    int64, then (when there is any) its ``context`` (:func:`prompt_context`) as JSON,
    hex. Tells a decode whether params were made for its prompt (a proxy that sent one
    prefill's params with several prompts, or with another LoRA adapter, cache salt or
    image under the same token ids); not a defence against forgery (that is the auth
    key's job). A text prompt's hash is its token ids' alone."""
    h = hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(),
                        digest_size=PROMPT_HASH_HEX // 2)  # fmt: skip
    if context:
        h.update(b"\0" + json.dumps([list(c) for c in context]).encode())
    return h.hexdigest()


def prompt_context(request: Any) -> tuple[tuple[str, ...], ...]:
    """What decides a request's KV besides its token ids, as vLLM's request holds it:
    its LoRA adapter (by name: the instances of one deployment load an adapter under
    one name, perhaps from different paths, so its path is left out, though vLLM's own
    prefix cache keys on it too), its ``cache_salt``, and each multimodal input's
    content hash and place. Attributes an engine's requests lack count as absent."""
    out: list[tuple[str, ...]] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        out.append(("lora", str(getattr(lora, "lora_name", lora))))
    salt = getattr(request, "cache_salt", None)
    if salt:
        out.append(("salt", str(salt)))
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        out.append(("mm", str(getattr(f, "identifier", "")), str(getattr(pos, "offset", "")),
                    str(getattr(pos, "length", ""))))  # fmt: skip
    return tuple(out)


def parse_params(params: Mapping[str, Any] | None) -> RemotePrefill | None:
    """The remote prefill a decode request names, or None when it names none.

    Raises:
        ProtocolError: the params are not an object (a client may send any JSON value),
            or ``do_remote_prefill`` is set but a field is missing, of the wrong
            type, out of bounds, or written by another kvxfer params version (the
            message names the field).
    """
    if not params:
        return None
    if not isinstance(params, Mapping):  # vLLM passes on any JSON a client sent
        raise ProtocolError(
            f"kv_transfer_params must be an object, got {type(params).__name__} {params!r:.80}"
        )
    if not params.get("do_remote_prefill"):
        return None
    x = _field(params, "kvxfer", dict, "")
    version = _field(x, "version", int, "kvxfer.")
    if version != PARAMS_VERSION:
        raise ProtocolError(
            f"kv_transfer_params: kvxfer.version is {version}, expected {PARAMS_VERSION}"
        )
    gens_hex = _field(x, "generations", list, "kvxfer.")
    if not 1 <= len(gens_hex) <= MAX_RANKS:
        raise ProtocolError(f"kv_transfer_params: kvxfer.generations has {len(gens_hex)} entries")
    try:
        gens = tuple(int(g, 16) for g in gens_hex if isinstance(g, str) and len(g) <= 16)
    except ValueError:
        gens = ()
    if len(gens) != len(gens_hex):
        raise ProtocolError("kv_transfer_params: kvxfer.generations must be hex strings")
    tp_size = _field(params, "tp_size", int, "")
    if tp_size != len(gens):
        raise ProtocolError(
            f"kv_transfer_params: tp_size {tp_size} != {len(gens)} generations (one per rank)"
        )
    address = _field(x, "address", str, "kvxfer.")
    if len([a for a in address.split(",") if a.strip()]) not in (1, tp_size):
        raise ProtocolError(
            f"kv_transfer_params: kvxfer.address names {address.count(',') + 1} endpoints "
            f"for tp_size {tp_size}"
        )
    block_size = _field(x, "block_size", int, "kvxfer.")
    num_tokens = _field(x, "num_tokens", int, "kvxfer.")
    block_ids = _ints(_field(params, "remote_block_ids", list, ""), "remote_block_ids",
                      MAX_BLOCK_IDS, 1 << 40)  # fmt: skip
    if block_size <= 0 or not 0 <= num_tokens <= len(block_ids) * block_size:
        raise ProtocolError(
            f"kv_transfer_params: kvxfer.num_tokens {num_tokens} does not fit "
            f"{len(block_ids)} blocks of {block_size} tokens"
        )
    lease_ms = x.get("lease_expires_at_ms")
    if lease_ms is not None and (isinstance(lease_ms, bool) or not isinstance(lease_ms, int)
                                 or not 0 < lease_ms < 1 << 53):  # fmt: skip
        raise ProtocolError("kv_transfer_params: kvxfer.lease_expires_at_ms must be an integer")
    digest = _field(x, "prompt_hash", str, "kvxfer.")
    if len(digest) != PROMPT_HASH_HEX or not set(digest) <= set("0123456789abcdef"):
        raise ProtocolError(
            f"kv_transfer_params: kvxfer.prompt_hash must be {PROMPT_HASH_HEX} lowercase hex digits"
        )
    ticket = _field(x, "hold_ticket", int, "kvxfer.")
    if not 0 < ticket < 1 << 53:
        raise ProtocolError(f"kv_transfer_params: kvxfer.hold_ticket {ticket} not in [1, 2**53)")
    return RemotePrefill(
        engine_id=_field(params, "remote_engine_id", str, ""),
        request_id=_field(x, "request_id", str, "kvxfer."),
        address=address,
        generations=gens,
        block_ids=block_ids,
        block_size=block_size,
        tp_size=tp_size,
        num_tokens=num_tokens,
        lease_expires_at_ms=lease_ms,
        prompt_hash=digest,
        hold_ticket=ticket,
    )
