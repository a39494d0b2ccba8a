"""Native CPU GEMM with bf16 weights: ``kvmesh::pack_bf16_weight`` and ``kvmesh::bf16_linear``.

Why: on CPUs without AVX512-BF16 / AMX (e.g. AMD Zen 3), ATen's bf16 matmul falls back to a
slow reference path, while fp32 weights cost twice the memory traffic (figures:
docs/engine.md, "Profile"). This kernel keeps the weights in bf16 and widens
them to fp32 in registers (a 16-bit shift), accumulating in fp32, so decode streams half the
bytes of fp32. On CPUs with AMX-BF16 (Sapphire Rapids and later) it multiplies bf16
activations of 4 rows or more with AMX tiles on the same packed panels and measured faster
than ATen's oneDNN matmul on unpacked weights at every M (docs/engine.md, "Attention
backends"), so bf16 Linears use it there too. The C++ (``workers/kernels/csrc/gemm/``) runs the
active kernel level's micro-kernels (every level has its own: scalar, AVX2+FMA, AVX-512,
``vdpbf16ps`` for bf16 activations at avx512bf16, AMX tiles at amx; :func:`workers.kernels.set_isa`,
the ``kernel_isa`` setting). Technique:
GotoBLAS / BLIS register and cache blocking (Goto & van de Geijn, TOMS 2008); weight layout:
the "VNNI-2" bf16 pair layout of oneDNN and SGLang's CPU kernels (also AMX's B-tile layout).

The sources are part of the one kvmesh extension that :mod:`workers.kernels` loads
(:mod:`workers.kernels.build` builds it); ``KVMESH_NATIVE_KERNELS=0`` disables it
(:func:`workers.kernels.available` is then False and the functions here raise RuntimeError).
:func:`workers.kernels.paths` says which path each op takes at the active level.

Ops (also reachable as ``torch.ops.kvmesh.*`` once the extension is loaded; all have fake
implementations, so ``torch.compile(fullgraph=True)`` treats them as opaque calls)::

    pack_bf16_weight(Tensor w) -> Tensor
    bf16_linear(Tensor x, Tensor packed, int N, Tensor? bias=None) -> Tensor
    int4_linear, int8_linear, gguf_linear, gguf_pack_qweight, gguf_unpack (below)
"""

from __future__ import annotations

import torch

from workers import kernels


