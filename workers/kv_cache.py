"""KV cache: one :class:`KVCache` per layer, allocated once, up front, from a memory budget.

A layer's cache holds K and V of ``num_blocks`` blocks of ``block_size`` tokens:
``data: [2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V), in a
float dtype (float32, bfloat16, float16) or quantized (``int8``, or ``fp8`` = e4m3,
``torch.float8_e4m3fn``).

Quantized caches keep one float32 scale per block, KV head and K/V
(``scales: [2, num_blocks, num_kv_heads]``); a stored value ``q`` means ``q * scale``. The scale
of a (block, head) is set from the absolute maximum (amax) of the values the block holds:

- ``int8``: ``scale = amax / 127``, values rounded to the nearest integer in [-127, 127];
- ``fp8``: ``scale = 2 ** ceil(log2(amax / 448))`` (a power of two, so that the block's amax
  lands in (224, 448]), values rounded to e4m3 and clamped to ±448. A power of two because
  re-scaling an e4m3 value by one only moves its exponent (exact), while any other ratio would
  round its 3-bit mantissa again; e4m3's relative precision does not depend on where the amax
  falls, so nothing is lost.

Blocks fill token by token (decodes) or many tokens at once (prefill chunks). Every write is a
read-modify-write of the blocks it touches: their stored values are dequantized, the new tokens
placed, the scale recomputed from the block's amax and the whole block requantized. The stored
values are kept, so the scale of a block only grows while it fills (int8; an fp8 scale may
also halve, exactly, when rounding brought the block's largest value down to 224); a block whose
first slot is written starts over (the block manager hands out blocks that are filled from
slot 0, so the rest of such a block holds a previous owner's values, which are zeroed). A write
costs O(tokens + touched blocks x block_size), independent of the sequence length; a prefill
chunk's full blocks are quantized once from their exact amax.

Error bound of a stored value (|x̂ - x|): int8: ``scale / 2`` for a block quantized once, and
at most ``scale / 2`` more per requantization that grew the scale (each one rounds again);
fp8: e4m3 rounding (relative 2^-4) of ``x``, requantization is exact except for values
pushed below e4m3's smallest normal (absolute error < ``2^-9 * scale``).

Float caches store the values as they are (no scales) and their reads of a contiguous run of
blocks are views (no copy).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import psutil
import torch

from kvmesh.core.engine_config import KV_CACHE_DTYPES
from kvmesh.core.errors import SettingsError

# quantized KV dtypes -> the largest magnitude a stored value may have
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4          # one float32 scale per (K or V, block, KV head)
_TINY = 2.0 ** -60       # smallest scale: an all-zero block still divides by something


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` → the model's dtype; else the torch dtype of one of
    :data:`kvmesh.core.engine_config.KV_CACHE_DTYPES` (``int8`` and ``fp8`` are quantized).
    Raises SettingsError naming ``kv_cache_dtype`` for an unknown name."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise SettingsError(f"unknown kv_cache_dtype {name!r}; choose auto or one of {sorted(KV_CACHE_DTYPES)}")
    return getattr(torch, KV_CACHE_DTYPES[name])


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across ``num_layers`` layers, scales included
    (quantized dtypes: 1 byte per value + 4 bytes per K/V and KV head)."""
    size = torch.empty((), dtype=dtype).element_size()
    per_head = block_size * head_dim * size + (SCALE_BYTES if is_quantized(dtype) else 0)
    return 2 * num_layers * num_kv_heads * per_head


