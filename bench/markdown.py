"""Benchmark tables in the docs: a block between two HTML-comment markers that a benchmark's
``--markdown FILE`` rewrites in place, leaving the rest of the file as it is."""

from __future__ import annotations

from pathlib import Path


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
