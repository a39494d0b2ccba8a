"""Settings: one typed object per service, from flags and ``KVMESH_*`` environment variables.

Precedence: explicit argument > ``KVMESH_<FIELD>`` environment variable > default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields

import torch

from scheduler.request import EngineError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when the CPU advertises AVX512-BF16 or AMX-BF16 (Linux /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _parse_bytes(v: str | float | int) -> float:
    """``"2GiB"``, ``"512MB"``, ``"0.2"`` (fraction), ``1e9`` → float."""
    if isinstance(v, (int, float)):
        return float(v)
    s = v.strip().lower().replace(" ", "")
    for suffix, mult in (("gib", 2**30), ("mib", 2**20), ("kib", 2**10), ("gb", 1e9), ("mb", 1e6), ("kb", 1e3), ("g", 2**30), ("m", 2**20), ("b", 1)):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


@dataclass
class EngineConfig:
    """Settings of one engine replica.

    Attributes:
        model: known model name (see ``kvmesh models list``) or checkpoint directory.
        dtype: weight/activation dtype: ``float32`` or ``bfloat16`` (``auto``: see
            :attr:`torch_dtype`).
        kv_cache_dtype: ``auto`` (= dtype), ``float32`` or ``bfloat16``.
        block_size: tokens per KV block.
        kv_cache_memory: KV budget: bytes if >= 1 (``"2GiB"`` accepted), else a fraction of
            free device memory.
        max_model_len: longest sequence, prompt + output, in tokens (0 = model's limit, at most 8192).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step.
        policy: ``continuous``, ``static`` or ``naive``.
        enable_prefix_caching, enable_chunked_prefill: switches.
        device: ``cpu``, ``cuda``, ``cuda:1`` ...
        num_threads: torch intra-op threads (0 = leave torch's default).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: float = 2 * 2**30
    max_model_len: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "continuous"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device: str = "cpu"
    num_threads: int = 0

    @classmethod
    def from_env(cls, **overrides) -> "EngineConfig":
        """Defaults, then ``KVMESH_*`` variables, then ``overrides`` (None values ignored)."""
        kw = {}
        for f in fields(cls):
            env = os.environ.get(f"KVMESH_{f.name.upper()}")
            if env is not None:
                kw[f.name] = env
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, str) and f.type in ("int", "bool", "float"):
                if f.type == "bool":
                    v = v.strip().lower() in ("1", "true", "yes", "on")
                elif f.name == "kv_cache_memory":
                    v = _parse_bytes(v)
                else:
                    v = int(v) if f.type == "int" else float(v)
                setattr(self, f.name, v)
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = _parse_bytes(self.kv_cache_memory)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise EngineError(f"unknown dtype {self.dtype!r}; choose auto or one of {sorted(DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise EngineError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise EngineError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.policy == "naive":
            self.enable_prefix_caching = False

    @property
    def torch_dtype(self) -> torch.dtype:
        """``auto``: bfloat16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16 or AMX),
        where it measured faster than float32 for prefill and batched decode
        (docs/engine_offline.md); float32 on other CPUs."""
        if self.dtype == "auto":
            if self.device.startswith("cuda") or cpu_has_native_bf16():
                return torch.bfloat16
            return torch.float32
        return DTYPES[self.dtype]

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