@dataclass(frozen=True)
class KVCacheInfo:
    """A replica's KV cache format and capacity (GetStats, Prometheus gauges).

    Attributes:
        dtype: stored K/V dtype (``int8``, ``float8_e4m3fn``, ``bfloat16``, ``float32``...).
        num_blocks: blocks in the pool.
        bytes_per_token: K and V of one token over all layers, scales included (bytes).
        max_concurrency: sequences of ``max_model_len`` tokens the pool holds at once
            (``num_blocks * block_size // max_model_len``).
    """

    dtype: str
    num_blocks: int
    bytes_per_token: float
    max_concurrency: int

    @classmethod
    def of(cls, cfg, model_config, num_blocks: int) -> "KVCacheInfo":
        """From an engine's resolved EngineConfig (``max_model_len`` set) and ModelConfig."""
        dt = kv_dtype(cfg.kv_cache_dtype, cfg.torch_dtype)
        m = model_config
        per_block = bytes_per_block(m.num_layers, cfg.block_size, m.num_kv_heads, m.head_dim, dt)
        return cls(str(dt).removeprefix("torch."), num_blocks, per_block / cfg.block_size,
                   num_blocks * cfg.block_size // max(cfg.max_model_len, 1))


def budget_bytes(kv_cache_memory: float, device: torch.device) -> int:
    """``kv_cache_memory`` >= 1 is a byte count; in (0, 1) a fraction of the device's free
    memory (available RAM on the CPU, free memory on an accelerator). A fraction above 0.9 is
    refused: the weights and activations need room too."""
    if not kv_cache_memory > 0:
        raise SettingsError(f"kv_cache_memory must be > 0, got {kv_cache_memory}")
    if kv_cache_memory >= 1:
        return int(kv_cache_memory)
    if kv_cache_memory > 0.9:
        raise SettingsError(f"kv_cache_memory fraction {kv_cache_memory} leaves no room for the model; use at most 0.9")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    return int(free * kv_cache_memory)


class KVCache:
    """One layer's paged K/V (see the module docstring for the layout and the scales).

    Args:
        data: ``[2, num_blocks, block_size, KVH, D]``, float or ``int8``/``float8_e4m3fn``.
        scales: ``[2, num_blocks, KVH]`` float32 for a quantized ``data``; None for a float one.
    """

    def __init__(self, data: torch.Tensor, scales: torch.Tensor | None = None):
        if is_quantized(data.dtype) != (scales is not None):
            raise ValueError(f"a {data.dtype} cache {'needs' if scales is None else 'takes no'} scales")
        self.data, self.scales = data, scales
        self.block_size, self.num_kv_heads, self.head_dim = data.shape[2], data.shape[3], data.shape[4]
        # index_put/index_copy are not implemented for float8 on every device: quantized values
        # move through this raw-byte view of ``data``
        self._bytes = data.view(torch.uint8) if scales is not None else None

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k, v: [T, KVH, D]`` (any float dtype) at ``slot_mapping: [T]`` int64 (slot =
        block * block_size + offset). Quantized: read-modify-write of the touched blocks."""
        kvh, d = self.num_kv_heads, self.head_dim
        if not self.quantized:
            self.data[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(self.data.dtype))
            self.data[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(self.data.dtype))
            return
        if slot_mapping.numel() == 0:
            return
        blocks, inv = torch.unique(slot_mapping // self.block_size, return_inverse=True)     # [U], [T]
        offsets = slot_mapping % self.block_size
        blk = self._dequantize(self._bytes[:, blocks], self.scales[:, blocks], torch.float32)  # [2, U, BS, KVH, D]
        restart = torch.zeros(blocks.shape[0], dtype=torch.bool, device=blk.device)
        restart[inv[offsets == 0]] = True            # first slot written: the block starts over
        blk.masked_fill_(restart[None, :, None, None, None], 0.0)
        blk[:, inv, offsets] = torch.stack((k, v)).float()
        amax = blk.abs().amax(dim=(2, 4))                                                   # [2, U, KVH]
        qmax = QUANT_MAX[self.data.dtype]
        if self.data.dtype == torch.int8:
            scale = (amax / qmax).clamp_min_(_TINY)
            q = (blk / scale[:, :, None, :, None]).round_().clamp_(-qmax, qmax).to(torch.int8)
        else:
            scale = torch.exp2(torch.ceil(torch.log2((amax / qmax).clamp_min_(_TINY))))
            q = (blk / scale[:, :, None, :, None]).clamp_(-qmax, qmax).to(self.data.dtype)
        self._bytes[:, blocks] = q.view(torch.uint8)
        self.scales[:, blocks] = scale

    def read(self, block_table: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks ``block_table`` lists (an int64 tensor of any shape, or a slice),
        each ``[*block_table.shape, block_size, KVH, D]`` (a slice: ``[n, block_size, KVH, D]``)
        in ``dtype``. A float cache read through a slice in its own dtype is a view."""
        if not self.quantized:
            return self.data[0][block_table].to(dtype), self.data[1][block_table].to(dtype)
        kv = self._dequantize(self._bytes[:, block_table], self.scales[:, block_table], dtype)
        return kv[0], kv[1]

    def _dequantize(self, raw: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """raw: ``[2, *blocks, BS, KVH, D]`` uint8 (the stored bytes); scales: ``[2, *blocks, KVH]``."""
        return raw.view(self.data.dtype).to(dtype) * scales.to(dtype).unsqueeze(-1).unsqueeze(-3)


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory backed by its own anonymous private mapping (``mmap``):
    Linux supplies zero pages on first touch, so only the pages that are written become
    resident: the KV pool's resident memory grows with the blocks in use, not with the budget
    (``torch.zeros`` writes, and so commits, every page up front). The first write of a page
    costs a page fault (what that costs a cold prefill: docs/engine.md, "Profile", 2026-12-01 on
    a Sapphire Rapids class Xeon). Transparent huge pages (``MADV_HUGEPAGE``) are not asked for:
    they measured slower writes and no decode gain (same place); the mapping is advised
    ``MADV_NOHUGEPAGE``, which keeps it so where
    THP is ``always`` and keeps it a mapping of its own (the kernel merges adjacent anonymous
    mappings only when their flags match: a stage's pool merged with a 29 MiB neighbour before,
    and ``/proc/PID/smaps`` could not tell the pool's pages apart). Raises OSError (ENOMEM) when
    the mapping cannot be made."""
    nbytes = math.prod(shape) * dtype.itemsize
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps a reference to the mapping for the tensor's life
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    """Zero-filled caches, one per layer: data ``[2, num_blocks, block_size, KVH, D]`` in
    ``dtype`` and, for a quantized dtype, scales ``[2, num_blocks, KVH]`` float32. On the CPU
    the layers' data are consecutive views of one lazily committed zero mapping
    (:func:`zeroed_host_tensor`): the pool is one anonymous mapping of its size, which
    ``/proc/PID/smaps`` shows with its resident pages (``bench.soak`` reads it there; one
    mapping per layer did not always merge into one: another mapping made between two layers'
    splits them). Raises EngineError when the memory cannot be allocated."""
    device = torch.device(device)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    try:
        if device.type == "cpu":
            datas = list(zeroed_host_tensor((num_layers, *shape), dtype).unbind(0))
        else:
            datas = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        caches = []
        for data in datas:
            scales = (torch.zeros(2, num_blocks, num_kv_heads, dtype=torch.float32, device=device)
                      if is_quantized(dtype) else None)
            caches.append(KVCache(data, scales))
        return caches
    except (RuntimeError, MemoryError, OSError) as e:   # torch's allocators: RuntimeError / OutOfMemoryError; mmap: OSError
        raise SettingsError(f"cannot allocate the KV cache ({num_blocks} blocks): {e}; lower --kv-cache-memory") from None
