"""Output of `localllm bench` records: `table` (aligned text), `md`, `csv`, `json`, `jsonl`.

A record is a dict, possibly nested (`{"machine": {...}, "model": {...}, ...}`); csv flattens
nested keys to `machine.cpu`. Table and md print the chosen columns under header lines (the
machine and the settings, common to all records); csv, json and jsonl carry every field of
every record.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

FORMATS = ("table", "md", "csv", "json", "jsonl")


class Column(NamedTuple):
    title: str
    cell: Callable[[dict[str, Any]], str]
    right: bool = True  # numbers are right-aligned


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = " ".join(str(v) for v in value)
        else:
            out[name] = value
    return out


def _table(rows: list[list[str]], columns: Sequence[Column], md: bool) -> list[str]:
    titles = [c.title for c in columns]
    widths = [max(len(r[i]) for r in [titles, *rows]) for i in range(len(columns))]

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if col.right else c.ljust(w)
                 for c, w, col in zip(cells, widths, columns)]
        return "| " + " | ".join(parts) + " |" if md else "  ".join(parts).rstrip()

    if md:
        rule = "|" + "|".join(("-" * (w + 1) + ":") if c.right else ("-" * (w + 2))
                              for w, c in zip(widths, columns)) + "|"
    else:
        rule = "  ".join("-" * w for w in widths)
    return [line(titles), rule, *(line(r) for r in rows)]


def render(records: list[dict[str, Any]], fmt: str, columns: Sequence[Column],
           header: Sequence[str] = (), footer: Sequence[str] = ()) -> str:
    """The records in `fmt`; `header` and `footer` lines go with table and md only."""
    if fmt == "json":
        return json.dumps(records, indent=2)
    if fmt == "jsonl":
        return "\n".join(json.dumps(r) for r in records)
    if fmt == "csv":
        flat = [flatten(r) for r in records]
        keys: dict[str, None] = {}
        for f in flat:
            keys.update(dict.fromkeys(f))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(keys), lineterminator="\n")
        writer.writeheader()
        writer.writerows(flat)
        return buf.getvalue().rstrip("\n")
    if fmt not in ("table", "md"):
        raise ValueError(f"unknown format {fmt!r}")
    md = fmt == "md"
    rows = [[c.cell(r) for c in columns] for r in records]
    lines = [*header, "", *_table(rows, columns, md)] if header else _table(rows, columns, md)
    if footer:
        lines += ["", *footer]
    return "\n".join(lines)
