"""Native CPU kernels (``torch.ops.kvmesh.*``): paged attention and KV cache writes (here), the
bf16-weight GEMM (:mod:`workers.kernels.gemm`, sources in ``csrc/gemm/``).

The C++ sources under ``csrc/`` are one extension, built ahead of time by ``make venv``
(``python -m workers.kernels.build``) into ``kvmesh_home()/torch_extensions/kvmesh_kernels-<key>``,
``key`` a hash of the sources, the compiler flags and the torch and Python versions (not the
checkout's path): :mod:`workers.kernels.build` is the one place that finds, builds and loads it.
A start whose sources have a build loads it without compiling; one whose sources changed (an
editable checkout) builds it on first use, once, saying so on stderr. A start that finds
another process building says so on stderr and waits at most ``KVMESH_KERNEL_BUILD_WAIT``
seconds (600 by default), then :func:`available` raises
:class:`~kvmesh.core.errors.DependencyUnavailableError`; a build that was killed is started
again by the next process, never waited for.

Otherwise nothing here raises when the kernels cannot be used: :func:`available` returns
False (after one warning on the ``kvmesh.kernels`` logger naming the reason) when
``KVMESH_NATIVE_KERNELS=0``, on a CPU that is not x86-64, or when the build fails (no compiler,
no ``ninja``...).

Instruction set: one switch for every kernel (``csrc/isa.h``, llama.cpp's ggml-cpu model: the
CPU's features detected once, at run time, in one place). Levels, lowest first: ``scalar``,
``avx2`` (AVX2 + FMA + F16C), ``avx512`` (+ AVX-512 F/BW/VL/DQ), ``avx512bf16`` (+ AVX512-BF16),
``amx`` (+ AMX-BF16 tiles, granted by the kernel); one build carries all of them (each level's
translation units compiled with ``#pragma GCC target``). The active level is the CPU's best,
or the ``kernel_isa`` setting (:class:`~kvmesh.core.engine_config.EngineConfig`; its
environment variable ``KVMESH_KERNEL_ISA`` is read once, when the kernels load; an engine sets
its own with :func:`set_isa`). One rule for a level above the CPU's: it is lowered to the CPU's
best, with one warning per process on the ``kvmesh.kernels`` logger. A kernel family without
code at the active level runs its nearest lower one, or none (:func:`paths`, which says what
each op runs now). On the attention paths: avx512bf16 computes q K^T of a bfloat16 cache with
``vdpbf16ps``, and work items of at least 9 query rows of a bfloat16 q (prefill and verify
chunks, cascade groups) run the flash path of ``csrc/attn_flash.h`` with ``vdpbf16ps`` register
tiles, items of at most 8 such rows over a bfloat16, int8 or fp8 cache the decode pass of
``csrc/attn_decode.h``, all KV heads of a key range at once; amx runs the flash path on AMX-BF16
tiles (``csrc/attn_amx.h``). :func:`isa` names the level in use. :func:`prefill_in_kernel` says
whether prefill chunks should run here rather than through SDPA.

Ops (schemas as registered; fake implementations below make them opaque to ``torch.compile``)::

    kvmesh::reshape_and_cache(Tensor k, Tensor v, Tensor(a!) kv_data, Tensor(b!)? scales,
                              Tensor slot_mapping) -> ()
    kvmesh::paged_attention(Tensor q, Tensor kv_data, Tensor? scales, Tensor query_start_loc,
                            Tensor seq_lens, Tensor block_tables, float scale,
                            Tensor? prefix_group=None, Tensor? prefix_block_tables=None,
                            Tensor? prefix_lens=None) -> Tensor
    kvmesh::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor
    kvmesh::add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)
        (csrc/norm.cpp: RMSNorm, and the residual add fused into it; x [T, hidden] contiguous)
    kvmesh::silu_and_mul_bf16(Tensor x) -> Tensor
        (csrc/activation.cpp: silu(gate) * up of a bfloat16 [T, 2 I] gate/up projection -> [T, I])
    kvmesh::rotary_bf16(Tensor x, Tensor cos, Tensor sin) -> Tensor
        (csrc/rotary.cpp: RoPE of a bfloat16 [T, heads, D] view, bit-identical to
        workers.layers.rotary.RotaryEmbedding.rotate)

    The norm (bfloat16), SiLU and RoPE loops have AVX-512 code (run at avx512 and above) and
    baseline code (run at scalar and avx2: no avx2 code of their own).

and the GEMMs of :mod:`workers.kernels.gemm` (``bf16_linear``, ``int4_linear``, ``int8_linear``,
``gguf_linear`` and their packing).
"""

