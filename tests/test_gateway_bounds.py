"""Issue 16 over real gRPC: request limits, request ids free once the final message is sent, usage
for every finish reason.

The mesh of tests/test_gateway.py (a scheduler with one engine process, local executor,
SmolLM2-135M in float32, and its gateways) plus ``gw_small``, a gateway on the same scheduler with
small limits (:data:`SMALL`) so that each limit is cheap to reach.
"""

from __future__ import annotations

import grpc
import pytest
from test_gateway import PROMPT, Mesh, greedy, joined

from kvmesh.core.service_config import GatewayConfig
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc

SMALL = dict(max_stop_strings=4, max_stop_chars=40, max_stop_token_ids=8, max_id_length=16, max_prompt_tokens=20,
             max_message_bytes=2048)
# 40+ prompt tokens: a second run of it finds its first full blocks in the prefix cache
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type with an oil-based ink and a wooden screw press.")


@pytest.fixture(scope="module")
def mesh(smollm2_dir):
    from gateway.server import serve_gateway
    m = Mesh(smollm2_dir)
    cfg = GatewayConfig(port=0, scheduler_address=m.sched.address, connect_timeout=60, default_timeout=60,
                        max_timeout=120, **SMALL)
    m.gw_small = m.run(serve_gateway(cfg))
    channel = grpc.insecure_channel(m.gw_small.address)
    m.stub_small = llm_pb2_grpc.LLMServiceStub(channel)
    yield m
    channel.close()
    m.run(m.gw_small.stop(0))
    m.close()


def _status(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    return ei.value


# ---- limits ------------------------------------------------------------------------------------

def _ids(n: int) -> llm_pb2.TokenIds:
    return llm_pb2.TokenIds(ids=[42] * n)


def _sized(n_bytes: int, cls=llm_pb2.TokenizeRequest, **kw):
    """A request whose serialized size is exactly ``n_bytes``."""
    req = cls(prompt="", **kw)
    req.prompt = "x" * (n_bytes - req.ByteSize())
    req.prompt = "x" * (len(req.prompt) - (req.ByteSize() - n_bytes))     # the length prefix grew
    assert req.ByteSize() == n_bytes
    return req


# (limit, a request at the limit, the same one unit over it, the field named)
LIMITS = {
    "max_stop_strings": (lambda n: llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1, stop=[f"#{i}#" for i in range(n)])),
                         4, "sampling.stop"),
    "max_stop_chars": (lambda n: llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1, stop=["#" * (n - 20), "@" * 20])),
                       40, "sampling.stop"),
    "max_stop_token_ids": (lambda n: llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1, stop_token_ids=range(1000, 1000 + n))),
                           8, "sampling.stop_token_ids"),
    "max_id_length": (lambda n: llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1), request_id="r" * n),
                      16, "request_id"),
    "max_id_length (session)": (lambda n: llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1), session_id="s" * n),
                                16, "session_id"),
    "max_prompt_tokens": (lambda n: llm_pb2.GenerateRequest(prompt_token_ids=_ids(n), sampling=greedy(1)),
                          20, "prompt"),
    # Tokenize: the prompt of a Generate request that size is over max_prompt_tokens
    "max_message_bytes": (lambda n: _sized(n), 2048, "request"),
}


def _call(stub, req) -> int:
    """Tokens generated (Generate), or counted (Tokenize)."""
    if isinstance(req, llm_pb2.TokenizeRequest):
        return stub.Tokenize(req).count
    _, ids, final = joined(list(stub.Generate(req)))
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return len(ids)


@pytest.mark.parametrize("case", list(LIMITS))
def test_each_limit_serves_at_it_and_names_it_over_it(mesh, case):
    make, limit, field = LIMITS[case]
    name = case.split()[0]
    assert _call(mesh.stub_small, make(limit)) >= 1
    with pytest.raises(grpc.RpcError) as ei:
        _call(mesh.stub_small, make(limit + 1))
    e = ei.value
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert field in e.details() and name in e.details() and str(limit) in e.details(), e.details()
    assert _call(mesh.stub, make(limit + 1)) >= 1    # the default gateway serves it


def test_text_and_chat_prompts_over_max_prompt_tokens(mesh):
    e = _status(mesh.stub_small.Generate(llm_pb2.GenerateRequest(prompt=LONG_PROMPT, sampling=greedy(1))))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_tokens (20)" in e.details()
    chat = llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(role="user", content=LONG_PROMPT)], sampling=greedy(1))
    e = _status(mesh.stub_small.Chat(chat))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_tokens (20)" in e.details()


