"""Prefix-cache index: which replica holds which KV blocks in which tier, fed by KV events.

The router asks :meth:`PrefixIndex.match_tiers` with a request's block hashes and gets, per
live replica, the tier (medium, :mod:`kvstore.events`) of each leading block of the request
it holds (its pool or its host tier), and how many leading blocks the shared Redis tier holds
(any replica can load those); :meth:`PrefixIndex.match` gives just each replica's count.
Each replica's :class:`kvstore.publisher.KVEventPublisher` keeps the index current with its
KV events. Two implementations of one contract:

- :class:`MemoryIndex`: dicts in this process (the embedded default when no Redis URL is
  given; thread-safe).
- :class:`RedisIndex`: shared by every scheduler of a deployment through one Redis
  (standalone, or one shard: the scripts derive key names from the prefix).

Consistency (both): each replica numbers its batches of events 1, 2, ...; ``apply`` takes a
batch only if its number is the next one expected, otherwise it changes nothing and returns
False, and the replica then ``resync``s (replaces its entries by a snapshot of its cache).
A replica is live while its heartbeat has not expired; ``match`` drops every entry of a
known replica whose heartbeat is missing or expired (so heartbeat *before* the first
apply/resync, as the publisher does). Blocks of the shared Redis tier belong to no replica:
a ``BlockStored`` of medium ``redis`` records the block for its ``ttl`` (the Redis tier's TTL,
which the index cannot observe otherwise), whichever replica sent it, and a resync or a
dropped replica leaves them. See docs/kvstore.md.

Redis key schema (``p`` = prefix, hashes as 16 lower-case hex digits, replica ids as given):

==============================  ======  ===================================================
key                             type    contents
==============================  ======  ===================================================
``p:b:{hash:016x}``             HASH    replica -> its mediums of the block, comma-separated
                                        (``pool``, ``host``, ``pool,host``)
``p:s:{hash:016x}``             STRING  "1", with the Redis tier's TTL: the block is in the
                                        shared Redis tier
``p:r:{replica}:blocks``        SET     hashes (hex) the replica holds (in any medium)
``p:r:{replica}:seq``           STRING  number of the last batch applied (or resynced)
``p:r:{replica}:hb``            STRING  "1" with a TTL: the replica is live while it exists
``p:replicas``                  SET     replica ids with a heartbeat or entries
==============================  ======  ===================================================

Every operation is one Lua script (one round trip, atomic on the server): ``apply`` checks
the sequence number and writes the batch in the same script, so a client or server crash
between or during calls leaves either the whole batch or none of it, and the next batch's
number tells the replica whether to resync. A missing ``seq`` key means "nothing known":
the next batch expected is 1.

Why one file over ~450 lines: one contract and its two implementations side by side, each Lua
script next to the :class:`MemoryIndex` method it mirrors; splitting them would separate what
must change together.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvstore.events import HOST, POOL, REDIS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

REPLICA_MEDIUMS = (POOL, HOST)     # a replica's own tiers, best first
SHARED_NO_TTL = 3600.0             # seconds the index keeps a Redis-tier block written without a TTL


class IndexUnavailable(RuntimeError):
    """The index could not answer in time (Redis down or slow): route by load."""


@dataclass(frozen=True)
class PrefixMatch:
    """What the index knows of a request's leading blocks (``match_tiers``).

    Attributes:
        held: per live replica that holds some of them, its best own medium (``pool`` before
            ``host``) of each leading block, None where it holds the block in none of its own
            tiers but the shared tier does; the run ends at the first block that neither the
            replica nor the shared tier holds (trailing Nones left out). Replicas holding none
            of the leading blocks are absent.
        shared: leading blocks in the shared Redis tier (loadable by any replica).
    """

    held: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    shared: int = 0

    def counts(self) -> dict[str, int]:
        """Per replica, how many leading blocks it holds in its own tiers (first miss ends it)."""
        out = {}
        for r, media in self.held.items():
            n = next((i for i, m in enumerate(media) if m is None), len(media))
            if n:
                out[r] = n
        return out


Snapshot = Iterable[int] | Mapping[str, Iterable[int]]


class PrefixIndex(Protocol):
    def apply(self, replica: str, seq: int, events: Sequence[KVEvent]) -> bool:
        """Apply one batch of a replica's KV events numbered seq (1, 2, ... per replica). Returns False
        (applies nothing) when seq is not the next expected number: the caller must resync. Raises
        IndexUnavailable; ValueError for an event of an unknown medium (or clearing the shared tier)."""

    def resync(self, replica: str, seq: int, block_hashes: Snapshot) -> None:
        """Replace everything known about replica by block_hashes: every block its pool holds now
        (an iterable of hashes), or ``{medium: hashes}`` for its ``pool`` and ``host`` tiers; the next
        batch expected is seq + 1. Shared (``redis``) entries stay. Raises IndexUnavailable."""

    def heartbeat(self, replica: str, ttl: float) -> None:
        """replica is alive for ttl more seconds. Raises IndexUnavailable."""

    def remove_replica(self, replica: str) -> None:
        """Drop every entry of replica (shut down, or declared dead). Raises IndexUnavailable."""

    def match_tiers(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """The tiers of the leading blocks of block_hashes (:class:`PrefixMatch`), live replicas only.
        Raises IndexUnavailable. Replicas whose heartbeat expired have all their entries dropped
        (lazily, here or in a sweep)."""

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each live replica, the number of leading blocks of block_hashes it holds in its own
        tiers, stopping at its first miss (``match_tiers(...).counts()``). Replicas with 0 may be
        left out. Raises IndexUnavailable."""


