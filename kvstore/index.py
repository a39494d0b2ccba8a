"""Prefix-cache index: which replica holds which KV blocks, fed by the replicas' KV events.

The router asks :meth:`PrefixIndex.match` with a request's block hashes and gets, per live
replica, how many leading blocks of the request it already holds; each replica's
:class:`kvstore.publisher.KVEventPublisher` keeps the index current with its block
manager's KV events. Two implementations of one contract:

- :class:`MemoryIndex`: a dict in this process (the embedded default when no Redis URL is
  given; thread-safe).
- :class:`RedisIndex`: shared by every scheduler of a deployment through one Redis
  (standalone, or one shard: the scripts derive key names from the prefix).

Consistency (both): each replica numbers its batches of events 1, 2, ...; ``apply`` takes a
batch only if its number is the next one expected, otherwise it changes nothing and returns
False, and the replica then ``resync``s (replaces its entries by a snapshot of its cache).
A replica is live while its heartbeat has not expired; ``match`` drops every entry of a
known replica whose heartbeat is missing or expired (so heartbeat *before* the first
apply/resync, as the publisher does). See docs/kvstore.md.

Redis key schema (``p`` = prefix, hashes as 16 lower-case hex digits, replica ids as given):

==============================  ======  ===================================================
key                             type    contents
==============================  ======  ===================================================
``p:b:{hash:016x}``             HASH    replica -> tier ("gpu") for each replica holding it
``p:r:{replica}:blocks``        SET     hashes (hex) the replica holds
``p:r:{replica}:seq``           STRING  number of the last batch applied (or resynced)
``p:r:{replica}:hb``            STRING  "1" with a TTL: the replica is live while it exists
``p:replicas``                  SET     replica ids with a heartbeat or entries
==============================  ======  ===================================================

Every operation is one Lua script (one round trip, atomic on the server): ``apply`` checks
the sequence number and writes the batch in the same script, so a client or server crash
between or during calls leaves either the whole batch or none of it, and the next batch's
number tells the replica whether to resync. A missing ``seq`` key means "nothing known":
the next batch expected is 1.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Callable, Protocol

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

GPU = "gpu"     # tier of a block in device memory (a "cpu" offload tier would come later)


class IndexUnavailable(RuntimeError):
    """The index could not answer in time (Redis down or slow): route by load."""


class PrefixIndex(Protocol):
    def apply(self, replica: str, seq: int, events: Sequence[KVEvent]) -> bool:
        """Apply one batch of a replica's KV events numbered seq (1, 2, ... per replica). Returns False
        (applies nothing) when seq is not the next expected number: the caller must resync. Raises IndexUnavailable."""

    def resync(self, replica: str, seq: int, block_hashes: Iterable[int]) -> None:
        """Replace everything known about replica by block_hashes (every block its prefix cache holds now);
        the next batch expected is seq + 1. Raises IndexUnavailable."""

    def heartbeat(self, replica: str, ttl: float) -> None:
        """replica is alive for ttl more seconds. Raises IndexUnavailable."""

    def remove_replica(self, replica: str) -> None:
        """Drop every entry of replica (shut down, or declared dead). Raises IndexUnavailable."""

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each live replica (heartbeat not expired), the number of leading blocks of block_hashes it
        holds, stopping at its first miss. Replicas with 0 may be left out. Raises IndexUnavailable.
        Replicas whose heartbeat expired have all their entries dropped (lazily, here or in a sweep)."""


def _check_events(events: Sequence[KVEvent]) -> None:
    for ev in events:
        if not isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"not a KV event: {ev!r}")


def open_index(url: str | None = None, prefix: str = "kvmesh", timeout: float = 0.005) -> PrefixIndex:
    """A :class:`RedisIndex` on ``url`` (``redis://host:port/db``), or a :class:`MemoryIndex`
    when ``url`` is empty or None. Connects lazily: never raises IndexUnavailable."""
    return RedisIndex(url, prefix=prefix, timeout=timeout) if url else MemoryIndex()


