"""``python -m bench.soak``: a soak of ``kvmesh serve`` through its real gRPC gateway: thousands
of mixed requests, optionally with a Redis restart and a pipeline stage killed in the middle,
then the statuses, the KV blocks left in use and the memory of every process.

The server is ``kvmesh serve --model MODEL`` (a subprocess) with ``--serve-args`` added
(``--address`` and ``--scheduler-address`` use a running one instead). ``--requests`` (2000)
requests, at most ``--concurrency`` (16) in flight, each of a kind drawn with a seeded RNG
(weights in ``KINDS``):

- ``chat``: a PolicyDesk question under its policy's system prompt (Chat; the policies' long
  shared prefixes come from the prefix cache), 4-16 tokens, greedy or sampled: OK;
- ``short``: a short text prompt (Generate), 4-16 tokens: OK;
- ``stop``: a short prompt with stop strings (" ", "."): OK, finish stop (or length);
- ``cancel``: the client cancels the stream after its first token: CANCELLED;
- ``deadline``: a 256-token request with a 0.2 s deadline: DEADLINE_EXCEEDED;
- ``abort``: a 256-token request ended by the gateway's Abort RPC after its first token: OK,
  finish abort;
- ``bad``: a request the gateway must refuse (empty prompt, bad sampling value, unknown role
  or model, negative timeout): INVALID_ARGUMENT.

**Process shapes.** ``kvmesh serve`` runs the gateway and the scheduler in one process (which
also starts the local Ray), each replica's engine loop in an engine process of its own, and at
``--pp 2 --executor ray`` the replica's pipeline stages as Ray actors (``ray::PipelineStage``
processes, children of Ray's raylet); GetStats gives each replica's engine ``pid`` and its
``stage_pids``. ``--own-redis`` starts a ``redis-server`` of the soak's own on a free port
(``bench.chaos.OwnRedis``, no persistence) and serves with it as the KV tier
(``--kv-offload-redis-url``) and the prefix index (``--redis-url``); the host tier is a flag of
``--serve-args`` (``--kv-offload-host-memory``).

**Chaos.** ``--restart-redis-at N``: once N requests are done, the own redis-server is killed
(SIGKILL) and started again, empty, on the same port ``--redis-down`` (3) seconds later; the
Redis tier and the Redis index must degrade (a miss is recomputed, routing falls back to load),
never fail a request. ``--kill-stage-at N``: once N requests are done, stage
``--kill-stage-index`` (0) of replica 0 is SIGKILLed (by the pid GetStats gives, checked to be a
``ray::PipelineStage``); the replica restarts whole (a new engine process and new stages) and
the soak follows GetStats until it is back. The events do not overlap: a kill due while Redis is
down waits until it is back.

**Expected outcomes.** A request gets exactly its kind's outcomes above, with one exception,
the rule the mesh documents for a replica's death (docs/mesh.md, "Requests: the death window";
``scheduler/service.py``): a request open at some moment of the *kill window* (from the kill to
the moment GetStats shows the replica back) that had already received tokens when its replica
died cannot be resumed exactly, and may end UNAVAILABLE ``replica N failed: ...``. One that had
received nothing is not failed: it waits for the restart and gets its kind's outcome, unless the
restart outlasts the scheduler's ``--restart-wait`` (read from ``--serve-args``, default 30 s):
then UNAVAILABLE ``... waited W s for a restarting replica`` with W >= that wait is expected
too. Everything else is unexpected: any other status (INTERNAL, UNKNOWN, a CANCELLED the client
did not ask for), a stream that ends without a final message, an UNAVAILABLE for a request
that had received no token (lost in the death window), any failure during the Redis restart.
Whether an UNAVAILABLE carried a retry hint (``grpc-retry-pushback-ms``) is counted.

**Memory.** The resident set size (RSS) of every process (``kvmesh serve``, each engine
process, each stage; Ray's own daemons too, reported apart and not checked) is read when the
first ``--warmup`` (200) requests are done and the server is idle (then ``--settle`` seconds,
3: an idle engine process gives the memory it freed back to the OS after 1 s,
:mod:`kvmesh.core.memory`), every ``--sample-every`` requests, and at the end, idle and settled.
A process started by the restart (engine, stages: new pids) gets its own warm-up: ``--rewarm``
(200) requests after the replica is back the soak waits for the server to be idle and samples
again; that sample is its baseline. Growth = end / baseline - 1, of the RSS outside the bounded
caches, each subtracted: a KV pool (``kv_cache_memory``, in
the stages at pp > 1, in the engine process at pp 1) is one anonymous mapping committed page by
page as blocks are first written (:func:`workers.kv_cache.allocate_kv_cache`), its resident
pages read in ``/proc/PID/smaps``; the host tier holds at most ``--kv-offload-host-memory``
bytes in the engine process (GetStats ``kv_tier_host_bytes``); Ray's object store is a shared
memory file of a fixed size (``/dev/shm/plasma...``, ``object_store_memory``) that the engine
process and the stages map: the store's pages a process has touched (the KV block bodies of the
tiers travel through it) count in its RSS, up to that size, its resident part read in smaps.
Each sample also records the RSS's anonymous, file and shared parts (``/proc/PID/status``).
At the end GetStats must show no request running or waiting and 0 KV blocks in use. Exits 1 when a check fails:
unexpected outcomes, blocks in use, a chaos event that did not happen as asked (the replica not
back), or a checked process whose RSS outside its bounded caches grew more than
``--max-growth`` (5%) or that has no idle baseline.

Usage::

    python -m bench.soak [--requests 2000] [--concurrency 16] [--model smollm2-135m-instruct] [--out soak.json]
    python -m bench.soak --serve-args \\
        "--pp 2 --executor ray --kv-cache-memory 256MiB --kv-offload-host-memory 128MiB" \\
        --own-redis --restart-redis-at 700 --kill-stage-at 1300 --out soak_pp2.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shlex
import sys
import time

from bench import command
from bench.machine import cpu_model
from bench.markdown import add_output_args

# kind: (weight, expected outcomes); an outcome is "OK:<finish reason>" or a gRPC status name
KINDS = {
    "chat": (0.30, {"OK:length", "OK:stop"}),
    "short": (0.20, {"OK:length", "OK:stop"}),
    "stop": (0.10, {"OK:stop", "OK:length"}),
    "cancel": (0.10, {"CANCELLED"}),
    "deadline": (0.10, {"DEADLINE_EXCEEDED"}),
    "abort": (0.12, {"OK:abort"}),
    "bad": (0.08, {"INVALID_ARGUMENT"}),
}
SHORT_PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time, in a small village,",
                 "The three primary colours are", "def fibonacci(n):", "A haiku about autumn:",
                 "Explain paged attention in one sentence:", "List three prime numbers:"]
REPLICA_FAILED = re.compile(r"replica \d+ failed: ")    # scheduler/service.py: a stream its replica's death cut
WAITED = re.compile(r"waited ([\d.]+) s for a restarting replica")
EXPECTED_RULE = ("each request gets its kind's outcomes; a request open during the kill window (kill -> replica "
                 "back) that had received tokens may end UNAVAILABLE 'replica N failed: ...'; one that had received "
                 "none may end UNAVAILABLE 'waited W s for a restarting replica' only with W >= --restart-wait")


def plan(n: int, seed: int) -> list[str]:
    """The kind of each of ``n`` requests, drawn with the seeded RNG by ``KINDS``' weights."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), [w for w, _ in KINDS.values()]
    return rng.choices(kinds, weights, k=n)


