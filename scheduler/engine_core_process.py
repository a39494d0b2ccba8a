"""The engine core process of one replica (:mod:`scheduler.engine_core`): :func:`engine_core_main`
loads the engine and runs its loop (:func:`scheduler.engine.run_engine_loop`) with
:class:`EngineCore`, which reads the client's messages on a thread and sends one ``STEP``
message per step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import traceback
from collections import deque

from kvmesh.core.errors import EngineError, error_name
from kvmesh.core.memory import release_free_memory
from kvmesh.core.sampling import SamplingParams
from scheduler.engine_core_wire import (
    ABORT,
    ADD,
    FATAL,
    FINISH,
    READY,
    SHUTDOWN,
    STEP,
    event_row,
    output_row,
    pack,
    unpack,
)
from scheduler.engine_records import EngineOutput
from scheduler.request import FinishReason


log = logging.getLogger("kvmesh.scheduler")

class _EventBuffer:
    """The core's KV event sink: events wait here until the step's message carries them."""

    def __init__(self):
        self.events: list = []

    def publish(self, events) -> None:
        self.events.extend(events)


HEALTH_CHECK_INTERVAL = 1.0     # seconds between the idle loop's executor health checks
IDLE_RELEASE_AFTER = 1.0        # seconds idle after serving before freed memory goes back to the OS


class EngineCore:
    """The engine loop of one replica in this process, fed from ``conn_in``, reporting to
    ``conn_out`` (module docstring). ``collect_events``: carry KV events (prefix routing).
    While it has no step in flight it checks its executor's health (``check_health``: Ray
    stages) every HEALTH_CHECK_INTERVAL seconds; a failed check ends the loop (FATAL). Once it
    has served and then been idle IDLE_RELEASE_AFTER seconds (no request, no KV tier write
    queued), it gives the memory freed meanwhile back to the OS, its own and its stages'
    (:mod:`kvmesh.core.memory`): once per idle spell."""

    def __init__(self, engine, conn_in, conn_out, collect_events: bool):
        self.engine, self.conn_out = engine, conn_out
        self._check_health = getattr(engine.executor, "check_health", None)
        self._next_check = time.monotonic() + HEALTH_CHECK_INTERVAL
        self.events = _EventBuffer() if collect_events else None
        if self.events is not None:
            engine.block_manager.sink = self.events
        self._inputs: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._rejected: list[list] = []
        self._dirty = False                  # inputs applied since the last message
        self._steps_seen = self._released_at = engine.num_steps
        self._quiet_since = time.monotonic()     # when num_steps last changed
        self._reader = threading.Thread(target=self._read, args=(conn_in,), name="kvmesh-core-input", daemon=True)
        self._reader.start()

    def _read(self, conn) -> None:
        """Input thread: frames from the client into the queue; EOF (the client is gone) stops."""
        try:
            while True:
                self._inputs.append(unpack(conn.recv_bytes()))
                self._wake.set()
        except (EOFError, OSError):
            self._inputs.append([SHUTDOWN])
            self._wake.set()

    def _apply_inputs(self) -> None:
        eng = self.engine
        while self._inputs:
            msg = self._inputs.popleft()
            self._dirty = True
            kind = msg[0]
            if kind == ADD:
                _, rid, prompt, params, traceparent, arrival, cache_salt, validated, block_hashes = msg
                try:
                    # validated at the edge (the scheduler service): carried, not validated again
                    sp = SamplingParams.trusted(**params) if validated else SamplingParams(**params)
                    eng.add_request(rid, prompt, sp, arrival_time=arrival, traceparent=traceparent,
                                    cache_salt=cache_salt, validated=validated, block_hashes=block_hashes)
                except EngineError as e:
                    self._rejected.append([rid, error_name(e), str(e)])   # the class crosses too
            elif kind == ABORT:
                eng.abort_request(msg[1])
            elif kind == FINISH:
                eng.finish_request(msg[1], FinishReason(msg[2]), msg[3])
            elif kind == SHUTDOWN:
                self._stop = True

    def _wait(self, timeout: float) -> None:
        if self._dirty or self._rejected or (self.events is not None and self.events.events):
            self._emit([])                   # new requests show in the stats before they run; KV events
            #                                  of an idle engine (write-throughs that reached Redis) go out
        if self._check_health is not None and time.monotonic() >= self._next_check:
            self._check_health()             # EngineError: a stage died while nothing ran
            self._next_check = time.monotonic() + HEALTH_CHECK_INTERVAL
        self._release_when_idle()
        if not self._inputs:
            self._wake.wait(timeout)
        self._wake.clear()

    def _release_when_idle(self) -> None:
        """Give freed memory back (this process and the executor's stages) once the engine has
        run steps and then none for IDLE_RELEASE_AFTER seconds, with no request and no Redis
        write left: once per idle spell."""
        eng, now = self.engine, time.monotonic()
        if eng.num_steps != self._steps_seen:
            self._steps_seen, self._quiet_since = eng.num_steps, now
            return
        if (self._released_at == self._steps_seen or now - self._quiet_since < IDLE_RELEASE_AFTER
                or self._inputs or eng.has_work() or (eng.tiers is not None and eng.tiers.writes_pending())):
            return
        self._released_at = self._steps_seen
        release_free_memory()
        release = getattr(eng.executor, "release_memory", None)
        if release is not None:
            release()

    def _emit(self, outputs: list[EngineOutput]) -> None:
        events = []
        if self.events is not None and self.events.events:
            events, self.events.events = [event_row(e) for e in self.events.events], []
        stats = dataclasses.astuple(self.engine.snapshot())
        rejected, self._rejected = self._rejected, []
        self._dirty = False
        self.conn_out.send_bytes(pack([STEP, [output_row(o) for o in outputs], rejected, stats, events]))

    def run(self) -> None:
        from scheduler.engine import run_engine_loop
        run_engine_loop(self.engine, lambda: self._stop, self._wait, self._emit, self._apply_inputs)


def engine_core_main(engine_cfg, sched_cfg, replica: int, conn_in, conn_out, collect_events: bool) -> None:
    """Entry point of a replica's engine process: load, say READY (or FATAL), run the loop
    until SHUTDOWN or until the client's pipe closes, then shut the executor down."""
    engine = None
    try:
        import torch
        from kvmesh.core.settings import available_cpus
        from scheduler.engine import LLMEngine
        from workers.executor import create_executor

        if sched_cfg.resolved_executor() == "local":
            if not engine_cfg.num_threads:      # the replicas of this machine share its cores
                engine_cfg = engine_cfg.replace(num_threads=max(1, available_cpus() // sched_cfg.replicas))
        else:
            torch.set_num_threads(1)            # the model runs in the stage actors
        engine = LLMEngine(engine_cfg, executor_factory=lambda cfg, model_dir: create_executor(
            cfg, model_dir, sched_cfg, replica))
        info = dataclasses.astuple(engine.info())
        stage_pids = [i["pid"] for i in getattr(engine.executor, "stage_info", ())]
        conn_out.send_bytes(pack([READY, info, torch.get_num_threads(), os.getpid(), stage_pids]))
        core = EngineCore(engine, conn_in, conn_out, collect_events)
        core.run()
    except BaseException as e:
        detail = str(e) if isinstance(e, EngineError) else f"{e!r}\n{traceback.format_exc()}"
        try:
            conn_out.send_bytes(pack([FATAL, detail, error_name(e)]))
        except OSError:
            pass
    finally:
        if engine is not None:
            engine.shutdown()
        try:
            from kvmesh.core import telemetry
            telemetry.shutdown_tracing()
        except Exception:
            pass
