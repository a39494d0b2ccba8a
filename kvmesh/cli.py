"""The ``kvmesh`` command line.

    kvmesh models list                  known models, pulled or not, and where
    kvmesh models pull NAME...          fetch and convert pinned weights (see workers.registry)
    kvmesh generate --prompt TEXT       stream one completion (``--chat`` applies the chat template);
                                        in this process, or through a gateway with ``--server ADDR``
    kvmesh chat --server ADDR           interactive multi-turn chat through a gateway (stdin lines)
    kvmesh serve                        the mesh in one process: scheduler + gateway (kvmesh/serve.py)
    kvmesh scheduler | gateway          one service alone (compose, Kubernetes)
    kvmesh demo                         the mesh in-process and a two-turn PolicyDesk chat through it,
                                        with TTFT, tokens/s, prefix-cache hits

Settings are one dataclass per service in :mod:`kvmesh.core.config`; every field has a flag
(:data:`ENGINE_FLAGS`, :data:`SCHEDULER_FLAGS`, :data:`GATEWAY_FLAGS`) and an environment variable
(``KVMESH_<FIELD>``, ``KVMESH_SCHEDULER_<FIELD>``, ``KVMESH_GATEWAY_<FIELD>``; a flag wins). Bad
arguments and :class:`EngineError` print ``kvmesh: error: <message>`` on stderr and exit 2; so
does a request the server refuses (INVALID_ARGUMENT ...). Other server errors (unreachable,
overloaded) print the same way and exit 1.

Importing this module stays light (no torch): the engine loads only when a command needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from kvmesh.core.config import ATTENTION_BACKENDS, ROUTING_POLICIES, STAGE_PLACEMENTS, WEIGHT_FORMATS
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from scheduler.scheduler import POLICIES

DEMO_MODEL = "qwen2.5-coder-0.5b-instruct"
DEMO_QUESTION = "travel-02"


# ---- engine settings ---------------------------------------------------------------------------

def _memory(v: str) -> float:
    from kvmesh.core.config import _parse_bytes
    try:
        n = _parse_bytes(v)
    except ValueError:
        n = -1.0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected bytes (2GiB, 512MB, 1e9) or a fraction (0.5), got {v!r}")
    return n


# (flag, EngineConfig field, add_argument keywords). One row per EngineConfig field.
ENGINE_FLAGS: list[tuple[str, str, dict]] = [
    ("--model", "model", dict(metavar="NAME|DIR", help="known model name (see `kvmesh models list`) or a "
                                                       "Hugging Face checkpoint directory")),
    ("--dtype", "dtype", dict(help="weights/activations: auto (bfloat16 on CUDA and bf16-capable CPUs, else float32), "
                                   "float32, bfloat16")),
    ("--kv-cache-dtype", "kv_cache_dtype", dict(help="auto (= dtype), float32, bfloat16, int8, fp8 (quantized "
                                                     "KV blocks, a scale per block and head)")),
    ("--weight-format", "weight_format", dict(choices=WEIGHT_FORMATS,
                                              help="weights quantized at load time: int8, int4 (group-wise), fp8, "
                                                   "w8a8-int8 (SmoothQuant); none = dense dtype (none)")),
    ("--quant-group-size", "quant_group_size", dict(type=int, choices=(32, 64, 128),
                                                    help="int4 group size along the input dimension (128)")),
    ("--no-calibration", "enable_calibration", dict(action="store_const", const=False,
                                                    help="round-to-nearest int4 and unsmoothed w8a8-int8 "
                                                         "(no AWQ scales, no SmoothQuant factors)")),
    ("--calibration-data", "calibration_data", dict(metavar="FILE",
                                                    help="calibration text file (default: the PolicyDesk policies)")),
    ("--speculative-method", "speculative_method", dict(choices=("ngram", "draft"),
                                                        help="speculative decoding: ngram (prompt lookup) or draft "
                                                             "(a draft model; --draft-model); default off")),
    ("--num-speculative-tokens", "num_speculative_tokens", dict(type=int, metavar="K",
                                                                help="proposed tokens per step (4; the most "
                                                                     "when adaptive)")),
    ("--fixed-speculative-tokens", "speculative_adaptive", dict(action="store_const", const=False,
                                                                help="always propose K tokens (default: adapt K "
                                                                     "per request to its acceptance rate)")),
    ("--draft-model", "draft_model", dict(metavar="NAME|DIR", help="draft model (same tokenizer as --model)")),
    ("--draft-num-layers", "draft_num_layers", dict(type=int, metavar="N",
                                                    help="keep the draft's first N decoder layers (0 = all)")),
    ("--draft-max-model-len", "draft_max_model_len", dict(type=int, metavar="N",
                                                          help="the draft's context limit; longer sequences "
                                                               "continue without speculation (0 = the draft's)")),
    ("--prompt-lookup-max", "prompt_lookup_max", dict(type=int, metavar="N", help="longest ngram matched (4)")),
    ("--prompt-lookup-min", "prompt_lookup_min", dict(type=int, metavar="N", help="shortest ngram matched (2)")),
    ("--block-size", "block_size", dict(type=int, metavar="N", help="tokens per KV block (power of two; 16)")),
    ("--kv-cache-memory", "kv_cache_memory", dict(type=_memory, metavar="BYTES|FRACTION",
                                                  help="KV cache budget: bytes (2GiB) or a fraction of free "
                                                       "memory (0.5); default 2GiB")),
    ("--max-model-len", "max_model_len", dict(type=int, metavar="N",
                                              help="longest prompt + output in tokens (0 = model's, at most 8192)")),
    ("--max-num-seqs", "max_num_seqs", dict(type=int, metavar="N", help="most sequences per step (64)")),
    ("--max-num-batched-tokens", "max_num_batched_tokens", dict(type=int, metavar="N",
                                                                help="token budget per step (2048)")),
    ("--policy", "policy", dict(choices=POLICIES, help="batching policy (continuous)")),
    ("--no-prefix-caching", "enable_prefix_caching", dict(action="store_const", const=False,
                                                          help="do not reuse KV blocks of shared prefixes")),
    ("--no-chunked-prefill", "enable_chunked_prefill", dict(action="store_const", const=False,
                                                            help="prefill each prompt in one step")),
    ("--device", "device", dict(help="cpu, cuda, cuda:1 ... (cpu)")),
    ("--num-threads", "num_threads", dict(type=int, metavar="N", help="torch intra-op threads (0 = torch's default)")),
    ("--attention-backend", "attention_backend", dict(choices=ATTENTION_BACKENDS,
                                                      help="native (C++ paged-attention kernels, CPU), torch "
                                                           "(PyTorch reference), auto = native where it builds (auto)")),
    ("--compile", "enable_compile", dict(action="store_const", const=True,
                                         help="compile decode steps with torch.compile, one graph per batch bucket "
                                              "(native attention backend; compiled at start-up). Default: eager")),
    ("--kv-offload-host-memory", "kv_offload_host_memory", dict(
        type=_memory, metavar="BYTES", help="keep KV blocks evicted from the pool in this much host memory "
                                            "(e.g. 4GiB; LRU) and load them back instead of recomputing (default off)")),
    ("--kv-offload-redis-url", "kv_offload_redis_url", dict(
        metavar="URL", help="keep evicted KV blocks in this Redis too, shared by replicas (redis://host:port/db)")),
    ("--kv-offload-redis-ttl", "kv_offload_redis_ttl", dict(type=float, metavar="SECONDS",
                                                            help="lifetime of a block in the Redis tier (3600; 0 = none)")),
    ("--kv-offload-prefix", "kv_offload_prefix", dict(metavar="PREFIX",
                                                      help="key prefix in the Redis tier (kvmesh)")),
]


def add_engine_args(p: argparse.ArgumentParser, *, default_model: str | None = None) -> None:
    """Add one flag per EngineConfig field. Unset flags stay None, so ``KVMESH_*`` variables and
    EngineConfig's defaults apply (``default_model`` is the exception: it beats KVMESH_MODEL)."""
    g = p.add_argument_group("engine settings", "Each flag also reads KVMESH_<FIELD> (e.g. KVMESH_DTYPE, "
                                                "KVMESH_ENABLE_PREFIX_CACHING=0); a flag wins.")
    for flag, field, kw in ENGINE_FLAGS:
        g.add_argument(flag, dest=field, default=default_model if field == "model" else None, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings of parsed ``args`` as EngineConfig keywords (None = not given)."""
    return {field: getattr(args, field) for _, field, _ in ENGINE_FLAGS}


# ---- service settings --------------------------------------------------------------------------

def _port(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535] (0 = any free port), got {v!r}")
    return n


def _metrics_port(v: str) -> int:
    if v.strip().lower() in ("off", "none"):
        return -1
    try:
        n = int(v)
    except ValueError:
        n = -2
    if not -1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535] (0 = any free port, -1 or off "
                                         f"= off), got {v!r}")
    return n


# (flag, SchedulerConfig field, add_argument keywords). One row per SchedulerConfig field.
SCHEDULER_FLAGS: list[tuple[str, str, dict]] = [
    ("--host", "host", dict(metavar="ADDR", help="listen address (127.0.0.1; 0.0.0.0 = every interface)")),
    ("--port", "port", dict(type=_port, metavar="PORT", help="listen port (50061; 0 = any free port)")),
    ("--replicas", "replicas", dict(type=int, metavar="N", help="model replicas, each with its own KV cache (1)")),
    ("--pp", "pp", dict(type=int, metavar="N", help="pipeline-parallel stages per replica (1)")),
    ("--pp-layers", "pp_layers", dict(metavar="N,N,...", help="decoder layers per stage (default: even split)")),
    ("--executor", "executor", dict(choices=("auto", "local", "ray"),
                                    help="local: the model in the engine's process, pp 1; ray: stages are Ray "
                                         "actors; auto: local at pp 1 without --ray-address, else ray (auto)")),
    ("--engine-process", "engine_process", dict(action=argparse.BooleanOptionalAction,
                                                help="each replica's engine loop in a process of its own "
                                                     "(--no-engine-process: a thread of the scheduler's process)")),
    ("--ray-address", "ray_address", dict(metavar="ADDR", help="existing Ray cluster (auto, ray://host:10001); "
                                                               "default: start a local one")),
    ("--stage-num-cpus", "stage_num_cpus", dict(type=float, metavar="N", help="CPUs each Ray stage actor reserves and its torch "
                                                                "threads (0 = this machine's cores over "
                                                                "replicas x pp, at least 1)")),
    ("--stage-placement", "stage_placement", dict(choices=STAGE_PLACEMENTS,
                                                  help="a replica's stages over Ray nodes: pack (as few nodes as "
                                                       "fit), spread, strict-spread (one node each) (pack)")),
    ("--restart-replicas", "restart_replicas", dict(action=argparse.BooleanOptionalAction,
                                                    help="restart a replica whose engine process died or hung, "
                                                         "with backoff (on)")),
    ("--restart-wait", "restart_wait", dict(type=float, metavar="S",
                                            help="how long a request waits for a restarting replica when none "
                                                 "is up, within its deadline (30 s)")),
    ("--step-timeout", "step_timeout", dict(type=float, metavar="S",
                                            help="watchdog: an engine with requests and no step for S seconds is "
                                                 "killed and restarted (120; 0 = off)")),
    ("--max-queued-requests", "max_queued_requests", dict(type=int, metavar="N",
                                                          help="waiting requests per replica before "
                                                               "RESOURCE_EXHAUSTED (1024)")),
    ("--routing", "routing", dict(choices=ROUTING_POLICIES,
                                  help="replica selection: prefix (cached prefix vs load), load (least loaded), "
                                       "round_robin, random (prefix)")),
    ("--redis-url", "redis_url", dict(metavar="URL", help="Redis prefix index shared by schedulers "
                                                          "(redis://host:6379/0; env KVMESH_REDIS_URL); "
                                                          "default: an in-process index")),
    ("--index-prefix", "index_prefix", dict(metavar="PREFIX", help="Redis key prefix of the index (kvmesh)")),
    ("--index-timeout", "index_timeout", dict(type=float, metavar="S", help="longest Redis call before routing "
                                                                            "by load (0.005 s)")),
    ("--prefix-weight", "prefix_weight", dict(type=float, metavar="W", help="score of a fully cached prompt (1.0)")),
    ("--load-weight", "load_weight", dict(type=float, metavar="W", help="score cost of a replica whose load "
                                                                        "fills its KV pool (1.0)")),
    ("--provisional-ttl", "provisional_ttl", dict(type=float, metavar="S",
                                                  help="how long a routed prompt counts as cached on its replica "
                                                       "before its KV events arrive (2 s)")),
    ("--scheduler-id", "scheduler_id", dict(metavar="ID", help="name in the index; replicas are ID/0, ID/1 ... "
                                                               "(default: hostname-random)")),
    ("--metrics-port", "metrics_port", dict(type=_metrics_port, metavar="PORT",
                                            help="Prometheus /metrics over HTTP on the listen address "
                                                 "(off; 0 = any free port; deployments use 9461)")),
    ("--tls-cert-file", "tls_cert_file", dict(metavar="PEM", help="certificate chain: listen with TLS only "
                                                                  "(with --tls-key-file)")),
    ("--tls-key-file", "tls_key_file", dict(metavar="PEM", help="private key of the TLS certificate")),
    ("--tls-client-ca-file", "tls_client_ca_file", dict(metavar="PEM",
                                                        help="require client certificates signed by this CA "
                                                             "(mutual TLS with the gateways)")),
    ("--health-port", "health_port", dict(type=_metrics_port, metavar="PORT",
                                          help="plaintext gRPC health-only port for probes that cannot speak "
                                               "TLS (off; 0 = any free port)")),
]

# (flag, GatewayConfig field, add_argument keywords). One row per GatewayConfig field.
GATEWAY_FLAGS: list[tuple[str, str, dict]] = [
    ("--host", "host", dict(metavar="ADDR", help="listen address (127.0.0.1; 0.0.0.0 = every interface)")),
    ("--port", "port", dict(type=_port, metavar="PORT", help="listen port (50051; 0 = any free port)")),
    ("--scheduler-address", "scheduler_address", dict(metavar="HOST:PORT",
                                                      help="the scheduler service (127.0.0.1:50061)")),
    ("--max-tokens-cap", "max_tokens_cap", dict(type=int, metavar="N",
                                                help="larger max_tokens are clamped to N (4096)")),
    ("--default-max-tokens", "default_max_tokens", dict(type=int, metavar="N",
                                                        help="max_tokens of a request that sets none (256)")),
    ("--default-timeout", "default_timeout", dict(type=float, metavar="S",
                                                  help="deadline of a request that sets none (300 s)")),
    ("--max-timeout", "max_timeout", dict(type=float, metavar="S", help="longest deadline a request may ask (3600 s)")),
    ("--connect-timeout", "connect_timeout", dict(type=float, metavar="S",
                                                  help="how long to wait for the scheduler at start-up (120 s)")),
    ("--metrics-port", "metrics_port", dict(type=_metrics_port, metavar="PORT",
                                            help="Prometheus /metrics over HTTP on the listen address "
                                                 "(off; 0 = any free port; deployments use 9451)")),
    ("--http-port", "http_port", dict(type=_metrics_port, metavar="PORT",
                                      help="OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                                           "/v1/models, /health) on the listen address (off; 0 = any free port)")),
    ("--max-stop-strings", "max_stop_strings", dict(type=int, metavar="N", help="stop strings per request (64)")),
    ("--max-stop-chars", "max_stop_chars", dict(type=int, metavar="N",
                                                help="characters of a request's stop strings together (4096)")),
    ("--max-stop-token-ids", "max_stop_token_ids", dict(type=int, metavar="N",
                                                        help="stop token ids per request (1024)")),
    ("--max-id-length", "max_id_length", dict(type=int, metavar="N",
                                              help="characters of a request_id or session_id (256)")),
    ("--max-prompt-tokens", "max_prompt_tokens", dict(type=int, metavar="N",
                                                      help="prompt tokens per request (0 = max_model_len - 1)")),
    ("--max-message-bytes", "max_message_bytes", dict(type=int, metavar="B",
                                                      help="size of a serialized request (4194304)")),
    ("--api-keys-file", "api_keys_file", dict(metavar="FILE",
                                              help="TENANT:KEY per line: every request needs "
                                                   "'authorization: Bearer KEY' (also KVMESH_API_KEYS; re-read "
                                                   "when the file changes and on SIGHUP)")),
    ("--tls-cert-file", "tls_cert_file", dict(metavar="PEM", help="certificate chain: the gateway listens with "
                                                                  "TLS only (with --tls-key-file)")),
    ("--tls-key-file", "tls_key_file", dict(metavar="PEM", help="private key of the gateway's certificate")),
    ("--scheduler-tls-ca-file", "scheduler_tls_ca_file", dict(metavar="PEM",
                                                              help="dial the scheduler with TLS, checking its "
                                                                   "certificate against this CA")),
    ("--scheduler-tls-client-cert-file", "scheduler_tls_client_cert_file",
     dict(metavar="PEM", help="the gateway's certificate for a scheduler requiring client certificates (mTLS)")),
    ("--scheduler-tls-client-key-file", "scheduler_tls_client_key_file",
     dict(metavar="PEM", help="private key of --scheduler-tls-client-cert-file")),
    ("--scheduler-tls-server-name", "scheduler_tls_server_name",
     dict(metavar="NAME", help="the name the scheduler's certificate holds, when not the dialled host")),
    ("--health-port", "health_port", dict(type=_metrics_port, metavar="PORT",
                                          help="plaintext gRPC health-only port for probes that cannot speak "
                                               "TLS (off; 0 = any free port)")),
]


def add_scheduler_args(p: argparse.ArgumentParser, *, listen: str | None = "--") -> None:
    """One flag per SchedulerConfig field (dest ``scheduler_<field>``); unset flags stay None so
    ``KVMESH_SCHEDULER_*`` variables apply. ``listen`` prefixes the host/port/metrics-port flags: ``"--"``
    (``kvmesh scheduler``), ``"--scheduler-"`` (``serve``, where ``--port`` is the gateway's), or
    None for none (``demo`` picks free ports)."""
    g = p.add_argument_group("scheduler settings", "Each flag also reads KVMESH_SCHEDULER_<FIELD> "
                                                   "(e.g. KVMESH_SCHEDULER_PP; --redis-url reads KVMESH_REDIS_URL); "
                                                   "a flag wins.")
    for flag, field, kw in SCHEDULER_FLAGS:
        if field in ("host", "port", "metrics_port", "health_port") or field.startswith("tls_"):   # also the gateway's under `serve`
            if listen is None:
                continue
            flag = listen + flag.removeprefix("--")
            if listen != "--":
                kw = dict(kw, help="the scheduler's " + kw["help"])
        g.add_argument(flag, dest=f"scheduler_{field}", default=None, **kw)


def scheduler_kwargs(args: argparse.Namespace) -> dict:
    return {field: getattr(args, f"scheduler_{field}", None) for _, field, _ in SCHEDULER_FLAGS}


def add_gateway_args(p: argparse.ArgumentParser, *, in_mesh: bool = False) -> None:
    """One flag per GatewayConfig field (dest ``gateway_<field>``); unset flags stay None so
    ``KVMESH_GATEWAY_*`` variables apply. ``in_mesh``: no ``--scheduler-address`` (the mesh's own)."""
    g = p.add_argument_group("gateway settings", "Each flag also reads KVMESH_GATEWAY_<FIELD> "
                                                 "(e.g. KVMESH_GATEWAY_PORT); a flag wins.")
    for flag, field, kw in GATEWAY_FLAGS:
        if not (in_mesh and field == "scheduler_address"):
            g.add_argument(flag, dest=f"gateway_{field}", default=None, **kw)


def gateway_kwargs(args: argparse.Namespace) -> dict:
    return {field: getattr(args, f"gateway_{field}", None) for _, field, _ in GATEWAY_FLAGS}


def add_grace_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish (5)")


# ---- streaming and reporting -------------------------------------------------------------------

def add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int, temperature: float | None = None) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"most tokens to generate ({max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T",
                   help=f"0 = greedy ({1.0 if temperature is None else temperature})")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (-1 = off)")
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="CTRL-style penalty (1.0 = off)")
    g.add_argument("--seed", type=int, help="per-request sampling seed")
    g.add_argument("--stop", nargs="+", default=[], metavar="S", help="stop strings (not included in the output)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags; raises EngineError for a bad value."""
    kw = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
          if getattr(args, k) is not None}
    return SamplingParams(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, **kw)


