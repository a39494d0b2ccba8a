"""The output processor both fronts share (gateway/output_processor.py).

* The processor alone, against a plain quadratic reference (re-decode the whole output after each
  token, search the whole text for stop strings): random byte-level vocabularies (characters of
  1-4 UTF-8 bytes split across tokens, outputs cut inside a character), random stop strings
  (some made of the output's own text, some holding U+FFFD, which only the flush can complete),
  random ``min_tokens``, random chunking of the ids into engine messages (Hypothesis). The text,
  the ids kept, the finish and stop reasons, the usage and when the front must end the request
  upstream equal the reference's.
* Its cost is linear in the output: the characters it decodes and matches grow as the output
  does, and no step allocates memory in proportion to the output so far (tracemalloc: a
  ``text +=`` or a copy of the ids per step would).
* Both fronts give the same text, token ids, finish reason, stop reason and usage for the same
  request: the offline ``LLM`` and the gateway (gRPC) in front of a scheduler, the same SmolLM2
  (float32, greedy) with prompt-lookup speculation so that steps carry several tokens; with no
  stop string, a stop string completing inside a multi-token step, one completing on the last
  token, and one deferred by ``min_tokens``.
"""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.output_processor import OutputProcessor
from kvmesh.core.sampling import SamplingParams

FFFD = "\ufffd"
ALPHABET = "ab \né中😀"          # 1, 2, 3 and 4 UTF-8 bytes


class ByteTokenizer:
    """Token id i is the bytes ``vocab[i]``; decoding joins them and reads UTF-8, an incomplete
    or bad sequence as U+FFFD (what a byte-level BPE's decode does). Counts its work."""

    def __init__(self, vocab: list[bytes]):
        self.vocab = vocab
        self.ids_decoded = self.chars_decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = b"".join(self.vocab[i] for i in ids).decode("utf-8", "replace")
        self.ids_decoded += len(ids)
        self.chars_decoded += len(text)
        return text


