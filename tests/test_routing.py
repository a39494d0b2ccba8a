"""KV-aware routing end to end: a scheduler service with two replicas (executor "local",
SmolLM2-135M in float32, 40-block KV pools so eviction is reachable) publishing to a real Redis
prefix index, and chats submitted as token ids (turn k+1 = turn k's prompt + its answer + a new
user message).

Redis: ``REDIS_URL`` (default redis://127.0.0.1:6379/0) with a key prefix of this module's
own, whose keys are deleted at the end (never FLUSHALL); if nothing answers there, a private
``redis-server`` is started (skipped without one). The outage test always runs its own
``redis-server`` on a free port, kills it mid-test and restarts it.

Busy replicas are made with a long request submitted straight to that replica's engine, so a
routing decision that ignored the index would go elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import SchedulerConfig
from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2, scheduler_pb2 as pb, scheduler_pb2_grpc
from kvstore.hashing import hash_blocks
from kvstore.index_contract import IndexUnavailable
from kvstore.index_redis import RedisIndex
from scheduler.service import serve_scheduler

pytestmark = pytest.mark.asyncio(loop_scope="module")

redis = pytest.importorskip("redis")

BLOCK = 16
NUM_BLOCKS = 40                 # KV pool of each replica
BLOCK_BYTES = 737_280           # SmolLM2-135M float32: 30 layers x 2 x 3 KV heads x 64 x 16 tokens x 4 bytes
MAX_LEN = 512
VOCAB = 49152
NEW = 8                         # greedy output tokens per turn
PROVISIONAL_TTL = 0.2           # s; tests wait it out so that the index alone decides
SCHEDULER_ID = "routing-test"


def _ping(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping()
    except (redis.RedisError, OSError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private ``redis-server`` on a free port, no persistence; ``kill`` and ``start`` again
    (same port, empty)."""

    def __init__(self):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _ping(self.url):
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _delete_keys(url: str, prefix: str) -> None:
    with contextlib.suppress(redis.RedisError, OSError):
        r = redis.Redis.from_url(url, socket_timeout=2)
        for key in r.scan_iter(match=f"{prefix}:*", count=1000):
            r.delete(key)
        r.close()


# ---- chats, turns, replicas ---------------------------------------------------------------------

class Chat:
    """A conversation as token ids (random ids: the model's answers do not matter here)."""

    def __init__(self, seed: int, first: int = 90):
        self.rng = random.Random(seed)
        self.prompt = self.words(first)
        self.previous: list[int] = []        # the prompt of the previous turn

    def words(self, n: int) -> list[int]:
        return [self.rng.randrange(100, VOCAB) for _ in range(n)]

    def add(self, answer: list[int], user: int = 30) -> None:
        """The next turn's prompt: this one + the answer + a new user message."""
        self.previous, self.prompt = self.prompt, self.prompt + answer + self.words(user)

    def expected_cached(self) -> int:
        """Prompt tokens the replica that served the previous turn still holds: the full blocks
        it computed (its prompt and all but the last answer token)."""
        return BLOCK * ((len(self.previous) + NEW - 1) // BLOCK)


@dataclass
class Turn:
    replica: int
    answer: list[int]
    cached: int


async def turn(stub, prompt: list[int], session: str = "") -> Turn:
    call = stub.Submit(pb.SubmitRequest(prompt_token_ids=prompt, session_id=session, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True)))
    msgs = [m async for m in call]
    assert msgs[-1].finished and len({m.replica for m in msgs}) == 1
    return Turn(msgs[-1].replica, [t for m in msgs for t in m.token_ids], msgs[-1].usage.cached_prompt_tokens)


