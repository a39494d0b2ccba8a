"""The PolicyDesk data package (policydesk/): its data, what the runtime reads of it (the default
calibration text of the quantized weight formats), and that an installed kvmesh ships it (and
the model hub's manifest) as package data."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import policydesk
from workers.quant.calibrate import calibration_text

ROOT = Path(__file__).resolve().parents[1]


def test_data_set_and_prompt_layout():
    qs, chats, texts = policydesk.questions(), policydesk.chats(), policydesk.policy_texts()
    assert (len(qs), len(chats), len(texts)) == (96, 24, 8)
    policies = {p.stem for p in (policydesk.DATA_DIR / "policies").glob("*.md")}
    assert {q["policy"] for q in qs} <= policies and {c["policy"] for c in chats} <= policies
    system = policydesk.system_message("travel_expenses")
    assert system.endswith((policydesk.DATA_DIR / "policies" / "travel_expenses.md").read_text(encoding="utf-8"))
    assert (policydesk.DATA_DIR / "system_prompt.txt").read_text(encoding="utf-8").strip() in system


def test_default_calibration_text_is_the_policies():
    text = calibration_text("")
    assert text.source == "policydesk" and text.docs == policydesk.policy_texts()


def test_package_data_ships_every_data_file():
    """Every file under policydesk/data and the hub's models.json match a package-data pattern
    of pyproject.toml, and their packages are found by setuptools (so ``pip install .`` has them)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = tool["packages"]["find"]["include"]
    assert "policydesk*" in include and "kvmesh*" in include
    for package, root in (("policydesk", ROOT / "policydesk"), ("kvmesh.hub", ROOT / "kvmesh" / "hub")):
        patterns = tool["package-data"][package]
        data = [f for f in root.rglob("*") if f.is_file() and f.suffix != ".py" and "__pycache__" not in f.parts]
        assert data, package
        for f in data:
            rel = f.relative_to(root).as_posix()
            assert any(fnmatch.fnmatch(rel, p) and rel.count("/") == p.count("/") for p in patterns), \
                f"{package}: {rel} is not package data"
