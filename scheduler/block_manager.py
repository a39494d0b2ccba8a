"""Paged KV block accounting and automatic prefix caching.

The block manager is the only owner of block ids. Each request holds a block table (list of
block ids); a block can be shared by several requests (reference counted) when their
prefixes match. A full block gets a chained hash (:mod:`kvstore.hashing`); when its last
user frees it, it stays in the cache, reusable by a later request with the same prefix,
until the allocator needs it (LRU eviction, oldest freed first). Design after vLLM's
automatic prefix caching and nano-vllm's block manager.

The free queue is the allocation order: freed blocks without a hash (nothing reusable) go to
its front and are handed out first, then blocks never used yet, then cached blocks, least
recently freed first. So a cached block is evicted only when no empty block is left, and the
KV pool's pages (committed on first write, :func:`workers.kv_cache.zeroed_host_tensor`) become
resident only as the running requests and the prefix cache's contents need them: the engine's
resident memory grows with the cache up to the pool's size (``kv_cache_memory``), not beyond.

KV events (:mod:`kvstore.events`) go out through ``sink`` when a hashed block becomes
reusable (stored) or is evicted (removed).

With KV tiers below the pool (:mod:`kvstore.tiers`, ``offload``), every evicted cached block is
also recorded as ``(hash, block id)`` (:meth:`take_evicted`): its K/V is still intact until the
next model step writes the block, and the engine copies it out before that step. With
``write_through``, every block that becomes cached is recorded too (:meth:`take_new_cached`). Blocks found
in a lower tier at admission come in through ``allocate(..., loaded=n)``: newly allocated
blocks, counted as computed and as cache hits, that the engine fills before the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventSink
from kvstore.hashing import hash_block, hash_blocks, salted_seed
from scheduler.request import Request


@dataclass
class BlockStats:
    num_blocks: int
    used: int          # referenced by at least one request
    cached: int        # free, but holding a reusable hashed block
    free: int          # free and empty (includes cached: free == allocatable)
    prefix_cache_queries: int   # prompt tokens looked up, once per request (first admission)
    prefix_cache_hits: int      # of which found in the cache (= the requests' num_cached_tokens)
    preempted_queries: int      # tokens looked up again by re-admissions after a preemption
    preempted_hits: int         # of which found in the cache (the rest is recomputed)

    @property
    def usage(self) -> float:
        return self.used / self.num_blocks if self.num_blocks else 0.0


class BlockManager:
    """Allocates KV blocks of ``block_size`` tokens out of ``num_blocks``.

    Args:
        num_blocks: size of the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep and reuse hashed full blocks.
        hash_seed: root of the block-hash chain (:func:`kvstore.hashing.seed_hash` of the
            model identity and KV format); a request with a ``cache_salt`` hashes from
            ``salted_seed(hash_seed, cache_salt)``, so it shares blocks only with its salt.
        sink: receives KV events, or None.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 hash_seed: int, sink: KVEventSink | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.sink = sink
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}          # block hash -> block id
        self.queries = self.hits = 0
        self.preempted_queries = self.preempted_hits = 0
        self._events: list[KVEvent] = []
        self.offload = False                      # record evicted blocks for the KV tiers
        self.write_through = False                # record newly cached blocks for the KV tiers
        self._evicted: list[tuple[int, int]] = []     # (block hash, block id), since take_evicted
        self._new_cached: list[tuple[int, int]] = []  # (block hash, block id), since take_new_cached
        self._loading = False

    # ---- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> BlockStats:
        free = len(self.free_queue)
        cached = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        return BlockStats(self.num_blocks, self.num_blocks - free, cached, free, self.queries, self.hits,
                          self.preempted_queries, self.preempted_hits)

    def cached_block_hashes(self) -> list[int]:
        """Hashes of every block in the prefix cache (in use or free-but-cached), for a
        prefix-index resync. The KV events emitted so far describe the same set, except
        that after :meth:`reset_prefix_cache` the blocks still in use stay listed here (they
        are still reusable) while ``AllBlocksCleared`` made the index forget them.

        Not thread-safe: the publisher thread calls it while the engine thread steps, so the
        caller must hold the engine lock (``LLMEngine.lock``), under which the engine also
        forwards events (``take_events``).
        """
        return list(self.cached)

    # ---- prefix cache ----------------------------------------------------------------
    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend ``req.block_hashes`` to cover every full block of its first ``num_tokens``."""
        have = len(req.block_hashes)
        if num_tokens // self.block_size > have:
            parent = req.block_hashes[-1] if have else None     # None: the request's salted root
            req.block_hashes += hash_blocks(self.hash_seed, req.tokens(0, num_tokens), self.block_size,
                                            parent=parent, start_block=have, cache_salt=req.cache_salt)

    def adopt_prompt_hashes(self, req: Request, hashes: Sequence[int]) -> bool:
        """Take ``hashes``, the hashes of the prompt's full blocks that the router computed to
        route the request (:func:`kvstore.hashing.hash_blocks`), as the request's block hashes,
        so that the prompt is hashed once per request. Checked for being this manager's chain at
        the cost of one block: one hash per full block of the prompt, and the first equal to the
        hash of the prompt's first block from the request's root (this seed, the request's
        ``cache_salt``, this block size). Returns False, taking nothing (the hashes are then
        computed here as for any request), on a mismatch, without prefix caching, or when the
        request already has hashes."""
        n = req.num_prompt_tokens // self.block_size
        if not self.enable_prefix_caching or req.block_hashes or not n or len(hashes) != n:
            return False
        first = hash_block(salted_seed(self.hash_seed, req.cache_salt), req.prompt_token_ids[:self.block_size])
        if hashes[0] != first:
            return False
        req.block_hashes = list(hashes)
        return True

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens.

        At least one token is always left to compute (the model needs a query to produce
        logits), so a prompt that is entirely cached gets its last block recomputed.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks = []
        for h in req.block_hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # ---- allocation ------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = (), loaded: int = 0) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens after its computed ones.

        ``cached_blocks`` (at admission only) are prefix-cache hits from
        :meth:`find_cached_prefix`; they are shared and count as computed. ``loaded`` (at
        admission only): the next that many blocks come from a lower KV tier: they are
        allocated here (``req.block_table[len(cached_blocks):][:loaded]``), count as computed
        and as hits, and are registered in the prefix cache; the caller fills them before
        the next step. Returns False (and changes nothing) when the pool cannot supply the blocks.

        An admission (a request holding no blocks yet) records its look-up once: a request's
        first admission adds its prompt to ``queries`` and its hits to ``hits`` and
        ``req.num_cached_tokens``; a re-admission after a preemption adds its tokens so far
        (prompt + output) to ``preempted_queries`` and its hits to ``preempted_hits``.
        """
        reused_free = sum(1 for b in cached_blocks if self.ref_count[b] == 0)
        have = len(req.block_table) + len(cached_blocks)
        computed = req.num_computed_tokens + (len(cached_blocks) + loaded) * self.block_size
        need = self.blocks_needed(computed + num_new_tokens) - have
        if max(need, 0) + reused_free > len(self.free_queue):
            return False
        if self.enable_prefix_caching and not req.block_table:      # an admission
            hit = (len(cached_blocks) + loaded) * self.block_size
            if req.num_preemptions == 0:      # usage reports the first admission's hits only
                self.queries += req.num_tokens
                self.hits += hit
                req.num_cached_tokens = hit
            else:
                self.preempted_queries += req.num_tokens
                self.preempted_hits += hit
        if cached_blocks:
            for b in cached_blocks:
                if self.ref_count[b] == 0:
                    del self.free_queue[b]
                self.ref_count[b] += 1
            req.block_table.extend(cached_blocks)
            req.num_computed_tokens = computed
        for _ in range(need):
            req.block_table.append(self._pop_free())
        if loaded:
            req.num_computed_tokens = computed
            self._loading = True              # registered, but not new: no write-through
            try:
                self.cache_full_blocks(req)
            finally:
                self._loading = False
        return True

    def _pop_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:                    # evict a cached block
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                self._events.append(BlockRemoved((h,)))
                if self.offload:
                    self._evicted.append((h, b))
        self.ref_count[b] = 1
        return b

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        n_full = req.num_computed_tokens // self.block_size
        self._update_hashes(req, n_full * self.block_size)
        new: list[int] = []
        first = None
        for i in range(req.num_registered_blocks, n_full):
            b = req.block_table[i]
            h = req.block_hashes[i]
            if self.block_hash[b] is not None or h in self.cached:   # hit, or a duplicate
                continue
            self.block_hash[b] = h
            self.cached[h] = b
            if self.write_through and not self._loading:
                self._new_cached.append((h, b))
            if first is None:
                first = i
            new.append(h)
        req.num_registered_blocks = n_full
        if new:
            parent = req.block_hashes[first - 1] if first else None
            self._events.append(BlockStored(tuple(new), parent, self.block_size))

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the blocks of ``req``'s block table past the first ``num_tokens`` tokens
        (speculative decoding: blocks that only held rejected proposals or draft lookahead
        slots). Blocks are only ever trimmed from the tail, which is never a prefix-cache hit
        of another request, so freed blocks are plain free blocks (their hash, if any, is
        kept: a registered block is full and computed, and is never past ``num_tokens``)."""
        keep = self.blocks_needed(num_tokens)
        while len(req.block_table) > keep:
            self._release(req.block_table.pop())

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so that the tail is evicted first."""
        for b in reversed(req.block_table):
            self._release(b)
        req.block_table = []
        req.num_registered_blocks = 0

    def _release(self, b: int) -> None:
        """Drop a reference to block ``b``; unreferenced, it joins the free queue: at the back
        (evicted last) when it holds a cached block, at the front (reused first) when empty."""
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            self.free_queue[b] = None
            if self.block_hash[b] is None:
                self.free_queue.move_to_end(b, last=False)

    def reset_prefix_cache(self, offload: bool = False) -> None:
        """Forget every cached (unreferenced) block; emptied, they move to the free queue's front.
        ``offload``: they count as evicted (:meth:`take_evicted`), so with KV tiers they move to
        the tiers below (the pool's cache is emptied, the lower tiers keep them)."""
        for b in [b for b in self.free_queue if self.block_hash[b] is not None]:
            if offload and self.offload and self.cached.get(self.block_hash[b]) == b:
                self._evicted.append((self.block_hash[b], b))
            self.block_hash[b] = None
            self.free_queue.move_to_end(b, last=False)
        self.cached = {h: b for h, b in self.cached.items() if self.ref_count[b] > 0}
        self._events.append(AllBlocksCleared())

    def take_evicted(self) -> list[tuple[int, int]]:
        """``(block hash, block id)`` of the cached blocks evicted since the last call (with
        ``offload`` only). Their K/V is intact until the next model step writes them."""
        ev, self._evicted = self._evicted, []
        return ev

    def take_new_cached(self) -> list[tuple[int, int]]:
        """``(block hash, block id)`` of the blocks that became cached since the last call (with
        ``write_through`` only; blocks loaded from a tier are not listed). Full and computed:
        their K/V does not change while they stay cached."""
        new, self._new_cached = self._new_cached, []
        return new

    def take_events(self, extra: Sequence[KVEvent] = ()) -> list[KVEvent]:
        """Events since the last call, then ``extra`` (the KV tiers' events, medium ``host`` or
        ``redis``); also forwards them to the sink."""
        ev, self._events = self._events + list(extra), []
        if ev and self.sink is not None:
            self.sink.publish(ev)
        return ev
