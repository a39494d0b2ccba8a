"""``kvmesh::gguf_linear`` (workers/kernels/csrc/gemm/gguf_gemm.cpp) against its PyTorch reference
(:func:`workers.kernels.reference.gguf_linear_ref`), on every path this CPU has (amx,
avx512vnni, avx2, scalar: each level this CPU has forced with ``workers.kernels.set_isa``, and
checked to run its own path, ``kernels.path("gguf_linear")``): both scale schemes, 4-, 6- and
8-bit lanes, groups of 16 and 32, N not a multiple of 16, row counts across the 4- and 8-row
register blocks, the 16-row AMX tiles and the 64-row cache blocks, float32 and bfloat16 x. The amx path
must give the avx512vnni path's outputs bit for bit (the same integers, the same float steps). The reference itself is checked against a plain
dequantize-then-matmul, so it cannot drift from the weights' meaning.

Tolerance: the integer parts are exact; the float32 scaling and sums in another order differ
by ~1e-6 of the sum of the terms' magnitudes (``|dx| * (|s| * sum |xq q| + |z| * |xsum|)``);
bfloat16 outputs may land on either side of a rounding boundary: one bfloat16 ulp (2^-7 relative)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.core.engine_config import _cpu_flags
from workers import kernels
from workers.kernels import gemm
from workers.kernels.reference import gguf_linear_bf16_ref, gguf_linear_ref, quantize_activations, unpack_gguf_qweight

pytestmark = pytest.mark.skipif(not gemm.gguf_available(), reason="the native kernels are not built here")

# the path of each level: avx512vnni needs AVX512-VNNI beyond the avx512 level (else avx2), amx AMX-INT8
_VNNI = "avx512_vnni" in _cpu_flags()
_VNNI_OR_AVX2 = "avx512vnni" if _VNNI else "avx2"
PATHS = {"amx": "amx" if _VNNI and "amx_int8" in _cpu_flags() else _VNNI_OR_AVX2, "avx512bf16": _VNNI_OR_AVX2,
         "avx512": _VNNI_OR_AVX2, "avx2": "avx2", "scalar": "scalar"}


def _levels():
    order = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]
    return order[: order.index(kernels.cpu_isa()) + 1]


@pytest.fixture
def set_level():
    """set_level(name): the kernels at that level (the CPU's best again afterwards)."""
    yield lambda name: kernels.set_isa(name)
    kernels.set_isa("auto")


def _weights(n, k, bits, G, scheme, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    if scheme == "flat":
        s = (torch.rand(n, k // G, generator=gen) * 0.02).half()
        z = (-s.float() * torch.randint(0, 2 ** bits, (n, k // G), generator=gen)).half()
        return q, gemm.pack_gguf_scales(s.float(), z.float(), torch.float16), None
    sc = torch.randint(-63, 64, (n, k // G), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 256, generator=gen) * 1e-3).half().float()
    if scheme == "k-sym":           # Q6_K's form: m = sc, dmin = 32 d, kept as sc and d alone
        return q, gemm.pack_gguf_scales(sc, None, torch.int8), gemm.pack_gguf_scales(d, None, torch.float16)
    m = torch.randint(0, 64, (n, k // G), generator=gen, dtype=torch.int8)
    dmin = (torch.rand(n, k // 256, generator=gen) * 1e-3).half().float()
    return q, gemm.pack_gguf_scales(sc, m, torch.int8), gemm.pack_gguf_scales(d, dmin, torch.float16)


def _dequantized(q, scales, supers, G):
    n, k = q.shape
    S = scales.shape[2]             # 1: m = sc, dmin = 32 d
    s = scales[:, :, 0, :].permute(0, 2, 1).reshape(-1, k // G)[:n].double()
    z = scales[:, :, S - 1, :].permute(0, 2, 1).reshape(-1, k // G)[:n].double()
    if supers is not None:
        sb = k // supers.shape[1]
        d = supers[:, :, 0, :].permute(0, 2, 1).reshape(-1, k // sb)[:n].double().repeat_interleave(sb // G, 1)
        dmin = supers[:, :, S - 1, :].permute(0, 2, 1).reshape(-1, k // sb)[:n].double().repeat_interleave(sb // G, 1)
        dmin = dmin * (32 if S == 1 else 1)
        s, z = d * s, -dmin * z
    return q.double() * s.repeat_interleave(G, 1) + z.repeat_interleave(G, 1)      # float64: exact


@pytest.mark.parametrize("bits,G,scheme", [(4, 32, "flat"), (6, 32, "flat"), (8, 32, "flat"), (4, 32, "k"), (6, 16, "k"),
                                           (6, 32, "k"), (8, 16, "k"), (4, 16, "k"), (6, 16, "k-sym"),
                                           (4, 32, "k-sym"), (8, 16, "k-sym")], ids=str)
@pytest.mark.parametrize("n,k", [(40, 256), (64, 512), (16, 768)], ids=str)
def test_kernel_matches_reference_on_every_path(bits, G, scheme, n, k, set_level):
    q, scales, supers = _weights(n, k, bits, G, scheme, seed=n + k + bits + G)
    qw = gemm.pack_gguf_qweight(q, bits)
    assert torch.equal(unpack_gguf_qweight(qw, bits, k)[:n], q)
    gen = torch.Generator().manual_seed(k)
    for level in _levels():
        assert set_level(level) == level and kernels.path("gguf_linear") == PATHS[level]
        # register blocks and their tails: avx2's and scalar's of 4, avx512vnni's of 8 (9 = 8 + 1,
        # 15 = 8 + 7); avx512vnni's 6-bit panels expanded per cache block of 16 rows or more (17,
        # 130 = 64 + 64 + 2: the last block of 2 unpacked in registers)
        for m in (1, 3, 5, 8, 9, 15, 17, 130):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
                x[0, 32:64] = 0                              # an all-zero block
                bias = torch.randn(n, generator=gen) if m == 3 else None
                y = gemm.gguf_linear(x, qw, scales, supers, bits, G, n, bias)
                if level == "amx" and dtype == torch.bfloat16 and m >= 32:
                    continue        # the amx path's bfloat16 route: test_amx_bf16_route_matches_its_reference
                ref = gguf_linear_ref(x, qw, scales, supers, bits, G, n, bias)
                assert y.dtype == dtype and y.shape == (m, n)
                qb = 32 if supers is None else k // supers.shape[1]
                xq, dx = quantize_activations(x, qb)
                w = _dequantized(q, scales, supers, G).double()
                mag = (dx.double().repeat_interleave(qb, 1) * xq.double()).abs() @ w.abs().T
                tol = 1e-5 * mag + (2 ** -7 * ref.double().abs() if dtype == torch.bfloat16 else 0)   # one bf16 ulp
                assert ((y.double() - ref.double()).abs() <= tol + 1e-30).all(), (level, m, dtype)


@pytest.mark.parametrize("bits,G,scheme", [(4, 32, "flat"), (6, 32, "flat"), (8, 32, "flat"), (4, 32, "k"), (6, 16, "k"),
                                           (8, 16, "k"), (4, 16, "k"), (6, 16, "k-sym"), (8, 32, "k-sym")], ids=str)
def test_amx_path_equals_the_vnni_path_bitwise(bits, G, scheme, set_level):
    """From 32 rows the amx path multiplies float32 x in AMX-INT8 tiles (rows padded to 16, k-quant
    m xsum as a tile product; bfloat16 x takes the AMX-BF16 route from 32 rows and avx512vnni's
    below); its outputs are the avx512vnni path's, bit for bit, below and above the 32-row
    threshold, with row tails, bias and both output dtypes."""
    if "amx" not in _levels():
        pytest.skip("this CPU has no AMX")
    n, k = 56, 1024 if G == 32 else 512
    q, scales, supers = _weights(n, k, bits, G, scheme, seed=7 * bits + G)
    qw = gemm.pack_gguf_qweight(q, bits)
    gen = torch.Generator().manual_seed(bits + G)
    for m in (15, 31, 32, 33, 47, 200):
        for dtype in (torch.float32, torch.bfloat16):
            if dtype == torch.bfloat16 and m >= 32:
                continue                                   # the bfloat16 route (next test)
            x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
            x[m // 2, :256] = 0                            # all-zero blocks and a whole zero super-block
            bias = torch.randn(n, generator=gen) if m == 33 else None
            out = {}
            for level in ("amx", "avx512"):
                set_level(level)
                out[level] = gemm.gguf_linear(x, qw, scales, supers, bits, G, n, bias)
            assert torch.equal(out["amx"], out["avx512"]), (m, dtype)


@pytest.mark.parametrize("bits,G,scheme", [(4, 32, "flat"), (6, 32, "flat"), (8, 32, "flat"), (4, 32, "k"), (6, 16, "k"),
                                           (8, 16, "k"), (4, 16, "k"), (6, 16, "k-sym"), (8, 32, "k-sym")], ids=str)
def test_amx_bf16_route_matches_its_reference(bits, G, scheme, set_level):
    """bfloat16 x of 32 rows or more on the amx path: the panels dequantized to bfloat16 and
    multiplied with AMX-BF16 tiles, x not quantized. Against :func:`gguf_linear_bf16_ref`
    (float64 sums of x and the bfloat16 weights): float32 sums in another order (~1e-6 of the
    terms' magnitudes), a weight whose float32 ``s q + z`` rounds to the other bfloat16
    neighbour (2^-8 of it), and the output's bfloat16 rounding (one ulp). Row tails (pairs of
    16-row tiles, an odd panel count) and bias covered."""
    if "amx" not in _levels():
        pytest.skip("this CPU has no AMX")
    set_level("amx")
    n, k = 40, 1024 if G == 32 else 512                    # 3 panels: a pair and a single one
    q, scales, supers = _weights(n, k, bits, G, scheme, seed=3 * bits + G)
    qw = gemm.pack_gguf_qweight(q, bits)
    w = _dequantized(q, scales, supers, G).to(torch.bfloat16).double()
    gen = torch.Generator().manual_seed(bits * G)
    for m in (32, 33, 56, 80, 300):       # 56: a 32-row block whose second tile is partial
        x = (torch.randn(m, k, generator=gen) * 2).bfloat16()
        bias = torch.randn(n, generator=gen) if m == 33 else None
        y = gemm.gguf_linear(x, qw, scales, supers, bits, G, n, bias)
        ref = gguf_linear_bf16_ref(x, qw, scales, supers, bits, G, n, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        mag = x.double().abs() @ w.abs().T
        tol = 2 ** -8 * mag + 1e-5 * mag + 2 ** -7 * ref.double().abs()
        assert ((y.double() - ref.double()).abs() <= tol + 1e-30).all(), m
        # and not the int8 route's numbers: x is not quantized here
        assert not torch.equal(y, gguf_linear_ref(x, qw, scales, supers, bits, G, n, bias))


def test_reference_is_dequantize_then_matmul():
    """The reference equals x (as the kernel quantizes it) @ W.T with W dequantized, in float64."""
    for bits, G, scheme in [(4, 32, "k"), (6, 16, "k"), (8, 16, "k"), (6, 16, "k-sym"), (8, 32, "flat"), (6, 32, "flat")]:
        q, scales, supers = _weights(24, 512, bits, G, scheme, seed=bits * G)
        qw = gemm.pack_gguf_qweight(q, bits)
        x = torch.randn(5, 512)
        qb = 32 if supers is None else 256
        xq, dx = quantize_activations(x, qb)
        xd = xq.double() * dx.double().repeat_interleave(qb, 1)
        want = xd @ _dequantized(q, scales, supers, G).double().T
        got = gguf_linear_ref(x.double(), qw, scales, supers, bits, G, 24)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_activation_quantization_rounds_half_to_even():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, -3.5         # inv = 1: 2.5 -> 2, -3.5 -> -4
    xq, dx = quantize_activations(x)
    assert xq[0, :3].tolist() == [127.0, 2.0, -4.0] and dx.tolist() == [[1.0]]
    q, scales, _ = _weights(16, 32, 8, 32, "flat", 0)
    qw = gemm.pack_gguf_qweight(torch.ones(16, 32, dtype=torch.uint8), 8)
    ones = gemm.pack_gguf_scales(torch.ones(16, 1), torch.zeros(16, 1), torch.float16)
    y = gemm.gguf_linear(x, qw, ones, None, 8, 32, 16)
    assert torch.equal(y[0], torch.full((16,), 125.0))        # 127 + 2 - 4, every column


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_native_packing_equals_the_torch_packing(bits):
    q = torch.randint(0, 2 ** bits, (37, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(gemm.pack_gguf_qweight(q, bits), gemm.pack_gguf_qweight_torch(q, bits))


def test_pack_layout_by_hand():
    q = torch.zeros(16, 8, dtype=torch.uint8)
    q[3] = torch.arange(8, dtype=torch.uint8) + 1                # column 3: k = 0..7 -> 1..8
    qw = gemm.pack_gguf_qweight_torch(q, 4)
    assert qw.shape == (1, 64)
    assert qw[0, 12:16].tolist() == [1 | 5 << 4, 2 | 6 << 4, 3 | 7 << 4, 4 | 8 << 4]
    q6 = q.clone()
    q6[3, 1], q6[7, 4] = 0x2A, 0x3F                              # high bits 10, 11
    qw6 = gemm.pack_gguf_qweight_torch(q6, 6)
    assert qw6.shape == (1, 96) and torch.equal(qw6[0, :64], gemm.pack_gguf_qweight(q6 & 15, 4)[0])
    # column 3, k 1: operand 0 byte 13 = lane 0, byte 13 -> bits 0-1 of byte 64 + 13; column 7, k 4:
    # operand 1 byte 28 = lane 1, byte 12 -> bits 2-3 of byte 80 + 12
    assert (qw6[0, 64 + 13] & 3) == 2 and ((qw6[0, 80 + 12] >> 2) & 3) == 3
    assert torch.equal(unpack_gguf_qweight(qw6, 6, 8), q6)
    qw8 = gemm.pack_gguf_qweight(torch.cat([q, q], dim=1)[:, :8], 8)
    assert qw8.shape == (1, 128) and qw8[0, 12:16].tolist() == [1, 2, 3, 4] and qw8[0, 64 + 12:64 + 16].tolist() == [5, 6, 7, 8]


def test_errors_name_the_argument():
    q, scales, supers = _weights(16, 256, 4, 32, "k", 1)
    qw = gemm.pack_gguf_qweight(q, 4)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        gemm.gguf_linear(x.half(), qw, scales, supers, 4, 32, 16)
    with pytest.raises(RuntimeError, match="qweight holds"):
        gemm.gguf_linear(torch.randn(2, 512), qw, scales, supers, 4, 32, 16)
    with pytest.raises(RuntimeError, match="scales must be contiguous int8"):
        gemm.gguf_linear(x, qw, scales.float(), supers, 4, 32, 16)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        gemm.gguf_linear(x, qw, scales, None, 4, 32, 16)
    with pytest.raises(RuntimeError, match="superscales must be contiguous float16"):
        gemm.gguf_linear(x, qw, scales, supers.float(), 4, 32, 16)
    with pytest.raises(RuntimeError, match=r"superscales must be .*\[P, K / SB, 1, 16\]"):
        gemm.gguf_linear(x, qw, scales[:, :, :1].contiguous(), supers, 4, 32, 16)      # sc alone, (d, dmin)
    with pytest.raises(ValueError, match="not exactly representable in torch.float16"):
        gemm.pack_gguf_scales(torch.full((16, 1), 70000.0), None, torch.float16)
    with pytest.raises(RuntimeError, match="bits must be 4, 6 or 8"):
        gemm.gguf_linear(x, qw, scales, supers, 5, 32, 16)
    with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
        gemm.gguf_linear(x, qw, scales, supers, 4, 32, 16, torch.zeros(15))
    with pytest.raises(RuntimeError, match=r"N \(17\)"):
        gemm.gguf_linear(x, qw, scales, supers, 4, 32, 17)
    with pytest.raises(ValueError, match="pack_gguf_qweight"):
        gemm.pack_gguf_qweight(q.int(), 4)
