"""Weight formats of :class:`workers.layers.linear.Linear`: quantize, dequantize and matmul.

Every format stores a weight ``W: [N, K]`` (``N`` = out_features, ``K`` = in_features) as
integers or fp8 plus float32 scales; ``quantize(w, fmt)`` returns the *canonical* tensors (what
is saved to disk, device independent) and ``to_runtime`` turns them into what the kernels of a
device want (e.g. the CPU int4 kernel's packed layout, bf16 scales).

======================  ==============================================  =====================================
format                  stored (canonical)                              matmul
======================  ==============================================  =====================================
``int8``                qweight int8 [N, K], scales fp32 [N]             CPU ``_weight_int8pack_mm`` (bf16 x);
                        (symmetric, per output channel)                  else x @ q.T * scale
``int4``                qweight uint8 [N, K/2] (two per byte, element     CPU ``_weight_int4pack_mm_for_cpu``,
                        2j in the high nibble), scales, zeros fp32        CUDA ``_weight_int4pack_mm`` (bf16 x);
                        [N, K/g] (asymmetric, group g along K)            else dequantize then matmul
``fp8``                 qweight float8_e4m3fn [N, K], scales fp32 [N]     CUDA (sm89+) ``_scaled_mm`` with x
                        (per output channel, clamped to ±448)             quantized per token to e4m3 (W8A8-FP8);
                                                                          else x @ q.T * scale (weight-only)
``w8a8-int8``           as ``int8``                                       ``torch._int_mm`` on int8 x quantized
                                                                          per token (dynamic, symmetric)
======================  ==============================================  =====================================

int4 convention (the one of gpt-fast/torchao, verified against :func:`dequantize_int4` by
experiment): ``w = (q - 8) * scale + zero`` with ``q`` in [0, 15] and
``zero = min + 8 * scale``, ``scale = (max - min) / 15`` of the group. The kernels take
``scales_and_zeros: [K/g, N, 2]`` (``[..., 0]`` scale, ``[..., 1]`` zero).

Kernel constraints (torch 2.13; figures: docs/quantization.md, "Weight formats"):
``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` need x and scales of one dtype, and
are far slower with float32 x than with bf16 x, so x goes through bf16.
The CPU int4 packing needs ``N % 16 == 0`` (rows are zero-padded, the output sliced).
``_int_mm`` works for every M on CPU; CUDA needs M > 16 and K, N multiples of 8 (x is padded to
17 rows; other shapes use the same integer math in float32). ``_scaled_mm`` runs on CPU but
measured slower than dequantizing e4m3 (the CPU has no fp8 arithmetic; same place), so on CPU
fp8 is a memory format only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0               # largest finite float8_e4m3fn
INT4_CPU_N_ALIGN = 16         # _convert_weight_to_int4pack_for_cpu: N % 16 == 0
CUDA_INT4_INNER_K_TILES = 8   # gpt-fast's choice; needs K % (8 * 16) == 0
_EPS = 1e-8


# ---- quantize / dequantize (canonical, float32 math, any device) -------------------------------

def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric per-output-channel int8: ``w ≈ q * scale``. w: [N, K] float →
    ``{"qweight": int8 [N, K], "scales": fp32 [N]}`` (q in [-127, 127])."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=_EPS) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"qweight": q, "scales": scales}


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] float32."""
    return qweight.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Asymmetric group-wise int4 (groups of ``group_size`` along K). w: [N, K] float with
    ``K % group_size == 0`` → ``{"qweight": uint8 [N, K/2], "scales": fp32 [N, K/g],
    "zeros": fp32 [N, K/g]}``; ``w ≈ (q - 8) * scale + zero``.
    Raises ValueError when K is not a multiple of group_size (callers pad, see Linear)."""
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4: in_features {K} is not a multiple of the group size {group_size}")
    g = w.float().reshape(N, K // group_size, group_size)
    wmin, wmax = torch.aminmax(g, dim=-1)
    scales = (wmax - wmin).clamp(min=1e-6) / 15.0
    zeros = wmin + 8.0 * scales
    q = torch.round((g - wmin[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8).reshape(N, K)
    return {"qweight": pack_int4(q), "scales": scales, "zeros": zeros}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] → uint8 [N, K/2]: element 2j in the high nibble, 2j+1 in
    the low one (the input layout of CUDA's ``_convert_weight_to_int4pack``)."""
    return (q[:, ::2] << 4) | q[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [N, K/2] → uint8 [N, K]."""
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Canonical int4 tensors → [N, K] float32."""
    q = unpack_int4(qweight).float()
    N, K = q.shape
    g = K // scales.shape[1]
    w = (q.reshape(N, -1, g) - 8.0) * scales[..., None].float() + zeros[..., None].float()
    return w.reshape(N, K)


def quantize_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-output-channel e4m3: ``w ≈ q * scale`` with ``scale = amax / 448``; values are
    clamped to ±448 before the cast (e4m3fn has no inf: an overflow would become NaN).
    → ``{"qweight": float8_e4m3fn [N, K], "scales": fp32 [N]}``."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=_EPS) / FP8_MAX
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"qweight": q, "scales": scales}


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales.float()[:, None]


