"""The native bf16-weight GEMM (workers/kernels/gemm.py, workers/kernels/csrc/gemm/).

Reference: float64 ``x @ bf16(W).T + b``. Tolerances (elementwise, ``S = |x| @ |W|.T + |b|``,
the scale of fp32 accumulation error):

- fp32 activations: ``|y - ref| <= 1e-4 * S`` (fp32 sums in another order);
- bf16 activations (bf16 output): ``|y - ref| <= 2**-8 * |ref| + 1e-4 * S`` (the output is one
  bf16 rounding, at most half an ulp = 2**-8 relative, from the fp32 sum).

Every kernel level this CPU has (``workers.kernels.set_isa``) runs the same cases, each checked
to run its own micro-kernels (``kernels.path("bf16_linear")``); levels it lacks are skipped. Shapes include N, K that are not multiples of the 16 x 2 block, the SmolLM2
projections and lm_head, M across the row blocking (1, 3, 8, 33, 257: 257 also takes the
k-blocked, several-row-chunk path).
"""

from __future__ import annotations

import os

import pytest
import torch

from workers import kernels
from workers.kernels import gemm

ISAS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")


@pytest.fixture(scope="module")
def best_isa():
    if os.environ.get("KVMESH_NATIVE_KERNELS") == "0":
        pytest.skip("native kernels disabled by KVMESH_NATIVE_KERNELS=0")
    assert kernels.available(), "the kernels failed to build/load (see the warning)"
    assert kernels.set_isa("auto") == kernels.cpu_isa()
    return kernels.cpu_isa()


@pytest.fixture(params=ISAS)
def isa(request, best_isa):
    if ISAS.index(request.param) > ISAS.index(best_isa):
        pytest.skip(f"CPU lacks {request.param} (best: {best_isa})")
    assert kernels.set_isa(request.param) == request.param
    assert kernels.path("bf16_linear") == request.param
    yield request.param
    kernels.set_isa("auto")


_cache: dict = {}


def _case(n: int, k: int, m: int, bias: bool, seed: int = 0):
    """(x fp32 [m, k], W [n, k], b or None, packed, ref float64, S float64), cached."""
    key = (n, k, m, bias, seed)
    if key not in _cache:
        g = torch.Generator().manual_seed(seed + 1000 * n + k)
        w = torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        wd = w.to(torch.bfloat16).double()
        ref = x.double() @ wd.T
        scale = x.double().abs() @ wd.abs().T
        if b is not None:
            ref, scale = ref + b.double(), scale + b.double().abs()
        _cache.clear() if len(_cache) > 8 else None
        _cache[key] = (x, w, b, gemm.pack_bf16_weight(w), ref, scale)
    return _cache[key]


def _check_fp32(y, ref, scale):
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    bad = err > 1e-4 * scale
    assert not bad.any(), f"max err/S {(err / scale).max().item():.3g} at {bad.nonzero()[0].tolist()}"


def _check_bf16(y, x, w, b):
    xb = x.to(torch.bfloat16)
    wd = w.to(torch.bfloat16).double()
    ref = xb.double() @ wd.T
    scale = xb.double().abs() @ wd.abs().T
    if b is not None:
        ref, scale = ref + b.double(), scale + b.double().abs()
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    bad = err > 2.0 ** -8 * ref.abs() + 1e-4 * scale
    assert not bad.any(), f"{bad.sum().item()} bad, first at {bad.nonzero()[0].tolist()}"


SHAPES = [(17, 33), (33, 17), (1, 1), (960, 576), (576, 1536)]   # (N, K) = (out, in)
MS = [1, 3, 8, 33, 257]


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference(isa, n, k):
    for i, m in enumerate(MS):
        x, w, b, p, ref, scale = _case(n, k, m, bias=i % 2 == 0)
        _check_fp32(gemm.bf16_linear(x, p, n, b), ref, scale)
        _check_bf16(gemm.bf16_linear(x.to(torch.bfloat16), p, n, b), x, w, b)


