"""How a benchmark module is a command: ``kvmesh bench NAME`` / ``kvmesh eval NAME`` (the module's
``add_parser``, which :mod:`kvmesh.cli.bench` calls when that command runs) and
``python -m bench.MODULE`` (the module's ``main``), with one set of flags (its
``add_arguments``) and one ``run(args) -> exit code``. The benchmarks never import the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from bench.markdown import command_line
from kvmesh.core.errors import EngineError

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


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
    print(json.dumps(run_child(json.loads(args.child))))
    return True


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
