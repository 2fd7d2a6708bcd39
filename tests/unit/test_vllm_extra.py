"""``kv_connector_extra_config``: one table of keys and defaults (``ExtraConfig``), read
once per connector by ``parse_extra``; unknown keys are refused by name; the docs'
configuration table says what the code does."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm.extra import _CHECKS, KEYS, READ_TOGETHER, ExtraConfig, parse_extra
from kvxfer.integrations.vllm.worker import WorkerSettings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
KEY = "0123456789abcdef0123456789abcdef"


def test_no_keys_give_the_defaults_of_the_table() -> None:
    got = parse_extra({}, env={})
    assert got == ExtraConfig()
    assert (got.deadline_s, got.lease_s, got.heartbeat_s, got.silence_s) == (30.0, 120.0, 1.0, 10.0)
    assert (got.side_channel_host, got.side_channel_port) == ("127.0.0.1", 0)
    assert (got.preconnect_s, got.idle_wait_s, got.hold_slots) == (600.0, 0.002, 65536)
    assert (got.transfer_mode, got.prefill_peers, got.allowed_prefills) == ("pull", (), None)
    assert (got.model_name, got.auth_key) == ("", None)
    assert parse_extra(None, env={}) == ExtraConfig()  # vLLM passes {} or nothing


def test_every_field_of_the_table_has_its_check() -> None:
    # a field without one would be a known key that parse_extra silently drops
    assert set(_CHECKS) | READ_TOGETHER == {f.name for f in dataclasses.fields(ExtraConfig)}
    assert set(_CHECKS) | READ_TOGETHER | {"auth_key_file"} == KEYS


def test_every_key_is_parsed_and_checked() -> None:
    got = parse_extra(
        {
            "side_channel_host": "10.0.0.7", "side_channel_port": "5700", "deadline_s": "45",
            "lease_s": 200, "heartbeat_s": 0.5, "silence_s": 0, "model_name": "m",
            "prefill_peers": ["tcp://10.0.0.5:5700"], "preconnect_s": 30,
            "idle_wait_s": 0, "hold_slots": "1024", "transfer_mode": "push",
            "allowed_prefills": ["10.0.0.0/24"],
        },
        env={"KVXFER_AUTH_KEY": KEY},
    )  # fmt: skip
    assert (got.side_channel_host, got.side_channel_port) == ("10.0.0.7", 5700)
    assert (got.deadline_s, got.lease_s, got.heartbeat_s, got.silence_s) == (45.0, 200.0, 0.5, 0.0)
    assert (got.model_name, got.prefill_peers) == ("m", ("tcp://10.0.0.5:5700",))
    assert (got.preconnect_s, got.idle_wait_s, got.hold_slots) == (30.0, 0.0, 1024)
    assert got.transfer_mode == "push" and got.allowed_prefills is not None
    assert got.auth_key == KEY.encode()
    assert KEY not in repr(got)  # a secret never reaches a log line


def test_an_unknown_key_is_refused_by_name_with_the_nearest_known_one() -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.deadline is not a kvxfer "
                       r"key.*did you mean 'deadline_s'"):  # fmt: skip
        parse_extra({"deadline": 5}, env={})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.backends .*known keys: "):
        parse_extra({"backends": ["UCX"]}, env={})  # NixlConnector's key: no silent default


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"side_channel_port": 70000}, r"side_channel_port must be a port"),
        ({"side_channel_port": "x"}, r"side_channel_port must be a port"),
        ({"side_channel_port": True}, r"side_channel_port must be a port"),
        ({"side_channel_port": "\u00b2"}, r"side_channel_port must be a port"),  # isdigit, not int
        ({"side_channel_port": "\u0667"}, r"side_channel_port must be a port"),  # int() takes it
        ({"hold_slots": "\u00b2"}, r"hold_slots must be an integer"),
        ({"side_channel_host": ""}, r"side_channel_host must be a host"),
        ({"side_channel_host": 5}, r"side_channel_host must be a host"),
        ({"model_name": ""}, r"model_name must be a non-empty string"),
        ({"preconnect_s": "soon"}, r"preconnect_s must be a number of seconds"),
        ({"deadline_s": 7200}, r"extra_config\.deadline_s must be at most 3600 seconds"),
        ({"prefill_peers": ["tcp://10.0.1.5:5700"], "allowed_prefills": ["10.0.0.0/24"]},
         r"prefill_peers: tcp://10.0.1.5:5700"),
        ({"auth_key": KEY}, r"auth_key is refused"),
    ],
)  # fmt: skip
def test_bad_values_name_their_key(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_extra(extra, env={})


def test_the_extra_config_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config must be an object"):
        parse_extra(["deadline_s", 5], env={})  # type: ignore[arg-type]


def test_the_worker_settings_take_their_keys_from_the_table() -> None:
    extra = parse_extra({"lease_s": 7, "transfer_mode": "push"}, env={})
    s = WorkerSettings("e", 0, 1, 16, 2, "CPU_ATTN", True, True, "tiny", "float16", extra=extra)
    assert (s.extra.lease_s, s.extra.transfer_mode, s.extra.deadline_s) == (7.0, "push", 30.0)
    assert WorkerSettings("e", 0, 1, 16, 2, "CPU_ATTN", True, True, "t", "f").extra == ExtraConfig()
    names = {f.name for f in dataclasses.fields(WorkerSettings)}
    assert not names & (set(KEYS) - {"model_name"}), "a key's default written twice"


def _documented() -> dict[str, str]:
    """docs/vllm.md's configuration table: key -> its default column, as written."""
    text = DOCS.read_text()
    table = text[text.index("| `kv_connector_extra_config` key |") :].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| .* \|$", table, re.MULTILINE)
    assert len(rows) == table.count("\n") - 1, "a row of the table not in the expected form"
    return dict(rows)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, tuple):
        return f"`{list(value)}`"
    return f'`"{value}"`' if value in ("pull", "push") else f"`{value}`"


