"""The benchmark's requests: data sets (PolicyDesk questions and chats, random token ids) and
JSONL workload files (:mod:`bench.serve`)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvmesh.core.errors import EngineError

DATASETS = ("policydesk", "policydesk-chat", "random")


@dataclass
class BenchRequest:
    """One arrival of the benchmark: a single-turn request, or a multi-turn session.

    Exactly one of ``messages`` (a conversation for the Chat RPC / chat completions),
    ``prompt_token_ids`` (token ids for Generate; ``prompt`` then holds their text for HTTP
    backends) or ``prompt`` (text) describes the input. A session has ``turns``: user messages
    sent one after the other after ``messages`` (the system message), each with the model's
    previous answers in the history; each turn is one request. ``info`` carries the data set's
    metadata (policy, reference answers, key facts) for evaluations."""

    id: str
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 128
    turns: list[str] | None = None
    session_id: str = ""
    info: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.turns) if self.turns else 1

    def to_json(self) -> dict:
        """The workload-file line: ``{"id", "messages" | "prompt" (+ "prompt_token_ids"), "max_tokens"}``
        (+ ``"turns"`` for a session, ``"info"`` when the data set has metadata)."""
        out: dict = {"id": self.id}
        if self.messages is not None:
            out["messages"] = self.messages
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        out["max_tokens"] = self.max_tokens
        if self.turns:
            out["turns"] = self.turns
        if self.info:
            out["info"] = self.info
        return out

    @classmethod
    def from_json(cls, d: dict) -> "BenchRequest":
        if not any(d.get(k) is not None for k in ("messages", "prompt", "prompt_token_ids")):
            raise EngineError(f"workload line {d.get('id', '?')!r}: needs messages, prompt or prompt_token_ids")
        return cls(id=str(d["id"]), messages=d.get("messages"), prompt=d.get("prompt"),
                   prompt_token_ids=d.get("prompt_token_ids"), max_tokens=int(d.get("max_tokens", 128)),
                   turns=d.get("turns"), session_id=d.get("session_id", ""), info=d.get("info") or {})


def _pick(items: list, n: int, seed: int) -> list[tuple[int, object]]:
    """``n`` items in a seeded random order: (repeat, item); the whole list is reshuffled for each
    further pass when ``n`` exceeds it."""
    rng, out, rep = random.Random(seed), [], 0
    while len(out) < n:
        order = list(items)
        rng.shuffle(order)
        out += [(rep, it) for it in order[:n - len(out)]]
        rep += 1
    return out


def _rid(base: str, rep: int) -> str:
    return base if rep == 0 else f"{base}#{rep}"


def load_requests(dataset: str, *, num_prompts: int | None, seed: int = 0, max_tokens: int = 128,
                  **dataset_kwargs) -> list[BenchRequest]:
    """The benchmark's arrivals from a data set, in a seeded random order.

    - ``policydesk``: PolicyDesk questions (96), messages = [system: system prompt + policy,
      user: question]; ``num_prompts`` None = all of them once; more than 96 repeat them
      (ids ``<id>#k``).
    - ``policydesk-chat``: PolicyDesk chats (24 sessions, 4-6 turns each); one arrival per session.
    - ``random``: ``random_input_len`` (1024) prompt tokens and ``random_output_len`` (128)
      output tokens per request (``max_tokens``; the ``max_tokens`` argument is not used), each
      drawn uniformly from ``[len x (1 - random_range_ratio), len x (1 + random_range_ratio)]``;
      token ids uniform over the vocabulary of ``tokenizer`` (a model name, directory or
      tokenizer object; default smollm2-135m-instruct) without its special tokens; ``prompt``
      is their decoded text. ``num_prompts`` None = 100.

    Raises EngineError for an unknown data set or bad lengths."""
    if num_prompts is not None and num_prompts < 1:
        raise EngineError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_tokens < 1:
        raise EngineError(f"max_tokens must be >= 1, got {max_tokens}")
    if dataset == "policydesk":
        import policydesk
        qs = policydesk.questions()
        return [BenchRequest(id=_rid(q["id"], rep), max_tokens=max_tokens,
                             messages=[{"role": "system", "content": policydesk.system_message(q["policy"])},
                                       {"role": "user", "content": q["question"]}],
                             info={k: q[k] for k in ("policy", "question", "reference_answer", "key_facts",
                                                     "answerable")})
                for rep, q in _pick(qs, num_prompts or len(qs), seed)]
    if dataset == "policydesk-chat":
        import policydesk
        chats = policydesk.chats()
        return [BenchRequest(id=_rid(c["id"], rep), max_tokens=max_tokens, session_id=_rid(c["id"], rep),
                             messages=[{"role": "system", "content": policydesk.system_message(c["policy"])}],
                             turns=[t["user"] for t in c["turns"]],
                             info={"policy": c["policy"], "turns": c["turns"]})
                for rep, c in _pick(chats, num_prompts or len(chats), seed)]
    if dataset == "random":
        return _random_requests(num_prompts or 100, seed, **dataset_kwargs)
    raise EngineError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")


def _random_requests(n: int, seed: int, *, random_input_len: int = 1024, random_output_len: int = 128,
                     random_range_ratio: float = 0.0, tokenizer=None) -> list[BenchRequest]:
    if random_input_len < 1 or random_output_len < 1:
        raise EngineError(f"random_input_len and random_output_len must be >= 1, got {random_input_len}, "
                          f"{random_output_len}")
    if not 0 <= random_range_ratio < 1:
        raise EngineError(f"random_range_ratio must be in [0, 1), got {random_range_ratio}")
    tok = _tokenizer(tokenizer)
    special = set(tok.all_special_ids)
    vocab = np.array([i for i in range(len(tok)) if i not in special])
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - random_range_ratio))), int(mean * (1 + random_range_ratio))
        return rng.integers(lo, max(lo, hi) + 1, size=n)

    ins, outs = lengths(random_input_len), lengths(random_output_len)
    reqs = []
    for i in range(n):
        ids = rng.choice(vocab, size=int(ins[i])).tolist()
        reqs.append(BenchRequest(id=f"random-{i}", prompt_token_ids=ids, prompt=tok.decode(ids),
                                 max_tokens=int(outs[i])))
    return reqs


def _tokenizer(name_or_tok):
    if name_or_tok is not None and not isinstance(name_or_tok, (str, os.PathLike)):
        return name_or_tok
    from transformers import AutoTokenizer

    from kvmesh.hub.pull import resolve_model
    name = str(name_or_tok or "smollm2-135m-instruct")
    path = Path(name) if Path(name).is_dir() else resolve_model(name)
    return AutoTokenizer.from_pretrained(str(path))


def save_workload(path: str | Path, requests: Sequence[BenchRequest]) -> None:
    """Write ``requests`` as JSONL (one :meth:`BenchRequest.to_json` per line)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")


def load_workload(path: str | Path, num_prompts: int | None = None) -> list[BenchRequest]:
    """Requests of a JSONL workload file, in file order (the first ``num_prompts``)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    reqs = [BenchRequest.from_json(json.loads(line)) for line in lines if line.strip()]
    if not reqs:
        raise EngineError(f"workload: {path} holds no requests")
    return reqs[:num_prompts] if num_prompts else reqs
