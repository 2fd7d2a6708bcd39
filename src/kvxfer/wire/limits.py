"""Wire limits, versioning and the bounded decoder shared by records and messages.

Wire format of a handshake record (msgpack)::

    envelope = [compat_hash: str, payload: bin]      payload = msgpack(LayoutRecord)

:func:`decode_record` decodes the envelope only, compares ``compat_hash`` with the
local one, and only then decodes the payload; every size is bounded before
anything is allocated (see the ``MAX_*`` constants). Notifications are a tagged
union (tag field ``"t"``) of small Structs, as are side-channel requests/replies.

Schema evolution rules (``SCHEMA_VERSION`` = 2; 2 added attempt ids, whose meaning
-- a notice for an attempt that is not live is dropped -- old peers cannot honour):

1. A new field is appended with a default, so old payloads still decode; decoders
   ignore fields they do not know, so new payloads decode on old peers.
2. A field's type and meaning never change; a field is never renamed or removed
   (deprecate it and keep decoding it).
3. Tags (``"t"``) are never reused; a new message gets a new tag.
4. Anything else (a changed meaning, a removed field) bumps ``SCHEMA_VERSION``,
   which is part of :func:`compat_hash`, so old and new peers refuse each other
   with :class:`IncompatibleError` instead of misreading each other.
5. A field's bounds may narrow only to refuse what no earlier sender sent within
   its documented settings (``budget_ms`` at most an hour, as ``deadline_s`` is; a
   consumer rank below its consumer size):
   such a value only ever came from a forger or a bug.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from kvxfer.errors import ProtocolError

SCHEMA_VERSION = 3  # 3: a hold-table slot is 32 bytes (word, reserved, binding digest)

MAX_RECORD_BYTES = 16 << 20  # one encoded envelope
MAX_AGENT_METADATA_BYTES = 8 << 20  # NIXL agent blobs: a few KB to ~1 MB
MAX_REGIONS = 65536
MAX_VIEWS = 1 << 20
MAX_COUNT = 1 << 32  # blocks in one view
MAX_DESCRIPTORS = 1 << 32  # sum of view counts (flat descriptor indices)
MAX_NAME_LEN = 256  # names, engine ids, agent names
MAX_HASH_LEN = 128
MAX_REQUEST_ID_LEN = 200
MAX_REASON_LEN = 1024
MAX_LEASE_IDS = 256
MAX_PUSH_IDS = 4096  # block ids per list in one PushRequest (fits MAX_MSG_BYTES)
MAX_BLOCK_ID = 1 << 40  # a logical block id on the wire (PushRequest.BlockIds)
MAX_SMALL_INT = 1 << 32  # SmallInt: sizes, ranks, counts of heads, layers...
MAX_U64 = (1 << 64) - 1  # U64: addresses, byte sizes, generations
MAX_MSG_BYTES = 64 << 10  # one notification / control message
MAX_HOLD_SLOTS = 1 << 24  # a producer rank's hold table (HOLD_SLOT_BYTES a slot: 512 MiB)
HOLD_SLOT_BYTES = 32  # a hold-table slot (kvxfer.engine.holds)
HOLD_DIGEST_BYTES = 16  # a hold's binding digest, in its slot and in notices
MAX_RANKS = 4096  # ranks named in one side-channel request or reply
MAX_SIDE_REQUEST_BYTES = 64 << 10
MAX_SIDE_REPLY_BYTES = 64 << 20
MAX_BUDGET_MS = 3_600_000  # a request's deadline budget on the wire: at most one hour

U64 = Annotated[int, Meta(ge=0)]  # msgpack cannot carry more than 2**64 - 1
SmallInt = Annotated[int, Meta(ge=0, le=MAX_SMALL_INT)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
BudgetMs = Annotated[int, Meta(ge=0, le=MAX_BUDGET_MS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_LEN)]
HashStr = Annotated[str, Meta(max_length=MAX_HASH_LEN)]
RequestId = Annotated[str, Meta(max_length=MAX_REQUEST_ID_LEN)]
HoldDigest = Annotated[bytes, Meta(max_length=HOLD_DIGEST_BYTES)]  # b"": none named
Reason = Annotated[str, Meta(max_length=MAX_REASON_LEN)]


_ENCODER = msgspec.msgpack.Encoder()

T = TypeVar("T")


def decode_bounded(dec: msgspec.msgpack.Decoder[T], buf: Any, what: str, max_bytes: int) -> T:
    """Decode ``buf`` with ``dec``; any failure or oversize becomes ProtocolError."""
    if not isinstance(buf, bytes | bytearray | memoryview):
        raise ProtocolError(f"{what}: expected bytes, got {type(buf).__name__}")
    if len(buf) > max_bytes:
        raise ProtocolError(f"{what}: {len(buf)} bytes exceeds the limit of {max_bytes}")
    try:
        return dec.decode(buf)
    except (msgspec.MsgspecError, RecursionError, ValueError, OverflowError) as e:
        raise ProtocolError(f"{what}: {e}") from None
