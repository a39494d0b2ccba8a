"""Faithfulness of a configuration on PolicyDesk: does an optimisation (quantized weights or KV
cache, speculative decoding, another runtime or batching policy) change what the model answers?

``kvmesh eval faithfulness [engine flags]`` answers the PolicyDesk set greedily (temperature 0)
with the configuration under test and with its unoptimised reference configuration, scores
both, and judges the configuration with the paired gate of :mod:`bench.gate`.

The set (:func:`select_items`): by default the **whole** data set, every single-turn question
(96) and every turn of every multi-turn chat (24 chats, 116 turns): 212 scored items. Prompt
layout (policydesk/data/README.md), through the model's chat template: system prompt +
the policy text as the system message; a question is one user message; chat turn ``k`` is the
chat's first ``k`` user messages, each earlier one followed by **the configuration's own
reply** to it as an assistant message (so a chat is answered turn by turn, and a configuration
that derails in turn 2 carries its own derailed reply into turn 3). Each chat turn is scored on
its own key facts (or abstention, when unanswerable).

Scores (rules in :mod:`bench.scoring`): key-fact accuracy, overall, for questions and chat
turns, answerable and unanswerable items, and per policy, each with its 95% Wilson interval;
agreement with the reference (identical greedy token ids) and first divergence; grounding.

Gate (:func:`bench.gate.verdict`): the configuration's per-item correctness against the
reference's on the same items: McNemar's exact test on the discordant pairs and the accuracy
difference with its 95% interval; ``FAIL`` (worse with p < 0.05, or more than 2 points below),
``PASS`` (the interval shows the drop is at most 2 points) or ``NO EVIDENCE`` (cannot tell).

The reference is the configuration under test with its optimisations undone: dense weights
(``weight_format none``), KV cache in the model dtype (``kv_cache_dtype auto``), no speculative
decoding, continuous batching, in ``--reference-dtype`` (float32). It is computed in the same
invocation (a second engine, loaded after the first is freed) or loaded from ``--reference
FILE`` (written there when the file does not exist yet). With ``--server HOST:PORT`` the
configuration is the served mesh, asked through its gateway (routing, speculative decoding, KV
tiers and all); the engine flags then describe only the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import policydesk
from bench import command, gate, scoring
from bench.markdown import add_output_args
from kvmesh.core.flags import add_engine_args, engine_kwargs

NUM_QUESTIONS, NUM_CHATS = 96, 24      # the whole data set


# ---- the items ----------------------------------------------------------------------------------

def _rotate(items: list[dict]) -> list[dict]:
    """``items`` reordered with their policies in rotation (sorted policy ids), each policy's
    items in data-set order."""
    by: dict[str, list[dict]] = {}
    for q in items:
        by.setdefault(q["policy"], []).append(q)
    names = sorted(by)
    return [by[p][k] for k in range(max(map(len, by.values()))) for p in names if k < len(by[p])]


def select_questions(n: int) -> list[dict]:
    """The first ``n`` PolicyDesk questions of a fixed interleaving: policies in rotation, every
    6th question (positions 2, 8, 14, ...) unanswerable while any are left, as in the data set
    (2 of 12 per policy). Raises ValueError for n outside [1, 96]."""
    qs = policydesk.questions()
    if not 1 <= n <= len(qs):
        raise ValueError(f"num_questions must be in [1, {len(qs)}], got {n}")
    ans, unans = _rotate([q for q in qs if q["answerable"]]), _rotate([q for q in qs if not q["answerable"]])
    out = []
    while len(out) < n:
        take_unans = (len(out) % 6 == 2 and unans) or not ans
        out.append((unans if take_unans else ans).pop(0))
    return out


def select_chats(n: int) -> list[dict]:
    """The first ``n`` PolicyDesk chats, policies in rotation. Raises ValueError for n outside
    [0, 24]."""
    cs = policydesk.chats()
    if not 0 <= n <= len(cs):
        raise ValueError(f"num_chats must be in [0, {len(cs)}], got {n}")
    return _rotate(cs)[:n]


def select_items(num_questions: int = NUM_QUESTIONS, num_chats: int = NUM_CHATS) -> list[dict]:
    """The scored items: ``num_questions`` questions (:func:`select_questions`; 0 for none),
    then every turn of ``num_chats`` chats (:func:`select_chats`). An item is ``{id, policy,
    kind ("question" | "chat"), chat (chat id or None), turn (1-based or None), question (the
    user message), key_facts, answerable}``; a chat turn's id is ``<chat id>/<turn>``. Raises
    ValueError for counts out of range or no items at all."""
    if num_questions == 0 and num_chats == 0:
        raise ValueError("num_questions and num_chats are both 0: nothing to evaluate")
    items = [] if num_questions == 0 else [
        {"id": q["id"], "policy": q["policy"], "kind": "question", "chat": None, "turn": None,
         "question": q["question"], "key_facts": q["key_facts"], "answerable": q["answerable"]}
        for q in select_questions(num_questions)]
    for c in select_chats(num_chats):
        for k, t in enumerate(c["turns"], 1):
            items.append({"id": f"{c['id']}/{k}", "policy": c["policy"], "kind": "chat", "chat": c["id"], "turn": k,
                          "question": t["user"], "key_facts": t["key_facts"], "answerable": t["answerable"]})
    return items


def conversation(item: dict, earlier: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The chat messages of one item: the system message, the ``earlier`` ``(user, assistant)``
    exchanges of its chat, then its user message."""
    msgs = [{"role": "system", "content": policydesk.system_message(item["policy"])}]
    for user, reply in earlier:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return msgs + [{"role": "user", "content": item["question"]}]