def _first_stop_ending_in(text: str, lo: int, stops: list[str]):
    """(end, stop) of the stop string that completes first in ``text[lo:]`` (it may begin
    before ``lo``); of those ending at one character, the longest. None if none does."""
    for end in range(lo + 1, len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            return end, max(hits, key=len)
    return None


def _reference(tok, ids, stops, min_tokens, finish):
    """What the client must get for output ``ids`` (the engine's ``finish`` = (reason, stop
    reason) at the last one), by brute force: after token k the text shown is the decode of
    ``ids[:k]`` unless that ends in an incomplete character (then what was shown before); a
    stop string counts once it completes in text shown after the ``min_tokens``-th token.
    Returns (text, ids kept, finish reason, stop reason, token index of a stop string's cut or
    None)."""
    shown = ""
    for k in range(1, len(ids) + 1):
        full = tok.decode(ids[:k])
        now = shown if full.endswith(FFFD) else full
        assert now.startswith(shown)
        if k > min_tokens and (hit := _first_stop_ending_in(now, len(shown), stops)):
            end, stop = hit
            return now[: end - len(stop)], ids[:k], "stop", stop, k
        shown = now
    full = tok.decode(ids)                                  # the flush at the engine's end
    if len(ids) > min_tokens and (hit := _first_stop_ending_in(full, len(shown), stops)):
        end, stop = hit
        return full[: end - len(stop)], ids, "stop", stop, None
    return full, ids, finish[0], finish[1], None


@st.composite
def cases(draw):
    """(vocab, output ids, message sizes, stops, min_tokens, engine finish)."""
    data = draw(st.text(ALPHABET, max_size=40)).encode()
    pieces = draw(st.lists(st.integers(0, 4), min_size=1, max_size=50))
    vocab, pos = [], 0
    for n in pieces:                                  # consecutive byte pieces; the rest is cut
        if pos >= len(data):
            break
        vocab.append(data[pos:pos + n])
        pos += n
    ids = list(range(len(vocab)))
    text = ByteTokenizer(vocab).decode(ids)
    stop = st.text(ALPHABET + FFFD, min_size=1, max_size=4)
    if text:
        at = draw(st.integers(0, len(text) - 1))
        stop = stop | st.just(text[at:at + draw(st.integers(1, 5))])
    stops = draw(st.lists(stop, max_size=4))
    sizes = draw(st.lists(st.integers(0, 4), max_size=len(ids) + 2))
    min_tokens = draw(st.integers(0, 5))
    finish = draw(st.sampled_from([("length", None), ("stop", None), ("stop", 7), ("abort", None)]))
    return vocab, ids, sizes, stops, min_tokens, finish


def _messages(ids, sizes):
    """Split ``ids`` into engine messages of the given sizes (0: a message with no token) until
    they run out; what is left goes in one last message."""
    out, pos = [], 0
    for n in sizes:
        if pos >= len(ids):
            break
        out.append(ids[pos:pos + n])
        pos += n
    if pos < len(ids) or not out:
        out.append(ids[pos:])
    return out


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_processor_matches_the_quadratic_reference(case):
    vocab, ids, sizes, stops, min_tokens, finish = case
    tok = ByteTokenizer(vocab)
    text, kept, reason, stop_reason, cut_at = _reference(tok, ids, stops, min_tokens, finish)
    params = SamplingParams(stop=stops, min_tokens=min_tokens, max_tokens=max(len(ids), min_tokens, 1),
                            logprobs=0)
    output = OutputProcessor(tok, [5, 6, 7], params, cumulative=True)
    msgs = _messages(ids, sizes)
    shown, got_ids, got_lps, ends, last = "", [], [], [], None
    for i, m in enumerate(msgs):
        final = i == len(msgs) - 1
        d = output.step(m, [f"lp{t}" for t in m], finished=final,
                        finish_reason=finish[0] if final else None, stop_reason=finish[1] if final else None)
        shown += d.text
        got_ids += d.token_ids
        got_lps += d.logprobs
        if d.end_upstream:
            ends.append(i)
        if d.finished:
            last = (d.finish_reason, d.stop_reason, i)
            assert output.step([0], ["x"], finished=True, finish_reason="length").token_ids == []
            break
    assert (shown, got_ids, last[:2]) == (text, kept, (reason, stop_reason))
    assert got_lps == [f"lp{t}" for t in kept]
    assert output.text == text and output.token_ids == kept and output.logprobs == got_lps
    u = output.usage()
    assert (u.prompt_tokens, u.completion_tokens) == (3, len(kept))
    # the message holding the stop string's token ends the output; the front must end the request
    # upstream unless that message was the engine's last
    at = len(msgs) - 1
    if cut_at is not None:
        at = next(j for j in range(len(msgs)) if sum(map(len, msgs[:j + 1])) >= cut_at)
    assert last[2] == at
    assert ends == ([at] if at < len(msgs) - 1 else [])


def _long_case(n: int):
    """An output of ``n`` tokens of 64 characters each, with stop strings that keep matching its
    characters (the longest stop string - 1 held back at every step) but never complete."""
    piece = ("a" * 20 + "中" * 2 + "b" * 41 + " ").encode()
    tok = ByteTokenizer([piece[:24], piece[24:]])           # token 0 ends inside the second "中"
    ids = [i % 2 for i in range(2 * n)]
    stops = ["a" * 40 + "z", "中中b!", "b" * 50 + "?"]
    return tok, ids, SamplingParams(stop=stops, max_tokens=2 * n)


def test_work_grows_linearly_with_the_output(monkeypatch):
    """Characters decoded and fed to the stop matcher, per token, do not grow with the output."""
    from gateway import stop_matcher
    fed = [0]
    feed = stop_matcher.StopMatcher.feed

    def counting_feed(self, text, **kw):
        fed[0] += len(text)
        return feed(self, text, **kw)
    monkeypatch.setattr(stop_matcher.StopMatcher, "feed", counting_feed)
    work = {}
    for n in (500, 2000):
        tok, ids, params = _long_case(n)
        fed[0] = 0
        output = OutputProcessor(tok, [1], params)
        for i in range(0, len(ids), 3):
            d = output.step(ids[i:i + 3], finished=i + 3 >= len(ids), finish_reason="length")
        assert d.finished and d.finish_reason == "length" and output.num_chars == 64 * n
        work[n] = (tok.ids_decoded + tok.chars_decoded + fed[0]) / len(ids)
    assert fed[0] == 64 * 2000             # the matcher reads each character once
    assert work[2000] <= 1.05 * work[500], work


def test_no_step_allocates_in_proportion_to_the_output():
    """Per engine message, the processor and the offline front's update (kvmesh.llm: the
    RequestOutput an AsyncLLM yields) allocate a bounded amount: the output reaches 512k
    characters (1 MiB) and 16k ids, and no message's peak allocation passes 64 KiB. Accumulating the text
    with ``+=``, or copying the ids or the text into each update, would allocate the whole
    output at every message."""
    from kvmesh.llm import _request_output
    tok, ids, params = _long_case(8192)
    output = OutputProcessor(tok, [1], params, cumulative=True)
    worst = 0
    tracemalloc.start()
    try:
        for i in range(0, len(ids), 2):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            d = output.step(ids[i:i + 2], finished=i + 2 >= len(ids), finish_reason="length")
            ro = _request_output("r", None, [1], output, d)
            worst = max(worst, tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    assert ro.finished and len(ro.outputs[0].text) == 64 * 8192 and len(ro.outputs[0].token_ids) == 2 * 8192
    assert worst < 64 * 1024, worst


def test_min_tokens_defers_stop_strings():
    """A stop string may not end in the first ``min_tokens`` tokens' text; it may begin there."""
    tok = ByteTokenizer([b"ab", b"c", b"ab", b"c", b"d"])
    for min_tokens, text, kept in [(0, "a", 2), (1, "a", 2), (2, "abca", 4), (4, "abcabcd", 5)]:
        output = OutputProcessor(tok, [1], SamplingParams(stop=["bc"], min_tokens=min_tokens, max_tokens=5),
                                 cumulative=True)
        d = output.step([0, 1, 2, 3, 4], finished=True, finish_reason="length")
        assert (output.text, len(output.token_ids)) == (text, kept), min_tokens
        assert d.finish_reason == ("length" if min_tokens == 4 else "stop")
    # "ab" + "c": the stop begins in the first token's text and ends in the second's
    output = OutputProcessor(tok, [1], SamplingParams(stop=["abc"], min_tokens=1, max_tokens=5))
    d = output.step([0, 1])
    assert (d.text, d.stop_reason, d.end_upstream) == ("", "abc", True)


def test_stop_in_the_flushed_text_wins_over_the_engines_reason():
    """The last token ends inside a character: its text shows only at the flush, and a stop
    string completing there finishes the request with ``stop`` (not the engine's ``length``)."""
    tok = ByteTokenizer([b"ok", b"\xe4\xb8"])
    output = OutputProcessor(tok, [1], SamplingParams(stop=["k" + FFFD], max_tokens=2))
    assert output.step([0, 1]).text == "o"                  # "k" may begin the stop: held
    d = output.step([], finished=True, finish_reason="length")
    assert (d.text, d.finish_reason, d.stop_reason, d.end_upstream) == ("", "stop", "k" + FFFD, False)


# ---------------------------------------------------------------------------------------------
# both fronts, the same requests

MAX_MODEL_LEN = 256
KV_MEMORY = 48 * 2**20
SPEC = dict(speculative_method="ngram")


class Gateway:
    """A scheduler (prompt-lookup speculation) and a gateway on an event loop in a thread."""

    def __init__(self, smollm2_dir, loop):
        import grpc

        from kvmesh.v1 import llm_pb2_grpc
        self.loop = loop
        self.sched, self.gw = loop.run(self._start(smollm2_dir))
        self.channel = grpc.insecure_channel(self.gw.address)
        self.stub = llm_pb2_grpc.LLMServiceStub(self.channel)

    async def _start(self, smollm2_dir):
        from gateway.server import serve_gateway
        from kvmesh.core.engine_config import EngineConfig
        from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
        from scheduler.service import serve_scheduler
        sched = await serve_scheduler(SchedulerConfig(executor="local", port=0),
                                      EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=KV_MEMORY,
                                                   max_model_len=MAX_MODEL_LEN, **SPEC))
        await sched.wait_ready()
        gw = await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=60,
                                               default_timeout=60, max_timeout=120))
        return sched, gw

    def generate(self, prompt_ids, **sampling):
        from kvmesh.v1 import common_pb2, llm_pb2
        req = llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=prompt_ids),
                                      sampling=common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, **sampling))
        return list(self.stub.Generate(req))

    def close(self):
        self.channel.close()
        self.loop.run(self.gw.stop(0))
        self.loop.run(self.sched.stop(0))
        self.loop.stop()


