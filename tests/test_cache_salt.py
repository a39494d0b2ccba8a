"""Per-tenant prefix-cache isolation (``cache_salt``): the salt enters the block-hash chain
(kvstore/hashing.py), so the engine, the router's prefix scoring and the Redis prefix index all
key by it.

* Engine level, through the offline ``LLM`` (SmolLM2-135M float32, real prose): requests of
  another salt get 0 cached tokens and the same greedy tokens; a salt's second request hits.
* Through the mesh: a gateway with API keys (tenants acme and globex) in front of a scheduler
  whose replica runs in an engine process and publishes to a real Redis index (``REDIS_URL``, a
  key prefix of this module's own, deleted at the end; a private redis-server when none
  answers). Tenant acme caches a PolicyDesk policy prefix; globex's identical chat reports 0
  cached tokens and the router gives it no prefix credit; acme's second chat hits; acme with a
  cache_salt of its own misses; nothing under the index prefix holds a tenant, a salt or a key.
"""

from __future__ import annotations

import shutil
import time
import uuid

import grpc
import pytest

from gateway.auth import cache_salt
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2, llm_pb2, scheduler_pb2, scheduler_pb2_grpc
from kvstore.events import BlockStored, CollectingSink
from kvstore.hashing import hash_blocks, salted_seed

from test_auth import ACME_1, GLOBEX, KEYS_FILE, KeyedMesh   # tests/ is on sys.path (no __init__.py)

redis = pytest.importorskip("redis")

BLOCK = 16
SCHEDULER_ID = "salt-test"


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# ---- hashing -----------------------------------------------------------------------------------------

def test_salt_changes_every_hash_of_the_chain():
    tokens = list(range(100, 100 + 5 * BLOCK))
    plain = hash_blocks(7, tokens, BLOCK)
    assert hash_blocks(7, tokens, BLOCK, cache_salt="") == plain == hash_blocks(7, tokens, BLOCK, cache_salt=None)
    a, b = hash_blocks(7, tokens, BLOCK, cache_salt="a"), hash_blocks(7, tokens, BLOCK, cache_salt="b")
    assert not set(a) & set(plain) and not set(a) & set(b) and len(set(a)) == 5
    assert a == hash_blocks(salted_seed(7, "a"), tokens, BLOCK)
    # continuing a chain from its last hash gives the same hashes (the block manager's way)
    assert a[:2] + hash_blocks(7, tokens, BLOCK, parent=a[1], start_block=2, cache_salt="a") == a


# ---- engine level ------------------------------------------------------------------------------------

