"""The native quantized-weight kernels (``kvmesh::int4_linear``, ``kvmesh::int8_linear``,
workers/kernels/csrc/gemm/int4_gemv.cpp, int8_gemv.cpp) against the plain PyTorch references.

int4: the canonical
int4 tensors of :func:`workers.layers.quant.quantize_int4` dequantized in float32 with the
scales and zeros rounded to bfloat16 (the kernel keeps them in bfloat16, as ATen's int4 CPU
kernel does), ``x.float() @ W.T``. Tolerance: the output's bfloat16 rounding (2**-8 relative)
plus float32 sums in another order (1e-4 of ``|x| @ |W|.T``). Also: ATen's packed int4 kernel
(what CPUs without AVX512-BF16 run) agrees within twice that bound; the engine's int4 model
runs every step through the kernel, keeps no second copy of the weights, and gives the same
greedy tokens as the model through ATen's kernel.

int8 (per-column scales; the int4 format's lm_head): against ``x.float() @ (q * bf16(s)).T``
with the same tolerance, and ATen's int8 kernel within twice it.

Both kernels have one level, avx512bf16 (amx runs it too): forced to each level this CPU has,
they run it and match their references from avx512bf16 up, and below it they raise and
``int4_available`` is False (the layers keep ATen's kernels)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.core.engine_config import KERNEL_LEVELS
from workers import kernels
from workers.kernels import gemm
from workers.layers import quant

pytestmark = pytest.mark.skipif(not gemm.int4_available(),
                                reason="the int4/int8 kernels need AVX512-BF16 and the native kernels")


def _case(n, k, g, m, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    t = quant.quantize_int4(w, g)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    return t, x


def _same_greedy_or_near_tie(logits_a, logits_b, min_steps):
    """Step by step, the greedy tokens of two runs agree until a step whose top-2 logits (run
    b) are closer than twice the runs' logit difference there (a near-tie of bf16 decoding,
    after which the runs legitimately part); at least ``min_steps`` steps compared."""
    compared = 0
    for a, b in zip(logits_a, logits_b):
        assert a.shape == b.shape
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            differ = a.argmax(-1) != b.argmax(-1)
            top = b.topk(2, dim=-1).values
            diff = (a - b).abs().max(dim=-1).values
            assert ((top[:, 0] - top[:, 1]) <= 2 * diff)[differ].all(), "tokens differ without a near-tie"
            break
        compared += 1
    assert compared >= min_steps, compared


def _aten_runtime(t, fmt="int4"):
    """The runtime tensors of ATen's kernel for ``fmt`` (what CPUs without AVX512-BF16 load)."""
    orig = gemm.int4_available
    gemm.int4_available = lambda: False
    try:
        rt = quant.to_runtime(fmt, t, torch.device("cpu"))
    finally:
        gemm.int4_available = orig
    assert set(rt) == ({"packed", "scales_and_zeros"} if fmt == "int4" else {"qweight", "scales"})
    return rt


def _reference(t, x):
    s, z = t["scales"].to(torch.bfloat16).float(), t["zeros"].to(torch.bfloat16).float()
    w = quant.dequantize_int4(t["qweight"], s, z)
    ref = x.float() @ w.T
    bound = 2 ** -8 * ref.abs() + 1e-4 * (x.float().abs() @ w.abs().T)
    return ref, bound