def test_the_docs_table_lists_every_key_with_the_codes_default() -> None:
    documented = _documented()
    assert set(documented) == set(KEYS) - {"auth_key"}, "a key missing from or extra in the docs"
    special = {"model_name": "where vLLM loaded the weights from: `--model` (a Hub id or a "
               "path), with `@<revision>` when `--revision` is set", "allowed_prefills": "any",
               "auth_key_file": "none"}  # fmt: skip
    defaults = ExtraConfig()
    for key, written in documented.items():
        want = special.get(key) or _shown(getattr(defaults, key))
        assert written == want, f"docs/vllm.md: {key} default {written}, the code has {want}"


def test_the_scheduler_role_checks_the_key_settings_without_reading_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # only the workers' engines use the key: the scheduler process never holds it
    path = tmp_path / "kvxfer.key"
    path.write_text(KEY)
    path.chmod(0o644)  # readable by others: the warning is the workers' to give
    with caplog.at_level("WARNING", logger="kvxfer"):
        got = parse_extra({"auth_key_file": str(path)}, env={}, read_key=False)
    assert got.auth_key is None and caplog.records == []
    # nothing is opened: a file only the workers' host has does not stop the scheduler
    assert parse_extra({"auth_key_file": str(tmp_path / "nope")}, env={},
                       read_key=False).auth_key is None  # fmt: skip
    assert parse_extra({}, env={"KVXFER_AUTH_KEY": KEY}, read_key=False).auth_key is None
    # what can be checked without the key still is
    with pytest.raises(ConfigError, match=r"auth_key_file must be a path"):
        parse_extra({"auth_key_file": 7}, env={}, read_key=False)
    with pytest.raises(ConfigError, match=r"auth_key is refused") as e:
        parse_extra({"auth_key": KEY}, env={}, read_key=False)
    assert KEY not in str(e.value)
    # the workers' side reads it, as before
    assert parse_extra({"auth_key_file": str(path)}, env={}).auth_key == KEY.encode()
