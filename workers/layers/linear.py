"""Linear layers: the one place weight formats live.

Model code builds every projection as a :class:`Linear` and never touches its weight
tensors directly. The loader copies checkpoint tensors in with :meth:`Linear.load_shard`
(several checkpoint tensors can be stacked into one layer, e.g. q/k/v into ``qkv_proj``),
then calls :meth:`Linear.finalize` once, which converts the weight to its serving format.
Quantized formats (``int8``, ``int4``, ``fp8``, ``w8a8-int8``; math in
:mod:`workers.layers.quant`) replace the dense weight with :meth:`Linear.set_quantized`; the
model code does not change (docs/quantization.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import gemm
from workers.layers import quant


class LinearMethod:
    """How a :class:`Linear` computes ``x @ W.T + b`` from its stored weight: one subclass per
    weight format and layout, chosen once when the layer gets its serving storage
    (:meth:`Linear.set_quantized`, :meth:`Linear.pack_bf16`; :class:`Dense` otherwise), so that
    ``Linear.forward`` does no format dispatch. Stateless: the tensors live on the layer, and
    one instance (:data:`DENSE`, ...) serves every layer of its format, so a compiled decoder
    layer (:mod:`workers.compiled_decode`) finds the same object in every layer.

    Attributes:
        format: the weight format, one of :data:`kvmesh.core.engine_config.WEIGHT_FORMATS`.
    """

    format = "none"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, in_features]`` → ``[T, out_features]`` in x's dtype."""
        raise NotImplementedError


class Dense(LinearMethod):
    """``weight`` ``[in_features, out_features]`` contiguous (after :meth:`Linear.finalize`):
    one ``addmm`` (``mm`` without bias)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.bias is not None:
            return torch.addmm(layer.bias, x, layer.weight)
        return torch.mm(x, layer.weight)


class DenseBF16Panels(LinearMethod):
    """bfloat16 weight in the panels of the native bf16 GEMM (``bf16_panels``,
    :meth:`Linear.pack_bf16`); the bias goes into the kernel."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        f = layer.fast
        if f is not None:
            return torch.ops.kvmesh.bf16_linear(x, *f)
        return torch.ops.kvmesh.bf16_linear(x, layer.bf16_panels, layer.out_features, layer.bias)


class DenseOneDNN(LinearMethod):
    """float32 weight prepacked for oneDNN's inner product (``onednn_weight``,
    :meth:`Linear.pack_onednn`), run by ``torch.ops.mkldnn._linear_pointwise``: oneDNN's JIT
    kernel for the CPU's ISA on torch's threads, in place of ATen's float32 ``mm``/``addmm``
    (MKL, which takes a generic code path on AMD CPUs); the bias goes into the op."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.onednn_weight, layer.bias, "none", [], "")


class Quantized(LinearMethod):
    """A quantized weight (:meth:`Linear.set_quantized`): x is multiplied by ``input_scale``
    first when the layer has one, then the format's :meth:`mm`, then the bias is added."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.input_scale is not None:
            x = x * layer.input_scale
        y = self.mm(layer, x)
        return y if layer.bias is None else y + layer.bias

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for the layer's runtime tensors (:func:`workers.layers.quant.to_runtime`)."""
        raise NotImplementedError


class Int8(Quantized):
    """Weight-only int8 (``qweight``, ``scales``)."""

    format = "int8"

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return quant.int8_mm(x, layer.qweight, layer.scales)


class NativeQuantized(Quantized):
    """A format with its own native kernel ``torch.ops.kvmesh.<op_name>``: the steps of a
    bfloat16 model call it once with the layer's bound arguments (:attr:`Linear.fast`: no
    reshapes, no buffer lookups; an input scale goes into the op); other inputs take
    :meth:`Quantized.apply` with the format's :meth:`mm`."""

    op_name = ""

    @functools.cached_property
    def op(self):
        return getattr(torch.ops.kvmesh, self.op_name).default

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        f = layer.fast
        if f is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == layer.fast_k:
            return self.op(x, *f)
        return super().apply(layer, x)


