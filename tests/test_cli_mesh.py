"""The mesh from the command line: ``kvmesh serve`` as a real subprocess (scheduler + gateway in
one process, executor "local", real SmolLM2 weights), ``kvmesh generate --server`` and
``kvmesh chat --server`` against it, the Python client (kvmesh/client.py), SIGTERM/SIGINT
shutdown, and the flags' errors. A ``--executor ray`` case runs when the Ray pipeline executor
is present.

One server serves the module (``served``); its last test stops it with SIGTERM."""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import cli
from kvmesh.cli.services import service_configs
from kvmesh.core import flags
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig

MODEL = "smollm2-135m-instruct"
KVMESH = Path(sys.executable).with_name("kvmesh")
LISTEN = re.compile(r"^kvmesh: (scheduler|gateway) listening on (\S+):(\d+)$")

pytestmark = pytest.mark.mesh
SUMMARY = r"prompt (\d+) tokens \((\d+) from prefix cache\), output (\d+) tokens, TTFT [\d.]+ s, " \
          r"decode [\d.-]+ tokens/s, finish (\w+)"
SYSTEM = ("You are a helpful assistant for a travel agency. Answer the traveller's questions in one or "
          "two short sentences, politely and precisely.")


def mesh_env(**extra) -> dict:
    env = dict(os.environ, KVMESH_DTYPE="float32", KVMESH_NUM_THREADS="1", KVMESH_KV_CACHE_MEMORY="64MiB",
               KVMESH_MAX_MODEL_LEN="1024", PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith(("KVMESH_SCHEDULER_", "KVMESH_GATEWAY_"))]:
        del env[k]
    env.update(extra)
    return env


class Served:
    """A ``kvmesh serve|scheduler|gateway`` subprocess; stderr lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen([str(KVMESH), *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.addresses: dict[str, tuple[str, int]] = {}

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def _next_line(self, deadline: float, waiting_for: str) -> str:
        """The next stderr line, waiting until ``deadline`` (monotonic) for it; fails the test
        when none comes or the process exits first."""
        try:
            line = self._q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {waiting_for} in time:\n{self.stderr}") from None
        if line is None:
            raise AssertionError(f"exited with {self.proc.wait()} before {waiting_for}:\n{self.stderr}")
        return line

    def wait_listening(self, services=("scheduler", "gateway"), timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while set(services) - set(self.addresses):
            if m := LISTEN.match(self._next_line(deadline, f"listening after {timeout} s")):
                self.addresses[m.group(1)] = (m.group(2), int(m.group(3)))

    def wait_line(self, pattern: str, timeout: float = 120) -> str:
        """The first stderr line matching regex ``pattern``, waiting for it as it comes (the
        announcements after ``wait_listening``'s lines may still be on their way)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while not (hits := [l for l in self.lines if rx.match(l)]):
            self._next_line(deadline, f"line matching {pattern!r} within {timeout} s")
        return hits[0]

    def address(self, service: str = "gateway") -> str:
        host, port = self.addresses[service]
        return f"{host}:{port}"

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> tuple[int, float]:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def kvmesh(*argv: str, input: str | None = None, timeout: float = 300, env: dict | None = None):
    return subprocess.run([str(KVMESH), *argv], input=input, capture_output=True, text=True, timeout=timeout,
                          env=env or mesh_env())


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def served(smollm2_dir):
    srv = Served(["serve", "--executor", "local", "--model", MODEL, "--port", "0", "--scheduler-port", "0",
                  "--metrics-port", "0", "--grace", "1"], mesh_env())
    try:
        t0 = time.monotonic()
        srv.wait_listening()
        srv.startup_s = time.monotonic() - t0
        yield srv
    finally:
        srv.kill()


# ---- bad arguments (no model loads) ------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["serve", "--pp", "0"], "kvmesh: error: pp must be >= 1, got 0"),
    (["serve", "--executor", "local", "--pp", "2"], "the local executor runs the whole model in one process"),
    (["serve", "--executor", "mpi"], "argument --executor: invalid choice: 'mpi'"),
    (["serve", "--port", "http"], "argument --port: expected a port number"),
    (["serve", "--scheduler-port", "70000"], "argument --scheduler-port: expected a port number"),
    (["serve", "--pp", "2", "--pp-layers", "10"], "pp_layers needs 2 positive layer counts"),
    (["serve", "--scheduler-address", "x:1"], "unrecognized arguments: --scheduler-address"),
    (["scheduler", "--replicas", "0"], "replicas must be >= 1"),
    (["gateway", "--default-timeout", "0"], "default_timeout must be in (0, max_timeout"),
    (["generate", "--server", "127.0.0.1:1", "--prompt", "hi", "--dtype", "float32"],
     "--dtype: engine settings are the server's"),
    (["chat", "--server", "127.0.0.1:1", "--temperature", "-1"], "temperature must be >= 0"),
    (["chat"], "the following arguments are required: --server"),
])
def test_bad_arguments_exit_2(argv, message, capsys, monkeypatch):
    for k in [k for k in os.environ if k.startswith(("KVMESH_SCHEDULER_", "KVMESH_GATEWAY_"))]:
        monkeypatch.delenv(k)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "error: " in err and "Traceback" not in err


