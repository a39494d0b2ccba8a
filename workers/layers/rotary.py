"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer"), in the rotate-half
(GPT-NeoX) layout that Llama/Qwen2/Mistral checkpoints in Hugging Face format use.

Supported ``rope_scaling`` types: none/``default``, ``linear`` (position interpolation,
Chen et al. 2023), ``llama3`` (Meta's frequency-dependent scaling). Others raise
``ValueError`` at load.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of their last dimension.

    ``forward(positions [T] int64, q [T, H, D], k [T, KVH, D])`` returns rotated (q, k) in the
    input dtype; the cos/sin table ``[max_positions, D/2]`` is precomputed in float32.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The table rows of ``positions`` ``[T]`` int64: (cos, sin), each ``[T, 1, D/2]`` in
        ``dtype``. Gathered once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` (any strides) by (cos, sin) of :meth:`cos_sin`; the
        rotation is computed in the activations' dtype, as transformers does. Returns a new
        contiguous ``[T, heads, D]``."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotated (q ``[T, H, D]``, k ``[T, KVH, D]``) at ``positions`` ``[T]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
