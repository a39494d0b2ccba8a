"""``kvmesh bench serve`` (bench/serve/): metrics from synthetic timelines (hand-computed),
the arrival process, max-concurrency, multi-turn sessions (fake backends), the openai-chat backend
against a real aiohttp SSE server on loopback, data sets and workload files, and one smoke run of
the command against a real mesh (``kvmesh serve`` subprocess, SmolLM2, executor local)."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from aiohttp import web

from bench.serve.backends import kvmesh_request
from bench.serve.load import arrival_times, run_benchmark
from bench.serve.metrics import benchmark_duration, parse_goodput, report, RequestRecord, StreamTimer, summarize
from bench.serve.plots import plot_sweep, plot_ttft
from bench.serve.workload import BenchRequest, load_requests, load_workload, save_workload
from kvmesh.core.errors import EngineError

MODEL = "smollm2-135m-instruct"


# ---- per-request metrics --------------------------------------------------------------------------

def test_stream_timer_multi_token_chunks():
    """Send at 10.0; chunks at 10.1 (1 token), 10.15 (2 tokens: one gap, as vLLM), 10.25 (1 token);
    end at 10.3; 4 output tokens."""
    t = StreamTimer(now=10.0)
    for at in (10.1, 10.15, 10.25):
        t.chunk(now=at)
    rec = t.done(RequestRecord(id="r"), text="abcd", output_tokens=4, prompt_tokens=7, cached_tokens=5, now=10.3)
    assert rec.success and rec.error == ""
    assert rec.ttft == pytest.approx(0.1)
    assert rec.itl == pytest.approx([0.05, 0.1])
    assert rec.e2el == pytest.approx(0.3)
    assert rec.tpot == pytest.approx(0.2 / 3)            # (E2EL - TTFT) / (4 - 1)
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens, rec.start_time) == (4, 7, 5, 10.0)


def test_stream_timer_without_tokens_is_a_failure():
    t = StreamTimer(now=0.0)
    rec = t.done(RequestRecord(id="r"), text="", output_tokens=0, now=1.0)
    assert not rec.success and "no output tokens" in rec.error and rec.tpot is None
    one = StreamTimer(now=0.0)
    one.chunk(now=0.2)
    rec = one.done(RequestRecord(id="s"), text="x", output_tokens=1, now=0.3)
    assert rec.success and rec.tpot is None and rec.itl == []


def _rec(id, ttft, e2el, out, prompt, itl=(), ok=True, start=0.0, cached=0):
    return RequestRecord(id=id, prompt_tokens=prompt, output_tokens=out, ttft=ttft, itl=list(itl), e2el=e2el,
                         success=ok, error="" if ok else "boom", cached_tokens=cached, start_time=start)


RECORDS = [
    _rec("a", 0.1, 0.5, 4, 10, itl=(0.1, 0.2, 0.1), cached=5),
    _rec("b", 0.2, 0.3, 1, 20),
    _rec("c", 0.4, 0.8, 3, 30, itl=(0.1, 0.3), start=1.0, cached=15),
    _rec("d", 9.0, 9.0, 50, 100, ok=False, start=0.5),          # failed: excluded from every aggregate
]


def test_summarize_hand_computed():
    s = summarize(RECORDS, 2.0, percentiles=(50, 90, 99.9))
    assert (s["completed"], s["failed"], s["duration"]) == (3, 1, 2.0)
    assert (s["total_input_tokens"], s["total_output_tokens"], s["total_cached_tokens"]) == (60, 8, 20)
    assert s["prefix_cache_hit_rate"] == pytest.approx(20 / 60)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(34.0)
    # TTFT 100, 200, 400 ms: p90 at rank 1.8 -> 200 + 0.8 x 200
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["p50_ttft_ms"] == pytest.approx(200)
    assert s["p90_ttft_ms"] == pytest.approx(360)
    assert s["p99.9_ttft_ms"] == pytest.approx(200 + 0.998 * 200)
    # TPOT only over requests with 2+ tokens: 400/3 and 400/2 ms
    assert s["mean_tpot_ms"] == pytest.approx((400 / 3 + 200) / 2)
    # ITL: every gap of every successful request: 100, 200, 100, 100, 300
    assert s["mean_itl_ms"] == pytest.approx(160)
    assert s["median_itl_ms"] == pytest.approx(100)
    assert s["p90_itl_ms"] == pytest.approx(200 + 0.6 * 100)      # rank 3.6 of [100,100,100,200,300]
    assert s["mean_e2el_ms"] == pytest.approx(1600 / 3)
    assert s["request_goodput"] is None


def test_goodput_slos():
    # ttft <= 300 and tpot <= 150: a (100, 133) good, b (200, one token = 0) good, c (400) not
    s = summarize(RECORDS, 2.0, goodput_slos={"ttft": 300, "tpot": 150})
    assert s["request_goodput"] == pytest.approx(1.0)
    # + e2el <= 450: a (500) fails too
    s = summarize(RECORDS, 2.0, goodput_slos=parse_goodput(["ttft:300", "tpot:150", "e2el:450"]))
    assert s["request_goodput"] == pytest.approx(0.5)
    # tpot <= 150 alone: a 133 good, b good, c 200 not
    assert summarize(RECORDS, 2.0, goodput_slos={"tpot": 150})["request_goodput"] == pytest.approx(1.0)


def test_duration_from_records_and_empty_metrics():
    assert benchmark_duration(RECORDS) == pytest.approx(9.5)     # d: start 0.5 + e2el 9.0
    s = summarize(RECORDS[3:], None)
    assert s["completed"] == 0 and s["failed"] == 1 and s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert "-" in report(s, (50, 99))


@pytest.mark.parametrize("items", [["ttft"], ["ttft:0"], ["latency:10"], ["tpot:x"]])
def test_parse_goodput_rejects(items):
    with pytest.raises(EngineError, match="goodput"):
        parse_goodput(items)


# ---- arrivals and concurrency ---------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_gamma(burstiness):
    """Gaps of mean 1/rate; coefficient of variation 1/sqrt(burstiness) (1: Poisson). Seeded, 20k gaps:
    the sample statistics are within 3% (their standard errors are below 1%)."""
    t = arrival_times(20001, 4.0, burstiness, np.random.default_rng(123))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)


def test_arrivals_inf_and_bad_values():
    assert np.array_equal(arrival_times(5, float("inf")), np.zeros(5))
    with pytest.raises(EngineError, match="request_rate"):
        arrival_times(3, 0.0)
    with pytest.raises(EngineError, match="burstiness"):
        arrival_times(3, 1.0, 0.0)


class FakeBackend:
    """A ``send`` that streams ``chunks`` fake tokens, yielding to the loop between them, and logs
    what it sees: requests in flight (max), each request's messages, start/end events."""

    def __init__(self, chunks: int = 3, fail: set[str] = frozenset()):
        self.chunks, self.fail = chunks, fail
        self.in_flight = self.max_in_flight = 0
        self.events: list[tuple[str, str]] = []
        self.seen: dict[str, BenchRequest] = {}

    async def __call__(self, req: BenchRequest, sampling: dict) -> RequestRecord:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.events.append(("start", req.id))
        self.seen[req.id] = req
        timer = StreamTimer()
        try:
            for _ in range(self.chunks):
                await asyncio.sleep(0.001)
                timer.chunk()
            await asyncio.sleep(0.001)
            if req.id in self.fail:
                return timer.failed(RequestRecord(id=req.id), "fake failure")
            return timer.done(RequestRecord(id=req.id, session_id=req.session_id), text=f"answer to {req.id}",
                              output_tokens=self.chunks, prompt_tokens=len(req.messages or []))
        finally:
            self.events.append(("end", req.id))
            self.in_flight -= 1