class Soak:
    """The request mix against one gateway (``stub``: ``LLMServiceStub`` on a grpc.aio channel)."""

    def __init__(self, stub, seed: int):
        import policydesk
        self.stub = stub
        self.rng = random.Random(seed + 1)
        self.questions = policydesk.questions()
        self.systems = {q["policy"]: policydesk.system_message(q["policy"]) for q in self.questions}

    def _sampling(self, max_tokens: int, **kw):
        from kvmesh.v1 import common_pb2
        temperature = self.rng.choice([0.0, 0.8])
        return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, **kw)

    def _call(self, kind: str, rid: str):
        """The RPC of one request of ``kind`` (a stream call)."""
        from google.protobuf.duration_pb2 import Duration

        from kvmesh.v1 import common_pb2, llm_pb2
        s = self.stub
        if kind == "chat":
            q = self.rng.choice(self.questions)
            msgs = [llm_pb2.ChatMessage(role="system", content=self.systems[q["policy"]]),
                    llm_pb2.ChatMessage(role="user", content=q["question"])]
            return s.Chat(llm_pb2.ChatRequest(messages=msgs, sampling=self._sampling(self.rng.randint(4, 16)),
                                              request_id=rid))
        prompt = self.rng.choice(SHORT_PROMPTS)
        if kind == "short":
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=self._sampling(self.rng.randint(4, 16)),
                                                      request_id=rid))
        if kind == "stop":
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      sampling=self._sampling(16, stop=[" ", "."])))
        if kind in ("cancel", "abort"):
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      sampling=self._sampling(256, ignore_eos=True)))
        if kind == "deadline":
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      timeout=Duration(nanos=200_000_000),
                                                      sampling=self._sampling(256, ignore_eos=True)))
        bad = self.rng.randrange(5)
        if bad == 0:
            return s.Generate(llm_pb2.GenerateRequest(prompt="", request_id=rid))
        if bad == 1:
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      sampling=common_pb2.SamplingParams(top_p=2.0)))
        if bad == 2:
            return s.Chat(llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(role="wizard", content=prompt)],
                                              request_id=rid))
        if bad == 3:
            return s.Generate(llm_pb2.GenerateRequest(model="no-such-model", prompt=prompt, request_id=rid))
        return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid, timeout=Duration(seconds=-1)))

    async def one(self, kind: str, rid: str) -> tuple[str, str, bool, bool]:
        """Send one request of ``kind``; returns (outcome, detail, whether it received tokens,
        whether its error status carried a retry hint)."""
        import grpc

        from kvmesh.v1 import common_pb2, llm_pb2
        call = self._call(kind, rid)
        final, tokens = None, False
        try:
            async for msg in call:
                tokens = tokens or bool(msg.token_ids)
                if msg.finished:
                    final = msg
                elif msg.token_ids and kind == "cancel":
                    call.cancel()
                    break
                elif msg.token_ids and kind == "abort":
                    await self.stub.Abort(llm_pb2.AbortRequest(request_id=rid))
                    kind = "aborted"            # once
        except grpc.aio.AioRpcError as e:
            hint = any(k == "grpc-retry-pushback-ms" for k, _ in (e.trailing_metadata() or ()))
            return e.code().name, e.details() or "", tokens, hint
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
        if final is None:
            code = await call.code()
            return code.name, "no final message", tokens, False
        return ("OK:" + common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower(),
                "", tokens, False)


