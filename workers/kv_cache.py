"""KV cache tensors: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per
layer (index 0 = K, 1 = V), allocated once, up front, from a memory budget."""

from __future__ import annotations

import psutil
import torch

from scheduler.request import EngineError

KV_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` → the model's dtype; else one of KV_DTYPES. Raises EngineError."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise EngineError(f"unknown kv cache dtype {name!r}; choose auto or one of {sorted(KV_DTYPES)}")
    return KV_DTYPES[name]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across ``num_layers`` layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def budget_bytes(kv_cache_memory: float, device: torch.device) -> int:
    """``kv_cache_memory`` >= 1 is a byte count; in (0, 1) a fraction of the device's free
    memory (available RAM on the CPU, free memory on an accelerator). A fraction above 0.9 is
    refused: the weights and activations need room too."""
    if not kv_cache_memory > 0:
        raise EngineError(f"kv_cache_memory must be > 0, got {kv_cache_memory}")
    if kv_cache_memory >= 1:
        return int(kv_cache_memory)
    if kv_cache_memory > 0.9:
        raise EngineError(f"kv_cache_memory fraction {kv_cache_memory} leaves no room for the model; use at most 0.9")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    return int(free * kv_cache_memory)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zero-filled caches, one per layer: ``[2, num_blocks, block_size, KVH, D]``.
    Raises EngineError when the memory cannot be allocated."""
    try:
        return [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
                for _ in range(num_layers)]
    except (RuntimeError, MemoryError) as e:     # torch's allocators raise RuntimeError / OutOfMemoryError
        raise EngineError(f"cannot allocate the KV cache ({num_blocks} blocks): {e}; lower --kv-cache-memory") from None
