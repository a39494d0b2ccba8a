"""The PolicyDesk data set (``policydesk/data``, see its README.md) and its prompt layout.

A data package that depends on nothing of kvmesh: the runtime (the default calibration text of
:mod:`workers.quant.calibrate`, ``kvmesh demo``) and the benchmarks read it. The data files ship
with the installed package (pyproject ``package-data``).

Every conversation about one policy starts with the same system message (system prompt, a blank
line, the whole policy text), so all requests on a policy share a ~1.4-1.7k-token prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"


def _jsonl(name: str) -> list[dict]:
    lines = (DATA_DIR / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def questions() -> list[dict]:
    """Single-turn questions: ``{id, policy, question, reference_answer, key_facts, answerable}``."""
    return _jsonl("questions.jsonl")


def chats() -> list[dict]:
    """Multi-turn chats: ``{id, policy, turns: [{user, reference_answer, key_facts, answerable}]}``."""
    return _jsonl("chats.jsonl")


def system_message(policy: str) -> str:
    """The system message for conversations about ``policy`` (a policy id, e.g. ``travel_expenses``)."""
    prompt = (DATA_DIR / "system_prompt.txt").read_text(encoding="utf-8").strip()
    return prompt + "\n\n" + (DATA_DIR / "policies" / f"{policy}.md").read_text(encoding="utf-8")


def policy_texts() -> list[str]:
    """The policy documents (``data/policies/*.md``), UTF-8 text, sorted by file name."""
    return [p.read_text(encoding="utf-8") for p in sorted((DATA_DIR / "policies").glob("*.md"))]
