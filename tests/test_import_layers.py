"""The import-layer contract: `lint-imports` (import-linter) with the contracts of pyproject.toml
([tool.importlinter]): bench > front (kvmesh.cli, kvmesh.serve, kvmesh.llm, kvmesh.client) >
gateway > scheduler > workers > kvstore > kvmesh.core > kvmesh.v1, no import pointing up (directly
or through other modules), so no circle between layers; no circle between the sibling modules of
a package either.

The second test proves the contract bites: a copy of the tree with one module of the workers
importing the scheduler fails it, naming that import, also when the import is for type
checking only (``if TYPE_CHECKING:``): the contract counts those too.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "kvmesh", "gateway", "scheduler", "workers", "kvstore", "policydesk")


def _lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"{exe} is missing: install the test extra (pip install -e '.[test]'), it holds import-linter")
    env = dict(os.environ, PYTHONPATH=str(root))      # the packages of `root`, not an installed copy
    # --no-cache: a cache written for another tree must not answer for this one
    return subprocess.run([str(exe), str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_layers_point_down():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, f"lint-imports failed:\n{r.stdout}\n{r.stderr}"
    assert "0 broken" in r.stdout, r.stdout


@pytest.mark.parametrize("probe", ["from scheduler.request import Request  # noqa: F401\n",
                                   "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                   "    from scheduler.request import Request  # noqa: F401\n"],
                         ids=["run-time", "type-checking"])
def test_an_upward_import_breaks_the_contract(tmp_path, probe):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "workers" / "contract_probe.py").write_text('"""An import pointing up."""\n\n' + probe)
    r = _lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    assert "workers.contract_probe -> scheduler.request" in r.stdout, r.stdout
