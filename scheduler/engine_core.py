"""The engine core process of one replica, and the scheduler service's client of it.

As vLLM v1's engine core: each replica's engine loop (:class:`scheduler.engine.LLMEngine`:
scheduler, block manager, executor; :func:`scheduler.engine.run_engine_loop`) runs in a
process of its own, so the gateway's and the scheduler service's Python work (gRPC, protobuf,
routing) never holds the GIL that the loop needs between model steps, and the model's torch
threads have the process to themselves.

Channel: two one-way pipes (:func:`multiprocessing.Pipe`), msgpack frames. Requests to the
core (``ADD``, ``ABORT``, ``FINISH``, ``SHUTDOWN``) are read by a thread of the core into a
queue the loop drains before each step, so a sender never waits for a model step. From the
core: ``READY`` (an :class:`~scheduler.engine_records.EngineInfo`) once loaded, ``FATAL`` (why it could
not load or why its loop died), and after each step one ``STEP`` message for all its requests:
their outputs, the requests it rejected, its :class:`~scheduler.engine_records.EngineStats`, and the
step's KV events (for the prefix index, :mod:`kvstore.publisher`).

The client (:class:`EngineCoreClient`) streams per-request outputs to asyncio callers with the
same API as :class:`scheduler.async_engine.AsyncEngine`. A core that exits (killed, crashed) or
reports its loop's death (``FATAL``: a step failed, e.g. a pipeline stage died) fails every open
stream with EngineError at once and marks the client ``errored``; from the moment the reader
thread reads that end, before the event loop has run, :meth:`~EngineCoreClient.is_up` says down
and ``add_request`` refuses, so the router sends it nothing more.

The core's side is :mod:`scheduler.engine_core_process`, the channel's frames
:mod:`scheduler.engine_core_wire`; this module is the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections import deque

from kvmesh.core.errors import DependencyUnavailableError, EngineError, rebuild
from kvmesh.core.sampling import SamplingParams
from kvstore.events import REDIS, BlockRemoved, BlockStored
from scheduler.async_engine import OutputStreams
from scheduler.engine_core_process import engine_core_main
from scheduler.engine_core_wire import (
    ABORT,
    ADD,
    FATAL,
    FINISH,
    PARAM_FIELDS,
    SHUTDOWN,
    STEP,
    event_of,
    output_of,
    pack,
    unpack,
)
from scheduler.engine_records import EngineInfo, EngineOutput, EngineStats
from scheduler.request import FinishReason

log = logging.getLogger("kvmesh.scheduler")


class EngineCoreClient(OutputStreams):
    """A replica's engine process, seen from the scheduler service (API of
    :class:`scheduler.async_engine.AsyncEngine`). Create it inside a running event loop, then
    ``await start()``.

    Attributes:
        info: the engine's :class:`EngineInfo` (after ``start``).
        stats: the last :class:`EngineStats` the core pushed.
        num_threads: torch threads of the core process; ``pid``: its process id.
        stage_pids: process ids of its Ray pipeline stages, by stage (empty at pp 1).
        on_death: called on the event loop, once, when the core exits unasked.
        sink: KV event sink (:class:`kvstore.publisher.KVEventPublisher`), or None.
    Raises (``start``): EngineError with the core's reason when it cannot load.
    """

    def __init__(self, engine_cfg, sched_cfg, replica: int = 0, *, collect_events: bool = False):
        super().__init__()
        self.replica = replica
        ctx = multiprocessing.get_context("spawn")      # torch, gRPC and Ray threads do not survive fork
        in_recv, self._in = ctx.Pipe(duplex=False)
        self._out, out_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_core_main, name=f"kvmesh-engine-{replica}", daemon=True,
                                   args=(engine_cfg, sched_cfg, replica, in_recv, out_send, collect_events))
        self.process.start()
        in_recv.close()
        out_send.close()
        self.info: EngineInfo | None = None
        self.num_threads = 0
        self.pid = self.process.pid
        self.stage_pids: list[int] = []
        self.on_death = None
        self.sink = None
        self.cached_hashes: dict[str, set[int]] = {}  # medium -> mirror of the core's (from KV events)
        self.kv_lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._pending: deque[tuple[int, int]] = deque()   # (add number, prompt tokens) not yet in stats
        self._num_sent = 0
        self._closing = False
        self._kill_reason = ""
        self._down: EngineError | None = None    # the death, as the reader thread saw it (before ``_died`` runs)
        self._reader: threading.Thread | None = None
        self.last_message = time.monotonic()     # when the core last sent a message (watchdog)
        self._last_add = 0.0

    async def start(self, timeout: float | None = None) -> None:
        """Wait until the core has loaded (READY), then start reading its messages."""
        try:
            msg = await asyncio.to_thread(self._recv_first, timeout)
        except BaseException:
            await self.shutdown()
            raise
        _, info, self.num_threads, self.pid, self.stage_pids = msg
        info[7] = tuple(info[7])
        self.info = EngineInfo(*info)
        self.stats = dataclasses.replace(self.stats, num_blocks=self.info.num_blocks)
        self._reader = threading.Thread(target=self._read, name=f"kvmesh-engine-client-{self.replica}", daemon=True)
        self._reader.start()

    def _recv_first(self, timeout: float | None):
        if not self._out.poll(timeout):
            raise DependencyUnavailableError(f"replica {self.replica}: the engine process did not load within {timeout} s")
        try:
            msg = unpack(self._out.recv_bytes())
        except (EOFError, OSError):
            self._reap(5.0)
            raise DependencyUnavailableError(f"replica {self.replica}: the engine process exited while loading "
                                             f"(exit code {self.process.exitcode})") from None
        if msg[0] == FATAL:
            raise rebuild(msg[2], msg[1])     # the core's error, of its class (SettingsError ...)
        return msg

    # ---- requests (event loop) ---------------------------------------------------------------
    def _send(self, msg) -> None:
        data = pack(msg)
        with self._send_lock:
            self._in.send_bytes(data)

    def add_request(self, engine_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    traceparent: str | None = None, cache_salt: str | None = None, *, validated: bool = False,
                    block_hashes: list[int] | None = None) -> asyncio.Queue:
        """Send a request to the core; returns its output queue. A request the core cannot
        serve ends its stream with EngineError (the core's message). Raises EngineError when
        the core is down (DependencyUnavailableError, ``errored`` set). ``validated`` (the
        parameters cross the pipe as the values validated at the edge and are not validated
        again) and ``block_hashes``: see :meth:`scheduler.engine.LLMEngine.add_request`."""
        if self._down is not None:
            self._died(self._down)           # the reader has seen the death; its call to _died may not have run yet
        if self.errored is not None:
            raise DependencyUnavailableError(f"replica {self.replica}: engine process down: {self.errored}")
        params = params or SamplingParams()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[engine_id] = q
        self._num_sent += 1
        self._last_add = time.monotonic()
        self._pending.append((self._num_sent, len(prompt_token_ids)))
        try:
            self._send([ADD, engine_id, list(prompt_token_ids), {f: getattr(params, f) for f in PARAM_FIELDS},
                        traceparent, time.monotonic(), cache_salt or "", validated, block_hashes or []])
        except (OSError, ValueError) as e:
            self._queues.pop(engine_id, None)
            error = DependencyUnavailableError(f"replica {self.replica}: engine process down: {e!r}")
            self._died(error)                # the core is gone and the reader has not said so yet
            raise error from None
        return q

    def is_up(self) -> bool:
        """Not known dead, and the process alive: one that has just died is down at once, before
        the reader has noticed, so that no new request is sent to it; one whose loop died (its
        ``FATAL``, a failed step) is down from the moment the reader thread has read it. Looks
        without reaping (``WNOWAIT``): the reader thread reaps, and ``Process.is_alive`` racing
        it can say alive for a process it has just reaped."""
        if self.errored is not None or self._down is not None:
            return False
        if not hasattr(os, "waitid"):
            return self.process.is_alive()
        try:
            return os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:            # reaped already
            return False

    def _abort(self, engine_id: str) -> bool:
        """Tell the core to abort; the core ends it at its next step."""
        if self.errored is None:
            try:
                self._send([ABORT, engine_id])
            except (OSError, ValueError):
                pass
        return True

    def _finish(self, engine_id: str, reason: FinishReason, stop_reason) -> bool:
        if self.errored is None:
            try:
                self._send([FINISH, engine_id, reason.value, stop_reason])
            except (OSError, ValueError):
                pass
        return True

    def pending_load(self) -> tuple[int, int]:
        """Requests (and their prompt tokens) sent to the core and not yet in ``stats``."""
        seen = self.stats.num_added
        while self._pending and self._pending[0][0] <= seen:
            self._pending.popleft()
        return len(self._pending), sum(t for _, t in self._pending)

    # ---- messages from the core (reader thread) ----------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = unpack(self._out.recv_bytes())
                if msg[0] == STEP:
                    self._on_step(msg)
                elif msg[0] == FATAL:
                    raise DependencyUnavailableError(f"replica {self.replica}: engine loop died: {msg[1]}")
        except BaseException as e:
            if self._closing:
                return
            if not isinstance(e, EngineError):
                why = f" ({self._kill_reason})" if self._kill_reason else ""
                self._down = DependencyUnavailableError(f"replica {self.replica}: the engine process (pid {self.pid}) "
                                                        f"exited{why}")      # down now; the exit code once reaped
                self._reap(2.0)
                e = DependencyUnavailableError(f"replica {self.replica}: the engine process (pid {self.pid}) exited "
                                f"(exit code {self.process.exitcode}){why}")
            self._down = e
            self._loop.call_soon_threadsafe(self._died, e)

    def _on_step(self, msg) -> None:
        self.last_message = time.monotonic()
        _, rows, rejected, stats, events = msg
        if events:
            evs = [event_of(r) for r in events]
            with self.kv_lock:
                for ev in evs:
                    if ev.medium == REDIS:           # the shared tier's: not this replica's to resync
                        continue
                    held = self.cached_hashes.setdefault(ev.medium, set())
                    if isinstance(ev, BlockStored):
                        held.update(ev.block_hashes)
                    elif isinstance(ev, BlockRemoved):
                        held.difference_update(ev.block_hashes)
                    else:
                        held.clear()
                if self.sink is not None:
                    self.sink.publish(evs)
        self.stats = EngineStats(*stats)
        outputs = [output_of(r) for r in rows]
        if outputs or rejected:
            self._loop.call_soon_threadsafe(self._step_done, outputs, rejected)

    def _step_done(self, outputs: list[EngineOutput], rejected: list[list]) -> None:
        for rid, name, message in rejected:
            self._fail(rid, rebuild(name, message))
        if outputs:
            self._deliver(outputs)

    def _died(self, error: EngineError) -> None:
        if self.errored is not None:
            return
        self.errored = error
        log.error("%s", error)
        self._fail_all(error)
        if self.on_death is not None:
            self.on_death(self)

    def _reap(self, timeout: float) -> bool:
        """Wait for the core to exit (polling waitpid: the process sentinel stays open while a
        child the core started lives on). True once it has exited."""
        deadline = time.monotonic() + timeout
        while self.process.exitcode is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stalled_for(self) -> float:
        """Seconds since the core's last message while it has open requests (0 when idle):
        what the scheduler's watchdog compares with ``step_timeout``."""
        if not self._queues or self.errored is not None:
            return 0.0
        return time.monotonic() - max(self.last_message, self._last_add)

    def kill(self, reason: str) -> None:
        """Kill the core (SIGKILL); its streams then fail as on any death, ``reason`` in the message."""
        self._kill_reason = reason
        self.process.kill()

    def set_kv_sink(self, sink) -> None:
        with self.kv_lock:
            self.sink = sink

    def cached_block_hashes(self) -> dict[str, list[int]]:
        """``{medium: hashes}`` of the core's pool and host tier as its KV events say (the
        publisher's resync)."""
        with self.kv_lock:
            return {m: list(hs) for m, hs in self.cached_hashes.items()}

    async def shutdown(self, timeout: float = 15.0) -> None:
        """Ask the core to stop (its executor shuts down), wait for it, kill it if it hangs."""
        self._closing = True
        try:
            self._send([SHUTDOWN])
        except (OSError, ValueError):
            pass
        if not await asyncio.to_thread(self._reap, timeout):
            log.warning("replica %d: the engine process did not stop within %.0f s; killing it", self.replica, timeout)
            self.process.kill()
            await asyncio.to_thread(self._reap, 5.0)
        for conn in (self._in, self._out):
            conn.close()