def _single(n: int) -> list[BenchRequest]:
    return [BenchRequest(id=f"q{i}", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=3)
            for i in range(n)]


@pytest.mark.parametrize("limit", [1, 3])
async def test_max_concurrency_never_exceeded(limit):
    fake = FakeBackend()
    recs = await run_benchmark(fake, "", _single(12), max_concurrency=limit, progress=False)
    assert fake.max_in_flight == limit                   # reached (all arrive at t=0) and never exceeded
    assert [r.id for r in recs] == [f"q{i}" for i in range(12)] and all(r.success for r in recs)
    unlimited = FakeBackend()
    await run_benchmark(unlimited, "", _single(12), progress=False)
    assert unlimited.max_in_flight == 12


async def test_requests_are_sent_no_earlier_than_their_arrival():
    fake = FakeBackend(chunks=1)
    recs = await run_benchmark(fake, "", _single(8), request_rate=200.0, burstiness=0.5, seed=7,
                                     progress=False)
    planned = arrival_times(8, 200.0, 0.5, np.random.default_rng(7))
    starts = [r.start_time for r in recs]
    assert all(s >= p - 1e-6 for s, p in zip(starts, planned))
    assert starts == sorted(starts)
    assert [e for e in fake.events if e[0] == "start"] == [("start", f"q{i}") for i in range(8)]


