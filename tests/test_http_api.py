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
import types
from urllib.parse import urlsplit

import grpc
import openai
import pytest
from test_gateway import CHAT, PROMPT, FakeScheduler, Mesh, _start_fake, _until, greedy, joined

from kvmesh.core.service_config import GatewayConfig
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


# ---- hostile clients (issue 37): no 500, no dropped connection, the server keeps serving ----------

def _served(mesh) -> None:
    r = _post(mesh, "/completions", json.dumps({"prompt": "Hi", "max_tokens": 1, **{"temperature": 0}}))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


SURROGATE = "\\ud800"          # JSON text of a lone surrogate: valid JSON, not Unicode text
MSG = '{"role": "user", "content": "hi"}'


@pytest.mark.parametrize("route, body, param", [
    ("/chat/completions", '{"messages": [{"role": "user", "content": "a%sb"}]}', "messages[0].content"),
    ("/chat/completions", '{"messages": [{"role": "us%s", "content": "hi"}]}', "messages[0].role"),
    ("/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
     "messages[0].content[0].text"),
    ("/chat/completions", '{"messages": [' + MSG + '], "model": "%s"}', "model"),
    ("/chat/completions", '{"messages": [' + MSG + '], "stop": ["ok", "x%s"]}', "stop[1]"),
    ("/chat/completions", '{"messages": [' + MSG + '], "request_id": "%s"}', "request_id"),
    ("/chat/completions", '{"messages": [' + MSG + '], "session_id": "%s"}', "session_id"),
    ("/chat/completions", '{"messages": [' + MSG + '], "user": "%s"}', "user"),
    ("/chat/completions", '{"messages": [' + MSG + '], "x_unknown": {"deep": ["%s"]}}', "x_unknown.deep[0]"),
    ("/chat/completions", '{"messages": [' + MSG + '], "k%s": 1}', None),                      # a key
    # a key that is not a name ends the path at its object, lists below it included (found by
    # tests/test_fuzz_api.py: the list's index was appended to the object's path)
    ("/completions", '{"prompt": "0", "__proto__": {"": "", "": ["%s"]}}', "__proto__"),
    ("/completions", '{"prompt": "%s"}', "prompt"),
    ("/completions", '{"prompt": ["%s"]}', "prompt[0]"),
    ("/completions", '{"prompt": "hi", "stop": "%s"}', "stop"),
    ("/completions", '"%s"', None),                                                            # the body
])
def test_lone_surrogate_is_400_naming_the_field(mesh, route, body, param):
    err = _error(_post(mesh, route, body % SURROGATE), 400, param)
    assert "not valid Unicode" in err["message"] and err["type"] == "invalid_request_error"
    _served(mesh)


def test_a_surrogate_pair_and_hostile_text_are_served(mesh):
    content = "\\ud83d\\ude00 \\u202eRTL\\u202c e\\u0301\\u0300 \\u0000 NUL \\ufeff"     # escapes, not bytes
    r = _post(mesh, "/chat/completions", '{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 1}' % content)
    assert r.status_code == 200, r.text


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("where", ["messages", "unknown field"])
@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_json_is_400_before_any_recursive_decoding(mesh, monkeypatch, where, depth):
    import gateway.openai_protocol as oai
    loads = []
    monkeypatch.setattr(oai, "json", types.SimpleNamespace(       # the gateway's parser, not this test's
        loads=lambda *a, **kw: loads.append(1) or json.loads(*a, **kw), JSONDecodeError=json.JSONDecodeError))
    inner = _nested(depth - 2)          # in the body object and the array it sits in: depth in all
    body = ('{"messages": [%s, %s]}' % (MSG, inner) if where == "messages"
            else '{"messages": [%s], "max_tokens": 1, "x": [%s]}' % (MSG, inner))
    err = _error(_post(mesh, "/chat/completions", body), 400, None)
    assert f"at most {oai.MAX_JSON_DEPTH}" in err["message"] and loads == []
    monkeypatch.undo()
    _served(mesh)


def test_json_at_the_depth_bound_is_parsed(mesh):
    from gateway.openai_protocol import MAX_JSON_DEPTH, json_depth
    body = '{"messages": [%s], "max_tokens": 1, "x": [%s], "y": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}' % (
        MSG, _nested(MAX_JSON_DEPTH - 2))
    assert json_depth(body.encode()) == MAX_JSON_DEPTH        # brackets in strings do not count
    assert _post(mesh, "/chat/completions", body).status_code == 200


@pytest.mark.parametrize("body", [
    b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "temperature": -Infinity}',
    b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}",          # more digits than Python converts
    b'{"prompt": "hi\xff"}', b'{"prompt": "\xed\xa0\x80"}',        # not UTF-8; an encoded surrogate
    b"\xef\xbb\xbf" + b'{"prompt": "hi"}', b"\x00\x00\x00{", b"", b"   ",
])
def test_bodies_that_are_not_json_text_are_400(mesh, body):
    _error(_http(mesh.url + "/completions", "POST", body), 400, None)
    _served(mesh)