def test_engine_salts_partition_the_prefix_cache(smollm2_dir, prose_ids):
    from kvmesh import LLM
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=48 * 2**20, max_model_len=512)
    sink = llm.engine.block_manager.sink = CollectingSink()
    prompt = prose_ids[:100]                       # 6 full blocks and 4 tokens
    hit = BLOCK * ((len(prompt) - 1) // BLOCK)

    def run(salt: str | None):
        p = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        ro = llm.generate(p, _greedy(4))[0]
        return ro.metrics.num_cached_tokens, ro.outputs[0].token_ids

    cached, tokens_a = run("tenant-a")
    assert cached == 0
    assert run("tenant-b") == (0, tokens_a)        # identical prompt, other salt: no hit, same output
    assert run(None) == (0, tokens_a)              # the unsalted cache does not see salted blocks either
    assert run("tenant-a") == (hit, tokens_a)      # the same salt still gets its hits
    assert run("tenant-b") == (hit, tokens_a)
    assert run(None) == (hit, tokens_a)
    stored = [ev for ev in sink.events if isinstance(ev, BlockStored)]
    seed = llm.engine.block_manager.hash_seed
    chains = {salt: hash_blocks(seed, prompt, BLOCK, cache_salt=salt)[:6] for salt in ("tenant-a", "tenant-b", "")}
    firsts = [ev for ev in stored if ev.parent_hash is None]
    assert [list(ev.block_hashes[:6]) for ev in firsts] == [chains["tenant-a"], chains["tenant-b"], chains[""]]
    assert len({h for c in chains.values() for h in c}) == 18      # no block shared between salts
    with pytest.raises(EngineError, match="cache_salt must be a string"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": 3}, _greedy(1))


# ---- through the mesh, with the Redis index ------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_url():
    import os
    from test_routing import RedisServer, _ping
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
def mesh(smollm2_dir, redis_url, tmp_path_factory):
    from test_routing import _delete_keys
    prefix = f"kvmesh-salt-test-{uuid.uuid4().hex[:8]}"
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEYS_FILE)
    # provisional_ttl 0: the router's credit comes from the Redis index alone
    m = KeyedMesh(smollm2_dir, str(path),
                  sched_kw=dict(routing="prefix", redis_url=redis_url, index_prefix=prefix, index_timeout=0.5,
                                provisional_ttl=0.0, scheduler_id=SCHEDULER_ID),
                  engine_kw=dict(kv_cache_memory=256 * 2**20, max_model_len=2048))
    m.prefix, m.redis_url = prefix, redis_url
    m.sched_channel = grpc.insecure_channel(m.sched.address)
    m.sched_stub = scheduler_pb2_grpc.SchedulerServiceStub(m.sched_channel)
    yield m
    m.sched_channel.close()
    m.close()
    _delete_keys(redis_url, prefix)


def _chat_request(salt: str = "") -> llm_pb2.ChatRequest:
    import policydesk
    req = llm_pb2.ChatRequest(messages=[
        llm_pb2.ChatMessage(role="system", content=policydesk.system_message("paid_leave")),
        llm_pb2.ChatMessage(role="user", content="How many days of paid leave do I get in my first year?")],
        cache_salt=salt)
    req.sampling.temperature, req.sampling.max_tokens, req.sampling.ignore_eos = 0.0, 4, True
    return req


def _chat(mesh, key: str, salt: str = "") -> tuple[str, llm_pb2.GenerateResponse]:
    """(text, final message) of the policy chat as the tenant of ``key``."""
    msgs = list(mesh.stub.Chat(_chat_request(salt), metadata=(("authorization", f"Bearer {key}"),), timeout=120))
    assert msgs[-1].finished
    return "".join(m.text for m in msgs), msgs[-1]


def _router(mesh) -> tuple[int, int]:
    st = mesh.sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    return st.prefix_routed, st.prefix_routed_blocks


def _held(index, hashes: list[int]) -> int:
    return index.match(hashes).get(f"{SCHEDULER_ID}/0", 0)


def _wait(pred, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return v


def test_tenant_b_gets_no_hit_and_no_credit_from_tenant_a(mesh):
    from kvstore.index_redis import RedisIndex
    index = RedisIndex(mesh.redis_url, prefix=mesh.prefix, timeout=1.0)
    try:
        meta = (("authorization", f"Bearer {ACME_1}"),)
        req = _chat_request()
        prompt = list(mesh.stub.Tokenize(llm_pb2.TokenizeRequest(chat=req), metadata=meta, timeout=30).token_ids)
        assert len(prompt) > 1000                                     # a whole policy
        seed = mesh.sched.service.replicas[0].info.hash_seed
        salted = {t: hash_blocks(seed, prompt, BLOCK, cache_salt=cache_salt(t)) for t in ("acme", "globex")}
        n_blocks, hit = len(prompt) // BLOCK, BLOCK * ((len(prompt) - 1) // BLOCK)

        text, first = _chat(mesh, ACME_1)                              # tenant acme caches the policy prefix
        assert first.usage.prompt_tokens == len(prompt) and first.usage.cached_prompt_tokens == 0
        _wait(lambda: _held(index, salted["acme"]) == n_blocks, "acme's blocks in the Redis index")
        assert _held(index, hash_blocks(seed, prompt, BLOCK)) == 0     # not under the unsalted hashes
        assert _held(index, salted["globex"]) == 0
        routed = _router(mesh)

        other_text, other = _chat(mesh, GLOBEX)                        # tenant globex, identical prompt
        assert other.usage.cached_prompt_tokens == 0
        assert _router(mesh) == routed                                 # no prefix credit
        assert other_text == text                                      # same greedy answer

        again_text, again = _chat(mesh, ACME_1)                        # acme again: hits its own blocks
        assert again.usage.cached_prompt_tokens == hit and again_text == text
        assert _router(mesh) == (routed[0] + 1, routed[1] + n_blocks)  # and the router credited them

        _, own = _chat(mesh, ACME_1, salt="project-x")                 # a salt of acme's own: a new partition
        assert own.usage.cached_prompt_tokens == 0
        _wait(lambda: _held(index, salted["globex"]) == n_blocks, "globex's blocks in the Redis index")
    finally:
        index.close()

    # nothing under the index prefix holds a tenant, a salt (raw or derived) or a key
    r = redis.Redis.from_url(mesh.redis_url, socket_timeout=5)
    secrets = [s.encode() for s in ("acme", "globex", "project-x", cache_salt("acme"), cache_salt("globex"),
                                    cache_salt("acme", "project-x"), ACME_1, GLOBEX)]
    dump = []
    for key in r.scan_iter(match=f"{mesh.prefix}:*", count=1000):
        kind = r.type(key)
        if kind == b"hash":
            value = r.hgetall(key)
            dump += [key, *value.keys(), *value.values()]
        elif kind == b"set":
            dump += [key, *r.smembers(key)]
        elif kind == b"string":
            dump += [key, r.get(key)]
        else:
            dump += [key, r.dump(key)]
    r.close()
    assert len(dump) > 3 * n_blocks                                    # the index holds the three partitions
    leaks = [(s, d) for s in secrets for d in dump if d and s in d]
    assert not leaks


def test_cache_salt_limits(mesh):
    meta = (("authorization", f"Bearer {GLOBEX}"),)
    req = llm_pb2.GenerateRequest(prompt="hi", cache_salt="s" * 257)
    with pytest.raises(grpc.RpcError) as e:
        list(mesh.stub.Generate(req, metadata=meta, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt: 257 characters exceeds max_id_length (256)" in e.value.details()
    sub = scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2, 3], cache_salt="s" * 257,
                                      sampling=common_pb2.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as e:
        list(mesh.sched_stub.Submit(sub, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()
    assert mesh.sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).replicas[0].healthy