@contextlib.asynccontextmanager
async def busy(replica, seed: int = 0):
    """A long request running on ``replica`` (straight to its engine) while the block runs."""
    ids = Chat(seed + 1000).words(20)
    gen = replica.aengine.generate(None, ids, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    await gen.__anext__()               # running: its tokens count as load
    try:
        yield
    finally:
        await gen.aclose()              # aborts it


async def fill(replica, n: int = 2, seed: int = 0) -> None:
    """Run ``n`` unrelated 500-token prompts on ``replica``: every older cached block is evicted."""
    for k in range(n):
        async for _ in replica.aengine.generate(None, Chat(seed + 2000 + k).words(500),
                                                SamplingParams(temperature=0.0, max_tokens=1)):
            pass


def held(index: RedisIndex, prompt: list[int], seed: int) -> dict[int, int]:
    """Replica index -> leading blocks of ``prompt`` the index says it holds ({} if Redis is down)."""
    try:
        found = index.match(hash_blocks(seed, prompt, BLOCK))
    except IndexUnavailable:
        return {}
    return {int(rid.rsplit("/", 1)[1]): n for rid, n in found.items() if rid.startswith(SCHEDULER_ID + "/")}


async def wait_for(pred, what: str, timeout: float = 15.0):
    """Poll ``pred()`` (sync or async) until truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


async def wait_idle(stub) -> None:
    async def idle():
        st = await stub.GetStats(pb.GetStatsRequest())
        return all(r.num_running == 0 and r.num_waiting == 0 for r in st.replicas)
    await wait_for(idle, "idle replicas")
    await asyncio.sleep(PROVISIONAL_TTL)


def _configs(smollm2_dir, redis_url: str, prefix: str) -> tuple[SchedulerConfig, EngineConfig]:
    # index_timeout 0.5 s: on a busy 2-core machine a 5 ms Redis reply can be late (GIL), which
    # would route by load and make these tests flaky; the outage test needs refusals only.
    sched = SchedulerConfig(port=0, replicas=2, executor="local", routing="prefix", redis_url=redis_url,
                            index_prefix=prefix, index_timeout=0.5, provisional_ttl=PROVISIONAL_TTL,
                            scheduler_id=SCHEDULER_ID)
    eng = EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES,
                       max_model_len=MAX_LEN)
    return sched, eng


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_url():
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if _ping(url):
        yield url
    elif shutil.which("redis-server"):
        srv = RedisServer()
        yield srv.url
        srv.kill()
    else:
        pytest.skip(f"no Redis at {url} (set REDIS_URL) and no redis-server to start")


@pytest.fixture(scope="module")
def prefix():
    return f"kvmesh-test-{uuid.uuid4().hex[:8]}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(smollm2_dir, redis_url, prefix):
    srv = await serve_scheduler(*_configs(smollm2_dir, redis_url, prefix))
    try:
        await srv.wait_ready()
        yield srv
    finally:
        await srv.stop(grace=1.0)
        _delete_keys(redis_url, prefix)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(server):
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield scheduler_pb2_grpc.SchedulerServiceStub(ch)


@pytest.fixture(scope="module")
def index(redis_url, prefix):
    idx = RedisIndex(redis_url, prefix=prefix, timeout=1.0)
    yield idx
    idx.close()


@pytest.fixture(scope="module")
def seed(server):
    return server.service.replicas[0].info.hash_seed


# ---- tests --------------------------------------------------------------------------------------

async def test_server_publishes_every_replica(stub):
    st = await stub.GetStats(pb.GetStatsRequest())
    assert (st.routing, st.scheduler_id) == ("prefix", SCHEDULER_ID) and st.index.startswith("redis")
    assert [(r.replica_id, r.indexed, r.num_blocks) for r in st.replicas] == \
        [(f"{SCHEDULER_ID}/0", True, NUM_BLOCKS), (f"{SCHEDULER_ID}/1", True, NUM_BLOCKS)]

    async def resynced():
        return all(r.index_resyncs >= 1 for r in (await stub.GetStats(pb.GetStatsRequest())).replicas)
    await wait_for(resynced, "the publishers' first resync")


async def test_turn2_goes_where_turn1_was_served_then_eviction_routes_by_load(server, stub, index, seed):
    r0, r1 = server.service.replicas
    chat = Chat(seed=1)
    await wait_idle(stub)
    async with busy(r0):
        t1 = await turn(stub, chat.prompt, session="chat-1")
    assert t1.replica == 1 and t1.cached == 0                       # replica 0 was busy
    chat.add(t1.answer)
    shared = chat.expected_cached()
    assert shared == BLOCK * ((len(chat.previous) + len(t1.answer)) // BLOCK) == 96
    await wait_for(lambda: held(index, chat.prompt, seed).get(1) == shared // BLOCK, "turn 1's blocks in Redis")
    await wait_idle(stub)
    before = await stub.GetStats(pb.GetStatsRequest())
    t2 = await turn(stub, chat.prompt)                              # no session id: the hashes decide
    assert t2.replica == 1 and t2.cached == shared
    after = await stub.GetStats(pb.GetStatsRequest())
    assert after.routed_requests == before.routed_requests + 1
    assert after.prefix_routed == before.prefix_routed + 1
    assert after.prefix_routed_blocks == before.prefix_routed_blocks + shared // BLOCK

    # replica 1 evicts the chat: the index forgets it, and turn 3 goes by load
    chat.add(t2.answer)
    await wait_for(lambda: held(index, chat.prompt, seed).get(1, 0) >= shared // BLOCK, "turn 2's blocks")
    await fill(r1, seed=1)
    await wait_for(lambda: 1 not in held(index, chat.prompt, seed), "evicted blocks leaving the index")
    await wait_idle(stub)
    async with busy(r1):
        t3 = await turn(stub, chat.prompt, session="chat-1")
    assert t3.replica == 0 and t3.cached == 0


async def test_removed_replica_leaves_the_index_and_comes_back(server, stub, index, seed):
    r0, r1 = server.service.replicas
    chat = Chat(seed=2)
    await wait_idle(stub)
    async with busy(r0):
        t1 = await turn(stub, chat.prompt)
    assert t1.replica == 1
    chat.add(t1.answer)
    await wait_for(lambda: held(index, chat.prompt, seed).get(1, 0) >= 1, "turn 1's blocks")

    await asyncio.to_thread(r1.stop_publishing)                     # removes its entries at once
    assert held(index, chat.prompt, seed) == {}
    assert not (await stub.GetStats(pb.GetStatsRequest())).replicas[1].indexed
    await wait_idle(stub)
    async with busy(r1):
        t2 = await turn(stub, chat.prompt)
    assert t2.replica == 0                                          # replica 1 still holds it, unknown

    r1.start_publishing(server.service.index)                       # resync: its cache is known again
    await wait_for(lambda: held(index, chat.previous, seed).get(1, 0) >= 1, "replica 1 back in the index")
    st = await stub.GetStats(pb.GetStatsRequest())
    assert st.replicas[1].indexed and st.replicas[1].index_resyncs >= 1


async def test_dead_replica_leaves_the_index(server, stub, index, seed):
    r0, r1 = server.service.replicas
    chat = Chat(seed=3)
    await wait_idle(stub)
    async with busy(r0):
        t1 = await turn(stub, chat.prompt)
    assert t1.replica == 1
    chat.add(t1.answer)
    await wait_for(lambda: held(index, chat.prompt, seed).get(1, 0) >= 1, "turn 1's blocks")
    r1.aengine.errored = RuntimeError("test: replica 1 down")
    try:
        st = await stub.GetStats(pb.GetStatsRequest())
        assert [(r.healthy, r.indexed) for r in st.replicas] == [(True, True), (False, False)]
        assert held(index, chat.prompt, seed) == {}
        t2 = await turn(stub, chat.prompt)
        assert t2.replica == 0
    finally:
        r1.aengine.errored = None
        if r1.publisher is None:
            r1.start_publishing(server.service.index)


@pytest.mark.chaos
async def test_redis_outage_routes_by_load_then_recovers(smollm2_dir):
    if not shutil.which("redis-server"):
        pytest.skip("needs redis-server for a private Redis to kill")
    rs = RedisServer()
    prefix = f"kvmesh-outage-{uuid.uuid4().hex[:8]}"
    srv = await serve_scheduler(*_configs(smollm2_dir, rs.url, prefix))
    index = RedisIndex(rs.url, prefix=prefix, timeout=1.0)
    try:
        await srv.wait_ready()
        seed = srv.service.replicas[0].info.hash_seed
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            stats = lambda: stub.GetStats(pb.GetStatsRequest())     # noqa: E731
            chat = Chat(seed=4)
            t1 = await turn(stub, chat.prompt, session="chat-4")
            chat.add(t1.answer)
            await wait_for(lambda: held(index, chat.prompt, seed).get(t1.replica, 0) >= 1, "turn 1's blocks")

            rs.kill()
            others = [Chat(seed=40 + i).prompt for i in range(3)]
            outs = await asyncio.gather(*(turn(stub, p) for p in [chat.prompt] + others))
            assert all(len(o.answer) == NEW for o in outs)          # every request completed
            st = await stats()
            assert st.routing_fallbacks >= 1
            await wait_for(lambda: stats_failed(stats), "publishers noticing the outage")

            rs.start()                                              # empty: the publishers resync
            t2 = outs[0]
            chat.add(t2.answer)
            await wait_for(lambda: held(index, chat.prompt, seed).get(t2.replica, 0) >= 1, "resync after restart")
            await wait_idle(stub)
            fallbacks = (await stats()).routing_fallbacks
            async with busy(srv.service.replicas[t2.replica], seed=4):
                t3 = await turn(stub, chat.prompt)
            assert t3.replica == t2.replica and t3.cached == chat.expected_cached()
            assert (await stats()).routing_fallbacks == fallbacks
    finally:
        await srv.stop(grace=1.0)
        index.close()
        rs.kill()


async def stats_failed(stats) -> bool:
    return all(r.index_failures > 0 for r in (await stats()).replicas)


@pytest.mark.chaos
async def test_restarted_replica_is_credited_only_with_what_it_holds(smollm2_dir, redis_url):
    """A replica restarts with an empty KV pool: the router credits it with nothing of its dead
    incarnation. A chat is warmed on replica 0 (turn 1, routed there: the router records its
    blocks as provisionally held by replica 0), replica 1 holds the chat's first 3 blocks (a
    shared system prompt), replica 0's engine process is SIGKILLed and restarts; turn 2 then goes
    to replica 1, by what is really cached (3 blocks, reused there), the index holding nothing of
    replica 0's dead incarnation. Before, the router's provisional entries of the dead
    incarnation outlived it and sent turn 2 to the restarted replica 0, credited with turn 1's 6
    blocks, where nothing was cached. ``provisional_ttl`` is 120 s here so that the restart,
    whose time depends on the machine's load, always falls within it; with the default 2 s a
    restart of 1.4 s (measured on a quiet machine, docs/mesh.md) did the same."""
    prefix = f"kvmesh-test-restart-{uuid.uuid4().hex[:8]}"
    sched_cfg, eng_cfg = _configs(smollm2_dir, redis_url, prefix)
    srv = await serve_scheduler(sched_cfg.replace(provisional_ttl=120.0), eng_cfg)
    index = RedisIndex(redis_url, prefix=prefix, timeout=1.0)
    try:
        await srv.wait_ready()
        seed = srv.service.replicas[0].info.hash_seed
        r0, r1 = srv.service.replicas
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            stats = lambda: stub.GetStats(pb.GetStatsRequest())     # noqa: E731
            system = Chat(seed=50).words(3 * BLOCK)                 # 3 full blocks shared with another chat
            chat = Chat(seed=51)
            chat.prompt = system + chat.words(60)                   # 108 tokens: 6 full blocks
            async with busy(r1, seed=5):                            # both caches empty: the load decides
                t1 = await turn(stub, chat.prompt, session="chat-restart")
            assert t1.replica == 0
            chat.add(t1.answer)
            await wait_for(lambda: held(index, chat.prompt, seed).get(0, 0) >= 6, "turn 1's blocks on replica 0")
            async for _ in r1.aengine.generate(None, system + Chat(seed=52).words(40),
                                               SamplingParams(temperature=0.0, max_tokens=1)):
                pass
            await wait_for(lambda: held(index, chat.prompt, seed).get(1) == 3, "the shared blocks on replica 1")

            old_pid = r0.aengine.pid
            os.kill(old_pid, signal.SIGKILL)

            async def restarted():
                st = (await stats()).replicas[0]
                return st.restarts == 1 and st.healthy and st.pid != old_pid and st.indexed and st.index_resyncs >= 1
            await wait_for(restarted, "replica 0 restarted and resynced", timeout=120)
            assert held(index, chat.prompt, seed) == {1: 3}         # nothing of the dead incarnation
            await wait_idle(stub)
            before = await stats()
            t2 = await turn(stub, chat.prompt, session="chat-restart")
            after = await stats()
            assert (t2.replica, t2.cached) == (1, 3 * BLOCK)
            assert after.prefix_routed_blocks - before.prefix_routed_blocks == 3     # credited what it reused
    finally:
        await srv.stop(grace=1.0)
        index.close()
        _delete_keys(redis_url, prefix)
