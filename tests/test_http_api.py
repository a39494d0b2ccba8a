"""The gateway's OpenAI-compatible HTTP API (issue 19) with the official ``openai`` client, over
real HTTP on loopback, in front of the real scheduler of tests/test_gateway.py (SmolLM2-135M,
float32, local executor). ``gw_http`` is a gateway of that scheduler with ``http_port=0``; its
gRPC side is the reference: the same greedy request must give the same text and usage both ways.
A fake scheduler (tests/test_gateway.py) gives the statuses a real one rarely does (429, 503).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import grpc
import openai
import pytest
from test_gateway import CHAT, PROMPT, FakeScheduler, Mesh, _start_fake, _until, greedy, joined

from kvmesh.core.config import GatewayConfig
from kvmesh.v1 import llm_pb2, llm_pb2_grpc, scheduler_pb2

# 40+ prompt tokens: a second run of it finds its first full blocks in the prefix cache
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type with an oil-based ink and a wooden screw press.")


@pytest.fixture(scope="module")
def mesh(smollm2_dir):
    from gateway.server import serve_gateway
    m = Mesh(smollm2_dir)
    cfg = GatewayConfig(port=0, http_port=0, scheduler_address=m.sched.address, connect_timeout=60,
                        default_timeout=60, max_timeout=120)
    m.gw_http = m.run(serve_gateway(cfg))
    m.url = m.gw_http.http.url
    channel = grpc.insecure_channel(m.gw_http.address)
    m.stub_http = llm_pb2_grpc.LLMServiceStub(channel)
    m.client = openai.OpenAI(base_url=m.url, api_key="unused", max_retries=0, timeout=120)
    yield m
    m.client.close()
    channel.close()
    m.run(m.gw_http.stop(0))
    m.close()


def _grpc_chat(mesh, messages, max_tokens: int, **kw):
    return joined(list(mesh.stub_http.Chat(llm_pb2.ChatRequest(
        messages=[llm_pb2.ChatMessage(**m) for m in messages], sampling=greedy(max_tokens, **kw)))))


def _grpc_generate(mesh, max_tokens: int, **kw):
    return joined(list(mesh.stub_http.Generate(llm_pb2.GenerateRequest(sampling=greedy(max_tokens), **kw))))


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


# ---- text, usage, finish reasons: the same as the gRPC path -------------------------------------

def test_chat_non_streaming_equals_grpc(mesh):
    text, ids, final = _grpc_chat(mesh, CHAT, 12)
    r = mesh.client.chat.completions.create(model=mesh.gw_http.path.info.name, messages=CHAT, max_tokens=12,
                                            **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", text, "length")
    assert len(ids) == 12 and (r.usage.prompt_tokens, r.usage.completion_tokens) == (final.usage.prompt_tokens, 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 16     # the gRPC run left the prompt in the prefix cache


def test_chat_streaming_equals_grpc_with_usage(mesh):
    text, _, final = _grpc_chat(mesh, CHAT, 16)
    chunks = list(mesh.client.chat.completions.create(messages=CHAT, max_tokens=16, model="", stream=True,
                                                      stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == final.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len(chunks) > 4              # streamed, not one piece


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_grpc_text_and_token_prompts(mesh, stream, smollm2_tokenizer):
    text, ids, _ = _grpc_generate(mesh, 10, prompt=PROMPT)
    for prompt in (PROMPT, smollm2_tokenizer.encode(PROMPT), [PROMPT]):
        r = mesh.client.completions.create(model="", prompt=prompt, max_tokens=10, stream=stream, **GREEDY)
        if stream:
            chunks = list(r)
            assert "".join(c.choices[0].text for c in chunks) == text
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            assert r.object == "text_completion" and r.id.startswith("cmpl-")
            assert (r.choices[0].text, r.choices[0].finish_reason) == (text, "length")
            assert r.usage.completion_tokens == len(ids) == 10


def test_stop_string_and_max_tokens_are_honoured(mesh):
    full, _, _ = _grpc_generate(mesh, 24, prompt=PROMPT)
    stop = full[10:16]
    cut = full[:full.index(stop)]
    for stream in (False, True):
        r = mesh.client.completions.create(model="", prompt=PROMPT, max_tokens=24, stop=[stop], stream=stream,
                                           **GREEDY)
        if stream:
            chunks = list(r)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            stop_reason = chunks[-1].choices[0].model_extra["stop_reason"]
        else:
            text, reason, stop_reason = r.choices[0].text, r.choices[0].finish_reason, r.choices[0].model_extra[
                "stop_reason"]
        assert (text, reason, stop_reason) == (cut, "stop", stop)
    r = mesh.client.chat.completions.create(model="", messages=CHAT, max_completion_tokens=3, **GREEDY)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")
    # the max_tokens used and the request id come back in headers
    raw = mesh.client.chat.completions.with_raw_response.create(model="", messages=CHAT, max_tokens=2, **GREEDY)
    assert raw.headers["x-kvmesh-max-tokens"] == "2" and raw.headers["x-request-id"]


def test_eos_finishes_with_stop(mesh):
    r = mesh.client.chat.completions.create(model="", messages=[{"role": "user", "content": "Say OK."}],
                                            max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 100


def test_cached_prompt_tokens_in_usage(mesh):
    first, again = (mesh.client.completions.create(model="", prompt=LONG_PROMPT, max_tokens=1, **GREEDY).usage
                    for _ in range(2))
    assert first.prompt_tokens == again.prompt_tokens > 16
    assert first.prompt_tokens_details.cached_tokens == 0 and again.prompt_tokens_details.cached_tokens >= 16


def test_logprobs(mesh):
    r = mesh.client.chat.completions.create(model="", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3,
                                            **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs))      # greedy: the best one
    r = mesh.client.completions.create(model="", prompt=PROMPT, max_tokens=4, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)


def test_models_and_health(mesh):
    models = mesh.client.models.list().data
    assert [m.id for m in models] == [mesh.gw_http.path.info.name]
    r = _http(mesh.url.removesuffix("/v1") + "/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


# ---- plain HTTP (http.client) ------------------------------------------------------------------------

class Reply:
    def __init__(self, status: int, headers, body: bytes):
        self.status_code, self.headers, self.text = status, headers, body.decode()

    def json(self):
        return json.loads(self.text)


def _open(url: str, method: str, body: bytes | None = None):
    """(connection, response) of one request."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request(method, u.path, body=body, headers={"Content-Type": "application/json"} if body is not None else {})
    return conn, conn.getresponse()


