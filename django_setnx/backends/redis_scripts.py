"""The Lua scripts of the Redis backend, which the Redlock backend runs on each of
its masters too: one script per operation, each atomic on the server, each judging
expiry by Redis' own clock (``TIME``). The key layout they work on is described in
:mod:`django_setnx.backends.redis`.

Each script is a string: ``KEYS`` and ``ARGV`` are documented above it. Helpers
shared by several scripts (``_NOW``, ``_WHOLE``, ...) are prepended to those that use
them only: defining one costs a little on every call.
"""

from .base import MAX_FENCING_TOKEN, MAX_PLAUSIBLE_MS

#: Largest millisecond argument a script accepts (about 31.7 years). Lua prints
#: numbers with 14 significant digits, so ``now + ttl`` must stay below 10**14 to be
#: written as a whole number; 10**12 leaves room for centuries of clock.
MAX_SCRIPT_MS = 10**12 - 1

# Redis' clock, read once per script: ``now`` in ms (expiries) and ``us`` in µs
# (fencing tokens). TIME's fields are strings; both numbers are exact in Lua's doubles.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""

# Parsing shared by the scripts, each taking only the helpers it calls (defining one
# costs a little on every call). A bad numeric argument raises a script error before
# anything is written: a record written before a failing PEXPIRE (a ttl of 1e20, say)
# would never expire and block its name for good. ms_arg() checks the value (tonumber
# also reads " 7" or "7e3"; the scripts only ever use the number, so any spelling of
# a whole number in range is as good as another), which costs less than a pattern.
#
# whole() is how every script reads the ``acquired``/``expires`` fields; Python
# parses them the same way (LockInfo.from_record), so both agree on what is held.
_WHOLE = """
local function whole(value)
  if value and string.match(value, '^%-?%d+$') then
    return tonumber(value)
  end
  return nil
end
"""
_MS_ARG = f"""
local function ms_arg(i, what, low)
  local value = tonumber(ARGV[i])
  if not value or value < low or value > {MAX_SCRIPT_MS} or value % 1 ~= 0 then
    error({{err = 'ERR django-setnx: ' .. what .. ' (ARGV[' .. i .. ']) must be a whole ' ..
      'number of ms from ' .. low .. ' to {MAX_SCRIPT_MS}, got ' .. (ARGV[i] or '')}})
  end
  return value
end
"""
# The fencing tokens and times a backend writes (base.MAX_FENCING_TOKEN and
# MAX_PLAUSIBLE_MS), as LockInfo.from_record reads them.
_PLAUSIBLE = f"""
local function plausible(n, max)
  return n ~= nil and n >= 0 and n <= max
end
local plausible_max = {{{MAX_FENCING_TOKEN}, {MAX_PLAUSIBLE_MS}, {MAX_PLAUSIBLE_MS}}}
"""
_FLAG_ARG = """
local function flag_arg(i, what)
  if ARGV[i] ~= '0' and ARGV[i] ~= '1' then
    error({err = 'ERR django-setnx: ' .. what .. ' (ARGV[' .. i .. ']) must be 0 or 1, ' ..
      'got ' .. (ARGV[i] or '')})
  end
  return ARGV[i] == '1'
end
"""

# Fencing tokens: a hybrid clock. A new token is Redis' clock in µs, or the last
# token of the name plus one if that is larger (two acquisitions within one µs, or a
# clock that stepped back). ``last`` is kept only while the name has a key: the lock
# record while it exists, then ``P:{N}:fence`` for FENCING_RETENTION after a release
# or a removal (retire()). So nothing per name outlives its last use by more than
# that, and tokens keep increasing as long as Redis' clock does not step back by more
# than FENCING_RETENTION (see the module docstring).
_FENCING = f"""
local function next_token(last)  -- nil when no larger token fits in 53 bits
  last = tonumber(last)
  local fencing = us
  if last and last >= us and last == last then  -- (last ~= last: NaN, unreadable)
    fencing = last + 1
  end
  if fencing > {MAX_FENCING_TOKEN} then
    return nil
  end
  return fencing
end
local function mint(last)
  local fencing = next_token(last)
  if not fencing then
    -- No larger token fits in 53 bits (Lua's doubles would repeat 2^53): refuse,
    -- before the caller's script writes anything that depends on it (review r158).
    error({{err = 'ERR django-setnx: fencing tokens exhausted: the next one of ' ..
      KEYS[1] .. ' would be past 2^53 - 1 (a remembered token written by hand, or ' ..
      'a server clock set centuries ahead). Delete ' .. KEYS[1] .. ' and ' .. KEYS[2] ..
      ' once nothing relies on its tokens'}})
  end
  return fencing
end
local function retire(fencing, fence_ms)
  redis.call('DEL', KEYS[1])
  if tonumber(fencing) then
    redis.call('SET', KEYS[2], fencing, 'PX', fence_ms)
  end
end
"""