class Int8Native(NativeQuantized):
    """Weight-only int8 in the native kernel's panels (``int8_panels``, ``int8_panel_scales``;
    :func:`workers.kernels.gemm.int8_linear`), at kernel levels avx512bf16 and amx; x goes through
    bfloat16 as with ATen's int8 kernel (:class:`Int8`), which the lower levels use."""

    format, op_name = "int8", "int8_linear"

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = gemm.int8_linear(x.to(torch.bfloat16).reshape(-1, x.shape[-1]), layer.int8_panels,
                             layer.int8_panel_scales, layer.out_features)
        return y.reshape(*x.shape[:-1], layer.out_features).to(x.dtype)


class Int4Packed(Quantized):
    """Weight-only int4 in the CPU or CUDA kernel's packed layout (``packed``,
    ``scales_and_zeros``)."""

    format = "int4"

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return quant.int4_packed_mm(x, layer.packed, layer.scales_and_zeros, layer.group_size, layer.out_features)


class Int4Native(NativeQuantized):
    """Weight-only int4 in the native kernel's panels (``int4_panels``, ``int4_panel_sz``;
    :func:`workers.kernels.gemm.int4_linear`), at kernel levels avx512bf16 and amx: x goes through
    bfloat16 as with ATen's int4 kernel, which the lower levels use (:class:`Int4Packed`)."""

    format, op_name = "int4", "int4_linear"

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        k_pad = layer.int4_panels.shape[1] // 8
        if xb.shape[-1] != k_pad:
            xb = F.pad(xb, (0, k_pad - xb.shape[-1]))
        y = gemm.int4_linear(xb.reshape(-1, k_pad), layer.int4_panels, layer.int4_panel_sz, layer.group_size,
                             layer.out_features)
        return y.reshape(*x.shape[:-1], layer.out_features).to(x.dtype)


class Int4Dequantized(Quantized):
    """Weight-only int4 in canonical tensors (``qweight``, ``scales``, ``zeros``), dequantized
    at each call: a CUDA shape the kernel does not take."""

    format = "int4"

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return quant.int4_dequantized_mm(x, layer.qweight, layer.scales, layer.zeros)


class FP8(Quantized):
    """fp8 e4m3 weights (``qweight``, ``scales``)."""

    format = "fp8"

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return quant.fp8_mm(x, layer.qweight, layer.scales)


class W8A8Int8(Quantized):
    """int8 weights and per-token int8 activations (``qweight``, ``scales``)."""

    format = "w8a8-int8"

    def mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return quant.w8a8_int8_mm(x, layer.qweight, layer.scales)


class GGUFNative(LinearMethod):
    """GGUF block-quantized weight in the ``gguf_linear`` kernel's panels (``gguf_qweight``,
    ``gguf_scales``, ``gguf_superscales`` or None; :meth:`Linear.set_gguf`): activations
    quantized per 32 values to int8, integer dot products (:func:`workers.kernels.gemm.gguf_linear`);
    x float32 or bfloat16, y in x's dtype; the bias is added inside the op."""

    format = "gguf"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        f = layer.fast
        if f is not None and x.dim() == 2:
            return torch.ops.kvmesh.gguf_linear.default(x, *f)
        return gemm.gguf_linear(x, layer.gguf_qweight, layer.gguf_scales, layer.gguf_superscales, layer.gguf_bits,
                                layer.group_size, layer.out_features, layer.bias)


class GGUFDense(Dense):
    """A GGUF weight dequantized once to the serving dtype (:meth:`Linear.set_gguf` where the
    ``gguf_linear`` kernel does not run: no native kernels, a CUDA device): the reference
    path, dequantize + matmul."""

    format = "gguf"


DENSE, BF16_PANELS, ONEDNN = Dense(), DenseBF16Panels(), DenseOneDNN()
GGUF_NATIVE, GGUF_DENSE = GGUFNative(), GGUFDense()
_QUANTIZED = {m.format: m for m in (Int8(), FP8(), W8A8Int8())}
INT4_PACKED, INT4_NATIVE, INT4_DEQUANTIZED = Int4Packed(), Int4Native(), Int4Dequantized()
INT8_NATIVE = Int8Native()


