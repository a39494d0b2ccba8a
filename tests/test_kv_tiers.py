"""KV tiers below the pool (kvstore/tiers.py, workers/kv_blocks.py): blocks round-trip bit for
bit through the host tier and a real Redis for float32, bfloat16, int8 and fp8 caches; damaged,
foreign or missing values and a dead Redis mean recompute (counted), never a wrong answer;
the host tier is bounded by size; keys are namespaced and carry no request text. Engine tests
(real SmolLM2 weights, float32): greedy output identical with and without tiers after the
pool evicted a chat's blocks, a Redis tier shared by two engines gives the second one cached
tokens, Redis killed between turns, and a pp=2 Ray pipeline whose stages store and load their
own layers."""

from __future__ import annotations

import dataclasses

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid

import pytest
import torch

from kvstore.events import HOST, REDIS, BlockRemoved, BlockStored
from kvstore.hashing import hash_blocks, seed_hash
from kvstore.tier_format import FORMAT_VERSION, BlockLayout, TierValueError, block_key, decode_value, encode_value
from kvstore.tier_stores import HostTier
from kvstore.tiers import KVTiers
from workers.kv_blocks import block_body_bytes, load_blocks, save_blocks
from workers.kv_cache import allocate_kv_cache, is_quantized

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
LAYERS, BLOCKS, BS, KVH, D = 3, 12, 16, 2, 8


def _unavailable(msg):
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def _pings(client):
    try:
        return client.ping()
    except Exception:
        return False


