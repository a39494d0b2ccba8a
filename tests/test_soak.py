"""The soak benchmark (bench/soak.py): its request mix, the rule that says which outcomes are
expected around a stage kill, and the KV pool's resident pages read from /proc/PID/smaps (a real
lazily committed pool); then the chaos soak itself, small, over real gRPC, Ray and Redis."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import KINDS, expected, plan


def test_plan_is_seeded_and_mixes_every_kind():
    kinds = plan(2000, seed=0)
    assert kinds == plan(2000, seed=0) and kinds != plan(2000, seed=1)
    counts = collections.Counter(kinds)
    assert set(counts) == set(KINDS)
    for kind, (weight, _) in KINDS.items():
        assert abs(counts[kind] / 2000 - weight) < 0.03, kind


def test_expected_outcomes_around_a_stage_kill():
    """A request's kind's outcome is always expected; in the kill window (kill at 10 s, replica
    back at 25 s) an UNAVAILABLE 'replica N failed' only after tokens, a 'waited' one only when it
    waited the whole --restart-wait; outside the window neither."""
    kill = {"t_kill": 10.0, "t_back": 25.0}

    def rec(kind, outcome, detail="", tokens=False, t0=9.0, t1=11.0):
        return {"kind": kind, "outcome": outcome, "detail": detail, "tokens": tokens, "t0": t0, "t1": t1}

    cut = "replica 0 failed: replica 0: engine loop died: pipeline stage 1 died"
    assert expected(rec("chat", "OK:length"), kill, 30.0) == "kind"
    assert expected(rec("chat", "UNAVAILABLE", cut, tokens=True), kill, 30.0) == "cut"
    assert expected(rec("chat", "UNAVAILABLE", cut, tokens=False), kill, 30.0) is None     # lost in the death window
    assert expected(rec("chat", "UNAVAILABLE", cut, tokens=True, t0=26, t1=27), kill, 30.0) is None   # after it
    assert expected(rec("chat", "UNAVAILABLE", cut, tokens=True), None, 30.0) is None        # no kill
    waited = "no healthy replica; waited {} s for a restarting replica"
    assert expected(rec("short", "UNAVAILABLE", waited.format("30.0"), t1=41), kill, 30.0) == "waited"
    assert expected(rec("short", "UNAVAILABLE", waited.format("4.2"), t1=15), kill, 30.0) is None
    assert expected(rec("deadline", "UNAVAILABLE", waited.format("0.2")), kill, 30.0) is None
    for outcome in ("INTERNAL", "UNKNOWN", "CANCELLED"):
        assert expected(rec("chat", outcome, "x", tokens=True), kill, 30.0) is None
    assert expected(rec("cancel", "CANCELLED"), kill, 30.0) == "kind"


# Run in a fresh process: the pool must be the process's largest anonymous mapping, as in an
# engine process, which a pytest process that ran other tests' engines (and KV tiers) is not.
_POOL_CHECK = """
import os, sys, torch
from bench.soak import kv_pool_rss
from workers.kv_cache import allocate_kv_cache
blocks, bs, kvh, d = 4000, 16, 5, 64
(cache,) = allocate_kv_cache(1, blocks, bs, kvh, d, torch.float32, torch.device("cpu"))
pool = 2 * blocks * bs * kvh * d * 4
before = kv_pool_rss(os.getpid(), pool)
cache.data[:, :1000].fill_(1.0)
after = kv_pool_rss(os.getpid(), pool)
try:
    kv_pool_rss(os.getpid(), 3 * pool)
    too_small = "no error"
except RuntimeError as e:
    too_small = str(e)
print(before, after, repr(too_small))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/PID/smaps is Linux's")
def test_kv_pool_rss_counts_the_pages_written():
    """A real KV pool (one layer, lazily committed, larger than the process's other anonymous
    mappings): its resident bytes follow the blocks written, not the pool's size."""
    blocks, bs, kvh, d = 4000, 16, 5, 64
    pool = 2 * blocks * bs * kvh * d * 4                          # 163,840,000 bytes
    block_bytes = bs * kvh * d * 4                                # 20 KiB: 5 pages
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-c", _POOL_CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    before, after, too_small = p.stdout.split(maxsplit=2)
    before, after = int(before), int(after)
    assert before < pool / 2             # nothing written yet (a merged neighbour may count)
    written = 2 * 1000 * block_bytes                              # K and V of a quarter of the blocks
    assert written <= after - before + 64 * 1024 and after <= before + written + 4 * 2**20
    assert "KV pool" in too_small, too_small


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="the chaos soak starts a redis-server of its own")
@pytest.mark.chaos
@pytest.mark.mesh
def test_chaos_soak_pp2_over_ray_with_kv_tiers_loses_no_request(tmp_path):
    """The soak with the real process shapes, small: `kvmesh serve` at pp 2 over a real local Ray
    (two ray::PipelineStage processes), KV tiers on (host memory and the soak's own redis-server,
    also the prefix index), 60 mixed requests; the Redis server is killed and restarted, then a
    stage is SIGKILLed and the replica restarts whole. Every request gets its kind's outcome,
    except a stream the kill cut after its first tokens (UNAVAILABLE `replica 0 failed`, with a
    retry hint); no KV block is left in use; every mesh process (kvmesh serve, the engine
    process, both stages, the restarted ones from their own warm-up) has its RSS before and after."""
    from bench.soak import main
    out = tmp_path / "soak.json"
    code = main(["--requests", "60", "--concurrency", "8", "--warmup", "8", "--rewarm", "8", "--sample-every", "1000",
                 "--serve-args", "--pp 2 --executor ray --dtype auto --weight-format auto --kv-cache-memory 256MiB "
                                 "--kv-offload-host-memory 64MiB",
                 "--own-redis", "--restart-redis-at", "14", "--redis-down", "1", "--kill-stage-at", "28",
                 "--server-log", str(tmp_path / "serve.log"), "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["unexpected"] == 0, r["unexpected_examples"]
    assert r["used_blocks_after"] == 0 and sum(sum(c.values()) for c in r["outcomes"].values()) == 60
    assert r["chaos_ok"], r["chaos"]
    kill, red = r["chaos"]["stage_kill"], r["chaos"]["redis_restart"]
    assert red["new_pid"] != red["pid"] and red["t_up"] <= kill["t_kill"]
    assert kill["in_flight"] > 0 and r["kill_window"]["requests"] >= kill["in_flight"]
    assert kill["new_engine_pid"] != kill["old_engine_pid"] and len(kill["new_stage_pids"]) == 2
    assert r["unavailable_retry_hints"].get("without", 0) == 0, r["unavailable_retry_hints"]
    roles = {p["role"]: p for p in r["processes"] if p["checked"]}
    assert set(roles) == {"gateway + scheduler (kvmesh serve)", "engine process (replica 0)",
                          "stage 0 (replica 0)", "stage 1 (replica 0)"}
    assert roles["engine process (replica 0)"]["pid"] == kill["new_engine_pid"]
    assert {roles[f"stage {i} (replica 0)"]["pid"] for i in (0, 1)} == set(kill["new_stage_pids"])
    assert roles["gateway + scheduler (kvmesh serve)"]["baseline"] == "idle after warm-up"
    for p in roles.values():
        assert p["rss_before_mib"] and p["rss_after_mib"] and p["rest_growth_pct"] is not None, p
    for i in (0, 1):
        assert roles[f"stage {i} (replica 0)"]["baseline"] == "idle after the restart's warm-up"
        assert roles[f"stage {i} (replica 0)"]["kv_pool_located"]
    assert code in (0, 1) and (code == 0) == r["rss_ok"]