async def stream_to(out, llm, prompt, params: SamplingParams):
    """Generate ``prompt`` (text or token ids) on ``llm`` (an AsyncLLM), writing text deltas to
    ``out`` as they arrive, and return the final RequestOutput."""
    final = None
    async for ro in llm.generate(None, prompt, params):
        if ro.outputs[0].delta_text:
            out.write(ro.outputs[0].delta_text)
            out.flush()
        final = ro
    if not final.outputs[0].text.endswith("\n"):
        out.write("\n")
    out.flush()
    return final


def summary(ro) -> str:
    """One line: prompt/output tokens, TTFT, decode tokens/s (after the first token), finish reason."""
    m, c = ro.metrics, ro.outputs[0]
    n_out = len(c.token_ids)
    ttft = f"{m.ttft:.3f}" if m.ttft is not None else "-"
    span = (m.finished_time or 0) - (m.first_token_time or 0)
    decode = f"{(n_out - 1) / span:.1f}" if n_out > 1 and m.first_token_time and span > 0 else "-"
    return (f"prompt {len(ro.prompt_token_ids)} tokens ({m.num_cached_tokens} from prefix cache), "
            f"output {n_out} tokens, TTFT {ttft} s, decode {decode} tokens/s, finish {c.finish_reason}")


# ---- through a gateway -------------------------------------------------------------------------