def quantized_method(fmt: str, runtime: dict[str, torch.Tensor]) -> Quantized:
    """The method of a layer quantized to ``fmt`` with the tensors ``runtime`` of
    :func:`workers.layers.quant.to_runtime`. Raises ValueError for an unknown format."""
    if fmt == "int4":
        if "int4_panels" in runtime:
            return INT4_NATIVE
        return INT4_PACKED if "packed" in runtime else INT4_DEQUANTIZED
    if fmt == "int8" and "int8_panels" in runtime:
        return INT8_NATIVE
    if fmt not in _QUANTIZED:
        raise ValueError(f"no quantized weight format {fmt!r}")
    return _QUANTIZED[fmt]


class Linear(nn.Module):
    """``y = x @ W.T + b`` for a weight ``W`` of ``[out_features, in_features]``.

    Storage (``weight`` changes shape when the layer is finalized):

    - as built: ``weight`` ``[out_features, in_features]`` float32, the checkpoint's layout
      (:meth:`load_shard` writes rows of it); after :meth:`allocate` it is the
      ``[out_features, in_features]`` transposed view of ``[in_features, out_features]``
      contiguous storage of the serving dtype;
    - after :meth:`finalize` (dense): ``weight`` ``[in_features, out_features]`` contiguous of
      the serving dtype, so ``y = x @ weight + bias``;
    - after :meth:`pack_bf16`: ``weight`` None, ``bf16_panels`` the native GEMM's panels;
    - after :meth:`set_quantized`: ``weight`` None, the format's runtime tensors as buffers
      (:func:`workers.layers.quant.to_runtime`), optional ``input_scale`` ``[in_features]``.

    ``bias`` is ``[out_features]``. ``method`` (:class:`LinearMethod`) computes the product
    for the current storage; ``format`` is its weight format.

    Args:
        in_features, out_features: sizes (ints).
        bias: whether the layer has a bias ``[out_features]``.
        shards: names and row counts of checkpoint tensors stacked along dim 0, in order,
            e.g. ``{"q": 576, "k": 192, "v": 192}``; default one shard named ``""``.
        tp_dim, tp_parts: a tensor-parallel rank's part of each checkpoint tensor
            (:mod:`workers.tensor_parallel`): ``tp_parts[shard]`` is the ``[start, end)`` range it
            holds along ``tp_dim`` of the checkpoint's ``[out, in]`` weight, 0 (column-parallel:
            output rows, and the bias's) or 1 (row-parallel: input columns; no bias). None: whole
            tensors. The shard sizes (``shards``, ``in_features``) are then the parts' sizes.
        tp_full: the whole checkpoint shards' sizes along ``tp_dim`` (stacked in ``shards``'
            order), for tensors stored stacked (a quantized checkpoint: :meth:`tp_index`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, int] | None = None, tp_dim: int | None = None,
                 tp_parts: dict[str, tuple[int, int]] | None = None,
                 tp_full: dict[str, int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.shards = shards or {"": out_features}
        if sum(self.shards.values()) != out_features:
            raise ValueError(f"shards {self.shards} do not add up to {out_features} rows")
        if (tp_dim is None) != (tp_parts is None) or (tp_dim == 1 and bias):
            raise ValueError("tp_dim and tp_parts go together; a row-parallel layer (tp_dim 1) has no bias")
        self.tp_dim, self.tp_parts, self.tp_full = tp_dim, tp_parts, tp_full
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self._loaded: set[tuple[str, str]] = set()
        self.method: LinearMethod = DENSE
        self.group_size = 0
        self.register_buffer("input_scale", None)     # [in_features]: x * input_scale first
        self.register_buffer("bf16_panels", None)     # weight panels of the native bf16 GEMM (pack_bf16)
        self.onednn_weight: torch.Tensor | None = None  # float32 weight prepacked for oneDNN (pack_onednn)
        self._qnames: list[str] = []
        # the native kernel's arguments as a plain tuple (bind_fast_path): a decode step calls
        # ~120 Linears, and each read of a buffer through nn.Module.__getattr__ costs ~0.5 us
        self.fast: tuple | None = None
        self.fast_k = 0

    @property
    def format(self) -> str:
        """The weight format (``none`` for dense)."""
        return self.method.format

    def _rows(self, shard: str) -> slice:
        start = 0
        for name, n in self.shards.items():
            if name == shard:
                return slice(start, start + n)
            start += n
        raise KeyError(f"no shard {shard!r} in {list(self.shards)}")

    def allocate(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Give the layer uninitialised dense storage already in its serving format, so that
        :meth:`finalize` does not copy: ``weight`` becomes the ``[out_features, in_features]``
        transposed view of a contiguous ``[in_features, out_features]`` tensor of ``dtype`` on
        ``device`` (:meth:`load_shard` writes through the view), ``bias`` ``[out_features]`` of
        ``dtype``. Used on a layer built on the ``meta`` device, whose tensors hold no memory.
        A quantized layer (:meth:`set_quantized`) is left as it is."""
        if self.format != "none":
            return
        storage = torch.empty(self.in_features, self.out_features, dtype=dtype, device=device)
        self.weight = nn.Parameter(storage.t(), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device),
                                     requires_grad=False)

    def tp_part(self, shard: str, tensor, dim: int | None = None):
        """This rank's part of checkpoint tensor ``shard`` (a weight ``[out, in]`` or a bias
        ``[out]``; anything with ``rows(idx)`` / ``cols(start, end)`` methods, such as a GGUF
        weight, works too): the ``tp_parts`` range along ``tp_dim``; the tensor itself without
        tensor parallelism. ``dim`` overrides ``tp_dim`` (0 for a bias). Raises ValueError for
        a checkpoint tensor too small for the range."""
        if self.tp_parts is None:
            return tensor
        start, end = self.tp_parts[shard]
        dim = self.tp_dim if dim is None else dim
        size = tensor.shape[dim]
        if end > size:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, the tensor-parallel part "
                             f"[{start}, {end}) of dim {dim}")
        if isinstance(tensor, torch.Tensor):
            return tensor.narrow(dim, start, end - start)
        return tensor.rows(torch.arange(start, end)) if dim == 0 else tensor.cols(start, end)

    def tp_index(self) -> torch.Tensor:
        """The rows (``tp_dim`` 0) or columns (1) of the whole layer's stacked ``[out, in]``
        weight this rank holds, in order (int64). Raises ValueError without ``tp_full``."""
        if self.tp_parts is None or self.tp_full is None:
            raise ValueError("tp_index needs tp_parts and tp_full")
        idx, base = [], 0
        for shard in self.shards:
            start, end = self.tp_parts[shard]
            idx.append(torch.arange(base + start, base + end))
            base += self.tp_full[shard]
        return torch.cat(idx)

    def load_shard(self, param: str, shard: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (whole: this method takes a tensor-parallel rank's part,
        :meth:`tp_part`) into rows of ``weight`` or ``bias``.

        Raises:
            ValueError: on a shape mismatch (message gives both shapes).
        """
        target = self.weight if param == "weight" else self.bias
        if target is None:
            raise ValueError(f"layer has no {param}")
        tensor = self.tp_part(shard, tensor, 0 if param == "bias" else None)
        rows = self._rows(shard)
        dst = target.data[rows]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, model expects {tuple(dst.shape)}")
        tensor = tensor.to(dst.device)      # a no-op on the CPU; one transfer per tensor otherwise
        if dst.is_contiguous() or dst.device.type != "cpu":
            dst.copy_(tensor)
        else:   # transposed storage (allocate): 256-row blocks, faster than one strided copy
            # (docs/engine.md, "Memory planning at load")
            for i in range(0, dst.shape[0], 256):
                dst[i:i + 256].copy_(tensor[i:i + 256])
        self._loaded.add((param, shard))

    def missing(self) -> list[str]:
        """Names (``param.shard``) that were never loaded."""
        want = [("weight", s) for s in self.shards]
        if self.bias is not None:
            want += [("bias", s) for s in self.shards]
        return [f"{p}.{s}" if s else p for p, s in want if (p, s) not in self._loaded]

    def set_quantized(self, fmt: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: torch.device | str = "cpu", group_size: int = 0) -> None:
        """Replace the dense weight by a quantized one.

        Args:
            fmt: ``int8``, ``int4``, ``fp8`` or ``w8a8-int8``.
            tensors: canonical tensors of :func:`workers.layers.quant.quantize` (``qweight``,
                ``scales``, ``zeros`` for int4), plus ``bias`` [out] and ``input_scale`` [in]
                (per-input-channel factor applied to x first: 1/s of AWQ or SmoothQuant) when
                the layer has them.
            dtype: serving dtype (bias, input_scale, output).
            device: where the kernels run (the runtime layout is device specific).
            group_size: int4 group size along in_features.
        """
        rt = quant.to_runtime(fmt, tensors, torch.device(device))
        method = quantized_method(fmt, rt)
        self.weight = None
        for name in self._qnames:
            delattr(self, name)
        self._qnames = list(rt)
        for name, t in rt.items():
            self.register_buffer(name, t)
        if tensors.get("bias") is not None:
            self.bias = nn.Parameter(tensors["bias"].to(device=device, dtype=dtype), requires_grad=False)
        scale = tensors.get("input_scale")
        self.input_scale = None if scale is None else scale.to(device=device, dtype=dtype)
        self.method, self.group_size = method, group_size
        self.fast = None

    def set_gguf(self, u, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        """Serve a GGUF weight (:class:`workers.quant.gguf_blocks.Unpacked` ``[out, in]``) in
        the ``gguf_linear`` kernel's panels when the kernel runs on ``device`` (the CPU with
        the native kernels built), else dequantized once to a dense ``dtype`` weight
        (:class:`GGUFDense`). ``bias`` ``[out]`` float or None.

        Raises:
            ValueError: ``u`` is not ``[out_features, in_features]``; a super-block scale float16
                cannot hold (``dmin = 32 d`` of a Q6_K stacked with other k-quants, at |d| > 2047).
        """
        if tuple(u.shape) != (self.out_features, self.in_features):
            raise ValueError(f"GGUF weight {list(u.shape)}, layer is [{self.out_features}, {self.in_features}]")
        device = torch.device(device)
        for name in self._qnames:
            delattr(self, name)
        self._qnames = []
        if bias is not None:
            self.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
        self.fast = None
        if device.type == "cpu" and gemm.gguf_available():
            # a k-quant weight with m = sc and dmin = 32 d (Q6_K) keeps sc and d alone: the file's bytes
            sym = u.scheme == "k" and torch.equal(u.a, u.b) and torch.equal(u.dmin, 32 * u.d)
            rt = {"gguf_qweight": gemm.pack_gguf_qweight(u.q, u.bits),
                  "gguf_scales": gemm.pack_gguf_scales(u.a, None if sym else u.b,
                                                       torch.float16 if u.scheme == "flat" else torch.int8),
                  "gguf_superscales": None if u.scheme == "flat" else gemm.pack_gguf_scales(u.d, None if sym else u.dmin,
                                                                                            torch.float16)}
            self.weight = None
            for name, t in rt.items():
                self.register_buffer(name, t)
                self._qnames.append(name)
            self.gguf_bits, self.group_size, self.method = u.bits, u.group, GGUF_NATIVE
            return
        w = u.dequantize().to(dtype)
        self.weight = nn.Parameter(w.t().contiguous().to(device), requires_grad=False)
        self.method = GGUF_DENSE

    def keep_rows(self, n: int) -> None:
        """Keep only the first ``n`` output rows (``out_features`` becomes ``n``; the rest of
        the storage is freed): a draft model's lm_head over the first ``n`` token ids
        (:mod:`workers.spec_decode.draft`). For a layer in its final storage before packing:
        dense ``[in, out]`` (:meth:`finalize`, also a GGUF weight served dense) or the GGUF
        kernel's panels (16 rows each).

        Raises:
            ValueError: ``n`` not in ``[1, out_features]``; a GGUF panel layer and ``n`` not a
                multiple of 16; a storage this method cannot cut (a quantized format, packed
                bf16 panels, oneDNN, a layer not finalized), naming it.
        """
        if not 1 <= n <= self.out_features:
            raise ValueError(f"keep_rows: n={n} outside [1, {self.out_features}]")
        if self.method is GGUF_NATIVE:
            if n % 16:
                raise ValueError(f"keep_rows: n={n} is not a multiple of the GGUF panels' 16 rows")
            for name in self._qnames:
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t[: n // 16].clone())
        elif self.method is DENSE or self.method is GGUF_DENSE:
            if self.weight is None or tuple(self.weight.shape) != (self.in_features, self.out_features):
                raise ValueError("keep_rows needs a finalized dense layer ([in_features, out_features])")
            self.weight = nn.Parameter(self.weight.data[:, :n].contiguous(), requires_grad=False)
        else:
            raise ValueError(f"keep_rows cannot cut a layer served as {type(self.method).__name__}")
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data[:n].clone(), requires_grad=False)
        self.out_features, self.shards, self.fast = n, {"": n}, None

    def weight_bytes(self) -> int:
        """Bytes of the stored weight: dense weight or quantized tensors incl. scales/zeros,
        bias and input scale."""
        ts = [self.weight, self.bias, self.input_scale, self.bf16_panels] + [getattr(self, n) for n in self._qnames]
        n = sum(t.numel() * t.element_size() for t in ts if t is not None)
        if self.onednn_weight is not None:          # an opaque oneDNN tensor: its logical size
            n += self.in_features * self.out_features * 4
        return n

    def finalize(self, dtype: torch.dtype) -> None:
        """Convert loaded weights to the serving format: dense, ``dtype``, stored transposed
        (``[in_features, out_features]`` contiguous), which measured faster than ``F.linear`` on
        ``[out, in]`` for batch-1 decode (docs/engine.md, "What each technique treats").
        After :meth:`allocate` with the same ``dtype`` the weight is already in that layout
        and nothing is copied. A quantized layer (:meth:`set_quantized`) is left as it is."""
        if self.format != "none":
            return
        self.weight = nn.Parameter(self.weight.data.to(dtype).t().contiguous(), requires_grad=False)
        if self.bias is not None:
            self.bias.data = self.bias.data.to(dtype)

    def pack_bf16(self) -> None:
        """Serve a dense bfloat16 layer through the native bf16-weight GEMM
        (:mod:`workers.kernels.gemm`): the weight is re-laid out into its panels (``packed``,
        ``[ceil(N/16), ceil(K/2), 16, 2]`` bf16 in ``bf16_panels``) and the ATen layout dropped.
        For CPUs where the kernel beats ATen's bf16 matmul (see :func:`pack_bf16_linears`)."""
        if self.format != "none" or self.weight is None or self.weight.dtype != torch.bfloat16:
            raise ValueError("pack_bf16 needs a dense bfloat16 layer")
        self.bf16_panels = gemm.pack_bf16_weight(self.weight.data.t())     # stored [in, out]: W = .t()
        self.weight = None
        self.method = BF16_PANELS
        self.fast = None

    def pack_onednn(self, rows_hint: int) -> None:
        """Serve a dense float32 layer through oneDNN's inner product: the weight is prepacked
        (``torch.ops.mkldnn._reorder_linear_weight``, its layout chosen for ``rows_hint`` rows of
        x) into ``onednn_weight`` and the ATen layout dropped (see :func:`pack_onednn_linears`)."""
        if self.format != "none" or self.weight is None or self.weight.dtype != torch.float32:
            raise ValueError("pack_onednn needs a dense float32 layer")
        # stored [in, out] (finalize): oneDNN takes W [out, in]
        self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data.t().contiguous(), rows_hint)
        self.weight = None
        self.method = ONEDNN
        self.fast = None

    def bind_fast_path(self) -> None:
        """Keep the native kernel's arguments in :attr:`fast` (bf16 panels, int4 or int8 panels
        without a bias), read by the method without ``nn.Module.__getattr__``. Call after the
        layer's tensors took their final place (:func:`bind_fast_paths`); :meth:`pack_bf16` and
        :meth:`set_quantized` clear it (the method then takes its general path)."""
        self.fast, self.fast_k = None, 0
        if self.method is BF16_PANELS:
            self.fast = (self.bf16_panels, self.out_features, self.bias)
        elif self.method is INT4_NATIVE and self.bias is None and (
                self.input_scale is None or self.input_scale.dtype == torch.bfloat16):
            self.fast = (self.int4_panels, self.int4_panel_sz, self.group_size, self.out_features, self.input_scale)
            self.fast_k = self.int4_panels.shape[1] // 8
        elif self.method is GGUF_NATIVE:
            self.fast = (self.gguf_qweight, self.gguf_scales, self.gguf_superscales, self.gguf_bits, self.group_size,
                         self.out_features, self.bias)
        elif self.method is INT8_NATIVE and self.bias is None and self.input_scale is None:
            self.fast = (self.int8_panels, self.int8_panel_scales, self.out_features)
            self.fast_k = self.int8_panels.shape[1] // 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, in_features]`` → ``[T, out_features]`` in x's dtype."""
        return self.method.apply(self, x)