@pytest.mark.parametrize("value, param", [(1e400, "temperature"), (-1e400, "top_p"), (10**30, "max_tokens"),
                                          (-(10**30), "seed"), (2.5, "n"), ("1", "max_tokens")])
def test_huge_and_odd_numbers_are_400(mesh, value, param):
    body = '{"prompt": "hi", "%s": %s}' % (param, json.dumps(value))     # 1e400: Infinity in JSON as a float
    if value in (1e400, -1e400):
        body = body.replace("Infinity", "1e400")
    _error(_post(mesh, "/completions", body), 400, param)


def test_control_characters_in_ids_are_400_and_odd_ids_are_served(mesh):
    for name in ("request_id", "session_id"):
        body = json.dumps({"prompt": "hi", "max_tokens": 1, name: "a\r\nx-injected: 1"})
        _error(_post(mesh, "/completions", body), 400, name)
    r = _post(mesh, "/completions", json.dumps({"prompt": "hi", "max_tokens": 1, "request_id": " spaced id é "}))
    assert r.status_code == 200 and r.json()["id"] == "cmpl- spaced id é "
    assert r.headers["x-request-id"] == "%20spaced%20id%20%C3%A9%20"     # percent-encoded in the header


def test_internal_error_is_500_without_exception_text(mesh, monkeypatch, caplog):
    def boom(*a, **kw):
        raise RuntimeError("secret-detail-7731")
    monkeypatch.setattr(mesh.gw_http.path, "_sampling", boom)
    for body, rid in (({"prompt": "hi", "max_tokens": 1, "request_id": "my-id-1"}, "my-id-1"),
                      ({"prompt": "hi", "max_tokens": 1}, None)):
        with caplog.at_level("ERROR", logger="kvmesh.gateway.http"):
            r = _post(mesh, "/completions", json.dumps(body))
        err = _error(r, 500, None)
        assert (err["type"], err["code"]) == ("server_error", "internal_error")
        assert "secret-detail" not in r.text and "RuntimeError" not in r.text
        rid = rid or r.headers["x-request-id"]
        assert r.headers["x-request-id"] == rid and rid in err["message"]
        logged = [rec for rec in caplog.records if rid in rec.getMessage()]
        assert logged and "secret-detail-7731" in str(logged[-1].exc_info[1])     # the traceback is logged
    monkeypatch.undo()
    _served(mesh)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                          "application/jsonp", "text/json"])
def test_post_routes_want_json_content_type(mesh, content_type):
    import httpx2
    headers = {} if content_type is None else {"content-type": content_type}
    for route in ("/completions", "/chat/completions"):
        r = httpx2.post(mesh.url + route, content=json.dumps({"prompt": "hi", "messages": [{"role": "user",
                        "content": "hi"}], "max_tokens": 1}).encode(), headers=headers, timeout=60)
        assert r.status_code == 415, (route, content_type, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (None, "unsupported_media_type") and "application/json" in err["message"]


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=UTF-8",
                                          "application/json;charset=utf8", "application/json; foo=bar"])
def test_json_content_types_are_served(mesh, content_type):
    import httpx2
    r = httpx2.post(mesh.url + "/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                    headers={"content-type": content_type}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("size", [64 * 1024, 2**20])
def test_oversized_headers_get_431_and_a_clean_close(mesh, size):
    import httpx2
    bound = mesh.gw_http.path.cfg.max_header_bytes
    with httpx2.Client(timeout=60) as client:
        r = client.post(mesh.url + "/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                        headers={"content-type": "application/json", "authorization": "Bearer " + "k" * size})
        assert r.status_code == 431 and r.headers["connection"] == "close"
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (None, "request_header_fields_too_large") and str(bound) in err["message"]
        r = client.post(mesh.url + "/completions", content=b'{"prompt": "hi", "max_tokens": 1}',     # a new connection
                        headers={"content-type": "application/json", "authorization": "Bearer " + "k" * (bound // 2)})
        assert r.status_code == 200
    with openai.OpenAI(base_url=mesh.url, api_key="k" * size, max_retries=0, timeout=60) as client:
        with pytest.raises(openai.APIStatusError) as ei:
            client.completions.create(model="", prompt="hi", max_tokens=1)
        assert ei.value.status_code == 431 and ei.value.body["code"] == "request_header_fields_too_large"


def test_malformed_http_gets_400_with_the_error_body(mesh):
    host, port = mesh.gw_http.http.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):          # the server closes after its answer
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["param"] is None
    _served(mesh)
