"""Both public APIs fuzzed with Hypothesis (issue 37, item 7): one real gateway (gRPC and its
OpenAI-compatible HTTP port) in front of a real scheduler and engine (SmolLM2-135M, float32,
local executor, an engine process), over loopback.

Requests are built from the real schema: the HTTP bodies from the fields
:mod:`gateway.openai_protocol` reads (chat completions and completions), the gRPC requests from
the descriptors of ``kvmesh.v1.GenerateRequest`` and ``ChatRequest`` (protos/kvmesh/v1). Each
field is left out, given a value the schema allows, or a hostile one: any Unicode (lone
surrogates, NUL, RTL marks, combining marks, BOM, noncharacters), huge, negative, NaN and
infinite numbers, integers of thousands of digits, the wrong JSON type, empty and huge strings
and arrays, nesting thousands of levels deep. Bodies also get duplicate keys, unknown fields,
invalid UTF-8 (lone surrogates written raw) and whole bodies that are not an object, not JSON or
truncated. gRPC requests are encoded from the descriptors at the wire level too: strings of
invalid UTF-8, field values beyond their type's range, wrong wire types, unknown fields, huge
packed repeated fields, truncated messages.

Properties, for every request:

* HTTP: a complete answer (never a dropped connection), 2xx or 4xx, never 5xx. A 4xx has OpenAI's
  error body ``{"error": {"message", "type", "param", "code"}}`` whose ``param`` is null or
  names a field of the request (its path resolves in the body sent, or, for a required field
  that is missing, is a field of the schema). A 2xx is a whole completion (``finish_reason``,
  ``usage``), or a stream of JSON events ending ``data: [DONE]`` with no error event.
* gRPC: the stream ends with one final message (``finished``), or the call fails with
  INVALID_ARGUMENT whose message starts with the field it is about (``sampling.stop[0]: ...``;
  ``request`` for bytes that do not parse), DEADLINE_EXCEEDED (a tiny ``timeout``), or grpc's own
  RESOURCE_EXHAUSTED for a message over twice max_message_bytes: never INTERNAL, UNKNOWN,
  UNAVAILABLE or CANCELLED, nor a status the client cannot read.
* Right after it, a good request is served (the server and its connections keep working).
* After each test: the scheduler has 0 running and 0 waiting requests, 0 used KV blocks and no
  engine restart, and the gateway no request in flight.

The last tests replay, deterministically, what the fuzzer found (and the fixes made): stop
token ids past the vocabulary killing the engine loop, an integer past the largest float being
a 500, a huge value quoted back whole in a gRPC status message the client then refused.

Size: ``KVMESH_FUZZ_PROFILE`` = ``full`` (the default: 550 examples for each of the 4 tests,
2,200 requests) or ``fast`` (40 each, 160); ``KVMESH_FUZZ_EXAMPLES=N`` sets the examples per test.
Each test asserts it sent at least that many. A failure names the seed it ran with
(``KVMESH_FUZZ_SEED=N`` replays the run) and Hypothesis prints the shrunk example and its
``@reproduce_failure`` blob. The gateway caps ``max_tokens`` at 4, so a served request is cheap.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import os
import random
import re
import threading
import time

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kvmesh.v1 import common_pb2, llm_pb2, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.fuzz

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 256
MAX_MESSAGE_BYTES = 256 * 1024      # the gateway's max_message_bytes here: huge values cross it
VOCAB = 49152                       # SmolLM2's vocabulary (the gateway refuses ids at or over it)

# ---- settings profiles ----------------------------------------------------------------------------

_COMMON = dict(deadline=None, database=None, print_blob=True, phases=(Phase.generate, Phase.shrink),
               suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.large_base_example, HealthCheck.function_scoped_fixture))
settings.register_profile("kvmesh-fuzz-full", max_examples=550, **_COMMON)
settings.register_profile("kvmesh-fuzz-fast", max_examples=40, **_COMMON)
PROFILE = os.environ.get("KVMESH_FUZZ_PROFILE", "full")
if PROFILE not in ("full", "fast"):
    raise ValueError(f"KVMESH_FUZZ_PROFILE must be full or fast, got {PROFILE!r}")
FUZZ = settings(settings.get_profile(f"kvmesh-fuzz-{PROFILE}"),
                **({"max_examples": int(os.environ["KVMESH_FUZZ_EXAMPLES"])}
                   if os.environ.get("KVMESH_FUZZ_EXAMPLES") else {}))
SEED = int(os.environ.get("KVMESH_FUZZ_SEED") or random.SystemRandom().randrange(2**32))


OUTCOMES: collections.Counter = collections.Counter()     # what each test's answers were (printed: pytest -s)
SLOWEST: list[tuple[float, str]] = []                      # (seconds, outcome) of the slowest requests


def event(what: str) -> None:
    OUTCOMES[what] += 1


def _timed(check, *args) -> None:
    """Run ``check(*args)``, keeping its time with the outcome it recorded."""
    t0 = time.monotonic()
    before = OUTCOMES.copy()
    try:
        check(*args)
    finally:
        what = ", ".join(sorted((OUTCOMES - before).keys()))
        SLOWEST.append((time.monotonic() - t0, what))
        SLOWEST.sort(reverse=True)
        del SLOWEST[5:]


def _run_fuzz(name: str, test) -> None:
    """Run the Hypothesis test ``test`` under FUZZ with SEED; a failure says how to replay it."""
    OUTCOMES.clear()
    SLOWEST.clear()
    t0 = time.monotonic()
    try:
        seed(SEED)(FUZZ(test))()
        print(f"\n{name}: {sum(v for k, v in OUTCOMES.items() if ' param ' not in k)} requests in "
              f"{time.monotonic() - t0:.1f} s, seed {SEED}")
        for what, n in sorted(OUTCOMES.items(), key=lambda kv: -kv[1]):
            print(f"  {n:5d}  {what}")
        print("  slowest: " + "; ".join(f"{t:.2f} s {what}" for t, what in SLOWEST))
    except BaseException as e:
        e.add_note(f"{name}: fuzz seed {SEED} (profile {PROFILE}, {FUZZ.max_examples} examples): replay with "
                   f"KVMESH_FUZZ_SEED={SEED} KVMESH_FUZZ_PROFILE={PROFILE}")
        raise


# ---- the server ---------------------------------------------------------------------------------

class FuzzMesh:
    """A scheduler and one gateway (gRPC and HTTP) on an event loop in a background thread."""

    def __init__(self, smollm2_dir):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-mesh", daemon=True)
        self.thread.start()
        self.sched, self.gw = self.run(self._start())
        self.channel = grpc.insecure_channel(self.gw.address, options=[
            ("grpc.max_send_message_length", 64 * MAX_MESSAGE_BYTES)])   # the server's limits refuse them
        self.sched_channel = grpc.insecure_channel(self.sched.address)
        self.sched_stub = scheduler_pb2_grpc.SchedulerServiceStub(self.sched_channel)
        self.http_host, self.http_port = self.gw.http.address.rsplit(":", 1)

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        from gateway.server import serve_gateway
        from kvmesh.core.engine_config import EngineConfig
        from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
        from scheduler.service import serve_scheduler
        sched = await serve_scheduler(SchedulerConfig(executor="local", port=0),
                                      EngineConfig(model=MODEL, dtype="float32", kv_cache_memory=48 * 2**20,
                                                   max_model_len=MAX_MODEL_LEN))
        await sched.wait_ready()
        gw = await serve_gateway(GatewayConfig(port=0, http_port=0, scheduler_address=sched.address,
                                               # a loaded 2-core machine may take long over a 4-token request
                                               connect_timeout=60, default_timeout=120, max_timeout=300,
                                               max_tokens_cap=4, default_max_tokens=2,
                                               max_message_bytes=MAX_MESSAGE_BYTES))
        return sched, gw

    def close(self):
        self.channel.close()
        self.sched_channel.close()
        self.run(self.gw.stop(0))
        self.run(self.sched.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def assert_idle(self, timeout: float = 15.0) -> None:
        """0 running, 0 waiting, 0 used blocks in the scheduler (within ``timeout`` seconds: an
        aborted request frees its blocks at the engine's next step) and nothing in flight here."""
        end = time.monotonic() + timeout
        while True:
            r = self.sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).replicas[0]
            idle = (r.num_running, r.num_waiting, r.num_used_blocks) == (0, 0, 0)
            if idle or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert (r.num_running, r.num_waiting, r.num_used_blocks) == (0, 0, 0), r
        assert r.healthy and r.restarts == 0, r
        assert not self.gw.path.live

    # ---- HTTP ----
    def post(self, route: str, body: bytes) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a POST; any connection failure fails the test."""
        conn = http.client.HTTPConnection(self.http_host, int(self.http_port), timeout=60)
        try:
            conn.request("POST", route, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        except (OSError, http.client.HTTPException) as e:
            raise AssertionError(f"the connection failed instead of an answer: {e!r}") from None
        finally:
            conn.close()

    def http_still_serves(self) -> None:
        status, _, data = self.post("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}')
        assert status == 200, (status, data[:500])
        assert json.loads(data)["usage"]["completion_tokens"] == 1

    # ---- gRPC ----
    def call(self, method: str, data: bytes) -> list[llm_pb2.GenerateResponse]:
        rpc = self.channel.unary_stream(f"/kvmesh.v1.LLMService/{method}", request_serializer=lambda b: b,
                                        response_deserializer=llm_pb2.GenerateResponse.FromString)
        return list(rpc(data, timeout=60))

    def grpc_still_serves(self) -> None:
        req = llm_pb2.GenerateRequest(prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=1))
        msgs = self.call("Generate", req.SerializeToString())
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 1


@pytest.fixture(scope="module")
def fuzz_mesh(smollm2_dir):
    m = FuzzMesh(smollm2_dir)
    yield m
    m.close()


# ---- hostile values ---------------------------------------------------------------------------------

SPECIALS = ["\x00", "\u200f", "\u200e", "\u202e", "\u2066", "\u0301", "\u0308\u0308\u0308", "\ufeff", "\uffff",
            "\ufffe", "\U0010ffff", "\U0001f600", "\u2028", "\x7f", "\x85", "\x1b[31m", "\r\n", "\\", '"', "'",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{", "{%", "%}", "\t", " ", "", "é", "漢字"]
SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"]
_PIECES = st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(SPECIALS))
# st.characters() draws lone surrogates too, now and then; SURROGATES makes them common enough
_PIECES_SURROGATES = st.one_of(st.characters(), st.sampled_from(SPECIALS), st.characters(), st.sampled_from(SPECIALS),
                               st.sampled_from(SURROGATES))


def _pieces(max_size: int, min_size: int = 0, surrogates: bool = False) -> st.SearchStrategy[str]:
    """Text of up to ``max_size`` pieces: any character (a lone surrogate only with
    ``surrogates``) or one of SPECIALS."""
    return st.lists(_PIECES_SURROGATES if surrogates else _PIECES, min_size=min_size, max_size=max_size).map("".join)


@st.composite
def _text(draw, surrogates: bool) -> str:
    """Text of any characters (with ``surrogates``, lone surrogates too): mostly short, at times
    long, now and then a huge run (up to 2/3 of max_message_bytes characters)."""
    size = draw(st.sampled_from(["short"] * 12 + ["long"] * 2 + ["huge"]))
    if size == "huge":
        return draw(st.sampled_from(SPECIALS + ["a", "ab "])) * draw(st.integers(1000, 2 * MAX_MESSAGE_BYTES // 3))
    return draw(_pieces(40 if size == "short" else 600, surrogates=surrogates))


# raw JSON numbers: what json.dumps writes and what it never writes
_RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E-999", "-0", "0.0", "-0.0", "1e308",
                "18446744073709551616", "-9223372036854775809", "4294967296", "2147483648", "0.5e1", "1" * 5000,
                "-" + "9" * 4400, "1" + "0" * 400, "1.0000000000000000000000001", "2e0", "01", "+1", ".5", "0x10"]


def _json_text(v, ensure_ascii: bool) -> str:
    return json.dumps(v, ensure_ascii=ensure_ascii, allow_nan=True)


@st.composite
def hostile_json(draw, depth: int = 0) -> str:
    """The JSON text of a hostile value (sometimes not valid JSON at all)."""
    kinds = ["text"] * 3 + ["int"] * 2 + ["float", "raw", "const"] * 2
    if depth < 2:
        kinds += ["array"] * 2 + ["object"] * 2 + ["deep", "huge_array"]
    kind = draw(st.sampled_from(kinds))
    ascii_ = draw(st.booleans())
    if kind == "text":
        return _json_text(draw(_text(surrogates=True)), ascii_)
    if kind == "int":
        return str(draw(st.one_of(st.integers(), st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, 2**64, -2**64]))))
    if kind == "float":
        return _json_text(draw(st.floats(allow_nan=True, allow_infinity=True)), ascii_)
    if kind == "raw":
        return draw(st.sampled_from(_RAW_NUMBERS))
    if kind == "const":
        return draw(st.sampled_from(["true", "false", "null", "[]", "{}", '""', "[null]", '{"":""}']))
    if kind == "array":
        return "[" + ",".join(draw(st.lists(hostile_json(depth + 1), max_size=4))) + "]"
    if kind == "object":
        pairs = draw(st.lists(st.tuples(_text(surrogates=True), hostile_json(depth + 1)), max_size=3))
        return "{" + ",".join(f"{_json_text(k, ascii_)}:{v}" for k, v in pairs) + "}"
    if kind == "deep":
        n = draw(st.sampled_from([1, 63, 64, 65, 200, 1000, 5000, 30_000]))
        if draw(st.booleans()):
            return "[" * n + "]" * n
        return '{"a":' * n + "1" + "}" * n
    n = draw(st.sampled_from([0, 1000, 1000, 60_000]))
    return "[" + ",".join([draw(st.sampled_from(["0", "1", '"x"', "null", "-1"]))] * n) + "]"


# ---- the HTTP schema (gateway/openai_protocol.py) ---------------------------------------------------

def _v(strategy, ascii_: bool = True):
    return strategy.map(lambda v: _json_text(v, ascii_))


_SMALL_TEXT = _pieces(20)
_IDS = st.text(st.characters(exclude_categories=["Cs", "Cc"]), max_size=20)     # no control characters
COMMON_FIELDS = {
    "model": _v(st.sampled_from(["", MODEL])),
    "temperature": _v(st.one_of(st.floats(0, 2), st.integers(0, 2))),
    "top_p": _v(st.floats(0.01, 1)),
    "top_k": _v(st.one_of(st.just(-1), st.integers(1, 100))),
    "min_p": _v(st.floats(0, 1)),
    "repetition_penalty": _v(st.floats(0.5, 2)),
    "presence_penalty": _v(st.floats(-2, 2)),
    "frequency_penalty": _v(st.floats(-2, 2)),
    "seed": _v(st.integers(0, 2**64 - 1)),
    "max_tokens": _v(st.integers(1, 8)),
    "max_completion_tokens": _v(st.integers(1, 8)),
    "min_tokens": _v(st.integers(0, 4)),
    "stop": _v(st.one_of(_pieces(8, min_size=1), st.lists(_pieces(8, min_size=1), max_size=4)), False),
    "stop_token_ids": _v(st.lists(st.integers(0, VOCAB - 1), max_size=4)),
    "ignore_eos": _v(st.booleans()),
    "skip_special_tokens": _v(st.booleans()),
    "stream": _v(st.booleans()),
    "stream_options": _v(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "n": _v(st.just(1)),
    "user": _v(_SMALL_TEXT, False),
    "request_id": _v(_IDS, False),
    "session_id": _v(_IDS, False),
    "tools": _v(st.just([])),
    "tool_choice": _v(st.sampled_from(["none", "auto"])),
    "response_format": _v(st.just({"type": "text"})),
    "logit_bias": _v(st.just({})),
}
_ROLES = st.sampled_from(["system", "user", "assistant", "developer"])
_CONTENT = st.one_of(_SMALL_TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _SMALL_TEXT}),
                                           max_size=3))
CHAT_FIELDS = dict(COMMON_FIELDS, **{
    "messages": _v(st.lists(st.fixed_dictionaries({"role": _ROLES, "content": _CONTENT}), min_size=1, max_size=4),
                   False),
    "logprobs": _v(st.booleans()),
    "top_logprobs": _v(st.integers(0, 20)),
})
COMPLETION_FIELDS = dict(COMMON_FIELDS, **{
    "prompt": _v(st.one_of(_SMALL_TEXT.filter(bool), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
                           st.lists(_SMALL_TEXT.filter(bool), min_size=1, max_size=1)), False),
    "logprobs": _v(st.integers(0, 5)),
    "echo": _v(st.just(False)),
    "best_of": _v(st.just(1)),
    "suffix": _v(st.just("")),
})
REQUIRED = {"messages": '[{"role": "user", "content": "Hi"}]', "prompt": '"Hi"'}


@st.composite
def http_body(draw, fields: dict) -> bytes:
    """A request body from ``fields`` (name -> strategy of a valid value's JSON text): each field
    left out, valid or hostile; the required one (messages, prompt) mostly present; then
    duplicate keys, unknown fields, raw (invalid UTF-8) or escaped surrogates, or a whole body
    that is not an object."""
    whole = draw(st.sampled_from(["object"] * 14 + ["other"]))
    if whole == "other":
        return draw(st.one_of(
            st.sampled_from([b"", b" ", b"null", b"[]", b"[{}]", b'"x"', b"1", b"NaN", b"{", b'{"prompt":', b"{}}",
                             b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b'{"a":1}garbage', b"{'a': 1}"]),
            hostile_json().map(lambda t: t.encode("utf-8", "surrogatepass")),
            st.binary(max_size=64)))
    # a few fields hostile (none, one, two, or many), the others left out or valid
    names = list(fields)
    k = draw(st.sampled_from([0] * 4 + [1] * 4 + [2] + [len(names)]))
    hostile = set(draw(st.lists(st.sampled_from(names), min_size=k, max_size=k)) if k < len(names)
                  else draw(st.sets(st.sampled_from(names))))
    pairs = []
    for name, valid in fields.items():
        if name in hostile:
            pairs.append((name, draw(hostile_json())))
        elif draw(st.sampled_from([True] * 9 + [False]) if name in REQUIRED else st.integers(0, 9).map(lambda i: i < 3)):
            pairs.append((name, draw(valid)))
    keys = {n for n, _ in pairs}
    # what a valid field needs besides it: stream for stream_options, logprobs for top_logprobs
    for name, needs in (("stream_options", "stream"), ("top_logprobs", "logprobs")):
        if name in keys and name not in hostile and needs not in keys and draw(st.sampled_from([True] * 4 + [False])):
            pairs.append((needs, "true"))
    for _ in range(draw(st.sampled_from([0] * 4 + [1, 2]))):     # unknown fields
        pairs.append((draw(st.one_of(_text(surrogates=True), st.sampled_from(["__proto__", "", "a.b", "x[0]"]))),
                      draw(hostile_json())))
    if pairs and draw(st.integers(0, 4)) == 0:          # a duplicate key, another value
        name, _ = draw(st.sampled_from(pairs))
        pairs.insert(draw(st.integers(0, len(pairs))), (name, draw(st.one_of(hostile_json(), fields.get(
            name, hostile_json())))))
    pairs = draw(st.permutations(pairs))
    text = "{" + ",".join(f"{_json_text(k, True)}:{v}" for k, v in pairs) + "}"
    # raw: a lone surrogate written as itself is not UTF-8 (the body), escaped it is a field's
    return text.encode("utf-8", "surrogatepass")


_SEGMENT = re.compile(r"([A-Za-z_]\w*)|\[(\d+)\]")


def _resolves(param: str, body) -> bool:
    """Whether ``param`` (``messages[1].content``, ``stream_options.include_usage``) is a path in ``body``."""
    node, pos = body, 0
    while pos < len(param):
        m = _SEGMENT.match(param, pos)
        if m is None:
            return False
        name, index = m.groups()
        if name is not None:
            if not isinstance(node, dict) or name not in node:
                return False
            node = node[name]
        else:
            if not isinstance(node, list) or int(index) >= len(node):
                return False
            node = node[int(index)]
        pos = m.end()
        if pos < len(param) and param[pos] == ".":
            pos += 1
    return True


def _parsed(body: bytes):
    """The body as the server reads it (None if it is not a JSON object)."""
    try:
        v = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return v if isinstance(v, dict) else None


def check_http(route: str, fields: dict, body: bytes, status: int, headers: dict, data: bytes) -> None:
    """The HTTP properties of one answer (module docstring)."""
    event(f"HTTP {status}")            # pytest --hypothesis-show-statistics: what the run reached
    assert status < 500, (status, data[:1000])
    assert 200 <= status < 300 or 400 <= status < 500, status
    if status >= 400:
        err = json.loads(data)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        e = err["error"]
        assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str), err
        assert e["code"] is None or isinstance(e["code"], str), err
        assert e["code"] != "internal_error", err
        param = e["param"]
        event(f"HTTP {status} param {param}")
        if param is not None:
            assert isinstance(param, str), err
            obj = _parsed(body)
            assert obj is not None, f"param {param!r} for a body that is not a JSON object: {err}"
            root = _SEGMENT.match(param)
            assert root is not None and root.group(1), err
            assert _resolves(param, obj) or (param == root.group(1) and param in fields), \
                f"param {param!r} names no field of the request: {err}"
        return
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in data.decode().split("\n\n") if line]
        assert events and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(ev) for ev in events[:-1]]
        assert not [c for c in chunks if "error" in c], chunks
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), chunks
    else:
        out = json.loads(data)
        assert out["choices"][0]["finish_reason"] in ("stop", "length"), out
        assert out["usage"]["completion_tokens"] <= 4, out


def _http_fuzz(fuzz_mesh, route: str, fields: dict, name: str) -> None:
    sent = []

    @given(http_body(fields))
    def one(body: bytes):
        sent.append(len(body))
        _timed(lambda: check_http(route, fields, body, *fuzz_mesh.post(route, body)))
        fuzz_mesh.http_still_serves()

    _run_fuzz(name, one)
    assert len(sent) >= FUZZ.max_examples
    fuzz_mesh.assert_idle()


def test_fuzz_http_chat_completions(fuzz_mesh):
    _http_fuzz(fuzz_mesh, "/v1/chat/completions", CHAT_FIELDS, "test_fuzz_http_chat_completions")


def test_fuzz_http_completions(fuzz_mesh):
    _http_fuzz(fuzz_mesh, "/v1/completions", COMPLETION_FIELDS, "test_fuzz_http_completions")


# ---- gRPC: messages from the descriptors (protos/kvmesh/v1) -------------------------------------------

FD = type(llm_pb2.GenerateRequest.DESCRIPTOR.fields[0])
_INT_RANGES = {FD.TYPE_INT32: (-2**31, 2**31 - 1), FD.TYPE_INT64: (-2**63, 2**63 - 1),
               FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_UINT64: (0, 2**64 - 1)}
# values the schema means (proto comments), drawn besides the type's whole range
_VALID = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.sampled_from([-1, 1, 5, 50]),
          "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
          "frequency_penalty": st.floats(-2, 2), "max_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 4),
          "logprobs": st.integers(0, 20), "role": st.sampled_from(["system", "user", "assistant"]),
          "model": st.sampled_from(["", MODEL]), "ids": st.integers(0, VOCAB - 1),
          "stop_token_ids": st.integers(0, VOCAB - 1), "seconds": st.integers(1, 30), "nanos": st.integers(0, 999_999_999),
          "prompt": _pieces(40, min_size=1), "content": _pieces(40),
          "request_id": st.one_of(st.just(""), st.uuids().map(str)), "session_id": st.sampled_from(["", "s1", "s2"]),
          "cache_salt": st.sampled_from(["", "a", "tenant-b"]), "stop": _pieces(8, min_size=1),
          "seed": st.integers(0, 2**32), "skip_special_tokens": st.booleans(), "ignore_eos": st.booleans()}


def _scalar(field) -> st.SearchStrategy:
    if field.type == FD.TYPE_STRING:
        return _text(surrogates=False)
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if field.type == FD.TYPE_FLOAT else 64)
    if field.type in _INT_RANGES:
        lo, hi = _INT_RANGES[field.type]
        return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, max(lo, -1), 1]))
    if field.type == FD.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise AssertionError(f"no strategy for {field.full_name}")


@st.composite
def proto_message(draw, desc, depth: int = 0):
    """A message of ``desc`` with a few fields (none, one, two or all) holding any value of their
    type, the others left out or valid (``_VALID``); repeated fields empty, short or (scalars)
    huge; one member of each oneof at most."""
    out = GetMessageClass(desc)()
    oneof_taken = set()
    names = [f.name for f in desc.fields]
    k = draw(st.sampled_from([0] * 3 + [1] * 4 + [2] * 2 + [len(names)]))
    hostile = set(draw(st.lists(st.sampled_from(names), min_size=k, max_size=k)) if k < len(names)
                  else draw(st.sets(st.sampled_from(names))))
    for f in desc.fields:
        if f.containing_oneof is not None:
            if f.containing_oneof.name in oneof_taken:
                continue
        how = "any" if f.name in hostile else draw(st.sampled_from(["absent"] * 2 + ["valid"] * 3))
        if how == "absent":
            continue
        if f.containing_oneof is not None:
            oneof_taken.add(f.containing_oneof.name)
        if f.type == FD.TYPE_MESSAGE:
            if f.is_repeated:
                n = draw(st.sampled_from([0, 1, 2, 3] if how == "valid" else [0, 1, 5, 300]))
                sub = draw(proto_message(f.message_type, depth + 1)) if n else None
                for _ in range(n):
                    getattr(out, f.name).add().CopyFrom(sub if how == "any" else draw(proto_message(f.message_type,
                                                                                                  depth + 1)))
            elif depth < 3:
                getattr(out, f.name).CopyFrom(draw(proto_message(f.message_type, depth + 1)))
            continue
        value = _VALID[f.name] if how == "valid" and f.name in _VALID else _scalar(f)
        if f.is_repeated:
            if draw(st.integers(0, 14)) == 0:            # huge
                getattr(out, f.name).extend([draw(value)] * draw(st.sampled_from([1000, 20_000, 70_000])))
            else:
                getattr(out, f.name).extend(draw(st.lists(value, max_size=5)))
        else:
            setattr(out, f.name, draw(value))
    return out


def _varint(n: int) -> bytes:
    n &= 2**64 - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
    key = _varint(number << 3 | wire)
    if wire == 0:
        return key + _varint(payload)
    if wire == 2:
        return key + _varint(len(payload)) + payload
    return key + payload


def _string_paths(desc, depth: int = 0) -> list[tuple[int, ...]]:
    """Field-number paths of the string fields of ``desc`` (through message fields)."""
    paths = []
    for f in desc.fields:
        if f.type == FD.TYPE_STRING:
            paths.append((f.number,))
        elif f.type == FD.TYPE_MESSAGE and depth < 3:
            paths += [(f.number, *p) for p in _string_paths(f.message_type, depth + 1)]
    return paths


_BAD_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"a\xe2\x82", b"\x80abc", b"\xfe\xff"]


@st.composite
def wire_mutation(draw, desc) -> bytes:
    """Bytes appended to a serialized ``desc``: an invalid UTF-8 string (at any depth), an
    unknown field, a wrong wire type for a known field, a huge packed field, or garbage."""
    kind = draw(st.sampled_from(["bad_utf8", "unknown", "wrong_wire", "huge_packed", "garbage"]))
    if kind == "bad_utf8":
        path = draw(st.sampled_from(_string_paths(desc)))
        payload = draw(st.binary(max_size=8)) + draw(st.sampled_from(_BAD_UTF8)) + draw(st.binary(max_size=8))
        data = _field(path[-1], 2, payload)
        for number in reversed(path[:-1]):
            data = _field(number, 2, data)
        return data
    if kind == "unknown":
        number = draw(st.integers(20, 2**29 - 1))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        payload = {0: draw(st.integers(0, 2**64 - 1)), 1: draw(st.binary(min_size=8, max_size=8)),
                   2: draw(st.binary(max_size=64)), 5: draw(st.binary(min_size=4, max_size=4))}[wire]
        return _field(number, wire, payload)
    if kind == "wrong_wire":
        f = draw(st.sampled_from(list(desc.fields)))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        payload = {0: draw(st.integers(0, 2**64 - 1)), 1: b"\x00" * 8, 2: draw(st.binary(max_size=16)),
                   5: b"\x00" * 4}[wire]
        return _field(f.number, wire, payload)
    if kind == "huge_packed":
        path = draw(st.sampled_from([p for p in _packed_paths(desc)] or [(1,)]))
        n = draw(st.sampled_from([10_000, 60_000, 200_000]))
        data = _field(path[-1], 2, _varint(draw(st.integers(0, 2**32 - 1))) * n)
        for number in reversed(path[:-1]):
            data = _field(number, 2, data)
        return data
    return draw(st.binary(min_size=1, max_size=32))


def _packed_paths(desc, depth: int = 0) -> list[tuple[int, ...]]:
    paths = []
    for f in desc.fields:
        if f.is_repeated and f.type in _INT_RANGES:
            paths.append((f.number,))
        elif f.type == FD.TYPE_MESSAGE and not f.is_repeated and depth < 2:
            paths += [(f.number, *p) for p in _packed_paths(f.message_type, depth + 1)]
    return paths


@st.composite
def grpc_request(draw, cls) -> bytes:
    """The wire bytes of a ``cls`` request: built from its descriptor, then (a third of the
    time) mutated at the wire level or truncated."""
    msg = draw(proto_message(cls.DESCRIPTOR))
    # the input a request needs, mostly (Hypothesis favours a sampled list's first element)
    if cls is llm_pb2.ChatRequest and not msg.messages and draw(st.sampled_from([True] * 4 + [False])):
        msg.messages.add(role="user", content="Hi")
    if cls is llm_pb2.GenerateRequest and msg.WhichOneof("input") is None and draw(st.sampled_from([True] * 4 + [False])):
        msg.prompt = "Hi"
    data = msg.SerializeToString()
    how = draw(st.sampled_from(["as is"] * 4 + ["mutate"] * 2 + ["truncate"]))
    if how == "mutate":
        parts = [data] + draw(st.lists(wire_mutation(cls.DESCRIPTOR), min_size=1, max_size=3))
        data = b"".join(draw(st.permutations(parts)))
    elif how == "truncate" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    return data


_DETAILS_FIELD = re.compile(r"^([A-Za-z_]\w*)")


def check_grpc(cls, method: str, fuzz_mesh, data: bytes) -> None:
    """The gRPC properties of one call (module docstring)."""
    try:
        msgs = fuzz_mesh.call(method, data)
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
        event(f"gRPC {code.name}: {(details or '').split(':')[0][:40]}")
        # INVALID_ARGUMENT from the gateway; DEADLINE_EXCEEDED for a tiny timeout; RESOURCE_EXHAUSTED
        # from grpc itself for a message over twice max_message_bytes. Never INTERNAL, UNKNOWN,
        # UNAVAILABLE, CANCELLED, nor an answer the client cannot read (its metadata too large).
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.RESOURCE_EXHAUSTED), (code, details[:2000])
        assert details, code
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert len(data) > 2 * MAX_MESSAGE_BYTES, (len(data), details[:2000])
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            m = _DETAILS_FIELD.match(details)
            roots = {f.name for f in cls.DESCRIPTOR.fields} | {"request", "prompt"}
            assert m and m.group(1) in roots, f"INVALID_ARGUMENT names no field: {details!r}"
        return
    event("gRPC OK")
    assert msgs and msgs[-1].finished and not any(m.finished for m in msgs[:-1]), msgs[-1:]
    assert msgs[-1].usage.completion_tokens <= 4


def _grpc_fuzz(fuzz_mesh, cls, method: str, name: str) -> None:
    sent = []

    @given(grpc_request(cls))
    def one(data: bytes):
        sent.append(len(data))
        _timed(check_grpc, cls, method, fuzz_mesh, data)
        fuzz_mesh.grpc_still_serves()

    _run_fuzz(name, one)
    assert len(sent) >= FUZZ.max_examples
    fuzz_mesh.assert_idle()


def test_fuzz_grpc_generate(fuzz_mesh):
    _grpc_fuzz(fuzz_mesh, llm_pb2.GenerateRequest, "Generate", "test_fuzz_grpc_generate")


def test_fuzz_grpc_chat(fuzz_mesh):
    _grpc_fuzz(fuzz_mesh, llm_pb2.ChatRequest, "Chat", "test_fuzz_grpc_chat")


# ---- what the fuzzer found ----------------------------------------------------------------------------

def test_error_messages_quote_a_huge_value_shortly(fuzz_mesh):
    """An unknown model or role of 100,000 characters is INVALID_ARGUMENT naming the field, its
    value quoted by its first 64 characters: the message once quoted all of it, and over gRPC a
    client refuses a status message that large (RESOURCE_EXHAUSTED instead of the answer)."""
    huge = "\u202e" + "x" * 100_000
    for method, req in (("Generate", llm_pb2.GenerateRequest(model=huge, prompt="Hi")),
                        ("Chat", llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(role=huge, content="Hi")]))):
        with pytest.raises(grpc.RpcError) as e:
            fuzz_mesh.call(method, req.SerializeToString())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()[:300]
        assert e.value.details().startswith("model: unknown model" if method == "Generate" else "messages[0].role")
        assert "(100001 characters)" in e.value.details() and len(e.value.details()) < 300
    for route, body in (("/v1/completions", {"model": huge, "prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": huge, "content": "Hi"}]})):
        status, _, data = fuzz_mesh.post(route, json.dumps(body).encode())
        err = json.loads(data)["error"]
        assert status in (400, 404) and err["param"] in ("model", "messages[0].role"), err
        assert len(err["message"]) < 300, err
    fuzz_mesh.grpc_still_serves()


def test_stop_token_ids_outside_the_vocabulary_under_min_tokens(fuzz_mesh):
    """Stop token ids past the vocabulary with min_tokens are served (they never match): they
    once were logit indexes in the engine, whose loop died of it (IndexError) and whose process
    was restarted, failing every request in flight; the engine stays up."""
    before = fuzz_mesh.sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).replicas[0].restarts
    req = llm_pb2.GenerateRequest(prompt="Hi", sampling=common_pb2.SamplingParams(
        max_tokens=3, min_tokens=2, ignore_eos=True, stop_token_ids=[2**32 - 1, 1_747_579]))
    msgs = fuzz_mesh.call("Generate", req.SerializeToString())
    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 3
    status, _, data = fuzz_mesh.post("/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 3, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [2**32 - 1]}).encode())
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3, data
    assert fuzz_mesh.sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).replicas[0].restarts == before


def test_an_integer_past_the_largest_float_is_400_naming_the_field(fuzz_mesh):
    """A float field given an integer of 400 digits is 400 naming the field (it was a 500:
    OverflowError converting it to a float)."""
    for route, body in (("/v1/completions", b'{"prompt": "Hi", "repetition_penalty": 1' + b"0" * 400 + b"}"),
                        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
                                                 b'"temperature": -' + b"9" * 400 + b"}")):
        status, _, data = fuzz_mesh.post(route, body)
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] in ("repetition_penalty", "temperature"), err
        assert "out of range" in err["message"], err
