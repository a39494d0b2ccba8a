"""Replica selection: which replica of the scheduler serves a new request.

Policies (``SchedulerConfig.routing``):

- ``prefix``: the replica that can reuse the longest prefix of the prompt, weighed against load.
  The prompt's full blocks are hashed exactly as the replicas' block managers hash them
  (:func:`kvstore.hashing.hash_blocks`, same seed and the request's ``cache_salt``), the prefix
  index (:mod:`kvstore.index`, fed by the replicas' KV events) says in which tier each replica
  holds each leading block (``match_tiers``), and each healthy replica gets the score::

      prefix_weight * cached_blocks / prompt_blocks  -  load_weight * load_tokens / pool_tokens

  where ``cached_blocks`` sums, over the prompt's leading blocks, the best weight of a copy
  that replica can load, and ends at the first block it can load from nowhere:

  =================================================  ======================================
  where the block is                                  weight
  =================================================  ======================================
  the replica's own pool (or just routed there)       1.0
  the replica's own host tier (a copy into the pool)  :data:`HOST_TIER_WEIGHT` (0.9)
  the shared Redis tier (any replica loads it)        ``shared_tier_weight``
                                                      (:data:`SHARED_TIER_WEIGHT`, 0.5, when the
                                                      replicas have a Redis tier; else 0)
  another replica's pool or host tier only            0 (not loadable from here)
  =================================================  ======================================

  So a chat may move to a lightly loaded replica and still skip most of its prefill.

  Highest score wins; ties go to the lower load, then to the replica that last served the
  request's ``session_id`` (a tie-breaker only: the hashes decide), then to the lowest index.
  Right after routing, the router records in-process that the replica will hold the prompt's
  blocks (for ``provisional_ttl`` seconds), so a burst sharing a prefix lands together before
  that replica's KV events reach the index. A replica that dies loses its KV cache: the
  service calls :meth:`Router.forget`, which drops its provisional blocks and the sessions it
  last served, so its next incarnation is credited only with what the index learns from it. An index that is down or slow
  (:class:`kvstore.index_contract.IndexUnavailable`) never fails a request: it is routed by load and
  counted in ``fallbacks``.
- ``load``: the least-loaded healthy replica (ties: lowest index).
- ``round_robin``, ``random`` (seeded): baselines for ``bench/routing.py``.

Load is the tokens a replica still has to process: tokens waiting to be prefilled plus the
tokens of its running sequences.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.core.service_config import ROUTING_POLICIES
from kvstore.events import HOST, POOL
from kvstore.hashing import hash_blocks
from kvstore.index_contract import IndexUnavailable

HOST_TIER_WEIGHT = 0.9      # a block in the replica's own host tier, against one in its pool
SHARED_TIER_WEIGHT = 0.5    # a block loadable from the shared KV tier, against one in the replica's pool
MAX_SESSIONS = 100_000      # session affinities kept (least recently routed dropped first)


class NoHealthyReplicaError(RuntimeError):
    """Every replica is down (its engine loop died) or still loading."""


@dataclass
class ReplicaLoad:
    """What the router knows about one replica. Token counts are tokens."""

    index: int
    healthy: bool
    waiting_tokens: int = 0     # prompt (or recompute) tokens still to prefill in the waiting queue
    running_tokens: int = 0     # prompt + output tokens of the running sequences
    pool_tokens: int = 0        # KV pool size (blocks x block size); 0 = unknown

    @property
    def load(self) -> int:
        return self.waiting_tokens + self.running_tokens


@dataclass
class RouterStats:
    """Counters since start. ``prefix_hits``: requests sent to a replica that could reuse
    (held in a tier of its own, was just sent, or could load from the shared tier) at least the
    prompt's first block; ``fallbacks``: requests routed by load because the index was unavailable."""

    routed: int = 0
    prefix_hits: int = 0
    matched_blocks: int = 0     # sum over routed requests of the leading blocks the chosen replica could reuse
    fallbacks: int = 0