def bind_fast_paths(model: nn.Module) -> int:
    """:meth:`Linear.bind_fast_path` on every Linear of ``model`` (call once its weights are
    final: packed, quantized, on huge pages). Returns how many layers have one."""
    n = 0
    for m in model.modules():
        if isinstance(m, Linear):
            m.bind_fast_path()
            n += m.fast is not None
    return n


def pack_bf16_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Switch every dense Linear of a bfloat16 model on the CPU to the native bf16 GEMM when
    the kernels build: it measured faster than ATen's bf16 matmul on every CPU class tried,
    with or without AVX512-BF16 and AMX (``python -m bench.gemm``; figures: docs/engine.md,
    "Attention backends"). The packed panels are then moved onto 2 MiB pages
    (:mod:`workers.huge_pages`). ``KVMESH_NATIVE_KERNELS=0`` keeps ATen. Returns how many layers
    were packed."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return 0
    from workers import kernels
    if not kernels.available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.format == "none" and m.weight is not None]
    for lin in layers:
        lin.pack_bf16()
    # the panels on 2 MiB pages: decode streams them every step (workers/huge_pages.py)
    from workers.huge_pages import empty_on_huge_pages
    views = empty_on_huge_pages([(lin.bf16_panels.shape, lin.bf16_panels.dtype) for lin in layers])
    for lin, view in zip(layers, views or []):
        lin.bf16_panels = view.copy_(lin.bf16_panels)     # one at a time: the original is freed
    return len(layers)


