"""Router unit tests (no model): the four policies, the prefix score against load,
provisional entries with a fake clock, tie-breaks, index outages, that the router hashes a
prompt exactly as the block manager does (a real BlockManager's KV events feed a MemoryIndex),
and the score's tier weights (own pool, own host tier, shared Redis tier) read from a real
index, MemoryIndex and RedisIndex (Redis at ``REDIS_URL``, a unique key prefix, skipped when
unreachable unless ``CI`` is set)."""

from __future__ import annotations

import pytest

from kvmesh.core.sampling import SamplingParams
from kvstore.hashing import hash_blocks, seed_hash
from kvstore.events import HOST, REDIS, BlockRemoved, BlockStored
from kvstore.events import POOL as POOL_MEDIUM
from kvstore.index_contract import IndexUnavailable, PrefixMatch
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex
from scheduler.block_manager import BlockManager
from scheduler.request import Request
from scheduler.router import SHARED_TIER_WEIGHT, NoHealthyReplicaError, ReplicaLoad, Router

BS = 4
SEED = seed_hash("router-test")
IDS = ["s/0", "s/1", "s/2"]
POOL = 1000                                   # KV pool tokens of each fake replica


class FakeIndex:
    """``match`` answers from ``held`` (replica id -> hashes it holds in its pool) and ``shared``
    (hashes in the shared Redis tier); ``down`` raises."""

    def __init__(self):
        self.held: dict[str, list[int]] = {}
        self.shared: list[int] = []
        self.down = False
        self.calls: list[list[int]] = []

    def match(self, hashes):
        self.calls.append(list(hashes))
        if self.down:
            raise IndexUnavailable("test: index down")
        out = {}
        for rid, held in self.held.items():
            n = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if n:
                out[rid] = n
        return out

    def match_tiers(self, hashes):
        """What the router asks: every held block is in the replica's pool (its run ends at its
        first miss), ``shared`` gives the shared run."""
        shared = next((i for i, h in enumerate(hashes) if h not in self.shared), len(hashes))
        return PrefixMatch({rid: (POOL_MEDIUM,) * n for rid, n in self.match(hashes).items()}, shared)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def loads(*tokens, healthy=None):
    healthy = healthy or [True] * len(tokens)
    return [ReplicaLoad(i, h, t, 0, POOL) for i, (t, h) in enumerate(zip(tokens, healthy))]


def prompt(start, n_blocks, tail=0):
    return list(range(start, start + n_blocks * BS + tail))


def hashes(tokens):
    return hash_blocks(SEED, tokens, BS)


@pytest.fixture
def index():
    return FakeIndex()


@pytest.fixture
def clock():
    return Clock()


def router(index, clock, **kw):
    kw.setdefault("provisional_ttl", 2.0)
    return Router("prefix", index, replica_ids=IDS, hash_seed=SEED, block_size=BS, clock=clock, **kw)


def test_load_round_robin_random():
    r = Router("load")
    assert r.pick(loads(5, 3, 3)) == 1
    with pytest.raises(NoHealthyReplicaError):
        r.pick(loads(0, 0, healthy=[False, False]))
    rr = Router("round_robin")
    assert [rr.pick(loads(0, 0, 0)) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.pick(loads(0, 0, 0, healthy=[True, False, True])) for _ in range(3)] == [2, 0, 2]
    picks = [Router("random", seed=7).pick(loads(0, 0, 0)) for _ in range(3)]
    assert len(set(picks)) == 1                               # seeded: the same first pick
    rnd = Router("random", seed=7)
    seen = [rnd.pick(loads(0, 9, 0, healthy=[True, False, True])) for _ in range(50)]
    assert set(seen) == {0, 2}
    with pytest.raises(ValueError, match="routing policy"):
        Router("sticky")
    with pytest.raises(ValueError, match="index"):
        Router("prefix")


def test_prefix_beats_a_moderate_load_difference(index, clock):
    p = prompt(0, 4, tail=2)
    index.held["s/1"] = hashes(p)[:3]
    r = router(index, clock)
    assert r.pick(loads(0, 300, 0), prompt_token_ids=p) == 1          # 0.75 - 0.3 > 0
    assert index.calls == [hashes(p)]                                 # full blocks only
    assert (r.stats.routed, r.stats.prefix_hits, r.stats.matched_blocks) == (1, 1, 3)
    clock.t += 10                                                     # provisional entries gone
    assert r.pick(loads(0, 900, 0), prompt_token_ids=p) == 0          # 0.75 - 0.9 < 0
    assert (r.stats.routed, r.stats.prefix_hits) == (2, 1)


