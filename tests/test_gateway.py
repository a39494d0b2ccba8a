"""The public gateway over real gRPC on loopback, in front of a real scheduler service (local
executor, SmolLM2-135M in float32), both on one background event loop; clients are sync stubs.

Two gateways share the scheduler: ``gw`` with the default ``max_tokens_cap`` and ``gw_cap`` with
a cap of 5 tokens (default max_tokens 3), so the cap is tested with few decode steps. The offline
``kvmesh.LLM`` on the same checkpoint is the reference for tokens and text. A fake scheduler
(GetModelInfo copied from the real one) covers status pass-through, a vanished scheduler and
``GatewayServer.stop`` with a stream in flight.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MAX_MODEL_LEN = 256
KV_MEMORY = 48 * 2**20          # SmolLM2 fp32: 68 blocks of 16 tokens
CAP, CAP_DEFAULT = 5, 3
PROMPT = "The history of the printing press begins"
KOREAN = ("User: Say hello in Korean with an emoji.\nAssistant: 안녕하세요! 🎉😊\n"
          "User: Say it again.\nAssistant:")
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours."}]


class Mesh:
    """A scheduler and two gateways on an event loop in a background thread."""

    def __init__(self, smollm2_dir):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mesh-loop", daemon=True)
        self.thread.start()
        self.sched, self.gw, self.gw_cap = self.run(self._start(smollm2_dir))
        self.channels = [grpc.insecure_channel(a) for a in (self.gw.address, self.gw_cap.address, self.sched.address)]
        self.stub, self.stub_cap = (llm_pb2_grpc.LLMServiceStub(c) for c in self.channels[:2])
        self.sched_stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channels[2])

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, smollm2_dir):
        from gateway.server import serve_gateway
        from kvmesh.core.engine_config import EngineConfig
        from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
        from scheduler.service import serve_scheduler
        sched = await serve_scheduler(SchedulerConfig(executor="local", port=0),
                                      EngineConfig(model=str(smollm2_dir), dtype="float32",
                                                   kv_cache_memory=KV_MEMORY, max_model_len=MAX_MODEL_LEN))
        await sched.wait_ready()
        cfg = GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=60, default_timeout=60,
                            max_timeout=120)
        gw = await serve_gateway(cfg)
        gw_cap = await serve_gateway(cfg.replace(max_tokens_cap=CAP, default_max_tokens=CAP_DEFAULT))
        return sched, gw, gw_cap

    def close(self):
        for c in self.channels:
            c.close()
        self.run(self.gw.stop(0))
        self.run(self.gw_cap.stop(0))
        self.run(self.sched.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def stats(self) -> scheduler_pb2.ReplicaStats:
        return self.sched_stub.GetStats(scheduler_pb2.GetStatsRequest()).replicas[0]

    def wait_idle(self, timeout: float = 10.0) -> scheduler_pb2.ReplicaStats:
        """Wait until the scheduler holds no request and no KV block; return its stats."""
        end = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s.num_used_blocks, s.num_running, s.num_waiting) == (0, 0, 0) or time.monotonic() > end:
                return s
            time.sleep(0.01)

    def assert_ended_upstream(self, steps_before: int) -> None:
        """The scheduler is idle with no used block, and reached it within a few engine steps of
        ``steps_before`` (a request left running would take ~100 more: the tests ask for 200)."""
        s = self.wait_idle()
        assert (s.num_used_blocks, s.num_running, s.num_waiting) == (0, 0, 0)
        assert s.num_steps - steps_before <= 5, "the upstream request kept running"


@pytest.fixture(scope="module")
def mesh(smollm2_dir):
    m = Mesh(smollm2_dir)
    yield m
    m.close()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from kvmesh import LLM
    return LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=KV_MEMORY, max_model_len=MAX_MODEL_LEN)


def greedy(max_tokens: int | None = None, **kw) -> common_pb2.SamplingParams:
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    return common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def offline(llm, prompt, max_tokens: int, chat: bool = False, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return (llm.chat(prompt, sp) if chat else llm.generate(prompt, sp))[0].outputs[0]


def joined(msgs):
    """(text, token ids, final message) of a finished stream."""
    assert msgs and msgs[-1].finished and not any(m.finished for m in msgs[:-1])
    return "".join(m.text for m in msgs), [t for m in msgs for t in m.token_ids], msgs[-1]


# ---- streaming parity ------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [PROMPT, KOREAN], ids=["english", "korean"])
def test_generate_streams_offline_greedy_tokens_and_text(mesh, llm, prompt):
    ref = offline(llm, prompt, 24)
    msgs = list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=greedy(24))))
    text, ids, final = joined(msgs)
    assert ids == ref.token_ids and text == ref.text
    assert len(msgs) > 2 and all("\ufffd" not in m.text for m in msgs)
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    prompt_ids = llm.tokenizer.encode(prompt)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt_ids), 24)
    t = final.timings
    assert 0 <= t.queue_time <= t.ttft <= t.e2e_latency and t.decode_time > 0
    # the same prompt as token ids streams the same output
    msgs = list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=prompt_ids),
                                                           sampling=greedy(24))))
    assert joined(msgs)[:2] == (ref.text, ref.token_ids)
    assert mesh.wait_idle().num_used_blocks == 0


def test_logprobs_per_token(mesh):
    msgs = list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(4, logprobs=2))))
    for m in msgs:
        assert len(m.logprobs) == len(m.token_ids)
        for t, lp in zip(m.token_ids, m.logprobs):
            assert t in lp.logprobs and len(lp.logprobs) >= 2     # sampled token + top-2
    assert sum(len(m.token_ids) for m in msgs) == 4


def test_chat_uses_the_chat_template(mesh, llm):
    ref = offline(llm, CHAT, 16, chat=True)
    req = llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(**m) for m in CHAT], sampling=greedy(16))
    text, ids, final = joined(list(mesh.stub.Chat(req)))
    assert ids == ref.token_ids and text == ref.text
    prompt_ids = llm.encode_chat(CHAT)
    assert final.usage.prompt_tokens == len(prompt_ids)
    tok = mesh.stub.Tokenize(llm_pb2.TokenizeRequest(chat=req))
    assert list(tok.token_ids) == prompt_ids and tok.count == len(prompt_ids)
    assert tok.max_model_len == MAX_MODEL_LEN


def test_stop_string_across_chunks_is_not_leaked_and_ends_upstream(mesh, llm):
    ref = offline(llm, PROMPT, 40)
    tok = llm.tokenizer
    # a stop string made of the last 2 characters of one token's text and the first 3 of the
    # next (decode steps stream one token per message, so it spans two messages)
    for k in range(6, 30):
        b = len(tok.decode(ref.token_ids[:k]))
        stop = ref.text[b - 2:b + 3]
        if len(stop) == 5 and ref.text.find(stop) == b - 2 and len(tok.decode(ref.token_ids[:k + 1])) >= b + 3:
            break
    else:
        pytest.fail("no stop string spanning a token boundary found")
    msgs = list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(200, stop=[stop]))))
    text, ids, final = joined(msgs)
    assert text == ref.text[:b - 2]
    # tokens k-1 and k (where the stop completes) came in separate messages; the text of
    # token k-1 that starts the stop string was held back, and nothing after it was sent
    assert len(ids) - len(msgs[-1].token_ids) == k
    assert (final.finish_reason, final.stop_reason) == (common_pb2.FINISH_REASON_STOP, stop)
    assert ids == ref.token_ids[:k + 1] and final.usage.completion_tokens == k + 1
    assert final.timings.e2e_latency > 0
    mesh.assert_ended_upstream(mesh.stats().num_steps)    # it asked for 200 tokens


def test_max_tokens_cap_and_default(mesh):
    call = mesh.stub_cap.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1000)))
    _, ids, final = joined(list(call))
    assert len(ids) == final.usage.completion_tokens == CAP
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert dict(call.trailing_metadata())["kvmesh-max-tokens"] == str(CAP)
    _, ids, _ = joined(list(mesh.stub_cap.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy()))))
    assert len(ids) == CAP_DEFAULT


# ---- deadlines, cancellation, abort ----------------------------------------------------------

@pytest.mark.parametrize("where", ["request", "client"])
def test_deadline_exceeded_aborts_upstream(mesh, where):
    """A deadline that expires mid-stream ends the call DEADLINE_EXCEEDED soon after it and
    aborts the request upstream. The deadline starts at 0.6 s and doubles until one falls
    after the first token (on a busy machine the first token can take longer than 0.6 s); each
    try must end DEADLINE_EXCEEDED with nothing left running. 200 tokens take far longer
    than the last try's 4.8 s."""
    for timeout in (0.6, 1.2, 2.4, 4.8):
        req = llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(200))
        kw = {}
        if where == "request":
            req.timeout.CopyFrom(Duration(seconds=int(timeout), nanos=round(timeout % 1 * 1e9)))
        else:
            kw["timeout"] = timeout
        received = []
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            for m in mesh.stub.Generate(req, **kw):
                received.append(m)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < timeout + 4.4
        mesh.assert_ended_upstream(mesh.stats().num_steps)
        if received:
            break
    assert received and not any(m.finished for m in received)     # it was running upstream


