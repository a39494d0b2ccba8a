"""The tensor-parallel communicators (workers/communicator.py) in real processes: the
shared-memory group (the native ops of csrc/shm_comm.cpp) and the gloo group, 2 and 3 ranks, sum
and gather exactly as the plain PyTorch reference, with the same bits on every rank, across
tensors larger than a slot and hundreds of consecutive calls; a rank that never arrives is an
error naming it, not a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import uuid

import pytest
import torch
from hypothesis import given, settings, strategies as st

from workers import kernels
from workers.communicator import reference_all_gather, reference_all_reduce

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")

SLOT = 4096      # bytes: small slots, so that the sizes below take several rounds


def _inputs(rank: int, sizes: list[int], dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 7)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def _rank_main(kind, rank, world, address, sizes, dtype_name, widths, calls, out_q, done=None):
    torch.set_num_threads(1)
    from workers.communicator import GlooCommunicator, ShmCommunicator
    dtype = getattr(torch, dtype_name)
    try:
        comm = (ShmCommunicator(rank, world, address, slot_bytes=SLOT, timeout_s=30) if kind == "shm"
                else GlooCommunicator(rank, world, address, timeout_s=30))
        sums = [comm.all_reduce(x.clone()) for x in _inputs(rank, sizes, dtype)]
        g = torch.Generator().manual_seed(rank)
        gathered = comm.all_gather(torch.randn(3, widths[rank], generator=g), widths)
        last = None
        for i in range(calls):                     # many rounds: both parities, reused slots
            last = comm.all_reduce(torch.full((5,), float(rank + i)))
        comm.close()
        out_q.put((rank, sums, gathered, last))
    except Exception as e:                          # noqa: BLE001 (reported to the test)
        out_q.put((rank, repr(e), None, None))
    if done is not None:            # tensors cross the queue as shared memory this process must keep
        done.wait(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(kind, world, sizes, dtype_name="float32", widths=None, calls=0, timeout=120):
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    address = f"kvmesh-test-{uuid.uuid4().hex[:10]}" if kind == "shm" else f"tcp://127.0.0.1:{_free_port()}"
    widths = widths or [4 + r for r in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(kind, r, world, address, sizes, dtype_name, widths, calls, q, done))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = {r: [x.clone() if isinstance(x, torch.Tensor) else x for x in rest]
                   for r, *rest in (q.get(timeout=timeout) for _ in procs)}
        results = {r: ([t.clone() for t in v[0]] if isinstance(v[0], list) else v[0], *v[1:]) for r, v in results.items()}
    finally:
        done.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results, widths


@pytest.mark.parametrize("kind,world", [("shm", 2), ("shm", 3), ("gloo", 2)])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sums_and_gathers_equal_the_reference_with_the_same_bits_on_every_rank(kind, world, dtype_name):
    sizes = [1, 1536, 5 * 1536, 3 * SLOT // 2 + 7]         # the last: more than one slot (several rounds)
    results, widths = _run(kind, world, sizes, dtype_name, calls=200)
    dtype = getattr(torch, dtype_name)
    for rank, (sums, gathered, last) in results.items():
        assert not isinstance(sums, str), sums
        for i, got in enumerate(sums):
            want = reference_all_reduce([_inputs(r, sizes, dtype)[i] for r in range(world)])
            assert got.dtype == dtype and torch.equal(got, want), (rank, sizes[i])
        parts = [torch.randn(3, widths[r], generator=torch.Generator().manual_seed(r)) for r in range(world)]
        assert torch.equal(gathered, reference_all_gather(parts))
        assert torch.equal(last, torch.full((5,), float(sum(range(world)) + world * 199)))


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * SLOT), min_size=1, max_size=4), world=st.sampled_from([2, 3]))
def test_any_sizes_sum_exactly_over_shared_memory(sizes, world):
    results, _ = _run("shm", world, sizes)
    for sums, _, _ in results.values():
        assert not isinstance(sums, str), sums
        for i, got in enumerate(sums):
            assert torch.equal(got, reference_all_reduce([_inputs(r, sizes, torch.float32)[i] for r in range(world)]))


def _lonely_rank(name, q):
    torch.set_num_threads(1)
    from kvmesh.core.errors import DependencyUnavailableError
    from workers.communicator import ShmCommunicator
    try:
        ShmCommunicator(0, 2, name, slot_bytes=SLOT, timeout_s=1.5)
        q.put("no error")
    except DependencyUnavailableError as e:
        q.put(str(e))


def test_a_rank_that_never_arrives_is_an_error_naming_it():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = f"kvmesh-test-{uuid.uuid4().hex[:10]}"
    p = ctx.Process(target=_lonely_rank, args=(name, q))
    p.start()
    msg = q.get(timeout=60)
    p.join(10)
    assert "rank(s) 1 did not reach round 1" in msg and "1.5 s" in msg, msg
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name)]      # the segment's name is gone