def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags as ``kvmesh.v1.SamplingParams`` keywords: only those given (the
    server's defaults apply to the rest), validated here first (EngineError)."""
    sampling_params(args)
    kw = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                        "max_tokens") if getattr(args, k) is not None}
    if args.stop:
        kw["stop"] = args.stop
    if args.ignore_eos:
        kw["ignore_eos"] = True
    return kw


def stream_responses(out, responses):
    """Write the text deltas of a GenerateResponse stream to ``out`` as they arrive (then a
    newline unless the text ends with one); returns the whole text and the final response."""
    final, parts = None, []
    for r in responses:
        if r.text:
            out.write(r.text)
            out.flush()
            parts.append(r.text)
        if r.finished:
            final = r
    text = "".join(parts)
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()
    if final is None:
        raise EngineError("the server ended the stream without a final message")
    return text, final


def response_summary(final) -> str:
    """:func:`summary` of a final GenerateResponse: its usage and the scheduler's timings."""
    from kvmesh.core.proto import finish_reason_name

    u, t = final.usage, final.timings
    n_out = u.completion_tokens
    ttft = f"{t.ttft:.3f}" if final.HasField("timings") else "-"
    decode = f"{(n_out - 1) / t.decode_time:.1f}" if n_out > 1 and t.decode_time > 0 else "-"
    return (f"prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} from prefix cache), "
            f"output {n_out} tokens, TTFT {ttft} s, decode {decode} tokens/s, finish {finish_reason_name(final)}")


