"""Conversions between the protos (``kvmesh.v1``) and the engine's types, in one place: sampling
parameters both ways, finish reasons, and the usage and timings of an engine output.

Used by the gateway (:mod:`gateway.stream`), the scheduler service (:mod:`scheduler.service`) and
the client (:mod:`kvmesh.client`). An engine output is read by its attributes (those of
:class:`scheduler.engine_records.EngineOutput`), so this module imports nothing above the bottom layer.
"""

from __future__ import annotations

import time
from dataclasses import fields

from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2

# SamplingParams fields that are ``optional`` in the proto: unset = the engine's default
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "max_tokens", "logprobs", "skip_special_tokens")
_FIELDS = tuple(f.name for f in fields(SamplingParams))
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}


def sampling_params_from_proto(msg: common_pb2.SamplingParams, *, default_max_tokens: int = 16) -> SamplingParams:
    """Engine sampling parameters from the proto message. Unset optional fields take the
    engine's defaults; unset ``max_tokens`` takes ``default_max_tokens`` (tokens).
    Raises InvalidRequestError naming the first bad field."""
    kw = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    kw.setdefault("max_tokens", default_max_tokens)
    return SamplingParams(min_tokens=msg.min_tokens, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, **kw)


def sampling_params_to_proto(params: SamplingParams | None = None, **kw) -> common_pb2.SamplingParams:
    """The proto message of ``params`` (every field set; ``seed``/``logprobs`` None left unset),
    or, without ``params``, of the keywords given (the fields of ``kvmesh.v1.SamplingParams``;
    None values are left unset: the server's default). No validation: the server validates.
    Raises ValueError (protobuf's) for a keyword that is not a field."""
    if params is not None:
        if kw:
            raise TypeError("give SamplingParams or keywords, not both")
        kw = {name: getattr(params, name) for name in _FIELDS}
    return common_pb2.SamplingParams(**{k: v for k, v in kw.items() if v is not None})


def finish_reason_to_proto(reason) -> int:
    """``kvmesh.v1.FinishReason`` of an engine finish reason (a :class:`scheduler.request.FinishReason`
    or its value ``"stop"``/``"length"``/``"abort"``); UNSPECIFIED for None or another."""
    return _FINISH.get(getattr(reason, "value", reason), common_pb2.FINISH_REASON_UNSPECIFIED)


def finish_reason_name(response_or_reason) -> str:
    """``stop``, ``length``, ``abort`` (or ``unspecified``) of a message with a ``finish_reason``
    field (``GenerateResponse``, ``SubmitResponse``) or of a ``kvmesh.v1.FinishReason`` value."""
    reason = getattr(response_or_reason, "finish_reason", response_or_reason)
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def usage_to_proto(o, *, final: bool = True) -> common_pb2.Usage:
    """The usage of an engine output ``o`` (:class:`scheduler.engine_records.EngineOutput`): with
    ``final``, prompt, completion and cached prompt tokens and the speculative counts; else only
    what is known mid-stream (cached prompt tokens, speculative counts so far)."""
    usage = common_pb2.Usage(cached_prompt_tokens=o.num_cached_tokens, spec_num_drafts=o.num_drafts,
                             spec_num_draft_tokens=o.num_draft_tokens,
                             spec_num_accepted_tokens=o.num_accepted_tokens)
    if final:
        usage.prompt_tokens, usage.completion_tokens = o.num_prompt_tokens, o.num_output_tokens
    return usage


def timings_to_proto(o) -> common_pb2.Timings:
    """The timings of a finished engine output ``o`` in seconds, from its monotonic timestamps:
    queue (arrival → first scheduled), ttft (arrival → first token), decode (first token → end),
    e2e (arrival → end); 0 where an event never happened (the ttft of a request aborted before
    its first token)."""
    end = o.finished_time or time.monotonic()
    first_tok = o.first_token_time
    return common_pb2.Timings(queue_time=(o.first_scheduled_time or end) - o.arrival_time,
                              ttft=first_tok - o.arrival_time if first_tok else 0.0,
                              decode_time=end - first_tok if first_tok else 0.0,
                              e2e_latency=end - o.arrival_time)
