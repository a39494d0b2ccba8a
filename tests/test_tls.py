"""TLS on the gateway and mutual TLS between the gateway and the scheduler (kvmesh/core/tls.py), over
real gRPC on loopback in front of a real scheduler (local executor, SmolLM2-135M float32).

The test makes its own PKI with the ``cryptography`` package: a CA, a server certificate for
127.0.0.1/localhost (the gateway's and the scheduler's), a client certificate for the gateway,
and a rogue CA with a client certificate of its own. The scheduler listens with TLS and requires
client certificates of the CA; the gateway listens with TLS and dials the scheduler with its
client certificate.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import Client, collect
from kvmesh.core.errors import EngineError
from kvmesh.v1 import llm_pb2, llm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


# ---- a test PKI ---------------------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path, key) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _write_cert(path, cert) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


class Pki:
    """PEM files under ``root``: ``ca``, ``server_cert``/``server_key``, ``client_cert``/``client_key``
    (signed by ca), ``rogue_ca``, ``rogue_cert``/``rogue_key`` (signed by rogue_ca)."""

    def __init__(self, root):
        def new_key():
            return ec.generate_private_key(ec.SECP256R1())

        ca_key, rogue_ca_key = new_key(), new_key()
        self.ca = _write_cert(root / "ca.pem", _cert("kvmesh test CA", ca_key, "kvmesh test CA", ca_key, ca=True))
        self.rogue_ca = _write_cert(root / "rogue-ca.pem", _cert("rogue CA", rogue_ca_key, "rogue CA", rogue_ca_key,
                                                                  ca=True))
        k = new_key()
        self.server_key = _write_key(root / "server.key", k)
        self.server_cert = _write_cert(root / "server.pem", _cert("kvmesh", k, "kvmesh test CA", ca_key, server=True))
        k = new_key()
        self.client_key = _write_key(root / "gateway.key", k)
        self.client_cert = _write_cert(root / "gateway.pem", _cert("kvmesh-gateway", k, "kvmesh test CA", ca_key))
        k = new_key()
        self.rogue_key = _write_key(root / "rogue.key", k)
        self.rogue_cert = _write_cert(root / "rogue.pem", _cert("kvmesh-gateway", k, "rogue CA", rogue_ca_key))
        self.not_pem = str(root / "not.pem")
        (root / "not.pem").write_text("hello\n")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ---- the mesh -----------------------------------------------------------------------------------------

class TlsMesh:
    """A scheduler requiring client certificates and a TLS gateway with one, on a background loop."""

    def __init__(self, smollm2_dir, pki: Pki):
        self.pki = pki
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tls-mesh", daemon=True)
        self.thread.start()
        self.sched, self.gw = self.run(self._start(smollm2_dir))

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def gateway_config(self, **kw):
        from kvmesh.core.service_config import GatewayConfig
        p = self.pki
        base = dict(port=0, scheduler_address=f"127.0.0.1:{self.sched.port}", connect_timeout=60,
                    tls_cert_file=p.server_cert, tls_key_file=p.server_key, scheduler_tls_ca_file=p.ca,
                    scheduler_tls_client_cert_file=p.client_cert, scheduler_tls_client_key_file=p.client_key)
        return GatewayConfig(**dict(base, **kw))

    async def _start(self, smollm2_dir):
        from gateway.server import serve_gateway
        from kvmesh.core.engine_config import EngineConfig
        from kvmesh.core.service_config import SchedulerConfig
        from scheduler.service import serve_scheduler
        p = self.pki
        sched = await serve_scheduler(SchedulerConfig(executor="local", port=0, tls_cert_file=p.server_cert,
                                                      tls_key_file=p.server_key, tls_client_ca_file=p.ca,
                                                      health_port=0),
                                      EngineConfig(model=str(smollm2_dir), dtype="float32",
                                                   kv_cache_memory=48 * 2**20, max_model_len=256))
        await sched.wait_ready()
        self.sched = sched
        return sched, await serve_gateway(self.gateway_config(health_port=0, http_port=0))

    def close(self):
        self.run(self.gw.stop(0))
        self.run(self.sched.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mesh(smollm2_dir, pki):
    m = TlsMesh(smollm2_dir, pki)
    yield m
    m.close()


def _generate(channel) -> list:
    req = llm_pb2.GenerateRequest(prompt="The capital of France is")
    req.sampling.temperature, req.sampling.max_tokens, req.sampling.ignore_eos = 0.0, 3, True
    return list(llm_pb2_grpc.LLMServiceStub(channel).Generate(req, timeout=30))


def _tls_channel(address: str, ca: str, cert: str | None = None, key: str | None = None) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        _read(ca), _read(key) if key else None, _read(cert) if cert else None))


def _fails(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    return e.value


# ---- tests --------------------------------------------------------------------------------------------

def test_tls_client_is_served_and_plaintext_refused(mesh, pki):
    with _tls_channel(mesh.gw.address, pki.ca) as ch:
        msgs = _generate(ch)
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 3
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(mesh.gw.address) as ch:            # plaintext: refused
        _fails(lambda: _generate(ch))
    with _tls_channel(mesh.gw.address, pki.rogue_ca) as ch:       # a certificate this client does not trust
        _fails(lambda: _generate(ch))
    with _tls_channel(mesh.gw.address, pki.ca) as ch:             # and the gateway still serves
        assert _generate(ch)[-1].finished


@pytest.mark.parametrize("which", ["gw", "sched"])
def test_plaintext_health_port_serves_health_only(mesh, which):
    """Probes that cannot speak TLS ask the health-only port: the same statuses, nothing else."""
    server = getattr(mesh, which)
    service = {"gw": "kvmesh.v1.LLMService", "sched": "kvmesh.v1.SchedulerService"}[which]
    with grpc.insecure_channel(f"127.0.0.1:{server.health_server.health_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", service):
            r = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            llm_pb2_grpc.LLMServiceStub(ch).ListModels(llm_pb2.ListModelsRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_http_port_speaks_https_only(mesh, pki):
    import http.client
    import json
    import ssl
    import urllib.request
    assert mesh.gw.http.url.startswith("https://")
    ctx = ssl.create_default_context(cafile=pki.ca)
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{mesh.gw.http.url}/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=60) as r:
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
    with pytest.raises((OSError, http.client.HTTPException)):     # plaintext HTTP: no answer
        urllib.request.urlopen(f"http://{mesh.gw.http.address}/health", timeout=10).read()
    with pytest.raises(OSError):                                   # a CA the server's certificate is not of
        urllib.request.urlopen(f"{mesh.gw.http.url[:-3]}/health", timeout=10,
                               context=ssl.create_default_context(cafile=pki.rogue_ca)).read()
    with urllib.request.urlopen(f"{mesh.gw.http.url[:-3]}/health", context=ctx, timeout=10) as r:
        assert r.status == 200


@pytest.mark.parametrize("size", [64 * 1024, 2**20])
def test_https_oversized_headers_get_431(mesh, pki, size):
    """Issue 37, 4 over TLS (no half-close there: the server reads and drops the rest, then closes)."""
    import httpx2
    with httpx2.Client(verify=ssl.create_default_context(cafile=pki.ca), timeout=60) as client:
        r = client.get(f"{mesh.gw.http.url}/models", headers={"authorization": "Bearer " + "k" * size})
        assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
        assert client.get(f"{mesh.gw.http.url[:-3]}/health").status_code == 200


def test_client_and_cli_with_the_ca(mesh, pki, capsys):
    from kvmesh.cli import main
    with Client(mesh.gw.address, tls_ca_file=pki.ca) as c:
        c.wait_ready(timeout=10)
        text, final = collect(c.generate("The capital of France is", temperature=0, max_tokens=3))
    assert final.usage.completion_tokens == 3
    argv = ["generate", "--server", mesh.gw.address, "--prompt", "The capital of France is", "--max-tokens", "3",
            "--temperature", "0", "--wait", "2"]
    assert main(argv + ["--tls-ca-file", pki.ca]) == 0
    assert capsys.readouterr().out.strip() == text.strip()
    assert main(argv) == 1                                         # plaintext against TLS: not ready, exit 1
    assert "not ready" in capsys.readouterr().err
    assert main(argv + ["--tls-ca-file", pki.not_pem]) == 2
    assert "tls_ca_file" in capsys.readouterr().err


def test_scheduler_requires_the_gateways_client_certificate(mesh, pki):
    addr = f"127.0.0.1:{mesh.sched.port}"

    def info(ch):
        return scheduler_pb2_grpc.SchedulerServiceStub(ch).GetModelInfo(scheduler_pb2.GetModelInfoRequest(),
                                                                         timeout=10)

    with _tls_channel(addr, pki.ca, pki.client_cert, pki.client_key) as ch:
        assert info(ch).max_model_len == 256
    with _tls_channel(addr, pki.ca) as ch:                         # no client certificate
        _fails(lambda: info(ch))
    with _tls_channel(addr, pki.ca, pki.rogue_cert, pki.rogue_key) as ch:   # one of another CA
        _fails(lambda: info(ch))
    with grpc.insecure_channel(addr) as ch:                        # plaintext
        _fails(lambda: info(ch))


@pytest.mark.parametrize("case", ["rogue client cert", "no client cert", "plaintext"])
def test_gateway_with_a_wrong_client_certificate_cannot_reach_the_scheduler(mesh, pki, case):
    from gateway.server import serve_gateway
    kw = {"rogue client cert": dict(scheduler_tls_client_cert_file=pki.rogue_cert,
                                    scheduler_tls_client_key_file=pki.rogue_key),
          "no client cert": dict(scheduler_tls_client_cert_file="", scheduler_tls_client_key_file=""),
          "plaintext": dict(scheduler_tls_ca_file="", scheduler_tls_client_cert_file="",
                            scheduler_tls_client_key_file="")}[case]
    with pytest.raises(EngineError, match="unreachable after 3 s"):
        mesh.run(serve_gateway(mesh.gateway_config(connect_timeout=3, **kw)))
    with _tls_channel(mesh.gw.address, pki.ca) as ch:              # the mesh's own gateway is unaffected
        assert _generate(ch)[-1].finished


def test_bad_tls_settings_are_named(mesh, pki):
    from gateway.server import serve_gateway
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
    from scheduler.service import serve_scheduler
    with pytest.raises(EngineError, match="tls_cert_file and tls_key_file go together"):
        mesh.run(serve_gateway(GatewayConfig(port=0, tls_cert_file=pki.server_cert)))
    with pytest.raises(EngineError, match="tls_client_ca_file .* needs tls_cert_file"):
        mesh.run(serve_scheduler(SchedulerConfig(port=0, tls_client_ca_file=pki.ca), EngineConfig()))
    with pytest.raises(EngineError, match="need scheduler_tls_ca_file"):
        GatewayConfig(scheduler_tls_client_cert_file=pki.client_cert,
                      scheduler_tls_client_key_file=pki.client_key).check_tls()
    with pytest.raises(EngineError, match="health_port must be a port"):
        GatewayConfig(health_port=70000)
    with pytest.raises(EngineError, match=r"tls_cert_file: .*not\.pem is not a PEM file"):
        mesh.run(serve_gateway(mesh.gateway_config(tls_cert_file=pki.not_pem)))
    with pytest.raises(EngineError, match=r"scheduler_tls_ca_file: cannot read .*missing\.pem"):
        mesh.run(serve_gateway(mesh.gateway_config(scheduler_tls_ca_file=pki.ca + ".missing.pem")))


def test_serve_refuses_a_tls_scheduler_the_gateway_cannot_dial(pki):
    from kvmesh import serve
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
    sched = SchedulerConfig(port=0, tls_cert_file=pki.server_cert, tls_key_file=pki.server_key)
    with pytest.raises(EngineError, match="needs --scheduler-tls-ca-file"):
        asyncio.run(serve.start_mesh(serve.Mesh(), sched, EngineConfig(), GatewayConfig(port=0)))


def test_deploy_secrets_script_makes_working_mutual_tls(tmp_path):
    """deploy/make_secrets.sh (compose, Kubernetes): the gateway's client certificate passes the
    scheduler's mutual TLS under the Service name; its API keys file loads."""
    import shutil
    import subprocess
    from pathlib import Path

    from grpc_health.v1 import health

    from gateway.auth import ApiKeys
    from kvmesh.core import tls
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    script = Path(__file__).resolve().parents[1] / "deploy" / "make_secrets.sh"
    subprocess.run(["sh", str(script), str(tmp_path)], check=True, capture_output=True, timeout=60)
    keys = ApiKeys(str(tmp_path / "api-keys"))
    assert keys.tenants == ("default",)

    async def check() -> int:
        servicer = health.aio.HealthServicer()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(
            str(tmp_path / "scheduler.crt"), str(tmp_path / "scheduler.key"), str(tmp_path / "ca.crt")))
        await server.start()
        try:
            creds = tls.channel_credentials(str(tmp_path / "ca.crt"), str(tmp_path / "gateway-client.crt"),
                                            str(tmp_path / "gateway-client.key"))
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                               options=tls.server_name_option("kvmesh-scheduler")) as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return r.status
        finally:
            await server.stop(None)

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING
