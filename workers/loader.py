"""Checkpoint loading: Hugging Face directory (config.json + *.safetensors) → our model.

Tensors are read with safetensors straight into the model's parameters; transformers' model
classes are never instantiated. Errors a user can fix (unknown architecture, missing or
extra tensor, shape mismatch, no weights) raise :class:`scheduler.request.EngineError`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from scheduler.request import EngineError
from workers.models.llama import LlamaForCausalLM, ModelConfig


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json``. Raises EngineError when missing or unsupported."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise EngineError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (ValueError, KeyError) as e:
        raise EngineError(f"{model_dir}: {e if isinstance(e, ValueError) else f'config.json lacks {e}'}") from None


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{model_dir}: no *.safetensors weight files")
    return files


def _iter_tensors(files: list[Path]):
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name).float()


def check_servable(model_dir: Path, cfg: ModelConfig, max_positions: int) -> None:
    """Raises EngineError for a checkpoint the attention cannot serve at ``max_positions``."""
    if cfg.sliding_window is not None and cfg.sliding_window < max_positions:
        raise EngineError(f"{model_dir}: sliding-window attention ({cfg.sliding_window} tokens) is not supported; "
                          f"use max_model_len <= {cfg.sliding_window}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the stored weights: parameters plus the quantized tensors of the Linears
    (int weights, scales, zeros, input scales); RoPE tables and other caches excluded."""
    from workers.layers.linear import Linear
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inside = {id(p) for m in linears for p in m.parameters()}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
    return rest + sum(m.weight_bytes() for m in linears)


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device: str | torch.device,
               max_positions: int, start_layer: int = 0, end_layer: int | None = None,
               num_layers: int | None = None, weight_format: str = "none", group_size: int = 128,
               calibration: bool = True, calibration_data: str = "") -> LlamaForCausalLM:
    """Build the model (or a pipeline stage of it) and load its weights.

    Args:
        model_dir: Hugging Face checkpoint directory.
        dtype: serving dtype of the weights (torch.float32 or torch.bfloat16).
        device: where the weights live ("cpu", "cuda", ...).
        max_positions: size of the RoPE table (tokens).
        start_layer, end_layer: the decoder layers this process holds.
        num_layers: keep only the checkpoint's first ``num_layers`` decoder layers (plus the
            final norm and lm_head: a full model of that depth; a truncated draft model).
        weight_format: ``none`` (dense ``dtype``) or a quantized format (``int8``, ``int4``,
            ``fp8``, ``w8a8-int8``): the weights then come from the quantized checkpoint cached
            by :func:`workers.quant.store.ensure_quantized` (built on first use from the whole
            dense model; docs/quantization.md). Not combined with ``num_layers``.
        group_size: int4 group size along in_features.
        calibration, calibration_data: AWQ (int4) / SmoothQuant (w8a8-int8) calibration on, and
            its text file ("" = the PolicyDesk policies).
    Raises:
        EngineError: unsupported architecture, missing/unexpected tensor, shape mismatch.
    """
    model_dir = Path(model_dir)
    if weight_format != "none":
        from workers.quant.store import ensure_quantized, load_quantized
        if num_layers is not None:
            raise EngineError("num_layers cannot be combined with a quantized weight_format")
        load_config(model_dir)        # a clear error before any quantization work
        qdir = ensure_quantized(model_dir, weight_format, group_size, calibration, calibration_data)
        return load_quantized(qdir, dtype=dtype, device=device, max_positions=max_positions,
                              start_layer=start_layer, end_layer=end_layer)
    cfg = load_config(model_dir)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise EngineError(f"{model_dir}: cannot keep {num_layers} of its {cfg.num_layers} decoder layers")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    check_servable(model_dir, cfg, max_positions)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg, max_positions, start_layer, end_layer)
    try:
        tensors = _iter_tensors(_safetensors_files(model_dir))
        if num_layers is not None:     # drop the tensors of the layers cut off
            tensors = ((n, t) for n, t in tensors
                       if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= num_layers))
        model.load_weights(tensors)
    except EngineError:
        raise
    except ValueError as e:
        raise EngineError(f"{model_dir}: {e}") from None
    model.finalize(dtype)
    return model.to(device).eval()
