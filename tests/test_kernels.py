"""Native CPU kernels (workers/kernels) against the PyTorch reference.

- ``kvmesh::paged_attention`` vs gather (``KVCache.read``) + SDPA
  (``workers.kernels.reference``) on random non-contiguous block tables with shared prefixes,
  mixed decode / verify / prefill-after-context batches, cascade groups, every cache dtype, GQA
  ratios 1/3/4/8, head dims 64/128, block sizes 16/32, on every ISA path this CPU has.
  Tolerances: float32 and quantized caches (dequantized exactly alike) 1e-5; bfloat16 / float16
  q and cache vs a float32 reference of the same inputs: the output's rounding (rtol 2^-8).
- ``kvmesh::reshape_and_cache`` bit-identical to ``KVCache.write`` (bytes and scales).
- ``torch.compile(fullgraph=True)`` calls the mutating op in place (no copy of the cache).
- The one ISA switch (csrc/isa.h): forced to each level this CPU has, every op runs that level's
  path (``kernels.paths()``, the table below) -- the attention, KV-write, norm, RoPE and SiLU
  tests here run at every level, the GEMMs' in test_gemm_kernel.py, test_quant_kernels.py and
  test_gguf_kernels.py; a level above the CPU's is lowered with one warning; an unknown name
  raises.
- The loader: cached build reused, ``KVMESH_KERNEL_ISA`` read at load, ``KVMESH_NATIVE_KERNELS=0``
  (the build and its cache: tests/test_kernel_build.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import logging

import pytest
import torch

from kvmesh.core.engine_config import _cpu_flags
from workers import kernels
from workers.kernels.reference import paged_attention_ref
from workers.kv_cache import KVCache

if not kernels.available():
    pytest.skip(f"native kernels cannot be built here: {kernels.unavailable_reason()}", allow_module_level=True)

RANK = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3, "amx": 4}
ISAS = [i for i in RANK if RANK[i] <= RANK[kernels.cpu_isa()]]
QUANT = (torch.int8, torch.float8_e4m3fn)
# paths whose work items of >= 9 rows of a bfloat16 q run the flash path (csrc/attn_flash.h),
# which rounds the softmax probabilities to bfloat16 before P V
FLASH = ("avx512bf16", "amx")


@pytest.fixture(params=ISAS)
def isa(request):
    assert kernels.set_isa(request.param) == request.param
    yield request.param
    kernels.set_isa("auto")


def expected_paths(level: str) -> dict[str, str]:
    """What each op runs at ``level`` (the C++ docstrings' rules: the nearest level at or below
    it that the op has code for)."""
    at = RANK[level]
    vnni = "avx512_vnni" in _cpu_flags()
    gguf = ("amx" if at >= 4 and vnni and "amx_int8" in _cpu_flags() else "avx512vnni" if at >= 2 and vnni
            else "avx2" if at >= 1 else "scalar")
    wide = "avx512" if at >= 2 else "scalar"             # norm, RoPE, SiLU: AVX-512F or baseline code
    return {"paged_attention": level, "reshape_and_cache": "avx2" if at >= 1 else "scalar", "bf16_linear": level,
            "int4_linear": "avx512bf16" if at >= 3 else "none", "int8_linear": "avx512bf16" if at >= 3 else "none",
            "gguf_linear": gguf, "rms_norm": wide, "rotary_bf16": wide, "silu_and_mul_bf16": wide}


def test_every_op_runs_the_forced_levels_path(isa):
    assert kernels.isa() == isa
    assert kernels.paths() == expected_paths(isa)


def test_a_level_above_the_cpus_is_lowered_once_and_an_unknown_one_raises(caplog):
    best = kernels.cpu_isa()
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.kernels"):
            for name in [n for n in RANK if RANK[n] > RANK[best]] * 2:
                assert kernels.set_isa(name) == best and kernels.isa() == best
        above = [n for n in RANK if RANK[n] > RANK[best]]
        assert [r.getMessage() for r in caplog.records] == [
            f"kvmesh: kernel ISA {n} is above this CPU's best; using {best}" for n in above]
        kernels.set_isa("scalar")
        with pytest.raises(RuntimeError, match="unknown kernel ISA 'sse9'"):
            kernels.set_isa("sse9")
        assert kernels.isa() == "scalar" and kernels.paths() == expected_paths("scalar")
    finally:
        kernels.set_isa("auto")
    assert kernels.isa() == best


def make_cache(nb, bs, kvh, d, dtype, gen, magnitude=1.0):
    vals = torch.randn(2, nb, bs, kvh, d, generator=gen) * magnitude
    if dtype in QUANT:
        cache = KVCache(torch.zeros(2, nb, bs, kvh, d, dtype=dtype), torch.zeros(2, nb, kvh))
        cache.write(vals[0].reshape(-1, kvh, d), vals[1].reshape(-1, kvh, d), torch.arange(nb * bs))
        return cache
    return KVCache(vals.to(dtype))


def make_batch(lens, ns, bs, nb, gen, shared=None):
    """Block tables ([S, W] int32, random distinct blocks, padded with -1 so that a read past
    a sequence's blocks would fail); ``shared``: {seq: (other seq, blocks)} copies the first
    blocks of another sequence's table (a shared prefix)."""
    width = max((n + bs - 1) // bs for n in lens) + 1
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = []
    for n in lens:
        need = (n + bs - 1) // bs
        tables.append([perm.pop() for _ in range(need)])
    for s, (o, k) in (shared or {}).items():
        tables[s][:k] = tables[o][:k]
    bt = torch.full((len(lens), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32)
    return qsl, torch.tensor(lens, dtype=torch.int32), bt


def check(out, ref, low_precision, bf16_probs=False):
    """``ref``: float32 reference of the same (possibly bfloat16) inputs; a low-precision
    ``out`` may differ by its own rounding (half an ulp: relative 2^-9 for bfloat16).
    ``bf16_probs``: the flash path (avx512bf16 or amx, bfloat16 q), which rounds the softmax
    probabilities to bfloat16 before P V (as ATen's bf16 flash attention does), and an int8 /
    float8 cache's dequantized K and V too: each weight is off by up to 2^-9 relative, so the output by up
    to 2^-9 max|V| more (|V| < 8 here: atol 2^-6); its error against ATen's bfloat16 SDPA is
    checked in test_flash_prefill_error_matches_aten_bf16_sdpa."""
    assert out.shape == ref.shape
    if bf16_probs:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -8, atol=2 ** -6)
    elif low_precision:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -8, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# (H, KVH, D, BS): GQA ratios 1, 3, 4, 8; head dims 64, 128; block sizes 16, 32
SHAPES = [(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 128, 32), (8, 1, 64, 32), (12, 4, 128, 16)]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.int8), (torch.float32, torch.int8), (torch.float32, torch.float8_e4m3fn),
          (torch.bfloat16, torch.float8_e4m3fn)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}KVH{}D{}BS{}".format(*s))