# Of a record's fencing token and an optional larger one from the caller (Redlock:
# the largest of its masters'), the one to remember when the record goes.
_LAST = """
local function last_of(fencing, floor)
  fencing, floor = tonumber(fencing), tonumber(floor)
  if floor and (not fencing or floor > fencing) then
    return floor
  end
  return fencing
end
"""


#: Longest a waiter stays queued without retrying. A live waiter re-registers on
#: every refused attempt, at least every ``WAIT_BLOCK`` (0.9) seconds, so it never
#: lapses (one paused longer only loses its place: it queues again at the back); a
#: waiter that died lapses within this, and a release never hands the lock to it
#: afterwards. Before that, a release may hand it the lock as a claim, which costs
#: the live waiters up to about WAIT_BLOCK each time: so waiters killed together
#: cost them at most about WAITER_MS + WAIT_BLOCK in all.
WAITER_MS = 1500
#: A lock handed to a waiter is first written for this long only (a *claim*): the
#: waiter confirms it with its next ACQUIRE, which writes its whole ttl. A waiter that
#: died while queued (SIGKILL, a gunicorn worker timeout) never confirms, so it holds
#: the others up for about this long (see redis.WAIT_BLOCK), not for the ttl it asked
#: for.
CLAIM_MS = 500

# Handing a free lock to the longest-waiting live waiter, shared by every script
# that frees a held lock (release, force-release, clear, a waiter giving up).
#
# KEYS[1..4]: lock, fence, waiters, requests. The waiters sorted set holds the tokens
# of refused callers that will retry, scored by when they were first refused (FIFO);
# the requests hash maps each to "<deadline_ms> <ttl_ms> <owner_json>". The lock
# record says ``queued`` once a caller queued up, so the common release of a lock
# nobody waited for skips this. The winner is told through its own inbox list,
# P:{N}:inbox:<token>, which it BLPOPs: the fencing token arrives there, so the
# waiter returns holding the lock without another round trip. The inbox key is built
# here rather than passed in KEYS because only the script knows which waiter wins;
# it shares the {N} hash tag, so it lives in the same Cluster slot as the declared
# keys.
#
# grant(last, retention_ms, signal_ms) hands the lock to the next live waiter, with a
# token minted after ``last`` (the token of the record it replaces); returns true if
# it did, false (nothing written) if nobody is waiting.
#
# The waiter gets a *claim*: the record expires after CLAIM_MS (or its ttl, if
# shorter) and keeps the ttl it asked for in ``claim``; its next ACQUIRE (or
# STOP_WAITING) under its token confirms it, writing now + ttl. A waiter that died
# while queued never confirms, so the lock is free again after CLAIM_MS. Nobody else
# is woken: every waiter retries within WAIT_BLOCK anyway (redis._block_timeout), and
# a retry that finds a claim waits for its end. Waking the next waiter in line at
# every handoff, as this once did, cost a process wake-up per handoff for the rare
# dead waiter.
_GRANT = f"""
local function notify(waiter, message, signal_ms)
  local inbox = string.sub(KEYS[1], 1, -5) .. 'inbox:' .. waiter
  redis.call('RPUSH', inbox, message)
  redis.call('PEXPIRE', inbox, signal_ms)
end
local function grant(last, retention_ms, signal_ms)
  -- Minted before anything is popped: with the name's tokens exhausted nobody gets
  -- the lock (the caller retires it, and each waiter hears of it at its next
  -- ACQUIRE), and the release still goes through (review r160).
  local fencing = next_token(last)
  if not fencing then
    return false
  end
  while true do
    local head = redis.call('ZPOPMIN', KEYS[3])
    if #head == 0 then
      return false
    end
    local waiter = head[1]
    local request = redis.call('HGET', KEYS[4], waiter)
    redis.call('HDEL', KEYS[4], waiter)
    if request then
      local deadline, ttl, owner = string.match(request, '^(%d+) (%d+) (.*)$')
      if deadline and tonumber(deadline) >= now then
        ttl = tonumber(ttl)
        local claim = math.min(ttl, {CLAIM_MS})
        redis.call('DEL', KEYS[1])
        redis.call('HSET', KEYS[1], 'token', waiter, 'fencing', fencing, 'owner', owner,
                   'acquired', now, 'expires', now + claim, 'claim', ttl)
        local next_in_line = redis.call('ZRANGE', KEYS[3], 0, 0)
        if next_in_line[1] then
          redis.call('HSET', KEYS[1], 'queued', 1)  -- the next release hands it on
        end
        redis.call('PEXPIRE', KEYS[1], claim + retention_ms)
        notify(waiter, fencing, signal_ms)
        return true
      end
    end
    -- A lapsed waiter (gave up or died): skip it.
  end
end
"""