async def test_sessions_send_next_turn_after_the_answer_with_it_in_history():
    reqs = [BenchRequest(id=f"s{i}", messages=[{"role": "system", "content": f"policy {i}"}],
                         turns=["first?", "second?", "third?"], max_tokens=3) for i in range(3)]
    fake = FakeBackend()
    recs = await run_benchmark(fake, "", reqs, max_concurrency=2, progress=False)
    assert len(recs) == 9 and all(r.success for r in recs)
    for i in range(3):
        ids = [f"s{i}/{k}" for k in range(3)]
        assert [r.id for r in recs if r.id.startswith(f"s{i}/")] == ids
        assert [r.turn for r in recs if r.id.startswith(f"s{i}/")] == [0, 1, 2]
        for k in (1, 2):                     # turn k starts only after turn k-1 ended
            assert fake.events.index(("end", ids[k - 1])) < fake.events.index(("start", ids[k]))
        assert fake.seen[ids[2]].messages == [
            {"role": "system", "content": f"policy {i}"},
            {"role": "user", "content": "first?"}, {"role": "assistant", "content": f"answer to s{i}/0"},
            {"role": "user", "content": "second?"}, {"role": "assistant", "content": f"answer to s{i}/1"},
            {"role": "user", "content": "third?"}]
        assert {fake.seen[x].session_id for x in ids} == {f"s{i}"}
    # sessions interleave: the three first turns all start before any third turn
    starts = [e[1] for e in fake.events if e[0] == "start"]
    assert max(starts.index(f"s{i}/0") for i in range(3)) < min(starts.index(f"s{i}/2") for i in range(3))


async def test_failed_turn_ends_its_session():
    reqs = [BenchRequest(id="s", messages=[], turns=["a", "b", "c"])]
    fake = FakeBackend(fail={"s/1"})
    recs = await run_benchmark(fake, "", reqs, progress=False)
    assert [(r.id, r.success) for r in recs] == [("s/0", True), ("s/1", False), ("s/2", False)]
    assert "s/2" not in fake.seen and recs[2].error == "not sent: turn 1 failed"
    assert summarize(recs)["failed"] == 2


# ---- the openai-chat backend against a real HTTP server ------------------------------------------