def test_lm_head(isa):
    n, k = 49152, 576
    for m in ([1] if isa == "scalar" else [1, 8]):
        x, w, b, p, ref, scale = _case(n, k, m, bias=False)
        _check_fp32(gemm.bf16_linear(x, p, n), ref, scale)


def test_two_threads_and_layouts(best_isa):
    """Thread partitions that split row chunks; non-contiguous x; leading dims; odd K."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n, k, m in [(960, 576, 257), (576, 1536, 33), (33, 17, 3)]:
            x, w, b, p, ref, scale = _case(n, k, m, bias=True)
            _check_fp32(gemm.bf16_linear(x, p, n, b), ref, scale)
            xt = x.T.contiguous().T                      # same values, column-major
            assert not xt.is_contiguous()
            _check_fp32(gemm.bf16_linear(xt, p, n, b), ref, scale)
            y3 = gemm.bf16_linear(x.reshape(1, m, k), p, n, b)
            assert y3.shape == (1, m, n)
            _check_fp32(y3[0], ref, scale)
    finally:
        torch.set_num_threads(old)


def test_pack_layout_and_rounding(best_isa):
    w = torch.randn(37, 9, dtype=torch.float64)
    w[0, 0] = 1.0 + 2.0 ** -8            # a tie: rounds to even (1.0), truncation agrees
    w[0, 1] = 1.0 + 3 * 2.0 ** -9        # rounds up to 1 + 2**-7 (truncation would not)
    p = gemm.pack_bf16_weight(w)
    assert p.dtype == torch.bfloat16 and p.shape == (3, 16, 16, 2)     # K padded to 32 (AMX tiles)
    wb = torch.zeros(48, 32, dtype=torch.bfloat16)
    wb[:37, :9] = w.to(torch.bfloat16)
    expect = wb.view(3, 16, 16, 2).permute(0, 2, 1, 3)
    assert torch.equal(p, expect)
    assert p[0, 0, 0, 1].item() == 1.0 + 2.0 ** -7
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(gemm.pack_bf16_weight(w.to(dtype)), gemm.pack_bf16_weight(w.to(dtype).float()))


def test_errors(best_isa):
    x, w, b, p, _, _ = _case(17, 33, 3, bias=True)
    with pytest.raises(RuntimeError, match="K=32"):
        gemm.bf16_linear(x[:, :32], p, 17)             # packed for K=33 (33 or 34)
    with pytest.raises(RuntimeError, match="N=40"):
        gemm.bf16_linear(x, p, 40)                     # packed has 2 panels: N in 17..32
    with pytest.raises(RuntimeError, match="bias"):
        gemm.bf16_linear(x, p, 17, b[:5])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        gemm.bf16_linear(x.double(), p, 17)
    with pytest.raises(RuntimeError, match="packed"):
        gemm.bf16_linear(x, p.float(), 17)
    with pytest.raises(RuntimeError, match="2-D floating"):
        gemm.pack_bf16_weight(torch.ones(4, 4, dtype=torch.int32))
    # the level is the process's (workers.kernels.set_isa; test_kernels.py: unknown names, a level
    # above the CPU's), not a variable read per call
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVMESH_KERNEL_ISA", "sse9")
        _check_bf16(gemm.bf16_linear(x.to(torch.bfloat16), p, 17, b), x, w, b)
        assert kernels.path("bf16_linear") == best_isa


def test_amx_tiles_coexist_with_aten(best_isa):
    """The AMX path leaves the tile state as ATen's own AMX matmuls (oneDNN) expect it: bf16
    matmuls in ATen before, between and after the kernel's calls stay exact, and the kernel
    agrees with the vdpbf16ps path at row counts around the 16-row tiles."""
    if best_isa != "amx":
        pytest.skip(f"CPU lacks AMX-BF16 (best: {best_isa})")
    g = torch.Generator().manual_seed(7)
    a = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    bm = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    expect = (a.double() @ bm.double())
    # row tails: the partial 16-row tile alone (15, 33, 100) or after a whole one in a 32-row
    # block (17); K = 4864 in one k-block (AMX row chunks keep all of K)
    for n, k, m in [(576, 1536, m) for m in (4, 15, 16, 17, 31, 32, 33, 64, 100)] + [(80, 4864, 100)]:
        x, w, b, p, ref, scale = _case(n, k, m, bias=True)
        xb = x.to(torch.bfloat16)
        y_amx = gemm.bf16_linear(xb, p, n, b)
        mid = (a @ bm).double()
        kernels.set_isa("avx512bf16")
        try:
            y_dp = gemm.bf16_linear(xb, p, n, b)
        finally:
            kernels.set_isa("auto")
        _check_bf16(y_amx, x, w, b)
        assert (y_amx.float() - y_dp.float()).abs().max() <= 2e-2 * scale.max(), m
        assert torch.allclose(mid, expect, rtol=2e-2, atol=0.5), m


def test_torch_compile_fullgraph(best_isa):
    """The ops are opaque to torch.compile (fakes registered) and agree with eager."""
    x, w, b, p, ref, scale = _case(960, 576, 8, bias=True)
    checks = ("test_schema", "test_faketensor")   # the full opcheck adds ~5 s of aot tests
    torch.library.opcheck(torch.ops.kvmesh.bf16_linear.default, (x, p, 960, b), test_utils=checks)
    torch.library.opcheck(torch.ops.kvmesh.pack_bf16_weight.default, (w,), test_utils=checks)

    def f(x, p, b):
        h = gemm.bf16_linear(x * 2.0, p, 960, b)
        return torch.relu(h) + 1.0

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    y = compiled(x, p, b)
    expect = torch.relu(2.0 * ref - b.double()) + 1.0   # (2 x) W^T + b; x * 2 is exact
    err = (y.double() - expect).abs()
    assert (err <= 2e-4 * scale).all(), (err / scale).max()


def test_packed_panels_move_to_huge_pages_unchanged(best_isa, monkeypatch, h):
    """pack_bf16_linears puts the panels in one mapping advised MADV_HUGEPAGE (workers/huge_pages.py):
    same values, same outputs as where they are without huge pages (THP never: ``available`` False)."""
    from workers import huge_pages
    from workers.layers.linear import Linear, pack_bf16_linears
    if not huge_pages.available():
        pytest.skip("no transparent huge pages here (THP never, or not Linux)")

    def model():
        torch.manual_seed(3)
        m = torch.nn.Sequential(Linear(96, 160, bias=False), Linear(160, 64, bias=True))
        for lin in m:
            lin.weight = torch.nn.Parameter(torch.randn(lin.in_features, lin.out_features).to(torch.bfloat16),
                                            requires_grad=False)
            if lin.bias is not None:
                lin.bias = torch.nn.Parameter(torch.randn(lin.out_features), requires_grad=False)
        return m

    x = torch.randn(5, 96).to(torch.bfloat16)
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    plain = model()
    assert pack_bf16_linears(plain, torch.bfloat16, torch.device("cpu")) == 2
    monkeypatch.undo()
    huge = model()
    assert pack_bf16_linears(huge, torch.bfloat16, torch.device("cpu")) == 2
    for a, b in zip(plain, huge):
        assert torch.equal(a.bf16_panels, b.bf16_panels)
        assert b.bf16_panels.data_ptr() % 4096 == 0
        assert h.vma_flags(b.bf16_panels.data_ptr()).get("VmFlags", "").split().count("hg") == 1   # MADV_HUGEPAGE
        # the plain panels' own allocation, checked by storage: VmFlags could say "hg" there too,
        # since NumPy advises its large heap allocations MADV_HUGEPAGE and the heap is reused
        assert a.bf16_panels.untyped_storage().nbytes() == a.bf16_panels.nbytes
        assert b.bf16_panels.untyped_storage().nbytes() % huge_pages.HUGE_PAGE == 0
    assert torch.equal(plain(x), huge(x))
