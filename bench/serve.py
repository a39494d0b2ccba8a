"""``kvmesh bench serve``: an online serving benchmark (load generator) for kvmesh's gRPC gateway
and for OpenAI-compatible HTTP servers (vLLM, llama.cpp), after vLLM's ``vllm bench serve``
(``benchmarks/benchmark_serving.py``): the same arrival process, metrics and result keys.

Requests arrive at ``--request-rate`` per second (``inf``: all at t=0), with gamma-distributed
gaps of shape ``--burstiness`` (1 = Poisson) and mean ``1/rate``; ``--max-concurrency`` caps the
requests in flight. Each request is streamed and timed on the client (seconds internally,
milliseconds in reports):

- TTFT: request sent -> first streamed chunk carrying a token (kvmesh: a message with token
  ids; OpenAI: a non-empty ``delta.content``)
- ITL: the gaps between successive token-carrying chunks; a chunk with n tokens (speculative
  decoding, a server that batches its stream) gives one gap, as in vLLM
- TPOT: (E2EL - TTFT) / (output_tokens - 1), output tokens from the server's usage
- E2EL: request sent -> end of the stream
- goodput: completed requests per second that meet every SLO given (``--goodput ttft:500
  tpot:50 e2el:5000``, ms; a request with one output token counts TPOT 0, as vLLM)

Datasets: ``policydesk`` (single-turn questions), ``policydesk-chat`` (multi-turn sessions: one
arrival each, turns sent one after the other with the model's own answers in the history),
``random`` (uniformly random token ids of the model's vocabulary, special tokens excluded),
or ``--workload FILE`` (JSONL written by ``--save-workload``). See docs/benchmarks.md.

Usage::

    kvmesh bench serve --model smollm2-135m-instruct --executor local --num-prompts 32 --request-rate 2
    kvmesh bench serve --address 127.0.0.1:50051 --dataset policydesk-chat --max-concurrency 8
    kvmesh bench serve --backend openai-chat --base-url http://127.0.0.1:8000/v1 --workload w.jsonl
    kvmesh bench serve --backend openai-chat --model smollm2-135m-instruct --executor local   # kvmesh's own HTTP API
    kvmesh bench serve --dataset random --random-input-len 256 --save-workload random.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvmesh.core.errors import EngineError

DATASETS = ("policydesk", "policydesk-chat", "random")
BACKENDS = ("kvmesh", "openai-chat")
SLO_METRICS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")


# ---- requests and records -----------------------------------------------------------------------

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


@dataclass
class RequestRecord:
    """What the client saw of one request. Times in seconds: ``ttft``, ``itl`` (gaps between
    token-carrying chunks), ``e2el`` from the request's send; ``start_time`` is the send time
    from the benchmark's start. Token counts are the server's usage (``cached_tokens``: prompt
    tokens served from the prefix cache, when the server says). ``turn`` is the turn index in a
    session (``id`` is then ``<session id>/<turn>``)."""

    id: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    success: bool = False
    error: str = ""
    text: str = ""
    cached_tokens: int = 0
    start_time: float = 0.0
    session_id: str = ""
    turn: int = 0
    finish_reason: str = ""

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1) in seconds; None below two output tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


class StreamTimer:
    """The client-side timeline of one streamed request: :meth:`chunk` for every received chunk
    that carries tokens, then :meth:`done` or :meth:`failed`. Times from ``time.perf_counter``
    unless given (tests feed synthetic timelines)."""

    def __init__(self, now: float | None = None):
        self.start = time.perf_counter() if now is None else now
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []
        self.chunks = 0

    def chunk(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def done(self, rec: RequestRecord, *, text: str, output_tokens: int, prompt_tokens: int = 0,
             cached_tokens: int = 0, finish_reason: str = "", now: float | None = None) -> RequestRecord:
        """Fill ``rec`` for a stream that ended normally (failed when no chunk carried a token)."""
        now = time.perf_counter() if now is None else now
        if self.first is None:
            return self.failed(rec, "the stream carried no output tokens", now=now)
        rec.ttft, rec.itl, rec.e2el = self.first - self.start, self.itl, now - self.start
        rec.text, rec.output_tokens, rec.prompt_tokens, rec.cached_tokens = text, output_tokens, prompt_tokens, \
            cached_tokens
        rec.finish_reason, rec.start_time, rec.success = finish_reason, self.start, True
        return rec

    def failed(self, rec: RequestRecord, error: str, now: float | None = None) -> RequestRecord:
        now = time.perf_counter() if now is None else now
        rec.success, rec.error, rec.start_time, rec.e2el = False, error, self.start, now - self.start
        return rec


# ---- datasets -------------------------------------------------------------------------------------

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
        from bench import policydesk
        qs = policydesk.questions()
        return [BenchRequest(id=_rid(q["id"], rep), max_tokens=max_tokens,
                             messages=[{"role": "system", "content": policydesk.system_message(q["policy"])},
                                       {"role": "user", "content": q["question"]}],
                             info={k: q[k] for k in ("policy", "question", "reference_answer", "key_facts",
                                                     "answerable")})
                for rep, q in _pick(qs, num_prompts or len(qs), seed)]
    if dataset == "policydesk-chat":
        from bench import policydesk
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

    from workers.registry import resolve_model
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


# ---- backends: one async function each, streaming one request into a RequestRecord --------------

async def kvmesh_request(stub, req: BenchRequest, sampling: dict) -> RequestRecord:
    """One request through a kvmesh gateway (``kvmesh.v1.LLMService`` stub on a grpc.aio
    channel): Chat for ``messages``, Generate for token ids or text. ``sampling``:
    temperature, ignore_eos, seed (None = unset)."""
    import grpc

    from kvmesh.v1 import common_pb2, llm_pb2

    from google.protobuf.duration_pb2 import Duration

    sampling = dict(sampling)
    timeout = sampling.pop("timeout", None)
    extra = {"timeout": Duration(seconds=int(timeout))} if timeout else {}
    params = common_pb2.SamplingParams(max_tokens=req.max_tokens,
                                       **{k: v for k, v in sampling.items() if v is not None})
    if req.messages is not None:
        call = stub.Chat(llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                       for m in req.messages],
                                             sampling=params, session_id=req.session_id, **extra))
    elif req.prompt_token_ids is not None:
        call = stub.Generate(llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=req.prompt_token_ids),
                                                     sampling=params, session_id=req.session_id, **extra))
    else:
        call = stub.Generate(llm_pb2.GenerateRequest(prompt=req.prompt, sampling=params, session_id=req.session_id,
                                                     **extra))
    rec, timer = RequestRecord(id=req.id, session_id=req.session_id), StreamTimer()
    parts, final = [], None
    try:
        async for msg in call:
            if msg.token_ids:
                timer.chunk()
            parts.append(msg.text)
            if msg.finished:
                final = msg
    except grpc.aio.AioRpcError as e:
        return timer.failed(rec, f"{e.code().name}: {e.details()}")
    if final is None:
        return timer.failed(rec, "the stream ended without a final message")
    reason = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    if reason == "abort":
        return timer.failed(rec, "the server aborted the request")
    u = final.usage
    return timer.done(rec, text="".join(parts), output_tokens=u.completion_tokens, prompt_tokens=u.prompt_tokens,
                      cached_tokens=u.cached_prompt_tokens, finish_reason=reason)


async def openai_chat_request(session, base_url: str, model: str, req: BenchRequest,
                              sampling: dict) -> RequestRecord:
    """One streamed ``POST {base_url}/chat/completions`` (``session``: aiohttp.ClientSession),
    with ``stream_options.include_usage`` for the token counts. A text or token-id prompt goes as
    one user message. Without a usage chunk the output tokens are the content chunks counted."""
    import aiohttp

    messages = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
    body = {"model": model, "messages": messages, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": sampling.get("temperature", 0.0)}
    if sampling.get("ignore_eos"):
        body["ignore_eos"] = True           # vLLM and llama.cpp extension
    if sampling.get("seed") is not None:
        body["seed"] = sampling["seed"]
    rec, timer = RequestRecord(id=req.id, session_id=req.session_id), StreamTimer()
    parts, usage, reason = [], None, ""
    try:
        async with session.post(base_url.rstrip("/") + "/chat/completions", json=body) as resp:
            if resp.status != 200:
                return timer.failed(rec, f"HTTP {resp.status}: {(await resp.text())[:500]}")
            async for raw in resp.content:          # SSE: one "data: {...}" line per event
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return timer.failed(rec, f"server error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        timer.chunk()
                        parts.append(content)
                    reason = choice.get("finish_reason") or reason
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        return timer.failed(rec, f"{type(e).__name__}: {e}")
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return timer.done(rec, text="".join(parts), output_tokens=usage.get("completion_tokens") or timer.chunks,
                      prompt_tokens=usage.get("prompt_tokens") or 0, cached_tokens=cached, finish_reason=reason)


SendFn = Callable[[BenchRequest, dict], Awaitable[RequestRecord]]


@contextlib.asynccontextmanager
async def open_backend(backend: str | SendFn, target: str, model: str = "",
                       connect_timeout: float = 60.0) -> AsyncIterator[SendFn]:
    """A ``send(request, sampling) -> RequestRecord`` for ``backend`` at ``target`` (gRPC address
    or base URL), its connection open for the block. A callable ``backend`` is used as is (tests).
    Raises EngineError for an unknown backend, ConnectionError when the server does not answer."""
    if callable(backend):
        yield backend
        return
    if backend == "kvmesh":
        import grpc

        from kvmesh.v1 import llm_pb2_grpc
        async with grpc.aio.insecure_channel(target) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), connect_timeout)
            except asyncio.TimeoutError:
                raise ConnectionError(f"no kvmesh gateway at {target} after {connect_timeout:g} s") from None
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            yield lambda req, sampling: kvmesh_request(stub, req, sampling)
        return
    if backend == "openai-chat":
        import aiohttp
        timeout = aiohttp.ClientTimeout(total=6 * 3600, sock_connect=connect_timeout)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            if not model:                   # the served model's name, as the server lists it
                try:
                    async with session.get(target.rstrip("/") + "/models") as resp:
                        model = (await resp.json())["data"][0]["id"]
                except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
                    raise ConnectionError(f"cannot list the models of {target} (give --model): {e}") from None
            yield lambda req, sampling: openai_chat_request(session, target, model, req, sampling)
        return
    raise EngineError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


# ---- arrivals and the run -------------------------------------------------------------------------

def arrival_times(n: int, request_rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    """Send times ``[n]`` (float64 seconds from the start) of ``n`` arrivals: the first at 0, then
    gaps drawn from Gamma(shape=burstiness, scale=1/(request_rate x burstiness)) (mean
    1/request_rate; burstiness 1 = exponential gaps, a Poisson process; < 1 burstier, > 1 more
    regular), as vLLM's benchmark_serving. ``request_rate`` inf: all at 0."""
    if not request_rate > 0:
        raise EngineError(f"request_rate must be > 0 (inf = all at once), got {request_rate}")
    if not burstiness > 0:
        raise EngineError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or n == 0:
        return np.zeros(n)
    rng = rng if rng is not None else np.random.default_rng(0)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def run_benchmark(backend: str | SendFn, target: str, requests: Sequence[BenchRequest], *,
                        request_rate: float = float("inf"), burstiness: float = 1.0,
                        max_concurrency: int | None = None, temperature: float = 0.0, seed: int = 0,
                        ignore_eos: bool = False, progress: bool = True, model: str = "",
                        num_warmups: int = 0, request_timeout: float | None = None) -> list[RequestRecord]:
    """Send ``requests`` to ``backend`` (``kvmesh`` at gRPC address ``target``, ``openai-chat`` at
    base URL ``target``, or a ``send`` callable) at :func:`arrival_times` (seeded with ``seed``),
    at most ``max_concurrency`` in flight. A session's turns go one after the other, each after
    the previous answer completed, with that answer in its history; if a turn fails, the rest
    are recorded as failed, not sent. ``num_warmups`` requests (the first ones, one at a time)
    go first and are not recorded. Sampling: ``temperature`` (0 = greedy; above 0 each request
    is seeded with ``seed``), ``ignore_eos``. ``request_timeout``: each kvmesh request's deadline
    in seconds, queueing included (None = the gateway's default, 300 s; at most its max_timeout).
    Returns one record per request (per turn), in arrival order, ``start_time`` from the start
    of the run."""
    from tqdm.auto import tqdm

    if max_concurrency is not None and max_concurrency < 1:
        raise EngineError(f"max_concurrency must be >= 1, got {max_concurrency}")
    times = arrival_times(len(requests), request_rate, burstiness, np.random.default_rng(seed))
    sampling = {"temperature": temperature, "ignore_eos": ignore_eos, "seed": seed if temperature > 0 else None,
                "timeout": request_timeout}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with open_backend(backend, target, model) as send:
        for req in list(requests)[:num_warmups]:
            first = _first_request(req)
            rec = await send(first, sampling)
            if not rec.success:
                raise ConnectionError(f"warm-up request {first.id} failed: {rec.error}")
        pbar = tqdm(total=sum(r.num_requests for r in requests), disable=not progress, unit="req",
                    desc="bench serve", file=sys.stderr)

        async def one(req: BenchRequest) -> RequestRecord:
            async with sem:
                rec = await send(req, sampling)
            pbar.update(1)
            return rec

        async def arrival(req: BenchRequest) -> list[RequestRecord]:
            if not req.turns:
                return [await one(req)]
            history, records = list(req.messages or []), []
            session = req.session_id or req.id
            for k, user in enumerate(req.turns):
                history.append({"role": "user", "content": user})
                rec = await one(dataclasses.replace(req, id=f"{req.id}/{k}", messages=list(history), turns=None,
                                                    session_id=session))
                rec.turn = k
                records.append(rec)
                if not rec.success:
                    for j in range(k + 1, len(req.turns)):
                        records.append(RequestRecord(id=f"{req.id}/{j}", session_id=session, turn=j,
                                                     error=f"not sent: turn {k} failed",
                                                     start_time=rec.start_time + rec.e2el))
                        pbar.update(1)
                    break
                history.append({"role": "assistant", "content": rec.text})
            return records

        t0 = time.perf_counter()
        tasks = []
        for req, at in zip(requests, times):
            if (delay := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(arrival(req)))
        try:
            done = await asyncio.gather(*tasks)
        finally:
            pbar.close()
    records = [r for rs in done for r in rs]
    for r in records:
        r.start_time -= t0
    return records