def test_weights_change_the_balance(index, clock):
    p = prompt(0, 4)
    index.held["s/1"] = hashes(p)
    assert router(index, clock, load_weight=0.0).pick(loads(0, 10_000, 0), prompt_token_ids=p) == 1
    assert router(index, clock, prefix_weight=0.0).pick(loads(0, 1, 0), prompt_token_ids=p) == 0


def test_only_this_schedulers_healthy_replicas_count(index, clock):
    p = prompt(0, 3)
    index.held = {"other/0": hashes(p), "s/2": hashes(p)}
    r = router(index, clock, provisional_ttl=0)
    assert r.pick(loads(0, 0, 50), prompt_token_ids=p) == 2
    assert r.pick(loads(0, 10, 0, healthy=[True, True, False]), prompt_token_ids=p) == 0
    assert r.stats.prefix_hits == 1


def test_provisional_entries_group_a_burst_then_expire(index, clock):
    r = router(index, clock)
    sys_prompt = prompt(0, 5)
    a, b = sys_prompt + [900, 901], sys_prompt + list(range(700, 710))
    assert r.pick(loads(0, 0, 0), prompt_token_ids=a) == 0            # nothing cached: lowest index
    assert r.pick(loads(50, 0, 0), prompt_token_ids=b) == 0           # follows a, events not in yet
    assert r.stats.matched_blocks == 5
    other = prompt(500, 5)
    assert r.pick(loads(100, 0, 0), prompt_token_ids=other) == 1      # no shared prefix: by load
    clock.t += 2.0                                                    # ttl over
    assert r.pick(loads(100, 0, 0), prompt_token_ids=b) == 1
    assert r._provisional[0] == {} and set(r._provisional[1].values()) == {clock.t + 2.0}   # expired ones dropped


def test_provisional_counts_leading_blocks_only(index, clock):
    r = router(index, clock)
    p = prompt(0, 4)
    r.pick(loads(0, 0, 0), prompt_token_ids=p)                        # provisional on 0
    q = p[:2 * BS] + [7] * BS + p[3 * BS:]                            # block 2 differs
    r.pick(loads(0, 0, 0), prompt_token_ids=q)
    assert r.stats.matched_blocks == 2


def test_index_down_routes_by_load_and_counts(index, clock):
    p = prompt(0, 4)
    index.held["s/0"] = hashes(p)
    index.down = True
    r = router(index, clock)
    assert r.pick(loads(100, 5, 100), prompt_token_ids=p) == 1
    assert (r.stats.fallbacks, r.stats.prefix_hits, r.stats.routed) == (1, 0, 1)
    index.down = False
    assert r.pick(loads(100, 5, 100), prompt_token_ids=p) == 0        # back; no stale provisional on 1
    assert r.stats.fallbacks == 1


def test_ties_load_then_session_then_index(index, clock):
    r = router(index, clock, provisional_ttl=0, load_weight=0.0)
    short = [1, 2]                                                    # no full block: no index call
    assert r.pick(loads(5, 3, 3), prompt_token_ids=short) == 1        # same score: lower load
    assert r.pick(loads(5, 5, 5), "chat", prompt_token_ids=short) == 0
    assert r.pick(loads(9, 5, 5), "chat", prompt_token_ids=short) == 1
    assert r.pick(loads(5, 5, 5), "chat", prompt_token_ids=short) == 1    # affinity breaks the tie
    assert r.pick(loads(5, 5, 5), "new", prompt_token_ids=short) == 0
    assert index.calls == []
    p = prompt(0, 4)
    index.held["s/2"] = hashes(p)
    assert r.pick(loads(5, 5, 5), "chat", prompt_token_ids=p) == 2    # the hashes decide, not affinity


def _serve(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """Prefill ``tokens`` on ``bm`` as the scheduler does, then free the request."""
    r = Request(rid, tokens, SamplingParams(max_tokens=1))
    hits = bm.find_cached_prefix(r)
    n = r.num_tokens - len(hits) * BS
    assert bm.allocate(r, n, hits)
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)
    bm.free(r)