@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_int4_and_int8_run_their_level_or_raise_below_it(level):
    if KERNEL_LEVELS.index(level) > KERNEL_LEVELS.index(kernels.cpu_isa()):
        pytest.skip(f"this CPU's best kernel level is {kernels.cpu_isa()}")
    t, x = _case(100, 256, 32, 5, 11)
    panels, sz = gemm.pack_int4_panels(quant.unpack_int4(t["qweight"]), t["scales"], t["zeros"], 32)
    t8 = quant.quantize_int8(torch.randn(100, 256, generator=torch.Generator().manual_seed(12)) * 0.05)
    p8, s8 = gemm.pack_int8_panels(t8["qweight"], t8["scales"])
    runs = KERNEL_LEVELS.index(level) >= KERNEL_LEVELS.index("avx512bf16")
    assert kernels.set_isa(level) == level
    try:
        assert kernels.path("int4_linear") == kernels.path("int8_linear") == ("avx512bf16" if runs else "none")
        assert gemm.int4_available() == runs
        if not runs:
            with pytest.raises(RuntimeError, match=f"in use \\({level}\\) is below avx512bf16"):
                gemm.int4_linear(x, panels, sz, 32, 100)
            with pytest.raises(RuntimeError, match=f"in use \\({level}\\) is below avx512bf16"):
                gemm.int8_linear(x, p8, s8, 100)
            return
        ref, bound = _reference(t, x)
        assert ((gemm.int4_linear(x, panels, sz, 32, 100).float() - ref).abs() <= bound).all()
        w8 = quant.dequantize_int8(t8["qweight"], t8["scales"].to(torch.bfloat16))
        ref8 = x.float() @ w8.T
        bound8 = 2 ** -8 * ref8.abs() + 1e-4 * (x.float().abs() @ w8.abs().T)
        assert ((gemm.int8_linear(x, p8, s8, 100).float() - ref8).abs() <= bound8).all()
    finally:
        kernels.set_isa("auto")


# (N, K, group): SmolLM2's qkv / down / gate_up shapes, N not a multiple of 16, larger groups
@pytest.mark.parametrize("n,k,g", [(960, 576, 32), (576, 1536, 32), (3072, 576, 32), (100, 64, 32), (48, 256, 128),
                                   (37, 128, 64)], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 300])