def test_serve_bad_flag_console_script():
    p = kvmesh("serve", "--pp", "0", timeout=120)
    assert p.returncode == 2
    assert p.stderr == "kvmesh: error: pp must be >= 1, got 0\n"


def test_no_server_exits_1(capsys):
    with socket.socket() as s:                # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["chat", "--server", f"127.0.0.1:{port}", "--wait", "0.5"]) == 1
    err = capsys.readouterr().err
    assert f"kvmesh: error: kvmesh server at 127.0.0.1:{port} not ready after 0.5 s" in err


def test_every_service_setting_has_a_flag(monkeypatch):
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    dests = lambda command: {a.dest for a in sub.choices[command]._actions if a.option_strings}
    assert dests("scheduler") >= {"scheduler_" + f.name for f in dataclasses.fields(SchedulerConfig)}
    assert dests("gateway") >= {"gateway_" + f.name for f in dataclasses.fields(GatewayConfig)}
    assert dests("serve") >= ({"scheduler_" + f.name for f in dataclasses.fields(SchedulerConfig)}
                              | {"gateway_" + f.name for f in dataclasses.fields(GatewayConfig)}) - {"gateway_scheduler_address"}
    monkeypatch.setenv("KVMESH_SCHEDULER_REPLICAS", "3")      # env applies where no flag is given
    monkeypatch.setenv("KVMESH_SCHEDULER_PP", "4")            # a flag beats the env
    monkeypatch.setenv("KVMESH_GATEWAY_MAX_TIMEOUT", "99")
    monkeypatch.setenv("KVMESH_GATEWAY_PORT", "1234")
    args = cli.build_parser().parse_args([
        "serve", "--host", "0.0.0.0", "--port", "0", "--max-tokens-cap", "100", "--default-max-tokens", "10",
        "--default-timeout", "5", "--connect-timeout", "7", "--scheduler-host", "10.0.0.1",
        "--scheduler-port", "0", "--pp", "2", "--pp-layers", "20,10", "--executor", "ray",
        "--ray-address", "auto", "--stage-num-cpus", "0.5", "--max-queued-requests", "8"])
    engine, sched, gw = service_configs(args)
    assert sched == SchedulerConfig(host="10.0.0.1", port=0, replicas=3, pp=2, pp_layers="20,10", executor="ray",
                                    ray_address="auto", stage_num_cpus=0.5, max_queued_requests=8)
    assert gw == GatewayConfig(host="0.0.0.0", port=0, max_tokens_cap=100, default_max_tokens=10,
                               default_timeout=5.0, max_timeout=99.0, connect_timeout=7.0)
    args = cli.build_parser().parse_args(["gateway", "--scheduler-address", "sched:50061", "--default-timeout", "9"])
    assert GatewayConfig.from_env(**flags.gateway_kwargs(args)).port == 1234
    assert flags.gateway_kwargs(args)["scheduler_address"] == "sched:50061"
    args = cli.build_parser().parse_args(["scheduler", "--port", "0", "--model", "m"])
    assert flags.scheduler_kwargs(args)["port"] == 0 and flags.engine_kwargs(args)["model"] == "m"


