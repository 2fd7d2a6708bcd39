"""``kvxfer bench per-request``'s tables: the rows of its JSON document as printed and
as written into docs (:mod:`kvxfer.bench.all`)."""

from __future__ import annotations

from typing import Any

__all__ = ["COLUMNS", "C_COLUMNS", "coalesced_table_rows", "print_report", "table_rows"]


COLUMNS = ["tp", "tokens", "blocks", "descriptors", "runs", "ids cpu", "make cpu", "post",
           "done", "cpu before wire", "cpu total", "verified"]  # fmt: skip
C_COLUMNS = ["variant", "tokens", "blocks", "descriptors", "ids cpu", "make cpu", "post", "done",
             "cpu before wire", "plain/this", "prepare", "rows", "verified"]  # fmt: skip


def table_rows(doc: dict[str, Any]) -> list[list[object]]:
    from kvxfer.bench.report import fmt_seconds as f

    return [[r["tp"], r["tokens"], "contig" if r["contiguous"] else "scattered",
             f"{r['num_descriptors']:,}", f"{r['num_runs']:,}", f(r["cpu_s"]["ids"]),
             f(r["cpu_s"]["make"]), f(r["wall_s"]["post"]), f(r["wall_s"]["done"]),
             f(r["cpu_before_wire_s"]), f(r["cpu_total_s"]), r["verified"]]
            for r in doc["results"]]  # fmt: skip


def coalesced_table_rows(doc: dict[str, Any]) -> list[list[object]]:
    from kvxfer.bench.report import fmt_ratio
    from kvxfer.bench.report import fmt_seconds as f

    plain = {(r["tokens"], r["contiguous"]): r for r in doc["results"] if r["tp"] == "1->1"}
    out: list[list[object]] = []
    for c in doc["coalesced"]:
        p = plain[(c["tokens"], c["contiguous"])]
        out.append([c["variant"], c["tokens"], "contig" if c["contiguous"] else "scattered",
                    f"{c['num_descriptors']:,}", f(c["cpu_s"]["ids"]), f(c["cpu_s"]["make"]),
                    f(c["wall_s"]["post"]), f(c["wall_s"]["done"]), f(c["cpu_before_wire_s"]),
                    fmt_ratio(p["cpu_before_wire_s"] / c["cpu_before_wire_s"]),
                    f(c["prepare_s"]), f"{c['num_rows_prepared']:,}", c["verified"]])  # fmt: skip
    return out


def print_report(doc: dict[str, Any]) -> None:
    from kvxfer.bench.report import default_console, fmt_ratio, fmt_seconds, make_table

    con = default_console()
    con.print(make_table("per-request CPU (median; cpu before wire = ids + make)", COLUMNS,
                         table_rows(doc), left=(0, 2)))  # fmt: skip
    if doc["coalesced"]:
        con.print(make_table("experiment: coalesced run-width rows (1->1)",
                             C_COLUMNS, coalesced_table_rows(doc), left=(0, 2)))  # fmt: skip
    t = doc["targets"]
    if t["evaluated"]:
        ok = "[green]OK[/]" if t["met"] else f"[red]MISS[/] ({fmt_ratio(t['over_target'])} over)"
        con.print(f"8K tokens, contiguous, 1->1: cpu before wire {fmt_seconds(t['cpu_before_wire_s'])}"
                  f" (target <= 1 ms) {ok}; coalesced {fmt_seconds(t['coalesced_cpu_before_wire_s'])}"
                  f" ({fmt_ratio(t['coalesced_speedup'])} less); library run rows "
                  f"{fmt_seconds(t['library_runs_cpu_before_wire_s'])}")  # fmt: skip
    else:
        con.print("(targets are judged at 8K tokens; not in this run)")
    ok_all = all(r["verified"] for r in doc["results"] + doc["coalesced"])
    con.print(f"all bytes verified: {ok_all}; wall {doc['wall_seconds']:.1f} s")