# ---- answering ----------------------------------------------------------------------------------

Answer = dict          # {id, text, token_ids, finish_reason}
Generate = Callable[[list[list[dict]]], Awaitable[list[Answer]]]   # conversations -> answers


async def answer_items(items: list[dict], generate: Generate) -> list[Answer]:
    """Answer ``items`` in rounds with ``generate`` (awaitable; a batch of conversations → one
    answer ``{text, token_ids, finish_reason}`` each, in order): round 1 holds every question and every chat's first turn, round ``k`` every
    chat's turn ``k``, its conversation built from the answers of the chat's earlier rounds (the
    configuration's own replies). Returns ``{id, text, token_ids, finish_reason}`` per item, in
    ``items`` order."""
    answers: dict[str, Answer] = {}
    pending = sorted(items, key=lambda it: it["turn"] or 1)
    by_id = {it["id"]: it for it in items}
    rnd = 1
    while pending:
        batch = [it for it in pending if (it["turn"] or 1) == rnd]
        pending = [it for it in pending if (it["turn"] or 1) != rnd]
        convs = []
        for it in batch:
            earlier = [] if it["kind"] == "question" else [
                (by_id[f"{it['chat']}/{k}"]["question"], answers[f"{it['chat']}/{k}"]["text"]) for k in range(1, it["turn"])]
            convs.append(conversation(it, earlier))
        for it, a in zip(batch, await generate(convs) if convs else []):
            answers[it["id"]] = {"id": it["id"], **a}
        rnd += 1
    return [answers[it["id"]] for it in items]


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


def llm_generate(llm, max_tokens: int) -> Generate:
    """The :data:`Generate` of an in-process :class:`kvmesh.LLM`: greedy, at most
    ``max_tokens`` tokens per answer."""
    from kvmesh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    async def generate(convs):
        return [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                 "finish_reason": o.outputs[0].finish_reason} for o in llm.chat(convs, params)]
    return generate