def test_client_cancel_frees_blocks_and_spares_other_streams(mesh, llm):
    ref = offline(llm, "Once upon a time", 32)
    victim = mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(200)))
    first = next(victim)
    other: list = []
    t = threading.Thread(target=lambda: other.extend(mesh.stub.Generate(
        llm_pb2.GenerateRequest(prompt="Once upon a time", sampling=greedy(32)))))
    t.start()
    while not other and t.is_alive():      # both streams running
        next(victim)
        time.sleep(0.01)
    assert mesh.stats().num_running >= 1
    victim.cancel()
    t.join(60)
    text, ids, _ = joined(other)
    assert (text, ids) == (ref.text, ref.token_ids)
    assert first.token_ids
    mesh.assert_ended_upstream(mesh.stats().num_steps)


def test_abort_rpc_ends_the_stream_with_abort(mesh):
    stream = mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(200), request_id="abort-me"))
    msgs = [next(stream), next(stream)]
    assert mesh.stub.Abort(llm_pb2.AbortRequest(request_id="abort-me")).found
    msgs += list(stream)
    _, ids, final = joined(msgs)
    assert final.finish_reason == common_pb2.FINISH_REASON_ABORT and final.request_id == "abort-me"
    assert final.usage.completion_tokens == len(ids) < 200
    mesh.assert_ended_upstream(mesh.stats().num_steps)
    # an id no gateway knows is forwarded to the scheduler, which does not know it either
    assert not mesh.stub.Abort(llm_pb2.AbortRequest(request_id="never-seen")).found


