"""bench.cpu_burner: the command runs beside busy processes, its exit status is the burner's,
and the busy processes are gone afterwards."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from bench import cpu_burner


def test_runs_the_command_beside_busy_processes_and_passes_its_status_on():
    code = ("import psutil, sys; me = psutil.Process(); "
            "sibs = [p for p in me.parent().children() if p.pid != me.pid]; "
            "busy = [p for p in sibs if p.cpu_percent(0.5) > 20]; sys.exit(10 + len(busy))")
    def live_children() -> set[int]:
        return {p.pid for p in psutil.Process().children(recursive=True)
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}

    before = live_children()     # an earlier test in this process may have left helpers running
    assert cpu_burner.main(["--threads", "2", "--", sys.executable, "-c", code]) == 12
    assert not live_children() - before                                     # the burners stopped


def test_a_command_is_required():
    r = subprocess.run([sys.executable, "-m", "bench.cpu_burner", "--threads", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "a command to run is required" in r.stderr


def test_negative_threads_are_refused():
    with pytest.raises(SystemExit) as e:
        cpu_burner.main(["--threads", "-1", "--", "true"])
    assert e.value.code == 2