def answer_with_llm(engine_kwargs: dict, items: list[dict], max_tokens: int) -> tuple[list[Answer], dict]:
    """Answer ``items`` (:func:`answer_items`) greedily with an in-process :class:`kvmesh.LLM`
    built from ``engine_kwargs`` (EngineConfig fields; None values ignored). Returns the answers
    and the engine's resolved settings. The engine is freed before returning. Raises EngineError
    for unservable settings."""
    from kvmesh import LLM

    llm = LLM(**{k: v for k, v in engine_kwargs.items() if v is not None})
    try:
        cfg = llm.engine.cfg
        settings = dict(dataclasses.asdict(cfg), torch_dtype=str(cfg.torch_dtype).removeprefix("torch."))
        answers = asyncio.run(answer_items(items, llm_generate(llm, max_tokens)))
    finally:
        shutdown = getattr(llm.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm
        gc.collect()
    return answers, settings


async def answer_via_gateway(address: str, items: list[dict], max_tokens: int, concurrency: int = 8) -> list[Answer]:
    """Answer ``items`` (:func:`answer_items`) greedily through a kvmesh gateway's Chat RPC,
    ``concurrency`` requests in flight. Raises grpc.RpcError when a call fails."""
    import grpc

    from kvmesh.client import chat_messages
    from kvmesh.core.proto import finish_reason_name
    from kvmesh.core.proto import sampling_params_to_proto as sampling
    from kvmesh.v1 import llm_pb2, llm_pb2_grpc

    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)

        async def one(conv):
            async with sem:
                req = llm_pb2.ChatRequest(messages=chat_messages(conv),
                                          sampling=sampling(temperature=0.0, max_tokens=max_tokens))
                text, ids, reason = [], [], None
                async for m in stub.Chat(req):
                    text.append(m.text)
                    ids += m.token_ids
                    if m.finished:
                        reason = finish_reason_name(m)
                return {"text": "".join(text), "token_ids": ids, "finish_reason": reason}

        async def generate(convs):
            return list(await asyncio.gather(*map(one, convs)))
        return await answer_items(items, generate)


# ---- evaluation ---------------------------------------------------------------------------------

def accuracy_group(correct: Sequence[bool]) -> dict | None:
    """``{correct, n, accuracy, ci}`` of a group of items (``ci``: 95% Wilson interval, as
    fractions); None for an empty group."""
    n = len(correct)
    if not n:
        return None
    k = sum(correct)
    return {"correct": k, "n": n, "accuracy": k / n, "ci": list(gate.wilson_interval(k, n))}


def accuracy(rows: list[dict]) -> dict:
    """Key-fact accuracy of scored rows (``correct``, ``kind``, ``answerable``, ``policy``):
    groups ``overall``, ``questions``, ``chat_turns``, ``answerable``, ``unanswerable`` (each
    :func:`accuracy_group`, None when empty) and ``policies`` (policy id → group)."""
    def group(pred):
        return accuracy_group([r["correct"] for r in rows if pred(r)])
    return {"overall": group(lambda r: True), "questions": group(lambda r: r["kind"] == "question"),
            "chat_turns": group(lambda r: r["kind"] == "chat"), "answerable": group(lambda r: r["answerable"]),
            "unanswerable": group(lambda r: not r["answerable"]),
            "policies": {p: group(lambda r, p=p: r["policy"] == p) for p in sorted({r["policy"] for r in rows})}}


def score(answers: list[Answer], items: list[dict]) -> dict:
    """Accuracy (:func:`accuracy`) and grounding of ``answers`` (in ``items`` order), with
    per-item rows. Raises ValueError when the answers are not the items'."""
    if [a["id"] for a in answers] != [q["id"] for q in items]:
        raise ValueError("answers and items are not in the same order")
    sources = {p: policydesk.system_message(p) for p in {q["policy"] for q in items}}
    rows = []
    for a, q in zip(answers, items):
        rows.append({"id": q["id"], "policy": q["policy"], "kind": q["kind"], "answerable": q["answerable"],
                     "correct": scoring.is_correct(a["text"], q),
                     "grounding": scoring.grounding(a["text"], sources[q["policy"]]), "text": a["text"],
                     "token_ids": a["token_ids"]})
    grounded = [r["grounding"] for r in rows if r["grounding"] is not None]
    return {"accuracy": accuracy(rows), "grounding": sum(grounded) / len(grounded) if grounded else None,
            "items": rows}


