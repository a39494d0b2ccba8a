"""How the ranks of a tensor-parallel group talk: the sum of their partial outputs and the
gather of their logits (:mod:`workers.tensor_parallel`).

- :class:`ShmCommunicator`: ranks on one node, through a shared-memory segment and the native
  ops ``kvmesh::shm_all_reduce`` / ``kvmesh::shm_all_gather`` (``workers/kernels/csrc/shm_comm.cpp``:
  each rank writes its part into its slot, waits for the others' arrival counters, and reads
  every slot; no Python per element). vLLM's CPU backend takes the same road across the sockets of
  one machine (its shared-memory all-reduce, ``csrc/cpu/shm.cpp``).
- :class:`GlooCommunicator`: ranks on different nodes, ``torch.distributed`` over gloo (TCP).
- :func:`reference_all_reduce`: the plain PyTorch sum both must equal.

Both give every rank the same bits: partial sums are added in rank order in float32 and
rounded once to the tensors' dtype (the ranks must hold identical hidden states, or their
outputs drift apart). Errors a rank cannot recover from (a peer that died, a group that never
formed) raise :class:`kvmesh.core.errors.DependencyUnavailableError`.
"""

from __future__ import annotations

import mmap
import os
import time
from datetime import timedelta

import torch

from kvmesh.core.errors import DependencyUnavailableError

SLOT_BYTES = 8 << 20      # per rank and round parity: a 1.5k-token bf16 chunk of a 2k hidden size in one round
HEADER_BYTES = 64 * 64    # csrc/shm_comm.cpp: kMaxRanks lines of 64 bytes
TIMEOUT_S = 60.0          # seconds a rank waits for its peers before it gives up on the group
SHM_DIR = "/dev/shm"


def reference_all_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``parts`` (one per rank, in rank order, equal shapes and dtypes): float32
    accumulation in rank order, rounded once to their dtype."""
    acc = parts[0].float().clone()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(parts[0].dtype)


def reference_all_gather(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[N, W_r]`` parts of every rank → ``[N, sum W_r]``, rank after rank along the last dim."""
    return torch.cat(parts, dim=-1)


class ShmCommunicator:
    """A group of ``world_size`` ranks on one node sharing the segment ``/dev/shm/<name>``.

    Rank 0 creates the segment (``HEADER_BYTES + 2 world slot_bytes`` bytes, zero-filled: a
    temporary name renamed into place, so a peer never maps a half-made file); the others wait
    for it (up to ``timeout_s``). Once all ranks mapped it (a first all-reduce), or that first
    all-reduce failed, rank 0 removes the name: the mappings stay, and nothing is left in /dev/shm
    when a rank dies.

    Raises:
        DependencyUnavailableError: the native kernels are not built (use gloo), the segment
            does not appear within ``timeout_s``, or a peer does not arrive within ``timeout_s``
            at a call (dead or hung).
    """

    kind = "shm"

    def __init__(self, rank: int, world_size: int, name: str, slot_bytes: int = SLOT_BYTES,
                 timeout_s: float = TIMEOUT_S):
        from workers import kernels
        if not kernels.available():
            raise DependencyUnavailableError(f"shared-memory tensor parallelism needs the native kernels "
                                             f"({kernels.unavailable_reason()}); ranks on different nodes use gloo")
        if "/" in name or not name:
            raise ValueError(f"bad segment name {name!r}")
        self.rank, self.world_size, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        self.path = os.path.join(SHM_DIR, name)
        size = HEADER_BYTES + 2 * world_size * slot_bytes
        if rank == 0:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            os.rename(tmp, self.path)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                    break
                except FileNotFoundError:
                    if time.monotonic() > deadline:
                        raise DependencyUnavailableError(f"tensor-parallel rank {rank}: rank 0's segment {self.path} "
                                                         f"did not appear within {timeout_s:g} s") from None
                    time.sleep(0.01)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.segment = torch.frombuffer(self._map, dtype=torch.uint8)
        self.seq = 0
        try:
            self.all_reduce(torch.zeros(1))       # every rank has mapped the segment
        finally:                                  # formed or not, the name goes
            if rank == 0:
                os.unlink(self.path)

    def _call(self, op, *args):
        try:
            return op(*args, self.segment, self.rank, self.world_size, self.slot_bytes, self.seq, self.timeout_s)
        except RuntimeError as e:
            raise DependencyUnavailableError(str(e).splitlines()[0]) from None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (float32, bfloat16 or float16; any shape), written into
        ``x`` (made contiguous first) and returned; the same bits on every rank."""
        x = x.contiguous()
        self.seq = self._call(torch.ops.kvmesh.shm_all_reduce, x)
        return x

    def all_gather(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's ``[N, widths[r]]`` ``x`` (same N and dtype on every rank) → ``[N, sum
        widths]``, rank after rank along the last dim."""
        x = x.contiguous()
        n, item = x.shape[0], x.element_size()
        out = torch.empty(sum(n * w * item for w in widths), dtype=torch.uint8)
        self.seq = self._call(torch.ops.kvmesh.shm_all_gather, x, out, [n * w * item for w in widths])
        parts, off = [], 0
        for w in widths:
            parts.append(out[off: off + n * w * item].view(x.dtype).view(n, w))
            off += n * w * item
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        self.segment = None
        self._map.close()


class GlooCommunicator:
    """A group of ranks on any nodes: ``torch.distributed`` with the gloo backend over TCP,
    meeting at ``init_method`` (``tcp://host:port`` of rank 0). The sum is an all-gather of the
    ranks' tensors added in rank order in float32 here (gloo's own all-reduce does not promise
    the same bits on every rank). This process's default process group is the one group.

    Raises:
        DependencyUnavailableError: the group does not form within ``timeout_s``, or a call
            fails (a peer died).
    """

    kind = "gloo"

    def __init__(self, rank: int, world_size: int, init_method: str, timeout_s: float = TIMEOUT_S):
        import torch.distributed as dist
        self.rank, self.world_size = rank, world_size
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:
            raise DependencyUnavailableError(f"tensor-parallel rank {rank}: the gloo group at {init_method} did "
                                             f"not form: {str(e).splitlines()[0]}") from None
        self._dist = dist

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            self._dist.all_gather(parts, x)
        except RuntimeError as e:
            raise DependencyUnavailableError(f"tensor-parallel rank {self.rank}: gloo: {str(e).splitlines()[0]}") from None
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`ShmCommunicator.all_reduce` (a new tensor, ``x`` left as it is)."""
        return reference_all_reduce(self._gather(x.contiguous()))

    def all_gather(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """As :meth:`ShmCommunicator.all_gather` (gloo needs equal shapes: padded to the widest)."""
        most = max(widths)
        padded = torch.nn.functional.pad(x.contiguous(), (0, most - x.shape[-1]))
        return reference_all_gather([p[:, :w] for p, w in zip(self._gather(padded), widths)])

    def close(self) -> None:
        self._dist.destroy_process_group()


def create_communicator(kind: str, rank: int, world_size: int, address: str):
    """``shm`` (``address``: the segment's name) or ``gloo`` (``address``: ``tcp://host:port``)."""
    if kind == "shm":
        return ShmCommunicator(rank, world_size, address)
    if kind == "gloo":
        return GlooCommunicator(rank, world_size, address)
    raise ValueError(f"unknown communicator kind {kind!r}")
