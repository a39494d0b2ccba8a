"""The deployment files (deploy/) agree with the code.

Renaming a setting, a flag, a port or a service in the code breaks one of these tests instead of
a deployment:

- every ``KVMESH_*`` variable in compose / Kubernetes is a field of EngineConfig, SchedulerConfig or
  GatewayConfig (by their ``ENV_PREFIX``), and each container's settings build with ``from_env``;
- listen ports, published ports, containerPorts, Services and health probes agree with the ports
  those settings give; the gateway's ``scheduler_address`` and the scheduler's ``ray_address``
  name the right compose service / Kubernetes Service and port;
- containers run the image deploy/Dockerfile builds (``kvmesh:<pyproject version>``), and their
  commands parse: ``kvmesh`` subcommands with :func:`kvmesh.cli.build_parser`, ``ray start`` /
  ``ray health-check`` with Ray's own CLI;
- the KubeRay RayCluster has the fields the operator requires;
- the Dockerfile (read as text): base image, CPU torch constraints, EXPOSE, ENTRYPOINT, model pull;
- deploy/grpc_health_check.py (compose's health check) against a real gRPC health server.

Nothing here builds an image or starts a container: no Docker engine or Kubernetes cluster runs
in CI (see deploy/README.md for what is not verified).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import shlex
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.grpc_server import LIVENESS
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
from kvmesh.core.settings import env_var
from kvmesh.v1 import llm_pb2, scheduler_pb2

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
HEALTH_SCRIPT = DEPLOY / "grpc_health_check.py"

CONFIGS = (EngineConfig, SchedulerConfig, GatewayConfig)
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
# KVMESH_* variables that are not config fields: the model cache root (kvmesh.hub.cache.kvmesh_home).
NON_CONFIG_VARS = {"KVMESH_HOME"}
REDIS_PORT, OTLP_GRPC_PORT, RAY_CLIENT_DEFAULT_PORT, RAY_GCS_DEFAULT_PORT = 6379, 4317, 10001, 6379
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# KubeRay passes "false" for these ray start options instead of dropping the flag (convertParamMap).
KUBERAY_EXPLICIT_BOOL_PARAMS = {"log-color", "include-dashboard", "include-log-monitor"}


# ---- reading the files -------------------------------------------------------------------------

def yaml_docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def deploy_yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


IMAGE = f"kvmesh:{project()['project']['version']}"


@dataclasses.dataclass
class Dockerfile:
    instructions: list[tuple[str, str]]         # (INSTRUCTION, rest of the line), continuations joined

    @classmethod
    def read(cls, path: Path = DOCKERFILE) -> "Dockerfile":
        out, buf = [], ""
        for line in path.read_text().splitlines():
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            buf += line
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
        assert not buf, "Dockerfile ends inside a line continuation"
        return cls(out)

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]

    def index(self, word: str, pred=lambda rest: True) -> int:
        return next(i for i, (w, rest) in enumerate(self.instructions) if w == word and pred(rest))

    @property
    def args(self) -> dict[str, str | None]:
        out = {}
        for rest in self.all("ARG"):
            name, _, default = rest.partition("=")
            out[name.strip()] = default.strip() or None
        return out

    @property
    def env(self) -> dict[str, str]:
        out = {}
        for rest in self.all("ENV"):
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                out[k] = v
        return out

    def exec_form(self, word: str) -> list[str]:
        (rest,) = self.all(word)
        value = json.loads(rest)
        assert isinstance(value, list), f"{word} should be in exec (JSON) form, got {rest!r}"
        return value

    def substitute(self, text: str) -> str:
        for name, default in self.args.items():
            if default is not None:
                text = text.replace("${%s}" % name, default).replace("$" + name, default)
        return text


DF = Dockerfile.read()


def compose() -> dict:
    (doc,) = yaml_docs(DEPLOY / "compose.yaml")
    return doc


def k8s_objects() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml" for d in yaml_docs(p)]


def k8s_find(kind: str, name: str | None = None) -> list[dict]:
    return [o for o in k8s_objects() if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


@dataclasses.dataclass
class Container:
    """One container of compose or Kubernetes, as the image will run it."""
    where: str
    image: str
    argv: list[str]                 # effective entrypoint + command
    env: dict[str, str]
    spec: dict                      # the compose service or Kubernetes container
    pod_labels: dict | None = None  # Kubernetes: the pod template's labels

    @property
    def subcommand(self) -> str | None:
        return self.argv[1] if len(self.argv) > 1 and self.argv[0] == "kvmesh" else None


def _argv(image: str, entrypoint, command) -> list[str]:
    """Docker semantics: a given entrypoint drops the image's CMD."""
    ours = image == IMAGE
    if isinstance(entrypoint, str):
        entrypoint = shlex.split(entrypoint)
    if isinstance(command, str):
        command = shlex.split(command)
    if entrypoint is None:
        entrypoint = DF.exec_form("ENTRYPOINT") if ours else []
        if command is None:
            command = DF.exec_form("CMD") if ours else []
    return list(entrypoint) + list(command or [])