# ---- in process ------------------------------------------------------------------------
class MemoryIndex:
    """The index in one process; every method takes one lock, so it is thread-safe and each
    call is atomic. Never raises IndexUnavailable.

    Args:
        clock: seconds, monotonic (tests may pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[int, dict[str, str]] = {}   # block hash -> {replica: tier}
        self._blocks: dict[str, set[int]] = {}          # replica -> hashes it holds
        self._seq: dict[str, int] = {}                  # replica -> last batch applied
        self._expiry: dict[str, float] = {}             # replica -> heartbeat deadline (clock s)

    def _drop_blocks(self, replica: str) -> None:
        for h in self._blocks.pop(replica, ()):
            holders = self._holders[h]
            del holders[replica]
            if not holders:
                del self._holders[h]

    def _store(self, replica: str, hashes: Iterable[int], tier: str = GPU) -> None:
        held = self._blocks.setdefault(replica, set())
        for h in hashes:
            self._holders.setdefault(h, {})[replica] = tier
            held.add(h)

    def _remove(self, replica: str, hashes: Iterable[int]) -> None:
        held = self._blocks.get(replica, set())
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and holders.pop(replica, None) is not None:
                held.discard(h)
                if not holders:
                    del self._holders[h]

    def _drop_replica(self, replica: str) -> None:
        self._drop_blocks(replica)
        self._seq.pop(replica, None)
        self._expiry.pop(replica, None)

    def apply(self, replica: str, seq: int, events: Sequence[KVEvent]) -> bool:
        _check_events(events)
        with self._lock:
            if seq != self._seq.get(replica, 0) + 1:
                return False
            for ev in events:
                if isinstance(ev, BlockStored):
                    self._store(replica, ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    self._remove(replica, ev.block_hashes)
                else:
                    self._drop_blocks(replica)
            self._seq[replica] = seq
            return True

    def resync(self, replica: str, seq: int, block_hashes: Iterable[int]) -> None:
        hashes = list(block_hashes)
        with self._lock:
            self._drop_blocks(replica)
            self._store(replica, hashes)
            self._seq[replica] = seq

    def heartbeat(self, replica: str, ttl: float) -> None:
        with self._lock:
            self._expiry[replica] = self._clock() + ttl

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._drop_replica(replica)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        with self._lock:
            now = self._clock()
            known = self._blocks.keys() | self._seq.keys() | self._expiry.keys()
            live = set()
            for r in known:
                if self._expiry.get(r, -1.0) > now:
                    live.add(r)
                else:
                    self._drop_replica(r)
            counts: dict[str, int] = {}
            for i, h in enumerate(block_hashes):
                holders = self._holders.get(h, {})
                live = {r for r in live if r in holders}
                if not live:
                    break
                for r in live:
                    counts[r] = i + 1
            return counts


# ---- Redis -----------------------------------------------------------------------------
# Lua scripts. ARGV[1] is always the key prefix; key names are built in the script, which
# Redis allows on a standalone server (not across Redis Cluster slots).
_LUA_LIB = """
local function drop_blocks(p, r)
  local bk = p .. ':r:' .. r .. ':blocks'
  for _, h in ipairs(redis.call('SMEMBERS', bk)) do
    redis.call('HDEL', p .. ':b:' .. h, r)
  end
  redis.call('DEL', bk)
end
local function drop_replica(p, r)
  drop_blocks(p, r)
  redis.call('DEL', p .. ':r:' .. r .. ':seq', p .. ':r:' .. r .. ':hb')
  redis.call('SREM', p .. ':replicas', r)
end
local function store(p, r, tier, first, last)
  local bk = p .. ':r:' .. r .. ':blocks'
  for j = first, last do
    redis.call('HSET', p .. ':b:' .. ARGV[j], r, tier)
    redis.call('SADD', bk, ARGV[j])
  end
end
"""

# ARGV: prefix, replica, seq, then ops: 'S' tier n h1..hn | 'R' n h1..hn | 'C'. Returns 1 or 0.
_APPLY = _LUA_LIB + """
local p, r = ARGV[1], ARGV[2]
local rk = p .. ':r:' .. r
local cur = tonumber(redis.call('GET', rk .. ':seq') or '0')
if tonumber(ARGV[3]) ~= cur + 1 then return 0 end
local i = 4
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    drop_blocks(p, r)
    i = i + 1
  elseif op == 'S' then
    local n = tonumber(ARGV[i + 2])
    store(p, r, ARGV[i + 1], i + 3, i + 2 + n)
    i = i + 3 + n
  else
    local n = tonumber(ARGV[i + 1])
    for j = i + 2, i + 1 + n do
      redis.call('HDEL', p .. ':b:' .. ARGV[j], r)
      redis.call('SREM', rk .. ':blocks', ARGV[j])
    end
    i = i + 2 + n
  end