# KEYS: lock, fence, waiters, requests.
# ARGV: token, ttl_ms, owner_json, retention_ms, wait_ms (-1: the caller waits
#       indefinitely, 0: it will not retry, n: it retries for n ms).
# Returns {1, fencing} when written, {0, ms until the holder's expiry} when not.
ACQUIRE = (
    _WHOLE
    + _MS_ARG
    + """
local ttl = ms_arg(2, 'ttl_ms', 1)
local retention = ms_arg(4, 'retention_ms', 0)
local wait = ms_arg(5, 'wait_ms', -1)
"""
    + _NOW
    + _FENCING
    + f"""
local held = redis.pcall('HMGET', KEYS[1], 'token', 'expires', 'fencing', 'queued', 'claim')
if held.err then
  -- Not a hash (written by hand): an unreadable record, taken over like a stale one.
  redis.call('DEL', KEYS[1])
  held = {{}}
end
local expires = whole(held[2])
if held[1] == ARGV[1] and expires and expires > now then
  -- Already ours under this token: handed to us by a release (a claim, confirmed
  -- here with our whole ttl), or the same caller trying again after an error. Ours
  -- but expired (a claim confirmed too late) is taken over below like any stale
  -- record, with a new fencing token: never reported as held since.
  if held[5] then
    redis.call('HSET', KEYS[1], 'expires', now + ttl)
    redis.call('HDEL', KEYS[1], 'claim')
    redis.call('PEXPIRE', KEYS[1], ttl + retention)
  end
  return {{1, tonumber(held[3])}}
end
if expires and expires > now then
  -- Held. A caller that will retry queues up (keeping its place on a re-try).
  if wait ~= 0 then
    if wait < 0 or wait > {WAITER_MS} then wait = {WAITER_MS} end
    redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1])
    redis.call('HSET', KEYS[4], ARGV[1], (now + wait) .. ' ' .. ttl .. ' ' .. ARGV[3])
    redis.call('PEXPIRE', KEYS[3], {WAITER_MS})
    redis.call('PEXPIRE', KEYS[4], {WAITER_MS})
    if not held[4] then
      redis.call('HSET', KEYS[1], 'queued', 1)
    end
  end
  return {{0, expires - now}}
end
-- Absent, stale (a holder that never released) or unreadable: take it over in this
-- same atomic step. Releases hand the lock straight to waiters, so a free lock with
-- waiters only follows an expiry; the first to retry wins it, queued or not.
local last = held[3]
if not held[1] then
  last = redis.call('GET', KEYS[2])
end
local fencing = mint(last)  -- before any write: it may refuse (exhausted tokens)
local queued = false
if held[1] then
  if held[4] then
    redis.call('ZREM', KEYS[3], ARGV[1])
    redis.call('HDEL', KEYS[4], ARGV[1])
    queued = redis.call('EXISTS', KEYS[3]) == 1
  end
  redis.call('DEL', KEYS[1])  -- no field of the old record survives
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fencing', fencing, 'owner', ARGV[3],
           'acquired', now, 'expires', now + ttl)
if queued then
  redis.call('HSET', KEYS[1], 'queued', 1)
end
redis.call('PEXPIRE', KEYS[1], ttl + retention)
return {{1, fencing}}
"""
)