# ---- the served mesh ---------------------------------------------------------------------------

def test_serve_prints_where_it_listens(served):
    listening = [l for l in served.lines if LISTEN.match(l)]
    assert [LISTEN.match(l).group(1) for l in listening] == ["scheduler", "gateway"], served.stderr
    for service in ("scheduler", "gateway"):
        host, port = served.addresses[service]
        assert host == "127.0.0.1" and port > 0 and port_open(host, port)
    print(f"serve: listening after {served.startup_s:.1f} s")


def test_serve_has_one_metrics_endpoint_for_both_services(served):
    """`kvmesh serve --metrics-port`: the gateway's endpoint also carries the scheduler's series
    (one process, one scrape target); no second endpoint is started for the scheduler (its
    line would come before the gateway's)."""
    url_line = r"kvmesh: metrics \(gateway and scheduler\) on (http://\S+/metrics)$"
    served.wait_line(url_line)
    (line,) = [l for l in served.lines if "metrics" in l and l.startswith("kvmesh:")]
    url = re.match(url_line, line).group(1)
    p = kvmesh("generate", "--server", served.address(), "--prompt", "Hello", "--max-tokens", "3",
               "--temperature", "0")
    assert p.returncode == 0, p.stderr
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "kvmesh:gateway_requests_total" in names          # the gateway's
    assert {"kvmesh:prompt_tokens_total", "kvmesh:num_requests_running", "kvmesh:kv_cache_blocks"} <= names, names


def test_generate_server_streams_offline_text(served):
    argv = ["--prompt", "The capital of France is", "--max-tokens", "24", "--temperature", "0"]
    offline = kvmesh("generate", "--model", MODEL, *argv)
    remote = kvmesh("generate", "--server", served.address(), *argv)
    assert offline.returncode == 0 and remote.returncode == 0, offline.stderr + remote.stderr
    assert remote.stdout == offline.stdout and "Paris" in remote.stdout
    s_off = re.search(SUMMARY, offline.stderr).groups()
    s_rem = re.search(SUMMARY, remote.stderr).groups()
    assert s_rem[0] == s_off[0] and s_rem[2:] == s_off[2:] == ("24", "length"), remote.stderr

    chat = ["--chat", "--system", SYSTEM, "--prompt", "Is a passport needed to fly from Paris to Rome?",
            "--max-tokens", "16", "--temperature", "0"]
    offline = kvmesh("generate", "--model", MODEL, *chat)
    remote = kvmesh("generate", "--server", served.address(), *chat)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == offline.stdout
    assert re.search(SUMMARY, remote.stderr).group(1) == re.search(SUMMARY, offline.stderr).group(1)


def test_chat_two_piped_turns_reuse_the_prefix(served):
    p = kvmesh("chat", "--server", served.address(), "--system", SYSTEM, "--temperature", "0",
               "--max-tokens", "24", input="Which documents do I need to travel to Japan?\n\n"
                                           "And how long can I stay there without a visa?\n")
    assert p.returncode == 0, p.stderr
    turns = re.findall(r"^turn (\d): " + SUMMARY + "$", p.stderr, re.M)
    assert [t[0] for t in turns] == ["1", "2"], p.stderr
    (_, p1, c1, n1, _), (_, p2, c2, n2, _) = [t for t in turns]
    p1, c1, p2, c2 = int(p1), int(c1), int(p2), int(c2)
    assert int(n1) > 0 and int(n2) > 0 and p.stdout.strip()
    assert p2 > p1 + int(n1)                   # turn 2 carries turn 1's question and answer
    assert c2 >= p1 // 16 * 16 > 0             # ... and its prompt comes from the prefix cache


