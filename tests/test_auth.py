"""API keys of the public gateway (gateway/auth.py): the key store, and the gateway with keys (gRPC
and its OpenAI-compatible HTTP port) in front of a real scheduler (local executor, SmolLM2-135M
float32) over loopback.

The gateway reads a keys file this module writes (two tenants, acme with two keys, globex with
one); revocation rewrites the file. Refusals must not say which keys or tenants exist; the
constant-time check is verified by recording every :func:`hmac.compare_digest` call (no timed
assertions here).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gateway import auth
from gateway.auth import ApiKeys, cache_salt
from kvmesh.client import Client, collect
from kvmesh.core.errors import EngineError
from kvmesh.v1 import llm_pb2, llm_pb2_grpc

ACME_1, ACME_2, GLOBEX = "sk-acme-0123456789abcdef", "sk-acme-rotated-fedcba9876", "sk-globex-00112233445566"
KEYS_FILE = f"# tenants of the test\nacme:{ACME_1}\nacme:{ACME_2}\n\nglobex:{GLOBEX}\n"


# ---- the key store ---------------------------------------------------------------------------------

def _write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)          # a new inode: seen as a change even within one mtime tick


def test_keys_file_and_env_give_tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    keys = ApiKeys.load(str(path), env={auth.ENV_KEYS: "initech:sk-initech-1, umbrella:sk-umbrella-2"})
    assert keys.tenants == ("acme", "globex", "initech", "umbrella")
    assert keys.tenant_for(f"Bearer {ACME_1}") == "acme"
    assert keys.tenant_for(f"bearer   {ACME_2} ") == "acme"        # scheme in any case, spaces trimmed
    assert keys.tenant_for(f"Bearer {GLOBEX}") == "globex"
    assert keys.tenant_for("Bearer sk-umbrella-2") == "umbrella"
    for bad in (None, "", ACME_1, f"Basic {ACME_1}", "Bearer ", f"Bearer {ACME_1}x", f"Bearer {ACME_1[:-1]}"):
        assert keys.tenant_for(bad) is None, bad
    assert ApiKeys.load("", env={}) is None                              # keys off
    assert ApiKeys.load("", env={auth.ENV_KEYS: "  "}) is None


def test_only_digests_are_kept(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    keys = ApiKeys(str(path), "initech:sk-initech-secret")

    def strings(obj, seen=None):
        seen = seen if seen is not None else set()
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (str, bytes)):
            yield obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from strings(k, seen)
                yield from strings(v, seen)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                yield from strings(v, seen)
        elif hasattr(obj, "__dict__"):
            yield from strings(vars(obj), seen)

    held = list(strings(keys))
    assert held, "nothing inspected"
    for key in (ACME_1, ACME_2, GLOBEX, "sk-initech-secret"):
        assert not any(key in (s if isinstance(s, str) else s.decode("latin-1")) for s in held)
        assert not any(key.encode() in (s.encode() if isinstance(s, str) else s) for s in held)


@pytest.mark.parametrize("text, message", [
    ("acme", "entry 1: expected TENANT:KEY"),
    ("\n\nacme:", "entry 3: the key of tenant 'acme' is empty"),
    ("bad tenant:sk-1", "tenant 'bad tenant' must match"),
    ("acme:sk one", "holds whitespace"),
    ("acme:sk-dup\nglobex:sk-dup", "entry 2: a key is listed twice"),
])
def test_bad_keys_file_names_the_entry_not_the_key(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(EngineError, match=message) as e:
        ApiKeys(str(path))
    assert str(path) in str(e.value)
    assert "sk-" not in str(e.value)
    with pytest.raises(EngineError, match="api_keys_file: cannot read"):
        ApiKeys(str(tmp_path / "missing"))


def test_revoked_key_is_refused_after_the_file_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    keys = ApiKeys(str(path))
    assert keys.tenant_for(f"Bearer {ACME_1}") == "acme"
    _write(path, KEYS_FILE.replace(f"acme:{ACME_1}\n", ""))             # revoke ACME_1
    assert keys.tenant_for(f"Bearer {ACME_1}") is None
    assert keys.tenant_for(f"Bearer {ACME_2}") == "acme"
    _write(path, "acme:\n")                                              # broken: the keys in use stay
    assert keys.tenant_for(f"Bearer {ACME_2}") == "acme"
    assert not keys.reload()
    path.unlink()                                                        # gone: the same
    assert keys.tenant_for(f"Bearer {GLOBEX}") == "globex"
    _write(path, "")                                                     # every key revoked: none passes
    assert keys.tenant_for(f"Bearer {GLOBEX}") is None and keys.tenants == ()


def _edit_in_place(path, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` (the same length) in the file, writing into the same inode, and
    put its modification time back (``cp -p``, some configuration tools): size, inode and mtime
    stay as they were."""
    assert len(old) == len(new)
    st = os.stat(path)
    text = path.read_text()
    with open(path, "r+") as f:
        f.write(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_mtime_ns, after.st_size, after.st_ino) == (st.st_mtime_ns, st.st_size, st.st_ino)