def test_int4_linear_matches_the_dequantized_reference(n, k, g, m):
    t, x = _case(n, k, g, m, n * 7 + k + m)
    panels, sz = gemm.pack_int4_panels(quant.unpack_int4(t["qweight"]), t["scales"], t["zeros"], g)
    y = gemm.int4_linear(x, panels, sz, g, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    ref, bound = _reference(t, x)
    assert ((y.float() - ref).abs() <= bound).all(), (y.float() - ref).abs().max()
    # ATen's packed kernel (CPUs without AVX512-BF16) within twice the bound
    rt = _aten_runtime(t)
    ya = quant.int4_packed_mm(x, rt["packed"], rt["scales_and_zeros"], g, n)
    assert ((ya.float() - ref).abs() <= 2 * bound).all()


def test_int4_linear_input_scale_is_the_bf16_product():
    """The op's ``input_scale`` (AWQ's per-input-channel 1/s) gives bit for bit what multiplying
    x by it in PyTorch first gives."""
    t, x = _case(576, 1536, 32, 5, 3)
    panels, sz = gemm.pack_int4_panels(quant.unpack_int4(t["qweight"]), t["scales"], t["zeros"], 32)
    s = (torch.rand(1536, generator=torch.Generator().manual_seed(4)) * 3 + 0.1).to(torch.bfloat16)
    y = gemm.int4_linear(x, panels, sz, 32, 576, input_scale=s)
    assert torch.equal(y, gemm.int4_linear(x * s, panels, sz, 32, 576))
    with pytest.raises(RuntimeError, match="input_scale"):
        gemm.int4_linear(x, panels, sz, 32, 576, input_scale=s[:100])


def test_int4_panels_layout_and_errors():
    t, x = _case(40, 64, 32, 2, 0)
    q = quant.unpack_int4(t["qweight"])
    panels, sz = gemm.pack_int4_panels(q, t["scales"], t["zeros"], 32)
    assert panels.shape == (3, 8 * 64) and sz.shape == (3, 2, 2, 16)
    # 16-bit lane 2n + j of k-octet 0: q[n, 2s + j] in nibble s; padding columns hold q = 8
    lanes = panels.view(torch.int16).int() & 0xFFFF
    assert int(lanes[0, 2 * 5 + 1]) == sum(int(q[5, 2 * s + 1]) << 4 * s for s in range(4))
    assert int(lanes[2, 2 * 15]) == 0x8888
    with pytest.raises(ValueError, match="multiple of the group"):
        gemm.pack_int4_panels(q[:, :48], t["scales"], t["zeros"], 32)
    with pytest.raises(RuntimeError, match="group size"):
        gemm.int4_linear(x[:, :48].contiguous(), panels[:, :8 * 48].contiguous(), sz, 32, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemm.int4_linear(x.float(), panels, sz, 32, 40)


def test_int4_model_runs_through_the_kernel(smollm2_dir, prose_ids, h, monkeypatch):
    """SmolLM2 with int4 weights (bf16): every decoder Linear holds only the kernel's panels,
    prefill and decode steps call the kernel, and the greedy tokens equal those of the same
    model loaded for ATen's int4 kernel (the two differ only by float32 summation order) up
    to a bf16 near-tie."""
    from workers.layers import linear
    calls = []
    real = torch.ops.kvmesh.int4_linear.default
    monkeypatch.setattr(linear.INT4_NATIVE, "op", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    reqs = [("a", prose_ids[10:90], h.greedy(12)), ("b", prose_ids[120:150], h.greedy(12))]
    tokens = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(gemm, "int4_available", lambda: False)
        eng = h.make_engine(smollm2_dir, dtype="bfloat16", weight_format="int4", quant_group_size=32)
        layers = [m for m in eng.executor.runner.model.modules() if isinstance(m, linear.Linear) and m.format == "int4"]
        assert layers and all(m.method is (linear.INT4_NATIVE if native else linear.INT4_PACKED) for m in layers)
        if native:
            assert all(m._qnames == ["int4_panels", "int4_panel_sz"] for m in layers)
        captured = h.capture_logits(eng)
        h.run(eng, reqs)
        tokens[native] = list(captured)
        if native:
            assert min(calls) <= 2 and max(calls) >= 30      # decode rows and prefill chunks
            # the layers' bound arguments (Linear.fast) give what their buffers give, bit for bit
            assert all(m.fast is not None for m in layers)
            for m in layers:
                m.fast = None
            general = h.capture_logits(eng)
            h.run(eng, [(f"{r}-general", ids, p) for r, ids, p in reqs])
            assert all(torch.equal(a, b) for a, b in zip(tokens[True], general)) and len(general) == len(tokens[True])
    _same_greedy_or_near_tie(tokens[True], tokens[False], 4)


@pytest.mark.parametrize("n,k", [(49152, 576), (576, 1536), (100, 64), (37, 130)], ids=str)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 130])
def test_int8_linear_matches_the_dequantized_reference(n, k, m):
    if n * m > 49152 * 5:
        pytest.skip("a large lm_head prefill: covered by the smaller shapes")
    gen = torch.Generator().manual_seed(n + k + m)
    t = quant.quantize_int8(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    panels, scales = gemm.pack_int8_panels(t["qweight"], t["scales"])
    y = gemm.int8_linear(x, panels, scales, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    w = quant.dequantize_int8(t["qweight"], t["scales"].to(torch.bfloat16))
    ref = x.float() @ w.T
    bound = 2 ** -8 * ref.abs() + 1e-4 * (x.float().abs() @ w.abs().T)
    assert ((y.float() - ref).abs() <= bound).all(), (y.float() - ref).abs().max()
    if k % 32 == 0:           # ATen's int8 kernel crashes on K = 130 (torch 2.13); ours takes any K
        rt = _aten_runtime(t, "int8")
        ya = quant.int8_mm(x, rt["qweight"], rt["scales"])
        assert ((ya.float() - ref).abs() <= 2 * bound).all()


def test_int8_model_runs_through_the_kernel(smollm2_dir, prose_ids, h, monkeypatch):
    """SmolLM2 with int8 weights (bf16): every Linear holds only the kernel's panels and the
    greedy tokens equal those of the model loaded for ATen's int8 kernel, up to a bf16 near-tie."""
    from workers.layers import linear
    reqs = [("a", prose_ids[10:90], h.greedy(12)), ("b", prose_ids[120:150], h.greedy(12))]
    tokens = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(gemm, "int4_available", lambda: False)
        eng = h.make_engine(smollm2_dir, dtype="bfloat16", weight_format="int8")
        layers = [m for m in eng.executor.runner.model.modules() if isinstance(m, linear.Linear) and m.format == "int8"]
        assert layers and all(m.method is (linear.INT8_NATIVE if native else linear._QUANTIZED["int8"]) for m in layers)
        if native:
            assert all(m._qnames == ["int8_panels", "int8_panel_scales"] for m in layers)
        tokens[native] = h.capture_logits(eng)
        h.run(eng, reqs)
    _same_greedy_or_near_tie(tokens[True], tokens[False], 4)
