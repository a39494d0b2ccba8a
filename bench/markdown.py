"""Where a benchmark's results go, the same way for every benchmark module.

- ``--out FILE``: the results as JSON (rows, or ``{"meta", "rows"}``), written after each row
  too, so a run that breaks later keeps what it measured (:func:`write_json`);
- ``--markdown FILE``: the table, under a ``Command: ...`` line, in FILE between
  the benchmark's two HTML-comment markers, the rest of the file left as it is
  (:func:`write_markdown`, :func:`replace_block`);
- ``--table JSON...``: print the table of saved ``--out`` files and exit (:func:`print_saved_table`).

Commands recorded in docs/ from earlier runs may name ``--out`` ``--output``, ``--result-file``
or ``--json``, and ``--markdown`` ``--md``: those names are no longer accepted.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path


def add_output_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, markers: str | None = None,
                    table: bool = True) -> None:
    """Add ``--out``, ``--markdown`` when the benchmark writes a table into docs (``markers``
    names its block, for the help), and ``--table`` unless ``table`` is False."""
    p.add_argument("--out", dest="out", metavar="FILE",
                   help="write the results here as JSON (after each row too)")
    if markers:
        p.add_argument("--markdown", dest="markdown", metavar="FILE",
                       help=f"write the table into FILE between the {markers} markers")
    if table:
        p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of saved --out files and exit")


def write_json(path: str | Path | None, data) -> None:
    """Write ``data`` as indented JSON to ``path`` (nothing when ``path`` is empty)."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1))


def saved_rows(paths: Sequence[str | Path]) -> list[dict]:
    """The rows of saved ``--out`` files, in order: a file holds a list of rows or ``{"rows": [...]}``."""
    rows = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        rows += data["rows"] if isinstance(data, dict) else data
    return rows


def print_saved_table(args: argparse.Namespace, table) -> bool:
    """With ``--table FILE...``: print ``table(rows)`` of the saved files' rows and return True (the
    benchmark then exits 0); without it, False."""
    if not getattr(args, "table", None):
        return False
    print(table(saved_rows(args.table)))
    return True


def command_line(prog: str, argv: Sequence[str] | None) -> str:
    """``"<prog> <args>"``, shell-quoted (``argv`` None = this process's arguments)."""
    return f"{prog} {shlex.join(sys.argv[1:] if argv is None else argv)}".strip()


def run_meta(command: str, **extra) -> dict:
    """``{"command": command, "date": "YYYY-MM-DD", **extra}`` for a run's ``--out`` and
    ``--markdown`` (``command``: :func:`command_line`, or ``args.command_line`` of a command run
    through :mod:`bench.command`)."""
    return {"command": command, "date": time.strftime("%Y-%m-%d"), **extra}


def write_markdown(path: str | Path, begin: str, end: str, meta: dict, *body: str) -> None:
    """Put ``Command: `<command>` (<date>[, <cpu>], <elapsed>; <workload>)``, a blank line and the
    ``body`` blocks (tables, notes; a blank line between) between ``begin`` and ``end`` in ``path``
    (:func:`replace_block`). ``meta``: :func:`run_meta` with ``elapsed_s``, ``workload`` and,
    optionally, ``cpu``."""
    elapsed = meta["elapsed_s"]
    took = f"{elapsed:.0f} s" if elapsed < 600 else f"{elapsed / 60:.0f} min"
    cpu = f", {meta['cpu']}" if meta.get("cpu") else ""
    head = f"Command: `{meta['command']}` ({meta['date']}{cpu}, {took}; {meta['workload']})"
    replace_block(Path(path), begin, end, "\n\n".join([head, *body]))


def md_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table: ``header``, the separator line, then one line per row (cells with str())."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def replace_block(path: Path, begin: str, end: str, body: str) -> None:
    """Write ``begin``, ``body``, ``end`` (one per line) into ``path`` in place of the text from
    ``begin`` to ``end`` when both markers are there, else appended (the file is created when
    missing)."""
    block = "\n".join([begin, body, end])
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text + ("\n" if text else "") + block + "\n"
    path.write_text(text)