from __future__ import annotations

import logging
import os
import platform
import threading

import torch

from kvmesh.core.engine_config import KERNEL_ISAS, EngineConfig
from kvmesh.core.errors import DependencyUnavailableError
from kvmesh.core.settings import env_var

log = logging.getLogger("kvmesh.kernels")

_lock = threading.Lock()
# module: the loaded extension (None: not loaded, see reason); lowered: the level names already
# warned about (one warning per name and process)
_state: dict = {"tried": False, "module": None, "reason": None, "lowered": set()}


def _load():
    with _lock:
        if _state["tried"]:
            return _state["module"]
        _state["tried"] = True
        reason = None
        if os.environ.get("KVMESH_NATIVE_KERNELS", "1") == "0":
            reason = "disabled by KVMESH_NATIVE_KERNELS=0"
        elif platform.machine().lower() not in ("x86_64", "amd64"):
            reason = f"CPU architecture {platform.machine()} is not x86-64"
        else:
            from workers.kernels import build
            try:
                got = build.load(build.KERNELS)
            except DependencyUnavailableError:   # another process's build outlasted the wait: not cached,
                _state["tried"] = False          # a later call waits again
                raise
            except Exception as e:          # compiler missing, build error, import error
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                errs = [ln for ln in lines if "error:" in ln.lower()]
                reason = f"build failed: {type(e).__name__}: {(errs or lines or [''])[0][:300]}"
            else:
                _state["module"] = got.module
        if reason is not None:
            _state["reason"] = reason
            log.warning("kvmesh: native CPU kernels unavailable (%s); using the PyTorch path", reason)
            return None
        _register_fakes()
        var = env_var(EngineConfig, "kernel_isa")          # KVMESH_KERNEL_ISA, read here only
        want = os.environ.get(var, "auto")
        if want not in KERNEL_ISAS:
            log.warning("kvmesh: unknown %s=%s (%s); using auto", var, want, ", ".join(KERNEL_ISAS))
            want = "auto"
        _select(_state["module"], want)
        return _state["module"]


def _select(m, name: str) -> str:
    """``m.set_isa(name)``, warning once per ``name`` and process when it was lowered."""
    got = m.set_isa(name)
    if name not in ("auto", "", got) and name not in _state["lowered"]:
        _state["lowered"].add(name)
        log.warning("kvmesh: kernel ISA %s is above this CPU's best; using %s", name, got)
    return got


