"""Settings and parameter validation that need no model."""

import math

import pytest
import torch

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from kvmesh.core.settings import parse_bytes
from workers.kv_cache import allocate_kv_cache, budget_bytes


@pytest.mark.parametrize("text, value", [("2GiB", 2 * 2**30), ("512MB", 512e6), ("1B", 1), ("1e9", 1e9), ("0.5", 0.5)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("kw, match", [
    (dict(kv_cache_dtype="int4"), "unknown kv_cache_dtype 'int4'"),
    (dict(policy="fifo"), "unknown scheduling policy 'fifo'"),
    (dict(weight_format="awq"), "unknown weight_format 'awq'"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
])
def test_every_choice_is_checked_when_the_settings_are_made(kw, match):
    """A setting with a list of choices is refused on construction (at start-up, before any
    model is loaded), not first where a lower layer uses it."""
    with pytest.raises(EngineError, match=match):
        EngineConfig(**kw)


def test_kv_cache_dtype_names_map_to_torch_dtypes():
    from kvmesh.core.engine_config import KV_CACHE_DTYPES
    from workers.kv_cache import kv_dtype
    assert {n: kv_dtype(n, torch.float32) for n in ("fp32", "bf16", "fp16", "int8", "fp8")} == {
        "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
        "fp8": torch.float8_e4m3fn}
    assert all(isinstance(kv_dtype(n, torch.float32), torch.dtype) for n in KV_CACHE_DTYPES)
    assert kv_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_kv_budget_bytes_and_fractions():
    cpu = torch.device("cpu")
    assert budget_bytes(1, cpu) == 1                 # 1 is one byte, not "all memory"
    assert budget_bytes(2 * 2**30, cpu) == 2 * 2**30
    assert 0 < budget_bytes(0.01, cpu) < budget_bytes(0.02, cpu)
    with pytest.raises(EngineError, match="at most 0.9"):
        budget_bytes(0.95, cpu)
    with pytest.raises(EngineError, match="> 0"):
        budget_bytes(0, cpu)
    with pytest.raises(EngineError, match="> 0"):
        budget_bytes(math.nan, cpu)


def test_kv_cache_allocation_failure_is_an_engine_error():
    with pytest.raises(EngineError, match="cannot allocate the KV cache"):
        allocate_kv_cache(1, 2**40, 16, 8, 128, torch.float32, torch.device("cpu"))   # petabytes


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_sampling_values_are_rejected(field, value):
    with pytest.raises(EngineError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


def test_env_and_overrides(monkeypatch):
    monkeypatch.setenv("KVMESH_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("KVMESH_KV_CACHE_MEMORY", "1GiB")
    cfg = EngineConfig.from_env(block_size=32)
    assert (cfg.max_num_seqs, cfg.kv_cache_memory, cfg.block_size) == (7, 2**30, 32)
