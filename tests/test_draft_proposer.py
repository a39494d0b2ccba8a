"""The draft-model proposer of speculative decoding (workers/spec_decode/draft.py) on SmolLM2
drafting for itself: its greedy proposals are the model's own greedy continuation
(transformers' ``generate``; so its K/V, positions and block tables are right), K/V written in
pieces and overwritten after a rejection gives the same proposals as one shot, the context
limit is respected, sampling rows return the target sampler's processed distribution, and a
truncated draft is the checkpoint's first N layers (checked against transformers); on the torch
attention backend and on the native one."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from workers.layers.sampler import make_generator
from workers.spec_decode.draft import DraftInput, DraftProposer

BS = 16
NUM_BLOCKS = 64
K = 8


def _cfg(model_dir, **kw) -> EngineConfig:
    kw.setdefault("max_model_len", 512)
    return EngineConfig(model=str(model_dir), draft_model=str(model_dir), dtype="float32", **kw)


def _proposer(model_dir, backend: str = "torch", **kw) -> DraftProposer:
    return DraftProposer(_cfg(model_dir, **kw), NUM_BLOCKS, BS, torch.device("cpu"), backend)


@pytest.fixture(scope="module")
def prompts(prose_ids):
    return {"a": prose_ids[:37], "b": prose_ids[100:160]}


@pytest.fixture(scope="module")
def reference(h, smollm2_dir, prompts):
    """transformers' greedy continuation (K tokens) of each prompt, and its logits at the last
    prompt position (the distribution of the first proposal)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), torch_dtype=torch.float32)
    ref = {rid: h.hf_greedy(hf, p, K) for rid, p in prompts.items()}
    with torch.inference_mode():
        first = {rid: hf(torch.tensor([p])).logits[0, -1].float() for rid, p in prompts.items()}
    return ref, first


def _native_available() -> bool:
    from workers import kernels
    return kernels.available()


@pytest.fixture(scope="module", params=["torch", pytest.param("native", marks=pytest.mark.skipif(
    not _native_available(), reason="the native kernels are not built here"))])
def full(smollm2_dir, request):
    """The whole model as its own draft, its attention on the torch backend (decode rows over
    gathered context) or the native one (every row but long chunks over the block tables in place,
    as the target's runner does)."""
    p = _proposer(smollm2_dir, request.param)
    assert p.native == (request.param == "native")
    return p


def test_greedy_proposals_are_the_models_own_continuation(full, prompts, reference):
    ref, _ = reference
    tables = {"a": [7, 3, 12, 40], "b": [20, 21, 22, 23, 24]}     # scattered, and a contiguous run
    out = full.propose([DraftInput(rid, 0, p, tables[rid], K, None) for rid, p in prompts.items()])
    for rid in prompts:
        assert out[rid].token_ids == ref[rid], rid
        assert out[rid].probs is None
    m = full.model.cfg
    assert full.max_model_len == 512
    assert full.kv_cache_bytes == NUM_BLOCKS * 2 * m.num_layers * BS * m.num_kv_heads * m.head_dim * 4


def test_kv_in_pieces_and_after_rejection_equals_one_shot(full, prompts, reference):
    ref, _ = reference
    p, n = prompts["a"], len(prompts["a"])
    bt = [50, 9, 33, 4]
    # prompt in two chunks; the first only writes K/V
    first = full.propose([DraftInput("x", 0, p[:20], bt, 0, None)])
    assert first["x"].token_ids == [] and first["x"].probs is None
    assert full.propose([DraftInput("x", 20, p[20:], bt, 4, None)])["x"].token_ids == ref["a"][:4]
    # the target accepted 2 proposals and added its bonus token: fed at the right position
    got = full.propose([DraftInput("x", n, ref["a"][:3], bt, 4, None)])["x"].token_ids
    assert got == ref["a"][3:7]
    # a rejection: position n+1 now holds another token than the draft's K/V was written for
    other = (ref["a"][1] + 1) % full.vocab_size
    batched = full.propose([DraftInput("x", n + 1, [other], bt, 3, None),           # decode path
                            DraftInput("y", 0, p + [ref["a"][0], other], [60, 61, 62, 63], 3, None),
                            DraftInput("z", 0, prompts["b"][:30], [1, 2], 0, None)])
    assert batched["x"].token_ids == batched["y"].token_ids
    assert len(batched["x"].token_ids) == 3 and batched["z"].token_ids == []
    alone = full.propose([DraftInput("y2", 0, p + [ref["a"][0], other], [10, 11, 12, 13], 3, None)])
    assert alone["y2"].token_ids == batched["y"].token_ids