@pytest.mark.parametrize("qdt,kvdt", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
def test_mixed_batch_matches_reference(isa, shape, qdt, kvdt):
    h, kvh, d, bs = shape
    gen = torch.Generator().manual_seed(hash((shape, str(kvdt))) % 2 ** 31)
    # decodes of length 1, 15, 16, 17, 31, 33 and 1,100; a 4-token verify chunk; a 40-token
    # chunk after 60 cached; a chunk that is a whole fresh prompt (no context)
    lens = [1, 15, 16, 17, 31, 33, 1100, 37, 100, 24]
    ns = [1, 1, 1, 1, 1, 1, 1, 4, 40, 24]
    nb = sum((n + bs - 1) // bs for n in lens) + 20
    cache = make_cache(nb, bs, kvh, d, kvdt, gen)
    qsl, sl, bt = make_batch(lens, ns, bs, nb, gen, shared={5: (4, 1), 8: (6, 3)})
    q = torch.randn(int(qsl[-1]), h, d, generator=gen).to(qdt)
    out = kernels.paged_attention(q, cache.data, cache.scales, qsl, sl, bt, d ** -0.5)
    ref = paged_attention_ref(q.float(), cache.data, cache.scales, qsl, sl, bt, d ** -0.5, compute_dtype=torch.float32)
    check(out, ref, qdt != torch.float32 or kvdt == torch.bfloat16, isa in FLASH and qdt == torch.bfloat16)


@pytest.mark.parametrize("kvdt", [torch.float32, torch.int8], ids=str)
def test_long_prefill_after_context_and_a_single_long_decode(isa, kvdt):
    """A 300-token chunk after 1,300 cached (query tiles, causal diagonal across items) and a
    lone 1,600-token decode with 3 KV heads (split into several KV ranges, merged by LSE)."""
    h, kvh, d, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(7)
    for lens, ns in (([1600], [300]), ([1600], [1])):
        nb = 110
        cache = make_cache(nb, bs, kvh, d, kvdt, gen)
        qsl, sl, bt = make_batch(lens, ns, bs, nb, gen)
        q = torch.randn(int(qsl[-1]), h, d, generator=gen)
        out = kernels.paged_attention(q, cache.data, cache.scales, qsl, sl, bt, 0.125)
        check(out, paged_attention_ref(q, cache.data, cache.scales, qsl, sl, bt, 0.125), False)


@pytest.mark.parametrize("flash_isa", [i for i in FLASH if i in ISAS] or
                         [pytest.param("avx512bf16", marks=pytest.mark.skip(reason="the CPU has no AVX512-BF16"))])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (12, 2, 128)], ids=str)