class Router:
    """Picks the replica of each new request; one per scheduler service. Not thread-safe:
    call it from one thread (the service's event loop).

    Args:
        policy: one of :data:`ROUTING_POLICIES`.
        index: a :class:`kvstore.index_contract.PrefixIndex` (``prefix`` only).
        replica_ids: the index's name of each replica, by replica index (``prefix`` only).
        hash_seed, block_size: the replicas' block-hash seed and tokens per block (``prefix`` only).
        prefix_weight, load_weight: score weights (see the module docstring).
        shared_tier_weight: weight of a block in the shared (Redis) KV tier, which every
            replica can load (0 = the replicas have no shared tier; see the module docstring).
        host_tier_weight: weight of a block in the replica's own host tier.
        provisional_ttl: seconds a routed prompt counts as held by its replica.
        clock: monotonic seconds (tests pass a fake one).
        seed: seed of the ``random`` policy.
    Raises:
        ValueError: unknown policy, or ``prefix`` without an index, replica ids or block size.
    """

    def __init__(self, policy: str = "load", index=None, *, replica_ids: Sequence[str] = (), hash_seed: int = 0,
                 block_size: int = 0, prefix_weight: float = 1.0, load_weight: float = 1.0,
                 provisional_ttl: float = 2.0, clock: Callable[[], float] = time.monotonic, seed: int = 0,
                 shared_tier_weight: float = 0.0, host_tier_weight: float = HOST_TIER_WEIGHT):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        if policy == "prefix" and (index is None or not replica_ids or block_size < 1):
            raise ValueError("prefix routing needs an index, the replica ids and the block size")
        self.policy, self.index = policy, index
        self._replica_ids = list(replica_ids)
        self.hash_seed, self.block_size = hash_seed, block_size
        self.prefix_weight, self.load_weight = prefix_weight, load_weight
        self.shared_tier_weight = shared_tier_weight
        self.tier_weights = {POOL: 1.0, HOST: host_tier_weight}
        self.provisional_ttl, self.clock = provisional_ttl, clock
        self.stats = RouterStats()
        self._rng = random.Random(seed)
        self._next = 0                                            # round robin
        self._sessions: OrderedDict[str, int] = OrderedDict()     # session id -> replica it last served
        self._provisional: dict[int, dict[int, float]] = {}       # replica -> block hash -> expiry
        self._expiries: deque[tuple[float, int, list[int]]] = deque()

    def block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str = "") -> list[int] | None:
        """The hashes of the prompt's full blocks as the replicas' block managers hash them for a
        request of ``cache_salt`` (:func:`kvstore.hashing.hash_blocks`, the replicas' seed and
        block size), for :meth:`pick` and for the replica's block manager, which reuses them
        (the prompt is hashed once per request); None unless the policy is ``prefix`` (no other
        policy needs them: the block manager then hashes the prompt itself)."""
        if self.policy != "prefix":
            return None
        if len(prompt_token_ids) < self.block_size:
            return []
        return hash_blocks(self.hash_seed, prompt_token_ids, self.block_size, cache_salt=cache_salt)

    def pick(self, loads: list[ReplicaLoad], session_id: str = "", prompt_token_ids: Sequence[int] = (),
             cache_salt: str = "", block_hashes: Sequence[int] | None = None) -> int:
        """Index of the replica for a new request.

        Args:
            loads: one entry per replica.
            session_id: the caller's conversation (tie-breaker of ``prefix``); "" = none.
            prompt_token_ids: the prompt (``prefix`` hashes its full blocks).
            cache_salt: the request's salt: its blocks hash as the replicas' block managers
                hash them for it, so it gets credit only for blocks cached under its salt.
            block_hashes: :meth:`block_hashes` of this prompt and salt, computed already (a
                request sent to the router again); None = hash them here.
        Raises:
            NoHealthyReplicaError: no replica is healthy.
        """
        healthy = [r for r in loads if r.healthy]
        if not healthy:
            raise NoHealthyReplicaError(f"no healthy replica (0 of {len(loads)} up): "
                                        "check the scheduler log for the engine error and restart it")
        matched = 0
        if self.policy == "round_robin":
            ids = sorted(r.index for r in healthy)
            choice = next((i for i in ids if i >= self._next), ids[0])
            self._next = choice + 1
        elif self.policy == "random":
            choice = self._rng.choice(healthy).index
        elif self.policy == "prefix":
            if block_hashes is None:
                block_hashes = self.block_hashes(prompt_token_ids, cache_salt)
            choice, matched = self._pick_prefix(healthy, session_id, block_hashes)
        else:
            choice = min(healthy, key=lambda r: (r.load, r.index)).index
        self.stats.routed += 1
        self.stats.prefix_hits += matched > 0
        self.stats.matched_blocks += matched
        if session_id:
            self._sessions[session_id] = choice
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return choice

    def forget(self, replica: int) -> None:
        """Forget what this router assumed ``replica`` holds: its provisional blocks and the
        sessions it last served (their affinity). Call it when the replica's engine dies (its
        KV cache goes with it) and when a new one takes its place: a restarted replica must get
        no credit for the blocks of the dead one. Its prefix-index entries are its publisher's
        (removed when the replica leaves the index, replaced by the new one's resync)."""
        self._provisional.get(replica, {}).clear()     # (its queued expiries find nothing left)
        for session in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[session]

    # ---- prefix ------------------------------------------------------------------------
    def _pick_prefix(self, healthy: list[ReplicaLoad], session_id: str,
                     hashes: Sequence[int]) -> tuple[int, int]:
        """(replica, leading blocks of the prompt it can reuse) by score, from the hashes of the
        prompt's full blocks; by load when the index fails."""
        hashes = list(hashes)
        now = self.clock()
        self._expire(now)
        reuse: dict[int, tuple[float, int]] = {}      # replica -> (weighted blocks, blocks)
        if hashes:
            try:
                found = self.index.match_tiers(hashes)
            except IndexUnavailable:
                self.stats.fallbacks += 1
                return min(healthy, key=lambda r: (r.load, r.index)).index, 0
            for r in healthy:
                prov = self._provisional.get(r.index, {})
                routed = next((k for k, h in enumerate(hashes) if prov.get(h, 0.0) <= now), len(hashes))
                reuse[r.index] = self._reusable(found.held.get(self._replica_ids[r.index], ()), routed, found.shared)
        max_load = max(max(r.load for r in healthy), 1)
        affine = self._sessions.get(session_id) if session_id else None

        def key(r: ReplicaLoad):
            cached = reuse.get(r.index, (0.0, 0))[0] / len(hashes) if hashes else 0.0
            score = self.prefix_weight * cached - self.load_weight * r.load / (r.pool_tokens or max_load)
            return (-score, r.load, r.index != affine, r.index)

        best = min(healthy, key=key)
        if hashes and self.provisional_ttl > 0:
            self._remember(best.index, hashes, now + self.provisional_ttl)
        return best.index, reuse.get(best.index, (0.0, 0))[1]

    def _reusable(self, media: Sequence[str | None], routed: int, shared: int) -> tuple[float, int]:
        """(weighted blocks, blocks) of the prompt's leading run that a replica can reuse:
        ``media`` its own tier of each leading block (``PrefixMatch.held``), ``routed`` leading
        blocks just routed to it (its pool, provisionally), ``shared`` leading blocks in the
        shared tier. The run ends at the first block of weight 0."""
        total, n = 0.0, 0
        while True:
            w = 1.0 if n < routed else 0.0
            if n < len(media) and media[n] is not None:
                w = max(w, self.tier_weights[media[n]])
            if n < shared:
                w = max(w, self.shared_tier_weight)
            if w <= 0.0:
                return total, n
            total, n = total + w, n + 1

    def _remember(self, replica: int, hashes: list[int], expiry: float) -> None:
        prov = self._provisional.setdefault(replica, {})
        for h in hashes:
            prov[h] = expiry
        self._expiries.append((expiry, replica, hashes))

    def _expire(self, now: float) -> None:
        """Drop provisional entries whose time is up (oldest first)."""
        while self._expiries and self._expiries[0][0] <= now:
            expiry, replica, hashes = self._expiries.popleft()
            prov = self._provisional[replica]
            for h in hashes:
                if prov.get(h, now + 1) <= now:
                    del prov[h]
