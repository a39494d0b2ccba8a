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

Instruction set: one build carries a scalar, an AVX2+FMA+F16C, an AVX-512F, an AVX-512F +
AVX512-BF16 and an AMX attention path (each translation unit compiled with ``#pragma GCC
target``; avx512bf16 computes q K^T of a bfloat16 cache with ``vdpbf16ps``, and work items of
at least 9 query rows of a bfloat16 q (prefill and verify chunks, cascade groups) run the flash
path of ``csrc/attn_flash.h`` with ``vdpbf16ps`` register tiles, items of at most 8 such rows
over a bfloat16, int8 or fp8 cache the decode pass of ``csrc/attn_decode.h``, all KV heads of a key range
at once; amx runs the flash path on AMX-BF16 tiles, ``csrc/attn_amx.h``); the best one the CPU supports is
chosen at run time (``__builtin_cpu_supports``, CPUID and the kernel's permission for the tile
state). ``KVMESH_KERNEL_ISA=scalar|avx2|avx512|avx512bf16|amx`` selects a lower path (a path
above what the CPU has is lowered to it; the GEMM reads the same variable); :func:`set_isa`
does the same at run time. :func:`isa` names the path in use. :func:`prefill_in_kernel` says
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
"""

from __future__ import annotations

import logging
import os
import platform
import threading

import torch

from kvmesh.core.errors import DependencyUnavailableError

log = logging.getLogger("kvmesh.kernels")

_lock = threading.Lock()
_state: dict = {"tried": False, "module": None, "reason": None}


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
        want = os.environ.get("KVMESH_KERNEL_ISA", "auto")
        try:
            got = _state["module"].set_isa(want)
        except RuntimeError:
            got = _state["module"].set_isa("auto")
            log.warning("kvmesh: unknown KVMESH_KERNEL_ISA=%s (scalar, avx2, avx512, avx512bf16, amx or auto); using %s",
                        want, got)
        else:
            if want not in ("auto", "", got):
                log.warning("kvmesh: KVMESH_KERNEL_ISA=%s is not supported by this CPU; using %s", want, got)
        return _state["module"]


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
    """The kernel path in use: ``"amx"``, ``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or
    ``"scalar"``; ``"none"`` when the extension is unavailable."""
    m = _load()
    return m.active_isa() if m is not None else "none"


def cpu_isa() -> str:
    """The best path this CPU supports (``"none"`` when the extension is unavailable)."""
    m = _load()
    return m.cpu_isa() if m is not None else "none"


def set_isa(name: str) -> str:
    """Select the kernel path (``"scalar"``, ``"avx2"``, ``"avx512"``, ``"avx512bf16"``,
    ``"amx"`` or ``"auto"``) for this
    process; one above :func:`cpu_isa` is lowered to it. Returns the path now in use. Raises
    RuntimeError when the extension is unavailable or the name is unknown."""
    m = _load()
    if m is None:
        raise RuntimeError(f"kvmesh native kernels unavailable: {_state['reason']}")
    return m.set_isa(name)


def prefill_in_kernel(dtype: torch.dtype) -> bool:
    """Whether prefill chunks of a ``dtype`` model over a cache of the same dtype are faster
    through ``paged_attention`` than through SDPA: for bfloat16 on the two flash paths
    (``csrc/attn_flash.h``): ``amx`` (a 1,500-token SmolLM2 prompt, 2 threads, Xeon with AMX:
    4.8 ms per layer against 9.4 ms for ATen's flash attention) and ``avx512bf16`` (the same
    prompt on one thread of an AMD EPYC Zen 5, CPU time: 8.2 ms per layer against 41.7 ms for
    SDPA; ``python -m bench.kernels --threads 1 --cpu-time``). Elsewhere ATen's GEMM-shaped flash
    attention wins for chunks of ``SDPA_MIN_CHUNK_TOKENS`` tokens and more
    (workers/layers/attention.py)."""
    return dtype == torch.bfloat16 and available() and isa() in ("amx", "avx512bf16")


def _require():
    if torch.compiler.is_compiling():     # traced by torch.compile: the ops were loaded to get here
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
    bytes and scales; a block whose slot 0 is written starts over).

    Raises RuntimeError on shape / dtype mismatches or a slot beyond the cache.
    """
    _require()
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
    with each member's own part (FlashInfer cascade attention, Ye et al. 2024).

    Raises RuntimeError on a dtype / shape mismatch, a block id outside the cache, a table too
    narrow for its length, or ``n_s > seq_lens[s]``.
    """
    _require()
    return torch.ops.kvmesh.paged_attention(q, kv_data, scales, query_start_loc, seq_lens, block_tables, scale,
                                            prefix_group, prefix_block_tables, prefix_lens)


def _register_fakes() -> None:
    """Fake (meta) kernels so torch.compile traces the ops as opaque calls."""
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

    @torch.library.register_fake("kvmesh::paged_attention")
    def _(q, kv_data, scales, query_start_loc, seq_lens, block_tables, scale, prefix_group=None,
          prefix_block_tables=None, prefix_lens=None):
        return q.new_empty(q.shape)