@pytest.fixture(scope="module")
def fronts(smollm2_dir, h):
    from kvmesh import LLM
    gw = Gateway(smollm2_dir, h.LoopThread("fronts-loop"))
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=KV_MEMORY, max_model_len=MAX_MODEL_LEN, **SPEC)
    yield llm, gw
    gw.close()


def _both(fronts, prompt_ids, **sampling):
    """The same greedy request through the offline LLM and through the gateway: for each, (text,
    token ids, finish reason, stop reason, usage as (prompt, completion, cached prompt tokens,
    speculative drafts)); and the gateway's messages (one per engine step)."""
    from kvmesh.core.proto import finish_reason_name
    llm, gw = fronts
    ro = llm.generate([prompt_ids], SamplingParams(temperature=0.0, ignore_eos=True, **sampling))[0]
    c, m = ro.outputs[0], ro.metrics
    offline = (c.text, c.token_ids, c.finish_reason, "" if c.stop_reason is None else str(c.stop_reason),
               (len(ro.prompt_token_ids), len(c.token_ids), m.num_cached_tokens, m.num_drafts))
    msgs = gw.generate(prompt_ids, **sampling)
    last = msgs[-1]
    assert last.finished and not any(x.finished for x in msgs[:-1])
    u = last.usage
    online = ("".join(x.text for x in msgs), [t for x in msgs for t in x.token_ids], finish_reason_name(last),
              last.stop_reason, (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, u.spec_num_drafts))
    return offline, online, msgs


