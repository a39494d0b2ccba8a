"""Settings and parameter validation that need no model."""

import math

import pytest
import torch

from kvmesh.core.config import EngineConfig, _parse_bytes
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from workers.kv_cache import allocate_kv_cache, budget_bytes


@pytest.mark.parametrize("text, value", [("2GiB", 2 * 2**30), ("512MB", 512e6), ("1B", 1), ("1e9", 1e9), ("0.5", 0.5)])
def test_parse_bytes(text, value):
    assert _parse_bytes(text) == value


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