def expected(rec: dict, kill: dict | None, restart_wait: float) -> str | None:
    """Why the outcome of request record ``rec`` (kind, outcome, detail, tokens, t0, t1) is
    expected: ``"kind"`` (its kind's), ``"cut"`` (UNAVAILABLE after tokens in the kill window),
    ``"waited"`` (UNAVAILABLE without tokens after waiting ``restart_wait`` for the restart, in
    the window); None: unexpected. ``kill``: the stage kill (``t_kill``, ``t_back``; None: none)."""
    if rec["outcome"] in KINDS[rec["kind"]][1]:
        return "kind"
    if kill is None or rec["outcome"] != "UNAVAILABLE":
        return None
    back = kill["t_back"] if kill.get("t_back") is not None else float("inf")
    if not (rec["t0"] <= back and rec["t1"] >= kill["t_kill"]):
        return None
    if rec["tokens"] and REPLICA_FAILED.search(rec["detail"]):
        return "cut"
    m = WAITED.search(rec["detail"])
    if not rec["tokens"] and m and float(m.group(1)) >= restart_wait - 0.05:
        return "waited"
    return None


# ---- memory ---------------------------------------------------------------------------------------

def rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes."""
    import psutil
    return psutil.Process(pid).memory_info().rss


def rss_parts(pid: int) -> dict[str, int]:
    """The RSS of process ``pid`` by kind of page (Linux ``/proc/PID/status``), bytes:
    ``anon`` (heap, malloc arenas, the KV pool), ``file`` (mapped files: libraries, weights read
    from disk), ``shmem`` (shared memory: Ray's object store as this process touched it)."""
    parts = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                key = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}.get(line.split(":", 1)[0] + ":")
                if key:
                    parts[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return parts


def _mappings(pid: int) -> list[tuple[str, int, int, bool]]:
    """(path, size, rss, advised MADV_NOHUGEPAGE) of each mapping of process ``pid``, bytes, from
    ``/proc/PID/smaps`` (Linux); the path is "" for an anonymous mapping."""
    out, path, size, resident = [], "", 0, 0
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:          # a mapping: addr perms offset dev inode [path]
                path = " ".join(head[5:])
            elif head[0] == "Size:":
                size = int(head[1]) * 1024
            elif head[0] == "Rss:":
                resident = int(head[1]) * 1024
            elif head[0] == "VmFlags:":                          # the mapping's last line
                out.append((path, size, resident, "nh" in head[1:]))
    return out


def kv_pool_rss(pid: int, pool_bytes: int, mappings: list | None = None) -> int:
    """Resident bytes of the KV pool of process ``pid`` (Linux): the largest anonymous mapping
    in ``/proc/PID/smaps`` advised ``MADV_NOHUGEPAGE`` (VmFlags ``nh``: the pool is one such
    mapping, :func:`workers.kv_cache.allocate_kv_cache`, which no neighbour merges into), or,
    where none is, the largest anonymous mapping; it must be at least 0.9 x ``pool_bytes`` long
    (the K/V data without int8 KV's scales). Raises RuntimeError when it is too small (the KV on
    a device, or in Ray stage actors at pp > 1 when ``pid`` is the engine's)."""
    anonymous = [m for m in (mappings if mappings is not None else _mappings(pid)) if not m[0]]
    advised = max(((size, rss) for _, size, rss, nh in anonymous if nh), default=(0, 0))
    largest = advised if advised[0] >= 0.9 * pool_bytes else max(((size, rss) for _, size, rss, _ in anonymous),
                                                                    default=(0, 0))
    if largest[0] < 0.9 * pool_bytes:
        raise RuntimeError(f"no anonymous mapping of the KV pool's {pool_bytes} bytes in process {pid} "
                           f"(the largest has {largest[0]})")
    return largest[1]


def object_store_rss(mappings: list) -> tuple[int, int]:
    """(size, resident bytes) of Ray's object store as a process maps it: the shared memory file
    ``/dev/shm/plasma...`` of a fixed size (``object_store_memory``); a process's resident part
    grows with the store's pages it has touched, up to that size. (0, 0) when not mapped."""
    store = [(size, rss) for path, size, rss, _ in mappings if "plasma" in path]
    return (sum(s for s, _ in store), sum(r for _, r in store))


def process_row(role: str, pid: int, pool_bytes: int = 0, host_tier_bytes: int = 0) -> dict | None:
    """One process's memory: RSS (and its anonymous, file and shared parts), and the bounded
    caches it holds: ``pool_bytes``: its KV pool's size (its resident pages located in smaps);
    ``host_tier_bytes``: what its host tier holds; Ray's object store pages it maps. ``rest``:
    the RSS outside them. None when the process is gone."""
    import psutil
    try:
        row = {"role": role, "pid": pid, "rss": rss(pid), "kv_pool_rss": None, "host_tier_bytes": host_tier_bytes,
               **{f"rss_{k}": v for k, v in rss_parts(pid).items()}}
        mappings = _mappings(pid)
    except (psutil.Error, OSError):
        return None
    row["object_store_bytes"], row["object_store_rss"] = object_store_rss(mappings)
    if pool_bytes:
        row["kv_pool_bytes"] = pool_bytes
        try:
            row["kv_pool_rss"] = kv_pool_rss(pid, pool_bytes, mappings)
        except RuntimeError as e:      # the split is best effort: the whole RSS then counts
            row["kv_pool_error"] = str(e)
    row["rest"] = row["rss"] - (row["kv_pool_rss"] or 0) - host_tier_bytes - row["object_store_rss"]
    return row


def ray_processes(serve_pid: int, known: set[int]) -> list[tuple[str, int]]:
    """(role, pid) of the processes under ``serve_pid`` that are not the mesh's (``known``): Ray's
    own (``ray: NAME``: GCS, raylet, its agents, idle workers, ...) and helpers (``other: ...``:
    multiprocessing's resource tracker)."""
    import psutil
    out = []
    try:
        children = psutil.Process(serve_pid).children(recursive=True)
    except psutil.Error:
        return out
    for c in children:
        if c.pid in known:
            continue
        try:
            cmd = c.cmdline()
        except psutil.Error:
            continue
        if not cmd:
            continue
        if cmd[0].startswith("ray::"):
            name = cmd[0].split()[0]
        elif any(a.endswith(".py") for a in cmd[1:3]):
            name = os.path.basename(next(a for a in cmd[1:3] if a.endswith(".py")))
        elif "multiprocessing" in " ".join(cmd[1:4]):
            out.append(("other: multiprocessing helper", c.pid))
            continue
        else:
            name = os.path.basename(cmd[0])
        out.append((f"ray: {name}", c.pid))
    return out


def checked(role: str) -> bool:
    """Whether a process of ``role`` is the mesh's own (its growth is checked), not Ray's or a helper."""
    return not role.startswith(("ray:", "other:"))


def summarize(samples: list[dict], max_growth: float) -> tuple[list[dict], list[dict]]:
    """(the processes alive at the end, those that ended earlier) from the samples. For one alive
    at the end: its baseline (its first idle sample before the last) and end RSS, whole and
    outside its bounded caches, and growths; ``checked``: a mesh process (not Ray's own), whose
    growth outside the bounded caches must be <= ``max_growth`` %."""
    def mib(b):
        return None if b is None else round(b / 2**20, 1)

    def growth(a, b):
        return None if not a or b is None else round(100.0 * (b / a - 1.0), 2)

    last = samples[-1]
    alive, ended = [], []
    seen: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
    for s in samples:
        for p in s["processes"]:
            seen.setdefault((p["role"], p["pid"]), []).append((s, p))
    for (role, pid), rows in seen.items():
        first_s, first = rows[0]
        end_s, end = rows[-1]
        if end_s is not last:
            ended.append({"role": role, "pid": pid, "first_done": first_s["done"], "last_done": end_s["done"],
                          "rss_first_mib": mib(first["rss"]), "rss_last_mib": mib(end["rss"])})
            continue
        base_s, base = next(((s, p) for s, p in rows[:-1] if s["phase"].startswith("idle")), (None, None))

        def pair(key):
            return mib(base.get(key)) if base else None, mib(end.get(key))

        caches = (("KV pool", "kv_pool_bytes" in end), ("host tier", bool(end["host_tier_bytes"])),
                  ("Ray object store", bool(end.get("object_store_rss"))))
        row = {"role": role, "pid": pid, "checked": checked(role),
               "baseline": base_s["phase"] if base_s else None, "baseline_done": base_s["done"] if base_s else None,
               "rss_before_mib": mib(base["rss"]) if base else None, "rss_after_mib": mib(end["rss"]),
               "rss_growth_pct": growth(base["rss"], end["rss"]) if base else None,
               "bounded": ", ".join(name for name, on in caches if on) or None,
               "kv_pool_mib": mib(end.get("kv_pool_bytes")),
               "kv_pool_located": end.get("kv_pool_bytes") is None or (end["kv_pool_rss"] is not None and (
                   base is None or base["kv_pool_rss"] is not None)),
               "object_store_mib": mib(end.get("object_store_bytes"))}
        for key, name in (("kv_pool_rss", "kv_pool_rss"), ("host_tier_bytes", "host_tier"),
                          ("object_store_rss", "object_store_rss"), ("rss_anon", "rss_anon"), ("rss_file", "rss_file"),
                          ("rss_shmem", "rss_shmem"), ("rest", "rest")):
            row[f"{name}_before_mib"], row[f"{name}_after_mib"] = pair(key)
        row["rest_growth_pct"] = growth(base["rest"], end["rest"]) if base else None
        row["ok"] = not row["checked"] or (row["rest_growth_pct"] is not None
                                           and row["rest_growth_pct"] <= max_growth)
        alive.append(row)
    return alive, ended


# ---- the run --------------------------------------------------------------------------------------

async def _stats(sched_stub):
    from kvmesh.v1 import scheduler_pb2
    return await sched_stub.GetStats(scheduler_pb2.GetStatsRequest())


async def _idle(sched_stub, timeout: float = 60.0):
    """GetStats once no request runs or waits and no block is in use (or after ``timeout``)."""
    end = time.monotonic() + timeout
    while True:
        st = await _stats(sched_stub)
        if all(r.num_running == r.num_waiting == r.num_used_blocks == 0 for r in st.replicas) \
                or time.monotonic() > end:
            return st
        await asyncio.sleep(0.1)


COUNTERS = ("restarts", "num_preemptions", "num_cached_blocks", "prefix_cache_hits", "kv_tier_host_hits",
            "kv_tier_redis_hits", "kv_tier_blocks_offloaded", "kv_tier_unavailable", "kv_tier_integrity_failures",
            "kv_tier_host_bytes", "index_resyncs", "index_failures")


def _replica(r) -> dict:
    return {"replica": r.replica, "pid": r.pid, "stage_pids": list(r.stage_pids), "healthy": r.healthy,
            "num_running": r.num_running, "num_waiting": r.num_waiting, "num_used_blocks": r.num_used_blocks,
            "num_blocks": r.num_blocks, **{k: getattr(r, k) for k in COUNTERS}}


async def soak(address: str, sched_address: str, args, own_redis=None) -> dict:
    import grpc
    import psutil

    from bench import chaos
    from kvmesh.v1 import llm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
    kinds = plan(args.requests, args.seed)
    records: list[dict] = [None] * args.requests       # type: ignore[list-item]
    samples: list[dict] = []
    events: dict[str, dict] = {}
    state = {"done": 0, "inflight": 0, "warm": False, "redis": False, "kill": False, "rewarm_at": None,
             "rewarmed": False}
    gate = asyncio.Event()
    gate.set()
    chaos_tasks: dict[str, asyncio.Task] = {}
    t0 = time.monotonic()

    def now() -> float:
        return round(time.monotonic() - t0, 2)

    async with grpc.aio.insecure_channel(address) as ch, grpc.aio.insecure_channel(sched_address) as sch:
        await asyncio.wait_for(ch.channel_ready(), 60)
        stub, sched_stub = llm_pb2_grpc.LLMServiceStub(ch), scheduler_pb2_grpc.SchedulerServiceStub(sch)
        st = await _stats(sched_stub)
        engine_pids = [r.pid for r in st.replicas if r.pid]
        if not engine_pids:
            raise RuntimeError("GetStats shows no engine process (pid 0): run kvmesh serve with engine processes")
        block_size = (await sched_stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest())).block_size
        serve_pid = psutil.Process(engine_pids[0]).parent().pid
        if args.kill_stage_at and not st.replicas[0].stage_pids:
            raise RuntimeError("--kill-stage-at needs Ray pipeline stages (--serve-args '--pp 2 --executor ray')")
        runner = Soak(stub, args.seed)

        async def sample(done: int, phase: str) -> dict:
            st = await _stats(sched_stub)
            rows = [process_row("gateway + scheduler (kvmesh serve)", serve_pid)]
            known = {serve_pid}
            for r in st.replicas:
                pool = r.num_blocks * block_size * round(r.kv_cache_bytes_per_token)
                if r.pid:
                    rows.append(process_row(f"engine process (replica {r.replica})", r.pid,
                                            0 if r.stage_pids else pool, r.kv_tier_host_bytes))
                    known.add(r.pid)
                for i, pid in enumerate(r.stage_pids):
                    rows.append(process_row(f"stage {i} (replica {r.replica})", pid, pool // len(r.stage_pids)))
                    known.add(pid)
            rows += [process_row(role, pid) for role, pid in ray_processes(serve_pid, known)]
            row = {"done": done, "phase": phase, "t": now(), "processes": [r for r in rows if r is not None]}
            samples.append(row)
            print(f"  {done:5d} requests  {row['t']:7.1f} s  " + "  ".join(
                f"{p['role'].split(' (')[0]} {p['rss'] / 2**20:.0f}"
                + (f" (pool {p['kv_pool_rss'] / 2**20:.0f})" if p['kv_pool_rss'] is not None else "")
                + (f" (host tier {p['host_tier_bytes'] / 2**20:.0f})" if p['host_tier_bytes'] else "")
                + (f" (object store {p['object_store_rss'] / 2**20:.0f})" if p['object_store_rss'] else "")
                for p in row["processes"] if checked(p["role"])) + f" MiB  ({phase})", flush=True)
            return row

        async def pause_and_sample(phase: str) -> None:
            """Stop dispatching, wait for the server to be idle, sample, go on."""
            gate.clear()
            while state["inflight"]:
                await asyncio.sleep(0.05)
            await _idle(sched_stub)
            await asyncio.sleep(args.settle)
            await sample(state["done"], phase)
            gate.set()

        async def restart_redis() -> None:
            ev = events["redis_restart"] = {"done": state["done"], "pid": own_redis.proc.pid}
            await asyncio.to_thread(own_redis.kill)
            ev["t_down"] = now()
            print(f"  chaos: redis-server (pid {ev['pid']}) killed at {ev['done']} requests done", flush=True)
            await asyncio.sleep(args.redis_down)
            await asyncio.to_thread(own_redis.start)
            ev["t_up"], ev["new_pid"] = now(), own_redis.proc.pid
            print(f"  chaos: redis-server back on port {own_redis.port} (pid {ev['new_pid']}) after "
                  f"{ev['t_up'] - ev['t_down']:.1f} s", flush=True)

        async def kill_stage() -> None:
            if "redis" in chaos_tasks:           # one event at a time: a kill due while Redis is down waits
                await chaos_tasks["redis"]
            st = await _stats(sched_stub)
            r = st.replicas[0]
            victim = r.stage_pids[args.kill_stage_index]
            ev = events["stage_kill"] = {"replica": r.replica, "stage": args.kill_stage_index, "pid": victim,
                                         "done": state["done"], "in_flight": state["inflight"],
                                         "old_engine_pid": r.pid, "old_stage_pids": list(r.stage_pids),
                                         "before": _replica(r), "t_back": None}
            chaos.kill_stage(victim)
            ev["t_kill"] = now()
            print(f"  chaos: stage {args.kill_stage_index} of replica {r.replica} (pid {victim}) killed at "
                  f"{ev['done']} requests done, {ev['in_flight']} in flight", flush=True)
            back = await chaos.wait_replica_back(lambda: _stats(sched_stub), r.replica, r.pid, list(r.stage_pids),
                                                 r.restarts, timeout=args.restart_timeout)
            if back is None:
                print(f"  chaos: replica {r.replica} not back within {args.restart_timeout:g} s", flush=True)
                return
            ev.update(t_back=now(), done_back=state["done"], new_engine_pid=back.pid,
                      new_stage_pids=list(back.stage_pids))
            ev["down_s"] = round(ev["t_back"] - ev["t_kill"], 2)
            state["rewarm_at"] = state["done"] + args.rewarm
            print(f"  chaos: replica {r.replica} back after {ev['down_s']:.1f} s (engine pid {back.pid}, stages "
                  f"{list(back.stage_pids)}) at {state['done']} requests done", flush=True)

        async def after(done: int) -> None:
            sampled = False
            if not state["warm"] and done >= args.warmup:
                state["warm"] = sampled = True
                await pause_and_sample("idle after warm-up")
            if args.restart_redis_at and not state["redis"] and done >= args.restart_redis_at:
                state["redis"] = True
                chaos_tasks["redis"] = asyncio.create_task(restart_redis())
            if args.kill_stage_at and not state["kill"] and done >= args.kill_stage_at:
                state["kill"] = True
                chaos_tasks["kill"] = asyncio.create_task(kill_stage())
            if state["rewarm_at"] is not None and not state["rewarmed"] and done >= state["rewarm_at"]:
                state["rewarmed"] = sampled = True
                await pause_and_sample("idle after the restart's warm-up")
            if done % args.sample_every == 0 and done < args.requests and not sampled:
                await sample(done, "running")

        it = iter(range(args.requests))

        async def worker() -> None:
            while True:
                await gate.wait()
                i = next(it, None)
                if i is None:
                    return
                state["inflight"] += 1
                start = time.monotonic() - t0
                try:
                    outcome, detail, tokens, hint = await runner.one(kinds[i], f"soak-{i}")
                finally:
                    state["inflight"] -= 1
                records[i] = {"i": i, "kind": kinds[i], "outcome": outcome, "detail": detail[:300],
                              "tokens": tokens, "retry_hint": hint, "t0": round(start, 3),
                              "t1": round(time.monotonic() - t0, 3)}
                state["done"] += 1
                await after(state["done"])

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        for t in chaos_tasks.values():      # a restart still being followed
            await t
        await _idle(sched_stub)
        await asyncio.sleep(args.settle)
        final = await _stats(sched_stub)
        await sample(args.requests, "idle at the end")
    wall = time.monotonic() - t0

    kill = events.get("stage_kill")
    counts: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
    unexpected: list[dict] = []
    why = collections.Counter()
    window: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
    redis_window: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
    hints = collections.Counter()
    by = {"kill": collections.Counter(), "redis": collections.Counter()}     # window -> reason -> requests
    red = events.get("redis_restart")
    for rec in records:
        counts[rec["kind"]][rec["outcome"]] += 1
        reason = expected(rec, kill, args.restart_wait)
        why[reason or "unexpected"] += 1
        if reason is None:
            unexpected.append(rec)
        back = kill["t_back"] if kill and kill["t_back"] is not None else 1e18
        if kill and rec["t0"] <= back and rec["t1"] >= kill["t_kill"]:
            window[rec["kind"]][rec["outcome"]] += 1
            by["kill"][reason or "unexpected"] += 1
        if red and "t_up" in red and rec["t0"] <= red["t_up"] and rec["t1"] >= red["t_down"]:
            redis_window[rec["kind"]][rec["outcome"]] += 1
            by["redis"][reason or "unexpected"] += 1
        if rec["outcome"] == "UNAVAILABLE":
            hints["with retry hint" if rec["retry_hint"] else "without"] += 1
    alive, ended = summarize(samples, args.max_growth)
    reps = [_replica(r) for r in final.replicas]
    chaos_ok = ((not args.restart_redis_at or (red is not None and "t_up" in red))
                and (not args.kill_stage_at or (kill is not None and kill["t_back"] is not None)))
    no_baseline = [p["role"] for p in alive if p["checked"] and p["rest_growth_pct"] is None]
    return {
        "requests": args.requests, "concurrency": args.concurrency, "warmup": args.warmup, "rewarm": args.rewarm,
        "settle_s": args.settle, "seed": args.seed, "wall_s": round(wall, 1),
        "outcomes": {k: dict(v) for k, v in counts.items()},
        "expected_rule": EXPECTED_RULE, "restart_wait": args.restart_wait,
        "unexpected": len(unexpected), "unexpected_examples": unexpected[:20], "expected_by": dict(why),
        "unavailable_retry_hints": dict(hints),
        "chaos": events, "chaos_ok": chaos_ok,
        # requests open during each event, their outcomes and why each was expected (kind, cut, waited)
        "kill_window": {"requests": sum(sum(c.values()) for c in window.values()),
                        "outcomes": {k: dict(v) for k, v in window.items() if v}, "expected_by": dict(by["kill"])},
        "redis_window": {"requests": sum(sum(c.values()) for c in redis_window.values()),
                         "outcomes": {k: dict(v) for k, v in redis_window.items() if v},
                         "expected_by": dict(by["redis"])},
        "replicas": reps, "used_blocks_after": sum(r["num_used_blocks"] for r in reps),
        "max_growth_pct": args.max_growth, "processes": alive, "ended_processes": ended,
        "no_baseline": no_baseline,
        "rss_ok": not no_baseline and all(p["ok"] for p in alive),
        "samples": samples,
    }


def _restart_wait(serve_args: list[str]) -> float:
    """The scheduler's ``--restart-wait`` in ``serve_args`` (else its default)."""
    from kvmesh.core.service_config import SchedulerConfig
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--restart-wait", type=float, default=SchedulerConfig().restart_wait)
    return p.parse_known_args(serve_args)[0].restart_wait


def report(r: dict) -> str:
    """The run's summary as text."""
    lines = [f"  {kind:9s} " + ", ".join(f"{o} {n}" for o, n in sorted(c.items())) for kind, c in r["outcomes"].items()]
    lines.append(f"unexpected outcomes: {r['unexpected']} (expected by: {r['expected_by']}); KV blocks in use "
                 f"after: {r['used_blocks_after']}; {r['wall_s']} s")
    if "stage_kill" in r["chaos"]:
        k = r["chaos"]["stage_kill"]
        lines.append(f"stage kill: stage {k['stage']} (pid {k['pid']}) at {k['done']} done, back after "
                     f"{k.get('down_s')} s; kill window {r['kill_window']['requests']} requests: "
                     f"{r['kill_window']['outcomes']}")
    if "redis_restart" in r["chaos"]:
        k = r["chaos"]["redis_restart"]
        lines.append(f"redis restart at {k['done']} done, down {k.get('t_up', 0) - k.get('t_down', 0):.1f} s; "
                     f"{r['redis_window']['requests']} requests open meanwhile: {r['redis_window']['outcomes']}")
    lines.append(f"UNAVAILABLE: {r['unavailable_retry_hints'] or 'none'}")
    for p in r["processes"]:
        if not p["checked"]:
            continue
        bounded = (f"; outside {p['bounded']} {p['rest_before_mib']} -> {p['rest_after_mib']} MiB "
                   f"({p['rest_growth_pct']} %)") if p["bounded"] else ""
        lines.append(f"{p['role']} pid {p['pid']}: RSS {p['rss_before_mib']} -> {p['rss_after_mib']} MiB "
                     f"({p['rss_growth_pct']} %, baseline: {p['baseline']}){bounded}"
                     + ("" if p["kv_pool_located"] else " [KV pool not located: the whole RSS counts]")
                     + ("" if p["ok"] else "  ** over the limit or no baseline **"))
    ray = [p for p in r["processes"] if not p["checked"]]
    if ray:
        lines.append("not checked: " + ", ".join(f"{p['role']} {p['rss_before_mib']} -> {p['rss_after_mib']} MiB"
                                                 for p in ray))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = command.parser(__doc__, prog="python -m bench.soak")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=200, help="requests before the first idle RSS sample (200)")
    p.add_argument("--rewarm", type=int, default=200,
                   help="requests after a killed replica is back before the restarted processes' idle RSS sample (200)")
    p.add_argument("--sample-every", type=int, default=200, help="an RSS sample every this many requests (200)")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds an idle sample waits once the server is idle (3; the engine process gives freed "
                        "memory back after 1 s idle)")
    p.add_argument("--max-growth", type=float, default=5.0,
                   help="RSS growth allowed outside the bounded caches after the baseline, %% (5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", help="a running gateway (host:port) instead of starting kvmesh serve")
    p.add_argument("--scheduler-address", help="its scheduler (host:port), with --address")
    p.add_argument("--serve-args", default="", help="extra arguments of kvmesh serve (one string)")
    p.add_argument("--server-log", help="write kvmesh serve's stderr to this file")
    chaos = p.add_argument_group("chaos")
    chaos.add_argument("--own-redis", action="store_true",
                       help="start a redis-server of the soak's own on a free port (no persistence) and serve with "
                            "it as the KV tier (--kv-offload-redis-url) and the prefix index (--redis-url)")
    chaos.add_argument("--restart-redis-at", type=int, default=0, metavar="N",
                       help="kill the own redis-server (SIGKILL) once N requests are done, start it again on the "
                            "same port --redis-down seconds later (0: never)")
    chaos.add_argument("--redis-down", type=float, default=3.0, metavar="S", help="seconds Redis stays down (3)")
    chaos.add_argument("--kill-stage-at", type=int, default=0, metavar="N",
                       help="SIGKILL a Ray pipeline stage of replica 0 once N requests are done (0: never)")
    chaos.add_argument("--kill-stage-index", type=int, default=0, metavar="K", help="which stage (0)")
    chaos.add_argument("--restart-timeout", type=float, default=300.0, metavar="S",
                       help="seconds to wait for the killed replica to be back (300)")
    add_output_args(p, table=False)
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be >= 1")
    if bool(args.address) != bool(args.scheduler_address):
        p.error("--address and --scheduler-address go together")
    if args.own_redis and args.address:
        p.error("--own-redis starts the server's Redis: not with --address")
    if args.restart_redis_at and not args.own_redis:
        p.error("--restart-redis-at restarts the soak's own Redis: add --own-redis")
    for name in ("restart_redis_at", "kill_stage_at"):
        at = getattr(args, name)
        if at and not args.warmup < at < args.requests:
            p.error(f"--{name.replace('_', '-')} must be between --warmup ({args.warmup}) and --requests")
    serve_args = shlex.split(args.serve_args)
    if args.own_redis and {"--redis-url", "--kv-offload-redis-url"} & set(serve_args):
        p.error("--own-redis sets --redis-url and --kv-offload-redis-url itself")
    args.restart_wait = _restart_wait(serve_args)
    cmd = "python -m bench.soak " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"soak: {args.requests} requests, concurrency {args.concurrency}, {cpu_model()}", flush=True)
    own_redis = None
    try:
        if args.address:
            result = asyncio.run(soak(args.address, args.scheduler_address, args))
        else:
            from bench.chaos import OwnRedis
            from bench.served import served
            if args.own_redis:
                own_redis = OwnRedis()
                own_redis.start()
                serve_args += ["--kv-offload-redis-url", own_redis.url, "--redis-url", own_redis.url]
                print(f"soak: own redis-server at {own_redis.url}", flush=True)
            addresses: dict = {}
            env = dict(os.environ, RAY_AUTH_MODE="disabled")
            with served(["serve", "--model", args.model, "--port", "0", "--scheduler-port", "0", *serve_args], env,
                        "gateway", addresses, log=args.server_log) as address:
                result = asyncio.run(soak(address, addresses["scheduler"], args, own_redis))
    finally:
        if own_redis is not None:
            own_redis.stop()
    result = {"command": cmd.strip(), "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
              "serve_args": serve_args, **result}
    print(report(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    ok = (result["unexpected"] == 0 and result["used_blocks_after"] == 0 and result["chaos_ok"] and result["rss_ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
