"""Load the served model: dense from the checkpoint (:mod:`workers.checkpoint`) or in a quantized
weight format (:mod:`workers.quant.store`, which builds on the dense loader).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvmesh.core.errors import SettingsError
from kvmesh.hub.pull import ensure_dense
from workers.checkpoint import load_config, load_dense
from workers.layers.linear import bind_fast_paths, pack_bf16_linears, pack_onednn_linears
from workers.models.llama import LlamaForCausalLM, use_native_ops
from workers.quant.store import ensure_quantized, load_quantized
from workers.tensor_parallel import TensorParallel


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the stored weights: parameters plus the quantized tensors of the Linears
    (int weights, scales, zeros, input scales); RoPE tables and other caches excluded."""
    from workers.layers.linear import Linear
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inside = {id(p) for m in linears for p in m.parameters()}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
    return rest + sum(m.weight_bytes() for m in linears)


def resolve_weight_format(weight_format: str, model_dir: str | Path) -> str:
    """The format ``auto`` stands for with this model: ``gguf`` where ``model_dir`` holds the
    published GGUF (``model.gguf``: the known models), else ``none``; other formats as they are."""
    if weight_format != "auto":
        return weight_format
    from workers.gguf_checkpoint import is_gguf_model
    return "gguf" if is_gguf_model(model_dir) else "none"


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device: str | torch.device,
               max_positions: int, start_layer: int = 0, end_layer: int | None = None,
               num_layers: int | None = None, weight_format: str = "none", group_size: int = 128,
               calibration: bool = True, calibration_data: str = "", gguf_requantize: str = "",
               tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """Build the model (or a pipeline stage of it) and load its weights.

    Args:
        model_dir: Hugging Face checkpoint directory.
        dtype: serving dtype of the weights (torch.float32 or torch.bfloat16).
        device: where the weights live ("cpu", "cuda", ...): they are allocated there and each
            checkpoint tensor is copied over as it is read (no whole-model copy).
        max_positions: size of the RoPE table (tokens).
        start_layer, end_layer: the decoder layers this process holds.
        num_layers: keep only the checkpoint's first ``num_layers`` decoder layers (plus the
            final norm and lm_head: a full model of that depth; a truncated draft model).
        weight_format: ``gguf`` (the published GGUF's own block-quantized weights,
            :mod:`workers.gguf_checkpoint`), ``none`` (dense ``dtype``) or a format quantized here (``int8``, ``int4``,
            ``fp8``, ``w8a8-int8``): the weights then come from the quantized checkpoint cached
            by :func:`workers.quant.store.ensure_quantized` (built on first use from the whole
            dense model; docs/quantization.md). Not combined with ``num_layers``. Every format
            but ``gguf`` reads the dense checkpoint: a pulled known model gets its dense
            safetensors converted from its GGUF first, once (:func:`kvmesh.hub.pull.ensure_dense`;
            for the quantized formats inside ``ensure_quantized``).
        group_size: int4 group size along in_features.
        calibration, calibration_data: AWQ (int4) / SmoothQuant (w8a8-int8) calibration on, and
            its text file ("" = the PolicyDesk policies).
        gguf_requantize: ``gguf`` only: ``"q4_1"`` requantizes the blocks with wider lanes to Q4_1
            at load (lossy: a speculative draft's fewer bytes per step).
        tp: a tensor-parallel rank's place (:mod:`workers.tensor_parallel`): the model holds its
            part of each layer.
    Memory (dense): peak RSS growth while loading is about the served weight bytes
        (:func:`weight_bytes`) plus the largest checkpoint tensor in its file dtype.
    Raises:
        SettingsError: unsupported architecture, missing/unexpected tensor, shape mismatch,
            malformed weight file.
        EngineError: the dense conversion of a pulled model failing (:func:`kvmesh.hub.pull.ensure_dense`).
    """
    model_dir = Path(model_dir)
    weight_format = resolve_weight_format(weight_format, model_dir)
    if weight_format == "gguf":
        from workers.gguf_checkpoint import load_gguf
        return load_gguf(model_dir, dtype=dtype, device=device, max_positions=max_positions, start_layer=start_layer,
                         end_layer=end_layer, num_layers=num_layers, requantize=gguf_requantize, tp=tp)
    if weight_format != "none":
        if num_layers is not None:
            raise SettingsError("num_layers cannot be combined with a quantized weight_format")
        load_config(model_dir)        # a clear error before any quantization work
        qdir = ensure_quantized(model_dir, weight_format, group_size, calibration, calibration_data)
        return load_quantized(qdir, dtype=dtype, device=device, max_positions=max_positions,
                              start_layer=start_layer, end_layer=end_layer, tp=tp)
    ensure_dense(model_dir, why="--weight-format none")
    return load_dense(model_dir, dtype=dtype, device=device, max_positions=max_positions, start_layer=start_layer,
                      end_layer=end_layer, num_layers=num_layers, tp=tp)


def use_serving_kernels(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, onednn: bool = True) -> None:
    """After :func:`load_model`, for serving: the native bf16 GEMM where it beats ATen
    (:func:`workers.layers.linear.pack_bf16_linears`), oneDNN for dense float32 Linears
    (:func:`workers.layers.linear.pack_onednn_linears`), the fused norm / rotary / SiLU-and-mul
    ops (:func:`workers.models.llama.use_native_ops`), then each Linear's kernel arguments bound
    once the weights are final (:func:`workers.layers.linear.bind_fast_paths`). ``onednn`` False
    keeps ATen for float32 (a step compiled by torch.compile: dynamo does not trace oneDNN's
    opaque weight tensors)."""
    pack_bf16_linears(model, dtype, device)
    if onednn:
        pack_onednn_linears(model, dtype, device)
    use_native_ops(model, dtype, device)
    bind_fast_paths(model)
