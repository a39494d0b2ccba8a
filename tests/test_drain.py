"""Graceful drain under a rolling restart: SIGTERM to ``kvmesh serve``, and to ``kvmesh gateway``
alone, with streams in flight (real subprocesses, real gRPC and HTTP over loopback, SmolLM2-135M
in an engine process).

To hold the streams open while the drain is looked at, the replica's engine process is stopped
(SIGSTOP) once every stream has its first token, and continued (SIGCONT) after the checks: the
drain then sees requests in flight for as long as the test needs, without a fixed sleep.

- ``kvmesh serve --grace 120``, 16 streams (12 gRPC, 4 HTTP): health NOT_SERVING while all 16 are
  still open; a new gRPC request UNAVAILABLE with ``grpc-retry-pushback-ms``, a new HTTP one 503
  with ``Retry-After``; once the engine continues every stream ends with its final message and
  all its tokens; the process exits 0.
- ``kvmesh gateway --grace 2`` (its scheduler a ``kvmesh scheduler``), streams frozen past the
  grace: each ends with a status, not cut: gRPC UNAVAILABLE naming the shutdown with the retry
  hint and its usage so far, HTTP an error event then ``data: [DONE]``; the scheduler aborted
  them (nothing running, no KV block used once its engine continues).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.core.grpc_server import LIVENESS
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from test_cli_mesh import MODEL, Served, mesh_env

pytestmark = [pytest.mark.chaos, pytest.mark.mesh]

PROMPT = "Once upon a time, in a small village by the sea,"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
HTTP_LINE = re.compile(r"^kvmesh: http listening on (\S+):(\d+) ")
HEALTH_LINE = re.compile(r"^kvmesh: gateway health checks \(plaintext\) on (\S+):(\d+)$")


def until(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def line_address(srv: Served, pattern: re.Pattern, timeout: float = 30) -> str:
    """``host:port`` of the first stderr line of ``srv`` matching ``pattern`` (waiting for it)."""
    found: list[str] = []

    def seen() -> bool:
        found.extend(f"{m.group(1)}:{m.group(2)}" for line in list(srv.lines) if (m := pattern.match(line)))
        return bool(found)
    until(seen, f"a line {pattern.pattern!r} in:\n{srv.stderr}", timeout)
    return found[0]


class Stream:
    """One streaming request on a thread: gRPC ``Generate`` or HTTP ``/v1/completions`` with
    ``stream``. ``tokens``: tokens received (gRPC: ids; HTTP: the usage chunk's count at the end);
    ``first``: set at the first token; ``done``: set when the stream ended, with ``final`` (the
    last gRPC message, or the HTTP usage chunk), ``error`` (gRPC: the RpcError; HTTP: the error
    event's body) and ``events`` (HTTP: every ``data:`` payload, ``[DONE]`` included)."""

    def __init__(self, kind: str, address: str, max_tokens: int):
        self.kind, self.address, self.max_tokens = kind, address, max_tokens
        self.tokens, self.final, self.error, self.events = 0, None, None, []
        self.first, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._grpc if kind == "grpc" else self._http, daemon=True)
        self.thread.start()

    def _grpc(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            try:
                for m in llm_pb2_grpc.LLMServiceStub(ch).Generate(llm_pb2.GenerateRequest(
                        prompt=PROMPT, sampling=common_pb2.SamplingParams(
                            temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)), timeout=300):
                    self.tokens += len(m.token_ids)
                    if self.tokens:
                        self.first.set()
                    self.final = m
            except grpc.RpcError as e:
                self.error = e
            finally:
                self.done.set()

    def _http(self) -> None:
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200, (r.status, r.read())
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                self.events.append(data)
                if data == "[DONE]":
                    break
                body = json.loads(data)
                if "error" in body:
                    self.error = body["error"]
                elif body.get("choices"):
                    self.first.set()
                elif body.get("usage"):
                    self.final = body
                    self.tokens = body["usage"]["completion_tokens"]
        finally:
            conn.close()
            self.done.set()


def engine_pid(scheduler_address: str) -> int:
    with grpc.insecure_channel(scheduler_address) as ch:
        st = scheduler_pb2_grpc.SchedulerServiceStub(ch).GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
    assert st.replicas[0].pid > 0
    return st.replicas[0].pid


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def post(address: str, path: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_sigterm_drains_16_streams_within_grace(smollm2_dir):
    """``kvmesh serve --grace 120``: SIGTERM with 16 streams in flight."""
    max_tokens = 24
    srv = Served(["serve", "--executor", "local", "--model", MODEL, "--port", "0", "--scheduler-port", "0",
                  "--http-port", "0", "--health-port", "0", "--grace", "120"], mesh_env())
    pid = None
    try:
        srv.wait_listening()
        gw, http_addr, health_addr = srv.address(), line_address(srv, HTTP_LINE), line_address(srv, HEALTH_LINE)
        pid = engine_pid(srv.address("scheduler"))
        assert health(health_addr, "kvmesh.v1.LLMService") == SERVING
        streams = [Stream("grpc", gw, max_tokens) for _ in range(12)] + \
                  [Stream("http", http_addr, max_tokens) for _ in range(4)]
        until(lambda: all(s.first.is_set() for s in streams), "the first token of all 16 streams", 180)
        os.kill(pid, signal.SIGSTOP)                   # the streams stay in flight until SIGCONT
        assert not any(s.done.is_set() for s in streams)
        t_term = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)

        until(lambda: health(health_addr, "kvmesh.v1.LLMService") == NOT_SERVING, "NOT_SERVING", 30)
        assert health(health_addr, "") == NOT_SERVING and health(health_addr, LIVENESS) == NOT_SERVING
        assert not any(s.done.is_set() for s in streams)     # health first, all 16 still open
        # a new request is refused at once, with a retry hint: gRPC ...
        with grpc.insecure_channel(gw) as ch:
            try:
                list(llm_pb2_grpc.LLMServiceStub(ch).Generate(llm_pb2.GenerateRequest(
                    prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=30))
                raise AssertionError("a new request was served while draining")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
                assert "shutting down" in e.details() and "retry" in e.details(), e.details()
                assert ("grpc-retry-pushback-ms", "1000") in tuple(e.trailing_metadata()), e.trailing_metadata()
        # ... and HTTP (503 with Retry-After); /health says 503
        status, headers, body = post(http_addr, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") == "1", (status, headers, body)
        assert "shutting down" in json.loads(body)["error"]["message"]
        assert post(http_addr, "/health")[0] == 503
        assert not any(s.done.is_set() for s in streams)

        os.kill(pid, signal.SIGCONT)
        until(lambda: all(s.done.is_set() for s in streams), "the 16 streams to end", 180)
        for s in streams:
            assert s.error is None, (s.kind, s.error)
            assert s.tokens == max_tokens, (s.kind, s.tokens)
            if s.kind == "grpc":
                assert s.final.finished and s.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert s.final.usage.completion_tokens == max_tokens
            else:
                assert s.events[-1] == "[DONE]" and not any('"error"' in e for e in s.events)
        rc = srv.proc.wait(60)
        took = time.monotonic() - t_term
        assert rc == 0, srv.stderr
        assert took < 120, f"SIGTERM to exit took {took:.1f} s"
        assert "kvmesh: gateway stopped" in srv.lines and "kvmesh: scheduler stopped" in srv.lines
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        srv.kill()


def test_gateway_sigterm_past_the_grace_ends_every_stream_with_a_status(smollm2_dir):
    """``kvmesh gateway --grace 2`` alone: streams that cannot finish within the grace end with
    UNAVAILABLE (gRPC: the shutdown named, the retry hint, the usage so far) or an HTTP error
    event and ``[DONE]``, never a cut connection; the scheduler aborts them."""
    grace = 2.0
    sched = Served(["scheduler", "--model", MODEL], mesh_env(KVMESH_SCHEDULER_PORT="0",
                                                             KVMESH_SCHEDULER_EXECUTOR="local"))
    gw = pid = None
    try:
        sched.wait_listening(["scheduler"])
        pid = engine_pid(sched.address("scheduler"))
        gw = Served(["gateway", "--port", "0", "--http-port", "0", "--grace", str(grace)],
                    mesh_env(KVMESH_GATEWAY_SCHEDULER_ADDRESS=sched.address("scheduler")))
        gw.wait_listening(["gateway"], timeout=120)
        streams = [Stream("grpc", gw.address(), 200) for _ in range(4)] + \
                  [Stream("http", line_address(gw, HTTP_LINE), 200) for _ in range(2)]
        until(lambda: all(s.first.is_set() for s in streams), "the first token of every stream", 180)
        os.kill(pid, signal.SIGSTOP)                   # no stream can finish now
        t_term = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        until(lambda: all(s.done.is_set() for s in streams), "every stream to end", 60)
        took = time.monotonic() - t_term
        assert grace <= took < grace + 20, took        # the grace was given, then they ended
        for s in streams:
            if s.kind == "grpc":
                e = s.error
                assert e is not None and e.code() == grpc.StatusCode.UNAVAILABLE, (s.final, e)
                assert "the gateway shut down before the request finished" in e.details(), e.details()
                assert f"after {s.tokens} tokens; retry it" in e.details(), (s.tokens, e.details())
                meta = dict(e.trailing_metadata())
                assert meta.get("grpc-retry-pushback-ms") == "1000", meta
                usage = common_pb2.Usage.FromString(meta["kvmesh-usage-bin"])
                assert usage.completion_tokens == s.tokens >= 1
            else:
                assert s.error is not None and "the gateway shut down" in s.error["message"], s.events
                assert s.events[-1] == "[DONE]", s.events
        assert gw.proc.wait(60) == 0, gw.stderr
        os.kill(pid, signal.SIGCONT)

        def idle() -> bool:
            with grpc.insecure_channel(sched.address("scheduler")) as ch:
                r = scheduler_pb2_grpc.SchedulerServiceStub(ch).GetStats(scheduler_pb2.GetStatsRequest(),
                                                                         timeout=30).replicas[0]
            return (r.num_running, r.num_waiting, r.num_used_blocks) == (0, 0, 0)
        until(idle, "the scheduler to abort the gateway's requests", 60)
        assert sched.stop()[0] == 0, sched.stderr
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if gw is not None:
            gw.kill()
        sched.kill()