end
redis.call('SET', rk .. ':seq', ARGV[3])
redis.call('SADD', p .. ':replicas', r)
return 1
"""

# ARGV: prefix, replica, seq, tier, h1..hn
_RESYNC = _LUA_LIB + """
local p, r = ARGV[1], ARGV[2]
drop_blocks(p, r)
store(p, r, ARGV[4], 5, #ARGV)
redis.call('SET', p .. ':r:' .. r .. ':seq', ARGV[3])
redis.call('SADD', p .. ':replicas', r)
return 1
"""

# ARGV: prefix, replica, ttl in ms
_HEARTBEAT = """
redis.call('SET', ARGV[1] .. ':r:' .. ARGV[2] .. ':hb', '1', 'PX', ARGV[3])
redis.call('SADD', ARGV[1] .. ':replicas', ARGV[2])
return 1
"""

# ARGV: prefix, replica
_REMOVE = _LUA_LIB + """
drop_replica(ARGV[1], ARGV[2])
return 1
"""

# ARGV: prefix, h1..hn. Drops replicas without a live heartbeat, then walks the hashes,
# each live replica's run ending at its first miss. Returns {replica, count, ...}.
_MATCH = _LUA_LIB + """
local p = ARGV[1]
local active, n_active, counts = {}, 0, {}
for _, r in ipairs(redis.call('SMEMBERS', p .. ':replicas')) do
  if redis.call('EXISTS', p .. ':r:' .. r .. ':hb') == 1 then
    active[r] = true
    n_active = n_active + 1
  else
    drop_replica(p, r)
  end
end
for i = 2, #ARGV do
  if n_active == 0 then break end
  local holders = {}
  for _, r in ipairs(redis.call('HKEYS', p .. ':b:' .. ARGV[i])) do holders[r] = true end
  for r in pairs(active) do
    if holders[r] then
      counts[r] = i - 1
    else
      active[r] = nil
      n_active = n_active - 1
    end
  end
end
local out = {}
for r, c in pairs(counts) do
  out[#out + 1] = r
  out[#out + 1] = c
end
return out
"""


class RedisIndex:
    """The index in Redis (redis-py), shared by every scheduler of a deployment.

    Each method is one script call: one round trip (two more, once, after Redis restarts
    and has forgotten the scripts). Any Redis error, refused connection or timeout raises
    :class:`IndexUnavailable`; a failed connection is discarded, and the next call opens a
    new one, so the index answers again as soon as Redis does.

    Args:
        url: ``redis://host:port/db``.
        prefix: every key starts with ``prefix + ":"`` (one prefix per deployment/test).
        timeout: seconds allowed to connect and to read the reply of ``match`` (the router's
            request path; a few ms).
        write_timeout: the same for ``apply``/``resync``/``heartbeat``/``remove_replica``
            (the publisher's background thread; a resync of many thousand blocks takes
            more than a few ms). A write that timed out may still have been applied: the
            publisher then resyncs, which is always safe.
    """

    def __init__(self, url: str, prefix: str = "kvmesh", timeout: float = 0.005,
                 write_timeout: float = 0.5):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url, self.prefix = url, prefix
        self._errors = (redis.RedisError, OSError)

        def client(t: float) -> "redis.Redis":
            # One retry, on a dropped connection only (a pooled socket that died with a
            # restarted server); a timeout is never retried, so a call takes at most ~2 x t.
            return redis.Redis.from_url(
                url, socket_timeout=t, socket_connect_timeout=t, decode_responses=True,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
                health_check_interval=0)

        self._read, self._write = client(timeout), client(write_timeout)
        self._apply = self._write.register_script(_APPLY)
        self._resync = self._write.register_script(_RESYNC)
        self._heartbeat = self._write.register_script(_HEARTBEAT)
        self._remove = self._write.register_script(_REMOVE)
        self._match = self._read.register_script(_MATCH)

    def _call(self, script, what: str, args: list) -> object:
        try:
            return script(args=[self.prefix, *args])
        except self._errors as e:
            raise IndexUnavailable(f"prefix index at {self.url}: {what} failed: "
                                   f"{type(e).__name__}: {e}") from e

    def apply(self, replica: str, seq: int, events: Sequence[KVEvent]) -> bool:
        _check_events(events)
        args: list = [replica, seq]
        for ev in events:
            if isinstance(ev, BlockStored):
                args += ["S", GPU, len(ev.block_hashes), *(f"{h:016x}" for h in ev.block_hashes)]
            elif isinstance(ev, BlockRemoved):
                args += ["R", len(ev.block_hashes), *(f"{h:016x}" for h in ev.block_hashes)]
            else:
                args.append("C")
        return self._call(self._apply, "apply", args) == 1

    def resync(self, replica: str, seq: int, block_hashes: Iterable[int]) -> None:
        self._call(self._resync, "resync", [replica, seq, GPU, *(f"{h:016x}" for h in block_hashes)])

    def heartbeat(self, replica: str, ttl: float) -> None:
        self._call(self._heartbeat, "heartbeat", [replica, max(1, round(ttl * 1000))])

    def remove_replica(self, replica: str) -> None:
        self._call(self._remove, "remove_replica", [replica])

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        if not block_hashes:
            return {}
        out = self._call(self._match, "match", [f"{h:016x}" for h in block_hashes])
        return {out[i]: int(out[i + 1]) for i in range(0, len(out), 2)}

    def close(self) -> None:
        """Close the connection pools (the index may not be used afterwards)."""
        self._read.close()
        self._write.close()
