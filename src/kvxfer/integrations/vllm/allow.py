"""``allowed_prefills``: which prefill engines a decode may contact (pure).

vLLM's API takes ``kv_transfer_params`` from any client, and the params name the
prefill's side-channel address: without a list, a client can make the decode connect
to any host and port (with a deployment key it gets no further than a refused
handshake, but the connection is made). With a list, params naming a prefill outside
it are not loaded: the decode computes the prompt, before any block is allocated or
any connection made.

Entries: a host (any port), ``host:port``, ``[v6]:port``, ``tcp://host:port``, a
network (``10.0.0.0/24``, ``fd00::/8``; any port), or an exact ``ipc://`` endpoint.
Host names match case-insensitively as written, never resolved (resolution would be
slow and another thing to trust): list them the way the prefills publish their
addresses (``side_channel_host``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import ConfigError

__all__ = ["Allowed", "allowed_prefills", "is_decimal", "refuse_address"]

KEY = "kv_connector_extra_config.allowed_prefills"
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
Net = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Allowed:
    """One entry: an IP network, a host name, or an exact endpoint; ``port`` None: any."""

    net: Net | None = None
    name: str = ""
    exact: str = ""
    port: int | None = None


def is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit takes "²" (int() refuses it) and int() takes "٧"."""
    return text.isascii() and text.isdigit()


def _port(text: str) -> int | None:
    return int(text) if is_decimal(text) and 0 < int(text) < 65536 else None


def _host_port(text: str, port_required: bool) -> tuple[str, int | None] | None:
    """``(host, port)`` of ``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare
    IPv6 address; None if malformed."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else ""
    elif text.count(":") > 1:  # a bare IPv6 address: no port
        host, port_text = text, ""
    else:
        host, _, port_text = text.partition(":")
    port = _port(port_text) if port_text else None
    if not host or (port_text and port is None) or (port_required and port is None):
        return None
    return host, port


def _entry(text: Any) -> Allowed:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{KEY}: every entry must be a non-empty string, got {text!r}")
    t = text.strip()
    if t.startswith("ipc://") and len(t) > len("ipc://"):
        return Allowed(exact=t)
    try:
        if "/" in t and not t.startswith("tcp://"):
            return Allowed(net=ipaddress.ip_network(t, strict=False))
    except ValueError:
        raise ConfigError(f"{KEY}: {text!r} is not a network such as 10.0.0.0/24") from None
    hp = _host_port(t.removeprefix("tcp://"), port_required=t.startswith("tcp://"))
    if hp is None:
        raise ConfigError(
            f"{KEY}: {text!r} is not a host, host:port, tcp://host:port, network or ipc:// endpoint"
        )
    host, port = hp
    try:
        return Allowed(net=ipaddress.ip_network(host), port=port)
    except ValueError:
        if not _NAME.fullmatch(host):
            raise ConfigError(f"{KEY}: {text!r}: {host!r} is not a host name") from None
        return Allowed(name=host.lower(), port=port)


def allowed_prefills(value: Any) -> tuple[Allowed, ...] | None:
    """The extra-config value: None (unset: any prefill may be contacted) or a list.

    Raises:
        ConfigError: naming the key, for anything but a list of valid entries.
    """
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ConfigError(
            f'{KEY} must be a list such as ["10.0.0.5", "10.0.1.0/24"], got {value!r}'
        )
    return tuple(_entry(v) for v in value)


def _allows(entry: Allowed, endpoint: str, host_port: tuple[str, int | None] | None) -> bool:
    """``host_port``: ``endpoint``'s host and port if it is a ``tcp://`` endpoint."""
    if entry.exact:
        return endpoint == entry.exact
    if host_port is None:
        return False
    host, port = host_port
    if entry.port is not None and port != entry.port:
        return False
    if entry.net is not None:
        try:
            return ipaddress.ip_address(host) in entry.net
        except ValueError:
            return False
    return host.lower() == entry.name


def refuse_address(address: str, allowed: tuple[Allowed, ...] | None) -> str:
    """Why a decode may not contact ``address`` (its endpoints, comma-separated); ""
    if it may (every endpoint allowed, or no list)."""
    if allowed is None:
        return ""
    for endpoint in (e.strip() for e in address.split(",")):
        hp = (
            _host_port(endpoint[len("tcp://") :], port_required=True)
            if endpoint.startswith("tcp://")
            else None
        )
        if not any(_allows(a, endpoint, hp) for a in allowed):
            return f"its prefill endpoint {endpoint} is not in allowed_prefills"
    return ""