def test_flash_prefill_error_matches_aten_bf16_sdpa(flash_isa, h, kvh, d):
    """The flash path (VDPBF16PS registers or AMX tiles) on long bfloat16 prefills (a 1,500-token
    prompt without context, 300 tokens after 1,300 cached): against the float32 reference its
    error is no larger than that of ATen's bfloat16 SDPA on the same inputs (the path it
    replaces; both round P to bfloat16), and it differs from the avx512 path (float32 P) by no
    more than that either."""
    bs = 16
    gen = torch.Generator().manual_seed(5)
    for lens, ns in (([1500], [1500]), ([1600], [300])):
        nb = 110
        cache = make_cache(nb, bs, kvh, d, torch.bfloat16, gen)
        qsl, sl, bt = make_batch(lens, ns, bs, nb, gen)
        q = torch.randn(int(qsl[-1]), h, d, generator=gen).to(torch.bfloat16)
        ref = paged_attention_ref(q.float(), cache.data, cache.scales, qsl, sl, bt, d ** -0.5, compute_dtype=torch.float32)
        aten = paged_attention_ref(q, cache.data, cache.scales, qsl, sl, bt, d ** -0.5).float()
        kernels.set_isa(flash_isa)
        try:
            flash = kernels.paged_attention(q, cache.data, cache.scales, qsl, sl, bt, d ** -0.5).float()
            kernels.set_isa("avx512")
            f32p = kernels.paged_attention(q, cache.data, cache.scales, qsl, sl, bt, d ** -0.5).float()
        finally:
            kernels.set_isa("auto")
        err, aten_err = (flash - ref).abs(), (aten - ref).abs()
        assert err.max() <= 1.05 * aten_err.max() and err.mean() <= 1.05 * aten_err.mean(), (err.max(), aten_err.max())
        assert (flash - f32p).abs().max() <= 2 * aten_err.max()
        assert (flash - f32p).abs().max() > 0          # the flash path ran (P in bfloat16), not the float32-P one