def compose_containers() -> list[Container]:
    out = []
    for name, svc in compose()["services"].items():
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        out.append(Container(f"compose service {name}", svc["image"],
                             _argv(svc["image"], svc.get("entrypoint"), svc.get("command")),
                             {k: str(v) for k, v in env.items()}, svc))
    return out


def _k8s_env(c: dict) -> dict[str, str]:
    env = {}
    for src in c.get("envFrom", []):
        (cm,) = k8s_find("ConfigMap", src["configMapRef"]["name"])
        env.update(cm["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
    return env


def pod_templates() -> list[tuple[str, dict, str | None]]:
    """(where, pod template, Ray node type or None) of every workload."""
    out = []
    for o in k8s_objects():
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            out.append((name, o["spec"]["template"], None))
        elif o["kind"] == "RayCluster":
            out.append((f"{name} head", o["spec"]["headGroupSpec"]["template"], "head"))
            for g in o["spec"].get("workerGroupSpecs", []):
                out.append((f"{name} worker group {g['groupName']}", g["template"], "worker"))
    return out


def k8s_containers() -> list[Container]:
    out = []
    for where, tpl, ray_node in pod_templates():
        for c in tpl["spec"]["containers"]:
            argv = ["ray", "start"] if ray_node else _argv(c["image"], c.get("command"), c.get("args"))
            out.append(Container(f"{where} container {c['name']}", c["image"], argv, _k8s_env(c), c,
                                 tpl["metadata"].get("labels", {})))
    return out


def all_containers() -> list[Container]:
    return compose_containers() + k8s_containers()


def service_containers(subcommand: str) -> list[Container]:
    found = [c for c in all_containers() if c.subcommand == subcommand]
    assert {c.where.split()[0] for c in found} == {"compose", "Deployment/kvmesh-" + subcommand}, \
        f"expected one `kvmesh {subcommand}` container in compose and one in Kubernetes, got {[c.where for c in found]}"
    return found


def config_field(var: str) -> tuple[type, str] | None:
    """The (config class, field) that environment variable ``var`` sets (``<ENV_PREFIX><FIELD>``,
    or the class's ``ENV_OVERRIDES`` name, e.g. KVMESH_REDIS_URL), or None."""
    hits = [(cls, f.name) for cls in CONFIGS for f in dataclasses.fields(cls) if var == env_var(cls, f.name)]
    assert len(hits) <= 1, f"{var} is ambiguous: {hits}"
    return hits[0] if hits else None


def settings(c: Container) -> dict[type, object]:
    """Each config built from ``c``'s environment only (as the container would)."""
    with mock.patch.dict(os.environ, c.env, clear=True):
        return {cls: cls.from_env() for cls in CONFIGS}


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"expected HOST:PORT, got {address!r}"
    return host, int(port)


def probes(c: dict) -> dict[str, dict]:
    return {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}


def container_port(c: dict, ref) -> int:
    """A Service targetPort (number or name) as ``c``'s containerPort number."""
    for p in c.get("ports", []):
        if ref in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    raise AssertionError(f"container {c['name']} has no port {ref!r}")


def k8s_service_backend(host: str, port: int) -> tuple[dict, Container, int]:
    """Follow ``host:port`` (a Service name, optionally .namespace[.svc...]) to (Service, the one
    container behind it, containerPort)."""
    name = host.split(".")[0]
    svcs = k8s_find("Service", name)
    assert len(svcs) == 1, f"no Kubernetes Service named {name!r} (from {host}:{port})"
    svc = svcs[0]
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port] or [None]
    assert sp is not None, f"Service {name} has no port {port}"
    selector = svc["spec"]["selector"]
    backends = [c for c in k8s_containers() if c.pod_labels is not None
                and selector.items() <= c.pod_labels.items()]
    pods = {c.where.split(" container ")[0] for c in backends}
    assert len(pods) == 1, f"Service {name} selects {sorted(pods) or 'no workload'}"
    target = sp.get("targetPort", sp["port"])
    owner = [c for c in backends if any(target in (p["containerPort"], p.get("name"))
                                        for p in c.spec.get("ports", []))]
    assert len(owner) == 1, f"Service {name} targetPort {target!r} matches no container port"
    return svc, owner[0], container_port(owner[0].spec, target)


def ray_cli():
    from ray.scripts.scripts import cli
    return cli


def parse_click(command: str, args: list[str]) -> dict:
    """Parse ``ray <command> args`` with Ray's click CLI, without running it."""
    import click
    try:
        return ray_cli().commands[command].make_context(f"ray {command}", list(args)).params
    except click.ClickException as e:
        raise AssertionError(f"ray {command} {' '.join(args)}: {e.format_message()}") from None


def kuberay_start_args(params: dict[str, str]) -> list[str]:
    """The ``ray start`` flags KubeRay generates from rayStartParams (its convertParamMap)."""
    out = []
    for k, v in sorted(params.items()):
        if v.lower() in ("true", "false") and k not in KUBERAY_EXPLICIT_BOOL_PARAMS:
            if v.lower() == "true":
                out.append(f"--{k}")
        else:
            out.append(f"--{k}={v}")
    return out


def raycluster() -> dict:
    (rc,) = k8s_find("RayCluster")
    return rc


def load_health_script():
    spec = importlib.util.spec_from_file_location("grpc_health_check", HEALTH_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- every file parses -------------------------------------------------------------------------

def test_every_yaml_file_parses():
    files = deploy_yaml_files()
    assert {p.relative_to(DEPLOY).as_posix() for p in files} >= {"compose.yaml", "k8s/kustomization.yaml"}
    for p in files:
        docs = yaml_docs(p)
        assert docs and all(isinstance(d, dict) for d in docs), p
        if p.parent == K8S and p.name != "kustomization.yaml":
            for d in docs:
                assert {"apiVersion", "kind", "metadata"} <= d.keys() and d["metadata"].get("name"), (p, d)


def test_kustomization_lists_every_manifest():
    (kust,) = yaml_docs(K8S / "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    listed = kust["resources"]
    assert len(listed) == len(set(listed))
    on_disk = {p.name for p in K8S.glob("*.y*ml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk


# ---- settings ------------------------------------------------------------------------------------

def test_kvmesh_variables_are_config_fields():
    sources = {"Dockerfile ENV": DF.env}
    for c in all_containers():
        sources[c.where] = c.env
    for cm in k8s_find("ConfigMap"):
        sources[f"ConfigMap/{cm['metadata']['name']}"] = cm["data"]
    seen = set()
    for where, env in sources.items():
        for var in env:
            if not var.startswith("KVMESH_"):
                continue
            seen.add(var)
            assert var in NON_CONFIG_VARS or config_field(var) is not None, \
                f"{where}: {var} is no field of {', '.join(c.__name__ for c in CONFIGS)} " \
                f"(prefixes {', '.join(c.ENV_PREFIX for c in CONFIGS)})"
    assert {"KVMESH_MODEL", "KVMESH_SCHEDULER_RAY_ADDRESS", "KVMESH_GATEWAY_SCHEDULER_ADDRESS"} <= seen


def test_kvmesh_home_is_the_images_alone():
    """The scheduler hands the stage actors a model directory under its own KVMESH_HOME, so every
    container must keep the image's."""
    from kvmesh.hub.cache import kvmesh_home
    assert "KVMESH_HOME" in inspect.getsource(kvmesh_home)
    assert DF.env.get("KVMESH_HOME", "").startswith("/")
    for c in all_containers():
        assert "KVMESH_HOME" not in c.env, f"{c.where} overrides the image's KVMESH_HOME"


def test_configmap_and_env_values_are_strings():
    for cm in k8s_find("ConfigMap"):
        for k, v in cm["data"].items():
            assert isinstance(v, str), f"ConfigMap {cm['metadata']['name']}: {k} must be a string, got {v!r}"
    for _, tpl, _ in pod_templates():
        for c in tpl["spec"]["containers"]:
            for e in c.get("env", []):
                assert "valueFrom" in e or isinstance(e.get("value"), str), (c["name"], e)


@pytest.mark.parametrize("c", [c for c in all_containers() if c.subcommand], ids=lambda c: c.where)
def test_container_settings_parse(c):
    """from_env accepts every value, and each KVMESH_* variable reaches its field."""
    cfgs = settings(c)
    for var, value in c.env.items():
        hit = config_field(var)
        if hit:
            cls, field = hit
            assert getattr(cfgs[cls], field) == getattr(cls(**{field: value}), field), (c.where, var)


def test_served_model_is_the_one_in_the_image():
    from kvmesh.hub.manifest import canonical_name
    model = DF.args["MODEL"]
    assert model and canonical_name(model) == model, f"Dockerfile ARG MODEL={model!r} is not a known model"
    for name, svc in compose()["services"].items():
        if "build" in svc:
            assert svc["build"]["args"]["MODEL"] == model, name
    for c in service_containers("scheduler"):
        assert settings(c)[EngineConfig].model == model, c.where


# ---- ports, addresses, probes --------------------------------------------------------------------

SERVICES = {"scheduler": (SchedulerConfig, SCHEDULER_SERVICE), "gateway": (GatewayConfig, LLM_SERVICE)}


@pytest.mark.parametrize("sub", sorted(SERVICES))
def test_services_listen_where_probes_and_ports_say(sub):
    cls, grpc_service = SERVICES[sub]
    for c in service_containers(sub):
        cfg = settings(c)[cls]
        assert cfg.host == "0.0.0.0", f"{c.where}: listens on {cfg.host}, unreachable from other containers"
        assert cfg.port > 0
        # the probes speak plaintext: a TLS service is probed on its plaintext health-only port
        probed = cfg.health_port if cfg.tls_cert_file else cfg.port
        assert probed > 0, f"{c.where}: TLS without a health_port leaves the probes nothing to ask"
        if c.where.startswith("compose"):
            test = c.spec["healthcheck"]["test"]
            assert test[:3] == ["CMD", "python", "/opt/kvmesh/grpc_health_check.py"], test
            args = load_health_script().build_parser().parse_args(test[3:])
            assert host_port(args.address)[1] == probed and args.service == grpc_service, test
        else:
            assert container_port(c.spec, "grpc") == cfg.port
            if cfg.health_port > 0:
                assert container_port(c.spec, "health") == cfg.health_port
            ps = probes(c.spec)
            assert {"readinessProbe", "livenessProbe"} <= ps.keys(), c.where
            for kind, p in ps.items():
                assert p["grpc"]["port"] == probed, (c.where, kind)   # grpc probes take numbers only
                # readiness (and start-up) ask the service, which follows what it depends on;
                # liveness asks `liveness`, which does not (a replica restart must not kill the pod)
                want = grpc_service if kind != "livenessProbe" else LIVENESS
                assert p["grpc"].get("service", "") == want, (c.where, kind)


def _mounted_files(c: Container) -> list[str]:
    """Where ``c``'s secrets are: compose secrets (/run/secrets/<name>), Kubernetes secret volumes
    (their mount paths, each a directory of the Secret's keys)."""
    if c.where.startswith("compose"):
        top = compose().get("secrets", {})
        names = [s if isinstance(s, str) else s["source"] for s in c.spec.get("secrets", [])]
        assert all(n in top and top[n].get("file") for n in names), (c.where, names)
        return [f"/run/secrets/{n}" for n in names]
    (dep,) = k8s_find("Deployment", c.where.split()[0].split("/")[1])
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    mounts = [m for m in c.spec.get("volumeMounts", []) if "secret" in volumes.get(m["name"], {})]
    assert all(m.get("readOnly") and "subPath" not in m for m in mounts), c.where   # no subPath: updates arrive
    return [m["mountPath"].rstrip("/") + "/" for m in mounts]


@pytest.mark.parametrize("sub", sorted(SERVICES))
def test_tls_and_api_keys_come_from_mounted_secrets(sub):
    """Both deployments run with TLS between every kvmesh service and the gateway's API keys; each
    file those settings name is a mounted secret (compose) or in a secret volume (Kubernetes)."""
    cls, _ = SERVICES[sub]
    for c in service_containers(sub):
        cfg = settings(c)[cls]
        files = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                 if f.name.endswith("_file") and getattr(cfg, f.name)}
        want = {"tls_cert_file", "tls_key_file"} | (
            {"tls_client_ca_file"} if sub == "scheduler" else
            {"api_keys_file", "scheduler_tls_ca_file", "scheduler_tls_client_cert_file",
             "scheduler_tls_client_key_file"})
        assert want <= files.keys(), (c.where, sorted(want - files.keys()))
        mounted = _mounted_files(c)
        for name, path in files.items():
            assert any(path == m or (m.endswith("/") and path.startswith(m)) for m in mounted), (c.where, name, path)


def test_gateway_dials_the_scheduler_by_a_name_its_certificate_holds():
    """make_secrets.sh names the scheduler's certificate after the compose service and the
    Kubernetes Service the gateways dial."""
    script = (DEPLOY / "make_secrets.sh").read_text()
    (san,) = [line for line in script.splitlines() if line.startswith("cert scheduler ")]
    for gw in service_containers("gateway"):
        cfg = settings(gw)[GatewayConfig]
        host = cfg.scheduler_tls_server_name or host_port(cfg.scheduler_address)[0]
        assert f"DNS:{host}," in san or san.endswith(f"DNS:{host}"), (gw.where, host, san)


def test_dockerfile_exposes_the_default_ports():
    exposed = {int(p.split("/")[0]) for rest in DF.all("EXPOSE") for p in rest.split()}
    assert exposed == {SchedulerConfig().port, GatewayConfig().port}


def test_gateway_is_published_on_its_port():
    (c,) = [c for c in service_containers("gateway") if c.where.startswith("compose")]
    port = settings(c)[GatewayConfig].port
    published = []
    for p in c.spec.get("ports", []):
        published.append(int(str(p).rsplit(":", 1)[-1].split("/")[0]) if not isinstance(p, dict) else p["target"])
    assert published == [port]
    (svc, _, target) = k8s_service_backend("kvmesh-gateway", port)
    assert target == port


def test_gateway_points_at_the_scheduler():
    for gw in service_containers("gateway"):
        host, port = host_port(settings(gw)[GatewayConfig].scheduler_address)
        if gw.where.startswith("compose"):
            svc = compose()["services"].get(host)
            assert svc is not None, f"compose has no service {host!r}"
            (sched,) = [c for c in compose_containers() if c.where == f"compose service {host}"]
            assert sched.subcommand == "scheduler"
            assert port == settings(sched)[SchedulerConfig].port
        else:
            _, sched, target = k8s_service_backend(host, port)
            assert sched.subcommand == "scheduler", f"Service {host} leads to {sched.where}"
            assert target == settings(sched)[SchedulerConfig].port


def test_gateway_waits_for_the_scheduler_no_longer_than_its_startup_probe():
    (gw,) = [c for c in service_containers("gateway") if not c.where.startswith("compose")]
    p = gw.spec["startupProbe"]
    window = p.get("initialDelaySeconds", 0) + p.get("periodSeconds", 10) * p.get("failureThreshold", 3)
    assert window >= settings(gw)[GatewayConfig].connect_timeout


def test_scheduler_points_at_the_ray_client_server():
    for c in service_containers("scheduler"):
        cfg = settings(c)[SchedulerConfig]
        assert cfg.executor == "ray"
        url = urlsplit(cfg.ray_address)
        assert url.scheme == "ray", f"{c.where}: a scheduler outside the Ray cluster needs Ray Client (ray://)"
        if c.where.startswith("compose"):
            (head,) = [h for h in compose_containers() if h.where == f"compose service {url.hostname}"]
            assert head.argv[:2] == ["ray", "start"], head.argv
            params = parse_click("start", head.argv[2:])
            assert params["head"] and (params["ray_client_server_port"] or RAY_CLIENT_DEFAULT_PORT) == url.port
        else:
            rc = raycluster()
            assert url.hostname.split(".")[0] == f"{rc['metadata']['name']}-head-svc"
            head = rc["spec"]["headGroupSpec"]
            assert int(head["rayStartParams"].get("ray-client-server-port", RAY_CLIENT_DEFAULT_PORT)) == url.port
            assert container_port(head["template"]["spec"]["containers"][0], url.port) == url.port


def test_redis_and_otlp_addresses():
    services = compose()["services"]
    for c in all_containers():
        if "KVMESH_REDIS_URL" in c.env:
            url = urlsplit(c.env["KVMESH_REDIS_URL"])
            assert url.scheme == "redis" and url.port == REDIS_PORT, c.env["KVMESH_REDIS_URL"]
            if c.where.startswith("compose"):
                assert services[url.hostname]["image"].startswith("redis:")
            else:
                _, redis, target = k8s_service_backend(url.hostname, url.port)
                assert redis.image.startswith("redis:") and target == REDIS_PORT
        if "OTEL_EXPORTER_OTLP_ENDPOINT" in c.env:
            url = urlsplit(c.env["OTEL_EXPORTER_OTLP_ENDPOINT"])
            assert url.port == OTLP_GRPC_PORT, c.where
            if c.where.startswith("compose"):
                assert services[url.hostname]["image"].startswith("jaegertracing/all-in-one:")
            else:
                _, jaeger, target = k8s_service_backend(url.hostname, url.port)
                assert jaeger.image.startswith("jaegertracing/all-in-one:") and target == OTLP_GRPC_PORT, c.where
    for c in service_containers("scheduler"):
        assert settings(c)[SchedulerConfig].redis_url == c.env["KVMESH_REDIS_URL"], c.where


# ---- images and commands -------------------------------------------------------------------------

def test_containers_run_the_image_the_dockerfile_builds():
    assert DF.all("FROM") == ["python:3.11-slim"]
    for c in all_containers():
        repo = c.image.rsplit(":", 1)[0]
        assert ":" in c.image and not c.image.endswith(":latest"), f"{c.where}: pin the tag of {c.image}"
        if repo == "kvmesh" or c.argv[:1] in (["kvmesh"], ["ray"]):
            assert c.image == IMAGE, f"{c.where} runs {c.image}, the Dockerfile is tagged {IMAGE}"
        if not c.where.startswith("compose") and c.image == IMAGE:
            assert c.spec.get("imagePullPolicy") == "IfNotPresent", c.where
    for name, svc in compose()["services"].items():
        if "build" in svc:
            assert svc["image"] == IMAGE
            assert (DEPLOY / svc["build"]["context"]).resolve() == ROOT, name
            assert svc["build"]["dockerfile"] == DOCKERFILE.relative_to(ROOT).as_posix(), name


def test_container_commands_are_kvmesh_commands():
    from kvmesh import cli
    from kvmesh.core import flags

    parser = cli.build_parser()
    (sub_action,) = [a for a in parser._actions if a.dest == "command"]
    containers = [c for c in all_containers() if c.subcommand]
    assert {c.subcommand for c in containers} == {"scheduler", "gateway"}
    for c in containers:
        if c.subcommand not in sub_action.choices:
            pytest.skip(f"`kvmesh {c.subcommand}` is not in the CLI yet (added by the mesh services change); "
                        f"deploy/ runs it in {c.where}")
        try:
            args = parser.parse_args(c.argv[1:])
        except SystemExit:
            pytest.fail(f"{c.where}: `{shlex.join(c.argv)}` does not parse with kvmesh.cli.build_parser()")
        # A flag default that is not None would beat the container's KVMESH_* variable.
        given = {EngineConfig: flags.engine_kwargs(args), SchedulerConfig: flags.scheduler_kwargs(args),
                 GatewayConfig: flags.gateway_kwargs(args)}
        for var in c.env:
            hit = config_field(var)
            if hit and hit[0] in given and hit[1] in given[hit[0]]:
                assert given[hit[0]][hit[1]] is None, \
                    f"{c.where}: the flag for {hit[0].__name__}.{hit[1]} defaults to {given[hit[0]][hit[1]]!r}, " \
                    f"so {var} would be ignored"


def test_dockerfile_pulls_the_model_with_the_cli():
    from kvmesh import cli

    runs = DF.all("RUN")
    pulls = [r for r in runs if "kvmesh models pull" in r]
    assert len(pulls) == 1
    argv = shlex.split(DF.substitute(pulls[0]))
    i = argv.index("kvmesh")
    args = cli.build_parser().parse_args(argv[i + 1:])
    assert args.func is cli.models.cmd_pull and args.names == [DF.args["MODEL"]]
    pull_at = DF.index("RUN", lambda r: "kvmesh models pull" in r)
    # the cache is the runtime user's, and where the services look (KVMESH_HOME set before the pull)
    assert DF.index("USER") < pull_at and DF.index("ENV", lambda r: "KVMESH_HOME=" in r) < pull_at


def test_dockerfile_installs_kvmesh_with_the_cpu_torch_pin():
    constraints = (ROOT / "constraints-cpu.txt").read_text()
    assert any(line.startswith("torch==") for line in constraints.splitlines())
    assert any(shlex.split(r)[:2] == ["constraints-cpu.txt", "./"] for r in DF.all("COPY"))
    installs = [shlex.split(DF.substitute(r)) for r in DF.all("RUN") if "pip install" in r]
    assert installs and any("." in argv for argv in installs)
    for argv in installs:
        argv = argv[:argv.index("&&")] if "&&" in argv else argv
        assert argv[argv.index("-c") + 1] == "constraints-cpu.txt", argv
        assert argv[argv.index("--extra-index-url") + 1] == CPU_TORCH_INDEX, argv
    requires = project()["project"]["requires-python"]
    assert requires == ">=3.11" and DF.all("FROM")[0].startswith("python:3.11")


def test_dockerfile_copies_every_package_and_the_context_allows_it():
    copied = [shlex.split(r)[0].rstrip("/") for r in DF.all("COPY")]
    packages = [p.rstrip("*") for p in project()["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert set(packages) <= set(copied), f"the image misses packages {set(packages) - set(copied)}"
    allowed = {line[1:].rstrip("/") for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert set(copied) <= allowed, f"Dockerfile.dockerignore leaves out {set(copied) - allowed}"
    for src in copied:
        assert (ROOT / src).exists(), src
    assert any(shlex.split(r) == [HEALTH_SCRIPT.relative_to(ROOT).as_posix(), "/opt/kvmesh/grpc_health_check.py"]
               for r in DF.all("COPY"))


def test_dockerfile_entrypoint_user():
    assert DF.exec_form("ENTRYPOINT") == ["kvmesh"]
    assert project()["project"]["scripts"]["kvmesh"] == "kvmesh.cli:main"
    user = DF.all("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root USER (runAsNonRoot checks it)"


# ---- compose -------------------------------------------------------------------------------------

def test_compose_dependencies_wait_for_health():
    services = compose()["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"
    sched = next(c for c in service_containers("scheduler") if c.where.startswith("compose"))
    gw = next(c for c in service_containers("gateway") if c.where.startswith("compose"))
    sched_name, gw_name = sched.where.split()[-1], gw.where.split()[-1]
    ray_head = urlsplit(settings(sched)[SchedulerConfig].ray_address).hostname
    assert services[sched_name]["depends_on"][ray_head]["condition"] == "service_healthy"
    assert services[gw_name]["depends_on"][sched_name]["condition"] == "service_healthy"


def test_compose_ray_nodes():
    services = compose()["services"]
    heads = [c for c in compose_containers() if c.argv[:2] == ["ray", "start"] and "--head" in c.argv]
    (head,) = heads
    head_params = parse_click("start", head.argv[2:])
    assert head_params["block"] and head_params["include_dashboard"] is False
    head_name = head.where.split()[-1]
    gcs = head_params["port"] or RAY_GCS_DEFAULT_PORT
    workers = [c for c in compose_containers() if c.argv[:2] == ["ray", "start"] and c.where != head.where]
    assert workers
    for c in workers:
        params = parse_click("start", c.argv[2:])
        assert params["block"] and host_port(params["address"]) == (head_name, gcs), c.where
        assert services[c.where.split()[-1]]["depends_on"][head_name]["condition"] == "service_healthy"
    for c in heads + workers:
        test = c.spec["healthcheck"]["test"]
        assert test[:3] == ["CMD", "ray", "health-check"], test
        params = parse_click("health-check", test[3:])
        assert host_port(params["address"]) in ((head_name, gcs), ("127.0.0.1", gcs)), test


# ---- Kubernetes ----------------------------------------------------------------------------------

def test_raycluster_has_what_kuberay_requires():
    rc = raycluster()
    assert rc["apiVersion"] == "ray.io/v1"
    head = rc["spec"]["headGroupSpec"]
    groups = rc["spec"]["workerGroupSpecs"]
    assert groups
    specs = [("head", head)] + [("worker", g) for g in groups]
    for node, spec in specs:
        params = spec["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), f"rayStartParams values must be strings: {params}"
        assert "block" not in params and "head" not in params and "address" not in params  # KubeRay adds these
        extra = ["--head"] if node == "head" else [f"--address={rc['metadata']['name']}-head-svc:6379"]
        parse_click("start", extra + ["--block"] + kuberay_start_args(params))
        (c, *_) = spec["template"]["spec"]["containers"]
        assert c["name"] and c["image"] == IMAGE
        assert "command" not in c and "args" not in c, "KubeRay generates the ray start command"
        # KubeRay's own probes need wget and the Ray dashboard agent; ours run `ray health-check`
        assert {"readinessProbe", "livenessProbe"} <= c.keys(), f"{node}: set both probes"
        labels = spec["template"]["metadata"].get("labels", {})
        assert "app.kubernetes.io/name" not in labels, "would override KubeRay's head Service selector"
    for g in groups:
        assert g["groupName"] and {"replicas", "minReplicas", "maxReplicas"} <= g.keys()
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g
    assert len({g["groupName"] for g in groups}) == len(groups)


def test_raycluster_ports_and_probes():
    rc = raycluster()
    svc = f"{rc['metadata']['name']}-head-svc"
    head = rc["spec"]["headGroupSpec"]
    gcs = int(head["rayStartParams"].get("port", RAY_GCS_DEFAULT_PORT))
    hc = head["template"]["spec"]["containers"][0]
    assert container_port(hc, "gcs-server") == gcs
    assert container_port(hc, "client") == int(head["rayStartParams"].get("ray-client-server-port",
                                                                          RAY_CLIENT_DEFAULT_PORT))
    nodes = [("head", hc)] + [("worker", g["template"]["spec"]["containers"][0]) for g in rc["spec"]["workerGroupSpecs"]]
    for node, c in nodes:
        for kind, p in probes(c).items():
            argv = p["exec"]["command"]
            assert argv[:2] == ["ray", "health-check"], (node, kind, argv)
            params = parse_click("health-check", argv[2:])
            want = ("127.0.0.1", gcs) if node == "head" else (svc, gcs)
            assert host_port(params["address"]) == want, (node, kind, argv)
            assert p.get("timeoutSeconds", 1) >= 5, "ray health-check takes a second or more"
    readiness = hc["readinessProbe"]["exec"]["command"]
    assert readiness[-2:] == ["--component", "ray_client_server"], "the scheduler needs the Ray Client server"


def test_k8s_labels_and_selectors():
    objs = k8s_objects()
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))
    for o in objs:
        labels = o["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "kvmesh" and labels.get("app.kubernetes.io/component"), o
    for where, tpl, _ in pod_templates():
        tl = tpl["metadata"]["labels"]
        assert tl.get("app.kubernetes.io/part-of") == "kvmesh" and tl.get("app.kubernetes.io/component"), where
        if any(c["image"] == IMAGE for c in tpl["spec"]["containers"]):
            assert tpl["spec"].get("securityContext", {}).get("runAsNonRoot") is True, where
    for d in k8s_find("Deployment"):
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for s in k8s_find("Service"):
        for p in s["spec"]["ports"]:
            k8s_service_backend(s["metadata"]["name"], p["port"])   # selects one workload, port exists
    (sched,) = k8s_find("Deployment", "kvmesh-scheduler")
    assert sched["spec"]["replicas"] == 1 and sched["spec"]["strategy"]["type"] == "Recreate"


# ---- the compose health check script -------------------------------------------------------------

@pytest.fixture
def health_server():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.set(SCHEDULER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    servicer.set(LLM_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def run_health_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTH_SCRIPT), *args, "--timeout", "2"],
                          capture_output=True, text=True, timeout=60)


def test_health_script_exit_status(health_server):
    ok = run_health_script(health_server, SCHEDULER_SERVICE)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok
    server_wide = run_health_script(health_server)                # "" is SERVING by default
    assert server_wide.returncode == 0, server_wide
    not_serving = run_health_script(health_server, LLM_SERVICE)
    assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stdout, not_serving
    unknown = run_health_script(health_server, "kvmesh.v1.NoSuchService")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout, unknown


def test_health_script_unreachable():
    import socket
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_health_script(f"127.0.0.1:{port}")
    assert r.returncode == 1 and ("UNAVAILABLE" in r.stdout or "DEADLINE_EXCEEDED" in r.stdout), r


# ---- metrics: ports, scrape configuration, Grafana dashboard -------------------------------------

METRICS_PORTS = {"scheduler": (SchedulerConfig, "SCHEDULER_METRICS_PORT"), "gateway": (GatewayConfig, "GATEWAY_METRICS_PORT")}
DASHBOARD = DEPLOY / "grafana" / "kvmesh.json"


@pytest.mark.parametrize("sub", sorted(METRICS_PORTS))
def test_metrics_ports_agree(sub):
    """Each service serves metrics on the deployments' port (kvmesh.core.settings), the Kubernetes
    containerPort/Service/annotations name it, and compose's Prometheus scrapes it."""
    import kvmesh.core.settings
    cls, const = METRICS_PORTS[sub]
    port = getattr(kvmesh.core.settings, const)
    for c in service_containers(sub):
        assert settings(c)[cls].metrics_port == port, c.where
        if c.where.startswith("compose"):
            (prom,) = yaml_docs(DEPLOY / "prometheus.yml")
            targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
            assert f"{c.where.split()[-1]}:{port}" in targets, targets
        else:
            assert container_port(c.spec, "metrics") == port
            (dep,) = k8s_find("Deployment", f"kvmesh-{sub}")
            ann = dep["spec"]["template"]["metadata"]["annotations"]
            assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port
            assert ann.get("prometheus.io/path", "/metrics") == "/metrics"
            _, owner, target = k8s_service_backend(f"kvmesh-{sub}", port)
            assert owner.subcommand == sub and target == port


def test_compose_prometheus_mounts_the_scrape_config():
    prom = compose()["services"]["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]


def _dashboard_exprs(panels) -> list[str]:
    out = []
    for p in panels:
        out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
        out += _dashboard_exprs(p.get("panels", []))     # collapsed rows
    return out


def test_grafana_dashboard_uses_only_defined_metrics():
    import re

    from kvmesh.core.metrics import GATEWAY_METRICS, SCHEDULER_METRICS
    defined = set()
    for name, kind in {**SCHEDULER_METRICS, **GATEWAY_METRICS}.items():
        defined |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    dash = json.loads(DASHBOARD.read_text())
    exprs = _dashboard_exprs(dash["panels"])
    assert exprs
    used = {m for e in exprs for m in re.findall(r"kvmesh:[A-Za-z0-9_:]+", e)}
    assert used <= defined, f"the dashboard queries metrics the code does not define: {sorted(used - defined)}"
    want = {"kvmesh:time_to_first_token_seconds_bucket", "kvmesh:inter_token_latency_seconds_bucket",
            "kvmesh:e2e_request_latency_seconds_bucket", "kvmesh:request_queue_time_seconds_bucket",
            "kvmesh:num_requests_running", "kvmesh:num_requests_waiting", "kvmesh:kv_cache_usage_perc",
            "kvmesh:prefix_cache_hits_total", "kvmesh:prefix_cache_queries_total", "kvmesh:generation_tokens_total",
            "kvmesh:request_success_total", "kvmesh:router_fallbacks_total"}
    assert want <= used, sorted(want - used)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
