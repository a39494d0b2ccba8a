"""The step format: what every executor sends its runners each step, and how a runner rebuilds it.

One format for every executor (:class:`workers.executor.InProcessExecutor` in the engine's
process, :class:`workers.executor.RayPipelineExecutor` to each stage actor): the executor's
:class:`StepEncoder` turns the scheduler's step into a :class:`StepDelta`, and the runner's side
:class:`StepDecoder` applies it to its per-request state and hands the model runner
:class:`StepInput` (the scheduled :class:`SeqInput` sequences, each with its whole block table,
which the persistent input batch compares with its stored copy). In-process the delta is handed
over as it is; to a Ray stage it is pickled. The same format serves vLLM v1's split
(``SchedulerOutput`` with new requests once, then cached-request diffs).

What the delta holds: a full ``StepInput`` would repeat, every step and for every sequence, its
request id, the whole block-table prefix, its sampling parameters, EOS ids, prompt and output
history. Across a process boundary that is most of the step's message: 8 decoding requests at
1.6k tokens of context pickle to ~7 KB without penalties and ~70 KB with them (docs/mesh.md,
"Step messages"). So each side keeps what does not change:

- :class:`StepEncoder` (the executor's side) gives each request a small int *handle* when it is
  first scheduled and sends its prompt-side data once (:class:`NewRequest`); afterwards a step
  carries per sequence only its handle, start position, the tokens scheduled, whether it
  samples, the change to its block table since the last step the runners saw of it, and the
  speculative fields when they are set (:class:`SeqDelta`).
- :class:`StepDecoder` (the runner's side) applies the changes to its per-request state and
  hands the runner the :class:`SeqInput` objects. The last stage appends the tokens it sampled
  (accepted proposals included) to its per-request output history, which penalties,
  ``min_tokens`` and prompt lookup read; the scheduler appends the same tokens to
  ``Request.output_token_ids`` (it drops tokens after a stop only when the request finishes).

Block tables are diffed exactly against the copy last sent (``keep`` leading ids stay, the rest
are replaced), so every way a table changes is covered by one rule: a decode or prefill chunk
that gained blocks appends them; speculative decoding's rollback (rejected proposals and
lookahead blocks trimmed, possibly re-allocated as other ids) truncates and appends;
preemption by recompute (blocks freed, the request re-admitted later with a new table from
position 0 or from its prefix-cache hits) rewrites the table from the first id that differs,
and the request keeps its handle, sampling state and output history (its outputs so far do
not change). A finished request that is still scheduled (static batching's padding rows,
after the engine freed it) is sent as new and forgotten after the step (``StepDelta.done``).

Across processes, frees of finished and aborted requests travel as a separate ``free_requests`` call per stage
with their handles: every call to a stage comes from the one executor (one Ray submitter) and a
synchronous single-threaded actor without task retries runs calls from one submitter in
submission order, so a free always lands between the steps the executor put it between. The
executor serializes :meth:`StepEncoder.encode` / :meth:`StepEncoder.free` with their Ray
calls under one lock (a freed handle is reused by a later request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Sequence

from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams


# ---- what the encoder reads of the scheduler's step ------------------------------------------
# (structural types: the workers sit below the scheduler, so they name what they read, and
# scheduler.scheduler.SchedulerOutput has it)

class ScheduledRequest(Protocol):
    request_id: str
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    traceparent: str | None
    block_table: list[int]

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


class ScheduledSeq(Protocol):
    req: ScheduledRequest
    start: int
    num_new_tokens: int
    sample: bool
    spec_token_ids: list[int]
    num_proposals: int


class ScheduledStep(Protocol):
    """One step as the scheduler decided it (``scheduler.scheduler.SchedulerOutput``)."""

    seqs: Sequence[ScheduledSeq]


# ---- what the model runner takes ------------------------------------------------------------

@dataclass
class SeqInput:
    """One sequence of a step, as the runner sees it (no scheduler state), rebuilt by
    :class:`StepDecoder`. Token ids are Python ints; positions count from 0.

    ``token_ids`` are the tokens at positions ``[start, start + len(token_ids))``;
    ``block_table`` lists the KV blocks covering positions ``[0, start + len(token_ids))``.
    The sampling fields (``params``, ``num_output_tokens``, ``eos_token_ids``,
    ``output_token_ids``) are set only when ``sample`` (the chunk ends at the last token).
    ``prompt_token_ids`` and ``output_token_ids`` are the decoder's per-request lists (the
    repetition penalty reads the prompt; penalties, ``min_tokens`` and prompt lookup the
    output; a draft model catches up from the prompt on a prefix-cache hit over blocks it never
    wrote); the output history is current on the last stage only.
    ``traceparent``: the W3C trace context of the scheduler's span of a traced request (None
    when tracing is off); the workers' spans of the request are its children.
    ``spec_token_ids``: proposals to verify, at positions ``[start + len(token_ids), ...)``
    (the block table covers them). ``num_proposals``: proposals the runner makes for the
    sequence's next step (with a draft model the block table then also covers
    ``1 + num_proposals`` lookahead slots).
    """

    request_id: str
    start: int
    token_ids: list[int]
    block_table: list[int]
    sample: bool
    params: SamplingParams | None = None
    num_output_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    traceparent: str | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    num_proposals: int = 0


@dataclass
class StepInput:
    """What one model step computes: the scheduled sequences (the scheduler's order)."""

    seqs: list[SeqInput]


# ---- the message ------------------------------------------------------------------------------

class NewRequest(NamedTuple):
    """A request new to the runners, sent once: what does not change from step to step.
    ``output_token_ids`` is non-empty only for a request that already generated tokens (static
    batching's padding rows, sent anew after their free)."""

    handle: int
    request_id: str
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    num_output_tokens: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    traceparent: str | None


class SeqDelta(NamedTuple):
    """One scheduled sequence. ``blocks`` is ``()`` when the block table is unchanged, else
    ``(keep, *ids)``: the table becomes its first ``keep`` ids followed by ``ids``."""

    handle: int
    start: int
    token_ids: list[int]
    sample: bool
    blocks: tuple
    spec_token_ids: tuple[int, ...] | list[int] = ()
    num_proposals: int = 0


class StepDelta(NamedTuple):
    """One step's message to every runner.

    Attributes:
        new: :class:`NewRequest` records, applied before ``seqs``.
        seqs: :class:`SeqDelta` records, one per scheduled sequence (the scheduler's order).
        done: handles to forget after this step (requests the engine freed while they are
            still scheduled).
    """

    new: list[NewRequest]
    seqs: list[SeqDelta]
    done: list[int]


class StepEncoder:
    """The executor's record of what its runners hold: a handle and the last block table sent
    per request. Not thread-safe (an executor holds a lock around it and its calls).

    Args:
        block_size: tokens per KV block (the block table a sequence needs covers its slots).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._sent: dict[str, list] = {}        # request id -> [handle, block ids the runners hold]
        self._free_handles: list[int] = []
        self._next_handle = 0

    def __len__(self) -> int:
        return len(self._sent)

    def _handle(self) -> int:
        if self._free_handles:
            return self._free_handles.pop()
        self._next_handle += 1
        return self._next_handle - 1

    def encode(self, out: ScheduledStep) -> StepDelta:
        """The message of one step (the scheduler output ``out``), and the encoder's state
        updated as if every runner applied it."""
        bs = self.block_size
        new, seqs, done = [], [], []
        for s in out.seqs:
            req, end = s.req, s.start + s.num_new_tokens
            slots = end + len(s.spec_token_ids) + (1 + s.num_proposals if s.num_proposals else 0)
            table = req.block_table[: -(-slots // bs)]
            sent = self._sent.get(req.request_id)
            if sent is None:
                h = self._handle()
                self._sent[req.request_id] = [h, table]
                new.append(NewRequest(h, req.request_id, req.sampling_params, req.eos_token_ids,
                                      req.num_output_tokens, req.prompt_token_ids, list(req.output_token_ids),
                                      req.traceparent))
                blocks = (0, *table)
            else:
                h, old = sent
                n = len(old)
                if len(table) >= n and table[:n] == old:
                    blocks = (n, *table[n:]) if len(table) > n else ()
                else:                            # shrunk or rewritten: keep the common prefix
                    keep = 0
                    for a, b in zip(table, old):
                        if a != b:
                            break
                        keep += 1
                    blocks = (keep, *table[keep:])
                sent[1] = table
            if s.spec_token_ids or s.num_proposals:
                seqs.append(SeqDelta(h, s.start, req.tokens(s.start, end), s.sample, blocks,
                                     list(s.spec_token_ids), s.num_proposals))
            else:
                seqs.append(SeqDelta(h, s.start, req.tokens(s.start, end), s.sample, blocks))
            if req.is_finished:                  # freed by the engine already: forget it after the step
                del self._sent[req.request_id]
                done.append(h)
        self._free_handles += done
        return StepDelta(new, seqs, done)

    def free(self, request_ids: list[str]) -> list[int]:
        """Forget ``request_ids`` (finished, aborted); returns the handles the runners must free
        (requests never sent are skipped)."""
        handles = [sent[0] for rid in request_ids if (sent := self._sent.pop(rid, None)) is not None]
        self._free_handles += handles
        return handles


class _State:
    """A runner's state of one request (see :class:`StepDecoder`)."""

    __slots__ = ("request_id", "params", "eos_token_ids", "num_output_tokens", "prompt_token_ids",
                 "output_token_ids", "traceparent", "blocks")

    def __init__(self, new: NewRequest):
        self.request_id = new.request_id
        self.params = new.params
        self.eos_token_ids = new.eos_token_ids
        self.num_output_tokens = new.num_output_tokens
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids = new.output_token_ids
        self.traceparent = new.traceparent
        self.blocks: list[int] = []


class StepDecoder:
    """A runner's per-request state, rebuilt into full :class:`SeqInput` objects each step.

    Per request: its id, sampling params, EOS ids, output count, prompt and output history,
    traceparent, and the block ids of its current table. The output history is current on the
    last stage only (:meth:`record`).

    Args:
        stage: the pipeline stage this decoder feeds (named in errors).
    Raises:
        EngineError: a message refers to a handle this runner does not hold, or keeps more
            blocks than it holds (the executor and the runner disagree: a bug).
    """

    def __init__(self, stage: int = 0):
        self.stage = stage
        self.states: dict[int, _State] = {}
        self._sampling: list[_State] = []

    def apply(self, delta: StepDelta) -> StepInput:
        """Apply ``delta``; returns the step's sequences as the runner takes them."""
        states = self.states
        for new in delta.new:
            states[new.handle] = _State(new)
        seqs, sampling = [], []
        for h, start, toks, sample, blocks, spec, num_proposals in delta.seqs:
            st = states.get(h)
            if st is None:
                raise EngineError(f"stage {self.stage}: step for request handle {h}, which it does not hold")
            if blocks:
                keep = blocks[0]
                if keep > len(st.blocks):
                    raise EngineError(f"stage {self.stage}: request {st.request_id} keeps {keep} blocks of "
                                      f"{len(st.blocks)} held")
                del st.blocks[keep:]
                st.blocks.extend(blocks[1:])
            seq = SeqInput(st.request_id, start, toks, st.blocks, sample, traceparent=st.traceparent,
                           prompt_token_ids=st.prompt_token_ids, spec_token_ids=list(spec),
                           num_proposals=num_proposals)
            if sample:
                seq.params = st.params
                seq.num_output_tokens, seq.eos_token_ids = st.num_output_tokens, st.eos_token_ids
                seq.output_token_ids = st.output_token_ids
                sampling.append(st)
            seqs.append(seq)
        self._sampling = sampling
        return StepInput(seqs)

    def record(self, sampled: dict[str, list[int]]) -> None:
        """The last stage: append each sampling sequence's new tokens (``sampled``, as in
        :class:`~workers.model_runner.ModelRunnerOutput`) of the step just applied to its
        request's output count and history."""
        for st in self._sampling:
            toks = sampled.get(st.request_id)
            if toks:
                st.num_output_tokens += len(toks)
                st.output_token_ids += toks
        self._sampling = []

    def free(self, handles: list[int]) -> list[str]:
        """Forget ``handles``; returns their request ids (unknown handles are skipped)."""
        return [st.request_id for h in handles if (st := self.states.pop(h, None)) is not None]
