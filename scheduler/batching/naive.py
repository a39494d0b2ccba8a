"""The naive loop: one request at a time and no KV reuse: every step recomputes the whole
sequence (prompt + output so far) and samples one token. The baseline of ``bench ablation``;
the prefix cache is never consulted."""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


class NaiveBatching(Scheduler):
    """Args: as :class:`Scheduler`'s; ``max_num_seqs`` is 1 whatever is asked, and there is no
    token budget (a step is one whole sequence)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 1, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 2048):
        super().__init__(block_manager, max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len)

    def schedule(self, busy: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.running:
            req = self.running[0]
            req.num_computed_tokens = 0          # no KV reuse: recompute everything
            if not self.bm.allocate(req, req.num_tokens):
                self._preempt(req, out)          # (add() checked that the pool holds it whole)
                return out
        elif self.waiting and self.bm.allocate(self.waiting[0], self.waiting[0].num_tokens):
            req = self.waiting.popleft()
            self._start(req)
        else:
            return out
        out.seqs.append(ScheduledSeq(req, 0, req.num_tokens, True))
        out.num_batched_tokens = req.num_tokens
        return out
