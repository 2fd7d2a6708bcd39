"""``kvxfer demo`` refuses options it cannot run, naming them, before starting any process
(it used to end in a traceback, a busy loop or an empty error)."""

from __future__ import annotations

import pytest

from kvxfer.cli.demo_run import DemoOptions
from kvxfer.cli.main import main
from kvxfer.errors import ConfigError


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requests", "-1"], "--requests must be >= 1, got -1"),
        (["--requests", "0"], "--requests must be >= 1, got 0"),
        (["--inflight", "0"], "--inflight must be >= 1, got 0"),
        (["--blocks-per-request", "0"], "--blocks-per-request must be in [1, 256], got 0"),
        (["--blocks-per-request", "300"], "--blocks-per-request must be in [1, 256], got 300"),
        (["--num-blocks", "0"], "--num-blocks must be >= 1, got 0"),
    ],
)
def test_options_it_cannot_run_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["demo", *argv]) == 2
    assert f"kvxfer demo: error: {message}" in capsys.readouterr().err


def test_a_hybrid_pool_leaves_half_its_blocks_to_state() -> None:
    # attention ids come from the low half of a hybrid pool, state ids from the high half
    with pytest.raises(ConfigError, match=r"--blocks-per-request must be in \[1, 8\], got 9"):
        DemoOptions(preset="tiny-mamba2", num_blocks=16, blocks_per_request=9).check()
    DemoOptions(preset="tiny-mamba2", num_blocks=16, blocks_per_request=8).check()
