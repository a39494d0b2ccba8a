"""The chaos events of ``bench.soak``: a Redis server of the soak's own that it kills and starts
again, and the SIGKILL of one Ray pipeline stage of a replica, followed until the replica is back.

:class:`OwnRedis` runs ``redis-server --bind 127.0.0.1 --port P --save '' --appendonly no`` on
a free port (never the machine's shared Redis); :meth:`OwnRedis.restart` kills it (SIGKILL, as a
crash), waits, and starts it again on the same port, empty (nothing was saved).

:func:`kill_stage` SIGKILLs the stage a replica reports in GetStats (``stage_pids``), after
checking that the pid is a ``ray::PipelineStage`` process, and :func:`wait_replica_back` polls
GetStats until the replica is up again with a new engine process and new stages (the replica
restarts whole: docs/mesh.md, "Self-healing replicas").
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A private ``redis-server`` on a free port of 127.0.0.1, no persistence. ``url`` is its
    URL; ``start`` / ``kill`` / ``restart`` / ``stop``. Raises RuntimeError when redis-server is
    missing or does not answer within 10 s."""

    def __init__(self, executable: str = "redis-server"):
        self.executable = shutil.which(executable)
        if self.executable is None:
            raise RuntimeError(f"{executable} is not installed (--own-redis needs it)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []             # every server process started, in order

    def _pings(self) -> bool:
        import redis
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.executable, "--bind", "127.0.0.1", "--port", str(self.port),
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.pids.append(self.proc.pid)
        deadline = time.monotonic() + 10
        while not self._pings():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start (exit code {self.proc.poll()})")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (a crash: its clients' connections drop)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float) -> None:
        """Kill it, wait ``down_s`` seconds, start it again on the same port (empty)."""
        self.kill()
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "OwnRedis":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def is_stage_process(pid: int) -> bool:
    """Whether ``pid`` is a Ray ``PipelineStage`` actor's process (its title is ``ray::PipelineStage``)."""
    import psutil
    try:
        return " ".join(psutil.Process(pid).cmdline()).startswith("ray::PipelineStage")
    except psutil.Error:
        return False


def kill_stage(pid: int) -> None:
    """SIGKILL the stage process ``pid``. Raises RuntimeError when it is not a stage's process
    (a pid reused or misread: nothing is killed then)."""
    if not is_stage_process(pid):
        raise RuntimeError(f"process {pid} is not a ray::PipelineStage process: not killed")
    os.kill(pid, signal.SIGKILL)


async def wait_replica_back(stats, replica: int, old_pid: int, old_stages: list[int], restarts: int,
                            timeout: float = 300.0):
    """Poll ``await stats()`` (a GetStatsResponse) every 0.2 s until replica ``replica`` is
    healthy with more than ``restarts`` restarts, a new engine pid and new stage pids (none of
    ``old_stages``); returns its ReplicaStats then, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await stats()
        r = next((r for r in st.replicas if r.replica == replica), None)
        if (r is not None and r.healthy and r.restarts > restarts and r.pid != old_pid
                and r.stage_pids and not set(r.stage_pids) & set(old_stages)):
            return r
        await asyncio.sleep(0.2)
    return None
