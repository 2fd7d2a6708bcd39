"""Shared output helpers for benchmarks and CLI commands: tables, JSON, PNG charts.

- :func:`print_table`: one rich table from column names and rows.
- :func:`machine_info` / :func:`write_json`: a result document stamped with the machine.
- :func:`dumps_json`: JSON with flat lists kept on one line (readable, diffable).
- :func:`save_loglog_png`: a log-log line chart through matplotlib's Agg backend.
- :func:`progress_bar`: a rich progress bar on stderr; :func:`markdown_table`: a GFM table.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = [
    "default_console",
    "dumps_json",
    "fmt_ratio",
    "fmt_seconds",
    "machine_info",
    "make_table",
    "markdown_table",
    "print_table",
    "progress_bar",
    "save_loglog_png",
    "write_json",
]


def fmt_seconds(seconds: float | None) -> str:
    """Seconds with 3 significant digits in a readable unit (``1.23 s``, ``45.6 ms``, ``7.8 us``)."""
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def fmt_ratio(ratio: float | None) -> str:
    """A ratio as ``1.07x`` / ``2.3e+03x``."""
    if ratio is None:
        return "-"
    return f"{ratio:.3g}x"


def make_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    left: Sequence[int] = (0,),
    markup: bool = True,
) -> Table:
    """A rich table; cells are ``str()``-ed; columns right-aligned except those in ``left``.
    ``markup=False``: cells are shown as written (text from a user's file: ``[red]`` is
    not a style there), the title too."""
    table = Table(title=title if markup else Text(title), title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i in left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(str(c) if markup else Text(str(c)) for c in row))
    return table


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    console: Console | None = None,
) -> None:
    """Print one table to ``console`` (default: stdout; 200 columns wide when not a terminal)."""
    (console or default_console()).print(make_table(title, columns, rows))


def default_console() -> Console:
    """A stdout console; wide when piped or captured, so tables never wrap."""
    return Console(width=None if sys.stdout.isatty() else 200)


def machine_info() -> dict[str, Any]:
    """Where a result was measured: platform, Python, NumPy, CPU count, time (UTC)."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


_ONE_LINE_MAX = 160  # characters of a flat record kept on one line


def _is_scalar(x: object) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def _flat(x: object) -> bool:
    """A list of scalars: printed on one line."""
    return isinstance(x, (list, tuple)) and all(_is_scalar(i) for i in x)


def dumps_json(obj: object, indent: int = 2, _level: int = 0) -> str:
    """JSON like ``json.dumps(obj, indent=indent)``, but lists of scalars stay on one line
    (a table of rows: one row per line), and so do records of scalars that fit in
    :data:`_ONE_LINE_MAX` characters."""
    pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
    if isinstance(obj, Mapping) and obj:
        if all(_is_scalar(v) for v in obj.values()):  # a small record: one line if short
            line = json.dumps(obj, separators=(", ", ": "))
            if len(line) + len(inner) <= _ONE_LINE_MAX:
                return line
        items = (
            f"{inner}{json.dumps(str(k))}: {dumps_json(v, indent, _level + 1)}"
            for k, v in obj.items()
        )
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)) and obj and not _flat(obj):
        items = (f"{inner}{dumps_json(v, indent, _level + 1)}" for v in obj)
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, separators=(", ", ": "))


def write_json(path: str | Path, doc: Mapping[str, Any], *, with_machine: bool = True) -> Path:
    """Write ``doc`` (plus ``"machine": machine_info()``) as JSON; create parent dirs."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    full = {**doc, "machine": machine_info()} if with_machine else dict(doc)
    out.write_text(dumps_json(full) + "\n")
    return out


def save_loglog_png(
    path: str | Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
) -> Path:
    """Save a log-log chart of ``series`` (label -> (xs, ys)); points with y <= 0 are dropped.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'kvxfer[bench]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("PNG output needs matplotlib: pip install 'kvxfer[bench]'") from exc
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and y > 0]
        if pts:
            ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no crowded minor labels
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


@contextlib.contextmanager
def progress_bar(total: int, description: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr with ``total`` steps; yields ``advance(label)``.

    Each ``advance(label)`` completes one step and shows ``label`` as the next task.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total)

        def advance(label: str) -> None:
            progress.update(task, advance=1, description=f"{description}: {label}")

        yield advance


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; first column left-aligned, the rest right."""
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join([":--"] + ["--:"] * (len(columns) - 1)) + "|"
    body = ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join([head, rule, *body])