def _check_events(events: Sequence[KVEvent]) -> None:
    for ev in events:
        if not isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"not a KV event: {ev!r}")
        if ev.medium not in REPLICA_MEDIUMS and not (ev.medium == REDIS and not isinstance(ev, AllBlocksCleared)):
            raise ValueError(f"KV event medium must be one of {REPLICA_MEDIUMS + (REDIS,)} "
                             f"(and the shared {REDIS!r} tier cannot be cleared): {ev!r}")


def _by_medium(block_hashes: Snapshot) -> dict[str, list[int]]:
    """A resync snapshot as ``{medium: hashes}`` (a plain iterable: the pool's)."""
    if not isinstance(block_hashes, Mapping):
        return {POOL: list(block_hashes)}
    bad = set(block_hashes) - set(REPLICA_MEDIUMS)
    if bad:
        raise ValueError(f"resync: mediums must be among {REPLICA_MEDIUMS}, got {sorted(bad)}")
    return {m: list(hs) for m, hs in block_hashes.items()}


def _shared_ttl(ev: BlockStored) -> float:
    return ev.ttl if ev.ttl > 0 else SHARED_NO_TTL


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
        self._holders: dict[int, dict[str, set[str]]] = {}  # block hash -> {replica: its mediums}
        self._blocks: dict[str, set[int]] = {}              # replica -> hashes it holds (any medium)
        self._seq: dict[str, int] = {}                      # replica -> last batch applied
        self._expiry: dict[str, float] = {}                 # replica -> heartbeat deadline (clock s)
        self._shared: dict[int, float] = {}                 # block hash -> deadline in the Redis tier
        self._next_sweep = 0.0

    def _drop_blocks(self, replica: str) -> None:
        for h in self._blocks.pop(replica, ()):
            holders = self._holders[h]
            del holders[replica]
            if not holders:
                del self._holders[h]

    def _store(self, replica: str, hashes: Iterable[int], medium: str) -> None:
        held = self._blocks.setdefault(replica, set())
        for h in hashes:
            self._holders.setdefault(h, {}).setdefault(replica, set()).add(medium)
            held.add(h)

    def _remove(self, replica: str, hashes: Iterable[int], medium: str) -> None:
        held = self._blocks.get(replica, set())
        for h in hashes:
            holders = self._holders.get(h, {})
            media = holders.get(replica)
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del holders[replica]
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
                if isinstance(ev, BlockStored) and ev.medium == REDIS:
                    deadline = self._clock() + _shared_ttl(ev)
                    self._shared.update((h, deadline) for h in ev.block_hashes)
                elif isinstance(ev, BlockStored):
                    self._store(replica, ev.block_hashes, ev.medium)
                elif isinstance(ev, BlockRemoved) and ev.medium == REDIS:
                    for h in ev.block_hashes:
                        self._shared.pop(h, None)
                elif isinstance(ev, BlockRemoved):
                    self._remove(replica, ev.block_hashes, ev.medium)
                else:
                    self._remove(replica, list(self._blocks.get(replica, ())), ev.medium)
            self._seq[replica] = seq
            return True

    def resync(self, replica: str, seq: int, block_hashes: Snapshot) -> None:
        snapshot = _by_medium(block_hashes)
        with self._lock:
            self._drop_blocks(replica)
            for medium, hashes in snapshot.items():
                self._store(replica, hashes, medium)
            self._seq[replica] = seq

    def heartbeat(self, replica: str, ttl: float) -> None:
        with self._lock:
            self._expiry[replica] = self._clock() + ttl

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._drop_replica(replica)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        return self.match_tiers(block_hashes).counts()

    def match_tiers(self, block_hashes: Sequence[int]) -> PrefixMatch:
        with self._lock:
            now = self._clock()
            if now >= self._next_sweep:                     # expired shared entries, once a second
                self._shared = {h: t for h, t in self._shared.items() if t > now}
                self._next_sweep = now + 1.0
            known = self._blocks.keys() | self._seq.keys() | self._expiry.keys()
            active = set()
            for r in known:
                if self._expiry.get(r, -1.0) > now:
                    active.add(r)
                else:
                    self._drop_replica(r)
            media: dict[str, list[str | None]] = {r: [] for r in active}
            last: dict[str, int] = {}                       # replica -> its last own block in the run
            shared = 0
            for i, h in enumerate(block_hashes):
                in_shared = shared == i and self._shared.get(h, 0.0) > now
                shared += in_shared
                if not active and not in_shared:
                    break
                holders = self._holders.get(h, {})
                for r in list(active):
                    own = next((m for m in REPLICA_MEDIUMS if m in holders.get(r, ())), None)
                    if own is None and not in_shared:
                        active.discard(r)
                        continue
                    media[r].append(own)
                    if own is not None:
                        last[r] = i
            return PrefixMatch({r: tuple(media[r][:n + 1]) for r, n in last.items()}, shared)


