"""The services' settings: SchedulerConfig (the scheduler service: replicas, executor, routing,
ports, TLS) and GatewayConfig (the gRPC/HTTP gateway), and the choices their fields accept.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.errors import SettingsError
from kvmesh.core.settings import (
    Settings,
    available_cpus,
    check_metrics_port,
    check_tls_files,
    coerce_strings,
    metrics_port_off,
    setting,
)

EXECUTORS = ("auto", "local", "ray")
ROUTING_POLICIES = ("prefix", "load", "round_robin", "random")   # scheduler.router implements them
STAGE_PLACEMENTS = ("pack", "spread", "strict-spread")


@dataclass
class SchedulerConfig(Settings):
    """Settings of the scheduler service (``kvmesh scheduler``). Environment: ``KVMESH_SCHEDULER_<FIELD>``.
    The engine settings of its replicas are an :class:`EngineConfig` (``KVMESH_<FIELD>``).

    Attributes:
        host, port: where the gRPC service listens (port 0 = any free port).
        replicas: model replicas, each one engine loop with its own KV cache.
        pp: pipeline-parallel stages per replica (Ray actors).
        pp_layers: decoder layers per stage, comma-separated (``"20,10"``); empty = even split.
        tensor_parallel_size: tensor-parallel ranks per stage (``-tp``; :mod:`workers.tensor_parallel`):
            a replica is ``pp x tensor_parallel_size`` Ray actors.
        executor: ``ray`` (stages are Ray actors), ``local`` (the model in the engine's own
            process; pp and tensor_parallel_size must be 1) or ``auto`` (:meth:`resolved_executor`:
            local at pp 1 and tensor_parallel_size 1 without ``ray_address``, else ray).
        engine_process: run each replica's engine loop (scheduler, block manager, executor) in a
            process of its own (:mod:`scheduler.engine_core`), as vLLM's engine core; False = a
            thread of the scheduler service's process.
        ray_address: an existing Ray cluster (``auto``, ``ray://host:10001``); empty = start a local one.
        stage_num_cpus: CPUs each stage actor reserves in Ray; 0 = :meth:`cpus_per_stage` (this
            machine's cores shared by every stage of every replica, at least 1).
        stage_placement: how a replica's stages spread over Ray nodes (a placement group of one
            bundle per stage and tensor-parallel rank): ``pack`` (as few nodes as fit), ``spread`` (different nodes where
            possible) or ``strict-spread`` (each stage on its own node, else start-up fails).
        max_queued_requests: waiting requests per replica before RESOURCE_EXHAUSTED.
        restart_replicas: restart a replica whose engine process died or hung (with backoff
            from 0.5 s, doubling, at most 30 s between tries); False = it stays down.
        restart_wait: how long a new request (or one whose replica died before its first
            token: docs/mesh.md, the death window) waits for a restarting replica when none is
            up (seconds, within its deadline) before UNAVAILABLE.
        step_timeout: watchdog: an engine process that has requests and sends no step for this
            long is taken as hung, killed and restarted (seconds; 0 = no watchdog).
        routing: replica selection (:mod:`scheduler.router`): ``prefix`` (cached prefix
            blocks weighed against load), ``load`` (least loaded), ``round_robin``, ``random``.
        redis_url: the shared prefix index (``redis://host:6379/0``); empty = an in-process
            index (this scheduler's replicas only). Environment: ``KVMESH_REDIS_URL`` (not
            ``KVMESH_SCHEDULER_REDIS_URL``).
        index_prefix: Redis key prefix of the index (schedulers sharing one index use the same).
        index_timeout: longest wait for one Redis call (seconds); slower or down = route by load.
        prefix_weight: score of a prompt fully cached on a replica (score =
            prefix_weight x cached blocks / prompt blocks - load_weight x load / KV pool tokens).
        load_weight: score cost of a replica whose waiting + running tokens fill its KV pool.
        provisional_ttl: how long the router assumes a replica holds a prompt it was just sent,
            before the replica's own KV events say so (seconds).
        scheduler_id: this scheduler's name in the index; its replicas are ``<scheduler_id>/<i>``.
            Empty = ``<hostname>-<random>``, new at every start.
        metrics_port: Prometheus ``/metrics`` over HTTP on ``host:metrics_port`` (docs/telemetry.md);
            -1 (or empty, ``off``) = off, 0 = any free port. Deployments use
            :data:`SCHEDULER_METRICS_PORT`.
        tls_cert_file, tls_key_file: PEM certificate chain and private key: the service listens
            with TLS only (:mod:`kvmesh.core.tls`); empty = plaintext.
        tls_client_ca_file: PEM CA certificate(s): every client (the gateways) must present a
            certificate it signed (mutual TLS); needs ``tls_cert_file``.
        health_port: a plaintext gRPC port serving only ``grpc.health.v1`` (probes that cannot
            speak TLS); -1 (or empty, ``off``) = none, 0 = any free port.
    """

    host: str = setting("127.0.0.1", "listen address (0.0.0.0 = every interface)", metavar="ADDR")
    port: int = setting(50061, "listen port (0 = any free port)", kind="port")
    replicas: int = setting(1, "model replicas, each with its own KV cache")
    pp: int = setting(1, "pipeline-parallel stages per replica")
    pp_layers: str = setting("", "decoder layers per stage (empty: an even split)", metavar="N,N,...")
    tensor_parallel_size: int = setting(1, "tensor-parallel ranks per stage (Ray actors; each holds 1/N of every "
                                        "layer's heads and MLP and sums with the others twice per layer)",
                                        short="-tp")
    executor: str = setting("auto", "local: the model in the engine's process, pp 1; ray: stages are Ray actors; "
                            "auto: local at pp 1 and tp 1 without --ray-address, else ray", choices=EXECUTORS)
    engine_process: bool = setting(True, "each replica's engine loop in a process of its own "
                                   "(--no-engine-process: a thread of the scheduler's process)")
    ray_address: str = setting("", "existing Ray cluster (auto, ray://host:10001); empty: start a local one",
                               metavar="ADDR")
    stage_num_cpus: float = setting(0.0, "CPUs each Ray stage actor reserves and its torch threads (0 = this "
                                    "machine's cores over replicas x pp x tp, at least 1)")
    stage_placement: str = setting("pack", "a replica's stages over Ray nodes: pack (as few nodes as fit), "
                                   "spread, strict-spread (one node each)", choices=STAGE_PLACEMENTS)
    max_queued_requests: int = setting(1024, "waiting requests per replica before RESOURCE_EXHAUSTED")
    restart_replicas: bool = setting(True, "restart a replica whose engine process died or hung, with backoff")
    restart_wait: float = setting(30.0, "seconds a request waits for a restarting replica when none is up, within "
                                  "its deadline", metavar="S")
    step_timeout: float = setting(120.0, "watchdog: an engine with requests and no step for S seconds is killed "
                                  "and restarted (0 = off)", metavar="S")
    routing: str = setting("prefix", "replica selection: prefix (cached prefix vs load), load (least loaded), "
                           "round_robin, random", choices=ROUTING_POLICIES)
    redis_url: str = setting("", "Redis prefix index shared by schedulers (redis://host:6379/0; env "
                             "KVMESH_REDIS_URL); empty: an in-process index", metavar="URL")
    index_prefix: str = setting("kvmesh", "Redis key prefix of the index", metavar="PREFIX")
    index_timeout: float = setting(0.005, "longest Redis call in seconds before routing by load", metavar="S")
    prefix_weight: float = setting(1.0, "score of a fully cached prompt", metavar="W")
    load_weight: float = setting(1.0, "score cost of a replica whose load fills its KV pool", metavar="W")
    provisional_ttl: float = setting(2.0, "seconds a routed prompt counts as cached on its replica before its KV "
                                     "events arrive", metavar="S")
    scheduler_id: str = setting("", "name in the index; replicas are ID/0, ID/1 ... (empty: hostname-random)",
                                metavar="ID")
    metrics_port: int = setting(-1, "Prometheus /metrics over HTTP on the listen address (0 = any free port; "
                                "deployments use 9461)", kind="optional_port")
    tls_cert_file: str = setting("", "certificate chain: listen with TLS only (with --tls-key-file)", metavar="PEM")
    tls_key_file: str = setting("", "private key of the TLS certificate", metavar="PEM")
    tls_client_ca_file: str = setting("", "require client certificates signed by this CA (mutual TLS with the "
                                      "gateways)", metavar="PEM")
    health_port: int = setting(-1, "plaintext gRPC health-only port for probes that cannot speak TLS (0 = any "
                               "free port)", kind="optional_port")

    ENV_PREFIX = "KVMESH_SCHEDULER_"
    ENV_OVERRIDES = {"redis_url": "KVMESH_REDIS_URL"}   # the name; shared with other services

    def __post_init__(self) -> None:
        metrics_port_off(self)
        coerce_strings(self)
        check_metrics_port(self)
        if self.replicas < 1:
            raise SettingsError(f"replicas must be >= 1, got {self.replicas}")
        if self.pp < 1:
            raise SettingsError(f"pp must be >= 1, got {self.pp}")
        if self.tensor_parallel_size < 1:
            raise SettingsError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.executor not in EXECUTORS:
            raise SettingsError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.executor == "local" and (self.pp != 1 or self.tensor_parallel_size != 1):
            raise SettingsError("the local executor runs the whole model in one process: use --pp 1 and "
                                "--tensor-parallel-size 1, or --executor ray")
        if self.stage_num_cpus < 0:
            raise SettingsError(f"stage_num_cpus must be >= 0, got {self.stage_num_cpus}")
        if self.stage_placement not in STAGE_PLACEMENTS:
            raise SettingsError(f"stage_placement must be one of {', '.join(STAGE_PLACEMENTS)}, got {self.stage_placement!r}")
        if self.restart_wait < 0 or self.step_timeout < 0:
            raise SettingsError("restart_wait and step_timeout must be >= 0 (seconds)")
        if self.max_queued_requests < 1:
            raise SettingsError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.routing not in ROUTING_POLICIES:
            raise SettingsError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(f"redis_url must be redis://host:port/db (or rediss://, unix://), got {self.redis_url!r}")
        if self.index_timeout <= 0 or self.provisional_ttl < 0:
            raise SettingsError("index_timeout must be > 0 and provisional_ttl >= 0 (seconds)")
        if self.prefix_weight < 0 or self.load_weight < 0:
            raise SettingsError("prefix_weight and load_weight must be >= 0")
        if "/" in self.scheduler_id:
            raise SettingsError(f"scheduler_id must not contain '/', got {self.scheduler_id!r}")
        check_metrics_port(self, "health_port")
        self.layer_split()

    def check_tls(self) -> None:
        """Raise SettingsError naming the settings when the TLS files do not go together
        (certificate and key; a client CA only with them). :func:`scheduler.service.serve_scheduler`
        calls it."""
        check_tls_files(self)

    def resolved_executor(self) -> str:
        """``executor``, with ``auto`` resolved: ``local`` (no Ray hop) for one stage on this
        machine, ``ray`` for pipeline or tensor parallelism or a Ray cluster (``ray_address``)."""
        if self.executor != "auto":
            return self.executor
        return "local" if self.pp == 1 and self.tensor_parallel_size == 1 and not self.ray_address else "ray"

    def cpus_per_stage(self) -> float:
        """CPUs each Ray stage actor reserves: ``stage_num_cpus``, or when it is 0 this
        process's usable cores (:func:`available_cpus`) over ``replicas x pp x tensor_parallel_size``
        shards (at
        least 1). On a cluster (``ray_address``) 0 means 1: the head's cores say nothing
        about the workers'."""
        if self.stage_num_cpus:
            return self.stage_num_cpus
        if self.ray_address:
            return 1.0
        return float(max(1, available_cpus() // (self.replicas * self.pp * self.tensor_parallel_size)))

    def layer_split(self) -> list[int] | None:
        """``pp_layers`` as a list of ``pp`` positive ints, or None for an even split."""
        if not self.pp_layers:
            return None
        try:
            split = [int(x) for x in self.pp_layers.split(",")]
        except ValueError:
            raise SettingsError(f"pp_layers must be comma-separated integers, got {self.pp_layers!r}") from None
        if len(split) != self.pp or min(split) < 1:
            raise SettingsError(f"pp_layers needs {self.pp} positive layer counts, got {self.pp_layers!r}")
        return split


@dataclass
class GatewayConfig(Settings):
    """Settings of the public gateway (``kvmesh gateway``). Environment: ``KVMESH_GATEWAY_<FIELD>``.

    Attributes:
        host, port: where the public gRPC service listens (port 0 = any free port).
        scheduler_address: ``host:port`` of the scheduler service.
        max_tokens_cap: server-wide cap on ``max_tokens`` (tokens); larger requests are clamped.
        default_max_tokens: ``max_tokens`` when a request leaves it unset (tokens).
        default_timeout: deadline of a request that sets none (seconds).
        max_timeout: longest deadline a request may ask for (seconds).
        connect_timeout: how long to wait for the scheduler at start-up (seconds).
        metrics_port: Prometheus ``/metrics`` over HTTP on ``host:metrics_port`` (docs/telemetry.md);
            -1 (or empty, ``off``) = off, 0 = any free port. Deployments use
            :data:`GATEWAY_METRICS_PORT`.
        http_port: the OpenAI-compatible HTTP API (``/v1/chat/completions``, ``/v1/completions``,
            ``/v1/models``, ``/health``; :mod:`gateway.http_api`) on ``host:http_port``; -1 (or
            empty, ``off``) = off, 0 = any free port.

    Request limits (a request over one ends INVALID_ARGUMENT naming the limit):
        max_stop_strings: stop strings per request (OpenAI allows 4).
        max_stop_chars: characters of all of a request's stop strings together.
        max_stop_token_ids: stop token ids per request.
        max_id_length: characters of ``request_id`` and of ``session_id``.
        max_prompt_tokens: prompt tokens (after tokenization or the chat template); 0 = what
            the model's context allows (``max_model_len`` - 1).
        max_message_bytes: size of a serialized request (bytes); gRPC itself refuses one over
            twice this before it is read (RESOURCE_EXHAUSTED).
        max_header_bytes: the HTTP API's request line and headers together (bytes); over it the
            answer is 431 and the connection is closed (gRPC metadata has grpc's own bound).

    Security (docs/mesh.md, "Security: API keys, tenants, TLS"):
        api_keys_file: ``TENANT:KEY`` lines (:mod:`gateway.auth`; also ``KVMESH_API_KEYS``); empty
            and no ``KVMESH_API_KEYS`` = no keys needed.
        tls_cert_file, tls_key_file: PEM certificate chain and key of the public listener (TLS
            only); empty = plaintext.
        scheduler_tls_ca_file: PEM CA the scheduler's certificate is checked against: the
            gateway dials the scheduler with TLS; empty = plaintext.
        scheduler_tls_client_cert_file, scheduler_tls_client_key_file: the gateway's own
            certificate and key for a scheduler that requires client certificates (mutual TLS).
        scheduler_tls_server_name: the name the scheduler's certificate must hold when it is not
            the host of ``scheduler_address``.
        health_port: a plaintext gRPC port serving only ``grpc.health.v1`` (probes that cannot
            speak TLS); -1 (or empty, ``off``) = none, 0 = any free port.
    """

    host: str = setting("127.0.0.1", "listen address (0.0.0.0 = every interface)", metavar="ADDR")
    port: int = setting(50051, "listen port (0 = any free port)", kind="port")
    scheduler_address: str = setting("127.0.0.1:50061", "the scheduler service", metavar="HOST:PORT")
    max_tokens_cap: int = setting(4096, "larger max_tokens are clamped to N")
    default_max_tokens: int = setting(256, "max_tokens of a request that sets none")
    default_timeout: float = setting(300.0, "deadline in seconds of a request that sets none", metavar="S")
    max_timeout: float = setting(3600.0, "longest deadline in seconds a request may ask", metavar="S")
    connect_timeout: float = setting(120.0, "seconds to wait for the scheduler at start-up", metavar="S")
    metrics_port: int = setting(-1, "Prometheus /metrics over HTTP on the listen address (0 = any free port; "
                                "deployments use 9451)", kind="optional_port")
    http_port: int = setting(-1, "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
                             "/health) on the listen address (0 = any free port)", kind="optional_port")
    max_stop_strings: int = setting(64, "stop strings per request")
    max_stop_chars: int = setting(4096, "characters of a request's stop strings together")
    max_stop_token_ids: int = setting(1024, "stop token ids per request")
    max_id_length: int = setting(256, "characters of a request_id or session_id")
    max_prompt_tokens: int = setting(0, "prompt tokens per request (0 = max_model_len - 1)")
    max_message_bytes: int = setting(4 * 2**20, "size of a serialized request in bytes", metavar="B")
    max_header_bytes: int = setting(32 * 1024, "HTTP API: request line and headers in bytes (over it: 431)",
                                    metavar="B")
    api_keys_file: str = setting("", "TENANT:KEY per line: every request needs 'authorization: Bearer KEY' (also "
                                 "KVMESH_API_KEYS; re-read when the file changes and on SIGHUP)", metavar="FILE")
    tls_cert_file: str = setting("", "certificate chain: the gateway listens with TLS only (with --tls-key-file)",
                                 metavar="PEM")
    tls_key_file: str = setting("", "private key of the gateway's certificate", metavar="PEM")
    scheduler_tls_ca_file: str = setting("", "dial the scheduler with TLS, checking its certificate against this "
                                         "CA", metavar="PEM")
    scheduler_tls_client_cert_file: str = setting("", "the gateway's certificate for a scheduler requiring client "
                                                  "certificates (mTLS)", metavar="PEM")
    scheduler_tls_client_key_file: str = setting("", "private key of --scheduler-tls-client-cert-file",
                                                 metavar="PEM")
    scheduler_tls_server_name: str = setting("", "the name the scheduler's certificate holds, when not the "
                                             "dialled host", metavar="NAME")
    health_port: int = setting(-1, "plaintext gRPC health-only port for probes that cannot speak TLS (0 = any "
                               "free port)", kind="optional_port")

    ENV_PREFIX = "KVMESH_GATEWAY_"

    def __post_init__(self) -> None:
        metrics_port_off(self)
        metrics_port_off(self, "http_port")
        coerce_strings(self)
        check_metrics_port(self)
        check_metrics_port(self, "http_port")
        if self.max_tokens_cap < 1 or not 1 <= self.default_max_tokens:
            raise SettingsError("max_tokens_cap and default_max_tokens must be >= 1")
        if not 0 < self.default_timeout <= self.max_timeout:
            raise SettingsError(f"default_timeout must be in (0, max_timeout={self.max_timeout}], "
                                f"got {self.default_timeout}")
        for name in ("max_stop_strings", "max_stop_chars", "max_stop_token_ids", "max_prompt_tokens"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_id_length < 1 or not 1024 <= self.max_message_bytes <= 2**30:
            raise SettingsError(f"max_id_length must be >= 1 and max_message_bytes in [1024, 2**30], got "
                                f"{self.max_id_length} and {self.max_message_bytes}")
        if not 1024 <= self.max_header_bytes <= 2**24:
            raise SettingsError(f"max_header_bytes must be in [1024, 2**24], got {self.max_header_bytes}")
        check_metrics_port(self, "health_port")

    def check_tls(self) -> None:
        """Raise SettingsError naming the settings when the TLS files do not go together: the
        listener's certificate and key; the client certificate and key to the scheduler, and
        those and ``scheduler_tls_server_name`` only with ``scheduler_tls_ca_file``.
        :func:`gateway.server.serve_gateway` calls it."""
        check_tls_files(self)
        if bool(self.scheduler_tls_client_cert_file) != bool(self.scheduler_tls_client_key_file):
            raise SettingsError("scheduler_tls_client_cert_file and scheduler_tls_client_key_file go together")
        if (self.scheduler_tls_client_cert_file or self.scheduler_tls_server_name) and not self.scheduler_tls_ca_file:
            raise SettingsError("scheduler_tls_client_cert_file and scheduler_tls_server_name need "
                                "scheduler_tls_ca_file (TLS to the scheduler)")