def quantize(w: torch.Tensor, fmt: str, group_size: int = 128) -> dict[str, torch.Tensor]:
    """Canonical tensors of ``w`` ([N, K]) in format ``fmt`` (``w8a8-int8`` stores as ``int8``)."""
    if fmt in ("int8", "w8a8-int8"):
        return quantize_int8(w)
    if fmt == "int4":
        return quantize_int4(w, group_size)
    if fmt == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"no quantized weight format {fmt!r}")


def dequantize(fmt: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Canonical tensors → [N, K] float32 (K padded for int4)."""
    if fmt in ("int8", "w8a8-int8"):
        return dequantize_int8(t["qweight"], t["scales"])
    if fmt == "int4":
        return dequantize_int4(t["qweight"], t["scales"], t["zeros"])
    if fmt == "fp8":
        return dequantize_fp8(t["qweight"], t["scales"])
    raise ValueError(f"no quantized weight format {fmt!r}")


# ---- runtime layout -----------------------------------------------------------------------------

def _cuda_int4_ok(n: int, k: int) -> bool:
    return n % 8 == 0 and k % (CUDA_INT4_INNER_K_TILES * 16) == 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t in memory aligned to 64 bytes: tensors read from safetensors files can sit at any
    offset, and ``_weight_int8pack_mm`` segfaulted on a weight at an address = 8 mod 64."""
    return t if t.data_ptr() % 64 == 0 and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def to_runtime(fmt: str, t: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Canonical tensors (CPU) → the tensors the matmul of ``fmt`` uses on ``device``.

    int8 on CPU: scales in bf16 (the kernel wants x's dtype, and x goes through bf16); where the
    native kernels run (AVX512-BF16), ``int8_panels`` / ``int8_panel_scales`` of
    :func:`workers.kernels.gemm.pack_int8_panels` instead.
    int4 on CPU: ``packed`` = ``_convert_weight_to_int4pack_for_cpu`` of the rows padded to a
    multiple of 16, ``scales_and_zeros`` bf16 [K/g, N_pad, 2], or, where the native int4 kernel
    runs (AVX512-BF16), ``int4_panels`` / ``int4_panel_sz`` of
    :func:`workers.kernels.gemm.pack_int4_panels` instead; on CUDA the CUDA packing when
    the shape allows (``N % 8 == 0``, ``K % 128 == 0``), else the canonical tensors
    (dequantize fallback)."""
    device = torch.device(device)
    if fmt == "int8" and device.type == "cpu":
        from workers.kernels import gemm
        if gemm.int4_available():
            panels, scales = gemm.pack_int8_panels(t["qweight"], t["scales"])
            return {"int8_panels": panels, "int8_panel_scales": scales}
    if fmt in ("int8", "w8a8-int8", "fp8"):
        out = {"qweight": _aligned(t["qweight"].to(device)), "scales": _aligned(t["scales"].float().to(device))}
        if fmt == "int8" and device.type == "cpu":
            out["scales"] = _aligned(out["scales"].to(torch.bfloat16))
        return out
    if fmt == "int4":
        q, scales, zeros = t["qweight"], t["scales"].float(), t["zeros"].float()
        N, K = q.shape[0], q.shape[1] * 2
        if device.type == "cpu" or (device.type == "cuda" and _cuda_int4_ok(N, K)):
            pad = (-N) % INT4_CPU_N_ALIGN if device.type == "cpu" else 0
            sz = torch.stack([scales, zeros], dim=-1)                           # [N, K/g, 2]
            if pad:
                q = F.pad(q, (0, 0, 0, pad), value=0x88)                        # (8-8)*1+0 = 0
                sz = torch.cat([sz, torch.tensor([1.0, 0.0]).expand(pad, sz.shape[1], 2)], dim=0)
            sz = sz.transpose(0, 1).contiguous().to(torch.bfloat16).to(device)  # [K/g, N_pad, 2]
            if device.type != "cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack(q.to(device), CUDA_INT4_INNER_K_TILES)
                return {"packed": packed, "scales_and_zeros": sz}
            from workers.kernels import gemm
            if gemm.int4_available() and K % (16 * scales.shape[1]) == 0:
                panels, psz = gemm.pack_int4_panels(unpack_int4(t["qweight"]), scales, zeros, K // scales.shape[1])
                return {"int4_panels": panels, "int4_panel_sz": psz}
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q).to(torch.int32), 1)
            return {"packed": packed, "scales_and_zeros": sz}
        return {"qweight": q.to(device), "scales": scales.to(device), "zeros": zeros.to(device)}
    raise ValueError(f"no quantized weight format {fmt!r}")


# ---- matmuls: x [T, K] → [T, N] in x's dtype ---------------------------------------------------

def int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight-only int8. qweight int8 [N, K]; scales [N] (bf16 on CPU, else float32)."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales).to(x.dtype)
    return (F.linear(x, qweight.to(x.dtype)) * scales.to(x.dtype))


def int4_packed_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                   out_features: int) -> torch.Tensor:
    """Weight-only int4 through the CPU or CUDA kernel, with the ``packed`` and
    ``scales_and_zeros`` (bf16 ``[K_pad/g, N_pad, 2]``) tensors of :func:`to_runtime`; x's K is
    zero-padded to the stored (group-aligned) ``K_pad``, the output sliced to ``out_features``."""
    k_pad = scales_and_zeros.shape[0] * group_size
    xb = x.to(torch.bfloat16)
    if xb.shape[-1] != k_pad:
        xb = F.pad(xb, (0, k_pad - xb.shape[-1]))
    if x.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group_size, scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm(xb, packed, group_size, scales_and_zeros)
    return y[:, :out_features].to(x.dtype)


def int4_dequantized_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor) -> torch.Tensor:
    """Weight-only int4 from the canonical tensors (a CUDA shape the kernel does not take):
    dequantized (K cut to x's), then a matmul in x's dtype."""
    w = dequantize_int4(qweight, scales, zeros)[:, : x.shape[-1]]
    return F.linear(x, w.to(x.dtype))


_scaled_mm_devices: dict[str, bool] = {}


def _scaled_mm_ok(x: torch.Tensor, n: int) -> bool:
    """W8A8-FP8 through ``_scaled_mm`` only on CUDA GPUs with fp8 tensor cores (sm89+)."""
    if x.device.type != "cuda" or x.shape[-1] % 16 or n % 16:
        return False
    key = str(x.device)
    if key not in _scaled_mm_devices:
        _scaled_mm_devices[key] = torch.cuda.get_device_capability(x.device) >= (8, 9)
    return _scaled_mm_devices[key]


def fp8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 weights. qweight float8_e4m3fn [N, K]; scales fp32 [N]. On sm89+ CUDA: x quantized
    per token to e4m3 (``scale = amax / 448``) and ``torch._scaled_mm`` (W8A8-FP8); elsewhere
    the weight is dequantized to x's dtype (weight-only)."""
    if _scaled_mm_ok(x, qweight.shape[0]):
        xf = x.float()
        sx = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=_EPS) / FP8_MAX
        xq = (xf / sx).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, qweight.t(), scale_a=sx, scale_b=scales[None, :].float(),
                             out_dtype=torch.bfloat16)
        return y.to(x.dtype)
    return F.linear(x, qweight.to(x.dtype)) * scales.to(x.dtype)


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token int8: x [T, K] → (int8 [T, K], fp32 scales [T, 1])."""
    xf = x.float()
    sx = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=_EPS) / 127.0
    return torch.round(xf / sx).clamp_(-127, 127).to(torch.int8), sx


def w8a8_int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 x int8 → int32 through ``torch._int_mm``, rescaled by the token and channel scales.
    qweight int8 [N, K]; scales fp32 [N]."""
    xq, sx = quantize_activations_int8(x)
    T, K = xq.shape
    N = qweight.shape[0]
    if x.device.type == "cuda":
        if K % 8 or N % 8:
            acc = xq.float() @ qweight.float().t()       # the same sums, in float32
        else:
            xp = F.pad(xq, (0, 0, 0, 17 - T)) if T <= 16 else xq
            acc = torch._int_mm(xp, qweight.t())[:T].float()
    else:
        acc = torch._int_mm(xq, qweight.t()).float()
    return (acc * sx * scales[None, :]).to(x.dtype)