def test_router_hashes_match_the_block_managers_events(clock):
    """Two block managers' events in a MemoryIndex: the router finds the one holding the prompt,
    and after eviction it no longer does."""
    idx = MemoryIndex(clock=clock)
    seqs = {rid: 0 for rid in IDS[:2]}
    bms = [BlockManager(8, BS, True, SEED) for _ in range(2)]

    def flush():
        for rid, m in zip(IDS, bms):
            idx.heartbeat(rid, 10.0)
            seqs[rid] += 1
            assert idx.apply(rid, seqs[rid], m.take_events())

    turn1 = list(range(10, 10 + 3 * BS + 1))
    _serve(bms[1], "t1", turn1)
    flush()
    r = router(idx, clock, provisional_ttl=0)
    turn2 = turn1 + [99] * (2 * BS)
    assert r.pick(loads(0, 0), prompt_token_ids=turn2) == 1
    assert r.stats.matched_blocks == 3
    _serve(bms[1], "fill", list(range(1000, 1000 + 8 * BS)))                # evicts every block of turn1
    flush()
    assert idx.match(hashes(turn2)) == {}
    assert r.pick(loads(0, 0), prompt_token_ids=turn2) == 0


def test_routing_settings(monkeypatch):
    from kvmesh.core.service_config import SchedulerConfig
    from kvmesh.core.settings import env_var
    from kvmesh.core.errors import EngineError

    monkeypatch.setenv("KVMESH_REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("KVMESH_SCHEDULER_REDIS_URL", "redis://ignored:6379/0")   # not this field's variable
    monkeypatch.setenv("KVMESH_SCHEDULER_ROUTING", "round_robin")
    monkeypatch.setenv("KVMESH_SCHEDULER_LOAD_WEIGHT", "0.25")
    cfg = SchedulerConfig.from_env()
    assert (cfg.redis_url, cfg.routing, cfg.load_weight) == ("redis://redis:6379/0", "round_robin", 0.25)
    assert SchedulerConfig.from_env(redis_url="").redis_url == ""                # a flag wins, even empty
    assert env_var(SchedulerConfig, "redis_url") == "KVMESH_REDIS_URL"
    assert env_var(SchedulerConfig, "routing") == "KVMESH_SCHEDULER_ROUTING"
    d = SchedulerConfig()
    assert (d.routing, d.redis_url, d.index_timeout, d.scheduler_id) == ("prefix", "", 0.005, "")
    for bad, match in ((dict(routing="sticky"), "routing"), (dict(redis_url="localhost:6379"), "redis_url"),
                       (dict(index_timeout=0), "index_timeout"), (dict(load_weight=-1), "load_weight"),
                       (dict(scheduler_id="a/b"), "scheduler_id")):
        with pytest.raises(EngineError, match=match):
            SchedulerConfig(**bad)


def test_shared_kv_tier_lets_a_chat_move_to_a_lightly_loaded_replica():
    """A replica holding the whole prompt but loaded to 60% of its pool loses to an idle one
    when a shared KV tier (Redis, write-through) lets the idle one load the blocks; without
    the tier, moving would recompute the prompt, and the holder wins."""
    p = prompt(0, 10)
    for weight, want in ((0.0, 0), (0.5, 1)):
        idx = FakeIndex()
        idx.held["s/0"] = idx.shared = hashes(p)           # written through to the shared tier
        r = Router("prefix", idx, replica_ids=IDS[:2], hash_seed=SEED, block_size=BS, provisional_ttl=0,
                   shared_tier_weight=weight)
        assert r.pick(loads(600, 0), prompt_token_ids=p) == want
    idx = FakeIndex()
    idx.held["s/0"] = idx.shared = hashes(p)
    r = Router("prefix", idx, replica_ids=IDS[:2], hash_seed=SEED, block_size=BS, provisional_ttl=0,
               shared_tier_weight=0.5)
    assert r.pick(loads(100, 0), prompt_token_ids=p) == 0     # lightly loaded holder: stays


# ---- tier weights, from a real index ---------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def real_index(request, h):
    """A MemoryIndex, or a RedisIndex under a unique prefix (its keys deleted afterwards)."""
    if request.param == "memory":
        yield MemoryIndex()
        return
    with h.redis_namespace() as (url, prefix):
        idx = RedisIndex(url, prefix=prefix, timeout=0.25)
        yield idx
        idx.close()


TURN = prompt(10, 4, tail=1)          # 4 full blocks


def publish(index, **events):
    """Each replica (IDS[i] for keyword ri) heartbeats and applies its events as batch 1."""
    for name, evs in events.items():
        rid = IDS[int(name[1:])]
        index.heartbeat(rid, 30.0)
        assert index.apply(rid, 1, evs)


def in_tier(medium, hs, ttl=0.0):
    return BlockStored(tuple(hs), None, BS, medium, ttl)


def test_score_weighs_own_pool_own_host_and_shared_tier(real_index, clock):
    """Equal prompts held in r0's pool (1.0 a block), r1's host tier (0.9) and the shared tier
    (0.5, every replica): the load at which each loses to the next pins the weights."""
    h = hashes(TURN)
    publish(real_index, r0=[in_tier(POOL_MEDIUM, h)], r1=[in_tier(HOST, h)], r2=[in_tier(REDIS, h, ttl=60.0)])
    assert real_index.match_tiers(h) == PrefixMatch({IDS[0]: (POOL_MEDIUM,) * 4, IDS[1]: (HOST,) * 4}, 4)
    r = router(real_index, clock, provisional_ttl=0, shared_tier_weight=SHARED_TIER_WEIGHT)
    assert r.pick(loads(0, 0, 0), prompt_token_ids=TURN) == 0
    assert r.pick(loads(90, 0, 0), prompt_token_ids=TURN) == 0        # 1.0 - 0.09 > 0.9
    assert r.pick(loads(110, 0, 0), prompt_token_ids=TURN) == 1       # 1.0 - 0.11 < 0.9
    assert r.pick(loads(110, 390, 0), prompt_token_ids=TURN) == 0     # 0.89 > 0.51 > 0.5
    assert r.pick(loads(510, 390, 0), prompt_token_ids=TURN) == 1     # 0.49 < 0.51 > 0.5
    assert r.pick(loads(600, 550, 0), prompt_token_ids=TURN) == 2     # 0.4, 0.35 < 0.5: loads from Redis
    assert r.stats.matched_blocks == 6 * 4                            # every pick could reuse all 4
    # without a shared tier the Redis copies count for nothing: r2 holds none of its own
    r = router(real_index, clock, provisional_ttl=0, shared_tier_weight=0.0)
    assert r.pick(loads(600, 550, 0), prompt_token_ids=TURN) == 0     # 0.4 > 0.35 > 0
    assert r.pick(loads(1100, 1050, 0), prompt_token_ids=TURN) == 2   # -0.1, -0.15 < 0
    assert r.stats.matched_blocks == 4                                # the second pick reused nothing


def test_shared_tier_bridges_a_replicas_own_run(real_index, clock):
    """r0 holds blocks 0, 1 in its pool and 3 in its host tier, the shared tier 0-3: r0's run is
    1 + 1 + 0.5 + 0.9 = 3.4 blocks, r1's 4 x 0.5 = 2; without the shared tier r0's ends at 2."""
    h = hashes(TURN)
    publish(real_index, r0=[in_tier(POOL_MEDIUM, h[:2]), in_tier(HOST, h[3:])], r1=[in_tier(REDIS, h, ttl=60.0)])
    assert real_index.match_tiers(h) == PrefixMatch({IDS[0]: (POOL_MEDIUM, POOL_MEDIUM, None, HOST)}, 4)
    r = router(real_index, clock, provisional_ttl=0, shared_tier_weight=SHARED_TIER_WEIGHT)
    assert r.pick(loads(340, 0), prompt_token_ids=TURN) == 0          # 0.85 - 0.34 > 0.5
    assert r.pick(loads(360, 0), prompt_token_ids=TURN) == 1          # 0.85 - 0.36 < 0.5
    assert r.stats.matched_blocks == 4 + 4
    r = router(real_index, clock, provisional_ttl=0, shared_tier_weight=0.0)
    assert r.pick(loads(0, 0), prompt_token_ids=TURN) == 0
    assert r.stats.matched_blocks == 2
    assert r.pick(loads(490, 0), prompt_token_ids=TURN) == 0          # 0.5 - 0.49 > 0
    assert r.pick(loads(510, 0), prompt_token_ids=TURN) == 1          # 0.5 - 0.51 < 0
    # block 1 leaves r0's pool and the shared copies are removed: r0's run ends after block 0
    assert real_index.apply(IDS[0], 2, [BlockRemoved((h[1],)), BlockRemoved(tuple(h), REDIS)])
    assert real_index.match_tiers(h) == PrefixMatch({IDS[0]: (POOL_MEDIUM,)}, 0)
