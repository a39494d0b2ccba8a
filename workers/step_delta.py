"""Incremental step messages from :class:`workers.executor.RayPipelineExecutor` to its stages.

A full :class:`workers.model_runner.StepInput` repeats, every step and for every sequence, its
request id, the whole block-table prefix, its sampling parameters, EOS ids, its prompt and (for
penalties) its output history. Across a process boundary that is most of the step's
message: 8 decoding requests at 1.6k tokens of context pickle to ~7 KB without penalties and
~70 KB with them (docs/mesh.md, "Step messages"). Here each stage keeps what does not change:

- :class:`StepEncoder` (the executor's side) gives each request a small int *handle* when
  it is first scheduled and sends its prompt-side data once (:data:`NewRequest`); afterwards a
  step carries per sequence only its handle, start position, the tokens scheduled, whether it
  samples, the change to its block table since the last step the stages saw of it, and the
  speculative fields when they are set (:data:`SeqDelta`).
- :class:`StepDecoder` (each stage's side) applies the changes to its per-request state and
  hands the runner the same :class:`~workers.model_runner.SeqInput` objects a full StepInput
  would have held. The last stage appends the tokens it sampled (accepted proposals included)
  to its per-request output history, which is what penalties and ``min_tokens`` read; the
  scheduler appends the same tokens to ``Request.output_token_ids`` (it drops tokens after a
  stop only when the request finishes).

Block tables are diffed exactly against the copy last sent (``keep`` leading ids stay, the rest
are replaced), so every way a table changes is covered by one rule: a decode or prefill chunk
that gained blocks appends them; speculative decoding's rollback (rejected proposals and
lookahead blocks trimmed, possibly re-allocated as other ids) truncates and appends;
preemption by recompute (blocks freed, the request re-admitted later with a new table from
position 0 or from its prefix-cache hits) rewrites the table from the first id that differs,
and the request keeps its handle, sampling state and output history (its outputs so far do
not change). A finished request that is still scheduled (static batching's padding rows,
after the engine freed it) is sent as new and forgotten after the step (``StepDelta.done``).

Frees of finished and aborted requests travel as a separate ``free_requests`` call per stage
with their handles: every call to a stage comes from the one executor (one Ray submitter) and a
synchronous single-threaded actor without task retries runs calls from one submitter in
submission order, so a free always lands between the steps the executor put it between. The
executor serializes :meth:`StepEncoder.encode` / :meth:`StepEncoder.free` with their Ray
calls under one lock (a freed handle is reused by a later request).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from workers.model_runner import SeqInput, StepInput

if TYPE_CHECKING:     # the scheduler's step type, only named in annotations (workers sit below the scheduler)
    from scheduler.scheduler import SchedulerOutput

# A request new to the stages: (handle, request_id, sampling params, eos_token_ids,
# num_output_tokens, prompt_token_ids, output_token_ids or None, traceparent or None).
# The prompt goes once per request, always (the repetition penalty reads it, and a draft model
# catches up from it on a prefix-cache hit over blocks it never wrote); the output history only
# when a penalty needs it (repetition, presence, frequency), non-empty only for a request that
# already generated tokens (static batching's padding rows).
NewRequest = tuple

# One scheduled sequence: (handle, start, token_ids, sample, blocks[, spec_token_ids,
# num_proposals]). ``blocks`` is () when the block table is unchanged, else (keep, *ids): the
# table becomes its first ``keep`` ids followed by ``ids``. The speculative fields are present
# only when one of them is set.
SeqDelta = tuple


class StepDelta(NamedTuple):
    """One step's message to every stage (a NamedTuple: it pickles without field names).

    Attributes:
        new: :data:`NewRequest` records, applied before ``seqs``.
        seqs: :data:`SeqDelta` records, one per scheduled sequence (the scheduler's order).
        done: handles to forget after this step (requests the engine freed while they are
            still scheduled).
    """

    new: list
    seqs: list
    done: list


def _needs_output(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


class StepEncoder:
    """The executor's record of what its stages hold: a handle and the last block table sent
    per request. Not thread-safe (the executor holds a lock around it and its Ray calls).

    Args:
        block_size: tokens per KV block (the block table a sequence needs covers its slots).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._sent: dict[str, list] = {}        # request id -> [handle, block ids the stages hold]
        self._free_handles: list[int] = []
        self._next_handle = 0

    def __len__(self) -> int:
        return len(self._sent)

    def _handle(self) -> int:
        if self._free_handles:
            return self._free_handles.pop()
        self._next_handle += 1
        return self._next_handle - 1

    def encode(self, out: SchedulerOutput) -> StepDelta:
        """The message of one step (the scheduler output ``out``), and the encoder's state
        updated as if every stage applied it."""
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
                sp = req.sampling_params
                new.append((h, req.request_id, sp, req.eos_token_ids, req.num_output_tokens,
                            req.prompt_token_ids,
                            list(req.output_token_ids) if _needs_output(sp) else None, req.traceparent))
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
            rec = (h, s.start, req.tokens(s.start, end), s.sample, blocks)
            if s.spec_token_ids or s.num_proposals:
                rec += (list(s.spec_token_ids), s.num_proposals)
            seqs.append(rec)
            if req.is_finished:                  # freed by the engine already: forget it after the step
                del self._sent[req.request_id]
                done.append(h)
        self._free_handles += done
        return StepDelta(new, seqs, done)

    def free(self, request_ids: list[str]) -> list[int]:
        """Forget ``request_ids`` (finished, aborted); returns the handles the stages must free
        (requests never sent are skipped)."""
        handles = [sent[0] for rid in request_ids if (sent := self._sent.pop(rid, None)) is not None]
        self._free_handles += handles
        return handles


class _State:
    """A stage's state of one request (see :class:`StepDecoder`)."""

    __slots__ = ("request_id", "params", "eos_token_ids", "num_output_tokens", "prompt_token_ids",
                 "output_token_ids", "traceparent", "blocks")

    def __init__(self, request_id, params, eos_token_ids, num_output_tokens, prompt_token_ids, output_token_ids,
                 traceparent):
        self.request_id = request_id
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.num_output_tokens = num_output_tokens
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        self.traceparent = traceparent
        self.blocks: list[int] = []


class StepDecoder:
    """A stage's per-request state, rebuilt into full :class:`SeqInput` objects each step.

    Per request: its id, sampling params, EOS ids, output count, prompt, output history (when a
    penalty needs it), traceparent, and the block ids of its current table. The
    histories are current on the last stage only (:meth:`record`).

    Raises:
        EngineError: a message refers to a handle this stage does not hold, or keeps more
            blocks than it holds (the executor and the stage disagree: a bug).
    """

    def __init__(self, stage: int = 0):
        self.stage = stage
        self.states: dict[int, _State] = {}
        self._sampling: list[_State] = []

    def apply(self, delta: StepDelta) -> StepInput:
        """Apply ``delta``; returns the step's sequences as the runner takes them."""
        states = self.states
        for h, rid, params, eos, n_out, prompt, output, tp in delta.new:
            states[h] = _State(rid, params, eos, n_out, prompt, output, tp)
        seqs, sampling = [], []
        for rec in delta.seqs:
            h, start, toks, sample, blocks = rec[:5]
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
                           prompt_token_ids=st.prompt_token_ids)
            if len(rec) > 5:
                seq.spec_token_ids, seq.num_proposals = rec[5], rec[6]
            if sample:
                sp = seq.params = st.params
                seq.num_output_tokens, seq.eos_token_ids = st.num_output_tokens, st.eos_token_ids
                if st.output_token_ids is not None:
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
                if st.output_token_ids is not None:
                    st.output_token_ids += toks
        self._sampling = []

    def free(self, handles: list[int]) -> list[str]:
        """Forget ``handles``; returns their request ids (unknown handles are skipped)."""
        return [st.request_id for h in handles if (st := self.states.pop(h, None)) is not None]
