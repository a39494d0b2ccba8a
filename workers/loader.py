"""Checkpoint loading: Hugging Face directory (config.json + *.safetensors) → our model.

Tensors are read with safetensors straight into the model's parameters; transformers' model
classes are never instantiated. Errors a user can fix (unknown architecture, missing or
extra tensor, shape mismatch, no weights) raise :class:`scheduler.request.EngineError`.
"""

from __future__ import annotations

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


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device: str | torch.device,
               max_positions: int, start_layer: int = 0, end_layer: int | None = None) -> LlamaForCausalLM:
    """Build the model (or a pipeline stage of it) and load its weights.

    Args:
        model_dir: Hugging Face checkpoint directory.
        dtype: serving dtype of the weights (torch.float32 or torch.bfloat16).
        device: where the weights live ("cpu", "cuda", ...).
        max_positions: size of the RoPE table (tokens).
        start_layer, end_layer: the decoder layers this process holds.
    Raises:
        EngineError: unsupported architecture, missing/unexpected tensor, shape mismatch.
    """
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    if cfg.sliding_window is not None and cfg.sliding_window < max_positions:
        raise EngineError(f"{model_dir}: sliding-window attention ({cfg.sliding_window} tokens) is not supported; "
                          f"use max_model_len <= {cfg.sliding_window}")
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg, max_positions, start_layer, end_layer)
    try:
        model.load_weights(_iter_tensors(_safetensors_files(model_dir)))
    except EngineError:
        raise
    except ValueError as e:
        raise EngineError(f"{model_dir}: {e}") from None
    model.finalize(dtype)
    return model.to(device).eval()
