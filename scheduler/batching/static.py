"""Static batching: a batch of up to ``max_num_seqs`` requests is admitted only when the
previous batch is completely done, with KV reserved for prompt + max_tokens; whole prompts are
prefilled in one step, and requests that finish early keep occupying (and computing) their row
until the longest one ends, as in padded static batching (the rows are ragged, not padded to
the longest prompt)."""

from __future__ import annotations

from scheduler.request import FinishReason, Request
from scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


class StaticBatching(Scheduler):
    """Args: as :class:`Scheduler`'s (``max_num_batched_tokens`` is not used: whole prompts)."""

    def schedule(self, busy: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        out = SchedulerOutput()
        self._release_batch_if_done()
        if not self.running:
            while self.waiting and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if not self.bm.allocate(req, req.num_prompt_tokens + req.sampling_params.max_tokens):
                    break
                self.waiting.popleft()
                self._start(req)
        for req in self.running:
            if req.is_finished:                  # padding row: recompute its last position
                if req.num_computed_tokens > 0:  # (none if aborted during its first step)
                    out.seqs.append(ScheduledSeq(req, req.num_computed_tokens - 1, 1, True, padding=True))
            else:
                n = req.num_tokens - req.num_computed_tokens
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n, True))
        out.num_batched_tokens = sum(s.num_scheduled_tokens for s in out.seqs)
        return out

    def finish(self, req: Request, reason: FinishReason, stop_reason=None) -> None:
        """End a request; a running one keeps its row (and blocks) until the batch is done."""
        if req.is_finished or req not in self.running:
            super().finish(req, reason, stop_reason)
            return
        self._mark_finished(req, reason, stop_reason)
        self._release_batch_if_done()

    def _release_batch_if_done(self) -> None:
        if self.running and all(r.is_finished for r in self.running):
            for r in self.running:               # the batch is done: release its rows
                self.bm.free(r)
            self.running = []
