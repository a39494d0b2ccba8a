"""OpenAI's JSON ↔ kvmesh.v1 messages, for the HTTP API (:mod:`gateway.http_api`).

Requests: :func:`chat_request` (``POST /v1/chat/completions``) and :func:`completion_request`
(``POST /v1/completions``) turn a request body into the ``ChatRequest`` / ``GenerateRequest`` the
gRPC API takes (so that both share :class:`gateway.stream.RequestPath`) plus the HTTP-only
:class:`Options`. A field of the wrong type or out of range raises :class:`gateway.stream.Status`
INVALID_ARGUMENT whose message starts with the field's name (``param`` in OpenAI's error body).

Fields: ``model``, ``messages`` (content a string or a list of ``{"type": "text"}`` parts; role
``developer`` is taken as ``system``), ``prompt`` (a string or token ids, or a list holding one of
them), ``max_tokens`` / ``max_completion_tokens`` (the latter wins), ``temperature``, ``top_p``,
``seed``, ``stop`` (a string or a list), ``presence_penalty``, ``frequency_penalty``, ``stream``,
``stream_options.include_usage``, ``logprobs`` (chat: a bool with ``top_logprobs`` in [0, 20];
completions: top-n in [0, 20]), ``n`` (only 1), ``user`` (ignored); vLLM's extensions ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``, ``request_id``; kvmesh's ``session_id`` (routing hint). Other fields are
ignored; those asking for something kvmesh does not do (``tools``, ``response_format``,
``logit_bias``, ``echo``, ``suffix``, ``best_of`` > 1 ...) are refused with 400.

The body itself (:func:`parse_body`): UTF-8 JSON (RFC 8259: no ``NaN``/``Infinity``, no
unpaired surrogate escapes such as ``"\\ud800"`` in any string or key), an object, nested at most
:data:`MAX_JSON_DEPTH` arrays and objects deep: checked on the raw bytes before any recursive
decoding. A body that breaks one of these is a 400 naming the field where there is one.

Responses: chunks and bodies as OpenAI's (``chat.completion``, ``chat.completion.chunk``,
``text_completion``), with ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens served
from the prefix cache) and vLLM's ``stop_reason`` (the stop string that matched) in each choice.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from itertools import accumulate, count
from operator import sub

from gateway.stream import Status, invalid
from kvmesh.core.proto import finish_reason_name
from kvmesh.v1 import common_pb2, llm_pb2

_UINT32, _UINT64 = 2**32 - 1, 2**64 - 1
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
                "suffix", "prediction", "audio", "modalities")
_HARMLESS = {"tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
             "modalities": (["text"],), "suffix": ("",)}     # the defaults of fields kvmesh does not do


# ---- the body: bytes -> JSON ---------------------------------------------------------------------

MAX_JSON_DEPTH = 64         # arrays and objects nested in a request body; a real request needs 4
# a JSON string from its opening quote to its closing one, or to the end of the bytes when it has
# none: every match ends where the next search starts, so one pass is linear in the body
_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)')
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_BRACKET_STEP = bytes.maketrans(b"[]{}", b"\x02\x00\x02\x00")   # open: +1, close: -1 (each minus 1)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")              # where a lone surrogate can come from
_SURROGATE = re.compile("[\ud800-\udfff]")
_NAME = re.compile(r"[A-Za-z_]\w*")


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``body``, counting ``[`` and ``{``
    outside strings (for a body that is not valid JSON, a bound of what a parser would recurse
    into). Linear in the body, no recursion: C loops only (a 4 MB body of ``[],`` takes 0.3 s)."""
    steps = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS).translate(_BRACKET_STEP)
    return max(map(sub, accumulate(steps), count(1)), default=0)


def _not_unicode(obj, path: str, ended: bool = False) -> Status | None:
    """INVALID_ARGUMENT naming the first string or object key in ``obj`` (parsed JSON, at most
    MAX_JSON_DEPTH deep) holding a lone surrogate; None when every one is Unicode text.
    ``ended``: the path stopped at an object above (a key that is not a name): nothing below it
    extends it."""
    if isinstance(obj, str):
        if _SURROGATE.search(obj):
            return invalid(f"{path or 'request body'}: not valid Unicode text (an unpaired surrogate such as "
                           "\\ud800 cannot be UTF-8)", param=path or None)
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if _SURROGATE.search(k):
                return invalid(f"{path or 'request body'}: an object key is not valid Unicode text (an unpaired "
                               "surrogate such as \\ud800 cannot be UTF-8)", param=path or None)
            # a key that is not a name ends the path at its object (the param must stay a path)
            stop = ended or not _NAME.fullmatch(k)
            if (bad := _not_unicode(v, path if stop else (f"{path}.{k}" if path else k), stop)) is not None:
                return bad
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if (bad := _not_unicode(v, f"{path}[{i}]" if path and not ended else path, ended)) is not None:
                return bad
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(body: bytes):
    """A request body → its JSON value. Raises Status INVALID_ARGUMENT (module docstring): bytes
    that are not UTF-8, nesting deeper than MAX_JSON_DEPTH (before parsing), text that is not
    JSON (``NaN``, ``Infinity``, an integer of more digits than Python converts), a lone
    surrogate in a string or key (naming its field)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"request body is not valid UTF-8 (byte {e.start})") from None
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and (depth := json_depth(body)) > MAX_JSON_DEPTH:
        raise invalid(f"request body nests arrays and objects {depth} deep; at most {MAX_JSON_DEPTH} are allowed")
    try:
        parsed = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise invalid(f"request body is not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:       # NaN, Infinity; an integer of over 4300 digits
        raise invalid(f"request body is not valid JSON: {str(e).partition(': value has')[0]}") from None
    if _SURROGATE_ESCAPE.search(text) and (bad := _not_unicode(parsed, "")) is not None:
        raise bad
    return parsed


@dataclass
class Options:
    """What the HTTP response needs besides the proto request: ``model`` (the name to answer
    with), ``stream``, ``include_usage`` (a last chunk with usage), ``top_logprobs`` (None: no
    logprobs), ``chat`` (chat completions or completions)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None
    chat: bool = True


