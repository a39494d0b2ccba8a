"""Tests for gateway.detokenizer.IncrementalDetokenizer.

Tokenizers: the real SmolLM2 tokenizer (GPT2-style byte-level BPE) and the Qwen2.5
tokenizer via kvmesh.hub (skipped if not pulled), plus a small in-memory
sentencepiece-style tokenizer (Metaspace "▁" + byte-fallback tokens, Llama decoder
chain) so the sentencepiece code path is always exercised.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from gateway.detokenizer import DetokenizerDelta, IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "안녕하세요, 반갑습니다",
    "🎉👍🏽 done",
    "def f(x):\n    return  x * 2\n\n\tprint('hi')   \n  # trailing  ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nok 🎉<|im_end|><|endoftext|>",
]
FFFD = "\ufffd"


# ---------------------------------------------------------------- tokenizer fixtures


def _registry_tokenizer(name: str):
    """The tokenizer of a pulled model; skip (never pull) when it is not available."""
    from transformers import AutoTokenizer

    from kvmesh.hub.pull import resolve_model

    try:
        path = resolve_model(name, pull_if_missing=False)
    except Exception as e:  # EngineError: not pulled (or not converted yet)
        pytest.skip(f"model {name!r} not available: {e}")
    return AutoTokenizer.from_pretrained(str(path))


def _sentencepiece_tokenizer():
    """A tiny Llama-style tokenizer: BPE over "▁"-joined words with <0xXX> byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    # ASCII-only corpus, so Korean and emoji are encoded as <0xXX> byte-fallback tokens
    corpus = [t for t in TEXTS if t.isascii()] + ["Help me. Hello world, alpha beta gamma."]
    tk.train_from_iterator(corpus * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
    )


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return _registry_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return _registry_tokenizer("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def sentencepiece_tokenizer():
    return _sentencepiece_tokenizer()


@pytest.fixture(params=["smollm2", "qwen", "sentencepiece"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


# ---------------------------------------------------------------- helpers


def _chunks(ids, mode, seed=0):
    """Split ids into one-token chunks, or random chunks of 1..5 tokens (fixed seed)."""
    if mode == "single":
        return [[i] for i in ids]
    rng, out, pos = random.Random(seed), [], 0
    while pos < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[pos : pos + n])
        pos += n
    return out


def _stream(tok, ids, chunk_mode="single", prompt=(), **kw):
    """Feed ids; return (detokenizer, list of deltas, final flush text or None if stopped)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas = []
    for chunk in _chunks(ids, chunk_mode):
        delta = d.add_tokens(chunk)
        assert isinstance(delta, DetokenizerDelta)
        deltas.append(delta)
        if delta.stop_string is not None:
            return d, deltas, None
    return d, deltas, d.flush()


def _check_roundtrip(tok, text, chunk_mode, skip_special_tokens):
    ids = tok.encode(text, add_special_tokens=False)
    ref = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    d, deltas, tail = _stream(tok, ids, chunk_mode, skip_special_tokens=skip_special_tokens)
    assert all(x.stop_string is None for x in deltas)
    assert "".join(x.text for x in deltas) + tail == ref
    assert d.output_text == ref
    assert d.num_output_tokens == len(ids)
    if FFFD not in ref:
        assert not any(FFFD in x.text for x in deltas), [x.text for x in deltas]


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunk_mode", ["single", "random"])
@pytest.mark.parametrize("text", TEXTS, ids=["english", "korean", "emoji", "code", "special"])
def test_roundtrip(tokenizer, text, chunk_mode, skip_special_tokens):
    _check_roundtrip(tokenizer, text, chunk_mode, skip_special_tokens)


def test_split_character_is_held_back(tokenizer):
    ids = tokenizer.encode("𠜎", add_special_tokens=False)  # rare CJK char (4 UTF-8 bytes)
    assert len(ids) > 1  # split over several (byte) tokens in every tokenizer tested
    d = IncrementalDetokenizer(tokenizer, [])
    assert [d.add_tokens([i]).text for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add_tokens(ids[-1:]).text.strip() == "𠜎"


def test_incomplete_character_at_end_is_flushed(tokenizer):
    ids = tokenizer.encode("ok 𠜎", add_special_tokens=False)[:-1]  # drop the char's last byte token
    d = IncrementalDetokenizer(tokenizer, [])
    text = "".join(d.add_tokens([i]).text for i in ids)
    assert FFFD not in text
    assert text + d.flush() == tokenizer.decode(ids)
    assert d.flush() == ""  # idempotent


# ---------------------------------------------------------------- stop strings


def _spanning_stop(tok, ids):
    """A stop string made of the last 2 chars of one token and the first 2 of the next."""
    for k in range(1, len(ids) - 1):
        a, b = tok.decode(ids[k : k + 1]), tok.decode(ids[k + 1 : k + 2])
        if len(a) >= 2 and len(b) >= 2 and a.isascii() and b.isascii() and a[-2:].strip():
            return a[-2:] + b[:2]
    raise AssertionError("no suitable token pair")


@pytest.mark.parametrize("chunk_mode", ["single", "random"])
def test_stop_spanning_two_tokens(tokenizer, chunk_mode):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog again", add_special_tokens=False)
    full = tokenizer.decode(ids)
    stop = _spanning_stop(tokenizer, ids)
    d, deltas, tail = _stream(tokenizer, ids, chunk_mode, stop=[stop])
    assert tail is None and deltas[-1].stop_string == stop
    assert all(x.stop_string is None for x in deltas[:-1])
    emitted = "".join(x.text for x in deltas)
    assert emitted == full[: full.index(stop)] == d.output_text
    assert not any(stop in x.text for x in deltas)
    assert d.num_output_tokens < len(ids)


def test_stop_prefix_false_alarm_is_emitted(tokenizer):
    hel, lo = tokenizer.encode("Hel", add_special_tokens=False), tokenizer.encode("lo", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], stop=["Help"])
    assert d.add_tokens(hel).text == ""  # might be the start of "Help": held back
    delta = d.add_tokens(lo)
    assert delta.stop_string is None
    assert delta.text + d.flush() == tokenizer.decode(hel + lo)
    assert "Hel" in d.output_text


def test_held_stop_prefix_released_by_flush(tokenizer):
    ids = tokenizer.encode("I need He", add_special_tokens=False)
    d, deltas, tail = _stream(tokenizer, ids, stop=["Help"])
    assert not "".join(x.text for x in deltas).endswith("He")
    assert "".join(x.text for x in deltas) + tail == tokenizer.decode(ids)


@pytest.mark.parametrize("chunk_mode", ["single", "random", "all"])
def test_multiple_stops_earliest_wins(tokenizer, chunk_mode):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    stops = ["delta", "gamma", "beta"]
    if chunk_mode == "all":  # everything in one chunk: all three match at once, earliest wins
        d = IncrementalDetokenizer(tokenizer, [], stop=stops)
        delta = d.add_tokens(ids)
        text, stop = delta.text, delta.stop_string
    else:
        d, deltas, _ = _stream(tokenizer, ids, chunk_mode, stop=stops)
        text, stop = "".join(x.text for x in deltas), deltas[-1].stop_string
    assert stop == "beta"
    assert text == "alpha " == d.output_text


def _first_stop(text: str, stops: list[str]):
    """Reference: the stop string completed first in ``text`` (end, stop); of those ending at
    the same character the longest. None when none occurs."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text.endswith(s, 0, end)]
        if hits:
            return end, max(hits, key=len)
    return None


def _held(text: str, stops: list[str]) -> int:
    """Reference: longest suffix of ``text`` that is a prefix of a stop string."""
    return max([k for s in stops for k in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:k])],
               default=0)