def _first_request(req: BenchRequest) -> BenchRequest:
    if not req.turns:
        return req
    return dataclasses.replace(req, messages=[*(req.messages or []), {"role": "user", "content": req.turns[0]}],
                               turns=None)


# ---- metrics ---------------------------------------------------------------------------------------

def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        try:
            v = float(value)
        except ValueError:
            v = -1.0
        if not sep or name not in SLO_METRICS or not v > 0:
            raise EngineError(f"goodput: expected NAME:MS with NAME in {', '.join(SLO_METRICS)} and MS > 0, "
                              f"got {item!r}")
        slos[name] = v
    return slos


def benchmark_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the run's start to the end of its last request (``start_time + e2el``)."""
    return max((r.start_time + r.e2el for r in records), default=0.0)


def _pkey(p: float) -> str:
    return f"p{p:g}"


def summarize(records: Sequence[RequestRecord], duration: float | None = None, *,
              percentiles: Sequence[float] = (50, 90, 99), goodput_slos: dict | None = None) -> dict:
    """vLLM's aggregate metrics over the successful requests: ``mean_/median_/std_/p<P>_`` of
    ``ttft``, ``tpot``, ``itl``, ``e2el`` in ms (None when no request has the metric; TPOT only over
    requests with 2+ output tokens); ``request_throughput`` (completed/s),
    ``output_throughput`` and ``total_token_throughput`` (tokens/s), ``request_goodput``
    (completed/s meeting every SLO of ``goodput_slos``, ms by metric name ttft/tpot/e2el; None
    without SLOs), ``completed``, ``failed``, token totals, ``prefix_cache_hit_rate`` (cached /
    prompt tokens), ``duration`` (s; None = :func:`benchmark_duration`). Percentiles are numpy's
    (linear interpolation)."""
    if duration is None:
        duration = benchmark_duration(records)
    if not duration > 0:
        raise EngineError(f"duration must be > 0, got {duration}")
    slos = goodput_slos or {}
    for name, v in slos.items():
        if name not in SLO_METRICS or not v > 0:
            raise EngineError(f"goodput_slos: {name}={v}: names are {', '.join(SLO_METRICS)}, values ms > 0")
    ok = [r for r in records if r.success]
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    n_cached = sum(r.cached_tokens for r in ok)
    out = {"duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
           "total_input_tokens": n_in, "total_output_tokens": n_out, "total_cached_tokens": n_cached,
           "prefix_cache_hit_rate": n_cached / n_in if n_in else None,
           "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration, "request_goodput": None}
    if slos:
        def good(r: RequestRecord) -> bool:
            got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
            return all(got[name] * 1e3 <= slo for name, slo in slos.items())
        out["request_goodput"] = sum(map(good, ok)) / duration
    for name in METRICS:
        ms = np.asarray(values[name], dtype=np.float64) * 1e3
        have = ms.size > 0
        out[f"mean_{name}_ms"] = float(ms.mean()) if have else None
        out[f"median_{name}_ms"] = float(np.median(ms)) if have else None
        out[f"std_{name}_ms"] = float(ms.std()) if have else None
        for p in percentiles:
            out[f"{_pkey(p)}_{name}_ms"] = float(np.percentile(ms, p)) if have else None
    return out


def report(summary: dict, percentiles: Sequence[float], title: str = "Serving Benchmark Result") -> str:
    """vLLM-style text table of a :func:`summarize` result."""
    def row(label, v, fmt="{:.2f}"):
        return f"{label:<40}{'-' if v is None else fmt.format(v):>12}"

    lines = [f"{' ' + title + ' ':=^52}", row("Successful requests:", summary["completed"], "{}"),
             row("Failed requests:", summary["failed"], "{}"), row("Benchmark duration (s):", summary["duration"]),
             row("Total input tokens:", summary["total_input_tokens"], "{}"),
             row("Total generated tokens:", summary["total_output_tokens"], "{}"),
             row("Prefix cache hit rate:", summary["prefix_cache_hit_rate"], "{:.1%}"),
             row("Request throughput (req/s):", summary["request_throughput"])]
    if summary["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", summary["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", summary["output_throughput"]),
              row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for name, heading in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{heading:-^52}")
        lines.append(row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(row(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"]))
        lines += [row(f"P{p:g} {name.upper()} (ms):", summary[f"{_pkey(p)}_{name}_ms"]) for p in percentiles
                  if p != 50]
    lines.append("=" * 52)
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------------------------

def plot_ttft(runs: dict[str, Sequence[RequestRecord]], path: str | Path) -> None:
    """TTFT distribution of each run (label -> records): histogram and empirical CDF, in ms (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_h, ax_c) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs.items():
        ttft = np.sort([r.ttft * 1e3 for r in records if r.success])
        if ttft.size == 0:
            continue
        ax_h.hist(ttft, bins=min(50, max(5, ttft.size // 2)), alpha=0.5, label=label)
        ax_c.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=label)
    ax_h.set(xlabel="TTFT (ms)", ylabel="requests", title="TTFT histogram")
    ax_c.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    _save(fig, (ax_h, ax_c), path)


def plot_sweep(rows: Sequence[dict], path: str | Path) -> None:
    """Latency against achieved output throughput over a rate sweep (rows: ``{"request_rate", **summary}``):
    TTFT p50/p90 on the left, TPOT p50 and ITL p50 on the right, each point labelled with its rate (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["output_throughput"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, keys, title in ((axes[0], ("p50_ttft_ms", "p90_ttft_ms"), "TTFT"),
                            (axes[1], ("p50_tpot_ms", "p50_itl_ms"), "per output token")):
        for key in keys:
            ys = [r.get(key) for r in rows]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=key.replace("_ms", "").replace("_", " "))
        for r, x in zip(rows, xs):
            y = r.get(keys[0])
            if y is not None:
                ax.annotate(f"{r['request_rate']:g}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel="output throughput (tokens/s)", ylabel="latency (ms)", title=f"{title} vs throughput")
    _save(fig, axes, path)


def _save(fig, axes, path: str | Path) -> None:
    """Grid and legend on each axis, then the figure as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line ------------------------------------------------------------------------------------

def _rate(v: str) -> float:
    try:
        r = float(v)
    except ValueError:
        r = -1.0
    if not r > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 in requests/s or inf, got {v!r}")
    return r


def _rates(v: str) -> list[float]:
    return [_rate(x) for x in v.split(",") if x.strip()]


def _percentiles(v: str) -> list[float]:
    try:
        ps = [float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        ps = []
    if not ps or not all(0 < p < 100 for p in ps):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles in (0, 100), got {v!r}")
    return ps


def build_parser() -> argparse.ArgumentParser:
    from kvmesh.cli import add_engine_args, add_scheduler_args

    p = argparse.ArgumentParser(prog="kvmesh bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="kvmesh",
                   help="kvmesh: the gRPC gateway; openai-chat: streaming /v1/chat/completions (vLLM, llama.cpp)")
    g.add_argument("--address", metavar="HOST:PORT", help="kvmesh gateway; default: start a mesh (`kvmesh serve` "
                                                          "subprocess) from the engine and scheduler flags")
    g.add_argument("--base-url", metavar="URL", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1; "
                                                     "default (openai-chat): start a mesh and use its --http-port")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="policydesk")
    g.add_argument("--workload", metavar="FILE", help="replay a JSONL workload file (instead of --dataset)")
    g.add_argument("--save-workload", metavar="FILE", help="write the requests as JSONL and exit (no server)")
    g.add_argument("--num-prompts", type=int, metavar="N",
                   help="arrivals (sessions for policydesk-chat); default: the whole data set once (random: 100)")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N", help="output tokens per request (128)")
    g.add_argument("--random-input-len", type=int, default=1024, metavar="N")
    g.add_argument("--random-output-len", type=int, default=128, metavar="N")
    g.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="lengths uniform in [len x (1-R), len x (1+R)] (0)")
    g.add_argument("--tokenizer", metavar="NAME|DIR", help="tokenizer of the random data set (default: --model, "
                                                           "else smollm2-135m-instruct)")
    g.add_argument("--seed", type=int, default=0, help="request order, arrival gaps, random prompts (0)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rate, default=float("inf"), metavar="R",
                   help="requests (sessions) per second; inf = all at once (inf)")
    g.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular (1)")
    g.add_argument("--max-concurrency", type=int, metavar="N", help="most requests in flight (no limit)")
    g.add_argument("--sweep-rates", type=_rates, metavar="R,R,...", help="run at each rate (e.g. 0.5,1,2,inf)")
    g.add_argument("--num-warmups", type=int, default=0, metavar="N", help="unrecorded requests sent first (0)")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (0)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max-tokens tokens")
    g.add_argument("--request-timeout", type=float, metavar="S",
                   help="kvmesh backend: each request's deadline, queueing included (default: the gateway's, 300 s)")
    g = p.add_argument_group("results")
    g.add_argument("--percentiles", type=_percentiles, default=[50.0, 90.0, 99.0], metavar="P,P,...",
                   help="reported percentiles (50,90,99)")
    g.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (ms)")
    g.add_argument("--result-file", metavar="FILE", help="write config and summary (JSON)")
    g.add_argument("--save-detailed", action="store_true", help="per-request records in the result file")
    g.add_argument("--save-texts", action="store_true", help="generated texts in the result file")
    g.add_argument("--plot-dir", metavar="DIR", help="write ttft.png (and sweep.png with --sweep-rates)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_scheduler_args(p, listen=None)
    add_engine_args(p)
    return p


def _mesh_argv(args: argparse.Namespace) -> list[str]:
    """``kvmesh serve`` arguments of the engine and scheduler flags given (free loopback ports)."""
    from kvmesh.cli import ENGINE_FLAGS, SCHEDULER_FLAGS

    argv = ["serve", "--host", "127.0.0.1", "--port", "0", "--scheduler-port", "0", "--grace", "1"]
    if args.backend == "openai-chat":           # the mesh's own OpenAI-compatible HTTP API
        argv += ["--http-port", "0"]
    for rows, dest in ((ENGINE_FLAGS, "{}"), (SCHEDULER_FLAGS, "scheduler_{}")):
        for flag, fld, kw in rows:
            v = getattr(args, dest.format(fld), None)
            if v is None:
                continue
            argv += [flag] if kw.get("action") == "store_const" else [flag, str(v)]
    return argv


@contextlib.contextmanager
def _target(args: argparse.Namespace):
    """The address or base URL to benchmark; starts a mesh (``kvmesh serve``) when there is no
    --address (kvmesh) or --base-url (openai-chat: the mesh's own HTTP API, ``--http-port``)."""
    from kvmesh.cli import ENGINE_FLAGS, SCHEDULER_FLAGS

    local = [f for f, fld, _ in ENGINE_FLAGS if fld != "model" and getattr(args, fld) is not None]
    local += [f for f, fld, _ in SCHEDULER_FLAGS if getattr(args, f"scheduler_{fld}", None) is not None]
    given = args.base_url if args.backend == "openai-chat" else args.address
    if given and local:
        raise EngineError(f"{', '.join(local)}: engine/scheduler settings start a mesh; not with "
                          f"{'--base-url' if args.backend == 'openai-chat' else '--address'}")
    if given:
        yield given
    else:
        from bench.served import served
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        print(f"kvmesh: starting a mesh: kvmesh {' '.join(_mesh_argv(args))}", file=sys.stderr, flush=True)
        if args.backend == "openai-chat":
            with served(_mesh_argv(args), env, "http") as address:
                yield f"http://{address}/v1"
        else:
            with served(_mesh_argv(args), env, "gateway") as address:
                yield address


def _record_json(r: RequestRecord, texts: bool) -> dict:
    d = dataclasses.asdict(r)
    d["tpot"] = r.tpot
    if not texts:
        del d["text"]
    return d


def main(argv: list[str] | None = None) -> int:
    """``kvmesh bench serve``; returns the exit code (2 for bad arguments, 1 when the server fails)."""
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except EngineError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, RuntimeError) as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    if args.backend == "kvmesh" and args.base_url:
        raise EngineError("--base-url is for --backend openai-chat (kvmesh takes --address)")
    if args.workload:
        requests = load_workload(args.workload, args.num_prompts)
    else:
        requests = load_requests(args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                                 max_tokens=args.max_tokens,
                                 **({"random_input_len": args.random_input_len,
                                     "random_output_len": args.random_output_len,
                                     "random_range_ratio": args.random_range_ratio,
                                     "tokenizer": args.tokenizer or args.model} if args.dataset == "random" else {}))
    if args.save_workload:
        save_workload(args.save_workload, requests)
        print(f"kvmesh: wrote {len(requests)} requests to {args.save_workload}", file=sys.stderr)
        return 0
    rates = args.sweep_rates or [args.request_rate]
    # openai-chat: the name to send; none (the served model, from /v1/models) for a mesh started here
    model = (args.model or "") if args.backend == "openai-chat" and args.base_url else ""
    runs, rows = {}, []
    with _target(args) as target:
        for rate in rates:
            label = f"{rate:g} req/s"
            print(f"kvmesh: {args.backend} at {target}: {len(requests)} arrivals, rate {label}, burstiness "
                  f"{args.burstiness:g}, max concurrency {args.max_concurrency or '-'}", file=sys.stderr, flush=True)
            records = asyncio.run(run_benchmark(
                args.backend, target, requests, request_rate=rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, temperature=args.temperature, seed=args.seed,
                ignore_eos=args.ignore_eos, progress=not args.no_progress, model=model,
                num_warmups=args.num_warmups if rate == rates[0] else 0, request_timeout=args.request_timeout))
            summary = summarize(records, percentiles=args.percentiles, goodput_slos=slos)
            print(report(summary, args.percentiles, f"{args.backend}, {label}"), flush=True)
            for r in [r for r in records if not r.success][:3]:
                print(f"kvmesh: {r.id} failed: {r.error}", file=sys.stderr)
            runs[label] = records
            rows.append({"request_rate": rate, **summary})
    if args.plot_dir:
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        plot_ttft(runs, Path(args.plot_dir) / "ttft.png")
        if args.sweep_rates:
            plot_sweep(rows, Path(args.plot_dir) / "sweep.png")
    if args.result_file:
        config = {k: v for k, v in vars(args).items() if k != "func" and v is not None}
        config.update(target=target, num_arrivals=len(requests),
                      date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        out = {"config": config, **rows[-1], "runs": rows if args.sweep_rates else None}
        if args.save_detailed or args.save_texts:
            out["records"] = {label: [_record_json(r, args.save_texts) if args.save_detailed
                                      else {"id": r.id, "success": r.success, "text": r.text} for r in recs]
                              for label, recs in runs.items()}
        Path(args.result_file).write_text(json.dumps(_jsonable(out), indent=1, allow_nan=False))
    return 0 if any(row["completed"] for row in rows) else 1


def _jsonable(v):
    """Strict JSON: an infinite rate becomes the string "inf", paths strings."""
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