def test_message_far_over_the_limit_is_refused_by_grpc_and_tokenize_is_bounded_too(mesh):
    over = _sized(2100, llm_pb2.GenerateRequest, sampling=greedy(1))
    e = _status(mesh.stub_small.Generate(over))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_message_bytes (2048)" in e.details()
    e = _status(mesh.stub_small.Generate(_sized(2 * 2048 + 100, llm_pb2.GenerateRequest, sampling=greedy(1))))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as ei:
        mesh.stub_small.Tokenize(llm_pb2.TokenizeRequest(prompt="x" * 3000))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_message_bytes" in ei.value.details()
    _, ids, _ = joined(list(mesh.stub_small.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(1)))))
    assert len(ids) == 1


def test_default_limits_serve_the_largest_stop_lists(mesh, llm):
    """64 stop strings of 64 characters (4096 in all) and 1024 stop token ids: served, and the
    stop string among them still ends the output where the offline reference says."""
    d = GatewayConfig()
    ref = offline_text(llm, 30)
    stop = ref[20:28]
    stops = [stop] + [f"{i:02d}" + "\u00e9" * 62 for i in range(d.max_stop_strings - 2)]
    stops.append("\u00e8" * (d.max_stop_chars - sum(map(len, stops))))
    assert len(stops) == d.max_stop_strings and sum(map(len, stops)) == d.max_stop_chars
    sp = greedy(30, stop=stops, stop_token_ids=range(60000, 60000 + d.max_stop_token_ids))
    text, _, final = joined(list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=sp))))
    assert (text, final.stop_reason) == (ref[: ref.index(stop)], stop)
    sp.stop_token_ids.append(1)
    e = _status(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=sp)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_stop_token_ids (1024)" in e.details()


def offline_text(llm, max_tokens: int, prompt: str = PROMPT) -> str:
    from kvmesh.core.sampling import SamplingParams
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0].outputs[0].text


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from kvmesh import LLM
    from test_gateway import KV_MEMORY, MAX_MODEL_LEN
    return LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=KV_MEMORY, max_model_len=MAX_MODEL_LEN)


# ---- request ids ---------------------------------------------------------------------------------

def test_id_is_free_right_after_a_stop_string_finish(mesh, llm):
    """Ten stop-string finishes at different tokens, each id reused at once: every reuse is
    served in full (no refusal, no stale end of the previous request)."""
    ref = offline_text(llm, 40)
    for i in range(10):
        stop = ref[8 + 3 * i: 12 + 3 * i]
        msgs = list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(200, stop=[stop]),
                                                               request_id="again")))
        assert joined(msgs)[2].finish_reason == common_pb2.FINISH_REASON_STOP
        _, ids, final = joined(list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(3),
                                                                               request_id="again"))))
        assert (final.finish_reason, len(ids)) == (common_pb2.FINISH_REASON_LENGTH, 3), i
    assert mesh.wait_idle().num_used_blocks == 0


def test_live_duplicate_is_already_exists_on_gateway_and_scheduler(mesh):
    from kvmesh.v1 import scheduler_pb2
    stream = mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(200), request_id="twice"))
    next(stream)
    e = _status(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(2), request_id="twice")))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS and "twice" in e.details()
    e = _status(mesh.sched_stub.Submit(scheduler_pb2.SubmitRequest(request_id="twice", prompt_token_ids=[1, 2, 3])))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()
    assert mesh.wait_idle().num_used_blocks == 0


# ---- usage -----------------------------------------------------------------------------------------

USAGE_CHAT = [{"role": "system", "content": LONG_PROMPT},
              {"role": "user", "content": "Reply with one word: who invented the printing press?"}]


def _chat(mesh, request_id: str = "", **sampling) -> llm_pb2.ChatRequest:
    return llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(**m) for m in USAGE_CHAT], request_id=request_id,
                               sampling=common_pb2.SamplingParams(temperature=0.0, **sampling))