@pytest.mark.parametrize("seed", range(40))
def test_stop_matcher_against_brute_force(seed):
    """Random stop lists over a 3-letter alphabet (overlapping, nested, repeated), random text
    fed in random pieces: the match and the held-back length equal a brute-force scan of the
    whole text, whatever the chunking."""
    from gateway.stop_matcher import StopMatcher
    rng = random.Random(seed)
    word = lambda n: "".join(rng.choice("abc") for _ in range(n))  # noqa: E731
    stops = [word(rng.randint(1, 6)) for _ in range(rng.randint(1, 8))] + [""]
    text = word(rng.randint(0, 40))
    m, pos, got = StopMatcher(stops), 0, None
    while pos < len(text) and got is None:
        piece = text[pos : pos + rng.randint(0, 5)]
        hit = m.feed(piece)
        if hit is not None:
            got = (pos + hit[0], hit[1])
        else:
            assert m.held == _held(text[: pos + len(piece)], stops)
        pos += len(piece)
    assert got == _first_stop(text, stops)


@pytest.mark.parametrize("chunk_mode", ["single", "random", "all"])
def test_first_completed_stop_wins_whatever_the_chunking(tokenizer, chunk_mode):
    """"beta gamma" starts first, "eta g" completes first: the one completed first ends the
    text, whether the ids come in one chunk or token by token."""
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    stops = ["beta gamma", "eta g"]
    d = IncrementalDetokenizer(tokenizer, [], stop=stops)
    if chunk_mode == "all":
        delta = d.add_tokens(ids)
        text, stop = delta.text, delta.stop_string
    else:
        d, deltas, _ = _stream(tokenizer, ids, chunk_mode, stop=stops)
        text, stop = "".join(x.text for x in deltas), deltas[-1].stop_string
    assert (text, stop) == ("alpha b", "eta g")


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    d, deltas, tail = _stream(tokenizer, ids, stop=["beta"], include_stop_str_in_output=True)
    assert tail is None and deltas[-1].stop_string == "beta"
    assert "".join(x.text for x in deltas) == "alpha beta" == d.output_text