def test_context_limit(smollm2_dir, prompts, reference):
    ref, _ = reference
    p = prompts["a"]                                        # 37 tokens
    d = _proposer(smollm2_dir, draft_max_model_len=40)
    assert d.max_model_len == 40
    bt = [0, 1, 2, 3]
    out = d.propose([DraftInput("near", 0, p, bt, 8, None),                        # positions 37..39 left
                     DraftInput("full", 0, p + ref["a"][:3], [4, 5, 6, 7], 4, None),  # 40 tokens: no room
                     DraftInput("over", 0, p + ref["a"][:8], [8, 9, 10, 11], 4, None),  # 45: K/V below 40 only
                     DraftInput("past", 40, ref["a"][3:6], [4, 5, 6, 7], 2, None)])   # wholly past the limit
    assert out["near"].token_ids == ref["a"][:3]
    assert out["full"].token_ids == out["over"].token_ids == out["past"].token_ids == []
    # a target limit below the draft's own caps it too
    assert _proposer(smollm2_dir, max_model_len=64).max_model_len == 64


def test_sampling_rows(full, prompts, reference):
    ref, first = reference
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=7)

    def run(seed, k=4):
        return full.propose([DraftInput("s", 0, prompts["a"], [0, 1, 2, 3], k, sp, make_generator(seed, "cpu")),
                             DraftInput("g", 0, prompts["b"], [4, 5, 6, 7, 8], k, None)])

    out = run(7)
    s = out["s"]
    assert out["g"].token_ids == ref["b"][:4] and out["g"].probs is None     # greedy row unaffected
    assert s.probs.shape == (4, full.vocab_size) and s.probs.dtype == torch.float32
    torch.testing.assert_close(s.probs.sum(-1), torch.ones(4), atol=1e-5, rtol=0)
    assert ((s.probs > 0).sum(-1) <= 20).all()                               # top-k: no mass outside it
    assert all(s.probs[i, t] > 0 for i, t in enumerate(s.token_ids))
    # the first distribution is the target sampler's processing of the model's logits
    logits = first["a"] / 0.8
    keep = logits.topk(20).indices
    expected = torch.full_like(logits, float("-inf")).scatter_(0, keep, logits[keep]).softmax(-1)
    torch.testing.assert_close(s.probs[0], expected, atol=1e-4, rtol=1e-3)
    # seeded: reproducible; other seeds draw other tokens
    again = run(7)["s"]
    assert again.token_ids == s.token_ids and torch.equal(again.probs, s.probs)
    firsts = {run(seed, k=1)["s"].token_ids[0] for seed in range(12)}
    assert len(firsts) > 1 and all(t in keep.tolist() for t in firsts)


def test_truncated_draft_is_the_first_layers(smollm2_dir, prompts, h):
    from transformers import AutoModelForCausalLM
    d = _proposer(smollm2_dir, draft_num_layers=8)
    assert len(d.model.layers) == 8 and d.model.is_last
    m = d.model.cfg
    assert d.kv_cache_bytes == NUM_BLOCKS * 2 * 8 * BS * m.num_kv_heads * m.head_dim * 4
    got = d.propose([DraftInput("a", 0, prompts["a"], [3, 1, 4, 2], 6, None)])["a"].token_ids
    assert got == d.propose([DraftInput("a", 0, prompts["a"], [3, 1, 4, 2], 6, None)])["a"].token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), num_hidden_layers=8, torch_dtype=torch.float32)
    assert got == h.hf_greedy(hf, prompts["a"], 6)


