"""kvmesh's defaults on every kernel level this CPU supports (the ``kernel_isa`` setting forced, issue
39): the Python side (``cpu_kernel_level``, which picks the default dtype) and the kernels agree on
the level, also on one above the CPU's (lowered by both); ``KVMESH_KERNEL_ISA`` is the setting's
variable; the default configuration (``dtype auto``, ``weight_format auto``) takes bfloat16 above
the scalar level and float32 at it; and a decode step of that configuration runs kvmesh's
kernels at its level, not ATen's matmuls (no ``aten::mm``/``addmm``/``linear`` in its profile)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.core.engine_config import KERNEL_LEVELS, EngineConfig, cpu_kernel_level
from kvmesh.core.errors import SettingsError
from workers import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are not built here")

ATEN_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}


def _supported(level: str) -> bool:
    return KERNEL_LEVELS.index(level) <= KERNEL_LEVELS.index(kernels.cpu_isa())


@pytest.fixture
def forced():
    """force(level): the kernels at ``level``; the CPU's best again afterwards."""
    def force(level: str) -> str:
        return kernels.set_isa(level)
    yield force
    kernels.set_isa("auto")


def test_settings_and_kernels_agree_on_the_level(forced, monkeypatch):
    monkeypatch.delenv("KVMESH_KERNEL_ISA", raising=False)
    assert cpu_kernel_level() == cpu_kernel_level("auto") == kernels.cpu_isa()
    for level in KERNEL_LEVELS:
        if _supported(level):
            assert forced(level) == level
            assert cpu_kernel_level(level) == kernels.isa() == level
            want = torch.float32 if level == "scalar" else torch.bfloat16
            assert EngineConfig(model="m", dtype="auto", kernel_isa=level).torch_dtype == want
        else:                                                  # above the CPU's best: lowered by both
            assert cpu_kernel_level(level) == forced(level) == kernels.cpu_isa()
    monkeypatch.setenv("KVMESH_KERNEL_ISA", "avx2")            # the setting's variable
    assert EngineConfig.from_env(model="m").kernel_isa == "avx2"
    assert EngineConfig(model="m").kernel_isa == "auto"
    monkeypatch.setenv("KVMESH_KERNEL_ISA", "sse9")
    with pytest.raises(SettingsError, match="kernel_isa"):
        EngineConfig.from_env(model="m")
    monkeypatch.delenv("KVMESH_KERNEL_ISA")
    monkeypatch.setenv("KVMESH_NATIVE_KERNELS", "0")
    assert cpu_kernel_level() == "scalar"
    assert EngineConfig(model="m", dtype="auto").torch_dtype == torch.float32
    assert EngineConfig(model="m", dtype="auto", device="cuda").torch_dtype == torch.bfloat16


@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_default_decode_step_runs_kvmesh_kernels(level, forced, smollm2_dir, prose_ids, monkeypatch):
    if not _supported(level):
        pytest.skip(f"this CPU's best kernel level is {kernels.cpu_isa()}")
    forced("scalar" if level != "scalar" else "auto")               # another level: the engine sets its own
    monkeypatch.delenv("KVMESH_WEIGHT_FORMAT", raising=False)       # the product's default: auto
    from kvmesh.core.sampling import SamplingParams
    from scheduler.engine import LLMEngine
    cfg = EngineConfig(model=str(smollm2_dir), kv_cache_memory=32 * 2**20, max_model_len=256, kernel_isa=level)
    assert cfg.dtype == "auto" and cfg.weight_format == "auto"
    engine = LLMEngine(cfg)
    try:
        assert kernels.isa() == level
        assert engine.cfg.torch_dtype == (torch.float32 if level == "scalar" else torch.bfloat16)
        engine.add_request("r", prose_ids[:40], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        produced = 0
        while produced == 0:                       # the prefill (and its first token)
            produced = sum(len(o.new_token_ids) for o in engine.step())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs = engine.step()                   # one decode step
        assert sum(len(o.new_token_ids) for o in outs) == 1
        ops = {e.key for e in prof.key_averages()}
        assert "kvmesh::gguf_linear" in ops, sorted(ops)
        assert not ops & ATEN_MATMULS, sorted(ops & ATEN_MATMULS)
    finally:
        engine.shutdown()


def test_float32_dense_linears_run_onednn_not_aten(smollm2_dir, prose_ids, h):
    """``--dtype float32`` with dense weights (the parity reference) keeps no ATen float32 matmul
    where kvmesh's kernels exist: every Linear is prepacked for oneDNN (multi-threaded JIT
    kernels; MKL's float32 path is generic on AMD CPUs), and the step compiled by torch.compile
    keeps ATen (oneDNN's opaque weights are not traced)."""
    from kvmesh.core.sampling import SamplingParams
    from workers.layers.linear import DENSE, ONEDNN, Linear
    eng = h.make_engine(smollm2_dir, weight_format="none", dtype="float32", max_num_seqs=2)
    model = eng.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.method is ONEDNN and m.weight is None for m in linears)
    eng.add_request("r", prose_ids[:40], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while sum(len(o.new_token_ids) for o in eng.step()) == 0:
        pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.step()
    ops = {e.key for e in prof.key_averages()}
    assert "mkldnn::_linear_pointwise" in ops, sorted(ops)
    assert not ops & ATEN_MATMULS, sorted(ops & ATEN_MATMULS)
    compiled = h.make_engine(smollm2_dir, weight_format="none", dtype="float32", enable_compile=True, max_num_seqs=1)
    assert all(m.method is DENSE for m in compiled.executor.runner.model.modules() if isinstance(m, Linear))