def pack_bf16_weight(w: torch.Tensor) -> torch.Tensor:
    """Pack a Linear weight for :func:`bf16_linear`.

    Args:
        w: ``[N, K]`` (out, in) floating CPU tensor, any float dtype.
    Returns:
        bf16 ``[ceil(N/16), ceil(K/2), 16, 2]``: ``packed[p, t, c, j] = bf16(w[16p+c, 2t+j])``
        (round to nearest even), zero padding; ``N`` is not stored, pass it to bf16_linear.
    Raises:
        RuntimeError: kernels unavailable, or ``w`` not 2-D floating / empty.
    """
    kernels.require()
    return torch.ops.kvmesh.pack_bf16_weight(w)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with W packed by :func:`pack_bf16_weight`; fp32 accumulation.

    Args:
        x: ``[..., K]`` float32 or bfloat16 (leading dims are flattened for the op, which takes
            ``[M, K]``).
        packed: from ``pack_bf16_weight(W [n, K])``.
        n: output features (``W.shape[0]``).
        bias: ``[n]`` any float dtype, or None.
    Returns:
        ``[..., n]`` in x's dtype.
    Raises:
        RuntimeError: kernels unavailable; shape/dtype mismatch (message names both).
    Path: the active level's micro-kernels, every level has its own (fp32 x at avx512bf16 and
    amx: avx512's; bf16 x of fewer than 4 rows at amx: avx512bf16's).
    """
    kernels.require()
    if x.dim() == 2:      # the decode path: no reshapes (each costs ~1 us of Python)
        return torch.ops.kvmesh.bf16_linear.default(x, packed, n, bias)
    lead = x.shape[:-1]
    y = torch.ops.kvmesh.bf16_linear.default(x.reshape(-1, x.shape[-1]), packed, n, bias)
    return y.reshape(*lead, n)


def int4_available() -> bool:
    """True when :func:`int4_linear` and :func:`int8_linear` run here: the kernels are loaded
    and the active level has their path (avx512bf16 and amx; :func:`workers.kernels.paths`)."""
    return kernels.path("int4_linear") != "none"


def pack_int4_panels(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of :func:`int4_linear` from the canonical int4 tensors
    (``W = (q - 8) * scale + zero`` per group of ``group_size`` along K,
    :func:`workers.layers.quant.quantize_int4`).

    Args:
        q: uint8 ``[N, K]`` values in [0, 15] (unpacked).
        scales, zeros: float ``[N, K / group_size]``.
        group_size: a multiple of 16 dividing K (the kernel sums x over groups 16 at a time).
    Returns:
        ``(panels uint8 [N16 / 16, 8 K], scales_and_zeros bfloat16 [N16 / 16, K / g, 2, 16])``
        with N16 = N rounded up to 16 (padding columns: q = 8, scale 1, zero 0, i.e. W = 0).
        Panel p, k-octet o: 32 little-endian 16-bit lanes, lane ``2n + j`` holding
        ``q[16p + n, 8o + 2s + j]`` in bits ``4s .. 4s + 3`` (s = 0..3).
    Raises:
        ValueError: shapes that do not fit that layout.
    """
    n, k = q.shape
    if group_size % 16 or k % group_size or scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"int4 panels: q {tuple(q.shape)}, scales {tuple(scales.shape)}, zeros "
                         f"{tuple(zeros.shape)}, group size {group_size}: K must be a multiple of the group "
                         f"size, itself a multiple of 16, and scales/zeros [N, K / group]")
    pad = (-n) % 16
    q = q.to(torch.int16)
    scales, zeros = scales.float(), zeros.float()
    if pad:
        q = torch.cat([q, q.new_full((pad, k), 8)])
        scales = torch.cat([scales, scales.new_ones(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    np_ = (n + pad) // 16
    qb = q.view(np_, 16, k // 8, 4, 2).permute(0, 2, 1, 4, 3)          # [p, o, n, j, s]
    lanes = qb[..., 0] | (qb[..., 1] << 4) | (qb[..., 2] << 8) | (qb[..., 3] << 12)     # int16 [p, o, n, j]
    panels = lanes.contiguous().view(torch.uint8).reshape(np_, 8 * k)
    sz = torch.stack([scales, zeros], dim=-1).view(np_, 16, k // group_size, 2).permute(0, 2, 3, 1)
    return panels, sz.to(torch.bfloat16).contiguous()


def int4_linear(x: torch.Tensor, panels: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                n: int, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for int4 weights packed by :func:`pack_int4_panels`: per 16 output columns and
    group, ``vdpbf16ps`` of x with ``128 + q`` (exact in bfloat16), then
    ``* scale + (zero - 136 scale) * sum(x)`` in float32 (the group-wise form of
    ``(q - 8) * scale + zero``).

    Args:
        x: bfloat16 ``[M, K]``.
        input_scale: bfloat16 ``[K]`` or None: x is first multiplied by it, rounded to bfloat16
            (bit-identical to ``x * input_scale`` in PyTorch).
        n: output features (<= the panels' padded N).
    Returns:
        bfloat16 ``[M, n]`` (a view of ``[M, N16]`` when n is not a multiple of 16).
    Raises:
        RuntimeError: kernels unavailable, the active level is below avx512bf16 (the one level
            this kernel has; amx runs it too: :func:`int4_available`), or shapes mismatch.
    """
    kernels.require()
    return torch.ops.kvmesh.int4_linear.default(x, panels, scales_and_zeros, group_size, n, input_scale)


def pack_int8_panels(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of :func:`int8_linear` from the canonical int8 tensors (``W = q * scale`` per
    output column, :func:`workers.layers.quant.quantize_int8`).

    Args:
        qweight: int8 ``[N, K]``.
        scales: float ``[N]``.
    Returns:
        ``(panels int8 [N16 / 16, 16 K], scales bfloat16 [N16])``, N16 = N rounded up to 16
        (padding columns: q = 0); panel p holds ``q[16p + c, k]`` at ``16 k + c``.
    """
    n, k = qweight.shape
    pad = (-n) % 16
    q = torch.cat([qweight, qweight.new_zeros(pad, k)]) if pad else qweight
    s = torch.cat([scales.float(), scales.new_ones(pad).float()]) if pad else scales.float()
    panels = q.view((n + pad) // 16, 16, k).transpose(1, 2).contiguous().view((n + pad) // 16, 16 * k)
    return panels, s.to(torch.bfloat16).contiguous()


def int8_linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """``(x @ q.T) * scale`` for int8 weights packed by :func:`pack_int8_panels` (float32 sums of
    x times the exact weights, then the column scale).

    Args:
        x: bfloat16 ``[M, K]``.
        n: output features (<= the panels' padded N).
    Returns:
        bfloat16 ``[M, n]``.
    Raises:
        RuntimeError: kernels unavailable, the active level is below avx512bf16 (the one level
            this kernel has; amx runs it too: :func:`int4_available`), or shapes mismatch.
    """
    kernels.require()
    return torch.ops.kvmesh.int8_linear.default(x, panels, scales, n)


# ---- GGUF block formats (csrc/gemm/gguf_gemm.cpp) -------------------------------------------------

def gguf_available() -> bool:
    """True when :func:`gguf_linear` runs here: the kernels are loaded (every level has a path)."""
    return kernels.path("gguf_linear") != "none"


def gguf_unpack(raw: torch.Tensor, ggml_type: str, k: int):
    """One GGUF tensor's blocks decoded in one native pass (``kvmesh::gguf_unpack``,
    csrc/gemm/gguf_unpack.cpp): the numbers of :func:`workers.quant.gguf_blocks.unpack_torch`.

    Args:
        raw: uint8 ``[N, row bytes]`` (the file's rows), on the CPU.
        ggml_type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K.
        k: values per row (a multiple of the block's values).
    Returns:
        ``(q, a, b, d, dmin)``: q uint8 ``[N, K]``; flat formats: a, b = s, z float32 ``[N, K / 32]``,
        d, dmin None; k-quants: a, b = sc, m int8 ``[N, K / G]``, d, dmin float32 ``[N, K / 256]``.
    Raises:
        RuntimeError: kernels unavailable, an unsupported type or a byte count that does not fit.
    """
    kernels.require()
    return torch.ops.kvmesh.gguf_unpack(raw, ggml_type, k)


def pack_gguf_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The weight panels of :func:`gguf_linear` from unsigned integers ``q``.

    Args:
        q: uint8 ``[N, K]`` (K a multiple of 8), values below ``2 ** bits``.
        bits: 4, 6 or 8 (lane width).
    Returns:
        uint8 ``[P, 2 * bits * K]`` (P = ceil(N / 16); padding columns 0): per panel, chunks
        along k; bits 4: 64-byte chunk c, byte ``4 n + j`` = ``q[n][8c + j] | q[n][8c + 4 + j] << 4``;
        bits 6: the same 64 bytes of low nibbles, then 32 bytes of the high 2 bits (operand
        ``o``'s byte ``i = 16 l + b`` in bits ``2l, 2l+1`` of byte ``64 + 16 o + b``);
        bits 8: 64-byte chunk c, byte ``4 n + j`` = ``q[n][4c + j]`` (csrc/gemm/gguf_gemm.cpp).
    Raises:
        ValueError: bad bits, K or dtype.
    """
    n, k = q.shape
    if bits not in (4, 6, 8) or k % 8 or q.dtype != torch.uint8:
        raise ValueError(f"pack_gguf_qweight: q must be uint8 [N, K] with K % 8 == 0 and bits 4, 6 or 8; got "
                         f"{q.dtype} {tuple(q.shape)}, bits {bits}")
    if q.device.type == "cpu" and kernels.available():
        return torch.ops.kvmesh.gguf_pack_qweight(q, bits)         # one pass, threads over panels
    return pack_gguf_qweight_torch(q, bits)


def pack_gguf_qweight_torch(q: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_gguf_qweight` in PyTorch tensor ops (the reference of the C++ packing, and
    the path where the kernels are not built)."""
    n, k = q.shape
    pad = (-n) % 16
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
    p = (n + pad) // 16
    if bits == 8:
        return q.view(p, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(p, 16 * k)
    qc = q.view(p, 16, k // 8, 2, 4).permute(0, 2, 1, 3, 4)           # [p, c, n, o, j]
    lo = qc & 0x0F
    nib = (lo[..., 0, :] | (lo[..., 1, :] << 4)).reshape(p, k // 8, 64)
    if bits == 4:
        return nib.contiguous().view(p, 8 * k)
    hi = (qc >> 4).permute(0, 1, 3, 2, 4).reshape(p, k // 8, 2, 4, 16)  # [p, c, o, l, b]: operand byte 16 l + b
    hb = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)     # [p, c, o, b]
    return torch.cat([nib, hb.reshape(p, k // 8, 32)], dim=2).contiguous().view(p, 12 * k)


def pack_gguf_scales(a: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Per-group (or per-super-block) pairs of :func:`gguf_linear`: ``a``, ``b`` ``[N, G']`` →
    ``dtype`` ``[P, G', 2, 16]`` (``[p, g, 0, n] = a[16p + n, g]``, ``[p, g, 1, n] = b[...]``;
    padding columns 0); ``b`` None (a k-quant weight with m = sc, dmin = 32 d) →
    ``[P, G', 1, 16]``. Raises ValueError when ``dtype`` cannot hold a value exactly (the
    scales are the file's own float16 numbers, or small integers)."""
    n, g = a.shape
    pad = (-n) % 16
    t = torch.stack([a] if b is None else [a, b], dim=1)        # [N, S, G']
    if pad:
        t = torch.cat([t, t.new_zeros(pad, t.shape[1], g)])
    out = t.view(-1, 16, t.shape[1], g).permute(0, 3, 2, 1).to(dtype).contiguous()
    if not torch.equal(out.to(t.dtype), t.view(-1, 16, t.shape[1], g).permute(0, 3, 2, 1)):
        raise ValueError(f"a GGUF scale is not exactly representable in {dtype}")
    return out


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, superscales: torch.Tensor | None,
                bits: int, group_size: int, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for a GGUF weight in the panels of :func:`pack_gguf_qweight` and
    :func:`pack_gguf_scales`: ``w = s q + z`` per group of ``group_size`` (16 or 32) along K,
    (s, z) float16 in ``scales`` (flat scheme, ``superscales`` None) or ``s = d sc``,
    ``z = -dmin m`` with int8 (sc, m) in ``scales`` and float16 (d, dmin) per super-block in
    ``superscales`` (k-quant scheme; both with a third dimension of 1 for m = sc, dmin = 32 d). x is quantized to int8 per 32 values (flat) or per
    super-block (k-quant; as llama.cpp's q8_0 / q8_K), round half to even of
    ``x * 127 / amax``; the dot products are exact int32, then scaled in float32
    (:func:`workers.kernels.reference.gguf_linear_ref` is the same in PyTorch).

    Args:
        x: ``[..., K]`` float32 or bfloat16, K a multiple of 32.
        bias: ``[n]`` (any float dtype), added in float32 before the output's rounding; or None.
    Returns:
        ``[..., n]`` in x's dtype.
    Raises:
        RuntimeError: kernels unavailable; shapes or dtypes that do not fit (the message
            names the argument).

    Path (:func:`workers.kernels.paths`, by the active level): ``amx`` (bfloat16 x of 32 rows or
    more: the panels dequantized to bfloat16 and AMX-BF16 tiles; float32 x of 32 rows or more:
    AMX-INT8 tiles; fewer rows: avx512vnni's), ``avx512vnni`` at avx512 and avx512bf16 (and at
    amx on a CPU without AMX-INT8), ``avx2`` (also at avx512 on a CPU without AVX512-VNNI),
    ``scalar``.
    """
    kernels.require()
    if x.dim() == 2:
        return torch.ops.kvmesh.gguf_linear.default(x, qweight, scales, superscales, bits, group_size, n, bias)
    lead = x.shape[:-1]
    y = torch.ops.kvmesh.gguf_linear.default(x.reshape(-1, x.shape[-1]), qweight, scales, superscales, bits,
                                             group_size, n, bias)
    return y.reshape(*lead, n)