def test_nothing_after_stop(tokenizer):
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    more = tokenizer.encode(" more text", add_special_tokens=False)
    d, deltas, _ = _stream(tokenizer, ids, stop=["beta"])
    n = d.num_output_tokens
    after = d.add_tokens(more)
    assert after.text == ""
    assert d.flush() == ""
    assert d.output_text == "alpha "
    assert d.num_output_tokens == n


def test_min_tokens_defers_stop_strings(tokenizer):
    """No stop string ends in the text of the first ``min_tokens`` tokens: the first "beta" (its
    last token is the k-th) is passed over with ``min_tokens=k``, the second ends the text."""
    ids = tokenizer.encode("alpha beta gamma beta delta", add_special_tokens=False)
    d, deltas, _ = _stream(tokenizer, ids, stop=["beta"])
    k = d.num_output_tokens
    assert d.output_text == "alpha "
    d, deltas, tail = _stream(tokenizer, ids, stop=["beta"], min_tokens=k)
    assert tail is None and deltas[-1].stop_string == "beta"
    assert d.output_text == "alpha beta gamma " and d.num_output_tokens > k


def test_stop_in_prompt_does_not_trigger(tokenizer):
    prompt = tokenizer.encode("Say alpha beta then stop", add_special_tokens=False)
    ids = tokenizer.encode(" gamma delta", add_special_tokens=False)
    d, deltas, tail = _stream(tokenizer, ids, prompt=prompt, stop=["beta", "stop"])
    assert all(x.stop_string is None for x in deltas)
    assert "".join(x.text for x in deltas) + tail == tokenizer.decode(ids)


def test_korean_stop_string(tokenizer):
    ids = tokenizer.encode("안녕하세요, 반갑습니다", add_special_tokens=False)
    d, deltas, tail = _stream(tokenizer, ids, stop=["반갑"])
    assert tail is None and deltas[-1].stop_string == "반갑"
    assert d.output_text.strip() == "안녕하세요,"
    assert not any(FFFD in x.text for x in deltas)


def test_stop_string_with_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("answer<|im_end|>junk", add_special_tokens=False)
    # with skip_special_tokens=False the special token text is visible to stop strings
    d, deltas, tail = _stream(tok, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert deltas[-1].stop_string == "<|im_end|>" and d.output_text == "answer"
    # with skip_special_tokens=True it is dropped from the text entirely
    d, deltas, tail = _stream(tok, ids, stop=["<|im_end|>"])
    assert tail is not None and d.output_text == "answerjunk"


# ---------------------------------------------------------------- cost


def _long_ids(tok, n=2000):
    rng = random.Random(0)
    words = ["hello", "world", "안녕", "🎉", "code", "\n", "x = 1;", "반갑습니다", "👍🏽", "the"]
    text = " ".join(rng.choice(words) for _ in range(n))
    ids = tok.encode(text, add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


def test_decode_window_is_bounded(tokenizer):
    """Each step decodes a small window, independent of the output length."""
    ids = _long_ids(tokenizer)
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOP", "</answer>"])
    inner, sizes = d._decode, []
    d._decode = lambda window: sizes.append(len(window)) or inner(window)
    text = "".join(d.add_tokens([i]).text for i in ids) + d.flush()
    assert text == tokenizer.decode(ids)
    assert max(sizes) <= 16, max(sizes)


def test_per_token_cost_is_flat(tokenizer, capsys, request):
    ids = _long_ids(tokenizer)
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOP", "</answer>"])
    times = []
    for i in ids:
        t0 = time.perf_counter()
        d.add_tokens([i])
        times.append(time.perf_counter() - t0)
    first, last = sorted(times[:500])[250], sorted(times[-500:])[250]  # medians
    with capsys.disabled():
        print(f"\n[{request.node.callspec.id}] 2000 tokens: median us/token first 500 = {first * 1e6:.1f}, "
              f"last 500 = {last * 1e6:.1f}, mean = {sum(times) / len(times) * 1e6:.1f}")
    assert last < 3 * first + 20e-6