def available() -> bool:
    """True when the extension is loaded (the first call loads it, building it when its sources
    have no build yet). Raises DependencyUnavailableError when another process's build of the
    same sources outlasted ``KVMESH_KERNEL_BUILD_WAIT`` seconds."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    _load()
    return _state["reason"]


def isa() -> str:
    """The kernel level in use: ``"amx"``, ``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or
    ``"scalar"``; ``"none"`` when the extension is unavailable."""
    m = _load()
    return m.active_isa() if m is not None else "none"


def cpu_isa() -> str:
    """The best level this CPU supports (``"none"`` when the extension is unavailable)."""
    m = _load()
    return m.cpu_isa() if m is not None else "none"


def set_isa(name: str) -> str:
    """Select the kernel level of every kernel in this process: ``"scalar"``, ``"avx2"``,
    ``"avx512"``, ``"avx512bf16"``, ``"amx"`` or ``"auto"`` (the CPU's best). One above
    :func:`cpu_isa` is lowered to it, with one warning per name and process. Returns the level
    now in use. Raises RuntimeError when the extension is unavailable or the name is unknown
    (the level is then unchanged)."""
    m = _load()
    if m is None:
        raise RuntimeError(f"kvmesh native kernels unavailable: {_state['reason']}")
    return _select(m, name)


def paths() -> dict[str, str]:
    """What each op runs at the active level: ``{op: path}`` for ``paged_attention`` (head dims
    that are multiples of 32; csrc/dispatch.h for others), ``reshape_and_cache`` (int8 / fp8
    caches), ``bf16_linear``, ``int4_linear``, ``int8_linear``, ``gguf_linear``, ``rms_norm``
    (bfloat16), ``rotary_bf16`` and ``silu_and_mul_bf16``. A path is a level's name (the nearest
    level at or below the active one that the op has code for; ``gguf_linear`` also
    ``"avx512vnni"``), or ``"none"``: the op raises at this level. Empty when the extension is
    unavailable."""
    m = _load()
    return dict(m.paths()) if m is not None else {}


def path(op: str) -> str:
    """``paths()[op]``, or ``"none"`` when the extension is unavailable. Raises KeyError for an
    op that :func:`paths` does not name."""
    p = paths()
    return p[op] if p else "none"


def prefill_in_kernel(dtype: torch.dtype) -> bool:
    """Whether prefill chunks of a ``dtype`` model over a cache of the same dtype are faster
    through ``paged_attention`` than through SDPA: for bfloat16 on the two flash paths
    (``csrc/attn_flash.h``), ``amx`` and ``avx512bf16``, where the kernel measured faster for a
    whole prefill (figures: docs/engine.md, "Attention backends"). Elsewhere ATen's GEMM-shaped
    flash attention wins for chunks of ``SDPA_MIN_CHUNK_TOKENS`` tokens and more
    (workers/layers/attention.py)."""
    return dtype == torch.bfloat16 and available() and isa() in ("amx", "avx512bf16")


def require() -> None:
    """Return when the extension is loaded (loading it on the first call); raise RuntimeError
    naming why it is unavailable otherwise. Called before each op: a dictionary lookup once
    loaded, nothing under torch.compile's tracing (the ops were loaded to get there)."""
    if _state["module"] is not None or torch.compiler.is_compiling():
        return
    if _load() is None:
        raise RuntimeError(f"kvmesh native kernels unavailable: {_state['reason']}")


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_data: torch.Tensor, scales: torch.Tensor | None,
                      slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' K and V into a paged cache, in place (``torch.ops.kvmesh.reshape_and_cache``).

    Args:
        k, v: ``[T, KVH, D]``, any float dtype, any strides.
        kv_data: ``[2, NB, BS, KVH, D]`` contiguous (``KVCache.data``): float32 / bfloat16 /
            float16, or int8 / float8_e4m3fn.
        scales: ``[2, NB, KVH]`` float32 contiguous (``KVCache.scales``) for a quantized cache,
            else None. Updated in place.
        slot_mapping: ``[T]`` int64, slot = block * BS + offset; negative slots are skipped
            (padding).

    A float cache receives ``k.to(dtype)``. A quantized cache is requantized per touched block
    exactly as ``workers.kv_cache.KVCache.write`` does (same float32 operations, bit-identical
    bytes and scales; a block whose slot 0 is written starts over). The requantization has
    scalar and avx2 code; the levels above avx2 run the avx2 code.

    Raises RuntimeError on shape / dtype mismatches or a slot beyond the cache.
    """
    require()
    torch.ops.kvmesh.reshape_and_cache(k, v, kv_data, scales, slot_mapping)


def paged_attention(q: torch.Tensor, kv_data: torch.Tensor, scales: torch.Tensor | None,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, prefix_group: torch.Tensor | None = None,
                    prefix_block_tables: torch.Tensor | None = None,
                    prefix_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a batch of query chunks over a paged KV cache
    (``torch.ops.kvmesh.paged_attention``).

    Args:
        q: ``[T, H, D]`` float32 / bfloat16 / float16 (D contiguous; D a multiple of 8).
        kv_data, scales: the cache as in :func:`reshape_and_cache` (int8 / fp8 dequantized in
            the kernel with the per-(block, head) scales).
        query_start_loc: ``[S+1]`` int32; sequence ``s`` owns query rows
            ``[qsl[s], qsl[s+1])`` (``n_s`` rows; decode: 1, prefill or verify chunk: more).
        seq_lens: ``[S]`` int32, keys of ``s`` in its own blocks, its new tokens included
            (already written). Query ``j`` of ``s`` sees own keys ``[0, seq_lens[s] - n_s + j]``.
        block_tables: ``[S, W]`` int32 block ids (only the first ``ceil(seq_lens/BS)`` read).
        scale: softmax scale (usually ``D ** -0.5``).
        prefix_group: ``[S]`` int32 or None; ``g >= 0``: sequence ``s``'s keys are the
            ``prefix_lens[g]`` tokens of ``prefix_block_tables[g]`` followed by its own keys
            (all prefix keys visible to all its queries); -1: no shared prefix.
        prefix_block_tables: ``[NG, P]`` int32; prefix_lens: ``[NG]`` int32.

    Returns:
        ``[T, H, D]`` in q's dtype (rows outside ``[qsl[0], qsl[S])`` are zero).

    Algorithm: FlashAttention-2 online softmax over cache blocks (fp32 accumulation); the H/KVH
    query heads of a KV head (GQA), and for a cascade group all members' queries, are rows of
    one work item so each K/V block is loaded once for all of them; long key ranges are split
    (flash decoding) and partial results merged by log-sum-exp, as is a group's shared prefix
    with each member's own part (FlashInfer cascade attention, Ye et al. 2024). Every level
    has its own kernel; a head dim that is not a multiple of 32 runs avx512's at avx512bf16 and
    amx, one not a multiple of 16 avx2's at avx512 and above.

    Raises RuntimeError on a dtype / shape mismatch, a block id outside the cache, a table too
    narrow for its length, or ``n_s > seq_lens[s]``.
    """
    require()
    return torch.ops.kvmesh.paged_attention(q, kv_data, scales, query_start_loc, seq_lens, block_tables, scale,
                                            prefix_group, prefix_block_tables, prefix_lens)