@pytest.mark.parametrize("qdt,kvdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                      (torch.float32, torch.float8_e4m3fn)], ids=str)
def test_cascade_groups(isa, qdt, kvdt):
    """Group 0: 3 decodes and a 5-token chunk share a 5-block prefix; group 1: 2 decodes share
    a 100-token prefix (not a whole number of blocks); one sequence is in no group. Equal to
    the reference over prefix + own keys, and to the same batch without cascade."""
    h, kvh, d, bs = 8, 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    own_lens = [6, 1, 11, 9, 20, 3, 50]
    ns = [1, 1, 1, 5, 1, 1, 1]
    groups = [0, 0, 0, 0, 1, 1, -1]
    plens = [5 * bs, 100]
    nb = 80
    cache = make_cache(nb, bs, kvh, d, kvdt, gen)
    qsl, sl, bt = make_batch(own_lens, ns, bs, nb, gen)
    pool = [b for b in torch.randperm(nb, generator=gen).tolist() if b not in set(bt.flatten().tolist())]
    pbt = torch.tensor([pool[:7], pool[7:14]], dtype=torch.int32)
    pg, pl = torch.tensor(groups, dtype=torch.int32), torch.tensor(plens, dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), h, d, generator=gen).to(qdt)
    out = kernels.paged_attention(q, cache.data, cache.scales, qsl, sl, bt, 0.3, pg, pbt, pl)
    ref = paged_attention_ref(q.float(), cache.data, cache.scales, qsl, sl, bt, 0.3, pg, pbt, pl, compute_dtype=torch.float32)
    low = qdt != torch.float32 or kvdt == torch.bfloat16
    check(out, ref, low, isa in FLASH and qdt == torch.bfloat16)
    if plens[0] % bs == 0:      # group 0 as plain sequences: prefix blocks + own blocks in one table
        rows = [0, 1, 2, 3]
        full = torch.full((4, 8), -1, dtype=torch.int32)
        for i in rows:
            nown = (own_lens[i] + bs - 1) // bs
            full[i, :5] = pbt[0, :5]
            full[i, 5:5 + nown] = bt[i, :nown]
        sub_qsl = qsl[:5] - qsl[0]
        plain = kernels.paged_attention(q[:int(qsl[4])], cache.data, cache.scales, sub_qsl,
                                        sl[:4] + plens[0], full, 0.3)
        # both outputs rounded to q's dtype: equal up to one rounding each
        torch.testing.assert_close(out[:int(qsl[4])].float(), plain.float(), rtol=2 ** -7 if low else 1e-5,
                                   atol=2 ** -6 if isa in FLASH and low else 1e-5)


def test_decode_attends_only_to_its_own_tokens():
    """Keys past seq_lens and in other sequences' blocks must not matter: poisoning them with
    huge values leaves the output unchanged."""
    gen = torch.Generator().manual_seed(11)
    cache = make_cache(40, 16, 2, 64, torch.float32, gen)
    qsl, sl, bt = make_batch([20, 7, 33], [1, 3, 1], 16, 40, gen)
    q = torch.randn(5, 4, 64, generator=gen)
    before = kernels.paged_attention(q, cache.data, None, qsl, sl, bt, 0.125)
    used = set()
    for s, n in enumerate(sl.tolist()):
        for p in range(n):
            used.add(int(bt[s, p // 16]) * 16 + p % 16)
    flat = cache.data.view(2, -1, 2, 64)
    for slot in range(flat.shape[1]):
        if slot not in used:
            flat[:, slot] = 1e4
    after = kernels.paged_attention(q, cache.data, None, qsl, sl, bt, 0.125)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 128, 32), (8, 1, 64, 16), (12, 4, 128, 16)],
                         ids=lambda s: "H{}KVH{}D{}BS{}".format(*s))
