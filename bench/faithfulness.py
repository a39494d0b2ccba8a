"""Faithfulness of a configuration on PolicyDesk: does an optimisation (quantized weights or KV
cache, speculative decoding, another batching policy) change what the model answers?

``kvmesh eval faithfulness [engine flags]`` answers PolicyDesk questions greedily (temperature
0) with the configuration under test and with the unoptimised reference configuration, then
scores both. The prompt layout is the data set's (:mod:`bench.policydesk`): system prompt +
the policy text, then the question as one user message, through the model's chat template.

Scores (pure functions below, tested in ``tests/test_faithfulness.py``):

- **key-fact accuracy**: an answerable question is right when its answer contains every key
  fact after :func:`normalize` (see :func:`contains_fact` for the matching rules); an
  unanswerable one is right when the answer abstains (:data:`ABSTAIN_PATTERNS`) and states no
  number that is not in the question (:func:`unanswerable_correct`). Reported for answerable,
  unanswerable and all questions.
- **agreement** with the reference: the share of questions whose greedy answers have identical
  token ids; **first divergence**: the token index where two different answers first differ
  (the shorter one's length when one is a prefix of the other), averaged over the diverging
  answers only (None when none diverge).
- **grounding**: the share of the answer's content words (lowercased, :data:`STOP_WORDS`
  removed) that occur in the system message the model was given (system prompt + policy).
- **quality gate**: ``passes_gate`` is true when overall key-fact accuracy is at most
  :data:`GATE_POINTS` (2) percentage points below the reference's.

The reference is the configuration under test with its optimisations undone: dense weights
(``weight_format none``), KV cache in the model dtype (``kv_cache_dtype auto``), no speculative
decoding, continuous batching, in ``--reference-dtype`` (float32). It is computed in the same
invocation (a second engine, loaded after the first is freed) or loaded from ``--reference
FILE`` (written there when the file does not exist yet).

Limits: the scorer is literal. A right answer that spells a number differently from the
policy ("two" for "2", "5.6" for "5.60", "9.30" for "09:30") counts as wrong; an abstention
phrased in words not in the list counts as wrong; an abstention followed by an invented claim
without a number counts as right; grounding counts words, not claims (a false sentence made of
policy words scores 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import re
import sys
import time
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from bench import policydesk

GATE_POINTS = 2.0        # the most key-fact accuracy may drop vs the reference, in percentage points

# ---- normalisation and key facts ----------------------------------------------------------------

_DASHES = re.compile("[\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d]")
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201b": "'", "\u2032": "'", "\u201c": '"', "\u201d": '"'})
_GROUP_SPACE = re.compile("(?<=\\d)[\u00a0\u2009\u202f](?=\\d{3}(?!\\d))")   # 1 000 with a thin/no-break space
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")                           # 1,500 -> 1500
_DECIMAL_COMMA = re.compile(r"(?<=\d),(?=\d{1,2}(?!\d))")                     # 5,60 -> 5.60
_CURRENCY = re.compile(r"[€$£¥]|\b(?:eur|euros?|usd|gbp)\b")
_PERCENT = re.compile(r"\s*(?:%|\bper ?cent\b)")
_HOUR_ZERO = re.compile(r"(?<![\d.:])0(\d:\d\d)")                                # 09:30 -> 9:30


def normalize(text: str) -> str:
    """Text as the scorer compares it, in this order: thousand groups joined across no-break
    and thin spaces ("1 000" → "1000"); Unicode NFKC; lowercase; curly quotes → straight;
    every Unicode dash and minus → "-"; thousands commas removed ("1,500" → "1500"); a comma
    before 1-2 final digits read as a decimal comma ("5,60" → "5.60"); currency symbols and
    codes removed ("€1,500" and "1500 EUR" → "1500"); "percent"/"per cent" and " %" → "%";
    a leading zero dropped from clock times ("09:30" → "9:30"); runs of whitespace → one space.
    Not handled: number words ("two"), "." thousand separators ("1.000" stays a decimal),
    trailing decimal zeros ("5.6" ≠ "5.60")."""
    s = _GROUP_SPACE.sub("", text)
    s = unicodedata.normalize("NFKC", s).lower().translate(_QUOTES)
    s = _DASHES.sub("-", s)
    s = _THOUSANDS.sub("", s)
    s = _DECIMAL_COMMA.sub(".", s)
    s = _CURRENCY.sub(" ", s)
    s = _PERCENT.sub("%", s)
    s = _HOUR_ZERO.sub(r"\1", s)
    return re.sub(r"\s+", " ", s).strip()


def contains_fact(answer: str, fact: str) -> bool:
    """True when the normalised ``fact`` occurs in the normalised ``answer``, as a whole number
    or word at its start: a fact starting with a letter or digit may not follow a letter or
    digit ("two" is not found in "network"), one starting with a digit may not follow "<digit>."
    ("5" is not in "0.5"), and one ending with a digit may not be followed by a digit or by
    "."/"," and a digit ("15" is not in "150" or "15.5"). A fact ending with a letter may be
    followed by more letters ("line manager" is in "line managers")."""
    f = normalize(fact)
    if not f:
        raise ValueError("empty key fact")
    pattern = re.escape(f)
    if f[0].isalnum():
        pattern = r"(?<![^\W_])" + pattern
    if f[0].isdigit():
        pattern = r"(?<!\d[.,])" + pattern
    if f[-1].isdigit():
        pattern += r"(?!\d|[.,]\d)"
    return re.search(pattern, normalize(answer)) is not None


def key_facts_correct(answer: str, key_facts: Sequence[str]) -> bool:
    """True when ``answer`` contains every key fact (:func:`contains_fact`)."""
    return all(contains_fact(answer, f) for f in key_facts)


# An abstention: the answer says the policy does not cover the question. Matched on the
# normalised answer (lowercase, straight apostrophes).
ABSTAIN_PATTERNS: tuple[str, ...] = (
    r"\bdo(?:es)?(?: not|n't|nt) (?:say|specify|state|mention|cover|contain|address|provide|include|"
    r"indicate|discuss|define|list|give|set|describe|tell)\b",
    r"\bnot (?:mentioned|specified|stated|covered|addressed|defined|listed|included|described|provided|"
    r"say|said)\b",
    r"\bno (?:specific |further |such |relevant )?(?:information|mention|details?|guidance|rule|provision)s?\b",
    r"\bnot (?:in|part of|found in) the policy\b",
    r"\bi (?:do not|don't|dont) know\b",
    r"\b(?:cannot|can't|can not|unable to) (?:find|answer|determine|tell|say)\b",
    r"\bsilent on\b",
)
_ABSTAIN = re.compile("|".join(f"(?:{p})" for p in ABSTAIN_PATTERNS))
_NUMBER = re.compile(r"\d+(?:[.:]\d+)*")


def abstains(answer: str) -> bool:
    """True when ``answer`` matches one of :data:`ABSTAIN_PATTERNS` ("The policy does not say.",
    "doesn't specify", "not mentioned", "no information", "not covered", "I don't know" ...)."""
    return _ABSTAIN.search(normalize(answer)) is not None


def new_numbers(answer: str, question: str) -> list[str]:
    """Numbers (digit runs, with "." or ":" inside) in ``answer`` that are not in ``question``."""
    asked = set(_NUMBER.findall(normalize(question)))
    return [n for n in _NUMBER.findall(normalize(answer)) if n not in asked]


def unanswerable_correct(answer: str, question: str) -> bool:
    """An unanswerable question is answered right when the answer abstains (:func:`abstains`)
    and asserts no made-up figure: it states no number that the question does not contain.
    Pattern-based: an abstention plus an invented claim without a number still counts as right."""
    return abstains(answer) and not new_numbers(answer, question)


def is_correct(answer: str, question: dict) -> bool:
    """Score one answer to a PolicyDesk question record (``key_facts``, ``answerable``, ``question``)."""
    if question["answerable"]:
        return key_facts_correct(answer, question["key_facts"])
    return unanswerable_correct(answer, question["question"])


def accuracy(correct: Sequence[bool], answerable: Sequence[bool]) -> dict:
    """Key-fact accuracy in [0, 1]: ``answerable``, ``unanswerable`` and ``overall`` (None for a
    group without questions)."""
    def share(xs):
        return sum(xs) / len(xs) if xs else None
    return {"answerable": share([c for c, a in zip(correct, answerable) if a]),
            "unanswerable": share([c for c, a in zip(correct, answerable) if not a]),
            "overall": share(list(correct))}


def accuracy_drop_points(acc: float, reference_acc: float) -> float:
    """How far ``acc`` is below ``reference_acc``, in percentage points (negative = better),
    rounded to 1e-6 so that 0.50 → 0.48 is exactly 2.0."""
    return round(100.0 * (reference_acc - acc), 6)


def passes_gate(acc: float, reference_acc: float, max_drop_points: float = GATE_POINTS) -> bool:
    """The quality gate: overall accuracy at most ``max_drop_points`` points below the reference."""
    return accuracy_drop_points(acc, reference_acc) <= max_drop_points


# ---- grounding ----------------------------------------------------------------------------------

STOP_WORDS = frozenset("""
a an the and or but if then else so than that this these those there here of in on at to for from
by with without about as into over under after before between during within per up down out off
is are was were be been being am do does did doing done have has had having can could may might
must shall should will would i you he she it we they me him her us them my your his its our
their mine yours what which who whom whose when where why how all any both each every few more
most other some such no nor not only own same too very just also yes one s t don't doesn't
isn't aren't can't won't please
""".split())
_WORD = re.compile(r"[^\W_]+(?:['.-][^\W_]+)*")


def content_words(text: str) -> list[str]:
    """The words of normalised ``text`` (letters/digits, joined by inner ' . -) that are not in
    :data:`STOP_WORDS`, in order, repeats kept."""
    return [w for w in _WORD.findall(normalize(text)) if w not in STOP_WORDS]


def grounding(answer: str, source: str) -> float | None:
    """Share of ``answer``'s content words that occur as words in ``source`` (the system
    message: system prompt + policy). None for an answer without content words."""
    words = content_words(answer)
    if not words:
        return None
    vocab = set(_WORD.findall(normalize(source)))
    return sum(w in vocab for w in words) / len(words)


# ---- agreement ----------------------------------------------------------------------------------

def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first position where token sequences ``a`` and ``b`` differ; the shorter
    one's length when it is a prefix of the other; None when they are identical."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def agreement(answers: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """Greedy agreement of token-id sequences with the reference's, pairwise:
    ``agreement`` (share identical), ``num_diverging``, ``mean_first_divergence`` (token index,
    over diverging pairs only; None when every pair is identical)."""
    if len(answers) != len(reference) or not answers:
        raise ValueError(f"need the same non-zero number of answers, got {len(answers)} and {len(reference)}")
    div = [first_divergence(a, r) for a, r in zip(answers, reference)]
    diverging = [d for d in div if d is not None]
    return {"agreement": 1 - len(diverging) / len(div), "num_diverging": len(diverging),
            "mean_first_divergence": sum(diverging) / len(diverging) if diverging else None}


# ---- the questions ------------------------------------------------------------------------------

def select_questions(n: int) -> list[dict]:
    """The first ``n`` PolicyDesk questions of a fixed interleaving: policies in rotation, every
    6th question (positions 2, 8, 14, ...) unanswerable while any are left, as in the data set
    (2 of 12 per policy). Raises ValueError for n outside [1, 96]."""
    qs = policydesk.questions()
    if not 1 <= n <= len(qs):
        raise ValueError(f"num_questions must be in [1, {len(qs)}], got {n}")

    def rotate(items):
        by: dict[str, list[dict]] = {}
        for q in items:
            by.setdefault(q["policy"], []).append(q)
        names = sorted(by)
        return [by[p][k] for k in range(max(map(len, by.values()))) for p in names if k < len(by[p])]

    ans, unans = rotate([q for q in qs if q["answerable"]]), rotate([q for q in qs if not q["answerable"]])
    out = []
    while len(out) < n:
        take_unans = (len(out) % 6 == 2 and unans) or not ans
        out.append((unans if take_unans else ans).pop(0))
    return out


def conversation(question: dict) -> list[dict]:
    """The chat messages of one question (the data set's prompt layout)."""
    return [{"role": "system", "content": policydesk.system_message(question["policy"])},
            {"role": "user", "content": question["question"]}]


# ---- answering ----------------------------------------------------------------------------------

def reference_engine_kwargs(engine_kwargs: dict, dtype: str = "float32") -> dict:
    """The unoptimised reference of a configuration: the same model and memory settings, dense
    ``dtype`` weights, KV cache in ``dtype``, no speculative decoding, continuous batching."""
    ref = {k: v for k, v in engine_kwargs.items() if v is not None}
    for k in ("quant_group_size", "enable_calibration", "calibration_data", "num_speculative_tokens",
              "speculative_adaptive", "draft_model", "draft_num_layers", "draft_max_model_len",
              "prompt_lookup_max", "prompt_lookup_min"):
        ref.pop(k, None)
    ref.update(dtype=dtype, weight_format="none", kv_cache_dtype="auto", speculative_method="",
               policy="continuous")
    return ref


def answer_with_llm(engine_kwargs: dict, questions: list[dict], max_tokens: int) -> tuple[list[dict], dict]:
    """Answer ``questions`` greedily with an in-process :class:`kvmesh.LLM` built from
    ``engine_kwargs`` (EngineConfig fields; None values ignored). Returns the answers
    (``{id, text, token_ids, finish_reason}``) and the engine's resolved settings. The engine
    is freed before returning. Raises EngineError for unservable settings."""
    from kvmesh import LLM, SamplingParams

    llm = LLM(**{k: v for k, v in engine_kwargs.items() if v is not None})
    try:
        cfg = llm.engine.cfg
        settings = dict(dataclasses.asdict(cfg), torch_dtype=str(cfg.torch_dtype).removeprefix("torch."))
        outs = llm.chat([conversation(q) for q in questions], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        answers = [{"id": q["id"], "text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                    "finish_reason": o.outputs[0].finish_reason} for q, o in zip(questions, outs)]
    finally:
        shutdown = getattr(llm.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm
        gc.collect()
    return answers, settings


async def answer_via_gateway(address: str, questions: list[dict], max_tokens: int,
                             concurrency: int = 8) -> list[dict]:
    """Answer ``questions`` greedily through a kvmesh gateway's Chat RPC (``concurrency``
    in flight). Returns ``{id, text, token_ids, finish_reason}`` per question, in order.
    Raises grpc.RpcError when a call fails."""
    import grpc

    from kvmesh.client import chat_messages, finish_reason_name, sampling
    from kvmesh.v1 import llm_pb2, llm_pb2_grpc

    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)

        async def one(q):
            async with sem:
                req = llm_pb2.ChatRequest(messages=chat_messages(conversation(q)),
                                          sampling=sampling(temperature=0.0, max_tokens=max_tokens))
                text, ids, reason = [], [], None
                async for m in stub.Chat(req):
                    text.append(m.text)
                    ids += m.token_ids
                    if m.finished:
                        reason = finish_reason_name(m)
                return {"id": q["id"], "text": "".join(text), "token_ids": ids, "finish_reason": reason}

        return list(await asyncio.gather(*(one(q) for q in questions)))


# ---- evaluation ---------------------------------------------------------------------------------

def score(answers: list[dict], questions: list[dict]) -> dict:
    """Accuracy and grounding of ``answers`` (in ``questions`` order), with per-question rows."""
    if [a["id"] for a in answers] != [q["id"] for q in questions]:
        raise ValueError("answers and questions are not in the same order")
    sources = {p: policydesk.system_message(p) for p in {q["policy"] for q in questions}}
    rows = []
    for a, q in zip(answers, questions):
        rows.append({"id": q["id"], "answerable": q["answerable"], "correct": is_correct(a["text"], q),
                     "grounding": grounding(a["text"], sources[q["policy"]]), "text": a["text"],
                     "token_ids": a["token_ids"]})
    grounded = [r["grounding"] for r in rows if r["grounding"] is not None]
    return {"accuracy": accuracy([r["correct"] for r in rows], [r["answerable"] for r in rows]),
            "grounding": sum(grounded) / len(grounded) if grounded else None, "questions": rows}


def compare(test: dict, reference: dict) -> dict:
    """Agreement and the gate of scored answers ``test`` against scored ``reference`` answers."""
    ag = agreement([r["token_ids"] for r in test["questions"]], [r["token_ids"] for r in reference["questions"]])
    for r, ref in zip(test["questions"], reference["questions"]):
        r["first_divergence"] = first_divergence(r["token_ids"], ref["token_ids"])
    acc, ref_acc = test["accuracy"]["overall"], reference["accuracy"]["overall"]
    return {**ag, "accuracy_drop_points": accuracy_drop_points(acc, ref_acc),
            "passes_gate": passes_gate(acc, ref_acc)}


def evaluate(answers: list[dict], questions: list[dict], reference_answers: list[dict]) -> dict:
    """The whole report of a configuration's answers against the reference's (same questions)."""
    ref = score(reference_answers, questions)
    test = score(answers, questions)
    cmp = compare(test, ref)
    return {"num_questions": len(questions), "accuracy": test["accuracy"], "grounding": test["grounding"],
            **cmp, "reference": {"accuracy": ref["accuracy"], "grounding": ref["grounding"]},
            "questions": [dict(r, reference_text=rr["text"]) for r, rr in zip(test["questions"], ref["questions"])]}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def summary(result: dict) -> str:
    """A few printable lines of an :func:`evaluate` result."""
    a, r = result["accuracy"], result["reference"]["accuracy"]
    mfd = result["mean_first_divergence"]
    return "\n".join([
        f"questions: {result['num_questions']}, max_tokens {result.get('max_tokens', '-')}",
        f"key-fact accuracy: answerable {_pct(a['answerable'])}, unanswerable {_pct(a['unanswerable'])}, "
        f"overall {_pct(a['overall'])} (reference {_pct(r['overall'])}; drop {result['accuracy_drop_points']:+.1f} points)",
        f"agreement with the reference: {_pct(result['agreement'])} identical, {result['num_diverging']} diverging, "
        f"mean first divergence {'-' if mfd is None else f'{mfd:.1f}'} tokens",
        f"grounding: {_pct(result['grounding'])} (reference {_pct(result['reference']['grounding'])})",
        f"quality gate (drop <= {GATE_POINTS:g} points): {'PASS' if result['passes_gate'] else 'FAIL'}",
    ])


# ---- command line -------------------------------------------------------------------------------

def _load_reference(path: Path, meta: dict, questions: list[dict]) -> list[dict] | None:
    """Cached reference answers from ``path`` (None when the file does not exist). Raises
    EngineError naming the field that does not match this run."""
    from scheduler.request import EngineError

    if not path.exists():
        return None
    data = json.loads(path.read_text())
    for k in ("model", "max_tokens", "dtype"):
        if data.get(k) != meta[k]:
            raise EngineError(f"--reference {path}: {k} is {data.get(k)!r}, this run's is {meta[k]!r}")
    by_id = {a["id"]: a for a in data["answers"]}
    missing = [q["id"] for q in questions if q["id"] not in by_id]
    if missing:
        raise EngineError(f"--reference {path}: no answers for questions {missing[:5]}")
    return [by_id[q["id"]] for q in questions]


def build_parser() -> argparse.ArgumentParser:
    from kvmesh.cli import add_engine_args

    p = argparse.ArgumentParser(
        prog="kvmesh eval faithfulness",
        description="Answer PolicyDesk questions greedily with a configuration (engine flags) and with the "
                    "unoptimised reference (dense weights and KV cache in --reference-dtype, no speculative "
                    "decoding, continuous batching); print key-fact accuracy, agreement with the reference, "
                    "grounding and the quality gate (accuracy drop <= 2 points). See docs/benchmarks.md.")
    p.add_argument("--num-questions", type=int, default=24, metavar="N",
                   help="questions, policies in rotation, every 6th unanswerable (24; 96 = all)")
    p.add_argument("--max-tokens", type=int, default=96, metavar="N", help="answer length limit (96)")
    p.add_argument("--reference", metavar="FILE", help="reference answers: loaded when FILE exists, else "
                                                       "computed and written there")
    p.add_argument("--reference-dtype", default="float32", help="dtype of the reference (float32)")
    p.add_argument("--server", metavar="HOST:PORT", help="answer through this kvmesh gateway instead of an "
                                                         "in-process engine (engine flags then only shape the "
                                                         "reference: give the server's --model)")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads here (0 = torch's default)")
    p.add_argument("--output", metavar="FILE", help="write the JSON result here")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from kvmesh.cli import engine_kwargs
    from kvmesh.config import EngineConfig
    from scheduler.request import EngineError

    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        raise EngineError(f"max_tokens must be >= 1, got {args.max_tokens}")
    try:
        questions = select_questions(args.num_questions)
    except ValueError as e:
        raise EngineError(str(e)) from None
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    kw = engine_kwargs(args)
    test_cfg = EngineConfig.from_env(**kw)              # bad settings fail before any model loads
    ref_kw = reference_engine_kwargs({k: getattr(test_cfg, k) for k in kw}, args.reference_dtype)
    EngineConfig.from_env(**ref_kw)
    t0 = time.perf_counter()
    meta = {"model": test_cfg.model, "max_tokens": args.max_tokens, "dtype": args.reference_dtype}
    ref_path = Path(args.reference) if args.reference else None
    ref_answers = _load_reference(ref_path, meta, questions) if ref_path else None
    if ref_answers is None:
        print(f"reference: {test_cfg.model}, dense {args.reference_dtype}, continuous batching ...",
              file=sys.stderr, flush=True)
        ref_answers, _ = answer_with_llm(ref_kw, questions, args.max_tokens)
        if ref_path:
            ref_path.write_text(json.dumps({**meta, "engine": ref_kw, "answers": ref_answers}, indent=1))
    print(f"configuration under test{' at ' + args.server if args.server else ''} ...", file=sys.stderr, flush=True)
    if args.server:
        answers, settings = asyncio.run(answer_via_gateway(args.server, questions, args.max_tokens)), {"server": args.server}
    else:
        answers, settings = answer_with_llm(kw, questions, args.max_tokens)
    result = {"model": test_cfg.model, "max_tokens": args.max_tokens, "config": settings,
              "reference_config": ref_kw, **evaluate(answers, questions, ref_answers),
              "elapsed_s": time.perf_counter() - t0}
    print(summary(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
