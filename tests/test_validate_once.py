"""Validate once, hash once (issue 38 item 4): each trust boundary validates a request once, the
internal hops carry what it validated, and the prompt's block hashes are computed once.

The real default path: a gateway in front of a scheduler service (SmolLM2-135M float32, local
executor, prefix routing, prefix caching) whose replica runs in an engine process. Counters wrap
``SamplingParams.validate``, ``hash_blocks`` (the router's and the block manager's) and the
max_model_len checks, in this process (gateway and scheduler service) and in the engine process
(its entry point is wrapped to install them there too); every call appends a line to a file.

* one request through the gateway: sampling validated twice (the gateway's edge and the scheduler
  service's edge, none in the engine process), the prompt hashed once (by the router), each
  block of the sequence hashed once, max_model_len checked once per edge;
* bad sampling straight to the scheduler service: INVALID_ARGUMENT naming the field, before
  routing and before any engine sees it; so are a bad prompt and one too long for max_model_len;
* the router's hashes are the block manager's own (same seed, block size and cache salt), and
  hashes of another chain are refused (the block manager hashes the prompt itself).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import time

import grpc
import pytest
import pytest_asyncio

from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc, scheduler_pb2 as pb, scheduler_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_LEN = 256
BLOCK = 16


# ---- counters (this process and the engine process) ---------------------------------------------

def _install_counters(log_path: str, where: str, setattr_=setattr) -> None:
    """Wrap the validating, hashing and max_model_len-checking functions so that each call appends
    ``<where> <kind> <detail>`` to ``log_path``."""
    import kvstore.hashing
    import scheduler.block_manager
    import scheduler.router
    import scheduler.scheduler
    import scheduler.service

    def record(kind: str, detail: str = "-") -> None:
        with open(log_path, "a") as f:
            f.write(f"{where} {kind} {detail}\n")

    validate = SamplingParams.validate

    def counted_validate(self):
        record("validate")
        return validate(self)

    setattr_(SamplingParams, "validate", counted_validate)

    def hashing(module, name):
        def counted(seed, token_ids, block_size, parent=None, start_block=0, cache_salt=None):
            out = kvstore.hashing.hash_blocks(seed, token_ids, block_size, parent, start_block, cache_salt)
            record(f"hash:{name}", f"{start_block}:{len(out)}")
            return out
        setattr_(module, "hash_blocks", counted)

    hashing(scheduler.router, "router")
    hashing(scheduler.block_manager, "block_manager")

    def length_check(module, name):
        check = module.check_length

        def counted(*a, **kw):
            record(f"max_model_len:{name}")
            return check(*a, **kw)
        setattr_(module, "check_length", counted)

    length_check(scheduler.service, "service")
    length_check(scheduler.scheduler, "scheduler")
    if where != "engine":
        from gateway.stream import RequestPath
        check_prompt_len = RequestPath.check_prompt_len

        def counted_prompt_len(self, n):
            record("max_model_len:gateway")
            return check_prompt_len(self, n)
        setattr_(RequestPath, "check_prompt_len", counted_prompt_len)


def counting_engine_core_main(log_path: str, *args) -> None:
    """The engine process's entry point with the counters installed (pickled by reference: this
    module is importable in the spawned process, tests/ being on its sys.path)."""
    _install_counters(log_path, "engine")
    from scheduler.engine_core_process import engine_core_main
    engine_core_main(*args)


class Counts:
    def __init__(self, path: str):
        self.path = path

    def lines(self) -> list[tuple[str, str, str]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [tuple(line.split()) for line in f]

    def since(self, mark: int) -> list[tuple[str, str, str]]:
        return self.lines()[mark:]


# ---- the mesh ------------------------------------------------------------------------------------

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(smollm2_dir, tmp_path_factory):
    import scheduler.engine_core
    from gateway.server import serve_gateway
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
    from scheduler.service import serve_scheduler

    log_path = str(tmp_path_factory.mktemp("counts") / "calls.log")
    with pytest.MonkeyPatch.context() as mp:
        _install_counters(log_path, "front", mp.setattr)
        mp.setattr(scheduler.engine_core, "engine_core_main", functools.partial(counting_engine_core_main, log_path))
        sc = SchedulerConfig(executor="local", port=0)
        assert sc.engine_process and sc.routing == "prefix"          # the default path
        ec = EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=48 * 2**20, max_model_len=MAX_LEN)
        assert ec.enable_prefix_caching and ec.block_size == BLOCK
        sched = await serve_scheduler(sc, ec)
        try:
            await sched.wait_ready()
            gw = await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=60,
                                                   default_timeout=60, max_timeout=120))
            try:
                async with grpc.aio.insecure_channel(gw.address) as gch, \
                        grpc.aio.insecure_channel(sched.address) as sch:
                    yield collections.namedtuple("Mesh", "sched gw stub sched_stub counts")(
                        sched, gw, llm_pb2_grpc.LLMServiceStub(gch), scheduler_pb2_grpc.SchedulerServiceStub(sch),
                        Counts(log_path))
            finally:
                await gw.stop(0)
        finally:
            await sched.stop(0)


async def _wait_idle(stub, timeout: float = 10.0) -> pb.ReplicaStats:
    end = time.monotonic() + timeout
    while True:
        r = (await stub.GetStats(pb.GetStatsRequest())).replicas[0]
        if (r.num_used_blocks, r.num_running, r.num_waiting) == (0, 0, 0) or time.monotonic() > end:
            return r
        await asyncio.sleep(0.02)


# ---- (a) one request through the real path ------------------------------------------------------

async def test_one_request_validated_once_per_edge_and_hashed_once(mesh, prose_ids):
    prompt = list(prose_ids[200:240])                  # 2 full blocks + 8 tokens
    assert len(prompt) == 40
    new = 20                                           # 60 tokens: block 2 fills during decode
    await _wait_idle(mesh.sched_stub)
    mark = len(mesh.counts.lines())
    req = llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=prompt), cache_salt="once",
                                  sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    msgs = [m async for m in mesh.stub.Generate(req)]
    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == new
    await _wait_idle(mesh.sched_stub)
    calls = mesh.counts.since(mark)
    by = collections.Counter((w, k) for w, k, _ in calls)

    # sampling: the gateway's edge and the scheduler service's edge (both in this process), not the engine's
    assert by[("front", "validate")] == 2, calls
    assert by[("engine", "validate")] == 0, calls

    # the prompt's blocks: hashed by the router, adopted by the block manager
    hashes = [(w, k, tuple(map(int, d.split(":")))) for w, k, d in calls if k.startswith("hash:")]
    assert [(w, k) for w, k, (start, n) in hashes if start == 0] == [("front", "hash:router")], hashes
    assert ("front", "hash:router", (0, len(prompt) // BLOCK)) in hashes
    hashed = [b for _, _, (start, n) in hashes for b in range(start, start + n)]
    total_blocks = (len(prompt) + new - 1) // BLOCK    # the last token's K/V is never written
    assert sorted(hashed) == list(range(len(hashed))) and len(hashed) <= total_blocks, hashes
    assert all(w == "engine" for w, k, (start, n) in hashes if k == "hash:block_manager")

    # max_model_len: once at the gateway (the token ids' length, before reading them), once at the
    # scheduler service's edge, not in the engine
    assert by[("front", "max_model_len:gateway")] == 1, calls
    assert by[("front", "max_model_len:service")] == 1, calls
    assert by[("engine", "max_model_len:scheduler")] == 0, calls


async def test_cached_prefix_hit_with_the_routers_hashes(mesh, prose_ids):
    """A second request sharing the prompt's first two blocks (same salt) hits them: the block
    manager registered the hashes the router sent, and found them again."""
    prompt = list(prose_ids[240:280])
    assert len(prompt) == 40
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for want_cached in (0, 2 * BLOCK):
        req = llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=prompt), cache_salt="hit",
                                      sampling=sampling)
        msgs = [m async for m in mesh.stub.Generate(req)]
        assert msgs[-1].usage.cached_prompt_tokens == want_cached
    # another salt: no hit
    req = llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=prompt), cache_salt="other",
                                  sampling=sampling)
    msgs = [m async for m in mesh.stub.Generate(req)]
    assert msgs[-1].usage.cached_prompt_tokens == 0


# ---- (b) the scheduler service's own edge --------------------------------------------------------

BAD_SAMPLING = {
    "temperature": common_pb2.SamplingParams(temperature=-1.0),
    "top_p": common_pb2.SamplingParams(top_p=0.0),
    "top_k": common_pb2.SamplingParams(top_k=-5),
    "repetition_penalty": common_pb2.SamplingParams(repetition_penalty=0.0),
    "max_tokens": common_pb2.SamplingParams(max_tokens=0),
    "min_tokens": common_pb2.SamplingParams(max_tokens=2, min_tokens=5),
    "logprobs": common_pb2.SamplingParams(logprobs=21),
}


@pytest.mark.parametrize("field", list(BAD_SAMPLING))
async def test_scheduler_service_rejects_bad_sampling_at_its_edge(mesh, prose_ids, field):
    service = mesh.sched.service
    routed = service.router.stats.routed
    mark = len(mesh.counts.lines())
    call = mesh.sched_stub.Submit(pb.SubmitRequest(prompt_token_ids=list(prose_ids[:20]),
                                                   sampling=BAD_SAMPLING[field]))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        [m async for m in call]
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in ei.value.details() and ei.value.details().startswith("sampling: ")
    assert service.router.stats.routed == routed                     # before routing: no engine saw it
    assert not [c for c in mesh.counts.since(mark) if c[0] == "engine"]


@pytest.mark.parametrize("case", ["empty", "vocab", "max_model_len"])
async def test_scheduler_service_rejects_bad_prompts_at_its_edge(mesh, case):
    prompt, sampling, match = {
        "empty": ([], common_pb2.SamplingParams(), "prompt is empty"),
        "vocab": ([1, 10**6], common_pb2.SamplingParams(), "outside the vocabulary"),
        "max_model_len": ([1] * 250, common_pb2.SamplingParams(max_tokens=7), "= 257 exceeds max_model_len 256"),
    }[case]
    routed = mesh.sched.service.router.stats.routed
    mark = len(mesh.counts.lines())
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        [m async for m in mesh.sched_stub.Submit(pb.SubmitRequest(prompt_token_ids=prompt, sampling=sampling))]
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in ei.value.details()
    assert mesh.sched.service.router.stats.routed == routed
    assert not [c for c in mesh.counts.since(mark) if c[0] == "engine"]


async def test_gateway_rejects_bad_sampling_naming_the_field(mesh):
    req = llm_pb2.GenerateRequest(prompt="Hello", sampling=common_pb2.SamplingParams(top_p=2.0))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        [m async for m in mesh.stub.Generate(req)]
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in ei.value.details()


# ---- (c) the router's hashes are the block manager's --------------------------------------------

@pytest.mark.parametrize("salt", ["", "tenant-a"])
async def test_router_and_block_manager_hash_alike(mesh, prose_ids, salt):
    """With prefix caching on, the router's hashes of a prompt (its seed and block size: the
    replicas') equal those a block manager with the replica's seed computes itself, under the
    same cache salt; and the block manager takes them (its one-block check passes)."""
    from scheduler.block_manager import BlockManager
    from scheduler.request import Request
    info = mesh.sched.service.replicas[0].info
    router = mesh.sched.service.router
    assert (router.hash_seed, router.block_size) == (info.hash_seed, info.block_size)
    prompt = list(prose_ids[:5 * BLOCK + 3])
    sent = router.block_hashes(prompt, salt)
    assert len(sent) == 5

    bm = BlockManager(64, info.block_size, True, info.hash_seed)
    own = Request("own", prompt, SamplingParams(), cache_salt=salt)
    bm.find_cached_prefix(own)                      # hashes the prompt itself
    assert own.block_hashes == sent

    adopted = Request("adopted", prompt, SamplingParams(), cache_salt=salt)
    assert bm.adopt_prompt_hashes(adopted, sent) and adopted.block_hashes == sent
    bm.find_cached_prefix(adopted)
    assert adopted.block_hashes == sent             # nothing recomputed, nothing changed


async def test_block_manager_refuses_hashes_of_another_chain(mesh, prose_ids):
    from kvstore.hashing import hash_blocks
    from scheduler.block_manager import BlockManager
    from scheduler.request import Request
    seed = mesh.sched.service.replicas[0].info.hash_seed
    prompt = list(prose_ids[:4 * BLOCK])
    bm = BlockManager(64, BLOCK, True, seed)
    good = hash_blocks(seed, prompt, BLOCK, cache_salt="a")
    for bad in (hash_blocks(seed, prompt, BLOCK, cache_salt="b"),          # another salt
                hash_blocks(seed + 1, prompt, BLOCK, cache_salt="a"),      # another seed
                hash_blocks(seed, prompt, 2 * BLOCK, cache_salt="a"),      # another block size
                good[:-1]):                                                # not every block
        req = Request("r", prompt, SamplingParams(), cache_salt="a")
        assert not bm.adopt_prompt_hashes(req, bad) and req.block_hashes == []
        bm.find_cached_prefix(req)
        assert req.block_hashes == good
    off = BlockManager(64, BLOCK, False, seed)      # prefix caching off: nothing taken
    req = Request("r", prompt, SamplingParams(), cache_salt="a")
    assert not off.adopt_prompt_hashes(req, good) and req.block_hashes == []


async def test_trusted_params_skip_validation_only():     # async only to share the module's loop mark
    fields = dict(temperature=0.0, top_k=5, max_tokens=7, stop=("x",), stop_token_ids=(3,))
    assert SamplingParams.trusted(**fields) == SamplingParams(**fields)
    assert SamplingParams.trusted().max_tokens == SamplingParams().max_tokens
    with pytest.raises(TypeError, match="nope"):
        SamplingParams.trusted(nope=1)
    from kvmesh.core.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=0)                       # the public constructor still validates
