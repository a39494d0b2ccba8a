"""One pipeline stage of a replica, run as a Ray actor by :class:`workers.executor.RayPipelineExecutor`.

A stage holds a contiguous range of decoder layers (the first also the embeddings, the last
also the final norm, lm_head, sampler and, with ``speculative_method=draft``, the draft model) and the paged KV cache of those layers only.
Under tensor parallelism a stage is ``tp`` actors, its ranks (:mod:`workers.tensor_parallel`):
each holds its part of the stage's layers and KV cache, runs every step, and sums with the
other ranks through a communicator (:mod:`workers.communicator`: shared memory on one node,
gloo across nodes) set up by :meth:`PipelineStage.connect_tp`; rank r's hidden states go to rank
r of the next stage; on the last stage rank 0 samples. Block
ids are the replica's: every stage has the same number of blocks, indexed by the same block
tables.

Steps arrive as incremental messages (:class:`workers.step.StepDelta`): the stage keeps
each request's prompt-side data and block table (:class:`workers.step.StepDecoder`) and
rebuilds the full sequences the runner takes; the last stage also keeps each request's output
history (penalties, ``min_tokens``).

Hidden states go from stage k to stage k+1 over a TCP connection of their own
(:class:`StageLink`), not through Ray: the executor submits every stage's ``execute`` at once,
stage k+1 prepares the step's inputs and then waits on the link for stage k's ``[T,
hidden_size]``. Through Ray the tensor went back to the caller (the ObjectRef's owner) and from
there to the next stage, two RPCs and the caller's dependency resolution on the way
(docs/mesh.md, "Step messages and the stage-to-stage hop"). Steps cross the link in order (each
stage runs its calls in submission order); a stage whose step fails sends an error frame in the
hidden states' place, so the stages after it fail that step too instead of waiting, and the
caller sees the error from the last stage.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import time
from collections import deque

import torch

from kvmesh.core import telemetry
from kvmesh.core.errors import DependencyUnavailableError, EngineError
from kvmesh.core.telemetry import StageSpans
from workers.model_runner import ModelRunner, ModelRunnerOutput
from workers.step import StepDecoder, StepDelta

log = logging.getLogger(__name__)

STEP_TIMES = 1024     # steps whose times a stage keeps (step_times)
LINK_TIMEOUT = 30.0   # seconds to set up a link between two stages
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class StageLink:
    """One direction of a TCP connection between consecutive stages, carrying one frame per
    step: hidden states ``[rows, cols]`` (float32, bfloat16 or float16) or an error message.

    Frame: a header (kind: 0 tensor, 1 error; rows; cols; dtype index; payload bytes), then the
    payload (the tensor's bytes, or the UTF-8 message).

    Raises (``recv``):
        EngineError: an error frame (the previous stage's step failed) or the connection closed
            (the previous stage died).
    """

    HEADER = struct.Struct("<BIIBQ")

    def __init__(self, sock: socket.socket):
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, t: torch.Tensor) -> None:
        """Send hidden states ``t`` (``[rows, cols]``); blocks while the socket's buffer is full
        (until the next stage reads: it does at the step after the one it runs)."""
        n = t.numel() * t.element_size()
        head = self.HEADER.pack(0, t.shape[0], t.shape[1], _DTYPES.index(t.dtype), n)
        payload = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
        sent = self.sock.sendmsg([head, payload])     # one segment for a small step
        if sent < len(head):
            self.sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < n:
            self.sock.sendall(payload[sent - len(head):])

    def send_error(self, message: str) -> None:
        data = message.encode()
        self.sock.sendall(self.HEADER.pack(1, 0, 0, 0, len(data)) + data)

    def _read(self, buf: memoryview) -> None:
        while buf:
            n = self.sock.recv_into(buf)
            if n == 0:
                raise DependencyUnavailableError("the previous pipeline stage closed its link (it died)")
            buf = buf[n:]

    def recv(self) -> torch.Tensor:
        head = bytearray(self.HEADER.size)
        self._read(memoryview(head))
        kind, rows, cols, dt, n = self.HEADER.unpack(head)
        if kind == 1:
            msg = bytearray(n)
            self._read(memoryview(msg))
            raise EngineError(msg.decode())
        out = torch.empty(n, dtype=torch.uint8)
        if n:
            self._read(memoryview(out.numpy()))
        return out.view(_DTYPES[dt]).view(rows, cols)

    def close(self) -> None:
        self.sock.close()


class PipelineStage:
    """Layers ``[start_layer, end_layer)`` of the model.

    Args:
        cfg: the replica's EngineConfig (``num_threads`` sets this process's torch threads).
        model_dir: checkpoint directory (readable on the actor's node).
        start_layer, end_layer: decoder layers held here.
        num_blocks: KV pool size, in blocks, shared by all stages.
        index: stage number (0 = first).
        replica: the replica's index (span attributes).
        tp_rank, tp_size: this actor's tensor-parallel rank and its stage's ranks.
    Raises:
        EngineError: the checkpoint cannot be loaded (surfaces as a RayTaskError on the caller).
    """

    def __init__(self, cfg, model_dir: str, start_layer: int, end_layer: int, num_blocks: int, index: int,
                 replica: int = 0, tp_rank: int = 0, tp_size: int = 1):
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if (nice := os.getpriority(os.PRIO_PROCESS, 0)) > 0:
            log.warning("pipeline stage %d runs at nice %d (Ray's default worker_niceness is 15): any process at "
                        "normal priority takes its CPU first; start the Ray nodes with RAY_worker_niceness=0",
                        index, nice)
        self.index = index
        self.tp = None
        if tp_size > 1:
            from workers.checkpoint import load_config
            from workers.tensor_parallel import ShardPlan, TensorParallel
            self.tp = TensorParallel(ShardPlan.of(load_config(model_dir), tp_rank, tp_size))
        self.runner = ModelRunner(cfg, model_dir, num_blocks, start_layer, end_layer, self.tp)
        self.requests = StepDecoder(index)
        self.prev: StageLink | None = None      # from the stage before (hidden states in)
        self.next: StageLink | None = None      # to the stage after (hidden states out)
        self._server: socket.socket | None = None
        self._token = b""
        self.step_ns: deque[tuple[int, int, int, int]] = deque(maxlen=STEP_TIMES)
        # one span per traced request on this stage (kvmesh/core/telemetry.py); OTEL_* come from the
        # actor's environment (a local Ray's workers inherit the driver's)
        self.spans = StageSpans(index, self.runner.model.start_layer, self.runner.model.end_layer, replica,
                                telemetry.setup_tracing(telemetry.WORKER), tp_rank, tp_size)

    def info(self) -> dict:
        """The stage as it runs: ``index``, ``start_layer`` / ``end_layer``, ``num_blocks``,
        ``kv_cache_bytes``, ``weight_bytes`` (its stored weights), ``num_threads`` (torch's intra-op threads in this process),
        ``node_id`` (the Ray node it runs on, hex), ``ip`` (its address), ``pid`` (its
        process), ``nice`` (its scheduling niceness), ``num_requests`` (requests whose state it
        holds: sent and not yet freed), ``tp_rank`` / ``tp_size`` and ``tp_comm`` (the
        communicator's kind, "" before :meth:`connect_tp` or without tensor parallelism)."""
        import ray
        m = self.runner.model
        return {"index": self.index, "start_layer": m.start_layer, "end_layer": m.end_layer,
                "num_blocks": self.runner.num_blocks, "kv_cache_bytes": self.runner.kv_cache_bytes,
                "weight_bytes": self.runner.weight_bytes,
                "num_threads": torch.get_num_threads(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "num_requests": len(self.requests.states),
                "tp_rank": self.tp.rank if self.tp else 0, "tp_size": self.tp.size if self.tp else 1,
                "tp_comm": getattr(self.tp and self.tp.comm, "kind", "")}

    # ---- the tensor-parallel group (set up by the executor once every rank is loaded)
    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's, for a gloo group's rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def tp_stats(self) -> dict:
        """``comm_ns`` and ``comm_calls`` of this rank's communicator calls so far
        (:class:`workers.tensor_parallel.TensorParallel`); zeros without tensor parallelism."""
        return {"comm_ns": self.tp.comm_ns if self.tp else 0, "comm_calls": self.tp.comm_calls if self.tp else 0}

    def connect_tp(self, kind: str, address: str) -> None:
        """Join this stage's tensor-parallel group: ``kind`` ``shm`` (``address``: the shared
        segment's name; every rank on this node) or ``gloo`` (``address``: ``tcp://host:port`` of
        rank 0). Every rank of the stage must be called at once (they wait for each other).
        Raises EngineError when the group cannot form."""
        from workers.communicator import create_communicator
        self.tp.connect(create_communicator(kind, self.tp.rank, self.tp.size, address))

    # ---- the link to the next stage (set up by the executor: listen, connect_next, accept_prev)
    def listen(self) -> tuple[str, int, bytes]:
        """Open a port for the previous stage: returns (this node's IP, port, a token the
        connecting stage must present)."""
        import ray
        self._server = socket.create_server(("", 0))
        self._server.settimeout(LINK_TIMEOUT)
        self._token = secrets.token_bytes(16)
        return ray.util.get_node_ip_address(), self._server.getsockname()[1], self._token

    def connect_next(self, host: str, port: int, token: bytes) -> None:
        """Connect to the next stage's :meth:`listen` port."""
        sock = socket.create_connection((host, port), timeout=LINK_TIMEOUT)
        sock.sendall(token)
        self.next = StageLink(sock)

    def accept_prev(self) -> None:
        """Accept the previous stage's connection (it must present the :meth:`listen` token).
        Raises EngineError when none comes within LINK_TIMEOUT seconds."""
        try:
            while True:
                conn, _ = self._server.accept()
                conn.settimeout(LINK_TIMEOUT)
                got = b""
                while len(got) < len(self._token):
                    chunk = conn.recv(len(self._token) - len(got))
                    if not chunk:
                        break
                    got += chunk
                if secrets.compare_digest(got, self._token):
                    break
                conn.close()                     # not our previous stage
        except socket.timeout:
            raise DependencyUnavailableError(f"stage {self.index}: the previous stage did not connect within {LINK_TIMEOUT:g} s") from None
        finally:
            self._server.close()
            self._server = None
        self.prev = StageLink(conn)

    # ---- steps ---------------------------------------------------------------------------
    def execute(self, delta: StepDelta) -> ModelRunnerOutput | None:
        """Run this stage on a step. The first stage embeds the step's tokens; the others
        take the previous stage's hidden states from the link. Returns the sampled (or
        verified) tokens and the draft model's proposals on the last stage; the other stages
        send their hidden states ``[T, hidden_size]`` on and return None.
        Raises EngineError when the message refers to a request this stage does not hold, or
        an earlier stage failed this step (after telling the next stage so)."""
        t0 = time.time_ns()
        t_in = [t0]
        waiting = self.prev is not None          # this step's frame is still on the link

        def hidden() -> torch.Tensor:
            nonlocal waiting
            waiting = False
            h = self.prev.recv()
            t_in[0] = time.time_ns()
            return h

        try:
            step = self.requests.apply(delta)
            out = self.runner.execute(step, hidden if self.prev is not None else None)
            if self.runner.model.is_last:
                self.requests.record(out.sampled)
        except BaseException as e:
            if waiting:                          # keep the link in step: consume this step's frame
                try:
                    self.prev.recv()
                except EngineError:
                    pass
            if self.next is not None:
                self.next.send_error(f"stage {self.index}: {e!r}" if not isinstance(e, EngineError) else str(e))
            raise
        t_out = time.time_ns()
        if self.next is not None:
            self.next.send(out)
            out = None
        t1 = time.time_ns()
        self.spans.record(step.seqs, t0, t1)
        self.step_ns.append((t0, t_in[0], t_out, t1))
        if delta.done:
            self._free(self.requests.free(delta.done))
        return out

    def save_blocks(self, block_ids: list[int]) -> list[bytes]:
        """This stage's bodies of KV blocks ``block_ids`` (:func:`workers.kv_blocks.save_blocks`)."""
        from workers.kv_blocks import save_blocks
        return save_blocks(self.runner.kv_caches, block_ids)

    def load_blocks(self, block_ids: list[int], bodies: list[bytes]) -> None:
        """Write this stage's saved bodies into KV blocks ``block_ids``. Raises ValueError on a
        body of the wrong size."""
        from workers.kv_blocks import load_blocks
        load_blocks(self.runner.kv_caches, block_ids, bodies)

    def free_requests(self, handles: list[int]) -> None:
        """Forget finished requests (by the handles of their step messages): their state here,
        the runner's (input batch rows, the last stage's seeded generators) and emit their spans."""
        self._free(self.requests.free(handles))

    def _free(self, request_ids: list[str]) -> None:
        self.runner.free_requests(request_ids)
        self.spans.finish(request_ids)

    def step_times(self) -> list[tuple[int, int, int, int]]:
        """(start, input ready, output ready, end) of the last ``STEP_TIMES`` steps' ``execute``
        here, epoch ns (``time.time_ns``; comparable across the processes of one machine).
        Input ready: the previous stage's hidden states arrived (the start, on the first
        stage); output ready: this stage's layers (and sampler) are done; end: the hidden
        states are sent on (on the last stage: the result is about to be returned)."""
        return list(self.step_ns)

    def release_memory(self) -> None:
        """Give this process's freed memory back to the OS (:mod:`kvmesh.core.memory`); the engine
        asks when its replica has gone idle."""
        from kvmesh.core.memory import release_free_memory
        release_free_memory()

    def flush_telemetry(self) -> None:
        """Export the queued spans (before the actor is killed)."""
        telemetry.shutdown_tracing()
