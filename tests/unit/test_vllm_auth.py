"""The vLLM connector's deployment key (``auth_key_file`` or ``KVXFER_AUTH_KEY``): where
it comes from, and the errors that name a bad one without printing it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm.extra import auth_key

KEY = "0123456789abcdef0123456789abcdef"


def _file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "kvxfer.key"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_a_key_file_gives_its_key_without_the_trailing_newline(tmp_path: Path) -> None:
    assert auth_key(_file(tmp_path, KEY + "\n"), None, env={}) == KEY.encode()


def test_the_file_wins_over_the_environment(tmp_path: Path) -> None:
    other = "f" * 32
    assert auth_key(_file(tmp_path, KEY), None, env={"KVXFER_AUTH_KEY": other}) == KEY.encode()


def test_without_a_file_the_environment_gives_the_key_or_none() -> None:
    assert auth_key(None, None, env={"KVXFER_AUTH_KEY": KEY}) == KEY.encode()
    assert auth_key(None, None, env={}) is None
    assert auth_key(None, None, env={"KVXFER_AUTH_KEY": ""}) is None


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.key")
    with pytest.raises(ConfigError, match=r"auth_key_file.*nope\.key"):
        auth_key(path, None, env={})


@pytest.mark.parametrize("text", ["short\n", "\n", ""])
def test_a_short_key_is_refused_without_printing_it(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="auth_key_file") as e:
        auth_key(_file(tmp_path, text), None, env={})
    assert "at least 16 bytes" in str(e.value)
    assert "short" not in str(e.value).replace(str(tmp_path), "")


def test_a_short_key_in_the_environment_is_refused() -> None:
    with pytest.raises(ConfigError, match="KVXFER_AUTH_KEY"):
        auth_key(None, None, env={"KVXFER_AUTH_KEY": "short"})


@pytest.mark.parametrize("bad", [1, ["a"], "", "  "])
def test_a_file_value_that_is_not_a_path_is_named(bad: object) -> None:
    with pytest.raises(ConfigError, match="auth_key_file must be a path"):
        auth_key(bad, None, env={})


def test_a_key_written_into_the_config_is_refused_without_echoing_it() -> None:
    # vLLM logs its whole configuration at start: a key there would be in every log
    with pytest.raises(ConfigError, match=r"auth_key_file\) or KVXFER_AUTH_KEY") as e:
        auth_key(None, KEY, env={})
    assert KEY not in str(e.value)


def test_a_key_file_others_may_read_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert auth_key(_file(tmp_path, KEY, 0o644), None, env={}) == KEY.encode()
    (rec,) = [r for r in caplog.records if "auth_key_file" in r.getMessage()]
    assert "0644" in rec.getMessage() and "chmod 600" in rec.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        auth_key(_file(tmp_path, KEY, 0o600), None, env={})
    assert caplog.records == []
