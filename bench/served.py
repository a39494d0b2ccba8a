"""A kvmesh service (``kvmesh serve`` / ``scheduler`` / ``gateway``) as a subprocess of a
benchmark: started, waited for until it prints where it listens, stopped with SIGTERM."""

from __future__ import annotations

import collections
import contextlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

LISTEN = re.compile(r"kvmesh: (\w+) listening on (\S+)")


@contextlib.contextmanager
def served(args: list[str], env: dict, service: str, addresses: dict | None = None,
           log: str | None = None) -> Iterator[str]:
    """Run ``python -m kvmesh.cli ARGS`` and yield the address ``service`` (``gateway`` or
    ``scheduler``) listens on. ``addresses``, when given, is filled with every service's address
    seen up to then (``kvmesh serve``: the scheduler's too). ``log``: a file that gets the
    process's stderr (else it is discarded once the address is known). Raises RuntimeError with
    the last lines of stderr when the process exits first."""
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", *args], env=env, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            m = LISTEN.search(line)
            if m and addresses is not None:
                addresses[m.group(1)] = m.group(2)
            if m and m.group(1) == service:
                address = m.group(2)
                break
        else:
            raise RuntimeError(f"kvmesh {args[0]} exited with {proc.wait()}:\n{''.join(seen[-30:])}")
        # keep draining stderr: a full pipe would block the service's next write
        if log is None:
            threading.Thread(target=collections.deque, args=(proc.stderr, 0), daemon=True).start()
        else:
            out = open(log, "w", encoding="utf-8")
            out.writelines(seen)
            out.flush()

            def copy():
                with out:
                    for line in proc.stderr:
                        out.write(line)
                        out.flush()
            threading.Thread(target=copy, daemon=True).start()
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
