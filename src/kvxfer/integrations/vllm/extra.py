"""``kv_connector_extra_config``: the connector's keys, their defaults and their checks.

:class:`ExtraConfig` is the one table of what a user may configure: each field is a key
(``auth_key`` comes from ``auth_key_file`` or ``$KVXFER_AUTH_KEY``) and each field's
default is the key's default, written nowhere else. :func:`parse_extra` reads a
connector's whole extra config once, in both roles: every value is checked (the key
file is read only in the workers' role, whose engines use it), and a key
kvxfer does not know (a typo such as ``deadline``, or another connector's key) is
refused by name at start instead of being ignored. A bad value raises
:class:`~kvxfer.errors.ConfigError` naming ``kv_connector_extra_config.<key>``.

Pure, except that the deployment key is read from its file or the environment.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvxfer.engine.config import MAX_DEADLINE_S, check_hold_slots, check_seconds
from kvxfer.errors import ConfigError, LayoutError
from kvxfer.integrations.vllm.allow import Allowed, allowed_prefills, is_decimal, refuse_address
from kvxfer.wire.auth import ENV_KEY, MIN_KEY_BYTES, load_auth_key

__all__ = [
    "KEYS",
    "ExtraConfig",
    "auth_key",
    "hold_slots",
    "idle_wait",
    "parse_extra",
    "peer_list",
    "seconds",
    "transfer_mode",
]

log = logging.getLogger(__name__)

PREFIX = "kv_connector_extra_config"
MAX_KEY_FILE_BYTES = 4096  # a key file longer than this is not a key file


@dataclass(frozen=True, slots=True)
class ExtraConfig:
    """Every ``kv_connector_extra_config`` key, checked; a field's default is the key's.

    docs/vllm.md's configuration table says what each does (a test keeps the two equal).
    """

    side_channel_host: str = "127.0.0.1"  # what the prefill workers bind and advertise
    side_channel_port: int = 0  # 0: an ephemeral port per worker; N: rank r binds N + r
    deadline_s: float = 30.0  # a load not done by then fails
    lease_s: float = 120.0  # how long a prefill holds blocks nobody reads
    heartbeat_s: float = 1.0  # decode-side liveness checks and lease renewals
    silence_s: float = 10.0  # a prefill silent this long (and 3 heartbeats) is dropped
    model_name: str = ""  # in the compatibility hash; "": the model's path or Hub id
    prefill_peers: tuple[str, ...] = ()  # producer addresses to contact at start
    preconnect_s: float = 600.0  # how long to keep trying an unreachable one
    idle_wait_s: float = 0.002  # a step that ran no tokens waits this long for a transfer
    hold_slots: int = 1 << 16  # the producer's hold table (kvxfer.engine.holds)
    transfer_mode: str = "pull"  # decode side: "pull" (READ) or "push" (the prefill WRITEs)
    allowed_prefills: tuple[Allowed, ...] | None = None  # None: any prefill
    auth_key: bytes | None = field(default=None, repr=False)  # a secret: never in repr or logs


def peer_list(value: Any, allowed: tuple[Allowed, ...] | None = None) -> tuple[str, ...]:
    """The ``prefill_peers`` extra-config value: a JSON list of producer addresses (each
    as the prefill publishes it: its ranks' endpoints, comma-separated), each in
    ``allowed`` (the ``allowed_prefills`` list; None: any).

    Raises:
        ConfigError: naming the key, for anything but a list of non-empty strings, or
            an address ``allowed`` refuses.
    """
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ConfigError(
            f"{PREFIX}.prefill_peers must be a list of addresses such as "
            f'["tcp://10.0.0.5:5700"], got {value!r}'
        )
    if not all(isinstance(a, str) and a.strip() for a in value):
        raise ConfigError(f"{PREFIX}.prefill_peers: not all non-empty strings: {value!r}")
    for address in value:
        if why := refuse_address(address, allowed):
            raise ConfigError(f"{PREFIX}.prefill_peers: {address}: {why}")
    return tuple(value)


def seconds(
    name: str, value: Any, *, allow_zero: bool = False, max_s: float | None = None
) -> float:
    """The extra-config value of key ``name`` as seconds: a finite number > 0 (>= 0 with
    ``allow_zero``). A numeric string is taken (JSON from a command line may quote it).

    Raises:
        ConfigError: naming the key, for anything else.
    """
    key = f"{PREFIX}.{name}"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{key} must be a number of seconds, got {value!r}") from None
    return check_seconds(key, value, allow_zero=allow_zero, max_s=max_s)


def idle_wait(value: Any) -> float:
    """The ``idle_wait_s`` extra-config value: seconds (0 to 1) a step that ran no tokens
    may wait for a transfer to end (:meth:`WorkerSide.finished`); 0 turns it off. A
    numeric string is taken, like the other keys' values.

    Raises:
        ConfigError: naming the key, for anything but such a number.
    """
    value_s = seconds("idle_wait_s", value, allow_zero=True)
    if value_s > 1.0:
        raise ConfigError(f"{PREFIX}.idle_wait_s must be at most 1 second, "
                          f"got {value!r}")  # fmt: skip
    return value_s


def hold_slots(value: Any) -> int:
    """The ``hold_slots`` extra-config value: requests a prefill rank holds at once (its
    hold table, 8 bytes a slot). A numeric string is taken.

    Raises:
        ConfigError: naming the key, for anything but an integer in [1, 2**24].
    """
    if isinstance(value, str) and is_decimal(value.strip()):
        value = int(value)
    return check_hold_slots(f"{PREFIX}.hold_slots", value)


def transfer_mode(value: Any) -> str:
    """The ``transfer_mode`` extra-config value (decode side): ``"pull"`` (the decode
    READs the prefill's blocks) or ``"push"`` (the decode asks the prefill to WRITE
    them into its blocks).

    Raises:
        ConfigError: naming the key, for anything else.
    """
    if value not in ("pull", "push"):
        raise ConfigError(f'{PREFIX}.transfer_mode must be "pull" or "push", got {value!r}')
    return str(value)


def auth_key(
    path: Any, inline: Any = None, env: Mapping[str, str] | None = None, *, read: bool = True
) -> bytes | None:
    """The deployment key of this instance's engines (:mod:`kvxfer.wire.auth`): the
    contents of the file named by the ``auth_key_file`` extra-config value (surrounding
    whitespace stripped), else ``$KVXFER_AUTH_KEY`` (from ``env``, default the process
    environment), else None: an unauthenticated control plane.

    ``inline`` is the ``auth_key`` extra-config value, refused when given: vLLM logs its
    whole configuration at start, so a key written there would be in every log. A key
    file that other users may read is used, with a warning. ``read`` False: check the
    two values and return None without opening the file or reading the environment.

    Raises:
        ConfigError: naming the key or the variable (never printing the key) for a path
            that is not a string, a file that cannot be read, or a key shorter than
            ``MIN_KEY_BYTES`` bytes.
    """
    if inline is not None:
        raise ConfigError(
            f"{PREFIX}.auth_key is refused: vLLM logs its configuration, so "
            "the key would be in every log; give it in a file (kv_connector_extra_config."
            f"auth_key_file) or {ENV_KEY}"
        )
    if path is None:
        if not read:
            return None
        try:
            return load_auth_key(None, env)
        except LayoutError as e:
            raise ConfigError(f"{ENV_KEY}: {e}") from None
    where = f"{PREFIX}.auth_key_file"
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{where} must be a path to a file holding the key, got {path!r}")
    if not read:
        return None
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o777
            key = f.read(MAX_KEY_FILE_BYTES + 1).strip()
    except OSError as e:
        raise ConfigError(f"{where} {path!r}: cannot read it ({e.strerror})") from None
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_FILE_BYTES:
        raise ConfigError(
            f"{where} {path!r}: the key must be at least {MIN_KEY_BYTES} bytes (and at most "
            f"{MAX_KEY_FILE_BYTES}), the file holds {len(key)}"
        )
    if mode & 0o077:
        log.warning("%s %s may be read by other users (mode %04o): chmod 600 it",
                    where, path, mode)  # fmt: skip
    return key


def _port(name: str, value: Any) -> int:
    if isinstance(value, str) and is_decimal(value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{PREFIX}.{name} must be a port in [0, 65535], got {value!r}")
    return value


def _host(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise ConfigError(f"{PREFIX}.{name} must be a host name or address, got {value!r}")
    return value


def _name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{PREFIX}.{name} must be a non-empty string, got {value!r}")
    return value


def _secs(allow_zero: bool = False) -> Callable[[str, Any], float]:
    return lambda name, value: seconds(name, value, allow_zero=allow_zero)


# key -> its check; the other keys (READ_TOGETHER) are read together in parse_extra
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "side_channel_host": _host,
    "side_channel_port": _port,
    "deadline_s": lambda name, value: seconds(name, value, max_s=MAX_DEADLINE_S),
    "lease_s": _secs(),
    "heartbeat_s": _secs(),
    "silence_s": _secs(allow_zero=True),
    "model_name": _name,
    "preconnect_s": _secs(),
    "idle_wait_s": lambda _, value: idle_wait(value),
    "hold_slots": lambda _, value: hold_slots(value),
    "transfer_mode": lambda _, value: transfer_mode(value),
}
READ_TOGETHER = frozenset({"prefill_peers", "allowed_prefills", "auth_key"})
# every key a user may write: ExtraConfig's fields, and the file the key is read from
KEYS: frozenset[str] = frozenset({f.name for f in fields(ExtraConfig)} | {"auth_key_file"})


def _unknown(key: object) -> ConfigError:
    near = difflib.get_close_matches(str(key), sorted(KEYS), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ConfigError(
        f"{PREFIX}.{key} is not a kvxfer key{hint} (known keys: {', '.join(sorted(KEYS))})"
    )


def parse_extra(
    extra: Mapping[str, Any] | None,
    env: Mapping[str, str] | None = None,
    *,
    read_key: bool = True,
) -> ExtraConfig:
    """The connector's ``kv_connector_extra_config`` (None: empty), every key checked.

    ``env``: where ``$KVXFER_AUTH_KEY`` is looked up (default the process environment).
    ``read_key`` False (the scheduler's role: only the workers' engines use the key):
    ``auth_key`` stays None, and neither the key file nor the environment is read, so
    the connector's scheduler side never holds the secret (with TP 1, vLLM runs a
    worker in the same process, whose side does) and does not repeat the workers'
    warning about the file's mode; ``auth_key_file`` is still checked to be a path and
    an inline ``auth_key`` is still refused.

    Raises:
        ConfigError: naming the key, for a key kvxfer does not know (with the nearest
            known one) or a bad value; nothing is half-applied, the connector does not start.
    """
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{PREFIX} must be an object of keys, got {extra!r:.80}")
    for key in extra:
        if key not in KEYS:
            raise _unknown(key)
    values = {key: check(key, extra[key]) for key, check in _CHECKS.items() if key in extra}
    allowed = allowed_prefills(extra.get("allowed_prefills"))
    return ExtraConfig(
        **values,
        prefill_peers=peer_list(extra.get("prefill_peers", []), allowed),
        allowed_prefills=allowed,
        auth_key=auth_key(extra.get("auth_key_file"), extra.get("auth_key"), env, read=read_key),
    )