def _kind(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{name}: expected a number, got {_kind(v)}")
    try:
        return float(v)
    except OverflowError:               # an integer past the largest float (over 309 digits)
        raise invalid(f"{name}: {len(str(abs(v)))}-digit integer is out of range for a number") from None


def _int(body: dict, name: str, lo: int = 0, hi: int = _UINT64) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{name}: expected an integer, got {_kind(v)}")
    if not lo <= v <= hi:
        raise invalid(f"{name}: must be in [{lo}, {hi}], got {v}")
    return v


def _bool(body: dict, name: str, path: str = "") -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise invalid(f"{path}{name}: expected a boolean, got {_kind(v)}")
    return v


def _str(body: dict, name: str) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise invalid(f"{name}: expected a string, got {_kind(v)}")
    return v


def _token_ids(v, name: str) -> list[int] | None:
    """``v`` as a list of token ids, None if it is not a list of integers."""
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if any(not 0 <= t <= _UINT32 for t in v):
            raise invalid(f"{name}: token ids must be in [0, {_UINT32}]")
        return v
    return None


def _common(body: dict, chat: bool) -> tuple[common_pb2.SamplingParams, Options]:
    """The sampling parameters and options both endpoints share."""
    if not isinstance(body, dict):
        raise invalid(f"request body: expected a JSON object, got {_kind(body)}")
    for name in _UNSUPPORTED:
        v = body.get(name)
        if v not in (None, [], {}) and v not in _HARMLESS.get(name, ()):
            raise invalid(f"{name}: not supported by kvmesh")
    n = _int(body, "n", lo=1)
    if n not in (None, 1):
        raise invalid(f"n: only n=1 is supported, got {n}")
    sp = common_pb2.SamplingParams()
    for name in _FLOATS:
        if (v := _number(body, name)) is not None:
            setattr(sp, name, v)
    if (v := _int(body, "top_k", lo=-1, hi=2**31 - 1)) is not None:
        sp.top_k = v
    if (v := _int(body, "seed", lo=0)) is not None:
        sp.seed = v
    for name in ("max_tokens", "max_completion_tokens"):     # the latter wins
        if (v := _int(body, name)) is not None:
            sp.max_tokens = min(v, _UINT32)
    if (v := _int(body, "min_tokens", hi=_UINT32)) is not None:
        sp.min_tokens = v
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid("stop: expected a string or an array of strings")
        sp.stop.extend(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if ids != [] and _token_ids(ids, "stop_token_ids") is None:
            raise invalid("stop_token_ids: expected an array of token ids")
        sp.stop_token_ids.extend(ids)
    for name in ("ignore_eos", "skip_special_tokens"):
        if (v := _bool(body, name)) is not None:
            setattr(sp, name, v)
    stream = bool(_bool(body, "stream"))
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise invalid("stream_options: only allowed when stream is true")
        if not isinstance(so, dict):
            raise invalid(f"stream_options: expected an object, got {_kind(so)}")
        include_usage = bool(_bool(so, "include_usage", "stream_options."))
    if chat:
        top = _int(body, "top_logprobs", hi=20)
        if _bool(body, "logprobs"):
            sp.logprobs = top or 0
        elif top is not None:
            raise invalid("top_logprobs: requires logprobs to be true")
        top = sp.logprobs if sp.HasField("logprobs") else None
    else:
        top = _int(body, "logprobs", hi=20)
        if top is not None:
            sp.logprobs = top
    return sp, Options(model=_str(body, "model"), stream=stream, include_usage=include_usage,
                       top_logprobs=top, chat=chat)


def _ids(body: dict, req) -> None:
    req.model, req.request_id, req.session_id = (_str(body, n) for n in ("model", "request_id", "session_id"))


def chat_request(body) -> tuple[llm_pb2.ChatRequest, Options]:
    """A chat completions request body (parsed JSON) → (ChatRequest, Options). Raises Status."""
    sp, opts = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: expected a non-empty array of messages")
    req = llm_pb2.ChatRequest(sampling=sp)
    _ids(body, req)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]: expected an object, got {_kind(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise invalid(f"messages[{i}].role: expected a string, got {_kind(role)}")
        if isinstance(content, list):       # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise invalid(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                              "are supported")
            content = "".join(p["text"] for p in content)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content: expected a string or an array of text parts, got {_kind(content)}")
        req.messages.add(role="system" if role == "developer" else role, content=content)
    return req, opts


def completion_request(body) -> tuple[llm_pb2.GenerateRequest, Options]:
    """A completions request body (parsed JSON) → (GenerateRequest, Options). Raises Status."""
    sp, opts = _common(body, chat=False)
    if body.get("echo"):
        raise invalid("echo: not supported by kvmesh")
    if _int(body, "best_of", lo=1) not in (None, 1):
        raise invalid("best_of: only best_of=1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]              # a batch of one
    req = llm_pb2.GenerateRequest(sampling=sp)
    _ids(body, req)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif (ids := _token_ids(prompt, "prompt")) is not None:
        req.prompt_token_ids.ids.extend(ids)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid(f"prompt: a batch of {len(prompt)} prompts is not supported; send one prompt per request")
    else:
        raise invalid("prompt: expected a string, an array of token ids, or an array holding one of them")
    return req, opts


# ---- responses ----------------------------------------------------------------------------------

def usage_json(u: common_pb2.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def finish_reason(out: llm_pb2.GenerateResponse) -> str | None:
    name = finish_reason_name(out)
    return name if out.finished and name != "unspecified" else None


class Responder:
    """Builds the JSON of one request's response from its ``GenerateResponse`` messages.
    ``rid``: the request id; ``tokenizer`` turns token ids into the logprobs' token strings."""

    def __init__(self, opts: Options, rid: str, tokenizer):
        self.opts, self.tokenizer = opts, tokenizer
        self.id = ("chatcmpl-" if opts.chat else "cmpl-") + rid
        self.created = int(time.time())
        self._sent_role = False
        self._offset = 0                    # completions logprobs: text offset of the next token

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.opts.model}

    def _logprobs(self, out: llm_pb2.GenerateResponse):
        """The choice's logprobs for the message's tokens (OpenAI's chat or completions shape)."""
        n, tok = self.opts.top_logprobs, self.tokenizer
        if n is None:
            return None
        entries = []
        for t, lp in zip(out.token_ids, out.logprobs):
            top = sorted(lp.logprobs.items(), key=lambda kv: -kv[1])[:n]
            entries.append((tok.decode([t]), lp.logprobs.get(t), [(tok.decode([i]), v) for i, v in top]))
        if self.opts.chat:
            return {"content": [{"token": s, "logprob": v, "bytes": list(s.encode()),
                                 "top_logprobs": [{"token": ts, "logprob": tv, "bytes": list(ts.encode())}
                                                  for ts, tv in top]} for s, v, top in entries]}
        offsets = []
        for s, _, _ in entries:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": [s for s, _, _ in entries], "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}

    def chunk(self, out: llm_pb2.GenerateResponse) -> dict | None:
        """The stream chunk of one message; None when it carries nothing to send."""
        reason = finish_reason(out)
        logprobs = self._logprobs(out)
        if not (out.text or reason or logprobs or (self.opts.chat and not self._sent_role)):
            return None
        if self.opts.chat:
            delta = {"content": out.text} if out.text or not self._sent_role else {}
            if not self._sent_role:
                delta["role"], self._sent_role = "assistant", True
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": reason}
        if out.finished:
            choice["stop_reason"] = out.stop_reason or None
        c = self._head("chat.completion.chunk" if self.opts.chat else "text_completion")
        c["choices"] = [choice]
        if self.opts.include_usage:
            c["usage"] = None
        return c

    def usage_chunk(self, out: llm_pb2.GenerateResponse) -> dict:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        c = self._head("chat.completion.chunk" if self.opts.chat else "text_completion")
        c.update(choices=[], usage=usage_json(out.usage))
        return c

    def body(self, messages: list[llm_pb2.GenerateResponse]) -> dict:
        """The whole (non-streaming) response of a finished request's messages."""
        final = messages[-1]
        text = "".join(m.text for m in messages)
        lps = [self._logprobs(m) for m in messages] if self.opts.top_logprobs is not None else None
        if self.opts.chat:
            logprobs = {"content": [e for lp in lps for e in lp["content"]]} if lps else None
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}
        else:
            logprobs = ({k: [e for lp in lps for e in lp[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                       "text_offset")} if lps else None)
            choice = {"index": 0, "text": text, "logprobs": logprobs}
        choice.update(finish_reason=finish_reason(final), stop_reason=final.stop_reason or None)
        b = self._head("chat.completion" if self.opts.chat else "text_completion")
        b.update(choices=[choice], usage=usage_json(final.usage))
        return b