def test_scheduler_status_passes_through(mesh):
    """Two gateways on one scheduler, one request id: the scheduler's ALREADY_EXISTS comes back."""
    stream = mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(200), request_id="dup"))
    next(stream)
    with pytest.raises(grpc.RpcError) as ei:
        list(mesh.stub_cap.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(2), request_id="dup")))
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in ei.value.details()
    # the same id twice on one gateway: the gateway's own ALREADY_EXISTS (issue 16)
    with pytest.raises(grpc.RpcError) as ei:
        list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(2), request_id="dup")))
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in ei.value.details()
    stream.cancel()
    assert mesh.wait_idle().num_used_blocks == 0


# ---- validation ------------------------------------------------------------------------------

def _gen(**kw):
    kw.setdefault("sampling", greedy(2))
    return "Generate", llm_pb2.GenerateRequest(**kw)


def _chat(messages, **kw):
    return "Chat", llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                                       sampling=greedy(2), **kw)


def _bad_utf8_stop():
    good = llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(2, stop=["ok", "XY"])).SerializeToString()
    return "raw", good.replace(b"XY", b"\xff\xfe")


INVALID = {
    "empty prompt": (lambda: _gen(prompt=""), "prompt"),
    "no prompt": (lambda: _gen(), "prompt"),
    "empty token ids": (lambda: _gen(prompt_token_ids=llm_pb2.TokenIds()), "prompt_token_ids"),
    "token id outside vocabulary": (lambda: _gen(prompt_token_ids=llm_pb2.TokenIds(ids=[1, 10**8])),
                                    "prompt_token_ids"),
    "negative temperature": (lambda: _gen(prompt=PROMPT, sampling=common_pb2.SamplingParams(temperature=-1)),
                             "temperature"),
    "top_p zero": (lambda: _gen(prompt=PROMPT, sampling=common_pb2.SamplingParams(top_p=0)), "top_p"),
    "max_tokens zero": (lambda: _gen(prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    "empty stop string": (lambda: _gen(prompt=PROMPT, sampling=greedy(2, stop=[""])), "stop"),
    "unknown model": (lambda: _gen(prompt=PROMPT, model="gpt-17"), "model"),
    "oversize prompt": (lambda: _gen(prompt_token_ids=llm_pb2.TokenIds(ids=[42] * (MAX_MODEL_LEN + 10))), "prompt"),
    "prompt + max_tokens too long": (lambda: _gen(prompt_token_ids=llm_pb2.TokenIds(ids=[42] * (MAX_MODEL_LEN - 10)),
                                                  sampling=greedy(20)), "max_tokens"),
    "negative timeout": (lambda: _gen(prompt=PROMPT, timeout=Duration(seconds=-1)), "timeout"),
    "timeout over max": (lambda: _gen(prompt=PROMPT, timeout=Duration(seconds=3600)), "timeout"),
    "no messages": (lambda: _chat([]), "messages"),
    "unknown role": (lambda: _chat([("user", "hi"), ("wizard", "hi")]), "messages[1].role"),
    "invalid UTF-8 stop string": (_bad_utf8_stop, "sampling.stop[1]"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_argument_names_the_field_and_server_keeps_serving(mesh, case):
    make, field = INVALID[case]
    method, req = make()
    if method == "raw":   # a client sending bytes no Python client could build
        call = mesh.channels[0].unary_stream("/kvmesh.v1.LLMService/Generate",
                                             response_deserializer=llm_pb2.GenerateResponse.FromString)(req)
    else:
        call = getattr(mesh.stub, method)(req)
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert field in ei.value.details()
    _, ids, final = joined(list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1)))))
    assert len(ids) == 1 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_tokenize_and_list_models(mesh, llm, smollm2_dir):
    tok = mesh.stub.Tokenize(llm_pb2.TokenizeRequest(prompt=PROMPT))
    assert list(tok.token_ids) == llm.tokenizer.encode(PROMPT) and tok.count == len(tok.token_ids)
    models = mesh.stub.ListModels(llm_pb2.ListModelsRequest()).models
    assert [(m.name, m.max_model_len, m.dtype) for m in models] == [(str(smollm2_dir), MAX_MODEL_LEN, "float32")]
    assert models[0].vocab_size == llm.engine.model_config.vocab_size
    with pytest.raises(grpc.RpcError) as ei:
        mesh.stub.Tokenize(llm_pb2.TokenizeRequest(prompt=PROMPT, model="nope"))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in ei.value.details()
    # the served name is accepted
    mesh.stub.Tokenize(llm_pb2.TokenizeRequest(prompt=PROMPT, model=models[0].name))