def test_bad_drafts(smollm2_dir, tmp_path):
    from kvmesh.hub.cache import is_pulled
    cfg_json = json.loads((smollm2_dir / "config.json").read_text())
    cfg_json["vocab_size"] += 64
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    # no weights in tmp_path: the check comes before any weight is read
    with pytest.raises(EngineError, match="vocabulary"):
        DraftProposer(_cfg(smollm2_dir).replace(draft_model=str(tmp_path)), NUM_BLOCKS, BS, torch.device("cpu"))
    with pytest.raises(EngineError, match="draft_num_layers"):
        _proposer(smollm2_dir, draft_num_layers=99)
    with pytest.raises(EngineError, match="draft_num_layers"):
        _proposer(smollm2_dir, draft_num_layers=8, weight_format="int8")
    with pytest.raises(EngineError, match="draft_max_model_len"):
        _proposer(smollm2_dir, draft_max_model_len=10**7)
    if not is_pulled("qwen2.5-coder-0.5b-instruct"):
        pytest.skip("qwen2.5-coder-0.5b-instruct not pulled")
    with pytest.raises(EngineError, match="vocabulary"):
        DraftProposer(_cfg(smollm2_dir).replace(draft_model="qwen2.5-coder-0.5b-instruct"), NUM_BLOCKS, BS,
                      torch.device("cpu"))


