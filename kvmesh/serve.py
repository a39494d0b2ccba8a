"""Run kvmesh's gRPC services in this process, on one asyncio loop.

    kvmesh scheduler   the scheduler service alone (its replicas' engines, Ray stage actors)
    kvmesh gateway     the public gateway alone, pointed at a scheduler's address
    kvmesh serve       the mesh: a scheduler, then a gateway pointed at it
    kvmesh demo        the mesh on free ports while a client talks to it

Each service prints one line on stderr, flushed, once it accepts requests::

    kvmesh: scheduler listening on 127.0.0.1:50061
    kvmesh: gateway listening on 127.0.0.1:50051
    kvmesh: http listening on 127.0.0.1:8000 (OpenAI-compatible API at http://127.0.0.1:8000/v1)

(the last only with the gateway's ``--http-port``; with the bound port when the configured one is
0), and, when its ``metrics_port`` is not -1, where its Prometheus endpoint is (docs/telemetry.md)::

    kvmesh: scheduler metrics on http://127.0.0.1:9461/metrics

SIGINT or SIGTERM stops the services in
reverse order of start, each given ``grace`` seconds for in-flight requests: the gateway first
(it drains: health NOT_SERVING at once, new requests UNAVAILABLE with a retry hint, requests in
flight finish within ``grace``, those still running then end UNAVAILABLE with their usage so far;
:mod:`gateway.server`, "Shutdown"), then the scheduler (aborts what is left, frees KV blocks,
shuts its executors down), then the Ray runtime the executors started here (a cluster joined with
``--ray-address`` is only disconnected from). A second signal exits at once. SIGHUP reloads
the gateway's API keys file (:meth:`gateway.auth.ApiKeys.reload`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvmesh.core.errors import SettingsError
from kvmesh.core.net import connect_address, host_port


def announce(message: str) -> None:
    print(f"kvmesh: {message}", file=sys.stderr, flush=True)


def announce_metrics(name: str, server) -> None:
    metrics = getattr(server, "metrics", None)
    if metrics is not None:
        announce(f"{name} metrics on {metrics.url}")
    health = getattr(server, "health_server", None)
    if health is not None:
        announce(f"{name} health checks (plaintext) on {connect_address(server.host, health.health_port)}")


@dataclass
class Mesh:
    """The services this process runs, in order of start: ``(name, server, listen address)``.
    ``scheduler``/``gateway`` are the server objects of :mod:`scheduler.service` and
    :mod:`gateway.server`, or None when not (yet) started."""

    services: list[tuple[str, object, str]] = field(default_factory=list)
    gateway_address: str | None = None       # where a client reaches the gateway
    scheduler_address: str | None = None     # where the gateway reaches the scheduler
    http_url: str | None = None              # the gateway's OpenAI-compatible API (http://.../v1), if on
    stopping: asyncio.Event = field(default_factory=asyncio.Event)   # set by SIGINT/SIGTERM

    def _get(self, name: str):
        return next((s for n, s, _ in self.services if n == name), None)

    @property
    def scheduler(self):
        return self._get("scheduler")

    @property
    def gateway(self):
        return self._get("gateway")

    async def stop(self, grace: float) -> None:
        """Stop the services in reverse order of start (gateway before scheduler)."""
        while self.services:
            name, server, _ = self.services.pop()
            try:
                await server.stop(grace)
            except Exception as e:                       # keep stopping the others
                announce(f"error stopping the {name}: {e!r}")
            else:
                announce(f"{name} stopped")


async def start_scheduler(mesh: Mesh, sched_cfg, engine_cfg) -> None:
    from scheduler.service import serve_scheduler

    server = await serve_scheduler(sched_cfg, engine_cfg)
    listen = host_port(sched_cfg.host, server.port)
    mesh.services.append(("scheduler", server, listen))
    await server.wait_ready()
    mesh.scheduler_address = connect_address(sched_cfg.host, server.port)
    announce(f"scheduler listening on {listen}")
    announce_metrics("scheduler", server)


async def start_gateway(mesh: Mesh, gw_cfg) -> None:
    from gateway.server import serve_gateway

    server = await serve_gateway(gw_cfg)
    listen = host_port(gw_cfg.host, server.port)
    mesh.services.append(("gateway", server, listen))
    mesh.gateway_address = connect_address(gw_cfg.host, server.port)
    announce(f"gateway listening on {listen}")
    if server.http is not None:
        mesh.http_url = server.http.url
        announce(f"http listening on {host_port(gw_cfg.host, server.http.port)} (OpenAI-compatible API at "
                 f"{server.http.url})")
    sched = mesh.scheduler
    if server.metrics is not None and sched is not None:    # one process: one endpoint for both
        from kvmesh.core.metrics import include_registry
        include_registry(server.path.metrics.registry, sched.service.metrics.registry)
        announce(f"metrics (gateway and scheduler) on {server.metrics.url}")
    else:
        announce_metrics("gateway", server)


async def start_mesh(mesh: Mesh, sched_cfg, engine_cfg, gw_cfg) -> None:
    """Start a scheduler, then a gateway pointed at it (``gw_cfg.scheduler_address`` is
    replaced by the scheduler's bound address). Raises SettingsError, before starting either,
    when the scheduler listens with TLS (or mutual TLS) and the gateway has no CA (or client
    certificate) to dial it with."""
    if sched_cfg.tls_cert_file and not gw_cfg.scheduler_tls_ca_file:
        raise SettingsError("--scheduler-tls-cert-file: the gateway needs --scheduler-tls-ca-file to dial a TLS "
                            "scheduler")
    if sched_cfg.tls_client_ca_file and not gw_cfg.scheduler_tls_client_cert_file:
        raise SettingsError("--scheduler-tls-client-ca-file: the gateway needs --scheduler-tls-client-cert-file and "
                            "--scheduler-tls-client-key-file for a scheduler requiring client certificates")
    await start_scheduler(mesh, sched_cfg, engine_cfg)
    if not mesh.stopping.is_set():              # a signal while the scheduler loaded: stop here
        await start_gateway(mesh, gw_cfg.replace(scheduler_address=mesh.scheduler_address))


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


async def run_services(start: Callable[[Mesh], Awaitable[None]], *, grace: float,
                       work: Callable[[Mesh], Awaitable[int]] | None = None) -> int:
    """Start services with ``start(mesh)``, then either serve until SIGINT/SIGTERM (returns 0)
    or, with ``work``, run ``work(mesh)`` and return its result (130 when a signal cancels it).
    The services stop in every case, including a failed start (the exception propagates).
    A signal during start-up lets the current step finish, then shuts down."""
    loop = asyncio.get_running_loop()
    mesh = Mesh()
    stopping = mesh.stopping
    caught: list[int] = []

    def on_signal(sig: int) -> None:
        if caught:
            announce(f"{signal.Signals(sig).name} again: exiting now")
            os._exit(130 if sig == signal.SIGINT else 143)
        caught.append(sig)
        stopping.set()

    def reload_keys() -> None:
        keys = getattr(mesh.gateway, "api_keys", None)
        if keys is not None:
            announce("SIGHUP: reloading the API keys" if keys.reload() else
                     "SIGHUP: the API keys file did not load; the previous keys stay in use")

    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, reload_keys)
    rc = 0
    ray_was_up = _ray_initialized()
    try:
        await start(mesh)
        if work is None:
            await stopping.wait()
        elif not stopping.is_set():
            task = asyncio.ensure_future(work(mesh))
            waiter = asyncio.ensure_future(stopping.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if task.done():
                rc = task.result()
            else:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if caught:
            announce(f"{signal.Signals(caught[0]).name}: shutting down")
            if work is not None:
                rc = 130
    finally:
        await mesh.stop(grace)
        if not ray_was_up and _ray_initialized():     # a local Ray our executors started (or joined)
            import ray
            await asyncio.to_thread(ray.shutdown)
            announce("ray stopped")
        for sig in signals + (signal.SIGHUP,):
            loop.remove_signal_handler(sig)
    return rc
