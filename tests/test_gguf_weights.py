"""Weight format ``gguf``: the published GGUF's block-quantized weights served as they are.

- :mod:`workers.quant.gguf_blocks` decodes every block format kvmesh serves (Q4_0, Q4_1, Q5_0,
  Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) to the kernel's integer representation, bit-exact against
  the ``gguf`` package's own dequantization (an independent implementation), on random blocks
  of every type and on every tensor type of the pinned SmolLM2 file; stacking parts (q/k/v,
  gate/up) in one representation is exact.
- :mod:`workers.gguf_checkpoint` loads SmolLM2's GGUF (llama architecture: q/k rows permuted
  by llama.cpp's converter) to the very float32 weights transformers dequantizes from the same
  file, and the engine's float32 greedy tokens in the reference path (dequantize + matmul)
  equal transformers' on that model.
- Through the ``gguf_linear`` kernel (int8 activations per 32 values, integer dot products),
  the model's logits stay within the int8 activation rounding of the reference path and the
  greedy tokens agree up to a near-tie.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.quant import gguf_blocks

TYPES = list(gguf_blocks.BLOCK)


def _random_blocks(ggml_type: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random bytes in the block layout of ``ggml_type`` whose float16 scale fields hold
    finite, moderate values: uint8 ``[rows, row bytes]``."""
    from gguf import GGMLQuantizationType
    bv, bb = gguf_blocks.BLOCK[ggml_type]
    rng = np.random.default_rng(seed)
    blk = rng.integers(0, 256, size=(rows, k // bv, bb), dtype=np.uint8)
    scales = (rng.standard_normal((rows, k // bv, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if ggml_type == "Q6_K":
        blk[..., 208:210] = scales[..., 0:2]
    else:
        blk[..., 0:4] = scales.reshape(rows, k // bv, 4)
    assert GGMLQuantizationType[ggml_type]
    return blk.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_columns_cut_on_block_boundaries_dequantize_to_the_same_values(ggml_type):
    """A tensor-parallel rank's input columns of a row-parallel weight (workers/tensor_parallel.py)."""
    u = gguf_blocks.unpack(ggml_type, torch.from_numpy(_random_blocks(ggml_type, 5, 1024, seed=3)), 1024)
    assert torch.equal(u.cols(256, 768).dequantize(), u.dequantize()[:, 256:768])
    with pytest.raises(ValueError, match="do not fall on the"):
        u.cols(0, 16 if ggml_type.endswith("_K") else 100)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_unpack_equals_the_gguf_package_dequantization(ggml_type):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    k = 512
    raw = _random_blocks(ggml_type, 7, k, seed=len(ggml_type) * 31 + k)
    u = gguf_blocks.unpack(ggml_type, torch.from_numpy(raw), k)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[ggml_type])).reshape(7, k).float()
    assert u.q.dtype == torch.uint8 and int(u.q.max()) < 2 ** u.bits
    assert u.bits == (4 if ggml_type in ("Q4_0", "Q4_1", "Q4_K") else 8 if ggml_type == "Q8_0" else 6)
    assert u.group == (16 if ggml_type == "Q6_K" else 32)
    assert torch.equal(u.dequantize(), ref)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_native_unpack_equals_the_torch_reference(ggml_type):
    """kvmesh::gguf_unpack (the load path where the kernels are built) gives the very tensors of
    unpack_torch, rows split across threads included (37 rows, K of 3 super-blocks)."""
    from workers.kernels import gemm
    if not gemm.gguf_available():
        pytest.skip("native kernels unavailable")
    k = 768
    raw = torch.from_numpy(_random_blocks(ggml_type, 37, k, seed=len(ggml_type) * 7 + 3))
    q, a, b, d, dmin = gemm.gguf_unpack(raw, ggml_type, k)
    ref = gguf_blocks.unpack_torch(ggml_type, raw, k)
    for got, want in ((q, ref.q), (a, ref.a), (b, ref.b), (d, ref.d), (dmin, ref.dmin)):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and torch.equal(got, want)
    u = gguf_blocks.unpack(ggml_type, raw, k)
    assert (u.bits, u.group, u.scheme) == (ref.bits, ref.group, ref.scheme) and torch.equal(u.q, ref.q)
    with pytest.raises(RuntimeError, match="needs"):
        gemm.gguf_unpack(raw[:, :-1], ggml_type, k)


def test_unpack_rejects_what_it_cannot_serve():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        gguf_blocks.unpack("IQ2_XXS", torch.zeros(1, 66, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="needs 144 bytes"):
        gguf_blocks.unpack("Q4_K", torch.zeros(1, 140, dtype=torch.uint8), 256)
    raw = torch.from_numpy(_random_blocks("Q8_0", 1, 32, 0)).clone()
    raw[0, 0:2] = torch.tensor([0xFF, 0x7B], dtype=torch.uint8)      # d = 65504: -128 d overflows float16
    with pytest.raises(ValueError, match="not exactly representable in float16"):
        gguf_blocks.unpack("Q8_0", raw, 32)
    with pytest.raises(ValueError, match="not exactly representable in float16"):
        gguf_blocks.unpack_torch("Q8_0", raw, 32)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_0", "Q5_0", "Q8_0"), ("Q4_1", "Q8_0"),
                                   ("Q4_K", "Q5_K")], ids="+".join)
def test_stack_is_exact(types):
    k = 512
    parts = [gguf_blocks.unpack(t, torch.from_numpy(_random_blocks(t, 5 + i, k, i)), k) for i, t in enumerate(types)]
    s = gguf_blocks.stack(parts)
    assert s.bits == max(p.bits for p in parts) and s.group == min(p.group for p in parts)
    assert torch.equal(s.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_stack_refuses_mixed_schemes():
    k = 256
    a = gguf_blocks.unpack("Q4_K", torch.from_numpy(_random_blocks("Q4_K", 2, k, 1)), k)
    b = gguf_blocks.unpack("Q8_0", torch.from_numpy(_random_blocks("Q8_0", 2, k, 2)), k)
    with pytest.raises(ValueError, match="schemes"):
        gguf_blocks.stack([a, b])


@pytest.mark.parametrize("ggml_type", ["Q5_0", "Q8_0", "Q6_K"])
def test_to_q4_1_is_llama_cpps_q4_1_of_the_exact_values(ggml_type):
    """A wider-lane weight requantized to Q4_1 (a draft model's fewer bytes): 4-bit lanes, flat,
    groups of 32, every value within half a step (plus the float16 rounding of the group's
    scale and minimum) of the exact weight, as close on average as the ``gguf`` package's own
    Q4_1 of the same values; a 4-bit weight is left as it is."""
    from gguf import GGMLQuantizationType, quants
    k = 512
    u = gguf_blocks.unpack(ggml_type, torch.from_numpy(_random_blocks(ggml_type, 40, k, 3)), k)
    w = u.dequantize()
    r = gguf_blocks.to_q4_1(u, rows=16)                      # rows in pieces: 16, 16, 8
    assert (r.bits, r.scheme, r.group, r.shape) == (4, "flat", 32, (40, k)) and int(r.q.max()) <= 15
    assert torch.equal(r.a.half().float(), r.a) and torch.equal(r.b.half().float(), r.b)
    err = (r.dequantize() - w).abs().view(40, k // 32, 32)
    tol = r.a / 2 + (15 * r.a + r.b.abs()) * 2.0 ** -10
    assert (err <= tol[..., None]).all()
    theirs = quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    assert err.mean() <= (torch.from_numpy(theirs) - w).abs().mean() * 1.01
    q4 = gguf_blocks.unpack("Q4_K", torch.from_numpy(_random_blocks("Q4_K", 2, 256, 4)), 256)
    assert gguf_blocks.to_q4_1(q4) is q4


# ---- the pinned SmolLM2 file -----------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_gguf_hf(smollm2_dir):
    """transformers' float32 model dequantized from the same GGUF."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), gguf_file="model.gguf",
                                                dtype=torch.float32).eval()


@pytest.fixture
def reference_path(monkeypatch):
    """The gguf format's reference path (dequantize once, dense matmul), as where the
    ``gguf_linear`` kernel does not run."""
    from workers.kernels import gemm
    monkeypatch.setattr(gemm, "gguf_available", lambda: False)


def test_every_tensor_type_of_the_file_decodes_exactly(smollm2_dir):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    seen = set()
    for t in GGUFReader(str(smollm2_dir / "model.gguf")).tensors:
        if t.tensor_type.name in gguf_blocks.FLOAT_TYPES or t.tensor_type.name in seen:
            continue
        seen.add(t.tensor_type.name)
        raw = np.asarray(t.data)[:16]
        k = int(t.shape[0])
        u = gguf_blocks.unpack(t.tensor_type.name, torch.from_numpy(np.array(raw)), k)
        assert torch.equal(u.dequantize(), torch.from_numpy(dequantize(raw, t.tensor_type)).reshape(-1, k).float())
    assert seen == {"Q4_1", "Q8_0"}


def test_load_gives_the_weights_transformers_dequantizes(smollm2_dir, smol_gguf_hf, reference_path):
    from workers.gguf_checkpoint import load_gguf
    m = load_gguf(smollm2_dir, dtype=torch.float32, device="cpu", max_positions=256)
    hf = smol_gguf_hf.model
    for i in (0, 7, 29):
        a, ha = m.layers[i].self_attn, hf.layers[i].self_attn
        w = a.qkv_proj.weight.t()           # stored [in, out]
        nq, nk = ha.q_proj.weight.shape[0], ha.k_proj.weight.shape[0]
        assert torch.equal(w[:nq], ha.q_proj.weight)         # the llama row permutation undone
        assert torch.equal(w[nq:nq + nk], ha.k_proj.weight)
        assert torch.equal(w[nq + nk:], ha.v_proj.weight)
        assert torch.equal(m.layers[i].mlp.down_proj.weight.t(), hf.layers[i].mlp.down_proj.weight)
        assert torch.equal(m.layers[i].input_layernorm.weight, hf.layers[i].input_layernorm.weight)
        assert a.qkv_proj.format == "gguf"
    ids = torch.tensor([0, 1, 2, 500, 49151])
    assert torch.equal(m.embed_tokens(ids), hf.embed_tokens.weight[ids])
    assert torch.equal(m.lm_head.weight.t(), smol_gguf_hf.lm_head.weight)      # tied: token_embd


def test_load_errors_name_the_file(tmp_path, smollm2_dir):
    import shutil

    from kvmesh.core.errors import SettingsError
    from workers.gguf_checkpoint import load_gguf
    shutil.copy(smollm2_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(SettingsError, match="no model.gguf"):
        load_gguf(tmp_path, dtype=torch.float32, device="cpu", max_positions=64)
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(SettingsError, match="model.gguf"):
        load_gguf(tmp_path, dtype=torch.float32, device="cpu", max_positions=64)


def test_reference_path_greedy_matches_transformers(smollm2_dir, smol_gguf_hf, prose_ids, h, reference_path):
    eng = h.make_engine(smollm2_dir, weight_format="gguf", dtype="float32", max_num_seqs=4)
    prompts = [prose_ids[3:20], prose_ids[50:83], prose_ids[120:121]]
    reqs = h.run(eng, [(f"g{i}", p, h.greedy(20)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert reqs[f"g{i}"].output_token_ids == h.hf_greedy(smol_gguf_hf, p, 20), f"prompt {i}"


def test_auto_is_gguf_where_the_model_has_its_gguf(smollm2_dir, tiny_llama_dir):
    from workers.loader import resolve_weight_format
    assert resolve_weight_format("auto", smollm2_dir) == "gguf"
    assert resolve_weight_format("auto", tiny_llama_dir) == "none"          # a checkpoint without a GGUF
    assert resolve_weight_format("int8", smollm2_dir) == "int8"


@pytest.mark.skipif("not __import__('workers.kernels.gemm', fromlist=['x']).gguf_available()",
                    reason="the native kernels are not built here")
def test_kernel_path_agrees_with_the_reference_path(smollm2_dir, prose_ids, h, monkeypatch):
    """The model through ``gguf_linear`` (int8 activations) against the same weights through
    dequantize + matmul, float32: logits within the activation rounding, greedy tokens equal
    up to a near-tie; every Linear runs the kernel (no dense copy kept)."""
    from workers.kernels import gemm
    from workers.layers.linear import GGUF_NATIVE, Linear
    fast = h.make_engine(smollm2_dir, weight_format="auto", dtype="float32", max_num_seqs=4)
    model = fast.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.method is GGUF_NATIVE and m.weight is None for m in linears)
    assert all(m.fast is not None for m in linears)
    monkeypatch.setattr(gemm, "gguf_available", lambda: False)
    ref = h.make_engine(smollm2_dir, weight_format="gguf", dtype="float32", max_num_seqs=4)
    compared = 0
    for i, p in enumerate([prose_ids[3:40], prose_ids[60:61], prose_ids[100:180]]):     # one at a time: a row
        logits = {}                                                                    # per step
        for name, eng in (("fast", fast), ("ref", ref)):
            captured = h.capture_logits(eng)
            h.run(eng, [(f"{name}{i}", p, h.greedy(12))])
            logits[name] = captured
        assert len(logits["fast"]) == len(logits["ref"]) == 12
        for a, b in zip(logits["fast"], logits["ref"]):
            assert (a - b).norm() / b.norm() < 0.08          # int8 activations: 1-5% measured on SmolLM2
            if not torch.equal(a.argmax(-1), b.argmax(-1)):
                top = b.topk(2, dim=-1).values[0]
                assert top[0] - top[1] <= 2 * (a - b).abs().max(), "tokens differ without a near-tie"
                break
            compared += 1
    assert compared >= 12


@pytest.mark.skipif("not __import__('workers.kernels.gemm', fromlist=['x']).gguf_available()",
                    reason="the native kernels are not built here")
def test_gguf_panels_load_onto_huge_pages_unchanged(smollm2_dir, monkeypatch, h):
    """load_gguf moves every kernel-served Linear's panels and scales into a mapping advised
    MADV_HUGEPAGE (decode streams them each step): the same tensors as with
    a load without huge pages (THP never: ``available`` False), which leaves them where they were
    made (each in its own allocation).

    Where the plain load's tensors live is checked by their storage, not by VmFlags: NumPy
    advises its own large heap allocations MADV_HUGEPAGE (``_set_madvise_hugepage``), so in a
    process that ran NumPy code before, a plain tensor can reuse heap pages flagged ``hg``."""
    from workers import huge_pages
    from workers.gguf_checkpoint import load_gguf
    from workers.layers.linear import GGUF_NATIVE, Linear
    if not huge_pages.available():
        pytest.skip("no transparent huge pages here (THP never, or not Linux)")
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    plain = load_gguf(smollm2_dir, dtype=torch.bfloat16, device="cpu", max_positions=256)
    monkeypatch.undo()
    huge = load_gguf(smollm2_dir, dtype=torch.bfloat16, device="cpu", max_positions=256)
    pairs = [(a, b) for a, b in zip(plain.modules(), huge.modules()) if isinstance(a, Linear)]
    maps = h.smaps()
    assert pairs and all(a.method is GGUF_NATIVE and b.method is GGUF_NATIVE for a, b in pairs)
    for a, b in pairs:
        for name in ("gguf_qweight", "gguf_scales", "gguf_superscales"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None)
            if tb is None:
                continue
            assert torch.equal(ta, tb) and tb.data_ptr() % 4096 == 0
            assert "hg" in h.vma_flags(tb.data_ptr(), maps).get("VmFlags", "").split()    # MADV_HUGEPAGE
            arena = tb.untyped_storage()                   # one 2 MiB-rounded mapping for them all
            assert arena.nbytes() % huge_pages.HUGE_PAGE == 0 and arena.nbytes() > tb.nbytes
            assert ta.untyped_storage().nbytes() == ta.nbytes                           # its own
            assert name in dict(b.named_buffers())                                         # still the module's buffer


def test_pipeline_stage_holds_its_layers_as_the_whole_model_does(smollm2_dir):
    """A stage [15, 30) reads only its layers from the GGUF and holds the same runtime tensors
    as layers 15.. of the whole model (the last stage: final norm and tied lm_head)."""
    from workers.gguf_checkpoint import load_gguf
    whole = load_gguf(smollm2_dir, dtype=torch.bfloat16, device="cpu", max_positions=64)
    first = load_gguf(smollm2_dir, dtype=torch.bfloat16, device="cpu", max_positions=64, end_layer=15)
    stage = load_gguf(smollm2_dir, dtype=torch.bfloat16, device="cpu", max_positions=64, start_layer=15)
    assert len(stage.layers) == 15 and stage.embed_tokens is None and not hasattr(first, "lm_head")
    assert torch.equal(first.embed_tokens.raw, whole.embed_tokens.raw)
    for i, layer in enumerate(stage.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            a, b = layer.get_submodule(name), whole.layers[15 + i].get_submodule(name)
            assert a.format == b.format == "gguf" and a._qnames == b._qnames, name
            assert all(_same(getattr(a, n), getattr(b, n)) for n in a._qnames), name
        assert torch.equal(layer.input_layernorm.weight, whole.layers[15 + i].input_layernorm.weight)
    a, b = stage.lm_head, whole.lm_head
    assert a._qnames == b._qnames and all(_same(getattr(a, n), getattr(b, n)) for n in a._qnames)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


@pytest.mark.parametrize("draft_vocab_size, draft_quantization", [(0, ""), (1024, "q4_1")],
                         ids=["as-published", "q4_1-first-1024-ids"])
def test_draft_in_the_gguf_format_keeps_greedy_tokens(h, smollm2_dir, prose_ids, draft_vocab_size,
                                                      draft_quantization):
    """Speculative decoding with the target's own GGUF as the draft (both weight format gguf,
    the draft truncated to 12 layers; as published, or requantized to Q4_1 with its lm_head cut
    to the first 1,024 token ids): greedy tokens equal to the same engine without
    speculation (float32, as the other exactness tests of speculation: in bfloat16 a verify
    pass over k + 1 rows takes other attention paths than one-row decode steps), and the
    draft's proposals are used."""
    plain = h.make_engine(smollm2_dir, weight_format="gguf", dtype="float32", max_model_len=256)
    want = h.run(plain, [("a", prose_ids[:60], h.greedy(16))])["a"].output_token_ids
    spec = h.make_engine(smollm2_dir, weight_format="gguf", dtype="float32", max_model_len=256,
                         speculative_method="draft", draft_model=str(smollm2_dir), draft_num_layers=12,
                         draft_vocab_size=draft_vocab_size, draft_quantization=draft_quantization)
    try:
        got = h.run(spec, [("a", prose_ids[:60], h.greedy(16))])["a"]
        assert got.output_token_ids == want and got.num_draft_tokens > 0
        draft = spec.executor.runner.proposer.model
        assert len(draft.layers) == 12 and {m.format for m in draft.modules() if hasattr(m, "method")} == {"gguf"}
        assert draft.lm_head.out_features == (draft_vocab_size or draft.cfg.vocab_size)
        bits = {m.gguf_bits for m in draft.modules() if getattr(m, "format", "") == "gguf"}
        assert bits == {4} if draft_quantization else len(bits) > 1      # SmolLM2's file: Q5_0 / Q6_K / Q8_0 too
    finally:
        spec.shutdown()