def evaluate(answers: list[Answer], items: list[dict], reference_answers: list[Answer]) -> dict:
    """The whole report of a configuration's answers against the reference's (same items):
    ``accuracy``, ``grounding``, agreement, the paired ``gate`` (:func:`bench.gate.verdict`),
    the reference's ``accuracy``/``grounding``, and per-item rows."""
    ref, test = score(reference_answers, items), score(answers, items)
    ag = scoring.agreement([r["token_ids"] for r in test["items"]], [r["token_ids"] for r in ref["items"]])
    verdict = gate.verdict([r["correct"] for r in test["items"]], [r["correct"] for r in ref["items"]])
    rows = [dict(r, reference_correct=rr["correct"], reference_text=rr["text"],
                 first_divergence=scoring.first_divergence(r["token_ids"], rr["token_ids"]))
            for r, rr in zip(test["items"], ref["items"])]
    return {"num_items": len(items), "num_questions": sum(it["kind"] == "question" for it in items),
            "num_chat_turns": sum(it["kind"] == "chat" for it in items),
            "accuracy": test["accuracy"], "grounding": test["grounding"], **ag, "gate": verdict,
            "reference": {"accuracy": ref["accuracy"], "grounding": ref["grounding"]}, "items": rows}


def fmt_group(g: dict | None) -> str:
    """``"61.3% [54.6, 67.6] (130/212)"``, or ``-`` for no items."""
    if g is None:
        return "-"
    lo, hi = g["ci"]
    return f"{100 * g['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] ({g['correct']}/{g['n']})"


def fmt_share(g: dict | None) -> str:
    """``"61% [55-68]"``: a group's accuracy and 95% interval in whole percent (tables); ``-``
    for no items."""
    return "-" if g is None else f"{100 * g['accuracy']:.0f}% [{100 * g['ci'][0]:.0f}-{100 * g['ci'][1]:.0f}]"


def summary(result: dict) -> str:
    """Printable lines of an :func:`evaluate` result: accuracy by group and per policy with
    95% intervals, the reference's, agreement, grounding and the gate's verdict."""
    a, r, g = result["accuracy"], result["reference"]["accuracy"], result["gate"]
    mfd = result["mean_first_divergence"]
    lines = [f"items: {result['num_items']} ({result['num_questions']} questions, {result['num_chat_turns']} chat "
             f"turns), max_tokens {result.get('max_tokens', '-')}",
             f"{'key-fact accuracy (95% interval)':34s} {'configuration':32s} reference"]
    for k in ("overall", "questions", "chat_turns", "answerable", "unanswerable"):
        lines.append(f"  {k:32s} {fmt_group(a[k]):32s} {fmt_group(r[k])}")
    for p in a["policies"]:
        lines.append(f"  policy {p:25s} {fmt_group(a['policies'][p]):32s} {fmt_group(r['policies'][p])}")
    lo, hi = g["difference_ci_points"]
    lines += [
        f"agreement with the reference: {100 * result['agreement']:.1f}% identical, {result['num_diverging']} "
        f"diverging, mean first divergence {'-' if mfd is None else f'{mfd:.1f}'} tokens",
        f"grounding: {_pct(result['grounding'])} (reference {_pct(result['reference']['grounding'])})",
        f"paired: {g['reference_only']} items lost, {g['test_only']} gained, McNemar exact p = {g['p_value']:.3g}; "
        f"difference {g['difference_points']:+.1f} points, 95% interval [{lo:+.1f}, {hi:+.1f}]",
        f"quality gate (drop <= {gate.GATE_POINTS:g} points): {g['verdict']}: {g['reason']}"]
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


# ---- command line -------------------------------------------------------------------------------