def _http(url: str, method: str = "GET", body: bytes | str | None = None) -> Reply:
    conn, r = _open(url, method, body.encode() if isinstance(body, str) else body)
    try:
        return Reply(r.status, r.headers, r.read())
    finally:
        conn.close()


def _sse(url: str, payload: dict):
    """(connection, iterator of the stream's ``data:`` lines) of a streaming POST."""
    conn, r = _open(url, "POST", json.dumps(payload).encode())
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    return conn, (line.decode().strip() for line in r if line.startswith(b"data: "))


# ---- errors: OpenAI's body and statuses; the server keeps serving -------------------------------

def _post(mesh, route: str, content: str) -> Reply:
    return _http(mesh.url + route, "POST", content)


def _error(r: Reply, status: int, param) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body, param", [
    ('{"model": "", "messages": [', None),                                    # malformed JSON
    ('[1, 2]', None),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', "temperature"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}', "top_p"),
    ('{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "n"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', "max_tokens"),
    ('{"messages": [{"role": "user", "content": "hi"}], "seed": -1}', "seed"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": 3}', "stop"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": [""]}', "stop"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": ' + json.dumps(["x"] * 65) + "}", "stop"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "top_logprobs"),
    ('{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}', "top_logprobs"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}',
     "stream_options"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', "tools"),
])
def test_bad_chat_requests_are_400_naming_the_field(mesh, body, param):
    err = _error(_post(mesh, "/chat/completions", body), 400, param)
    assert err["type"] == "invalid_request_error"
    r = mesh.client.chat.completions.create(model="", messages=CHAT, max_tokens=1, **GREEDY)
    assert r.usage.completion_tokens == 1          # still serving