def test_an_edit_keeping_size_inode_and_mtime_is_seen(tmp_path):
    """Issue 37, 6: the change time (which os.utime sets too) says the file changed."""
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    keys = ApiKeys(str(path))
    assert keys.tenant_for(f"Bearer {ACME_1}") == "acme"
    rotated = ACME_1[:-4] + "wxyz"
    _edit_in_place(path, ACME_1, rotated)
    assert keys.tenant_for(f"Bearer {ACME_1}") is None              # the next check, no SIGHUP
    assert keys.tenant_for(f"Bearer {rotated}") == "acme"


def test_an_edit_no_stat_field_shows_is_seen_by_its_hash_within_a_second(tmp_path, monkeypatch):
    """Where no stat field changes (a filesystem's coarse timestamps), the SHA-256 of the bytes,
    read at most once every HASH_INTERVAL seconds, says it."""
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    keys = ApiKeys(str(path))
    now = [100.0]
    keys._clock = lambda: now[0]
    keys._stamp_of = lambda st: (1, 2, 3, 4)                        # stat never shows a change
    keys.reload()
    reads = []
    real_open = open

    def counting_open(file, *a, **kw):
        reads.append(file)
        return real_open(file, *a, **kw)

    rotated = ACME_1[:-4] + "wxyz"
    _edit_in_place(path, ACME_1, rotated)
    monkeypatch.setattr(auth, "open", counting_open, raising=False)     # the module's reads of the file
    for _ in range(50):                                             # within the interval: no read at all
        now[0] += auth.HASH_INTERVAL / 100
        assert keys.tenant_for(f"Bearer {ACME_1}") == "acme"
    assert reads == []
    now[0] += auth.HASH_INTERVAL / 2
    assert keys.tenant_for(f"Bearer {ACME_1}") is None              # hashed, changed: reloaded
    assert keys.tenant_for(f"Bearer {rotated}") == "acme"
    assert len(reads) == 2                                          # one hash, one reload
    now[0] += auth.HASH_INTERVAL
    assert keys.tenant_for(f"Bearer {rotated}") == "acme" and len(reads) == 3    # hashed, unchanged