def load_reference(path: Path, meta: dict, items: list[dict]) -> list[Answer] | None:
    """Cached reference answers from ``path`` (None when the file does not exist). Raises
    EngineError naming the field that does not match this run, or the missing items."""
    from kvmesh.core.errors import EngineError

    if not path.exists():
        return None
    data = json.loads(path.read_text())
    for k in ("model", "max_tokens", "dtype"):
        if data.get(k) != meta[k]:
            raise EngineError(f"--reference {path}: {k} is {data.get(k)!r}, this run's is {meta[k]!r}")
    by_id = {a["id"]: a for a in data["answers"]}
    missing = [q["id"] for q in items if q["id"] not in by_id]
    if missing:
        raise EngineError(f"--reference {path}: no answers for items {missing[:5]}")
    return [by_id[q["id"]] for q in items]


DESCRIPTION = ("Answer the PolicyDesk set (all questions and every turn of all chats, by default) greedily "
               "with a configuration (engine flags, or a served mesh with --server) and with the "
               "unoptimised reference (dense weights and KV cache in --reference-dtype, no speculative "
               "decoding, continuous batching); print key-fact accuracy per group and policy with 95% "
               "intervals, agreement, grounding, and the paired quality gate (McNemar exact test and "
               "the accuracy difference's interval: PASS, FAIL or NO EVIDENCE). See docs/benchmarks.md.")


def add_parser(subparsers, help: str) -> argparse.ArgumentParser:
    """``kvmesh eval faithfulness`` (:mod:`bench.command`)."""
    return command.add_parser(subparsers, "faithfulness", help, DESCRIPTION, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.faithfulness``: the same as ``kvmesh eval faithfulness``."""
    return command.main("kvmesh eval faithfulness", DESCRIPTION, add_arguments, run, argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-questions", type=int, default=NUM_QUESTIONS, metavar="N",
                   help=f"single questions, policies in rotation, every 6th unanswerable ({NUM_QUESTIONS} = all; 0 = none)")
    p.add_argument("--num-chats", type=int, default=NUM_CHATS, metavar="N",
                   help=f"multi-turn chats, policies in rotation, every turn scored ({NUM_CHATS} = all; 0 = none)")
    p.add_argument("--max-tokens", type=int, default=96, metavar="N", help="answer length limit per turn (96)")
    p.add_argument("--reference", metavar="FILE", help="reference answers: loaded when FILE exists, else "
                                                       "computed and written there")
    p.add_argument("--reference-dtype", default="float32", help="dtype of the reference (float32)")
    p.add_argument("--server", metavar="HOST:PORT", help="answer through this kvmesh gateway instead of an "
                                                         "in-process engine (engine flags then only shape the "
                                                         "reference: give the server's --model)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N", help="requests in flight with --server (8)")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads here (0 = torch's default)")
    add_output_args(p, table=False)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    """Answer the set with the reference and the configuration under test; print the summary."""
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.errors import EngineError

    if args.max_tokens < 1:
        raise EngineError(f"max_tokens must be >= 1, got {args.max_tokens}")
    if args.concurrency < 1:
        raise EngineError(f"concurrency must be >= 1, got {args.concurrency}")
    try:
        items = select_items(args.num_questions, args.num_chats)
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
    ref_answers = load_reference(ref_path, meta, items) if ref_path else None
    if ref_answers is None:
        print(f"reference: {test_cfg.model}, dense {args.reference_dtype}, continuous batching, {len(items)} items ...",
              file=sys.stderr, flush=True)
        ref_answers, _ = answer_with_llm(ref_kw, items, args.max_tokens)
        if ref_path:
            ref_path.write_text(json.dumps({**meta, "engine": ref_kw, "answers": ref_answers}, indent=1))
    print(f"configuration under test{' at ' + args.server if args.server else ''} ...", file=sys.stderr, flush=True)
    if args.server:
        answers = asyncio.run(answer_via_gateway(args.server, items, args.max_tokens, args.concurrency))
        settings = {"server": args.server}
    else:
        answers, settings = answer_with_llm(kw, items, args.max_tokens)
    result = {"model": test_cfg.model, "max_tokens": args.max_tokens, "config": settings,
              "reference_config": ref_kw, **evaluate(answers, items, ref_answers),
              "elapsed_s": time.perf_counter() - t0}
    print(summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
