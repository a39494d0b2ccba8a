"""The soak benchmark's pieces that need no server (bench/soak.py): its request mix, and the
KV pool's resident pages read from /proc/PID/smaps, checked on a real lazily committed pool."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import KINDS, plan


def test_plan_is_seeded_and_mixes_every_kind():
    kinds = plan(2000, seed=0)
    assert kinds == plan(2000, seed=0) and kinds != plan(2000, seed=1)
    counts = collections.Counter(kinds)
    assert set(counts) == set(KINDS)
    for kind, (weight, _) in KINDS.items():
        assert abs(counts[kind] / 2000 - weight) < 0.03, kind


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
