"""Settings: one typed object per service, from flags and ``KVMESH_*`` environment variables.

Precedence: explicit argument > ``KVMESH_<FIELD>`` environment variable > default. A class may
name another variable for a field in ``ENV_OVERRIDES`` (:func:`env_var`): SchedulerConfig's
``redis_url`` reads ``KVMESH_REDIS_URL``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Self

from kvmesh.core.errors import SettingsError

if TYPE_CHECKING:
    import torch

# dtype names accepted in settings -> torch dtype attribute (torch is imported only where a
# torch dtype is asked for, so the gateway's process, which reads these settings, loads no torch)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


WEIGHT_FORMATS = ("none", "int8", "int4", "fp8", "w8a8-int8")
SPECULATIVE_METHODS = ("", "ngram", "draft")
ATTENTION_BACKENDS = ("auto", "native", "torch")


def cpu_has_native_bf16() -> bool:
    """True when the CPU advertises AVX512-BF16 or AMX-BF16 (Linux /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


EXECUTORS = ("auto", "local", "ray")
ROUTING_POLICIES = ("prefix", "load", "round_robin", "random")   # scheduler.router implements them
POLICIES = ("continuous", "static", "naive")   # batching policies; scheduler.scheduler implements them
STAGE_PLACEMENTS = ("pack", "spread", "strict-spread")


def available_cpus() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _parse_bytes(v: str | float | int) -> float:
    """``"2GiB"``, ``"512MB"``, ``"0.2"`` (fraction), ``1e9`` → float."""
    if isinstance(v, (int, float)):
        return float(v)
    s = v.strip().lower().replace(" ", "")
    for suffix, mult in (("gib", 2**30), ("mib", 2**20), ("kib", 2**10), ("gb", 1e9), ("mb", 1e6), ("kb", 1e3), ("g", 2**30), ("m", 2**20), ("b", 1)):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


def setting(default, help: str, *, metavar: str | None = None, choices: tuple | None = None, kind: str = "",
            flag: str = ""):
    """A settings field whose default is stated here, once, with what its command-line flag
    needs (:mod:`kvmesh.core.flags` builds the flags from these): ``help`` (one line, without
    the default, which the flag's help adds), ``metavar``, ``choices``, ``kind`` (``"bytes"``:
    ``2GiB``-style sizes, ``"port"``, ``"optional_port"``: a port or -1/``off``) and ``flag``
    (another flag name than ``--<field>``; for a bool field, one that sets the opposite of
    the default)."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar, "choices": choices,
                                                        "kind": kind, "flag": flag})


class Settings:
    """What the settings classes share: ``ENV_PREFIX`` (of their environment variables),
    :meth:`from_env` and :meth:`replace`."""

    ENV_PREFIX = "KVMESH_"

    @classmethod
    def from_env(cls, **overrides) -> Self:
        """Defaults, then the ``<ENV_PREFIX><FIELD>`` variables (:func:`env_var`), then
        ``overrides`` (None values ignored). Raises SettingsError naming a bad field."""
        kw = {}
        for f in fields(cls):
            env = os.environ.get(env_var(cls, f.name))
            if env is not None:
                kw[f.name] = env
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def replace(self, **kw) -> Self:
        """A copy with ``kw`` changed, checked again."""
        return dataclasses.replace(self, **kw)


def env_var(cls, field: str, prefix: str | None = None) -> str:
    """The environment variable of a settings field: ``<ENV_PREFIX><FIELD>``, unless the class
    names another one in ``ENV_OVERRIDES`` (e.g. ``KVMESH_REDIS_URL``)."""
    return getattr(cls, "ENV_OVERRIDES", {}).get(field) or f"{prefix or cls.ENV_PREFIX}{field.upper()}"


def _coerce_strings(obj) -> None:
    """Environment variables arrive as strings: convert int/float/bool fields.
    Raises SettingsError naming the field when a value does not parse."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, str) and f.type in ("int", "bool", "float"):
            try:
                if f.type == "bool":
                    v = v.strip().lower() in ("1", "true", "yes", "on")
                elif f.name in ("kv_cache_memory", "kv_offload_host_memory"):
                    v = _parse_bytes(v)
                else:
                    v = int(v) if f.type == "int" else float(v)
            except ValueError:
                raise SettingsError(f"{f.name}: expected {f.type}, got {v!r}") from None
            setattr(obj, f.name, v)


def _check_tls(obj) -> None:
    """A listener's TLS settings: certificate and key together; a client CA only with them.
    Checked when the service starts (``check_tls``), not on construction: the settings of one
    service may come from several sources, each naming one file."""
    if bool(obj.tls_cert_file) != bool(obj.tls_key_file):
        raise SettingsError("tls_cert_file and tls_key_file go together (the certificate chain and its private key)")
    if getattr(obj, "tls_client_ca_file", "") and not obj.tls_cert_file:
        raise SettingsError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")


# The metrics ports deployments use (deploy/: compose, Kubernetes, prometheus.yml); the services'
# own default is off (metrics_port -1), so that several meshes on one host do not collide.
SCHEDULER_METRICS_PORT = 9461
GATEWAY_METRICS_PORT = 9451


def _metrics_port_off(obj, name: str = "metrics_port") -> None:
    """``KVMESH_*_METRICS_PORT=`` (empty), ``off`` or ``none`` mean -1 (no metrics server); the
    same for another optional port field ``name``."""
    v = getattr(obj, name)
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "off", "none")):
        setattr(obj, name, -1)