# ---- health, reflection, start-up ------------------------------------------------------------

def test_health_serving(mesh):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    stub = health_pb2_grpc.HealthStub(mesh.channels[0])
    for service in ("", "kvmesh.v1.LLMService"):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(mesh):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    stub = reflection_pb2_grpc.ServerReflectionStub(mesh.channels[0])
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvmesh.v1.LLMService", "grpc.health.v1.Health"} <= names


def test_unreachable_scheduler_fails_start(mesh):
    from gateway.server import serve_gateway
    from kvmesh.core.service_config import GatewayConfig
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=f"scheduler at {addr} unreachable"):
        mesh.run(serve_gateway(GatewayConfig(port=0, scheduler_address=addr, connect_timeout=1.0)))
    assert time.monotonic() - t0 < 5


def test_port_in_use_fails_start(mesh):
    from gateway.server import serve_gateway
    from kvmesh.core.service_config import GatewayConfig
    with pytest.raises(EngineError, match="cannot listen"):
        mesh.run(serve_gateway(GatewayConfig(port=mesh.gw.port, scheduler_address=mesh.sched.address)))


def test_internal_error_is_internal_and_server_keeps_serving(mesh, monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("boom")
    monkeypatch.setattr(mesh.gw.path, "_sampling", boom)
    with pytest.raises(grpc.RpcError) as ei:
        list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(2))))
    assert ei.value.code() == grpc.StatusCode.INTERNAL and "RuntimeError: boom" in ei.value.details()
    monkeypatch.undo()
    assert joined(list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1)))))[2].finished