# StatusCodes that mean "this request is refused" (exit 2, like a bad argument: a wrong API key
# too); others exit 1.
_REFUSED = ("INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION", "UNAUTHENTICATED",
            "PERMISSION_DENIED")


def rpc_error(e, address: str) -> int:
    """Print a grpc.RpcError as ``kvmesh: error: ...``; return the exit code."""
    code = e.code()
    name = code.name if code is not None else "UNKNOWN"
    if name == "UNAVAILABLE":
        print(f"kvmesh: error: cannot reach the kvmesh server at {address}: {e.details()}", file=sys.stderr)
    else:
        print(f"kvmesh: error: {e.details()} ({name})", file=sys.stderr)
    return 2 if name in _REFUSED else 1


class ServerUnavailable(Exception):
    """The gateway did not become ready in time (``kvmesh: error: ...``, exit 1)."""


def connect(address: str, wait: float, api_key: str | None = None, tls_ca_file: str | None = None):
    """A :class:`kvmesh.client.Client` of the gateway at ``address`` (with ``api_key``; TLS checked
    against ``tls_ca_file`` when given), once it is ready; raises ServerUnavailable after ``wait``
    seconds."""
    from kvmesh.client import Client

    client = Client(address, api_key=api_key or None, tls_ca_file=tls_ca_file or None)
    try:
        client.wait_ready(timeout=wait)
    except BaseException as e:
        client.close()
        if isinstance(e, TimeoutError):
            raise ServerUnavailable(str(e)) from None
        raise
    return client


