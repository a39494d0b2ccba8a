"""The channel between an engine core process and its client (:mod:`scheduler.engine_core`): the
message kinds, and msgpack frames of plain lists (engine outputs, sampling parameters and KV
events as rows of their fields).
"""

from __future__ import annotations

import dataclasses

import msgpack

from kvmesh.core.sampling import SamplingParams
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler.engine_records import EngineOutput
from scheduler.request import FinishReason

# message kinds, to the core and from it
ADD, ABORT, FINISH, SHUTDOWN = range(4)
READY, STEP, FATAL = range(3)

_OUTPUT_FIELDS = [f.name for f in dataclasses.fields(EngineOutput)]
_REASON_AT = _OUTPUT_FIELDS.index("finish_reason")
PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]   # an ADD's parameters: {field: value}


def pack(msg) -> bytes:
    """One frame: ``msg`` (lists, dicts, numbers, strings, bytes) as msgpack bytes."""
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes):
    """The message of a frame from :func:`pack` (arrays as lists, maps with any keys). Raises
    msgpack's exceptions (ValueError subclasses) on a bad frame."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def output_row(o: EngineOutput) -> list:
    """``o``'s fields in declaration order, its finish reason as its string value."""
    row = [getattr(o, f) for f in _OUTPUT_FIELDS]
    if o.finish_reason is not None:
        row[_REASON_AT] = o.finish_reason.value
    return row


def output_of(row: list) -> EngineOutput:
    """The EngineOutput of an :func:`output_row` row (the row is changed in place)."""
    if row[_REASON_AT] is not None:
        row[_REASON_AT] = FinishReason(row[_REASON_AT])
    return EngineOutput(*row)


def event_row(e) -> list:
    """A KV event (:mod:`kvstore.events`) as a row: ``[0, hashes, parent, block size, medium,
    ttl]`` (BlockStored), ``[1, hashes, medium]`` (BlockRemoved), ``[2, medium]`` (AllBlocksCleared)."""
    if isinstance(e, BlockStored):
        return [0, list(e.block_hashes), e.parent_hash, e.block_size, e.medium, e.ttl]
    if isinstance(e, BlockRemoved):
        return [1, list(e.block_hashes), e.medium]
    return [2, e.medium]


def event_of(row: list):
    """The KV event of an :func:`event_row` row."""
    if row[0] == 0:
        return BlockStored(tuple(row[1]), row[2], row[3], row[4], row[5])
    if row[0] == 1:
        return BlockRemoved(tuple(row[1]), row[2])
    return AllBlocksCleared(row[1])
