"""Backends: one async function each, streaming one request into a :class:`RequestRecord`
(kvmesh's gRPC gateway; OpenAI-compatible ``/chat/completions`` over HTTP), and
:func:`open_backend`, which opens a connection for a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from bench.serve.metrics import RequestRecord, StreamTimer
from bench.serve.workload import BenchRequest
from kvmesh.core.errors import EngineError

BACKENDS = ("kvmesh", "openai-chat")


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