@pytest.fixture
def redis_prefix():
    """(raw client, unique prefix) on REDIS_URL; deletes the prefix's keys afterwards."""
    import redis
    raw = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    if not _pings(raw):
        _unavailable(f"Redis not reachable at {REDIS_URL}: start redis-server or set REDIS_URL")
    prefix = f"kvmesh-test-{uuid.uuid4().hex[:12]}"
    yield raw, prefix
    keys = list(raw.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        raw.delete(*keys)
    raw.close()


@pytest.fixture
def private_redis(tmp_path):
    """(url, process): a redis-server of this test's own on a free port, killed afterwards."""
    if shutil.which("redis-server") is None:
        _unavailable("redis-server is not installed")
    import redis
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(tmp_path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 10
    while not _pings(client):
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.02)
    client.close()
    yield f"redis://127.0.0.1:{port}/0", p
    if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait()


def _filled_caches(dtype, seed=0):
    """Caches of LAYERS layers with random K/V written (quantized: through the real write path)."""
    g = torch.Generator().manual_seed(seed)
    caches = allocate_kv_cache(LAYERS, BLOCKS, BS, KVH, D, dtype, torch.device("cpu"))
    slots = torch.arange(BLOCKS * BS)
    for c in caches:
        k = torch.randn(BLOCKS * BS, KVH, D, generator=g) * 3
        v = torch.randn(BLOCKS * BS, KVH, D, generator=g)
        c.write(k, v, slots)
    return caches


def _layout(dtype, ranges=((0, LAYERS),)):
    return BlockLayout(str(dtype).removeprefix("torch."), dtype.itemsize, BS, KVH, D, ranges, is_quantized(dtype))


def _same_blocks(a, a_ids, b, b_ids):
    for ca, cb in zip(a, b):
        ia, ib = torch.tensor(a_ids), torch.tensor(b_ids)
        assert torch.equal(ca.data.view(torch.uint8)[:, ia], cb.data.view(torch.uint8)[:, ib])
        if ca.quantized:
            assert torch.equal(ca.scales[:, ia], cb.scales[:, ib])
        ka, va = ca.read(ia, torch.float32)
        kb, vb = cb.read(ib, torch.float32)
        assert torch.equal(ka, kb) and torch.equal(va, vb)


# ---- unit: bodies, values, tiers ------------------------------------------------------------
@pytest.mark.parametrize("name", list(DTYPES))
def test_blocks_round_trip_through_each_tier(name, redis_prefix):
    raw, prefix = redis_prefix
    dtype = DTYPES[name]
    src = _filled_caches(dtype)
    ids = [7, 2, 9]
    bodies = save_blocks(src, ids)
    assert [len(b) for b in bodies] == [block_body_bytes(src)] * 3
    hashes = hash_blocks(seed_hash(f"test;{name}"), list(range(3 * BS)), BS)
    layout = _layout(dtype)
    for tiers, tier in ((KVTiers(layout, host_bytes=2**24, prefix=prefix), HOST),
                        (KVTiers(layout, redis_url=REDIS_URL, prefix=prefix), REDIS)):
        tiers.offload(hashes, [[b] for b in bodies])      # host: evicted blocks
        tiers.publish(hashes, [[b] for b in bodies])      # redis: write-through
        tiers.flush()
        found = tiers.fetch(hashes)
        assert [f.tier for f in found] == [tier] * 3
        dst = allocate_kv_cache(LAYERS, BLOCKS, BS, KVH, D, dtype, torch.device("cpu"))
        load_blocks(dst, [0, 1, 4], [f.bodies[0] for f in found])
        _same_blocks(src, ids, dst, [0, 1, 4])
        tiers.close()


def test_value_checks_checksum_version_and_layout():
    layout = _layout(torch.bfloat16)
    body = save_blocks(_filled_caches(torch.bfloat16), [3])[0]
    value = encode_value(layout, 0, body)
    assert decode_value(layout, 0, value) == body
    flipped = bytearray(value)
    flipped[-5] ^= 0x40
    with pytest.raises(TierValueError) as e:
        decode_value(layout, 0, bytes(flipped))
    assert e.value.reason == "integrity"
    with pytest.raises(TierValueError) as e:
        decode_value(layout, 0, value[:-1])
    assert e.value.reason == "integrity"
    other_version = bytearray(value)
    other_version[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(TierValueError) as e:
        decode_value(layout, 0, bytes(other_version))
    assert e.value.reason == "format"
    with pytest.raises(TierValueError) as e:       # same bytes read by a replica with another layout
        decode_value(_layout(torch.bfloat16, ((0, 2), (2, 3))), 0, value)
    assert e.value.reason == "format"
    with pytest.raises(TierValueError) as e:       # the same bytes in a tensor-parallel replica's order
        decode_value(dataclasses.replace(layout, tp=2), 0, value)
    assert e.value.reason == "format"


def test_corrupted_redis_value_is_a_counted_miss(redis_prefix):
    raw, prefix = redis_prefix
    layout = _layout(torch.int8)
    caches = _filled_caches(torch.int8)
    hashes = hash_blocks(seed_hash("corrupt"), list(range(3 * BS)), BS)
    tiers = KVTiers(layout, redis_url=REDIS_URL, prefix=prefix)
    tiers.publish(hashes, [[b] for b in save_blocks(caches, [0, 1, 2])])
    tiers.flush()
    assert len(tiers.fetch(hashes)) == 3
    key = block_key(prefix, hashes[1], (0, LAYERS))
    v = bytearray(raw.get(key))
    v[len(v) // 2] ^= 0xFF
    raw.set(key, bytes(v))
    found = tiers.fetch(hashes)
    assert len(found) == 1                          # stops at the damaged block
    assert tiers.stats.integrity_failures == 1
    raw.delete(block_key(prefix, hashes[0], (0, LAYERS)))
    assert tiers.fetch(hashes) == []                # a missing key: a plain miss
    assert tiers.stats.integrity_failures == 1
    tiers.close()


def test_host_tier_evicts_least_recently_used_by_size():
    t = HostTier(capacity=3000)
    for i in range(3):
        t.put(f"k{i}", bytes(1000))
    assert t.bytes == 3000 and len(t) == 3
    assert t.get("k0") is not None                  # k0 is now the most recently used
    t.put("k3", bytes(1000))
    assert "k1" not in t and "k0" in t and "k3" in t and t.evictions == 1
    t.put("k4", bytes(2500))
    assert t.bytes <= 3000 and "k4" in t and len(t) == 1
    t.put("big", bytes(4000))                       # larger than the whole tier: not kept
    assert "big" not in t and t.bytes <= 3000
    layout = _layout(torch.float32)
    body_len = len(encode_value(layout, 0, bytes(layout.body_bytes(0))))
    tiers = KVTiers(layout, host_bytes=2 * body_len)
    hashes = hash_blocks(seed_hash("lru"), list(range(3 * BS)), BS)
    tiers.offload(hashes, [[bytes(layout.body_bytes(0))]] * 3)
    assert len(tiers.host) == 2 and tiers.fetch(hashes) == []     # the first block was dropped
    assert len(tiers.fetch(hashes[1:])) == 2


def test_tiers_publish_kv_events_with_their_medium(redis_prefix):
    """Blocks entering and leaving the host tier (offload, LRU drop, promotion from Redis) and
    write-throughs that reached Redis come out of ``take_events`` with their medium; a block
    whose stages are not all kept is reported removed, never stored; a failed Redis write
    reports nothing."""
    raw, prefix = redis_prefix
    layout = _layout(torch.float32, ((0, 2), (2, 3)))
    parts = [bytes(layout.body_bytes(0)), bytes(layout.body_bytes(1))]
    block = sum(len(encode_value(layout, s, b)) for s, b in enumerate(parts))
    tiers = KVTiers(layout, host_bytes=2 * block, redis_url=REDIS_URL, prefix=prefix, ttl=120.0)
    h = hash_blocks(seed_hash("events"), list(range(4 * BS)), BS)
    tiers.offload(h[:3], [parts] * 3)                  # room for two: h[0] is dropped
    assert tiers.take_events() == [BlockRemoved((h[0],), HOST), BlockStored(tuple(h[1:3]), None, BS, HOST)]
    assert sorted(tiers.host_block_hashes()) == sorted(h[1:3])
    assert tiers.take_events() == []
    tiers.publish(h, [parts] * 4)                      # write-through: reported once written
    tiers.flush()
    assert tiers.take_events() == [BlockStored(tuple(h), None, BS, REDIS, 120.0)]
    assert [f.tier for f in tiers.fetch(h[:1])] == [REDIS]    # h[0], promoted into the host tier
    ev = tiers.take_events()                           # ... where it pushes out the oldest, h[1]
    assert ev == [BlockRemoved((h[1],), HOST), BlockStored((h[0],), None, BS, HOST)]
    assert sorted(tiers.host_block_hashes()) == sorted([h[0], h[2]])
    tiers.close()
    small = KVTiers(layout, host_bytes=block - 1)      # a block's stages do not fit together
    small.offload(h[:1], [parts])
    assert small.take_events() == [BlockRemoved((h[0],), HOST)] and small.host_block_hashes() == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                      # nothing listens there
    down = KVTiers(layout, redis_url=f"redis://127.0.0.1:{port}/0", prefix=prefix, timeout=0.2)
    down.publish(h[:1], [parts])
    down.flush()
    assert down.take_events() == [] and down.redis.write_errors == 1
    down.close()


def test_keys_are_namespaced_and_carry_no_request_text(redis_prefix, smollm2_tokenizer):
    raw, prefix = redis_prefix
    text = "Confidential: employee 4711 asks about parental leave in Lisbon."
    ids = smollm2_tokenizer.encode(text * 3)
    hashes = hash_blocks(seed_hash("keys"), ids, BS)
    layout = _layout(torch.float32, ((0, 2), (2, 3)))
    tiers = KVTiers(layout, redis_url=REDIS_URL, prefix=prefix)
    tiers.publish(hashes, [[bytes(layout.body_bytes(0)), bytes(layout.body_bytes(1))]] * len(hashes))
    tiers.flush()
    keys = sorted(k.decode() for k in raw.scan_iter(match=f"{prefix}:*"))
    assert len(keys) == 2 * len(hashes)
    for k in keys:
        assert re.fullmatch(re.escape(prefix) + r":kv:[0-9a-f]{16}:(0-2|2-3)", k), k
    words = [w for w in re.findall(r"[A-Za-z0-9]{4,}", text)]
    for k in keys:
        v = raw.get(k)
        assert not any(w.encode() in v or w in k for w in words)
    tiers.close()


def test_redis_down_is_a_miss_not_an_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                   # nothing listens there
    layout = _layout(torch.float32)
    tiers = KVTiers(layout, redis_url=f"redis://127.0.0.1:{port}/0", prefix="down", timeout=0.2)
    hashes = hash_blocks(seed_hash("down"), list(range(2 * BS)), BS)
    tiers.publish(hashes, [[bytes(layout.body_bytes(0))]] * 2)
    tiers.flush()
    assert tiers.fetch(hashes) == []
    assert tiers.stats.unavailable == 1 and tiers.redis.write_errors == 1
    tiers.close()


# ---- engine ---------------------------------------------------------------------------------
def _chat(prose_ids, turn):
    """A prompt growing by turn (a returning chat): 180, 260 tokens of real text."""
    return prose_ids[: 100 + 80 * turn]


def _run(h, engine, rid, ids, n=12):
    r = h.run(engine, [(rid, ids, h.greedy(n))])[rid]
    return r.output_token_ids, r.num_cached_tokens


def _evict_with_fillers(h, engine, prose_ids):
    """Requests of other text that take over the whole small pool (evicting every cached block)."""
    for i in range(3):
        _run(h, engine, f"fill{i}", [t + 7 + i for t in prose_ids[150:400]], n=2)


def test_greedy_identical_with_host_tier_after_eviction(h, smollm2_dir, prose_ids):
    plain = h.make_engine(smollm2_dir, num_blocks=24)
    tiered = h.make_engine(smollm2_dir, num_blocks=24, kv_offload_host_memory=64 * 2**20)
    outs = {}
    for name, eng in (("plain", plain), ("tiered", tiered)):
        first = _run(h, eng, "t1", _chat(prose_ids, 1))
        _evict_with_fillers(h, eng, prose_ids)
        outs[name] = first, _run(h, eng, "t2", _chat(prose_ids, 2))
    (p1, (p2, p_cached)), (t1, (t2, t_cached)) = outs["plain"], outs["tiered"]
    assert p1 == t1[:] and p2 == t2
    assert p_cached == 0                            # the pool had lost the chat
    assert t_cached == 176                          # ... the host tier had not (180 tokens: 11 full blocks)
    st = tiered.snapshot()
    assert st.kv_tier_host_hits == t_cached // 16 and st.kv_tier_blocks_offloaded > 0
    assert st.kv_tier_integrity_failures == 0 and st.prefix_cache_hits >= t_cached
    plain.shutdown()
    tiered.shutdown()


@pytest.fixture
def redis_engines(h, smollm2_dir, redis_prefix):
    raw, prefix = redis_prefix
    made = []

    def make(url=REDIS_URL, **kw):
        eng = h.make_engine(smollm2_dir, num_blocks=48, kv_offload_redis_url=url, kv_offload_prefix=prefix, **kw)
        made.append(eng)
        return eng

    yield make, raw, prefix
    for e in made:
        e.shutdown()


def test_shared_redis_gives_another_replica_cached_tokens(h, redis_engines, prose_ids):
    make, raw, prefix = redis_engines
    a, b = make(), make()
    ref = h.make_engine(b.model_dir, num_blocks=48)
    out_a, _ = _run(h, a, "t1", _chat(prose_ids, 1))   # a keeps the chat and wrote it through to Redis
    a.tiers.flush()
    assert len(list(raw.scan_iter(match=f"{prefix}:kv:*"))) == 11
    out_b, cached_b = _run(h, b, "t2", _chat(prose_ids, 2))
    out_ref, cached_ref = _run(h, ref, "t2", _chat(prose_ids, 2))
    assert cached_ref == 0 and cached_b == 176      # 180 tokens: 11 full blocks from a's turn
    assert out_b == out_ref
    assert b.snapshot().kv_tier_redis_hits == 11
    ref.shutdown()


def test_corrupted_value_in_redis_means_recompute(h, redis_engines, prose_ids):
    make, raw, prefix = redis_engines
    a = make()
    out1, _ = _run(h, a, "t1", _chat(prose_ids, 1))
    a.tiers.flush()
    keys = sorted(raw.scan_iter(match=f"{prefix}:kv:*"))
    assert len(keys) == 11
    h0 = hash_blocks(a.block_manager.hash_seed, _chat(prose_ids, 1), 16)
    key = block_key(prefix, h0[3], (0, 30))
    v = bytearray(raw.get(key))
    v[-100] ^= 0x01                                 # one bit of one value
    raw.set(key, bytes(v))
    b = make()
    ref = h.make_engine(b.model_dir, num_blocks=48)
    out_b, cached_b = _run(h, b, "t2", _chat(prose_ids, 2))
    out_ref, _ = _run(h, ref, "t2", _chat(prose_ids, 2))
    assert cached_b == 3 * 16                       # the blocks before the damaged one
    assert out_b == out_ref
    assert b.snapshot().kv_tier_integrity_failures == 1
    ref.shutdown()


@pytest.mark.chaos
def test_redis_killed_between_turns_means_recompute(h, redis_engines, private_redis, prose_ids):
    make, _, _ = redis_engines
    url, proc = private_redis
    a = make(url=url)
    ref = h.make_engine(a.model_dir, num_blocks=48)
    _run(h, a, "t1", _chat(prose_ids, 1))
    a.tiers.flush()
    b = make(url=url)
    assert len(b.tiers.fetch(hash_blocks(b.block_manager.hash_seed, _chat(prose_ids, 1), 16))) == 11
    proc.kill()
    proc.wait()
    out_b, cached_b = _run(h, b, "t2", _chat(prose_ids, 2))
    out_ref, _ = _run(h, ref, "t2", _chat(prose_ids, 2))
    assert cached_b == 0 and out_b == out_ref
    assert b.snapshot().kv_tier_unavailable >= 1
    # and the next request on the same engine is fine too (no lingering state)
    out_again, _ = _run(h, b, "t3", _chat(prose_ids, 2))
    assert out_again == out_ref
    ref.shutdown()


# ---- pp=2 and tp=3 through Ray ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    import ray

    from workers.executor import ensure_ray
    ensure_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.mark.parametrize("pp,tp,ranges", [(2, 1, ((0, 15), (15, 30))), (1, 3, ((0, 30),))], ids=["pp2", "tp3"])
def test_stages_and_ranks_store_and_load_their_own_layers(ray_local, h, smollm2_dir, prose_ids, redis_prefix,
                                                          pp, tp, ranges):
    """pp=2: each stage's body under its own key; tp=3: a stage's body is its ranks' parts (each its
    KV heads of every block) one after the other, split again at load."""
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.service_config import SchedulerConfig
    from scheduler.engine import LLMEngine
    from workers.executor import create_executor
    raw, prefix = redis_prefix
    cfg = EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=512,
                       num_threads=1, kv_offload_host_memory=64 * 2**20, kv_offload_redis_url=REDIS_URL,
                       kv_offload_prefix=prefix)
    sc = SchedulerConfig(pp=pp, tensor_parallel_size=tp, stage_num_cpus=1)
    eng = LLMEngine(cfg, executor_factory=lambda c, d: create_executor(c, d, sc))
    try:
        assert eng.tiers.layout.layer_ranges == ranges and eng.tiers.layout.tp == tp
        ref = h.make_engine(smollm2_dir, num_blocks=48)
        out1, _ = _run(h, eng, "t1", _chat(prose_ids, 1))
        eng.reset_prefix_cache(offload=True)
        eng.step()
        eng.tiers.flush()
        keys = [k.decode().rsplit(":", 1)[1] for k in raw.scan_iter(match=f"{prefix}:kv:*")]
        assert sorted(keys) == sorted(f"{a}-{b}" for a, b in ranges for _ in range(11))
        out2, cached = _run(h, eng, "t2", _chat(prose_ids, 2))
        assert cached == 176 and eng.snapshot().kv_tier_host_hits == 11
        assert (out1, out2) == (_run(h, ref, "r1", _chat(prose_ids, 1))[0], _run(h, ref, "r2", _chat(prose_ids, 2))[0])
        eng.tiers.flush()
        eng.tiers.host._values.clear()              # now from Redis: the stages' own values
        eng.tiers.host.bytes = 0
        eng.reset_prefix_cache()
        out3, cached3 = _run(h, eng, "t3", _chat(prose_ids, 2))
        assert cached3 == 256                       # t1's blocks and t2's (written through)
        assert out3 == out2 and eng.snapshot().kv_tier_redis_hits == 16
        ref.shutdown()
    finally:
        eng.shutdown()