def _check_metrics_port(obj, name: str = "metrics_port") -> None:
    if not -1 <= getattr(obj, name) <= 65535:
        raise SettingsError(f"{name} must be a port in [0, 65535], 0 = any free port, -1 = off; "
                            f"got {getattr(obj, name)}")


@dataclass
class EngineConfig(Settings):
    """Settings of one engine replica.

    Attributes:
        model: known model name (see ``kvmesh models list``) or checkpoint directory.
        dtype: weight/activation dtype: ``float32`` or ``bfloat16`` (``auto``: see
            :attr:`torch_dtype`).
        kv_cache_dtype: ``auto`` (= dtype), ``float32``, ``bfloat16``, or a quantized KV cache:
            ``int8`` or ``fp8`` (e4m3) with a scale per block and KV head.
        weight_format: ``none`` (dense ``dtype``), or weights quantized at load time: ``int8``
            (weight-only, per output channel), ``int4`` (weight-only, group-wise asymmetric),
            ``fp8`` (e4m3, per output channel), ``w8a8-int8`` (int8 weights and activations,
            SmoothQuant).
        quant_group_size: ``int4`` group size along the input dimension (32, 64 or 128).
        enable_calibration: activation-aware calibration for ``int4`` (AWQ scales) and
            ``w8a8-int8`` (SmoothQuant factors); False = round-to-nearest, no smoothing.
        calibration_data: calibration text file; empty = the PolicyDesk policies.
        speculative_method: ``""`` (off), ``ngram`` (prompt lookup) or ``draft`` (a draft model).
        num_speculative_tokens: proposed tokens per step (k; with adaptive speculation, the most).
        speculative_adaptive: per request, lower k when acceptance is low, raise it when high.
        draft_model: the draft checkpoint (known name or directory; same tokenizer as ``model``).
        draft_num_layers: keep only the draft's first N decoder layers (0 = all).
        draft_max_model_len: the draft's context limit in tokens (0 = its max_position_embeddings);
            longer sequences continue without speculation.
        prompt_lookup_max, prompt_lookup_min: ``ngram`` match lengths tried, longest first.
        block_size: tokens per KV block.
        kv_cache_memory: KV budget: bytes if >= 1 (``"2GiB"`` accepted), else a fraction of
            free device memory.
        max_model_len: longest sequence, prompt + output, in tokens (0 = model's limit, at most 8192).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step.
        policy: ``continuous``, ``static`` or ``naive``.
        enable_prefix_caching, enable_chunked_prefill: switches.
        device: ``cpu``, ``cuda``, ``cuda:1`` ...
        num_threads: torch intra-op threads (0 = leave torch's default).
        attention_backend: ``native`` (the C++ paged-attention kernels of :mod:`workers.kernels`,
            reading K/V in place through the block tables; CPU only), ``torch`` (the PyTorch
            reference: gather + SDPA), or ``auto`` (native where it can be built and runs, else
            torch, with a log line saying why).
        enable_compile: run decode-only steps with ``torch.compile``d layers, one graph per batch
            bucket (:mod:`workers.compiled_decode`; needs the native attention backend), compiled
            at start-up (``--compile``). Off by default for now: Dynamo keeps each engine's
            graphs (keyed to that engine's modules) for the life of the process, so a process
            that creates many engines (tests, restarts) accumulates them.
        kv_offload_host_memory: bytes of host memory (``"4GiB"`` accepted) that keep KV blocks
            evicted from the pool, least recently used dropped first (0 = no host tier;
            docs/kvstore.md, "KV tiers").
        kv_offload_redis_url: a Redis shared by replicas that keeps evicted KV blocks
            (``redis://host:port/db``; empty = none).
        kv_offload_redis_ttl: seconds a block lives in the Redis tier (0 = no expiry).
        kv_offload_prefix: key prefix in the Redis tier (one per deployment).
    """

    model: str = setting("smollm2-135m-instruct", "known model name (see `kvmesh models list`) or a Hugging Face "
                         "checkpoint directory", metavar="NAME|DIR")
    dtype: str = setting("auto", "weights/activations: float32, bfloat16 (float16 slow on CPUs); auto = bfloat16 "
                         "on CUDA and on CPUs with AVX512-BF16/AMX, else float32", metavar="DTYPE")
    kv_cache_dtype: str = setting("auto", "KV cache: auto (= dtype), float32, bfloat16, or quantized blocks int8, "
                                  "fp8 (a scale per block and head)", metavar="DTYPE")
    weight_format: str = setting("none", "weights quantized at load time: int8, int4 (group-wise), fp8, w8a8-int8 "
                                 "(SmoothQuant); none = dense dtype", choices=WEIGHT_FORMATS)
    quant_group_size: int = setting(128, "int4 group size along the input dimension", choices=(32, 64, 128))
    enable_calibration: bool = setting(True, "AWQ scales (int4) and SmoothQuant factors (w8a8-int8); "
                                       "--no-calibration: round-to-nearest, no smoothing")
    calibration_data: str = setting("", "calibration text file (empty: the PolicyDesk policies)", metavar="FILE")
    speculative_method: str = setting("", "speculative decoding: ngram (prompt lookup) or draft (a draft model, "
                                      "--draft-model); empty: off", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = setting(4, "proposed tokens per step (the most, when adaptive)", metavar="K")
    speculative_adaptive: bool = setting(True, "always propose K tokens (default: adapt K per request to its "
                                         "acceptance rate)", flag="--fixed-speculative-tokens")
    draft_model: str = setting("", "draft model (same tokenizer as --model)", metavar="NAME|DIR")
    draft_num_layers: int = setting(0, "keep the draft's first N decoder layers (0 = all)")
    draft_max_model_len: int = setting(0, "the draft's context limit; longer sequences continue without "
                                       "speculation (0 = the draft's)")
    prompt_lookup_max: int = setting(4, "longest ngram matched")
    prompt_lookup_min: int = setting(2, "shortest ngram matched")
    block_size: int = setting(16, "tokens per KV block (a power of two)")
    kv_cache_memory: float = setting(2 * 2**30, "KV cache budget: bytes (2GiB, 512MB, 1e9) or a fraction of free "
                                     "memory (0.5)", metavar="BYTES|FRACTION", kind="bytes")
    max_model_len: int = setting(0, "longest prompt + output in tokens (0 = the model's, at most 8192)")
    max_num_seqs: int = setting(64, "most sequences per step")
    max_num_batched_tokens: int = setting(2048, "token budget per step")
    policy: str = setting("continuous", "batching policy", choices=POLICIES)
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps (--no-chunked-prefill: each "
                                           "prompt in one step)")
    max_prefill_tokens_with_decodes: int = setting(0, "with chunked prefill: the most prompt tokens a step that "
                                                   "also decodes may prefill (0 = the whole token budget); smaller "
                                                   "shortens the decode steps that a long prompt shares")
    device: str = setting("cpu", "cpu, cuda, cuda:1 ...", metavar="DEVICE")
    num_threads: int = setting(0, "torch intra-op threads (0 = torch's default)")
    attention_backend: str = setting("auto", "native (C++ paged-attention kernels, CPU), torch (PyTorch "
                                     "reference), auto = native where it builds", choices=ATTENTION_BACKENDS)
    enable_compile: bool = setting(False, "decode steps through torch.compile, one graph per batch bucket, "
                                   "compiled at start-up (native attention backend)")
    kv_offload_host_memory: float = setting(0, "keep KV blocks evicted from the pool in this much host memory "
                                            "(e.g. 4GiB; LRU) and load them back instead of recomputing",
                                            metavar="BYTES", kind="bytes")
    kv_offload_redis_url: str = setting("", "keep evicted KV blocks in this Redis too, shared by replicas "
                                        "(redis://host:port/db)", metavar="URL")
    kv_offload_redis_ttl: float = setting(3600.0, "lifetime of a block in the Redis tier in seconds (0 = none)",
                                          metavar="S")
    kv_offload_prefix: str = setting("kvmesh", "key prefix in the Redis tier", metavar="PREFIX")

    def __post_init__(self) -> None:
        _coerce_strings(self)
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = _parse_bytes(self.kv_cache_memory)
        if isinstance(self.kv_offload_host_memory, str):
            self.kv_offload_host_memory = _parse_bytes(self.kv_offload_host_memory)
        if self.kv_offload_host_memory < 0:
            raise SettingsError(f"kv_offload_host_memory must be >= 0 bytes, got {self.kv_offload_host_memory}")
        if self.kv_offload_redis_url and not self.kv_offload_redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(f"kv_offload_redis_url must be redis://host:port/db (or rediss://, unix://), "
                                f"got {self.kv_offload_redis_url!r}")
        if self.kv_offload_redis_ttl < 0:
            raise SettingsError(f"kv_offload_redis_ttl must be >= 0 seconds, got {self.kv_offload_redis_ttl}")
        if self.kv_offload and self.speculative_method == "draft":
            raise SettingsError("KV offload (kv_offload_host_memory, kv_offload_redis_url) does not keep a draft "
                                "model's KV: use it without speculative_method 'draft'")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise SettingsError(f"unknown dtype {self.dtype!r}; choose auto or one of {sorted(DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise SettingsError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise SettingsError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.policy == "naive":
            self.enable_prefix_caching = False
        if self.weight_format not in WEIGHT_FORMATS:
            raise SettingsError(f"unknown weight_format {self.weight_format!r}; choose one of {WEIGHT_FORMATS}")
        if self.quant_group_size not in (32, 64, 128):
            raise SettingsError(f"quant_group_size must be 32, 64 or 128, got {self.quant_group_size}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise SettingsError(f"unknown speculative_method {self.speculative_method!r}; "
                                f"choose one of {SPECULATIVE_METHODS} ('' = off)")
        if self.speculative_method and self.policy != "continuous":
            raise SettingsError(f"speculative_method {self.speculative_method!r} needs policy 'continuous' "
                                f"(got {self.policy!r})")
        if self.speculative_method and not 1 <= self.num_speculative_tokens <= 16:
            raise SettingsError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise SettingsError("speculative_method 'draft' needs draft_model (--draft-model)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise SettingsError(f"unknown attention_backend {self.attention_backend!r}; choose one of {ATTENTION_BACKENDS}")
        if self.draft_num_layers < 0 or self.draft_max_model_len < 0:
            raise SettingsError("draft_num_layers and draft_max_model_len must be >= 0")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SettingsError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def kv_offload(self) -> bool:
        """A KV tier below the pool is configured (host memory or Redis)."""
        return self.kv_offload_host_memory > 0 or bool(self.kv_offload_redis_url)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``auto``: bfloat16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16 or AMX),
        where it measured faster than float32 for prefill and batched decode
        (docs/engine_offline.md); float32 on other CPUs."""
        import torch

        if self.dtype == "auto":
            if self.device.startswith("cuda") or cpu_has_native_bf16():
                return torch.bfloat16
            return torch.float32
        return getattr(torch, DTYPES[self.dtype])


@dataclass
class SchedulerConfig(Settings):
    """Settings of the scheduler service (``kvmesh scheduler``). Environment: ``KVMESH_SCHEDULER_<FIELD>``.
    The engine settings of its replicas are an :class:`EngineConfig` (``KVMESH_<FIELD>``).

    Attributes:
        host, port: where the gRPC service listens (port 0 = any free port).
        replicas: model replicas, each one engine loop with its own KV cache.
        pp: pipeline-parallel stages per replica (Ray actors).
        pp_layers: decoder layers per stage, comma-separated (``"20,10"``); empty = even split.
        executor: ``ray`` (stages are Ray actors), ``local`` (the model in the engine's own
            process; pp must be 1) or ``auto`` (:meth:`resolved_executor`: local at pp 1 without
            ``ray_address``, else ray).
        engine_process: run each replica's engine loop (scheduler, block manager, executor) in a
            process of its own (:mod:`scheduler.engine_core`), as vLLM's engine core; False = a
            thread of the scheduler service's process.
        ray_address: an existing Ray cluster (``auto``, ``ray://host:10001``); empty = start a local one.
        stage_num_cpus: CPUs each stage actor reserves in Ray; 0 = :meth:`cpus_per_stage` (this
            machine's cores shared by every stage of every replica, at least 1).
        stage_placement: how a replica's stages spread over Ray nodes (a placement group of one
            bundle per stage): ``pack`` (as few nodes as fit), ``spread`` (different nodes where
            possible) or ``strict-spread`` (each stage on its own node, else start-up fails).
        max_queued_requests: waiting requests per replica before RESOURCE_EXHAUSTED.
        restart_replicas: restart a replica whose engine process died or hung (with backoff
            from 0.5 s, doubling, at most 30 s between tries); False = it stays down.
        restart_wait: how long a new request waits for a restarting replica when none is up
            (seconds, within its deadline) before UNAVAILABLE.
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
    executor: str = setting("auto", "local: the model in the engine's process, pp 1; ray: stages are Ray actors; "
                            "auto: local at pp 1 without --ray-address, else ray", choices=EXECUTORS)
    engine_process: bool = setting(True, "each replica's engine loop in a process of its own "
                                   "(--no-engine-process: a thread of the scheduler's process)")
    ray_address: str = setting("", "existing Ray cluster (auto, ray://host:10001); empty: start a local one",
                               metavar="ADDR")
    stage_num_cpus: float = setting(0.0, "CPUs each Ray stage actor reserves and its torch threads (0 = this "
                                    "machine's cores over replicas x pp, at least 1)")
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
        _metrics_port_off(self)
        _coerce_strings(self)
        _check_metrics_port(self)
        if self.replicas < 1:
            raise SettingsError(f"replicas must be >= 1, got {self.replicas}")
        if self.pp < 1:
            raise SettingsError(f"pp must be >= 1, got {self.pp}")
        if self.executor not in EXECUTORS:
            raise SettingsError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.executor == "local" and self.pp != 1:
            raise SettingsError("the local executor runs the whole model in one process: use --pp 1 or --executor ray")
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
        _check_metrics_port(self, "health_port")
        self.layer_split()

    def check_tls(self) -> None:
        """Raise SettingsError naming the settings when the TLS files do not go together
        (certificate and key; a client CA only with them). :func:`scheduler.service.serve_scheduler`
        calls it."""
        _check_tls(self)

    def resolved_executor(self) -> str:
        """``executor``, with ``auto`` resolved: ``local`` (no Ray hop) for one stage on this
        machine, ``ray`` for pipeline parallelism or a Ray cluster (``ray_address``)."""
        if self.executor != "auto":
            return self.executor
        return "local" if self.pp == 1 and not self.ray_address else "ray"

    def cpus_per_stage(self) -> float:
        """CPUs each Ray stage actor reserves: ``stage_num_cpus``, or when it is 0 this
        process's usable cores (:func:`available_cpus`) over ``replicas x pp`` stages (at
        least 1). On a cluster (``ray_address``) 0 means 1: the head's cores say nothing
        about the workers'."""
        if self.stage_num_cpus:
            return self.stage_num_cpus
        if self.ray_address:
            return 1.0
        return float(max(1, available_cpus() // (self.replicas * self.pp)))

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

    Security (README, "Security: API keys and TLS"):
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
        _metrics_port_off(self)
        _metrics_port_off(self, "http_port")
        _coerce_strings(self)
        _check_metrics_port(self)
        _check_metrics_port(self, "http_port")
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
        _check_metrics_port(self, "health_port")

    def check_tls(self) -> None:
        """Raise SettingsError naming the settings when the TLS files do not go together: the
        listener's certificate and key; the client certificate and key to the scheduler, and
        those and ``scheduler_tls_server_name`` only with ``scheduler_tls_ca_file``.
        :func:`gateway.server.serve_gateway` calls it."""
        _check_tls(self)
        if bool(self.scheduler_tls_client_cert_file) != bool(self.scheduler_tls_client_key_file):
            raise SettingsError("scheduler_tls_client_cert_file and scheduler_tls_client_key_file go together")
        if (self.scheduler_tls_client_cert_file or self.scheduler_tls_server_name) and not self.scheduler_tls_ca_file:
            raise SettingsError("scheduler_tls_client_cert_file and scheduler_tls_server_name need "
                                "scheduler_tls_ca_file (TLS to the scheduler)")
