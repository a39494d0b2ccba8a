"""How a benchmark module is a command: ``kvmesh bench NAME`` / ``kvmesh eval NAME`` (the module's
``add_parser``, which :mod:`kvmesh.cli.bench` calls when that command runs) and
``python -m bench.MODULE`` (the module's ``main``), with one set of flags (its
``add_arguments``) and one ``run(args) -> exit code``. The benchmarks never import the CLI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable

from bench.markdown import command_line
from kvmesh.core.errors import EngineError

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

DEFAULT_MODEL = "smollm2-135m-instruct"      # what a benchmark runs unless told --model


def parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of a ``python -m bench.MODULE`` with flags of its own (no ``add_arguments``):
    described by the first paragraph of the module's docstring ``doc``, with ``--model``
    (default :data:`DEFAULT_MODEL`)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    return p


def add_parser(subparsers, name: str, help: str, description: str, add_arguments: AddArguments,
               run: Run) -> argparse.ArgumentParser:
    """Add the command ``name`` to ``subparsers`` (``kvmesh bench``'s or ``kvmesh eval``'s) with
    the module's flags; parsing it sets ``func`` to ``run``."""
    p = subparsers.add_parser(name, help=help, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_child_arg(p: argparse.ArgumentParser) -> None:
    """``--child SPEC`` (hidden): the benchmark runs one row, described by the JSON ``SPEC``, in a
    fresh child process of its own (``python -m bench.MODULE --child SPEC``)."""
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)


def answered_child(args: argparse.Namespace, run_child: Callable[[dict], dict]) -> bool:
    """In a row's child process (``--child SPEC``): print ``run_child(spec)`` as one JSON line for
    the parent and return True (the command then exits 0); otherwise False."""
    if not args.child:
        return False
    answer(run_child(json.loads(args.child)))
    return True


def answer(result) -> int:
    """In a row's child process: print ``result`` as one JSON line, the last of its output, for
    the parent (:func:`child_answer`). Returns the child's exit code, 0."""
    print(json.dumps(result))
    return 0


def child_answer(stdout: str):
    """The answer of a row's child process: the JSON of the last line it printed (the lines
    before it are its own progress output)."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_child(cmd: list[str]):
    """Run a row's child process ``cmd`` (``python -m bench.MODULE --child ...``) to its end and
    return its answer (:func:`child_answer`); None when it failed, after printing the last
    3,000 characters of its stderr."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        return None
    return child_answer(res.stdout)


def main(prog: str, description: str, add_arguments: AddArguments, run: Run, argv: list[str] | None) -> int:
    """``python -m bench.MODULE``: parse ``argv`` (None = this process's) with the module's flags and
    run it (``args.command_line`` records how it was called); an EngineError prints ``kvmesh: error: <message>`` and gives exit code 2."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.command_line = command_line(prog, argv)
    try:
        return run(args)
    except EngineError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
