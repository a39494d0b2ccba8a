"""Run a command beside busy CPU threads: the check that tests hold on a loaded machine.

    python -m bench.cpu_burner --threads 2 -- make test-all

starts ``--threads`` processes that spin in a loop (plain Python arithmetic, at the caller's
priority), runs the command, stops them, and exits with the command's status. On a 2-core
machine two burners take each core half the time from the command, the load under which
timing-dependent tests flake (issue 35). Prints the command's exit status and wall time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import time


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x = (x * 31 + i) & 0xFFFF


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_burner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="busy processes beside the command (default 2)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("a command to run is required (after --)")
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    stop = mp.Event()
    burners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.threads)]
    for p in burners:
        p.start()
    t0 = time.monotonic()
    try:
        rc = subprocess.call(command)
    finally:
        stop.set()
        for p in burners:
            p.join(5)
            if p.is_alive():
                p.kill()
    wall = time.monotonic() - t0
    print(f"cpu_burner: {' '.join(command)} exited {rc} after {wall:.0f} s beside {args.threads} busy "
          f"processes", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