def test_usage_for_every_finish_reason(mesh, llm):
    """One chat prompt (57 tokens; greedy, SmolLM2 answers in ~30 tokens and then EOS), its
    first blocks in the prefix cache, ended by length, EOS, a stop token, a stop string and the
    Abort RPC: every final message reports the prompt, the cached prompt tokens and what was
    generated."""
    from kvmesh.core.sampling import SamplingParams
    ref = llm.chat(USAGE_CHAT, SamplingParams(temperature=0.0, max_tokens=60))[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.stop_reason is None     # EOS
    n_prompt = len(llm.encode_chat(USAGE_CHAT))
    cached = (n_prompt - 1) // 16 * 16
    list(mesh.stub.Chat(_chat(mesh, max_tokens=1)))                  # fills the prefix cache
    stop = ref.text[ref.text.index("invented"):][:12]
    cases = {   # sampling -> (finish reason, stop reason, completion tokens)
        "length": (dict(max_tokens=5, ignore_eos=True), common_pb2.FINISH_REASON_LENGTH, "", 5),
        "eos": (dict(max_tokens=60), common_pb2.FINISH_REASON_STOP, "", len(ref.token_ids)),
        "stop token": (dict(max_tokens=60, stop_token_ids=[ref.token_ids[6]]), common_pb2.FINISH_REASON_STOP,
                       str(ref.token_ids[6]), ref.token_ids.index(ref.token_ids[6]) + 1),
        "stop string": (dict(max_tokens=60, stop=[stop]), common_pb2.FINISH_REASON_STOP, stop, None),
    }
    for name, (sp, reason, stop_reason, n) in cases.items():
        text, ids, final = joined(list(mesh.stub.Chat(_chat(mesh, **sp))))
        assert (final.finish_reason, final.stop_reason) == (reason, stop_reason), name
        u = final.usage
        assert (u.prompt_tokens, u.cached_prompt_tokens) == (n_prompt, cached), name
        assert u.completion_tokens == (n if n is not None else len(ids)), name
    assert text == ref.text[: ref.text.index(stop)]
    stream = mesh.stub.Chat(_chat(mesh, "u-abort", max_tokens=150, ignore_eos=True))
    msgs = [next(stream), next(stream)]
    assert mesh.stub.Abort(llm_pb2.AbortRequest(request_id="u-abort")).found
    _, ids, final = joined(msgs + list(stream))
    assert final.finish_reason == common_pb2.FINISH_REASON_ABORT
    u = final.usage
    assert (u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens) == (n_prompt, cached, len(ids))
    assert mesh.wait_idle().num_used_blocks == 0
    # deadline: no final message; the status's trailing metadata holds the usage. The deadline
    # must fall after the first tokens and before the 150th: 0.8 s, doubled while a busy machine
    # sends no token within it (seen beside 2 busy processes)
    for deadline in (0.8, 1.6, 3.2, 6.4):
        req = _chat(mesh, max_tokens=150, ignore_eos=True)
        req.timeout.FromNanoseconds(int(deadline * 1e9))
        received = []
        with pytest.raises(grpc.RpcError) as ei:
            for msg in mesh.stub.Chat(req):
                received += msg.token_ids
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value.details()
        assert mesh.wait_idle().num_used_blocks == 0
        if received:
            break
    assert received
    u = common_pb2.Usage.FromString(dict(ei.value.trailing_metadata())["kvmesh-usage-bin"])
    assert (u.prompt_tokens, u.cached_prompt_tokens) == (n_prompt, cached)
    assert u.completion_tokens == len(received)
    assert mesh.wait_idle().num_used_blocks == 0


REPEAT = "The cat sat on the mat. " * 6


def test_usage_of_a_stop_string_finish_with_speculative_decoding(smollm2_dir):
    """A scheduler speculating by prompt lookup (ngram) and a repetitive prompt: the request
    ended by a stop string reports the speculative counts and cached prompt tokens the scheduler
    sent before the match (both were 0), no more than the same request ended by length."""
    import asyncio
    import threading

    from gateway.server import serve_gateway
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
    from scheduler.service import serve_scheduler

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    async def start():
        sched = await serve_scheduler(SchedulerConfig(executor="local", port=0), EngineConfig(
            model=str(smollm2_dir), dtype="float32", kv_cache_memory=48 * 2**20, max_model_len=256,
            speculative_method="ngram", num_speculative_tokens=4))
        await sched.wait_ready()
        return sched, await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=60))

    sched, gw = run(start())
    try:
        with grpc.insecure_channel(gw.address) as ch:
            stub = llm_pb2_grpc.LLMServiceStub(ch)
            req = llm_pb2.GenerateRequest(prompt=REPEAT, sampling=greedy(40))
            text, ids, by_length = joined(list(stub.Generate(req)))
            assert by_length.usage.spec_num_drafts > 0, "the prompt does not make ngram speculate"
            at = text.index("mat.", len(text) // 2)
            req.sampling.stop.append(text[at - 4: at + 4])
            _, ids2, by_stop = joined(list(stub.Generate(req)))
            assert by_stop.finish_reason == common_pb2.FINISH_REASON_STOP and len(ids2) < len(ids)
            u = by_stop.usage
            assert 0 < u.spec_num_drafts <= by_length.usage.spec_num_drafts
            assert 0 < u.spec_num_accepted_tokens <= u.spec_num_draft_tokens
            assert u.cached_prompt_tokens > 0           # the second run of the prompt
    finally:
        run(gw.stop(0))
        run(sched.stop(0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
