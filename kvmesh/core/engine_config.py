"""EngineConfig: the settings of one engine replica (model, dtypes, KV cache, batching,
speculative decoding, kernels), and the choices its fields accept.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.core.errors import SettingsError
from kvmesh.core.settings import Settings, coerce_strings, parse_bytes, setting

if TYPE_CHECKING:
    import torch

# The choices of the engine settings, one list each; EngineConfig checks every field against its
# list on construction, so a bad value stops the start-up. dtype names -> torch dtype attribute
# (torch is imported only where a torch dtype is asked for, so the gateway's process, which reads
# these settings, loads no torch).
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}          # dtype (weights, activations)
# kv_cache_dtype: the float dtypes, or quantized blocks (workers.kv_cache: a scale per block and KV head)
KV_CACHE_DTYPES = {**DTYPES, "int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


WEIGHT_FORMATS = ("auto", "none", "gguf", "int8", "int4", "fp8", "w8a8-int8")
SPECULATIVE_METHODS = ("", "ngram", "draft", "ngram+draft")
DRAFT_METHODS = ("draft", "ngram+draft")       # the methods that run a draft model
LOOKUP_METHODS = ("ngram", "ngram+draft")      # the methods that run prompt lookup
DRAFT_QUANTIZATIONS = ("", "q4_1")              # the draft's weights as published, or requantized
ATTENTION_BACKENDS = ("auto", "native", "torch")


KERNEL_LEVELS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")   # kvmesh's CPU kernel levels, lowest first
KERNEL_ISAS = ("auto",) + KERNEL_LEVELS        # what the kernel_isa setting (KVMESH_KERNEL_ISA) accepts


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere), read once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_kernel_level(want: str = "auto") -> str:
    """The level kvmesh's native CPU kernels run at here, one of :data:`KERNEL_LEVELS`, read
    from Linux /proc/cpuinfo so that a process without torch can tell (the kernels' own rule,
    workers/kernels/csrc/isa.cpp: avx2 = AVX2 + FMA + F16C; avx512 = + AVX-512 F, BW, VL, DQ;
    avx512bf16 = + AVX512-BF16; amx = + AMX-TILE and AMX-BF16): the CPU's best, or ``want``
    (a ``kernel_isa`` setting) when that names a lower level (``auto``: the best; a level above
    the best is lowered to it, as the kernels do); ``scalar`` off x86-64 and with
    ``KVMESH_NATIVE_KERNELS=0``."""
    import os
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or os.environ.get("KVMESH_NATIVE_KERNELS", "1") == "0":
        return "scalar"
    f = _cpu_flags()
    level = "scalar"
    if {"avx2", "fma", "f16c"} <= f:
        level = "avx2"
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
            level = "avx512"
            if "avx512_bf16" in f:
                level = "amx" if {"amx_tile", "amx_bf16"} <= f else "avx512bf16"
    if want in KERNEL_LEVELS and KERNEL_LEVELS.index(want) < KERNEL_LEVELS.index(level):
        return want
    return level


POLICIES = ("continuous", "static", "naive")   # batching policies; scheduler.batching implements them

@dataclass
class EngineConfig(Settings):
    """Settings of one engine replica.

    Attributes:
        model: known model name (see ``kvmesh models list``) or checkpoint directory.
        dtype: weight/activation dtype: ``float32`` or ``bfloat16`` (``auto``: see
            :attr:`torch_dtype`).
        kv_cache_dtype: ``auto`` (= dtype), ``float32``, ``bfloat16``, or a quantized KV cache:
            ``int8`` or ``fp8`` (e4m3) with a scale per block and KV head.
        weight_format: ``gguf`` (the published GGUF's block-quantized weights as they are, run by
            the ``gguf_linear`` kernel; activations in ``dtype``), ``none`` (dense ``dtype``), ``auto``
            (``gguf`` where the model directory holds ``model.gguf``, else ``none``;
            :func:`workers.loader.resolve_weight_format`), or weights quantized at load time: ``int8``
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
        speculative_max_batch_tokens: the most tokens (rows x (1 + k)) one step verifies: k is
            cut to this // n - 1 for n running and waiting requests (0 = no cap). A CPU's verify pass costs
            about a decode step up to 5 rows and more past them (docs/spec_decode.md, "Speculation
            under load"), so speculation turns off from 3 requests and back on as the batch
            shrinks; raise it where the GEMM has more compute (a GPU).
        draft_model: the draft checkpoint (known name or directory; same tokenizer as ``model``).
        draft_num_layers: keep only the draft's first N decoder layers (0 = all).
        draft_max_model_len: the draft's context limit in tokens (0 = its max_position_embeddings);
            longer sequences continue without speculation.
        draft_quantization: ``q4_1``: the draft's GGUF blocks with wider lanes (Q5_0, Q6_K,
            Q8_0) requantized to Q4_1 when it loads, so a proposal reads fewer bytes (lossy: the
            draft's guesses may get worse; the target's verification keeps the output exact);
            ``""``: as published. Weight format ``gguf`` only.
        draft_vocab_size: the draft's lm_head keeps the first N token ids and proposes only
            those (0 or at least the vocabulary: all); the ids of a byte-level BPE vocabulary are
            in merge order, so the first ones are the frequent ones (FR-Spec, Zhao et al. 2025).
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
        kernel_isa: the instruction-set level of kvmesh's native CPU kernels, one of
            :data:`KERNEL_LEVELS` (``auto``: the CPU's best; a level above the CPU's is lowered
            to it, with a warning). Process-wide: every kernel follows the last engine started
            in the process (:func:`workers.kernels.set_isa`). ``KVMESH_KERNEL_ISA`` also sets
            it for processes that run the kernels without an engine (read when they load).
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
                         "on CUDA and on CPUs with AVX2 + FMA and up, float32 at the scalar level", metavar="DTYPE")
    kv_cache_dtype: str = setting("auto", "KV cache: auto (= dtype), float32, bfloat16, or quantized blocks int8, "
                                  "fp8 (a scale per block and head)", metavar="DTYPE")
    weight_format: str = setting("auto", "gguf: the published GGUF's own quantized blocks, run natively; none: dense "
                                 "dtype; or quantized at load time: int8, int4 (group-wise), fp8, w8a8-int8 "
                                 "(SmoothQuant); auto = gguf where the model has a GGUF (the known models), else none",
                                 choices=WEIGHT_FORMATS)
    quant_group_size: int = setting(128, "int4 group size along the input dimension", choices=(32, 64, 128))
    enable_calibration: bool = setting(True, "AWQ scales (int4) and SmoothQuant factors (w8a8-int8); "
                                       "--no-calibration: round-to-nearest, no smoothing")
    calibration_data: str = setting("", "calibration text file (empty: the PolicyDesk policies)", metavar="FILE")
    speculative_method: str = setting("", "speculative decoding: ngram (prompt lookup) or draft (a draft model, "
                                      "--draft-model); empty: off", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = setting(4, "proposed tokens per step (the most, when adaptive)", metavar="K")
    speculative_adaptive: bool = setting(True, "always propose K tokens (default: adapt K per request to its "
                                         "acceptance rate)", flag="--fixed-speculative-tokens")
    speculative_max_batch_tokens: int = setting(5, "the most tokens (rows x (1 + K)) a step verifies: each "
                                                "row's K is cut to this // n - 1 for n running and waiting "
                                                "requests, so batches of more than half this decode without "
                                                "speculation; 0: no cap",
                                                metavar="TOKENS")
    draft_model: str = setting("", "draft model (same tokenizer as --model)", metavar="NAME|DIR")
    draft_num_layers: int = setting(0, "keep the draft's first N decoder layers (0 = all)")
    draft_max_model_len: int = setting(0, "the draft's context limit; longer sequences continue without "
                                       "speculation (0 = the draft's)")
    draft_quantization: str = setting("", "q4_1: the draft's GGUF blocks requantized to Q4_1 at load (4-bit lanes: "
                                      "fewer bytes per proposal, lossy; weight format gguf); default: as published",
                                      choices=DRAFT_QUANTIZATIONS)
    draft_vocab_size: int = setting(0, "the draft proposes only the first N token ids (its lm_head cut to "
                                    "them; 0 = the whole vocabulary)")
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
    kernel_isa: str = setting("auto", "instruction set of the native CPU kernels: scalar, avx2, avx512, avx512bf16, "
                              "amx (one above the CPU's is lowered to it); auto = the CPU's best", choices=KERNEL_ISAS)
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
        coerce_strings(self)
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if isinstance(self.kv_offload_host_memory, str):
            self.kv_offload_host_memory = parse_bytes(self.kv_offload_host_memory)
        if self.kv_offload_host_memory < 0:
            raise SettingsError(f"kv_offload_host_memory must be >= 0 bytes, got {self.kv_offload_host_memory}")
        if self.kv_offload_redis_url and not self.kv_offload_redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(f"kv_offload_redis_url must be redis://host:port/db (or rediss://, unix://), "
                                f"got {self.kv_offload_redis_url!r}")
        if self.kv_offload_redis_ttl < 0:
            raise SettingsError(f"kv_offload_redis_ttl must be >= 0 seconds, got {self.kv_offload_redis_ttl}")
        if self.kv_offload and self.uses_draft:
            raise SettingsError("KV offload (kv_offload_host_memory, kv_offload_redis_url) does not keep a draft "
                                "model's KV: use it without speculative_method 'draft'")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise SettingsError(f"unknown dtype {self.dtype!r}; choose auto or one of {sorted(DTYPES)}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SettingsError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose auto or one of "
                                f"{sorted(KV_CACHE_DTYPES)}")
        if self.policy not in POLICIES:
            raise SettingsError(f"unknown scheduling policy {self.policy!r}; choose one of {POLICIES}")
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
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise SettingsError(f"unknown draft_quantization {self.draft_quantization!r}; "
                                f"choose one of {DRAFT_QUANTIZATIONS} ('' = as published)")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise SettingsError(f"unknown speculative_method {self.speculative_method!r}; "
                                f"choose one of {SPECULATIVE_METHODS} ('' = off)")
        if self.speculative_method and self.policy != "continuous":
            raise SettingsError(f"speculative_method {self.speculative_method!r} needs policy 'continuous' "
                                f"(got {self.policy!r})")
        if self.speculative_method and not 1 <= self.num_speculative_tokens <= 16:
            raise SettingsError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.uses_draft and not self.draft_model:
            raise SettingsError(f"speculative_method {self.speculative_method!r} needs draft_model (--draft-model)")
        if self.kernel_isa not in KERNEL_ISAS:
            raise SettingsError(f"unknown kernel_isa {self.kernel_isa!r}; choose one of {KERNEL_ISAS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise SettingsError(f"unknown attention_backend {self.attention_backend!r}; choose one of {ATTENTION_BACKENDS}")
        if self.speculative_max_batch_tokens < 0:
            raise SettingsError(f"speculative_max_batch_tokens must be >= 0, got {self.speculative_max_batch_tokens}")
        for name in ("draft_num_layers", "draft_max_model_len", "draft_vocab_size"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        # before any weight is read (`auto` is resolved per model where the draft loads)
        if self.uses_draft and self.weight_format != "auto":
            self.check_draft_weight_format(self.weight_format)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SettingsError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def check_draft_weight_format(self, weight_format: str) -> None:
        """Raise SettingsError when the draft's ``draft_quantization`` or ``draft_vocab_size``
        cannot apply to its weights in ``weight_format`` (a resolved format, not ``auto``)."""
        if self.draft_quantization and weight_format != "gguf":
            raise SettingsError(f"draft_quantization {self.draft_quantization!r} requantizes GGUF blocks: it needs "
                                f"weight_format gguf, not {weight_format!r}")
        if self.draft_vocab_size and weight_format not in ("none", "gguf"):
            raise SettingsError(f"draft_vocab_size cannot be combined with weight_format {weight_format!r}: "
                                "the lm_head is cut in the dense and gguf formats")

    @property
    def uses_draft(self) -> bool:
        """Whether the speculative method runs a draft model (``draft``, ``ngram+draft``)."""
        return self.speculative_method in DRAFT_METHODS

    @property
    def kv_offload(self) -> bool:
        """A KV tier below the pool is configured (host memory or Redis)."""
        return self.kv_offload_host_memory > 0 or bool(self.kv_offload_redis_url)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``auto``: bfloat16 on CUDA and wherever kvmesh's CPU kernels have a vector path
        (:func:`cpu_kernel_level` of :attr:`kernel_isa` above ``scalar``: AVX2 + FMA + F16C and
        up); float32 at the scalar level. Rule: bf16 wherever it measured faster than float32,
        prefill and decode (figures: docs/engine_offline.md; docs/results-history.md, section
        0z10)."""
        import torch

        if self.dtype == "auto":
            if self.device.startswith("cuda") or cpu_kernel_level(self.kernel_isa) != "scalar":
                return torch.bfloat16
            return torch.float32
        return getattr(torch, DTYPES[self.dtype])