def test_every_digest_is_compared_in_constant_time(tmp_path, monkeypatch):
    """A wrong key sharing all but its last character with a real one, and one sharing nothing,
    cost the same: the presented key's SHA-256 is compared with every stored digest through
    hmac.compare_digest, all of them each time, with equal-length arguments."""
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    keys = ApiKeys(str(path))
    calls: list[tuple[int, int]] = []
    real = auth.hmac.compare_digest

    def recording(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    seen = {}
    for name, value in (("near miss", ACME_1[:-1] + "X"), ("far miss", "Z" * len(ACME_1)), ("first key", ACME_1),
                        ("last key", GLOBEX)):
        calls.clear()
        keys.tenant_for(f"Bearer {value}")
        seen[name] = list(calls)
    assert all(c == [(32, 32)] * 3 for c in seen.values()), seen


def test_cache_salt_separates_tenants_and_hides_them():
    assert cache_salt("", "") == ""                                      # no tenant, no salt: unpartitioned
    a, b = cache_salt("acme"), cache_salt("globex")
    assert len({a, b, cache_salt("acme", "x"), cache_salt("", "acme"), cache_salt("acme", "x\0")}) == 5
    assert a == cache_salt("acme", "") and len(a) == 64 and "acme" not in a
    # a client cannot pick another tenant's salt: the tenant is always part of it
    assert cache_salt("globex", "") != cache_salt("acme", "") and cache_salt("globex", "acme") != a


# ---- through the gateway --------------------------------------------------------------------------

class KeyedMesh:
    """A scheduler and a gateway with API keys on an event loop in a background thread;
    ``sched_kw``/``engine_kw``/``gw_kw`` change the settings (tests/test_cache_salt.py, test_tls.py)."""

    def __init__(self, smollm2_dir, keys_path: str, sched_kw: dict | None = None, engine_kw: dict | None = None,
                 gw_kw: dict | None = None):
        self.keys_path = keys_path
        self.sched_kw, self.engine_kw, self.gw_kw = sched_kw or {}, engine_kw or {}, gw_kw or {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="auth-mesh", daemon=True)
        self.thread.start()
        self.sched, self.gw = self.run(self._start(smollm2_dir))
        self.channel = grpc.insecure_channel(self.gw.address)
        self.stub = llm_pb2_grpc.LLMServiceStub(self.channel)

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, smollm2_dir):
        from gateway.server import serve_gateway
        from kvmesh.core.engine_config import EngineConfig
        from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
        from scheduler.service import serve_scheduler
        engine = dict(model=str(smollm2_dir), dtype="float32", kv_cache_memory=48 * 2**20, max_model_len=256)
        sched = await serve_scheduler(SchedulerConfig(**dict(dict(executor="local", port=0), **self.sched_kw)),
                                      EngineConfig(**dict(engine, **self.engine_kw)))
        await sched.wait_ready()
        gw = await serve_gateway(GatewayConfig(**dict(dict(port=0, scheduler_address=sched.address, connect_timeout=60,
                                                           metrics_port=0, api_keys_file=self.keys_path),
                                                      **self.gw_kw)))
        return sched, gw

    def close(self):
        self.channel.close()
        self.run(self.gw.stop(0))
        self.run(self.sched.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def mesh(smollm2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEYS_FILE)
    m = KeyedMesh(smollm2_dir, str(path), gw_kw=dict(http_port=0))
    yield m
    m.close()


def _bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def _generate(stub, key: str | None, **kw):
    req = llm_pb2.GenerateRequest(prompt="The capital of France is", **kw)
    req.sampling.temperature, req.sampling.max_tokens, req.sampling.ignore_eos = 0.0, 3, True
    return list(stub.Generate(req, metadata=_bearer(key) if key is not None else None, timeout=60))


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    details = e.value.details()
    assert details == auth.UNAUTHENTICATED_MESSAGE
    for secret in ("acme", "globex", ACME_1, GLOBEX, "sk-"):               # nothing about what exists
        assert secret not in details
    return e.value


def _scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _scrape_once(url: str, done, timeout: float = 10.0) -> dict:
    """The first scrape for which ``done(samples)`` holds, or the last after ``timeout`` s. The
    HTTP API counts a request in the ``finally`` after its response's last byte went out, so a
    client that read the response can scrape before the count moves (gRPC counts before the
    status is sent)."""
    deadline = time.monotonic() + timeout
    while not done(samples := _scrape(url)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return samples


def _count(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lv), v in samples.items() if n == name and labels.items() <= dict(lv).items())


def test_no_key_wrong_key_right_key(mesh):
    stub = mesh.stub
    _refused(lambda: _generate(stub, None))
    _refused(lambda: _generate(stub, "sk-not-a-key"))
    _refused(lambda: _generate(stub, ACME_1 + "0"))
    _refused(lambda: list(stub.Generate(llm_pb2.GenerateRequest(prompt="x"),
                                        metadata=(("authorization", ACME_1),))))   # not a bearer token
    msgs = _generate(stub, ACME_1)
    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 3
    assert _generate(stub, GLOBEX)[-1].finished
    # every RPC of the service needs a key; the answers with one are the usual ones
    for rpc, req in (("ListModels", llm_pb2.ListModelsRequest()), ("Tokenize", llm_pb2.TokenizeRequest(prompt="hi")),
                     ("Abort", llm_pb2.AbortRequest(request_id="nope"))):
        _refused(lambda: getattr(stub, rpc)(req, timeout=10))
        getattr(stub, rpc)(req, metadata=_bearer(ACME_2), timeout=10)
    chat = llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(role="user", content="Hi")])
    chat.sampling.max_tokens = 2
    _refused(lambda: list(stub.Chat(chat, timeout=30)))
    assert list(stub.Chat(chat, metadata=_bearer(GLOBEX), timeout=30))[-1].finished