# KEYS: lock, fence, waiters, requests. ARGV: token, retention_ms, signal_ms, fence_ms,
# and optionally the holder's fencing token if it may be larger than this record's
# (Redlock: the largest of its masters' tokens), remembered instead.
# Returns 1 if released (or handed to a waiter), 0 if not ours. An expired record
# still carrying our token is ours: nobody else held it since.
RELEASE = (
    _MS_ARG
    + _LAST
    + """
local retention = ms_arg(2, 'retention_ms', 0)
local signal = ms_arg(3, 'signal_ms', 1)
local fence = ms_arg(4, 'fence_ms', 1)
local held = redis.pcall('HMGET', KEYS[1], 'token', 'fencing', 'queued')
if held.err or held[1] ~= ARGV[1] then
  return 0
end
local last = last_of(held[2], ARGV[5])
if not held[3] then
  -- Nobody queued while it was held: the common, uncontended release.
  redis.call('DEL', KEYS[1])
  if last then
    redis.call('SET', KEYS[2], last, 'PX', fence)
  end
  return 1
end
"""
    + _NOW
    + _FENCING
    + _GRANT
    + """
if not grant(last, retention, signal) then
  retire(last, fence)
end
return 1
"""
)

# KEYS: lock, fence, waiters, requests, inbox. ARGV: token, retention_ms, signal_ms,
# fence_ms. A queued caller gives up: withdraw it. If a release handed it the lock
# meanwhile, returns {1, fencing} (it holds the lock: the caller keeps it); else
# {0, 0}. A handed lock that already expired unused is passed on instead.
STOP_WAITING = (
    _WHOLE
    + _MS_ARG
    + """
local retention = ms_arg(2, 'retention_ms', 0)
local signal = ms_arg(3, 'signal_ms', 1)
local fence = ms_arg(4, 'fence_ms', 1)
"""
    + _NOW
    + _FENCING
    + _GRANT
    + """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('DEL', KEYS[5])
local held = redis.call('HMGET', KEYS[1], 'token', 'expires', 'fencing', 'claim')
if held[1] ~= ARGV[1] then
  return {0, 0}
end
local expires = whole(held[2])
if expires and expires > now then
  local ttl = whole(held[4])
  if ttl then  -- a claim: the caller keeps the lock, so confirm it with its ttl
    redis.call('HSET', KEYS[1], 'expires', now + ttl)
    redis.call('HDEL', KEYS[1], 'claim')
    redis.call('PEXPIRE', KEYS[1], ttl + retention)
  end
  return {1, tonumber(held[3])}
end
if not grant(held[3], retention, signal) then
  retire(held[3], fence)
end
return {0, 0}
"""
)

# KEYS: lock. ARGV: token, ttl_ms, retention_ms, and optionally the holder's fencing
# token, recorded if larger than the record's (Redlock: the largest of its masters').
# Returns 1 if extended, 0 if not ours.
EXTEND = (
    _MS_ARG
    + _LAST
    + """
local ttl = ms_arg(2, 'ttl_ms', 1)
local retention = ms_arg(3, 'retention_ms', 0)
local held = redis.pcall('HMGET', KEYS[1], 'token', 'fencing')
if held.err or held[1] ~= ARGV[1] then
  return 0
end
"""
    + _NOW
    + """
redis.call('HSET', KEYS[1], 'expires', now + ttl, 'fencing', last_of(held[2], ARGV[4]))
redis.call('PEXPIRE', KEYS[1], ttl + retention)
return 1
"""
)

# KEYS: lock. ARGV: token. Returns 1 if held (not expired) under token, else 0.
OWNS = (
    _WHOLE
    + """
local held = redis.pcall('HMGET', KEYS[1], 'token', 'expires')
if held.err or held[1] ~= ARGV[1] then
  return 0
end
"""
    + _NOW
    + """
local expires = whole(held[2])
if expires and expires > now then
  return 1
end
return 0
"""
)

# KEYS: lock. Returns {now, {field, value, ...}} ({} when there is no record; a key
# that is not a hash gives {'error', <its type>}, read as an unreadable record).
_FIELDS = """
local function fields_of(key)
  local fields = redis.pcall('HGETALL', key)
  if fields.err then
    return {'error', 'WRONGTYPE: a ' .. redis.call('TYPE', key).ok .. ', not a hash'}
  end
  return fields
end
"""
GET = (
    _NOW
    + _FIELDS
    + """
return {now, fields_of(KEYS[1])}
"""
)

