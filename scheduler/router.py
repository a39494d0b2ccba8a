"""Replica selection: which replica of the scheduler serves a new request.

For now the least-loaded healthy replica, load being the tokens it still has to process:
tokens waiting to be prefilled plus the tokens of its running sequences. A prefix-cache
term (a Redis prefix index keyed by ``session_id`` and block hashes) comes next.
"""

from __future__ import annotations

from dataclasses import dataclass


class NoHealthyReplicaError(RuntimeError):
    """Every replica is down (its engine loop died) or still loading."""


@dataclass
class ReplicaLoad:
    """What the router knows about one replica. Token counts are tokens."""

    index: int
    healthy: bool
    waiting_tokens: int = 0     # prompt (or recompute) tokens still to prefill in the waiting queue
    running_tokens: int = 0     # prompt + output tokens of the running sequences

    @property
    def load(self) -> int:
        return self.waiting_tokens + self.running_tokens


class Router:
    """Picks the healthy replica with the least load; ties go to the lowest index."""

    def pick(self, loads: list[ReplicaLoad], session_id: str = "") -> int:
        """Index of the replica for a new request.

        Args:
            loads: one entry per replica.
            session_id: the caller's session (unused until the prefix index exists).
        Raises:
            NoHealthyReplicaError: no replica is healthy.
        """
        healthy = [r for r in loads if r.healthy]
        if not healthy:
            raise NoHealthyReplicaError(f"no healthy replica (0 of {len(loads)} up): "
                                        "check the scheduler log for the engine error and restart it")
        return min(healthy, key=lambda r: (r.load, r.index)).index