@pytest.mark.parametrize("body, param", [
    ('{"prompt": ""}', "prompt"),
    ('{"prompt": ["a", "b"]}', "prompt"),
    ('{"prompt": [1, 99999999]}', "prompt"),
    ('{"prompt": "hi", "echo": true}', "echo"),
    ('{"prompt": "hi", "logprobs": 50}', "logprobs"),
])
def test_bad_completion_requests_are_400_naming_the_field(mesh, body, param):
    _error(_post(mesh, "/completions", body), 400, param)


def test_unknown_model_is_404_and_openai_client_errors(mesh):
    with pytest.raises(openai.NotFoundError) as ei:
        mesh.client.chat.completions.create(model="gpt-nope", messages=CHAT, max_tokens=1)
    assert ei.value.code == "model_not_found" and "gpt-nope" in ei.value.message
    with pytest.raises(openai.BadRequestError) as ei:
        mesh.client.completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=-2)
    assert ei.value.param == "temperature"
    _error(_http(mesh.url + "/nope"), 404, None)
    assert mesh.client.completions.create(model="", prompt=PROMPT, max_tokens=1).usage.completion_tokens == 1


# ---- disconnects free the request's KV at once ----------------------------------------------------

STREAM_200 = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}


def test_closed_stream_frees_its_kv(mesh):
    conn, lines = _sse(mesh.url + "/completions", STREAM_200)
    assert json.loads(next(lines)[6:])["choices"][0]["text"]
    assert mesh.stats().num_running == 1
    steps = mesh.stats().num_steps
    conn.close()
    mesh.assert_ended_upstream(steps)


def test_disconnect_during_a_non_streaming_request_frees_its_kv(mesh):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}).encode()
    host, port = mesh.gw_http.http.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert _until(lambda: mesh.stats().num_running == 1 and mesh.stats().num_steps > 0, 60)
    steps = mesh.stats().num_steps
    sock.close()
    mesh.assert_ended_upstream(steps)


def test_concurrent_streams_are_independent(mesh):
    """A stream closed early does not disturb another on the same gateway."""
    text, _, _ = _grpc_generate(mesh, 24, prompt="Once upon a time")
    got = []
    t = threading.Thread(target=lambda: got.append(mesh.client.completions.create(
        model="", prompt="Once upon a time", max_tokens=24, **GREEDY).choices[0].text))
    conn, lines = _sse(mesh.url + "/completions", STREAM_200)
    next(lines)
    t.start()
    time.sleep(0.2)
    conn.close()
    t.join(120)
    assert got == [text]


# ---- against a fake scheduler: over capacity, unreachable ----------------------------------------

def test_scheduler_full_is_429_and_gone_is_503(mesh):
    from gateway.server import serve_gateway
    fake = FakeScheduler(mesh.sched_stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest()))
    server, address = mesh.run(_start_fake(fake))
    gw = mesh.run(serve_gateway(GatewayConfig(port=0, http_port=0, scheduler_address=address, connect_timeout=10)))
    client = openai.OpenAI(base_url=gw.http.url, api_key="unused", max_retries=0)
    try:
        fake.mode = "full"
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as ei:
                r = client.completions.create(model="", prompt=PROMPT, max_tokens=5, stream=stream)
                list(r) if stream else None
            assert ei.value.status_code == 429 and "queue is full" in ei.value.message
        fake.mode = "endless"       # a stream whose client goes away: the upstream call is cancelled
        conn, lines = _sse(gw.http.url + "/completions", {"prompt": PROMPT, "max_tokens": 100, "stream": True})
        next(lines)
        conn.close()
        assert _until(lambda: fake.cancelled == 1)
        mesh.run(server.stop(0))    # the scheduler goes away
        with pytest.raises(openai.InternalServerError) as ei:
            client.completions.create(model="", prompt=PROMPT, max_tokens=5)
        assert ei.value.status_code == 503 and f"scheduler at {address} unreachable" in ei.value.message
        health = gw.http.url.removesuffix("/v1") + "/health"
        assert _until(lambda: _http(health).status_code == 503)
    finally:
        client.close()
        mesh.run(gw.stop(0))
