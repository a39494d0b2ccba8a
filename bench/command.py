"""How a benchmark module is a command: ``kvmesh bench NAME`` / ``kvmesh eval NAME`` (the module's
``add_parser``, which :mod:`kvmesh.cli.bench` calls when that command runs) and
``python -m bench.MODULE`` (the module's ``main``), with one set of flags (its
``add_arguments``) and one ``run(args) -> exit code``. The benchmarks never import the CLI.
"""

from __future__ import annotations

import argparse
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
