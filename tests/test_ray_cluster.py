"""Pipeline stages across Ray nodes: a two-node Ray cluster on this machine (``ray start --head``
and ``ray start --address``: two raylets, one CPU and one custom resource each), a pp=2
replica placed ``strict-spread`` (real Ray, real SmolLM2 weights, float32). Its greedy output
equals the in-process engine's, its two stages report different nodes, a third stage cannot
be placed (an EngineError naming what was asked) and the placement group is removed at
shutdown.

The cluster is this module's own: ``ray start --block`` subprocesses in their own session
and temp dir, terminated at the end (never ``ray stop``, which would stop every Ray instance
of the machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import EngineError
from scheduler.engine import LLMEngine
from workers.executor import RayPipelineExecutor, ensure_ray

pytestmark = pytest.mark.multinode

KV = 64 * 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """End a ``ray start --block`` and what it started (its own process group)."""
    if proc.poll() is None:
        proc.terminate()                     # ray start --block stops its node's processes
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of that node, if any
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
def cluster():
    """``host:port`` of a two-node Ray cluster (node_a: the head, node_b), this process connected."""
    import ray
    if ray.is_initialized():
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    temp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")     # short: Ray's socket paths have a length limit
    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
              f"--object-store-memory={200 * 2**20}", "--block"]
    procs = []

    def start(args, name):
        log = open(Path(temp) / f"{name}.log", "w")
        procs.append(subprocess.Popen([ray_bin, "start", *args, *common], stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, env=dict(os.environ, RAY_worker_niceness="0")))

    try:
        start(["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}",
               '--resources={"node_a": 1}'], "head")
        deadline = time.monotonic() + 30
        while True:                                   # the head's GCS is up
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and procs[0].poll() is None, "ray head did not start"
                time.sleep(0.2)
        start([f"--address={address}", '--resources={"node_b": 1}'], "worker")
        ensure_ray(address)
        deadline = time.monotonic() + 30
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline and procs[1].poll() is None, "the second ray node did not join"
            time.sleep(0.2)
        yield address
    finally:
        ray.shutdown()
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _outputs(engine, h, requests):
    return {rid: r.output_token_ids for rid, r in h.run(engine, requests).items()}


def test_pp2_strict_spread_puts_a_stage_on_each_node_and_matches_the_engine(cluster, smollm2_dir, prose_ids, h):
    import ray
    from ray.util import placement_group_table

    cfg = EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=KV, max_model_len=512,
                       num_threads=1, max_num_batched_tokens=96)
    requests = [(f"r{i}", prose_ids[7 * i: 40 + 31 * i], h.greedy(8)) for i in range(4)]
    expected = _outputs(LLMEngine(cfg), h, requests)
    t0 = time.monotonic()
    eng = LLMEngine(cfg, executor_factory=lambda c, d: RayPipelineExecutor(c, d, 2, stage_num_cpus=1,
                                                                            placement="strict-spread"))
    t_up = time.monotonic() - t0
    try:
        infos = eng.executor.stage_info
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(alive) == 2 and {i["node_id"] for i in infos} == alive     # one stage per node
        assert [i["num_threads"] for i in infos] == [1, 1]
        pg_id = eng.executor.placement_group.id.hex()
        assert _outputs(eng, h, requests) == expected
        # every CPU of the cluster is in the group now; a 3-stage strict spread cannot fit 2 nodes
        with pytest.raises(EngineError, match=r"could not place 3 pipeline stages within 2 s.*STRICT_SPREAD"):
            RayPipelineExecutor(cfg, str(smollm2_dir), 3, stage_num_cpus=1, placement="strict-spread",
                                placement_timeout=2)
    finally:
        eng.shutdown()
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    print(f"pp=2 strict-spread over 2 nodes: up in {t_up:.1f} s")


def test_tp3_across_two_nodes_sums_over_gloo_and_matches_the_engine(cluster, smollm2_dir, prose_ids, h):
    """Three tensor-parallel ranks of half a CPU each, spread over the two nodes: their group
    spans nodes, so they sum through gloo over TCP instead of shared memory."""
    import ray
    cfg = EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=KV, max_model_len=512,
                       num_threads=1)
    requests = [(f"r{i}", prose_ids[5 * i: 30 + 17 * i], h.greedy(6)) for i in range(3)]
    expected = _outputs(LLMEngine(cfg), h, requests)
    eng = LLMEngine(cfg, executor_factory=lambda c, d: RayPipelineExecutor(c, d, 1, stage_num_cpus=0.5,
                                                                            placement="spread", tp=3))
    try:
        infos = ray.get([s.info.remote() for s in eng.executor.stages])
        assert len({i["node_id"] for i in infos}) == 2
        assert [(i["tp_rank"], i["tp_comm"]) for i in infos] == [(0, "gloo"), (1, "gloo"), (2, "gloo")]
        assert _outputs(eng, h, requests) == expected
    finally:
        eng.shutdown()