def test_lazy_writes_stale_blocks_and_catching_up(full, prompts, reference, prose_ids):
    """The draft writes a request's K/V only when asked for proposals; a cached prefix it never
    wrote is stale: a new request on it catches up from its prompt, or gets nothing without
    one; a request that decoded far without the draft is left to decode without it."""
    ref, _ = reference
    p = prompts["a"]                                             # 37 tokens: blocks 0-1 full
    bt = [30, 31, 32]
    assert full.propose([DraftInput("w", 0, p[:32], bt, 0, None)])["w"].token_ids == []
    full.free_requests(["w"])                                    # ended with its prompt unwritten
    assert {30, 31} <= full._stale
    blind = full.propose([DraftInput("blind", 32, p[32:], bt, K, None)])
    assert blind["blind"].token_ids == []                        # no prompt to catch up from
    out = full.propose([DraftInput("r", 32, p[32:], bt, K, None, context=p)])
    assert out["r"].token_ids == ref["a"]                        # caught up on the stale prefix
    assert not {30, 31, 32} & full._stale
    # a decode that sat out more than MAX_CATCH_UP tokens is not caught up
    from workers.spec_decode.draft import MAX_CATCH_UP
    long = prose_ids[: MAX_CATCH_UP + 40]
    tables = list(range(40, 40 + -(-(len(long) + K + 1) // BS)))
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    full.propose([DraftInput("late", 0, long[:20], tables, 2, greedy)])          # proposes: written
    full.propose([DraftInput("late", 20, long[20:], tables, 0, greedy)])         # decoded without the draft
    assert full.propose([DraftInput("late", len(long), [7], tables, 2, greedy)])["late"].token_ids == []
    full.free_requests(["blind", "r", "late"])


@pytest.mark.parametrize("weight_format", ["none", "gguf"])
def test_draft_vocabulary_cuts_the_lm_head_to_its_first_rows(smollm2_dir, weight_format):
    """``draft_vocab_size`` N keeps the lm_head's first N rows, in a weight format whose storage is
    cut differently (dense columns, GGUF kernel panels): N / V of its bytes, and on any hidden
    state exactly the whole head's first N logits."""
    n = 1024
    whole = _proposer(smollm2_dir, weight_format=weight_format).model.lm_head
    cut = _proposer(smollm2_dir, weight_format=weight_format, draft_vocab_size=n).model.lm_head
    assert (cut.out_features, cut.format) == (n, weight_format)
    assert cut.weight_bytes() == pytest.approx(whole.weight_bytes() * n / whole.out_features, rel=1e-3)
    x = torch.randn(5, whole.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cut(x), whole(x)[:, :n])


@torch.inference_mode()
def _logits_along(p: DraftProposer, seq: list[int], table: list[int]) -> torch.Tensor:
    """``[len(seq), V]`` float32: the draft model's logits at every position of ``seq`` (one
    forward over it as a prefill chunk into ``table``)."""
    ids, pos, md, _ = p._prepare([(0, seq, table)])
    return p.model.compute_logits(p.model(ids, pos, md, p.kv_caches))


def test_draft_vocabulary_proposes_the_first_token_ids(full, smollm2_dir, prompts):
    """With ``draft_vocab_size`` N greedy proposals are the argmax over the first N ids of the
    whole draft's logits, and a sampling row's q is the sampler's processed distribution over
    those ids, zero past them, V long (the rejection sampler's q)."""
    n, V = 1024, full.vocab_size
    cut = _proposer(smollm2_dir, "native" if full.native else "torch", draft_vocab_size=n)
    assert (cut.head_size, full.head_size, cut.vocab_size) == (n, V, V)
    p = prompts["a"]
    got = cut.propose([DraftInput("g", 0, p, [0, 1, 2, 3], K, None)])["g"].token_ids
    logits = _logits_along(full, p + got, [50, 51, 52, 53])
    want = logits[len(p) - 1: len(p) - 1 + K, :n].argmax(-1).tolist()
    assert got == want and max(got) < n
    assert got != logits[len(p) - 1: len(p) - 1 + K].argmax(-1).tolist()   # some whole-vocabulary choice lies past n

    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=3)
    s = cut.propose([DraftInput("s", 0, p, [4, 5, 6, 7], 3, sp, make_generator(3, "cpu"))])["s"]
    assert s.probs.shape == (3, V) and not s.probs[:, n:].any() and max(s.token_ids) < n
    torch.testing.assert_close(s.probs.sum(-1), torch.ones(3), atol=1e-5, rtol=0)
    first = logits[len(p) - 1, :n] / 0.8
    keep = first.topk(20).indices
    expected = torch.full_like(first, float("-inf")).scatter_(0, keep, first[keep]).softmax(-1)
    torch.testing.assert_close(s.probs[0, :n], expected, atol=1e-4, rtol=1e-3)


def test_bad_draft_vocabulary_and_quantization(smollm2_dir):
    with pytest.raises(EngineError, match="draft_vocab_size 1000: .*multiple of the GGUF panels' 16 rows"):
        _proposer(smollm2_dir, weight_format="gguf", draft_vocab_size=1000)
    with pytest.raises(EngineError, match="draft_vocab_size cannot be combined with weight_format 'int8'"):
        _proposer(smollm2_dir, weight_format="int8", draft_vocab_size=1024)
    with pytest.raises(EngineError, match="draft_vocab_size must be >= 0, got -1"):
        _cfg(smollm2_dir, draft_vocab_size=-1)
    with pytest.raises(EngineError, match="draft_quantization 'q4_1' requantizes GGUF blocks: it needs weight_format gguf"):
        _proposer(smollm2_dir, draft_quantization="q4_1")
    # refused when the settings are read, before the target loads
    with pytest.raises(EngineError, match="draft_quantization 'q4_1' requantizes GGUF blocks: it needs weight_format gguf"):
        _cfg(smollm2_dir, speculative_method="draft", draft_quantization="q4_1", weight_format="int8")
    with pytest.raises(EngineError, match="draft_vocab_size cannot be combined with weight_format 'int8'"):
        _cfg(smollm2_dir, speculative_method="draft", draft_vocab_size=1024, weight_format="int8")
    with pytest.raises(EngineError, match="unknown draft_quantization 'q5'"):
        _cfg(smollm2_dir, draft_quantization="q5")
    whole = _proposer(smollm2_dir, draft_vocab_size=10**6)          # at least the vocabulary: all of it
    assert whole.head_size == whole.vocab_size == whole.model.lm_head.out_features