def test_request_is_not_read_before_the_key_is_checked(mesh):
    """Bytes that do not parse (a string field with invalid UTF-8) are INVALID_ARGUMENT with a key,
    UNAUTHENTICATED without: the refusal comes before the request is read."""
    bad = b"\x12\x02\xff\xfe"                                        # field 2 (prompt) = invalid UTF-8
    call = mesh.channel.unary_stream("/kvmesh.v1.LLMService/Generate", request_serializer=lambda b: b,
                                     response_deserializer=llm_pb2.GenerateResponse.FromString)
    _refused(lambda: list(call(bad, timeout=10)))
    with pytest.raises(grpc.RpcError) as e:
        list(call(bad, metadata=_bearer(ACME_1), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()


def test_health_stays_open(mesh):
    health = health_pb2_grpc.HealthStub(mesh.channel)
    for service in ("", "kvmesh.v1.LLMService"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    Client(mesh.gw.address).wait_ready(timeout=10)                   # no key needed to wait


def test_revoked_key_is_refused_by_the_running_gateway(mesh):
    assert _generate(mesh.stub, ACME_1)[-1].finished
    _write(mesh.keys_path, KEYS_FILE.replace(f"acme:{ACME_1}\n", ""))
    try:
        _refused(lambda: _generate(mesh.stub, ACME_1))
        assert _generate(mesh.stub, ACME_2)[-1].finished              # the tenant's other key still works
    finally:
        _write(mesh.keys_path, KEYS_FILE)
    assert _generate(mesh.stub, ACME_1)[-1].finished                  # listed again: accepted again


def test_client_and_cli_send_the_key(mesh, capsys, monkeypatch):
    from kvmesh.cli import main
    with Client(mesh.gw.address, api_key=GLOBEX) as c:
        text, final = collect(c.generate("The capital of France is", temperature=0, max_tokens=3))
        assert final.usage.completion_tokens == 3
    with Client(mesh.gw.address, api_key="sk-wrong") as c:
        _refused(lambda: collect(c.generate("x", max_tokens=1)))
    argv = ["generate", "--server", mesh.gw.address, "--prompt", "The capital of France is", "--max-tokens", "3",
            "--temperature", "0"]
    monkeypatch.delenv("KVMESH_API_KEY", raising=False)
    assert main(argv) == 2                                           # refused, as a bad argument
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(argv + ["--api-key", ACME_2]) == 0
    out = capsys.readouterr()
    assert "output 3 tokens" in out.err and out.out.strip() == text.strip()


def test_tenant_labels_metrics_and_spans(mesh):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    url = mesh.gw.metrics.url
    before = _scrape(url)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    servicer = mesh.gw.path           # gateway.stream.RequestPath: its spans, both fronts'
    tracer, servicer.tracer = servicer.tracer, provider.get_tracer("test-auth")
    try:
        _generate(mesh.stub, GLOBEX)
        _generate(mesh.stub, GLOBEX)
        _generate(mesh.stub, ACME_2)
        _refused(lambda: _generate(mesh.stub, "sk-wrong"))
    finally:
        servicer.tracer = tracer
    after = _scrape(url)

    def delta(name, **labels):
        return _count(after, name, **labels) - _count(before, name, **labels)

    name = "kvmesh:gateway_requests_total"
    assert delta(name, method="Generate", code="OK", tenant="globex") == 2
    assert delta(name, method="Generate", code="OK", tenant="acme") == 1
    assert delta(name, method="Generate", code="UNAUTHENTICATED", tenant="") == 1
    assert delta("kvmesh:gateway_generation_tokens_total", tenant="globex") == 6
    assert delta("kvmesh:gateway_time_to_first_token_seconds_count", tenant="acme") == 1
    tenants = {lv for (n, lvs), _ in after.items() if n.startswith("kvmesh:gateway_") for k, lv in lvs if k == "tenant"}
    assert tenants <= {"", "acme", "globex"}                          # bounded by the keys file
    spans = [s for s in exporter.get_finished_spans() if s.name == "kvmesh.gateway.generate"]
    assert sorted(s.attributes["kvmesh.tenant"] for s in spans) == ["acme", "globex", "globex"]


def test_only_the_requests_tenant_can_abort_it(mesh):
    from kvmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
    req = llm_pb2.GenerateRequest(prompt="Once upon a time", request_id="acme-long")
    req.sampling.temperature, req.sampling.max_tokens, req.sampling.ignore_eos = 0.0, 200, True
    call = mesh.stub.Generate(req, metadata=_bearer(ACME_1), timeout=120)
    first = next(call)                                               # streaming: the request runs
    abort = llm_pb2.AbortRequest(request_id="acme-long")
    assert not mesh.stub.Abort(abort, metadata=_bearer(GLOBEX), timeout=10).found
    with grpc.insecure_channel(mesh.sched.address) as ch:            # nor through the scheduler
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        assert not sched.Abort(scheduler_pb2.SchedulerAbortRequest(request_id="acme-long", tenant="globex"),
                               timeout=10).found
    assert mesh.stub.Abort(abort, metadata=_bearer(ACME_2), timeout=10).found   # the tenant's other key may
    msgs = [first, *call]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert msgs[-1].usage.completion_tokens < 200


def test_request_ids_are_per_tenant(mesh):
    """globex may use acme's live request id, over gRPC and HTTP, and gets its own request (no
    ALREADY_EXISTS); acme's stream is untouched (the same greedy tokens as a run on its own);
    globex cannot abort it; acme reusing its own live id still gets ALREADY_EXISTS (gRPC 409 over
    HTTP), at the gateway and at the scheduler."""
    from kvmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

    def long_request(rid: str) -> llm_pb2.GenerateRequest:
        req = llm_pb2.GenerateRequest(prompt="Once upon a time", request_id=rid)
        req.sampling.temperature, req.sampling.max_tokens, req.sampling.ignore_eos = 0.0, 160, True
        return req

    call = mesh.stub.Generate(long_request("shared-id"), metadata=_bearer(ACME_1), timeout=120)
    first = next(call)                                               # acme's request runs
    live = mesh.gw.path.live
    assert ("acme", "shared-id") in live
    # globex, the same id: its own request, over both APIs
    msgs = _generate(mesh.stub, GLOBEX, request_id="shared-id")
    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 3
    assert all(m.request_id == "shared-id" for m in msgs)
    status, body, headers = _http(mesh, "/v1/completions", GLOBEX, dict(COMPLETION, request_id="shared-id"))
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    assert headers["x-request-id"] == "shared-id" and body["id"] == "cmpl-shared-id"
    status, body, _ = _http(mesh, "/v1/chat/completions", GLOBEX,
                            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "shared-id"})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body
    # globex cannot abort acme's request, at the gateway or at the scheduler
    abort = llm_pb2.AbortRequest(request_id="shared-id")
    assert not mesh.stub.Abort(abort, metadata=_bearer(GLOBEX), timeout=10).found
    with grpc.insecure_channel(mesh.sched.address) as ch:
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        assert not sched.Abort(scheduler_pb2.SchedulerAbortRequest(request_id="shared-id", tenant="globex"),
                               timeout=10).found
        # the scheduler's own check, per tenant: acme's id is taken for acme, free for globex
        sub = scheduler_pb2.SubmitRequest(request_id="shared-id", prompt_token_ids=[1, 2, 3], tenant="acme",
                                          sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0))
        with pytest.raises(grpc.RpcError) as e:
            list(sched.Submit(sub, timeout=30))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        sub.tenant = "globex"
        assert list(sched.Submit(sub, timeout=30))[-1].finished
    # acme, its own live id (its other key): ALREADY_EXISTS over gRPC, 409 over HTTP
    with pytest.raises(grpc.RpcError) as e:
        _generate(mesh.stub, ACME_2, request_id="shared-id")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "shared-id" in e.value.details()
    status, body, _ = _http(mesh, "/v1/completions", ACME_2, dict(COMPLETION, request_id="shared-id"))
    assert status == 409 and body["error"]["code"] == "request_id_in_use", body
    assert ("acme", "shared-id") in live                             # all of that while acme's ran
    msgs = [first, *call]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 160
    ids = [t for m in msgs for t in m.token_ids]
    alone = list(mesh.stub.Generate(long_request("acme-alone"), metadata=_bearer(ACME_1), timeout=120))
    assert ids == [t for m in alone for t in m.token_ids]            # unaffected by globex's requests
    assert not live                                                  # every id is free again


# ---- the HTTP API ---------------------------------------------------------------------------------

def _http(mesh, route: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a request to the gateway's HTTP port."""
    import json
    import urllib.error
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://{mesh.gw.http.address}{route}", headers=headers, method="POST" if body
                                 else "GET", data=json.dumps(body).encode() if body else None)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


COMPLETION = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def test_http_needs_a_key_too(mesh):
    for key in (None, "sk-not-a-key", ACME_1 + "0"):
        for route, body in (("/v1/completions", COMPLETION), ("/v1/models", None),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            status, err, headers = _http(mesh, route, key, body)
            assert status == 401 and err["error"]["code"] == "invalid_api_key", (route, key, err)
            assert err["error"]["message"] == auth.UNAUTHENTICATED_MESSAGE
            assert headers.get("www-authenticate") == "Bearer"
    assert _http(mesh, "/health")[:2] == (200, {"status": "ok"})          # health stays open
    status, body, _ = _http(mesh, "/v1/completions", GLOBEX, COMPLETION)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    grpc_text = "".join(m.text for m in _generate(mesh.stub, GLOBEX))
    assert body["choices"][0]["text"] == grpc_text                          # the same path both ways
    assert _http(mesh, "/v1/models", ACME_2)[0] == 200


def test_http_revoked_key_and_tenant_metrics(mesh):
    url = mesh.gw.metrics.url
    before = _scrape(url)
    assert _http(mesh, "/v1/completions", ACME_1, COMPLETION)[0] == 200
    _write(mesh.keys_path, KEYS_FILE.replace(f"acme:{ACME_1}\n", ""))
    try:
        assert _http(mesh, "/v1/completions", ACME_1, COMPLETION)[0] == 401
        assert _http(mesh, "/v1/completions", ACME_2, COMPLETION)[0] == 200
    finally:
        _write(mesh.keys_path, KEYS_FILE)

    def delta(after, **labels):
        return (_count(after, "kvmesh:gateway_requests_total", **labels)
                - _count(before, "kvmesh:gateway_requests_total", **labels))

    after = _scrape_once(url, lambda s: delta(s, method="Completions", code="OK", tenant="acme") >= 2)
    assert delta(after, method="Completions", code="OK", tenant="acme") == 2
    assert delta(after, method="Completions", code="UNAUTHENTICATED", tenant="") == 1
    assert (_count(after, "kvmesh:gateway_prompt_tokens_total", tenant="acme")
            > _count(before, "kvmesh:gateway_prompt_tokens_total", tenant="acme"))