# ---- Redis -----------------------------------------------------------------------------
# Lua scripts. ARGV[1] is always the key prefix; key names are built in the script, which
# Redis allows on a standalone server (not across Redis Cluster slots). A replica's mediums of
# a block are one hash field, "pool", "host" or "pool,host".
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
local function has(v, m)
  return string.find(',' .. v .. ',', ',' .. m .. ',', 1, true) ~= nil
end
local function add(p, r, m, h)
  local v = redis.call('HGET', p .. ':b:' .. h, r)
  if not v then
    redis.call('HSET', p .. ':b:' .. h, r, m)
    redis.call('SADD', p .. ':r:' .. r .. ':blocks', h)
  elseif not has(v, m) then
    redis.call('HSET', p .. ':b:' .. h, r, v .. ',' .. m)
  end
end
local function remove(p, r, m, h)
  local v = redis.call('HGET', p .. ':b:' .. h, r)
  if not v then return end
  local rest = {}
  for x in string.gmatch(v, '[^,]+') do
    if x ~= m then rest[#rest + 1] = x end
  end
  if #rest == 0 then
    redis.call('HDEL', p .. ':b:' .. h, r)
    redis.call('SREM', p .. ':r:' .. r .. ':blocks', h)
  else
    redis.call('HSET', p .. ':b:' .. h, r, table.concat(rest, ','))
  end
end
"""

# ARGV: prefix, replica, seq, then ops: 'S' medium ttl_ms n h1..hn | 'R' medium n h1..hn |
# 'C' medium. Medium 'redis' writes/deletes the shared entries p:s:h. Returns 1 or 0.
_APPLY = _LUA_LIB + """
local p, r = ARGV[1], ARGV[2]
local rk = p .. ':r:' .. r
local cur = tonumber(redis.call('GET', rk .. ':seq') or '0')
if tonumber(ARGV[3]) ~= cur + 1 then return 0 end
local i = 4
while i <= #ARGV do
  local op, m = ARGV[i], ARGV[i + 1]
  if op == 'C' then
    for _, h in ipairs(redis.call('SMEMBERS', rk .. ':blocks')) do remove(p, r, m, h) end
    i = i + 2
  elseif op == 'S' then
    local ttl, n = ARGV[i + 2], tonumber(ARGV[i + 3])
    for j = i + 4, i + 3 + n do
      if m == 'redis' then redis.call('SET', p .. ':s:' .. ARGV[j], '1', 'PX', ttl) else add(p, r, m, ARGV[j]) end
    end
    i = i + 4 + n
  else
    local n = tonumber(ARGV[i + 2])
    for j = i + 3, i + 2 + n do
      if m == 'redis' then redis.call('DEL', p .. ':s:' .. ARGV[j]) else remove(p, r, m, ARGV[j]) end
    end
    i = i + 3 + n
  end
end
redis.call('SET', rk .. ':seq', ARGV[3])
redis.call('SADD', p .. ':replicas', r)
return 1
"""

# ARGV: prefix, replica, seq, then groups: medium n h1..hn
_RESYNC = _LUA_LIB + """
local p, r = ARGV[1], ARGV[2]
drop_blocks(p, r)
local i = 4
while i <= #ARGV do
  local m, n = ARGV[i], tonumber(ARGV[i + 1])
  for j = i + 2, i + 1 + n do add(p, r, m, ARGV[j]) end
  i = i + 2 + n
end
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

# ARGV: prefix, h1..hn. Drops replicas without a live heartbeat, then walks the hashes: the
# shared run (p:s:h) ends at its first miss, each live replica's run at the first block that
# neither it nor the shared run holds. Returns {shared, replica, codes, ...}; codes has one
# character per block of the replica's run ('p' pool, 'h' host, '-' only in the shared tier),
# up to its last own block.
_MATCH = _LUA_LIB + """
local p = ARGV[1]
local active, n_active, codes, last = {}, 0, {}, {}
for _, r in ipairs(redis.call('SMEMBERS', p .. ':replicas')) do
  if redis.call('EXISTS', p .. ':r:' .. r .. ':hb') == 1 then
    active[r] = true
    n_active = n_active + 1
    codes[r] = ''
  else
    drop_replica(p, r)
  end
end
local shared, shared_on = 0, true
for i = 2, #ARGV do
  local h = ARGV[i]
  local in_shared = shared_on and redis.call('EXISTS', p .. ':s:' .. h) == 1
  if in_shared then shared = shared + 1 else shared_on = false end
  if n_active == 0 and not in_shared then break end
  if n_active > 0 then
    local held = {}
    local kv = redis.call('HGETALL', p .. ':b:' .. h)
    for j = 1, #kv, 2 do held[kv[j]] = kv[j + 1] end
    for r in pairs(active) do
      local v, c = held[r], nil
      if v and has(v, 'pool') then c = 'p' elseif v and has(v, 'host') then c = 'h' end
      if c then
        codes[r] = codes[r] .. c
        last[r] = #codes[r]
      elseif in_shared then
        codes[r] = codes[r] .. '-'
      else
        active[r] = nil
        n_active = n_active - 1
      end
    end
  end
end
local out = {shared}
for r, n in pairs(last) do
  out[#out + 1] = r
  out[#out + 1] = string.sub(codes[r], 1, n)
end
return out
"""
_CODES = {"p": POOL, "h": HOST, "-": None}


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
                ttl_ms = max(1, math.ceil(_shared_ttl(ev) * 1000))
                args += ["S", ev.medium, ttl_ms, len(ev.block_hashes), *(f"{h:016x}" for h in ev.block_hashes)]
            elif isinstance(ev, BlockRemoved):
                args += ["R", ev.medium, len(ev.block_hashes), *(f"{h:016x}" for h in ev.block_hashes)]
            else:
                args += ["C", ev.medium]
        return self._call(self._apply, "apply", args) == 1

    def resync(self, replica: str, seq: int, block_hashes: Snapshot) -> None:
        args: list = [replica, seq]
        for medium, hashes in _by_medium(block_hashes).items():
            args += [medium, len(hashes), *(f"{h:016x}" for h in hashes)]
        self._call(self._resync, "resync", args)

    def heartbeat(self, replica: str, ttl: float) -> None:
        self._call(self._heartbeat, "heartbeat", [replica, max(1, round(ttl * 1000))])

    def remove_replica(self, replica: str) -> None:
        self._call(self._remove, "remove_replica", [replica])

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        return self.match_tiers(block_hashes).counts()

    def match_tiers(self, block_hashes: Sequence[int]) -> PrefixMatch:
        if not block_hashes:
            return PrefixMatch()
        out = self._call(self._match, "match", [f"{h:016x}" for h in block_hashes])
        held = {out[i]: tuple(_CODES[c] for c in out[i + 1]) for i in range(1, len(out), 2)}
        return PrefixMatch(held, int(out[0]))

    def close(self) -> None:
        """Close the connection pools (the index may not be used afterwards)."""
        self._read.close()
        self._write.close()