def test_both_fronts_give_the_same_output(fronts, prose_ids, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = prose_ids[:80] + prose_ids[:30]            # repeats its beginning: long accepted runs
    offline, online, msgs = _both(fronts, prompt, max_tokens=24)
    assert offline == online
    text, full, reason, _, usage = online
    assert reason == "length" and len(full) == 24 and usage[3] > 0
    steps = [list(x.token_ids) for x in msgs if x.token_ids]
    assert any(len(s) > 1 for s in steps)

    # a stop string completing on a token in the middle of a multi-token step (that token's own
    # text, first seen there): both cut the text there and drop the step's later ids
    pos, found = 0, None
    for s in steps:
        for i in range(pos, pos + len(s) - 1):
            before = tok.decode(full[:i])
            piece = tok.decode(full[:i + 1])[len(before):]
            if found is None and len(piece.strip()) >= 3 and text.find(piece) == len(before):
                found = piece, before, i
        pos += len(s)
    assert found, "no stop string inside a multi-token step"
    stop, before, i = found
    offline, online, _ = _both(fronts, prompt, max_tokens=24, stop=[stop])
    assert offline == online
    assert online[:4] == (before, full[:i + 1], "stop", stop)
    assert online[4][:2] == (len(prompt), i + 1)

    # a stop string completing on the last token (max_tokens reached there too): ``stop`` wins
    assert len(tok.decode(full[:23])) < len(text)
    n = next(n for n in range(3, len(text)) if text.find(text[-n:]) == len(text) - n)
    stop = text[-n:]
    offline, online, _ = _both(fronts, prompt, max_tokens=24, stop=[stop])
    assert offline == online
    assert online[:4] == (text[:-n], full, "stop", stop)

    # min_tokens past the first stop string's token: it no longer ends the output there
    stop, before, i = found
    offline, online, _ = _both(fronts, prompt, max_tokens=24, stop=[stop], min_tokens=i + 1)
    assert offline == online
    cut = text.find(stop, len(before) + 1)
    assert online[0] == (text if cut < 0 else text[:cut]) and online[0].startswith(before + stop)