def add_server_arg(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--server", required=required, metavar="HOST:PORT",
                   help="a kvmesh gateway (`kvmesh serve` / `kvmesh gateway`)"
                        + ("" if required else "; default: run the engine in this process"))
    p.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="how long to wait for the server to be ready (10 s)")
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"), metavar="KEY",
                   help="API key sent as 'authorization: Bearer KEY' (env KVMESH_API_KEY)")
    p.add_argument("--tls-ca-file", default=os.environ.get("KVMESH_TLS_CA_FILE"), metavar="PEM",
                   help="connect with TLS, checking the server's certificate against this CA "
                        "(env KVMESH_TLS_CA_FILE)")


# ---- commands ----------------------------------------------------------------------------------

def cmd_models_list(args: argparse.Namespace) -> int:
    from workers.registry import DEFAULT_MODEL, KNOWN_MODELS, is_pulled, kvmesh_home, model_dir

    print(f"models live in {kvmesh_home() / 'models'} (KVMESH_HOME)")
    rows = [("NAME", "STATE", "UPSTREAM", "PATH")]
    for name, spec in sorted(KNOWN_MODELS.items()):
        pulled = is_pulled(name)
        label = name + (" (default)" if name == DEFAULT_MODEL else "") + (" (demo)" if name == DEMO_MODEL else "")
        rows.append((label, "pulled" if pulled else "not pulled", spec.hf_repo, str(model_dir(name)) if pulled else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[3])
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from workers.registry import pull_cli
    return pull_cli(args.names, progress=not args.quiet, force=args.force)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)          # bad values fail before the model loads
    if args.system is not None and not args.chat:
        raise EngineError("--system needs --chat")
    if args.server is not None:
        given = [flag for flag, field, _ in ENGINE_FLAGS if field != "model" and getattr(args, field) is not None]
        if given:
            raise EngineError(f"{', '.join(given)}: engine settings are the server's, not for --server")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.server is not None:
        return _generate_remote(args, prompt)
    return asyncio.run(_generate(args, prompt, params))


