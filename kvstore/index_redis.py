"""RedisIndex: the prefix-cache index (:mod:`kvstore.index`) in Redis, shared by every scheduler
of a deployment (standalone Redis, or one shard: the scripts derive key names from the prefix).
Each Lua script mirrors the :class:`kvstore.index_memory.MemoryIndex` method of its name.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvstore.events import HOST, POOL, BlockRemoved, BlockStored, KVEvent
from kvstore.index_contract import (
    IndexUnavailable,
    PrefixMatch,
    Snapshot,
    by_medium,
    check_events,
    shared_ttl,
)

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
        check_events(events)
        args: list = [replica, seq]
        for ev in events:
            if isinstance(ev, BlockStored):
                ttl_ms = max(1, math.ceil(shared_ttl(ev) * 1000))
                args += ["S", ev.medium, ttl_ms, len(ev.block_hashes), *(f"{h:016x}" for h in ev.block_hashes)]
            elif isinstance(ev, BlockRemoved):
                args += ["R", ev.medium, len(ev.block_hashes), *(f"{h:016x}" for h in ev.block_hashes)]
            else:
                args += ["C", ev.medium]
        return self._call(self._apply, "apply", args) == 1

    def resync(self, replica: str, seq: int, block_hashes: Snapshot) -> None:
        args: list = [replica, seq]
        for medium, hashes in by_medium(block_hashes).items():
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