# KEYS: lock, fence, waiters, requests. ARGV: retention_ms, signal_ms, fence_ms,
# optionally a fencing token to remember if larger than the record's (as RELEASE, ''
# for none), and optionally the fencing token the record must carry ('' for any; 0
# for a record without a readable one).
# Force-release whoever holds it; a queued waiter gets it next. The removed record's
# fencing token is remembered, so the next holder's is larger.
# Returns {now, {field, value, ...}} of the removed record ({} when none was removed).
DELETE = (
    _MS_ARG
    + _LAST
    + _FIELDS
    + _WHOLE
    + _PLAUSIBLE
    + """
local retention = ms_arg(1, 'retention_ms', 0)
local signal = ms_arg(2, 'signal_ms', 1)
local fence = ms_arg(3, 'fence_ms', 1)
"""
    + _NOW
    + _FENCING
    + _GRANT
    + """
local fields = fields_of(KEYS[1])
if #fields > 0 and ARGV[5] and ARGV[5] ~= '' then
  -- The fencing token LockInfo.from_record reads: 0 unless the token and the three
  -- numbers are there, and plausible.
  local f = redis.pcall('HMGET', KEYS[1], 'token', 'fencing', 'acquired', 'expires', 'owner')
  local shown = 0
  if not f.err and f[1] then
    local readable = true
    for i = 2, 4 do
      readable = readable and plausible(whole(f[i]), plausible_max[i - 1])
    end
    -- The owner must be a JSON object (cjson reads "[]" as one too: such an owner,
    -- written by hand, is not matched by the fencing token 0 its listing shows).
    local ok, owner = true, {}
    if f[5] and f[5] ~= '' then
      ok, owner = pcall(cjson.decode, f[5])
    end
    if readable and ok and type(owner) == 'table' and owner[1] == nil then
      shown = whole(f[2])
    end
  end
  if shown ~= tonumber(ARGV[5]) then
    return {now, {}}
  end
end
if #fields > 0 then
  local last = last_of(redis.pcall('HGET', KEYS[1], 'fencing'), ARGV[4])
  if not grant(last, retention, signal) then
    retire(last, fence)
  end
end
return {now, fields}
"""
)

# KEYS: lock, fence, waiters, requests.
# ARGV: include_held (0/1), retention_ms, signal_ms, older_than_ms ('' = any),
#       dry_run (0/1), fence_ms, and optionally a fencing token (as DELETE).
# Re-checks at removal time what SCAN found, so a lock re-acquired in between is kept.
# A removed held lock goes to a queued waiter, as on release. A record without a
# readable ``expires`` blocks nobody (ACQUIRE takes it over), so it counts as stale;
# one without a readable ``acquired`` has no known age and is not kept by older_than.
# Returns 1 if removed (or removable, on a dry run), else 0.
CLEAR = (
    _WHOLE
    + _MS_ARG
    + _FLAG_ARG
    + _LAST
    + """
local include_held = flag_arg(1, 'include_held')
local retention = ms_arg(2, 'retention_ms', 0)
local signal = ms_arg(3, 'signal_ms', 1)
local older_than = nil
if ARGV[4] ~= '' then
  older_than = ms_arg(4, 'older_than_ms', 0)
end
local dry_run = flag_arg(5, 'dry_run')
local fence = ms_arg(6, 'fence_ms', 1)
"""
    + _NOW
    + _FENCING
    + _GRANT
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local f = redis.pcall('HMGET', KEYS[1], 'acquired', 'expires', 'fencing')
if f.err then
  f = {}  -- not a hash (written by hand): unreadable, so stale
end
local acquired, expires = whole(f[1]), whole(f[2])
local held = expires ~= nil and expires > now
if held and not include_held then
  return 0
end
if older_than and acquired and acquired > now - older_than then
  return 0
end
if not dry_run then
  local last = last_of(f[3], ARGV[7])
  if not (held and grant(last, retention, signal)) then
    retire(last, fence)
  end
end
return 1
"""
)


# KEYS: the lock keys of one SCAN batch (on one server; on a Cluster, where one script
# cannot take keys of several slots, the backend asks key by key instead).
# ARGV: '1' for held, '0' for stale. Returns the keys in that state, by Redis' clock,
# as every script judges a lock (by ``expires`` alone) and LockInfo.from_record shows
# it: held while ``expires`` is a plausible time ahead; a key of another type is stale.
FILTER_BY_STATE = (
    _NOW
    + _WHOLE
    + (
        """
local want_held = ARGV[1] == '1'
local out = {}
for _, key in ipairs(KEYS) do
  local expires = redis.pcall('HGET', key, 'expires')
  if type(expires) == 'table' then
    expires = nil  -- not a hash: unreadable, stale
  else
    expires = whole(expires)
  end
  if (expires ~= nil and expires > now and expires <= MAX_PLAUSIBLE_MS) == want_held then
    out[#out + 1] = key
  end
end
return out
"""
    ).replace("MAX_PLAUSIBLE_MS", str(MAX_PLAUSIBLE_MS))
)