def _register_fakes() -> None:
    """Fake (meta) kernels of every op (these and :mod:`workers.kernels.gemm`'s) so that
    torch.compile traces them as opaque calls."""
    @torch.library.register_fake("kvmesh::reshape_and_cache")
    def _(k, v, kv_data, scales, slot_mapping):
        return None

    @torch.library.register_fake("kvmesh::rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("kvmesh::add_rms_norm")
    def _(x, residual, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("kvmesh::rotary_bf16")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("kvmesh::silu_and_mul_bf16")
    def _(x):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("kvmesh::pack_bf16_weight")
    def _(w):
        n, k = w.shape
        return w.new_empty(((n + 15) // 16, (k + 31) // 32 * 16, 16, 2), dtype=torch.bfloat16)

    @torch.library.register_fake("kvmesh::bf16_linear")
    def _(x, packed, n, bias=None):
        torch._check(x.dim() == 2, lambda: "bf16_linear: x must be [M, K]")
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kvmesh::int4_linear")
    def _(x, panels, sz, group_size, n, input_scale=None):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kvmesh::int8_linear")
    def _(x, panels, scales, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kvmesh::gguf_linear")
    def _(x, qweight, scales, superscales, bits, group_size, n, bias=None):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kvmesh::paged_attention")
    def _(q, kv_data, scales, query_start_loc, seq_lens, block_tables, scale, prefix_group=None,
          prefix_block_tables=None, prefix_lens=None):
        return q.new_empty(q.shape)
