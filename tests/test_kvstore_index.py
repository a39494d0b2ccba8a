"""Prefix-cache index (kvstore/index.py) and KV event publisher (kvstore/publisher.py).

The same contract tests run against MemoryIndex and RedisIndex. RedisIndex uses the Redis at
``REDIS_URL`` (default redis://127.0.0.1:6379/0) under a unique key prefix per test, and
deletes only that prefix's keys afterwards; the outage tests start a private redis-server
on a free port. No model weights: events are built directly.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import pytest

from kvmesh.core.sampling import SamplingParams
from kvstore.events import HOST, POOL, REDIS, AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.hashing import hash_blocks, seed_hash
from kvstore.index_contract import SHARED_NO_TTL, IndexUnavailable, PrefixMatch
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex
from kvstore.publisher import KVEventPublisher
from scheduler.block_manager import BlockManager
from scheduler.request import Request

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
BS = 4
SEED_A = seed_hash("model=model-a:0123456789abcdef;weights=torch.float32;kv=torch.float32")
SEED_B = seed_hash("model=model-b:fedcba9876543210;weights=torch.float32;kv=torch.float32")
TOKENS = list(range(100, 100 + 10 * BS))


def chain(n, seed=SEED_A, tokens=TOKENS):
    return hash_blocks(seed, tokens[:n * BS], BS)


def stored(hashes, parent=None):
    return BlockStored(tuple(hashes), parent, BS)


def wait_for(cond, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def try_match(index, hashes):
    try:
        return index.match(hashes)
    except IndexUnavailable:
        return None


def _unavailable(msg):
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


# ---- fixtures ----------------------------------------------------------------------------
@pytest.fixture
def redis_prefix():
    """(raw client, unique prefix) on REDIS_URL; deletes the prefix's keys afterwards."""
    import redis
    raw = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
    try:
        raw.ping()
    except redis.RedisError as e:
        _unavailable(f"Redis not reachable at {REDIS_URL} ({e}): start redis-server or set REDIS_URL")
    prefix = f"kvmesh-test-{uuid.uuid4().hex[:12]}"
    yield raw, prefix
    keys = list(raw.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        raw.delete(*keys)
    raw.close()


@pytest.fixture(params=["memory", "redis"])
def index(request):
    if request.param == "memory":
        yield MemoryIndex()
        return
    raw, prefix = request.getfixturevalue("redis_prefix")
    # A generous read timeout: these tests check semantics on a shared 2-core machine.
    idx = RedisIndex(REDIS_URL, prefix=prefix, timeout=0.25)
    idx.raw = raw
    yield idx
    idx.close()


@pytest.fixture
def publisher():
    """``publisher(index, snapshot, **kw)``: a KVEventPublisher for replica "s/0" (heartbeats
    every 50 ms), closed after the test even when it fails, before the index goes."""
    made = []

    def make(index, snapshot, **kw):
        made.append(KVEventPublisher(index, "s/0", snapshot, **{"heartbeat_interval": 0.05, "ttl": 2.0, **kw}))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def redis_keys(index, pattern="*"):
    """The index's Redis keys matching ``pattern`` after the prefix (None for MemoryIndex)."""
    if not isinstance(index, RedisIndex):
        return None
    return sorted(index.raw.scan_iter(match=f"{index.prefix}:{pattern}", count=1000))


# ---- the contract, on both implementations -------------------------------------------------
def test_match_counts_leading_blocks(index):
    h = chain(6)
    index.heartbeat("s/0", 30)
    index.heartbeat("s/1", 30)
    assert index.apply("s/0", 1, [stored(h[:4])])
    assert index.apply("s/1", 1, [stored(h[:2])])
    assert index.match(h) == {"s/0": 4, "s/1": 2}
    assert index.match(h[:3]) == {"s/0": 3, "s/1": 2}
    other = chain(3, tokens=[7] + TOKENS[1:])           # differs in the first token: no block shared
    assert not any(index.match(other).values())
    assert index.match([]) == {}


def test_run_stops_at_first_miss(index):
    h = chain(6)
    index.heartbeat("s/0", 30)
    assert index.apply("s/0", 1, [stored(h)])
    assert index.apply("s/0", 2, [BlockRemoved((h[2],))])
    assert index.match(h) == {"s/0": 2}                  # h[3:] still held, but after a miss
    assert index.match(h[3:]) == {"s/0": 3}
    assert index.apply("s/0", 3, [BlockRemoved((h[0],)), BlockRemoved((h[0], h[1]))])  # repeats are no-ops
    assert not any(index.match(h).values())


def test_all_blocks_cleared(index):
    h = chain(4)
    for r in ("s/0", "s/1"):
        index.heartbeat(r, 30)
        assert index.apply(r, 1, [stored(h)])
    # Events apply in order within a batch: cleared, then one block stored again.
    assert index.apply("s/0", 2, [AllBlocksCleared(), stored(h[:1])])
    assert index.match(h) == {"s/0": 1, "s/1": 4}
    assert index.apply("s/0", 3, [stored(h[1:3], h[0]), AllBlocksCleared()])
    assert index.match(h) == {"s/1": 4}


def test_seq_gap_applies_nothing_until_resync(index):
    h = chain(5)
    index.heartbeat("s/0", 30)
    assert index.apply("s/0", 1, [stored(h[:2])])
    assert index.apply("s/0", 3, [stored(h[2:4])]) is False     # batch 2 was lost
    assert index.apply("s/0", 1, [AllBlocksCleared()]) is False  # a replay
    assert index.match(h) == {"s/0": 2}                          # neither was applied
    index.resync("s/0", 7, h[:3])
    assert index.match(h) == {"s/0": 3}
    assert index.apply("s/0", 2, [stored(h[3:])]) is False
    assert index.apply("s/0", 8, [stored(h[3:])])
    assert index.match(h) == {"s/0": 5}
    index.resync("s/0", 9, [h[0], h[2]])                         # replaces, does not add
    assert index.match(h) == {"s/0": 1}


def test_empty_batch_advances_seq(index):
    index.heartbeat("s/0", 30)
    assert index.apply("s/0", 1, [])
    assert index.apply("s/0", 2, [stored(chain(1))])
    assert index.match(chain(1)) == {"s/0": 1}


def test_heartbeat_expiry_drops_the_replica(index):
    h = chain(3)
    index.heartbeat("dying", 0.4)
    index.heartbeat("alive", 60)
    assert index.apply("dying", 1, [stored(h)])
    assert index.apply("alive", 1, [stored(h[:1])])
    assert index.apply("silent", 1, [stored(h)])     # never heartbeats: not live
    assert index.match(h) == {"dying": 3, "alive": 1}
    time.sleep(0.6)
    assert index.match(h) == {"alive": 1}
    if isinstance(index, RedisIndex):                # dropped, not just hidden
        assert redis_keys(index, "r:dying*") == [] and redis_keys(index, "r:silent*") == []
        assert index.raw.smembers(f"{index.prefix}:replicas") == {"alive"}
        for x in h:
            assert index.raw.hkeys(f"{index.prefix}:b:{x:016x}") in ([], ["alive"])
    # Back with a heartbeat: nothing of its old entries remains, and its seq is forgotten.
    index.heartbeat("dying", 60)
    assert index.match(h) == {"alive": 1}
    assert index.apply("dying", 2, [stored(h)]) is False
    assert index.apply("dying", 1, [stored(h[:2])])
    assert index.match(h) == {"alive": 1, "dying": 2}


def test_remove_replica(index):
    h = chain(3)
    for r in ("s/0", "s/1"):
        index.heartbeat(r, 30)
        assert index.apply(r, 1, [stored(h)])
    index.remove_replica("s/0")
    index.remove_replica("never-seen")
    assert index.match(h) == {"s/1": 3}
    assert redis_keys(index, "r:s/0*") in (None, [])
    assert index.apply("s/0", 2, [stored(h)]) is False   # forgotten: the next batch expected is 1


def test_two_models_never_share_keys(index):
    ha, hb = chain(4, SEED_A), chain(4, SEED_B)        # same tokens, different model identities
    assert not set(ha) & set(hb)
    index.heartbeat("a/0", 30)
    index.heartbeat("b/0", 30)
    assert index.apply("a/0", 1, [stored(ha)])
    assert index.apply("b/0", 1, [stored(hb)])
    assert index.match(ha) == {"a/0": 4}
    assert index.match(hb) == {"b/0": 4}
    if isinstance(index, RedisIndex):
        for x in ha:
            assert index.raw.hgetall(f"{index.prefix}:b:{x:016x}") == {"a/0": "pool"}   # tier recorded
        for x in hb:
            assert index.raw.hgetall(f"{index.prefix}:b:{x:016x}") == {"b/0": "pool"}
    else:
        assert all(index._holders[x] == {"a/0": {"pool"}} for x in ha)


# ---- tiers: the medium of each block --------------------------------------------------------
def in_tier(medium, hashes, ttl=0.0):
    return BlockStored(tuple(hashes), None, BS, medium, ttl)


def test_mediums_per_replica_and_block(index):
    """A replica's blocks in its pool and in its host tier: match_tiers answers the best medium
    of each, each medium follows its own events, and a reset pool leaves the host tier."""
    h = chain(5)
    index.heartbeat("s/0", 30)
    index.heartbeat("s/1", 30)
    assert index.apply("s/0", 1, [stored(h[:3]), in_tier(HOST, h[3:4])])
    assert index.apply("s/1", 1, [in_tier(HOST, h[:2])])
    assert index.match_tiers(h) == PrefixMatch({"s/0": (POOL, POOL, POOL, HOST), "s/1": (HOST, HOST)}, 0)
    assert index.match(h) == {"s/0": 4, "s/1": 2}
    # evicted from the pool into the host tier
    assert index.apply("s/0", 2, [BlockRemoved((h[1],)), in_tier(HOST, h[1:2])])
    assert index.match_tiers(h).held["s/0"] == (POOL, HOST, POOL, HOST)
    # loaded back into the pool while the host tier keeps its copy: the pool is the better one
    assert index.apply("s/0", 3, [stored(h[1:2])])
    assert index.match_tiers(h).held["s/0"] == (POOL, POOL, POOL, HOST)
    if isinstance(index, RedisIndex):
        assert sorted(index.raw.hget(f"{index.prefix}:b:{h[1]:016x}", "s/0").split(",")) == ["host", "pool"]
    # the host tier's LRU drops it: the pool's copy stays
    assert index.apply("s/0", 4, [BlockRemoved((h[1],), HOST)])
    assert index.match_tiers(h).held["s/0"] == (POOL, POOL, POOL, HOST)
    # the pool's prefix cache is reset: the host tier keeps h[3]
    assert index.apply("s/0", 5, [AllBlocksCleared()])
    assert index.match_tiers(h) == PrefixMatch({"s/1": (HOST, HOST)}, 0)
    assert index.match_tiers(h[3:]) == PrefixMatch({"s/0": (HOST,)}, 0)
    if isinstance(index, RedisIndex):
        assert index.raw.smembers(f"{index.prefix}:r:s/0:blocks") == {f"{h[3]:016x}"}


def test_shared_redis_blocks_belong_to_no_replica(index):
    """Blocks in the shared Redis tier: counted for every replica, bridging the gaps of a
    replica's own run; neither a resync nor the replica's removal drops them."""
    h = chain(4)
    index.heartbeat("s/0", 30)
    index.heartbeat("s/1", 30)
    assert index.apply("s/0", 1, [stored(h[:2]), in_tier(REDIS, h[:3], ttl=60.0)])
    assert index.match_tiers(h) == PrefixMatch({"s/0": (POOL, POOL)}, 3)
    assert index.apply("s/0", 2, [BlockRemoved((h[0],)), in_tier(HOST, h[3:])])
    assert index.match_tiers(h) == PrefixMatch({"s/0": (None, POOL, None, HOST)}, 3)
    assert index.match(h) == {}                       # its own run starts with a miss
    index.resync("s/0", 3, [])
    assert index.match_tiers(h) == PrefixMatch({}, 3)
    index.remove_replica("s/0")
    index.remove_replica("s/1")
    assert index.match_tiers(h) == PrefixMatch({}, 3)
    assert index.match_tiers(h[1:]) == PrefixMatch({}, 2)
    if isinstance(index, RedisIndex):
        ttl = index.raw.pttl(f"{index.prefix}:s:{h[0]:016x}")
        assert 50_000 < ttl <= 60_000


def test_shared_blocks_expire_with_the_tiers_ttl(index):
    h = chain(2)
    index.heartbeat("s/0", 30)
    assert index.apply("s/0", 1, [in_tier(REDIS, h, ttl=0.3), in_tier(REDIS, h[1:])])    # 0 = no TTL
    assert index.match_tiers(h).shared == 2
    time.sleep(0.5)
    assert index.match_tiers(h).shared == 0          # the first is gone: the run ends there
    assert index.match_tiers(h[1:]).shared == 1      # kept for SHARED_NO_TTL
    if isinstance(index, RedisIndex):
        assert index.raw.pttl(f"{index.prefix}:s:{h[1]:016x}") > (SHARED_NO_TTL - 60) * 1000


def test_unknown_medium_is_refused(index):
    index.heartbeat("s/0", 30)
    for bad in ([in_tier("disk", [1])], [BlockRemoved((1,), "gpu")], [AllBlocksCleared(REDIS)]):
        with pytest.raises(ValueError, match="medium"):
            index.apply("s/0", 1, bad)
    with pytest.raises(ValueError, match="medium"):
        index.resync("s/0", 1, {REDIS: [1]})
    assert index.apply("s/0", 1, [])                  # nothing was applied: batch 1 is still next


def test_match_hundred_blocks_one_call(index):
    tokens = list(range(100 * BS))
    h = hash_blocks(SEED_A, tokens, BS)
    for i in range(4):
        index.heartbeat(f"s/{i}", 30)
        assert index.apply(f"s/{i}", 1, [stored(h[:25 * (i + 1)])])
    t0 = time.perf_counter()
    m = index.match(h)
    dt = time.perf_counter() - t0
    assert m == {"s/0": 25, "s/1": 50, "s/2": 75, "s/3": 100}
    assert dt < 0.25, f"match of 100 hashes took {dt * 1e3:.1f} ms"


# ---- the publisher -------------------------------------------------------------------------
class FakeReplica:
    """A block-manager stand-in: its cached hashes and an 'engine lock' held while it changes
    them and publishes the events, as the engine does."""

    def __init__(self, hashes=()):
        self.lock = threading.Lock()
        self.cached: dict[int, None] = dict.fromkeys(hashes)
        self.sink = None

    def store(self, hashes):
        with self.lock:
            self.cached.update(dict.fromkeys(hashes))
            if self.sink:
                self.sink.publish([stored(hashes)])

    def evict(self, hashes):
        with self.lock:
            for x in hashes:
                self.cached.pop(x, None)
            if self.sink:
                self.sink.publish([BlockRemoved(tuple(hashes))])

    def snapshot(self):
        with self.lock:
            return list(self.cached)


def test_publisher_end_to_end(index, publisher):
    h = chain(8)
    rep = FakeReplica(h[:2])                  # already cached before the publisher starts
    pub = publisher(index, rep.snapshot)
    rep.sink = pub
    wait_for(lambda: pub.resyncs == 1, what="the initial resync")
    assert index.match(h) == {"s/0": 2}

    def engine():                             # events come from another thread
        for i in range(2, 8):
            rep.store(h[i:i + 1])
        rep.evict(h[6:7])

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    wait_for(lambda: index.match(h) == {"s/0": 6}, what="the published blocks in the index")
    wait_for(lambda: pub.events == 7, what="the counters")   # counted once apply has returned
    assert (pub.resyncs, pub.failures) == (1, 0)          # the initial resync only
    assert 1 <= pub.batches <= 7
    pub.close()
    assert index.match(h) == {}


def test_publisher_resyncs_after_a_gap(index, publisher):
    h = chain(6)
    rep = FakeReplica()
    pub = publisher(index, rep.snapshot)
    rep.sink = pub
    rep.store(h[:3])
    wait_for(lambda: index.match(h) == {"s/0": 3})
    index.remove_replica("s/0")               # the index lost this replica's state
    assert index.match(h) == {}
    rep.store(h[3:5])                         # apply → False → resync with the snapshot
    wait_for(lambda: index.match(h) == {"s/0": 5}, what="resync after the gap")
    wait_for(lambda: pub.resyncs == 2)               # counted once resync has returned
    assert pub.failures == 0
    index.remove_replica("s/0")               # again, on an idle replica: the batch sent with
    wait_for(lambda: index.match(h) == {"s/0": 5}, what="resync of an idle replica")  # a heartbeat finds out
    wait_for(lambda: pub.resyncs == 3)
    assert pub.failures == 0
    pub.close()


def test_publisher_resync_carries_the_host_tier(index, publisher):
    h = chain(4)
    publisher(index, lambda: {POOL: h[:2], HOST: h[2:]})
    wait_for(lambda: index.match_tiers(h) == PrefixMatch({"s/0": (POOL, POOL, HOST, HOST)}, 0),
             what="the initial resync, pool and host")


def test_publisher_with_block_manager(publisher):
    """A real BlockManager → publisher → index: stores, then evictions, arrive."""
    index = MemoryIndex()
    lock = threading.Lock()
    m = BlockManager(6, BS, True, SEED_A)

    def snapshot():
        with lock:
            return m.cached_block_hashes()

    pub = publisher(index, snapshot)
    m.sink = pub
    r = Request("a", TOKENS[:3 * BS + 1], SamplingParams(max_tokens=1))
    with lock:
        assert m.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        m.cache_full_blocks(r)
        m.free(r)
        m.take_events()
        assert sorted(m.cached_block_hashes()) == sorted(r.block_hashes[:3])
    wait_for(lambda: index.match(r.block_hashes) == {"s/0": 3})
    other = Request("b", list(range(5000, 5000 + 6 * BS)), SamplingParams(max_tokens=1))
    with lock:                                # needs all 6 blocks: evicts the 3 cached ones
        assert m.allocate(other, other.num_tokens)
        m.take_events()
        assert m.cached_block_hashes() == []
    wait_for(lambda: not index.match(r.block_hashes))
    pub.close()


# ---- Redis outages -------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private_redis(tmp_path):
    """(url, start): ``start()`` runs redis-server on the same free port each time and
    returns the process; every process started is killed afterwards."""
    if shutil.which("redis-server") is None:
        _unavailable("redis-server is not installed")
    import redis
    port = _free_port()
    procs: list[subprocess.Popen] = []

    def start():
        p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
        wait_for(lambda: _pings(client), what=f"redis-server on port {port}")
        client.close()
        return p

    yield f"redis://127.0.0.1:{port}/0", start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _pings(client):
    try:
        return client.ping()
    except Exception:
        return False


def test_redis_outage_and_recovery(private_redis, publisher):
    url, start = private_redis
    server = start()
    index = RedisIndex(url, prefix="kvmesh-outage", timeout=0.02)
    h = chain(8)
    rep = FakeReplica(h[:2])
    pub = publisher(index, rep.snapshot, retry_interval=0.05)
    rep.sink = pub
    rep.store(h[2:4])
    wait_for(lambda: try_match(index, h) == {"s/0": 4})
    wait_for(lambda: pub.resyncs == 1)         # the initial one has returned, not just run

    server.kill()                              # Redis down: calls fail fast
    server.wait()
    for _ in range(5):
        t0 = time.perf_counter()
        with pytest.raises(IndexUnavailable):
            index.match(h)
        assert time.perf_counter() - t0 < 0.1
    rep.store(h[4:6])                          # lost: nobody receives it
    wait_for(lambda: pub.failures >= 2, what="the publisher to notice the outage")
    assert pub._thread.is_alive()

    start()                                    # back, empty: the publisher resyncs by itself
    wait_for(lambda: try_match(index, h) == {"s/0": 6}, what="resync after the restart")
    wait_for(lambda: pub.resyncs >= 2)
    rep.store(h[6:])
    wait_for(lambda: try_match(index, h) == {"s/0": 8})
    pub.close()
    assert index.match(h) == {}
    index.close()


def test_redis_stalled_times_out_and_recovers(private_redis):
    url, start = private_redis
    server = start()
    index = RedisIndex(url, prefix="kvmesh-stall", timeout=0.02)
    h = chain(4)
    index.heartbeat("s/0", 30)
    assert index.apply("s/0", 1, [stored(h)])
    assert index.match(h) == {"s/0": 4}

    server.send_signal(signal.SIGSTOP)         # accepts connections, never answers
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            with pytest.raises(IndexUnavailable):
                index.match(h)
            assert time.perf_counter() - t0 < 0.1
    finally:
        server.send_signal(signal.SIGCONT)
    # The late replies to the timed-out calls must not be read as this call's answer.
    wait_for(lambda: try_match(index, h) == {"s/0": 4}, what="the index to answer again")
    assert index.match(h[:2]) == {"s/0": 2}
    assert index.apply("s/0", 2, [BlockRemoved((h[1],))])
    assert index.match(h) == {"s/0": 1}
    index.close()