async def _sse_server(bodies: list[dict]):
    """A loopback OpenAI-style server: /v1/models, streaming /v1/chat/completions (4 content
    chunks, one of them empty, then finish, usage, [DONE]); model "boom" answers HTTP 500."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        bodies.append(body)
        if body["model"] == "boom":
            return web.Response(status=500, text="model exploded")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj):
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            await asyncio.sleep(0.005)

        base = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"]}
        await event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for piece in ("Hel", "lo", " world"):
            await event({**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        await event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        await event({**base, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5,
                                                      "prompt_tokens_details": {"cached_tokens": 8}}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/v1"


async def test_openai_chat_backend_over_http():
    bodies: list[dict] = []
    runner, url = await _sse_server(bodies)
    try:
        reqs = [BenchRequest(id="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5),
                BenchRequest(id="p", prompt="random text", prompt_token_ids=[1, 2, 3], max_tokens=2)]
        recs = await run_benchmark("openai-chat", url, reqs, ignore_eos=True, progress=False)
        for r in recs:
            assert r.success, r.error
            assert r.text == "Hello world" and r.finish_reason == "stop"
            assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (5, 12, 8)    # from usage
            assert len(r.itl) == 2 and all(g > 0 for g in r.itl)     # 3 content chunks, the empty one not counted
            assert 0 < r.ttft < r.e2el
        m, p = sorted(bodies, key=lambda b: b["max_tokens"], reverse=True)
        assert m["model"] == "fake-model"                             # discovered from /v1/models
        assert m["messages"] == [{"role": "user", "content": "hi"}] and m["max_tokens"] == 5
        assert m["stream"] is True and m["stream_options"] == {"include_usage": True}
        assert m["ignore_eos"] is True and m["temperature"] == 0.0 and "seed" not in m
        assert p["messages"] == [{"role": "user", "content": "random text"}]
        bad = await run_benchmark("openai-chat", url, reqs[:1], model="boom", progress=False)
        assert not bad[0].success and "HTTP 500" in bad[0].error and "model exploded" in bad[0].error
    finally:
        await runner.cleanup()


async def test_unreachable_backends_raise():
    with pytest.raises(EngineError, match="backend"):
        await run_benchmark("tgi", "x", _single(1), progress=False)
    with pytest.raises(ConnectionError, match="--model"):
        await run_benchmark("openai-chat", "http://127.0.0.1:9/v1", _single(1), progress=False)


# ---- data sets and workload files -----------------------------------------------------------------

def test_policydesk_datasets():
    qs = load_requests("policydesk", num_prompts=None, seed=0, max_tokens=64)
    assert len(qs) == 96 and len({q.id for q in qs}) == 96
    q = qs[0]
    assert [m["role"] for m in q.messages] == ["system", "user"] and q.max_tokens == 64
    assert q.messages[1]["content"] == q.info["question"] and "reference_answer" in q.info
    assert q.messages[0]["content"].startswith("You are PolicyDesk")
    again = load_requests("policydesk", num_prompts=100, seed=0, max_tokens=64)
    assert [r.id for r in again[:96]] == [r.id for r in qs] and again[96].id.endswith("#1")
    other = load_requests("policydesk", num_prompts=96, seed=1, max_tokens=64)
    assert [r.id for r in other] != [r.id for r in qs] and {r.id for r in other} == {r.id for r in qs}
    chats = load_requests("policydesk-chat", num_prompts=None, seed=0, max_tokens=64)
    assert len(chats) == 24 and sum(c.num_requests for c in chats) == 116
    c = chats[0]
    assert [m["role"] for m in c.messages] == ["system"] and c.session_id == c.id
    assert c.turns == [t["user"] for t in c.info["turns"]]
    with pytest.raises(EngineError, match="dataset"):
        load_requests("sharegpt", num_prompts=1, seed=0, max_tokens=1)


def test_random_dataset_lengths(smollm2_tokenizer):
    reqs = load_requests("random", num_prompts=50, seed=3, max_tokens=1, random_input_len=40,
                               random_output_len=10, random_range_ratio=0.5, tokenizer=smollm2_tokenizer)
    special = set(smollm2_tokenizer.all_special_ids)
    ins = [len(r.prompt_token_ids) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 60 and len(set(ins)) > 5
    assert min(outs) >= 5 and max(outs) <= 15
    assert not special & {i for r in reqs for i in r.prompt_token_ids}
    assert reqs[0].prompt == smollm2_tokenizer.decode(reqs[0].prompt_token_ids) and reqs[0].messages is None
    fixed = load_requests("random", num_prompts=4, seed=3, max_tokens=1, random_input_len=16,
                                random_output_len=4, tokenizer=smollm2_tokenizer)
    assert {len(r.prompt_token_ids) for r in fixed} == {16} and {r.max_tokens for r in fixed} == {4}


def test_workload_round_trip(tmp_path):
    reqs = load_requests("policydesk", num_prompts=3, seed=0, max_tokens=32)
    reqs += [BenchRequest(id="tok", prompt="x y", prompt_token_ids=[5, 6], max_tokens=4)]
    path = tmp_path / "w.jsonl"
    save_workload(path, reqs)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert set(lines[0]) == {"id", "messages", "max_tokens", "info"} and lines[0]["max_tokens"] == 32
    assert lines[3] == {"id": "tok", "prompt": "x y", "prompt_token_ids": [5, 6], "max_tokens": 4}
    assert load_workload(path) == reqs
    assert [r.id for r in load_workload(path, 2)] == [r.id for r in reqs[:2]]
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "max_tokens": 3}\n')
    with pytest.raises(EngineError, match="needs messages"):
        load_workload(tmp_path / "bad.jsonl")


def test_plots_write_pngs(tmp_path):
    plot_ttft({"1 req/s": RECORDS, "inf req/s": RECORDS[:2]}, tmp_path / "ttft.png")
    rows = [{"request_rate": r, **summarize(RECORDS, d)} for r, d in ((1.0, 4.0), (float("inf"), 2.0))]
    plot_sweep(rows, tmp_path / "sweep.png")
    for name in ("ttft.png", "sweep.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_command_lines_exit_2(capsys):
    from kvmesh import cli
    assert cli.main(["bench", "serve", "--backend", "openai-chat", "--save-workload", "/dev/null",
                     "--dataset", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--backend", "openai-chat", "--base-url", "http://127.0.0.1:1/v1",
                     "--dtype", "float32", "--num-prompts", "1"]) == 2
    assert "--dtype: engine/scheduler settings start a mesh; not with --base-url" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--address", "127.0.0.1:1", "--dtype", "float32", "--num-prompts", "1"]) == 2
    assert "--dtype: engine/scheduler settings start a mesh" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--goodput", "ttft", "--num-prompts", "1"]) == 2
    assert "goodput" in capsys.readouterr().err


# ---- smoke run against a real mesh -----------------------------------------------------------------

@pytest.mark.mesh
def test_bench_serve_against_a_real_mesh(tmp_path, smollm2_tokenizer, monkeypatch, capsys):
    """``kvmesh bench serve`` starts a mesh (``kvmesh serve --executor local``, SmolLM2) and replays a
    workload file: a token-id prompt (Generate), a chat (Chat) and a two-turn session; 4 tokens
    each, EOS ignored. The JSON has the summary, records and texts; the TTFT plot is a PNG."""
    for k in [k for k in list(__import__("os").environ) if k.startswith(("KVMESH_SCHEDULER_", "KVMESH_GATEWAY_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVMESH_NUM_THREADS", "1")
    system = ("You are a concise assistant for a small bakery. Answer questions about opening hours, bread, "
              "cakes and prices in one short sentence.")
    work = [BenchRequest(id="ids", prompt_token_ids=smollm2_tokenizer.encode("The capital of France is"),
                         max_tokens=4),
            BenchRequest(id="chat", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4),
            BenchRequest(id="sess", messages=[{"role": "system", "content": system}],
                         turns=["When do you open?", "And on Sundays?"], max_tokens=4)]
    wl, out, plots = tmp_path / "w.jsonl", tmp_path / "r.json", tmp_path / "plots"
    save_workload(wl, work)
    from kvmesh import cli
    rc = cli.main(["bench", "serve", "--workload", str(wl), "--model", MODEL, "--executor", "local",
                   "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                   "--ignore-eos", "--request-rate", "50", "--max-concurrency", "2", "--goodput", "ttft:600000",
                   "--out", str(out), "--save-detailed", "--save-texts", "--plot-dir", str(plots),
                   "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err[-3000:]
    assert "kvmesh, 50 req/s" in printed.out and "Mean TTFT (ms)" in printed.out
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["total_output_tokens"] == 16 and res["request_goodput"] == pytest.approx(res["request_throughput"])
    for key in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                "median_e2el_ms", "output_throughput", "total_token_throughput", "duration"):
        assert res[key] > 0, key
    assert res["config"]["request_rate"] == 50.0 and res["config"]["workload"] == str(wl)
    recs = {r["id"]: r for r in res["records"]["50 req/s"]}
    assert set(recs) == {"ids", "chat", "sess/0", "sess/1"}
    assert all(r["output_tokens"] == 4 and len(r["itl"]) >= 1 and r["text"] for r in recs.values())
    assert recs["ids"]["prompt_tokens"] == len(work[0].prompt_token_ids)
    s0, s1 = recs["sess/0"], recs["sess/1"]
    assert s1["start_time"] >= s0["start_time"] + s0["e2el"]
    # turn 2 = turn 1's prompt + its answer + the new question; its prefix comes from the cache
    assert s1["prompt_tokens"] > s0["prompt_tokens"] + 4 and s1["cached_tokens"] >= 16
    assert (plots / "ttft.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.mesh
def test_bench_serve_openai_chat_against_kvmesh_http(tmp_path, monkeypatch, capsys):
    """``kvmesh bench serve --backend openai-chat`` without ``--base-url`` starts a mesh with its
    OpenAI-compatible HTTP API (``--http-port 0``) and streams chat completions to it: a chat and a
    two-turn session, 4 tokens each, EOS ignored; usage (with cached prompt tokens) comes back."""
    for k in [k for k in list(__import__("os").environ) if k.startswith(("KVMESH_SCHEDULER_", "KVMESH_GATEWAY_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVMESH_NUM_THREADS", "1")
    system = ("You are a concise assistant for a small bakery. Answer questions about opening hours, bread, "
              "cakes and prices in one short sentence.")
    work = [BenchRequest(id="chat", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4),
            BenchRequest(id="sess", messages=[{"role": "system", "content": system}],
                         turns=["When do you open?", "And on Sundays?"], max_tokens=4)]
    wl, out = tmp_path / "w.jsonl", tmp_path / "r.json"
    save_workload(wl, work)
    from kvmesh import cli
    rc = cli.main(["bench", "serve", "--backend", "openai-chat", "--workload", str(wl), "--model", MODEL,
                   "--executor", "local", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                   "--ignore-eos", "--max-concurrency", "2", "--out", str(out), "--save-detailed",
                   "--save-texts", "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err[-3000:]
    assert "--http-port 0" in printed.err and "openai-chat at http://127.0.0.1:" in printed.err
    assert "openai-chat, inf req/s" in printed.out
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and res["failed"] == 0 and res["total_output_tokens"] == 12
    recs = {r["id"]: r for r in res["records"]["inf req/s"]}
    assert set(recs) == {"chat", "sess/0", "sess/1"}
    assert all(r["output_tokens"] == 4 and r["text"] and r["finish_reason"] == "length" for r in recs.values())
    s0, s1 = recs["sess/0"], recs["sess/1"]
    assert s1["prompt_tokens"] > s0["prompt_tokens"] + 4 and s1["cached_tokens"] >= 16


@pytest.mark.parametrize("timeout, expect", [(None, False), (3600, True)])
async def test_kvmesh_request_timeout_sets_the_rpc_deadline(timeout, expect):
    """``request_timeout`` becomes the request's ``timeout`` field (the gateway's deadline,
    queueing included); unset leaves the gateway's default."""
    sent = []

    class Stub:
        def Chat(self, request):
            sent.append(request)

            async def stream():
                return
                yield
            return stream()

    req = BenchRequest(id="q", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    await kvmesh_request(Stub(), req, {"temperature": 0.0, "ignore_eos": True, "seed": None,
                                             "timeout": timeout})
    assert sent[0].HasField("timeout") is expect
    if expect:
        assert sent[0].timeout.seconds == 3600
    assert sent[0].sampling.max_tokens == 2 and sent[0].sampling.ignore_eos


def test_serving_variants_pass_their_flags_and_get_ratios():
    """bench.serving's ``kvmesh:FLAG=VALUE`` systems: the flags reach `kvmesh serve`, and each
    variant gets its own ratio line against vLLM."""
    from bench.serving import _extra_args, _ratios
    assert _extra_args("kvmesh:max-prefill-tokens-with-decodes=256:no-compile") == [
        "--max-prefill-tokens-with-decodes", "256", "--no-compile"]
    assert _extra_args("kvmesh-thread") == ["--no-engine-process"]
    row = lambda tps: {"output_throughput": tps, "p90_ttft_ms": 100.0, "median_tpot_ms": 20.0}
    lines = _ratios({"kvmesh": row(120.0), "kvmesh:x=1": row(150.0), "vllm": row(100.0)})
    assert lines == ["kvmesh / vllm: output tok/s 1.20x, TTFT p90 1.00x, TPOT p50 1.00x",
                     "kvmesh:x=1 / vllm: output tok/s 1.50x, TTFT p90 1.00x, TPOT p50 1.00x"]