def gguf_to_huge_pages(model: nn.Module) -> int:
    """Move the GGUF panels and scales of every Linear served by the ``gguf_linear`` kernel
    onto 2 MiB pages (:mod:`workers.huge_pages`), one tensor at a time (the load's peak stays
    near one copy): a decode step streams all of them, faster from 2 MiB pages (figures:
    docs/engine.md, "Weights on 2 MiB pages"). No-op where huge pages are unavailable. Returns
    how many layers moved."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.method is GGUF_NATIVE]
    names = [[n for n in ("gguf_qweight", "gguf_scales", "gguf_superscales") if getattr(lin, n) is not None]
             for lin in layers]
    from workers.huge_pages import empty_on_huge_pages
    views = empty_on_huge_pages([(getattr(lin, n).shape, getattr(lin, n).dtype)
                                 for lin, ns in zip(layers, names) for n in ns])
    if views is None:
        return 0
    it = iter(views)
    for lin, ns in zip(layers, names):
        for n in ns:
            setattr(lin, n, next(it).copy_(getattr(lin, n)))      # the registered buffer replaced
        lin.fast = None
    return len(layers)


def pack_onednn_linears(model: nn.Module, dtype: torch.dtype, device: torch.device, rows_hint: int = 64) -> int:
    """Switch every dense Linear of a float32 model on an x86-64 CPU with kvmesh's kernels to
    oneDNN's prepacked inner product (:meth:`Linear.pack_onednn`), so that no float32 linear
    runs ATen's ``mm`` (MKL's generic path on AMD CPUs) where kvmesh's kernels exist
    (docs/results-history.md, 0z10: ``python -m bench.gemm --columns "aten fp32" "onednn fp32"``).
    No-op elsewhere: other dtypes, CUDA, no oneDNN, kernels unavailable. Returns how many layers
    switched."""
    if dtype != torch.float32 or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return 0
    from workers import kernels
    if not kernels.available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.format == "none" and m.weight is not None]
    for lin in layers:
        lin.pack_onednn(rows_hint)
    return len(layers)