# ---- against a fake scheduler: statuses, a vanished scheduler, shutdown ----------------------

class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """GetModelInfo of the real scheduler; Submit per ``mode``: ``full`` (RESOURCE_EXHAUSTED),
    ``truncated`` (one message, no final), ``endless`` (a token every 20 ms until cancelled)."""

    def __init__(self, info):
        self.info, self.mode, self.cancelled = info, "endless", 0

    async def GetModelInfo(self, request, context):
        return self.info

    async def Submit(self, request, context):
        if self.mode == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "replica 0 queue is full")
        await context.write(scheduler_pb2.SubmitResponse(request_id=request.request_id, token_ids=[42]))
        if self.mode == "truncated":
            return
        try:
            while True:
                await asyncio.sleep(0.02)
                await context.write(scheduler_pb2.SubmitResponse(request_id=request.request_id, token_ids=[42]))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def _start_fake(fake) -> tuple[grpc.aio.Server, str]:
    """``fake`` served with the health a scheduler has (SchedulerService SERVING: the gateway
    follows it)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, server)
    servicer = health.aio.HealthServicer()
    await servicer.set("kvmesh.v1.SchedulerService", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _gateway(mesh, scheduler_address: str):
    from gateway.server import serve_gateway
    from kvmesh.core.service_config import GatewayConfig
    return mesh.run(serve_gateway(GatewayConfig(port=0, scheduler_address=scheduler_address, connect_timeout=10)))


def _until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_fake_scheduler_statuses_and_shutdown(mesh):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    fake = FakeScheduler(mesh.sched_stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest()))
    server, address = mesh.run(_start_fake(fake))
    gw = _gateway(mesh, address)
    req = llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(100))
    with grpc.insecure_channel(gw.address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        fake.mode = "full"        # the scheduler's status and message pass through
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(req))
        assert (ei.value.code(), ei.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "replica 0 queue is full")
        fake.mode = "truncated"
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(req))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "without a final message" in ei.value.details()
        fake.mode = "endless"     # stop() cancels an in-flight stream and its upstream call
        stream = stub.Generate(req)
        next(stream)
        mesh.run(gw.stop(0))
        with pytest.raises(grpc.RpcError) as ei:
            list(stream)
        assert ei.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert _until(lambda: fake.cancelled == 1)

    gw = _gateway(mesh, address)
    mesh.run(server.stop(0))     # the scheduler goes away
    with grpc.insecure_channel(gw.address) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            list(llm_pb2_grpc.LLMServiceStub(ch).Generate(req))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ei.value.details().startswith(f"scheduler at {address} unreachable: "), ei.value.details()
        health = health_pb2_grpc.HealthStub(ch)
        assert _until(lambda: health.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.LLMService")).status
                      == health_pb2.HealthCheckResponse.NOT_SERVING)
    mesh.run(gw.stop(0))


def test_gateway_modules_do_not_import_torch():
    """The gateway only needs a tokenizer: importing its gRPC server and its HTTP API (and the
    settings they read) loads no torch (issue: one obvious place per concept at the edges)."""
    import subprocess
    import sys
    code = ("import sys, gateway.server, gateway.http_api, kvmesh.core.engine_config, kvmesh.core.service_config; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'workers')));"
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