@pytest.mark.parametrize("kvdt", [torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
def test_bf16_decode_ignores_unwritten_slots(isa, shape, kvdt):
    """bfloat16 decode rows (<= 8 per KV head: the avx512bf16 decode pass reads K and V in
    whole 16-token chunks, widening an int8 / float8 cache to bfloat16 in registers): NaN
    (int8: 127) in every slot past a sequence's length (the tail of its last block) and in
    unused blocks changes nothing, bit for bit; the result matches the reference. Lengths 1,
    15, 16, 17, 33, 1,030 and 1,601; 2-token verify rows where G <= 4."""
    h, kvh, d, bs = shape
    g = h // kvh
    gen = torch.Generator().manual_seed(hash((shape, str(kvdt))) % 2 ** 31)
    lens = [1, 15, 16, 17, 33, 1030, 1601] + ([40, 18] if g <= 4 else [])
    ns = [1] * 7 + ([2, 2] if g <= 4 else [])
    nb = sum((n + bs - 1) // bs for n in lens) + 6
    cache = make_cache(nb, bs, kvh, d, kvdt, gen)
    qsl, sl, bt = make_batch(lens, ns, bs, nb, gen)
    q = torch.randn(int(qsl[-1]), h, d, generator=gen).to(torch.bfloat16)
    clean = kernels.paged_attention(q, cache.data, cache.scales, qsl, sl, bt, d ** -0.5)
    used = torch.zeros(nb * bs, dtype=torch.bool)
    for s, n in enumerate(sl.tolist()):
        for p in range(n):
            used[int(bt[s, p // bs]) * bs + p % bs] = True
    if kvdt in QUANT:         # byte 0x7f: int8 127, float8 e4m3fn NaN
        cache.data.view(torch.uint8).view(2, nb * bs, kvh, d)[:, ~used] = 0x7F
    else:
        cache.data.view(2, nb * bs, kvh, d)[:, ~used] = float("nan")
    out = kernels.paged_attention(q, cache.data, cache.scales, qsl, sl, bt, d ** -0.5)
    torch.testing.assert_close(out, clean, rtol=0, atol=0)
    ref = paged_attention_ref(q.float(), cache.data, cache.scales, qsl, sl, bt, d ** -0.5,
                              compute_dtype=torch.float32)
    check(out, ref, True, isa in FLASH)


def test_invalid_arguments_raise():
    gen = torch.Generator().manual_seed(0)
    cache = make_cache(8, 16, 2, 64, torch.float32, gen)
    qsl, sl, bt = make_batch([20], [1], 16, 8, gen)
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="block"):
        kernels.paged_attention(q, cache.data, None, qsl, sl, bt.clone().fill_(99), 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_attention(q, cache.data, None, qsl, sl.long(), bt, 0.1)
    with pytest.raises(RuntimeError, match="queries but seq_len"):
        kernels.paged_attention(torch.randn(30, 4, 64), cache.data, None, torch.tensor([0, 30], dtype=torch.int32),
                                sl, bt, 0.1)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.paged_attention(q, cache.data, torch.ones(2, 8, 2), qsl, sl, bt, 0.1)
    with pytest.raises(RuntimeError, match="beyond the cache"):
        kernels.reshape_and_cache(torch.randn(1, 2, 64), torch.randn(1, 2, 64), cache.data, None,
                                  torch.tensor([8 * 16]))


# ---- reshape_and_cache -------------------------------------------------------------------

def _write_steps(bs, gen):
    """(slots, magnitude) of successive writes: prefill chunks spanning several blocks, one
    starting mid-block, decodes of several sequences (one per sequence, some at slot 0 of a
    block holding a previous owner's values), a chunk restarting a used block."""
    return [
        (list(range(3 * bs, 3 * bs + 2 * bs + 5)), 1.0),             # 2 full blocks + 5 tokens
        (list(range(3 * bs + 2 * bs + 5, 3 * bs + 4 * bs)), 3.0),     # rest of the chunk, mid-block start
        ([10 * bs + 4, 7 * bs, 3 * bs + 4 * bs], 0.5),                # decodes; 7*bs restarts block 7
        ([5 * bs + 1], 100.0),                                        # decode raising a block's scale
        ([7 * bs + 1, 10 * bs + 5, 12 * bs], 1e-3),                   # decodes with tiny values
        (list(range(4 * bs, 4 * bs + bs // 2)), 2.0),                 # chunk restarting block 4
    ]


@pytest.mark.parametrize("kvdt", [torch.int8, torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("indt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bs", [16, 32])
def test_reshape_and_cache_is_bit_identical_to_kvcache_write(isa, kvdt, indt, bs):
    kvh, d, nb = 3, 64, 16
    gen = torch.Generator().manual_seed(bs)
    init = make_cache(nb, bs, kvh, d, kvdt, gen, magnitude=2.0)   # a previous owner's values
    ref = KVCache(init.data.clone(), None if init.scales is None else init.scales.clone())
    nat = KVCache(init.data.clone(), None if init.scales is None else init.scales.clone())
    for slots, mag in _write_steps(bs, gen):
        k = (torch.randn(len(slots), kvh, d, generator=gen) * mag).to(indt)
        v = (torch.randn(len(slots), kvh, d, generator=gen) * mag).to(indt)
        sm = torch.tensor(slots)
        ref.write(k, v, sm)
        kernels.reshape_and_cache(k, v, nat.data, nat.scales, sm)
        assert torch.equal(nat.data.view(torch.uint8), ref.data.view(torch.uint8))
        if kvdt in QUANT:
            assert torch.equal(nat.scales, ref.scales)


def test_fp8_scale_at_powers_of_two(isa):
    """Block amax / 448 exactly at and one float above / below a power of two (where
    ceil(log2(.)) is decided by the last bit) gives the same scale as KVCache.write."""
    kvh, d, bs = 1, 8, 16
    for k in (-20, -3, 0, 1, 5):
        for step in (-1, 0, 1):
            p = torch.tensor(448.0 * 2.0 ** k)
            amax = p if step == 0 else torch.nextafter(p, torch.tensor(float("inf") if step > 0 else 0.0))
            x = torch.zeros(1, kvh, d)
            x[0, 0, 3] = amax
            caches = [KVCache(torch.zeros(2, 2, bs, kvh, d, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, kvh))
                      for _ in range(2)]
            caches[0].write(x, -x, torch.tensor([bs]))
            kernels.reshape_and_cache(x, -x, caches[1].data, caches[1].scales, torch.tensor([bs]))
            assert torch.equal(caches[0].scales, caches[1].scales), (k, step)
            assert torch.equal(caches[0].data.view(torch.uint8), caches[1].data.view(torch.uint8))


# ---- torch.compile ------------------------------------------------------------------------

def test_compiled_write_and_attend_mutate_the_cache_in_place():
    """fullgraph compile of write + attention: outputs equal eager, the cache and scales are
    updated in place, and the generated code allocates nothing of the cache's size (no clone
    by auto-functionalization)."""
    from torch._inductor.utils import run_and_get_code

    nb, bs, kvh, d = 4096, 16, 3, 64            # a 75 MiB int8 cache would show in any clone
    gen = torch.Generator().manual_seed(5)
    data = torch.zeros(2, nb, bs, kvh, d, dtype=torch.int8)
    scales = torch.zeros(2, nb, kvh)
    qsl, sl, bt = make_batch([40, 1], [8, 1], bs, nb, gen)
    slots = torch.tensor([int(bt[0, p // bs]) * bs + p % bs for p in range(32, 40)]
                         + [int(bt[1, 0]) * bs], dtype=torch.long)

    def step(q, k, v, data, scales):            # through the Python wrappers (traced without breaks)
        kernels.reshape_and_cache(k, v, data, scales, slots)
        return kernels.paged_attention(q, data, scales, qsl, sl, bt, 0.125) * 2

    q, k, v = torch.randn(9, 9, d, generator=gen), torch.randn(9, kvh, d, generator=gen), torch.randn(9, kvh, d, generator=gen)
    eager_data, eager_scales = data.clone(), scales.clone()
    expect = step(q, k, v, eager_data, eager_scales)
    ptr = data.data_ptr()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    got, codes = run_and_get_code(compiled, q, k, v, data, scales)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert data.data_ptr() == ptr
    assert torch.equal(data, eager_data) and torch.equal(scales, eager_scales)
    code = "\n".join(codes)
    assert "kvmesh.reshape_and_cache" in code and "kvmesh.paged_attention" in code
    assert not any(f"{2}, {nb}, {bs}, {kvh}, {d}" in ln and ("empty" in ln or "clone" in ln or "copy" in ln)
                   for ln in code.splitlines())


# ---- loader ---------------------------------------------------------------------------------

def _child(env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr, level=logging.WARNING)\n"
            "from workers import kernels; print(kernels.available(), kernels.isa())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_loader_reuses_the_build_and_honours_the_isa_and_off_switches():
    r = _child({"KVMESH_KERNEL_ISA": "scalar"})
    assert r.stdout.split() == ["True", "scalar"], r.stderr
    assert "compiling" not in r.stderr                   # the build directory's library is reused
    r = _child({"KVMESH_KERNEL_ISA": "avx9000"})
    assert r.stdout.split() == ["True", kernels.cpu_isa()] and "unknown KVMESH_KERNEL_ISA" in r.stderr, r.stderr
    if kernels.cpu_isa() != "amx":                       # above this CPU: lowered, with one warning
        r = _child({"KVMESH_KERNEL_ISA": "amx"})
        assert r.stdout.split() == ["True", kernels.cpu_isa()], r.stderr
        assert r.stderr.count("is above this CPU's best") == 1, r.stderr
    r = _child({"KVMESH_NATIVE_KERNELS": "0"})
    assert r.stdout.split() == ["False", "none"], r.stderr
    assert "KVMESH_NATIVE_KERNELS=0" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # the directory this (loaded) process names is the one the children reused: loading must not
    # change the key (torch's loader appends to the flag lists it is given)
    from workers.kernels import build
    assert build.is_built() and build.KERNELS.library().is_file()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rms_norm_matches_the_model_norm(isa, dtype):
    """kvmesh::rms_norm / add_rms_norm against workers.models.llama.RMSNorm's PyTorch
    expression: the residual sum is bit-identical (rounded to dtype first, as the model does);
    the norm agrees to float32 rounding (its mean is summed in another order). At every level
    (bfloat16: the AVX-512F loop at avx512 and above, the baseline one below)."""
    assert kernels.path("rms_norm") == expected_paths(isa)["rms_norm"]
    from workers.models.llama import RMSNorm
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    for rows in (1, 5, 40):
        x = (3 * torch.randn(rows, 576, generator=g)).to(dtype)
        r = torch.randn(rows, 576, generator=g).to(dtype)
        ref, (ref2, ref_sum) = norm(x), norm(x, r)
        norm.native = True
        try:
            y, (y2, y_sum) = norm(x), norm(x, r)
        finally:
            norm.native = False
        assert y.dtype == dtype and y2.dtype == dtype and torch.equal(y_sum, ref_sum)
        tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7      # one unit of the last place
        for a, b in ((y, ref), (y2, ref2)):
            assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (a.float() - b.float()).abs().max()
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.kvmesh.rms_norm(x, norm.weight[:5], 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.kvmesh.add_rms_norm(x, r[:, :5].contiguous(), norm.weight, 1e-5)


def test_rotary_bf16_is_bit_identical_to_the_model_rotation(isa):
    """kvmesh::rotary_bf16 on a strided q/k view of a fused qkv projection equals
    RotaryEmbedding.rotate bit for bit (same bfloat16 rounding of every op), at every level."""
    assert kernels.path("rotary_bf16") == expected_paths(isa)["rotary_bf16"]
    from workers.layers.rotary import RotaryEmbedding
    rope = RotaryEmbedding(64, 4096, 10000.0)
    g = torch.Generator().manual_seed(5)
    for T in (1, 7, 300):
        qkv = (4 * torch.randn(T, 15 * 64, generator=g)).to(torch.bfloat16)
        x = qkv[:, : 12 * 64].view(T, 12, 64)              # row stride 960, not 768
        cos, sin = rope.cos_sin(torch.randint(0, 4000, (T,), generator=g), torch.bfloat16)
        got = torch.ops.kvmesh.rotary_bf16(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, rope.rotate(x, cos, sin))
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvmesh.rotary_bf16(x.float(), cos, sin)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.kvmesh.rotary_bf16(x, cos[:2], sin)


def test_silu_and_mul_bf16_matches_the_model_activation(isa):
    """``kvmesh::silu_and_mul_bf16`` against workers.models.llama.silu_and_mul in bfloat16:
    at most one bfloat16 ulp apart (the two exp implementations differ in the last float32
    bits), nearly all bit-identical; widths that are not a multiple of 16 (the scalar tail);
    at every level."""
    assert kernels.path("silu_and_mul_bf16") == expected_paths(isa)["silu_and_mul_bf16"]
    from workers.models.llama import silu_and_mul
    gen = torch.Generator().manual_seed(2)
    for T, inter in ((1, 1536), (37, 1536), (5, 4864 + 3)):
        x = (torch.randn(T, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
        x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 3.0, -3.0])
        got, ref = torch.ops.kvmesh.silu_and_mul_bf16(x), silu_and_mul(x)
        ulp = (got.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
        assert ulp.max() <= 1 and (ulp == 0).float().mean() > 0.99
    with pytest.raises(RuntimeError, match="silu_and_mul_bf16"):
        torch.ops.kvmesh.silu_and_mul_bf16(torch.zeros(2, 3, dtype=torch.bfloat16))