def test_chat_reset_and_errors_keep_the_session(served):
    long_line = "word " * 2000                 # longer than max_model_len: refused, the chat goes on
    p = kvmesh("chat", "--server", served.address(), "--temperature", "0", "--max-tokens", "4",
               input=f"Hello!\n/reset\nHello!\n{long_line}\n")
    assert p.returncode == 2, p.stderr
    assert "kvmesh: conversation reset" in p.stderr
    turns = re.findall(r"^turn (\d): " + SUMMARY + "$", p.stderr, re.M)
    assert len(turns) == 2 and turns[0][1] == turns[1][1]      # after /reset: the same prompt again
    assert int(turns[1][2]) > 0                                  # same session, cached
    assert "kvmesh: error: " in p.stderr and "(INVALID_ARGUMENT)" in p.stderr


def test_client(served):
    from kvmesh.client import Client, collect
    from kvmesh.core.proto import finish_reason_name

    with Client(served.address()) as c:
        c.wait_ready(timeout=10)
        (info,) = c.list_models()
        assert info.name == MODEL and info.max_model_len == 1024
        tok = c.tokenize("The capital of France is")
        assert tok.count == len(tok.token_ids) == 5
        text, final = collect(c.generate(token_ids=list(tok.token_ids), temperature=0, max_tokens=6))
        assert "Paris" in text and finish_reason_name(final) == "length"
        assert final.usage.prompt_tokens == 5 and final.usage.completion_tokens == 6
        chat_ids = c.tokenize(messages=[{"role": "user", "content": "Hi"}]).token_ids
        text, final = collect(c.chat([("user", "Hi")], temperature=0, max_tokens=4, session_id="s"))
        assert final.usage.prompt_tokens == len(chat_ids)
        assert c.abort("no-such-request") is False
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate("hi", temperature=-1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def stream_in_background(address: str, max_tokens: int):
    """A greedy Generate stream on a thread: (thread, event set at its first message or end,
    list of the responses it got, or the RpcError that ended it)."""
    from kvmesh.client import Client
    first, got = threading.Event(), []

    def stream():
        with Client(address) as c:
            try:
                for r in c.generate("Once upon a time", temperature=0, max_tokens=max_tokens, ignore_eos=True):
                    first.set()
                    got.append(r)
            except grpc.RpcError as e:
                got.append(e)
            first.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    return t, first, got


def test_sigterm_stops_in_flight_streams_and_exits_0(served):
    """Last test of the served mesh: SIGTERM with a stream in flight."""
    t, first, got = stream_in_background(served.address(), max_tokens=900)
    assert first.wait(60)
    rc, took = served.stop(signal.SIGTERM)
    t.join(10)
    assert rc == 0, served.stderr
    assert took < 20, f"SIGTERM took {took:.1f} s"
    assert not t.is_alive()
    last = got[-1]                              # the stream ended: aborted, cancelled or cut off
    assert isinstance(last, grpc.RpcError) or (last.finished and last.usage.completion_tokens < 900)
    lines = served.lines
    assert lines.index("kvmesh: SIGTERM: shutting down") < lines.index("kvmesh: gateway stopped") \
        < lines.index("kvmesh: scheduler stopped"), served.stderr
    for host, port in served.addresses.values():
        assert not port_open(host, port)
    print(f"serve: SIGTERM -> exit 0 in {took:.1f} s")


# ---- services alone, and the demo --------------------------------------------------------------

def test_scheduler_and_gateway_alone_sigint(smollm2_dir):
    """``kvmesh scheduler`` and ``kvmesh gateway`` as separate processes (settings from the
    environment, like compose / Kubernetes); SIGINT stops each with exit 0."""
    sched = Served(["scheduler", "--model", MODEL], mesh_env(KVMESH_SCHEDULER_PORT="0",
                                                             KVMESH_SCHEDULER_EXECUTOR="local"))
    gw = None
    try:
        sched.wait_listening(["scheduler"])
        gw = Served(["gateway", "--port", "0"], mesh_env(KVMESH_GATEWAY_SCHEDULER_ADDRESS=sched.address("scheduler")))
        gw.wait_listening(["gateway"], timeout=120)
        p = kvmesh("generate", "--server", gw.address(), "--prompt", "The capital of France is",
                   "--max-tokens", "4", "--temperature", "0")
        assert p.returncode == 0 and "Paris" in p.stdout, p.stderr
        assert gw.stop(signal.SIGINT)[0] == 0 and "kvmesh: gateway stopped" in gw.lines
        assert sched.stop(signal.SIGINT)[0] == 0 and "kvmesh: scheduler stopped" in sched.lines
    finally:
        sched.kill()
        if gw is not None:
            gw.kill()


def _ray_executor_available() -> bool:
    try:
        from workers import executor
    except Exception:
        return False
    return hasattr(executor, "RayPipelineExecutor")


def test_demo_through_the_mesh(smollm2_dir):
    p = kvmesh("demo", "--model", MODEL, "--executor", "local", "--max-tokens", "8", "--max-model-len", "2048",
               "--kv-cache-memory", "256MiB", timeout=600)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "[turn 1] user: If I drive my own car" in out and "[turn 2] assistant: " in out
    assert re.search(r"gateway 127\.0\.0\.1:\d+ -> scheduler 127\.0\.0\.1:\d+ \(local executor, pp 1\)", out)
    assert len(re.findall(r"TTFT [\d.]+ s, decode [\d.-]+ tokens/s", out)) == 2
    first = int(re.search(r"prompt (\d+) tokens \(0 from prefix cache\)", out).group(1))
    assert first > 1000
    reused, total = map(int, re.search(r"prefix cache: turn 2 reused (\d+) of its (\d+) prompt tokens", out).groups())
    assert first - 16 <= reused < total
    assert "kvmesh: gateway stopped" in p.stderr and "kvmesh: scheduler stopped" in p.stderr


@pytest.mark.skipif(not _ray_executor_available(), reason="the Ray pipeline executor is not there yet")
def test_serve_ray_pipeline_two_stages(smollm2_dir):
    """The default executor (ray): two pipeline stages as Ray actors in a local Ray started by
    kvmesh; greedy output equals the offline engine's; SIGTERM shuts Ray down, exit 0."""
    env = mesh_env(RAY_AUTH_MODE="disabled")
    env.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)      # kvmesh must set it itself
    srv = Served(["serve", "--model", MODEL, "--pp", "2", "--stage-num-cpus", "0.5", "--port", "0",
                  "--scheduler-port", "0", "--grace", "4"], env)
    try:
        srv.wait_listening(timeout=300)
        argv = ["--prompt", "The capital of France is", "--max-tokens", "12", "--temperature", "0"]
        remote = kvmesh("generate", "--server", srv.address(), *argv, env=env)
        offline = kvmesh("generate", "--model", MODEL, *argv)
        assert remote.returncode == 0, remote.stderr
        assert remote.stdout == offline.stdout
        p = kvmesh("chat", "--server", srv.address(), "--system", SYSTEM, "--temperature", "0", "--max-tokens", "8",
                   input="Do I need a visa for Japan?\nAnd for Korea?\n", env=env)
        assert p.returncode == 0, p.stderr
        (c2,) = re.findall(r"^turn 2: prompt \d+ tokens \((\d+) from prefix cache\)", p.stderr, re.M)
        assert int(c2) > 0
        # SIGTERM with a stream in flight: the whole grace period (4 s) passes without Ray's
        # signal handler aborting the process (it would, ~3 s after the signal)
        t, first, got = stream_in_background(srv.address(), max_tokens=400)
        assert first.wait(60)
        rc, took = srv.stop(signal.SIGTERM, timeout=120)
        t.join(10)
        assert rc == 0, srv.stderr
        assert "SIGTERM received" not in srv.stderr, srv.stderr
        assert "SIGTERM handler is not set" not in srv.stderr, srv.stderr     # no stray warning at start
        assert srv.lines[-2:] == ["kvmesh: scheduler stopped", "kvmesh: ray stopped"], srv.stderr
        print(f"serve --pp 2 (ray): SIGTERM with a stream in flight -> exit 0 in {took:.1f} s")
    finally:
        srv.kill()
