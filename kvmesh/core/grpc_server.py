"""The gRPC server scaffold of kvmesh's services (the gateway, :mod:`gateway.server`; the scheduler,
:mod:`scheduler.service`): one ``grpc.aio`` server with

* the service's servicer(s), added by the caller;
* standard health checking (``grpc.health.v1``, :class:`HealthServicer`): "" and the service's
  name, NOT_SERVING until the service says otherwise (readiness: whether to send it requests);
  :data:`LIVENESS`, SERVING from the bind to the graceful stop (liveness: the process answers,
  whatever the state of what it depends on); and server reflection (the service, health,
  reflection);
* a listening address bound plaintext or with TLS (:mod:`kvmesh.core.tls`), never shared with
  another process (``so_reuseport`` off: a port in use is an error, not a second listener);
* optionally a Prometheus ``/metrics`` endpoint (:mod:`kvmesh.core.metrics`) and a plaintext
  health-only port for probes that cannot speak TLS;
* a graceful stop: health NOT_SERVING for every name (open Watch streams get it, then end), no
  new RPCs, in-flight ones given a grace period, then the extra ports, the tracer provider and
  the metrics endpoint closed.

What differs between the services (their servicers, the scheduler channel, replicas, the HTTP API)
stays in their own modules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.core import telemetry
from kvmesh.core.errors import DependencyUnavailableError
from kvmesh.core.metrics import MetricsServer, start_metrics_server

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
# the health name of liveness (Kubernetes' livenessProbe): SERVING while the process answers, also
# while what it depends on is down (the scheduler's replicas restarting, the gateway's scheduler)
LIVENESS = "liveness"
# the scaffold's own services: open to every client (API keys are not asked for them)
SCAFFOLD_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME)


class HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` over a status per service name, as grpc's reference servicer
    (``Check`` of an unknown name is NOT_FOUND, ``Watch`` of one says SERVICE_UNKNOWN), except that
    a ``Watch`` stream ends (status OK) once the server enters its graceful stop, right after it
    has sent NOT_SERVING: a watcher (a gateway following its scheduler) then does not hold the
    server's stop for its whole grace period. Use it from the server's event loop."""

    def __init__(self):
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()          # set and replaced at each change
        self.shutting_down = False

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:64]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        last = None
        while True:
            changed = self._changed              # before reading: a change in between wakes the wait
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self.shutting_down:
                return
            await changed.wait()

    def _set(self, service: str, status: int) -> None:
        self._status[service] = status
        self._changed.set()
        self._changed = asyncio.Event()

    async def set(self, service: str, status: int) -> None:
        """The status of ``service`` (ignored once shutting down)."""
        if not self.shutting_down:
            self._set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every name NOT_SERVING for good; open Watch streams send it and end."""
        self.shutting_down = True
        for service in list(self._status):
            self._set(service, NOT_SERVING)
        self._changed.set()


class GrpcServer:
    """A bound (not yet started) server of the scaffold; :func:`open_server` makes one.

    Attributes:
        server: the ``grpc.aio.Server``.
        health: its ``grpc.health.v1`` servicer (:class:`HealthServicer`, also answering on
            ``health_server``).
        service_name: the full name of the service (``kvmesh.v1.LLMService`` ...).
        host, port, address: where it listens (``port`` the bound one; ``address`` ``host:port``).
        metrics: the ``/metrics`` endpoint (:class:`kvmesh.core.metrics.MetricsServer`), None when off.
        health_server: the plaintext health-only server (its port in ``.health_port``), None when off.
        serving: the status last set with :meth:`set_serving`.
    """

    def __init__(self, server: grpc.aio.Server, health_servicer, service_name: str, host: str, port: int):
        self.server, self.health, self.service_name = server, health_servicer, service_name
        self.host, self.port, self.address = host, port, f"{host}:{port}"
        self.metrics: MetricsServer | None = None
        self.health_server: grpc.aio.Server | None = None
        self.serving = False

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        """Health of "" and of the service (readiness): SERVING or NOT_SERVING. :data:`LIVENESS`
        is not changed."""
        self.serving = serving
        for name in ("", self.service_name):
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    async def enter_graceful_shutdown(self) -> None:
        """Every health status NOT_SERVING, for good (later :meth:`set_serving` calls are ignored)."""
        self.serving = False
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None, *, alongside: Iterable[Awaitable] = ()) -> None:
        """Refuse new RPCs and give in-flight ones ``grace`` seconds (None = wait for them), while
        ``alongside`` (e.g. another listener's own stop) runs concurrently; then stop the
        health-only port. Call :meth:`enter_graceful_shutdown` first so probes see it coming."""
        await asyncio.gather(self.server.stop(grace), *alongside)
        await self._stop_health_port()

    async def close(self, tracing: Iterable[str] = ()) -> None:
        """After :meth:`stop`: flush and shut down the tracer providers of these service names
        (their last spans are exported) and stop the metrics endpoint."""
        for name in tracing:
            await asyncio.to_thread(telemetry.shutdown_tracing, name)
        await self._stop_metrics()

    async def abandon(self) -> None:
        """Undo :func:`open_server` when the service fails to start: stop everything at once."""
        await self.server.stop(None)
        await self._stop_health_port()
        await self._stop_metrics()

    async def _stop_health_port(self) -> None:
        if self.health_server is not None:
            await self.health_server.stop(None)
            self.health_server = None

    async def _stop_metrics(self) -> None:
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
            self.metrics = None


class Service:
    """Base of a running service on the scaffold ``rpc``: where it listens (``host``, ``port``,
    ``address``), its ``metrics`` endpoint and ``health_server`` (None when off)."""

    def __init__(self, rpc: GrpcServer):
        self.rpc = rpc
        self.host, self.port, self.address = rpc.host, rpc.port, rpc.address

    @property
    def metrics(self) -> MetricsServer | None:
        return self.rpc.metrics

    @property
    def health_server(self) -> grpc.aio.Server | None:
        return self.rpc.health_server

    async def wait_for_termination(self) -> None:
        await self.rpc.server.wait_for_termination()


async def open_server(service_name: str, host: str, port: int, add_servicers: Callable[[grpc.aio.Server], None], *,
                      credentials: grpc.ServerCredentials | None = None, options: Iterable[tuple] = (),
                      interceptors: Iterable = (), metrics_registry=None, metrics_port: int = -1,
                      health_port: int = -1) -> GrpcServer:
    """Build the scaffold of a service named ``service_name`` (its servicers added by
    ``add_servicers(server)``) and bind ``host:port`` (0 = any free port; TLS with
    ``credentials``); health NOT_SERVING ("" and the service), :data:`LIVENESS` SERVING. With ``metrics_port`` other than -1, serve
    ``metrics_registry`` at ``http://host:metrics_port/metrics``; with ``health_port`` other than -1
    a plaintext health-only gRPC port. Returns the server, not yet started (:meth:`GrpcServer.start`).

    Raises:
        DependencyUnavailableError: an address cannot be bound (the message names it and asks
            whether the port is in use). Nothing is left running.
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *options], interceptors=list(interceptors) or None)
    add_servicers(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    addr = f"{host}:{port}"
    try:
        bound = server.add_secure_port(addr, credentials) if credentials else server.add_insecure_port(addr)
    except RuntimeError as e:           # grpc raises "Failed to bind to address ..."
        await server.stop(None)
        raise DependencyUnavailableError(f"cannot listen on {addr} ({e}): is the port in use? choose another port "
                                         "(0 = any free port)") from None
    srv = GrpcServer(server, health_servicer, service_name, host, bound)
    await srv.set_serving(False)
    await health_servicer.set(LIVENESS, SERVING)
    try:
        srv.metrics = start_metrics_server(metrics_registry, host, metrics_port) if metrics_registry else None
        srv.health_server = await _serve_health_port(health_servicer, host, health_port)
    except BaseException:
        await srv.abandon()
        raise
    return srv


async def _serve_health_port(health_servicer, host: str, port: int) -> grpc.aio.Server | None:
    """A plaintext gRPC server on ``host:port`` with only ``grpc.health.v1`` (``health_servicer``,
    the TLS service's own, so both answer alike), for probes that cannot speak TLS (Kubernetes'
    ``grpc:`` probes). None when ``port`` is -1 (off). Returns the started server (its bound port
    in ``.health_port``). Raises DependencyUnavailableError if the port cannot be bound."""
    if port < 0:
        return None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        server.health_port = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        await server.stop(None)
        raise DependencyUnavailableError(f"cannot listen on {host}:{port} for health checks ({e}): is the port "
                                         "in use? (0 = any free port, -1 = off)") from None
    await server.start()
    return server