async def _generate(args: argparse.Namespace, prompt: str, params: SamplingParams) -> int:
    from kvmesh.llm import AsyncLLM

    llm = AsyncLLM(**engine_kwargs(args))
    try:
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            prompt = llm.encode_chat(system + [{"role": "user", "content": prompt}])
        ro = await stream_to(sys.stdout, llm, prompt, params)
    finally:
        await llm.shutdown()
    print(summary(ro), file=sys.stderr, flush=True)
    return 0


def _generate_remote(args: argparse.Namespace, prompt: str) -> int:
    """``generate --server``: the Generate RPC (Chat with ``--chat``) of a gateway."""
    import grpc

    kw = sampling_kwargs(args)
    try:
        with connect(args.server, args.wait, args.api_key, args.tls_ca_file) as client:
            if args.chat:
                system = [{"role": "system", "content": args.system}] if args.system else []
                call = client.chat(system + [{"role": "user", "content": prompt}], model=args.model or "", **kw)
            else:
                call = client.generate(prompt, model=args.model or "", **kw)
            _, final = stream_responses(sys.stdout, call)
    except grpc.RpcError as e:
        return rpc_error(e, args.server)
    print(response_summary(final), file=sys.stderr, flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Multi-turn chat through a gateway's Chat RPC: each stdin line is a user turn (a prompt
    on a terminal); the whole conversation goes with every turn, under one session id."""
    import grpc
    from kvmesh.client import new_session_id

    kw = sampling_kwargs(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    session = args.session_id or new_session_id()
    try:
        client = connect(args.server, args.wait, args.api_key, args.tls_ca_file)
    except grpc.RpcError as e:
        return rpc_error(e, args.server)
    rc, n = 0, 0
    history = list(system)
    with client:
        if interactive:
            try:
                import readline  # noqa: F401  (line editing for input())
            except ImportError:
                pass
            print(f"kvmesh: chat with {args.server} (session {session}); /reset starts over, Ctrl-D ends",
                  file=sys.stderr, flush=True)
        while True:
            try:
                line = input("> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            if not line:                    # EOF of a pipe
                break
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                history = list(system)
                print("kvmesh: conversation reset", file=sys.stderr, flush=True)
                continue
            if text in ("/quit", "/exit"):
                break
            history.append({"role": "user", "content": text})
            call = None
            try:
                call = client.chat(history, model=args.model or "", session_id=session, **kw)
                answer, final = stream_responses(sys.stdout, call)
            except grpc.RpcError as e:
                history.pop()
                rc = rpc_error(e, args.server)
                if rc != 2 or not interactive:
                    return rc
                continue
            except KeyboardInterrupt:       # stop this answer (the request is aborted), keep chatting
                if call is not None:
                    call.cancel()
                history.pop()
                if not interactive:
                    raise
                print("\nkvmesh: answer interrupted", file=sys.stderr, flush=True)
                continue
            history.append({"role": "assistant", "content": answer})
            n += 1
            print(f"turn {n}: {response_summary(final)}", file=sys.stderr, flush=True)
    return rc


def _service_configs(args: argparse.Namespace, **sched_overrides):
    """(EngineConfig, SchedulerConfig, GatewayConfig) from the flags and the environment."""
    from kvmesh.core.config import EngineConfig, GatewayConfig, SchedulerConfig

    return (EngineConfig.from_env(**engine_kwargs(args)),
            SchedulerConfig.from_env(**dict(scheduler_kwargs(args), **sched_overrides)),
            GatewayConfig.from_env(**gateway_kwargs(args)))


def _run_services(coro) -> int:
    try:
        return asyncio.run(coro)
    except (OSError, RuntimeError) as e:       # e.g. a port in use
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    from kvmesh import serve

    engine_cfg, sched_cfg, gw_cfg = _service_configs(args)
    return _run_services(serve.run_services(lambda mesh: serve.start_mesh(mesh, sched_cfg, engine_cfg, gw_cfg),
                                            grace=args.grace))


def cmd_scheduler(args: argparse.Namespace) -> int:
    from kvmesh import serve

    engine_cfg, sched_cfg, _ = _service_configs(args)
    return _run_services(serve.run_services(lambda mesh: serve.start_scheduler(mesh, sched_cfg, engine_cfg),
                                            grace=args.grace))


def cmd_gateway(args: argparse.Namespace) -> int:
    from kvmesh import serve
    from kvmesh.core.config import GatewayConfig

    gw_cfg = GatewayConfig.from_env(**gateway_kwargs(args))
    return _run_services(serve.run_services(lambda mesh: serve.start_gateway(mesh, gw_cfg), grace=args.grace))


def cmd_demo(args: argparse.Namespace) -> int:
    import grpc
    from bench import policydesk

    question = next((q for q in policydesk.questions() if q["id"] == args.question), None)
    if question is None:
        raise EngineError(f"no PolicyDesk question {args.question!r} in {policydesk.DATA_DIR / 'questions.jsonl'}")
    # The follow-up: the opening turn of the first chat about the same policy.
    follow_up = next(c["turns"][0] for c in policydesk.chats() if c["policy"] == question["policy"])
    turns = [(question["question"], question["reference_answer"]),
             (follow_up["user"], follow_up["reference_answer"])]
    kw = sampling_kwargs(args)
    system = policydesk.system_message(question["policy"])
    # The mesh on free loopback ports; the other scheduler and gateway settings from flags / env.
    engine_cfg, sched_cfg, gw_cfg = _service_configs(args, host="127.0.0.1", port=0)
    gw_cfg = gw_cfg.replace(host="127.0.0.1", port=0)
    try:
        return _run_services(_demo(engine_cfg, sched_cfg, gw_cfg, question["policy"], system, turns, kw))
    except grpc.RpcError as e:
        return rpc_error(e, "the demo's gateway")


async def _demo(engine_cfg, sched_cfg, gw_cfg, policy: str, system: str, turns: list[tuple[str, str]],
                kw: dict) -> int:
    from kvmesh import serve
    from kvmesh.client import Client

    serve.announce(f"starting the mesh: {engine_cfg.model}, {sched_cfg.resolved_executor()} executor, pp {sched_cfg.pp}, "
                   f"{sched_cfg.replicas} replica(s) ...")
    t0 = time.monotonic()

    async def chat(mesh) -> int:
        client = Client(mesh.gateway_address)
        try:
            return await asyncio.to_thread(_demo_chat, client, mesh, time.monotonic() - t0, engine_cfg, sched_cfg,
                                           policy, system, turns, kw)
        finally:
            client.close()          # on Ctrl-C: cancels the stream in flight, so the thread ends

    return await serve.run_services(lambda mesh: serve.start_mesh(mesh, sched_cfg, engine_cfg, gw_cfg),
                                    work=chat, grace=1.0)


def _demo_chat(client, mesh, startup: float, engine_cfg, sched_cfg, policy: str, system: str,
               turns: list[tuple[str, str]], kw: dict) -> int:
    """The demo's conversation (in a thread, while the loop serves the mesh)."""
    from kvmesh.client import new_session_id

    out = sys.stdout
    client.wait_ready(timeout=60)
    info = client.list_models()[0]
    out.write(f"PolicyDesk demo: {info.name} ({info.dtype}, {engine_cfg.device}), mesh up in {startup:.1f} s: "
              f"gateway {mesh.gateway_address} -> scheduler {mesh.scheduler_address} "
              f"({sched_cfg.resolved_executor()} executor, pp {sched_cfg.pp})\n"
              f"system: PolicyDesk prompt + policy '{policy}'\n")
    session = new_session_id()
    messages = [{"role": "system", "content": system}]
    for n, (user, reference) in enumerate(turns, 1):
        messages.append({"role": "user", "content": user})
        out.write(f"\n[turn {n}] user: {user}\n[turn {n}] assistant: ")
        answer, final = stream_responses(out, client.chat(messages, session_id=session, **kw))
        messages.append({"role": "assistant", "content": answer})
        out.write(f"  (reference answer: {reference})\n  {response_summary(final)}\n")
        if n > 1:
            u = final.usage
            out.write(f"  prefix cache: turn {n} reused {u.cached_prompt_tokens} of its "
                      f"{u.prompt_tokens} prompt tokens from the earlier turns\n")
        out.flush()
    return 0


# ---- parser ------------------------------------------------------------------------------------

def register_commands(sub) -> None:
    """Add every subcommand to ``sub`` (the top-level subparsers). Each parser sets ``func``, a
    callable (args) -> exit code. New commands (``kvmesh bench ...``) register here."""
    models = sub.add_parser("models", help="list and pull known models")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = msub.add_parser("list", help="known models, pulled or not, and where")
    p.set_defaults(func=cmd_models_list)
    p = msub.add_parser("pull", help="download pinned weights and convert them (idempotent)")
    p.add_argument("names", nargs="+", metavar="NAME", help="known model name(s)")
    p.add_argument("--force", action="store_true", help="convert again even if already pulled")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_models_pull)

    p = sub.add_parser("generate", help="stream one completion to the terminal",
                       description="Stream a completion to stdout; a summary line (tokens, TTFT, "
                                   "decode tokens/s, finish reason) goes to stderr. With --server, "
                                   "through a kvmesh gateway; otherwise the engine runs in this process.")
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    add_server_arg(p, required=False)
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="multi-turn chat through a kvmesh gateway",
                       description="Chat through a gateway's Chat RPC: each line of stdin is a user turn "
                                   "(a pipe works too; EOF ends), answers stream to stdout, one summary "
                                   "line per turn (tokens, prefix-cache hits, TTFT, tokens/s) goes to stderr. "
                                   "The whole conversation is sent each turn under one session id, so "
                                   "earlier turns come from the prefix cache. /reset starts over.")
    add_server_arg(p, required=True)
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--model", metavar="NAME", help="model name (default: the served model)")
    p.add_argument("--session-id", metavar="ID", help="session id (default: a new random one)")
    add_sampling_args(p, max_tokens=256)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="the mesh in one process: scheduler + gateway",
                       description="Start the scheduler service (its replicas, Ray stage actors) and the "
                                   "public gateway in one process. Prints `kvmesh: <service> listening on "
                                   "HOST:PORT` on stderr for each; SIGINT/SIGTERM stops them (exit 0).")
    add_grace_arg(p)
    add_gateway_args(p, in_mesh=True)
    add_scheduler_args(p, listen="--scheduler-")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("scheduler", help="the scheduler service alone",
                       description="The internal scheduler service (kvmesh.v1.SchedulerService): replicas "
                                   "of the model, their engine loops and executors. Settings from flags or "
                                   "KVMESH_SCHEDULER_* / KVMESH_* variables.")
    add_grace_arg(p)
    add_scheduler_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_scheduler)

    p = sub.add_parser("gateway", help="the public gateway alone",
                       description="The public gRPC service (kvmesh.v1.LLMService) in front of a scheduler "
                                   "(--scheduler-address). Settings from flags or KVMESH_GATEWAY_* variables.")
    add_grace_arg(p)
    add_gateway_args(p)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("demo", help="a two-turn PolicyDesk chat through an in-process mesh: streamed answers, "
                                    "TTFT, tokens/s, prefix-cache hits",
                       description="Start the mesh (scheduler with Ray stage workers, gateway) in this "
                                   "process on free ports, ask a PolicyDesk question (bench/data/policydesk) "
                                   "with the policy in the system message through the gateway's Chat RPC, "
                                   "then a follow-up turn in the same session that reuses the cached prefix.")
    p.add_argument("--question", default=DEMO_QUESTION, metavar="ID",
                   help=f"question id from questions.jsonl ({DEMO_QUESTION})")
    add_sampling_args(p, max_tokens=160, temperature=0.0)
    add_scheduler_args(p, listen=None)
    add_engine_args(p, default_model=DEMO_MODEL)
    p.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (see docs/)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    # `kvmesh bench engine ARGS` hands ARGS to bench.engine_offline (see main())
    bsub.add_parser("engine", help="offline engine benchmark: naive / static / continuous (± prefix caching), "
                                   "fp32 and bf16; `kvmesh bench engine --help` for its flags")
    # `kvmesh bench serve ARGS` hands ARGS to bench.serve (see main())
    bsub.add_parser("serve", help="online serving benchmark (as `vllm bench serve`): arrivals, TTFT/TPOT/ITL/"
                                  "E2EL, goodput, over gRPC or OpenAI HTTP; `kvmesh bench serve --help`")
    # `kvmesh bench ablation ARGS` / `kvmesh eval faithfulness ARGS`: bench.ablation / bench.faithfulness (main())
    bsub.add_parser("ablation", help="one PolicyDesk table over the serving techniques (naive loop ... prefix "
                                     "routing, quantization, speculation): tok/s, TTFT, ITL, memory, "
                                     "faithfulness; `kvmesh bench ablation --help`")
    evaluate = sub.add_parser("eval", help="quality evaluations (see docs/benchmarks.md)")
    esub = evaluate.add_subparsers(dest="eval_command", metavar="WHAT", required=True)
    esub.add_parser("faithfulness", help="PolicyDesk key-fact accuracy, agreement with the unoptimised "
                                         "reference, grounding, quality gate; `kvmesh eval faithfulness --help`")


def build_parser() -> argparse.ArgumentParser:
    from kvmesh import __version__

    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: an LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for a bad argument or an EngineError)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Ray starts its processes with fork+exec: grpc's fork handlers are not needed and only log
    # "skipping fork() handlers" lines (read when grpc is first imported, hence here)
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    if argv[:2] == ["bench", "engine"]:
        from bench.engine_offline import main as bench_engine
        try:
            return bench_engine(argv[2:])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0
    if argv[:2] == ["bench", "serve"]:
        from bench.serve import main as bench_serve
        try:
            return bench_serve(argv[2:])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0
    if argv[:2] in (["bench", "ablation"], ["eval", "faithfulness"]):
        if argv[0] == "bench":
            from bench.ablation import main as run
        else:
            from bench.faithfulness import main as run
        try:
            return run(argv[2:])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0
        except EngineError as e:
            print(f"kvmesh: error: {e}", file=sys.stderr)
            return 2
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:             # --help, --version, or argparse's "error: ..." (code 2)
        return e.code if isinstance(e.code, int) else 0
    try:
        return args.func(args)
    except EngineError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
    except ServerUnavailable as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkvmesh: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
