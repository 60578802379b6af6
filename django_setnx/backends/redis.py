"""Redis backend: one Lua script per operation, expiry judged by Redis' own clock.

Settings::

    "redis": {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        "LOCATION": "redis://127.0.0.1:6379/0",  # or OPTIONS["CACHE"]
        "KEY_PREFIX": "setnx",
        "TTL": 60,
        "OPTIONS": {
            "CACHE": None,              # alias of a django-redis cache to share its connection
            "CONNECTION_KWARGS": {},    # passed to the client factory with LOCATION
            "CLIENT_CLASS": "redis.Redis.from_url",  # dotted path: (location, **kw) -> client;
                # django_setnx.backends.clients.sentinel / .cluster for Sentinel / Cluster
            "STALE_RETENTION": 86400,   # seconds an expired record stays visible as stale
            "WAKE_TTL": 1,              # seconds a handed-over lock's signal waits for its waiter
        },
    }

Requires Redis >= 6.0 (float ``BLPOP`` timeouts, ``SCAN ... TYPE``).

Key layout, for a lock named ``N`` under prefix ``P``:

- ``P:{N}:lock`` -- a hash: ``token``, ``fencing``, ``owner`` (JSON), ``acquired`` and
  ``expires`` (ms, Redis clock). Its Redis TTL is the lock's ttl plus
  ``STALE_RETENTION``: a holder that crashes leaves a record that is *stale* (expired
  but visible to the admin and ``listlocks``) until ``clearlocks`` or Redis removes it.
  Whether a lock is held is decided by the ``expires`` field, never by key existence.
- ``P:{N}:fence`` -- an ``INCR`` counter with no expiry that release and clear never
  touch, so fencing tokens strictly increase per name across releases and takeovers.
- ``P:{N}:waiters`` -- a sorted set of the tokens of callers that were refused and
  will retry, scored by when each was first refused, and ``P:{N}:requests`` -- a
  hash from each such token to its deadline, ttl and owner. A release that finds
  live waiters does not free the lock: in the same script it writes the lock for
  the longest-waiting one (FIFO, so nobody starves, and a client that releases and
  loops straight back to acquire queues behind the others) and pushes the new
  fencing token to that waiter's ``P:{N}:inbox:<token>`` list, which it is blocked
  on with ``BLPOP``. The waiter returns holding the lock, with no further round
  trip. A release that lands before the waiter's ``BLPOP`` is not lost (the inbox
  outlives it by ``WAKE_TTL``), and a waiter that gives up withdraws atomically,
  keeping a lock handed to it in the meantime. A waiter stays queued for
  ``WAITER_MS`` after its last attempt: one that died is skipped after that.

The ``{N}`` hash tag puts the keys of one lock in one Redis Cluster slot, so a
script may touch all of them (Cluster hashes the whole key instead when the first
``{`` is followed at once by ``}``: avoid a prefix containing ``{}`` and names that
start with ``}`` there). Names are parsed back from lock keys by stripping ``P:{``
and ``}:lock``.

Every acquire, release, extend, owns, get and delete is one round trip: a Lua script
sent with ``EVALSHA`` (redis-py falls back to ``EVAL``-by-load on ``NOSCRIPT``), which
reads the time with ``TIME`` inside Redis, so no two app servers' clocks are ever
compared. ``list`` and ``clear`` walk the prefix with ``SCAN`` (never ``KEYS``), one
pipeline per batch; on a Redis Cluster they scan every primary, node by node (each
node's batch only holds keys of its own slots, so its pipeline stays on that node).
"""

import importlib
import json
import math
import numbers
import threading

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from ..validation import ttl_to_ms
from .base import STATES, AcquireResult, BaseLockBackend, ClearResult, LockInfo

try:
    import redis
except ImportError:  # reported by check_params (E010) and on first use
    redis = None

DEFAULT_KEY_PREFIX = "setnx"
DEFAULT_STALE_RETENTION = 86400
DEFAULT_WAKE_TTL = 1
DEFAULT_CLIENT_CLASS = "redis.Redis.from_url"
OPTION_NAMES = {"CACHE", "CONNECTION_KWARGS", "CLIENT_CLASS", "STALE_RETENTION", "WAKE_TTL"}

#: Longest single BLPOP. redis-py >= 8 sets a 5 s socket timeout by default, and a
#: BLPOP that blocks as long as the socket timeout is cut short by a TimeoutError.
MAX_BLOCK = 4.0
#: Shortest BLPOP timeout: Redis' timer resolution is about a millisecond.
MIN_BLOCK = 0.005
SCAN_COUNT = 1000

# Redis' clock in ms; every script starts with it. TIME's fields are strings.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""


#: Longest a waiter stays queued without retrying. A live waiter re-registers on
#: every refused attempt, at least every ``WAIT_BLOCK`` seconds, so it never lapses;
#: a waiter that died lapses within this, and a release never hands the lock to it
#: afterwards (it could before: then the lock sits unused until its ttl ends, as
#: with a holder that crashed).
WAITER_MS = 3000
#: Longest single wait of a queued waiter before it retries (and re-registers).
WAIT_BLOCK = 1.5

# Handing a free lock to the longest-waiting live waiter, shared by every script
# that frees a held lock (release, force-release, clear, a waiter giving up).
#
# KEYS[1..4]: lock, fence, waiters, requests. The waiters sorted set holds the tokens
# of refused callers that will retry, scored by when they were first refused (FIFO);
# the requests hash maps each to "<deadline_ms> <ttl_ms> <owner_json>". The winner
# is told through its own inbox list, P:{N}:inbox:<token>, which it BLPOPs: the
# fencing token arrives there, so the waiter returns holding the lock without
# another round trip. The inbox key is built here rather than passed in KEYS because
# only the script knows which waiter wins; it shares the {N} hash tag, so it lives
# in the same Cluster slot as the declared keys.
#
# grant(now, retention_ms, signal_ms) returns true if the lock was handed over.
_GRANT = """
local function grant(now, retention_ms, signal_ms)
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
      if tonumber(deadline) >= now then
        ttl = tonumber(ttl)
        local fencing = redis.call('INCR', KEYS[2])
        redis.call('HSET', KEYS[1], 'token', waiter, 'fencing', fencing, 'owner', owner,
                   'acquired', now, 'expires', now + ttl)
        redis.call('PEXPIRE', KEYS[1], ttl + retention_ms)
        local inbox = string.sub(KEYS[1], 1, -5) .. 'inbox:' .. waiter
        redis.call('RPUSH', inbox, fencing)
        redis.call('PEXPIRE', inbox, signal_ms)
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
ACQUIRE = _NOW + f"""
local held = redis.call('HMGET', KEYS[1], 'token', 'expires', 'fencing')
if held[1] == ARGV[1] then
  -- Already ours under this token: handed to us by a release while we were not
  -- looking, or a retried call (redis-py retries on a broken connection).
  return {{1, tonumber(held[3])}}
end
local expires = tonumber(held[2])
if expires and expires > now then
  -- Held. A caller that will retry queues up (keeping its place on a re-try).
  local wait = tonumber(ARGV[5])
  if wait ~= 0 then
    if wait < 0 or wait > {WAITER_MS} then wait = {WAITER_MS} end
    redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1])
    redis.call('HSET', KEYS[4], ARGV[1], (now + wait) .. ' ' .. ARGV[2] .. ' ' .. ARGV[3])
    redis.call('PEXPIRE', KEYS[3], {WAITER_MS})
    redis.call('PEXPIRE', KEYS[4], {WAITER_MS})
  end
  return {{0, expires - now}}
end
-- Absent or stale (a holder that never released): take it over in this same
-- atomic step. Releases hand the lock straight to waiters, so a free lock with
-- waiters only follows an expiry; the first to retry wins it, queued or not.
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
end
local fencing = redis.call('INCR', KEYS[2])
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fencing', fencing, 'owner', ARGV[3],
           'acquired', now, 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[4]))
return {{1, fencing}}
"""

# KEYS: lock, fence, waiters, requests. ARGV: token, retention_ms, signal_ms.
# Returns 1 if released (or handed to a waiter), 0 if not ours. An expired record
# still carrying our token is ours: nobody else held it since.
RELEASE = _GRANT + """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
-- Every refused caller that will retry is queued, so with no waiters there is
-- nobody to hand over to: the common, uncontended release stops here.
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
""" + _NOW + """
if not grant(now, tonumber(ARGV[2]), tonumber(ARGV[3])) then
  redis.call('DEL', KEYS[1])
end
return 1
"""

# KEYS: lock, fence, waiters, requests, inbox. ARGV: token, retention_ms, signal_ms.
# A queued caller gives up: withdraw it. If a release handed it the lock meanwhile,
# returns {1, fencing} (it holds the lock: the caller keeps it); else {0, 0}. A
# handed lock that already expired unused is passed on instead.
STOP_WAITING = _GRANT + _NOW + """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('DEL', KEYS[5])
local held = redis.call('HMGET', KEYS[1], 'token', 'expires', 'fencing')
if held[1] ~= ARGV[1] then
  return {0, 0}
end
if tonumber(held[2]) > now then
  return {1, tonumber(held[3])}
end
if not grant(now, tonumber(ARGV[2]), tonumber(ARGV[3])) then
  redis.call('DEL', KEYS[1])
end
return {0, 0}
"""

# KEYS: lock. ARGV: token, ttl_ms, retention_ms. Returns 1 if extended, 0 if not ours.
EXTEND = _NOW + """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[3]))
return 1
"""

# KEYS: lock. ARGV: token. Returns 1 if held (not expired) under token, else 0.
OWNS = _NOW + """
local held = redis.call('HMGET', KEYS[1], 'token', 'expires')
if held[1] == ARGV[1] and tonumber(held[2]) > now then
  return 1
end
return 0
"""

# KEYS: lock. Returns {now, {field, value, ...}} ({} when there is no record).
GET = _NOW + """
return {now, redis.call('HGETALL', KEYS[1])}
"""

# KEYS: lock, fence, waiters, requests. ARGV: retention_ms, signal_ms.
# Force-release whoever holds it; a queued waiter gets it next.
# Returns {now, {field, value, ...}} of the removed record ({} when there was none).
DELETE = _GRANT + _NOW + """
local fields = redis.call('HGETALL', KEYS[1])
if #fields > 0 then
  redis.call('DEL', KEYS[1])
  grant(now, tonumber(ARGV[1]), tonumber(ARGV[2]))
end
return {now, fields}
"""

# KEYS: lock, fence, waiters, requests.
# ARGV: include_held (0/1), retention_ms, signal_ms, older_than_ms ('' = any), dry_run.
# Re-checks at removal time what SCAN found, so a lock re-acquired in between is kept.
# A removed held lock goes to a queued waiter, as on release.
# Returns 1 if removed (or removable, on a dry run), else 0.
CLEAR = _GRANT + _NOW + """
local f = redis.call('HMGET', KEYS[1], 'acquired', 'expires')
local acquired, expires = tonumber(f[1]), tonumber(f[2])
if not expires then
  return 0
end
local held = expires > now
if held and ARGV[1] == '0' then
  return 0
end
if ARGV[4] ~= '' and acquired > now - tonumber(ARGV[4]) then
  return 0
end
if ARGV[5] == '0' then
  redis.call('UNLINK', KEYS[1])
  if held then
    grant(now, tonumber(ARGV[2]), tonumber(ARGV[3]))
  end
end
return 1
"""


def _text(value):
    """A reply as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


_OWNER_JSON_CACHE = {}
_OWNER_JSON_CACHE_SIZE = 1024


def _owner_json(owner):
    """``owner`` as compact JSON, cached: a thread writes the same owner record on
    every acquire, and encoding it is a measurable part of an uncontended acquire."""
    try:
        # The value types are part of the key: 1, 1.0 and True are equal, but their
        # JSON is not.
        key = (*owner.items(), *map(type, owner.values()))
        return _OWNER_JSON_CACHE[key]
    except TypeError:  # an unhashable value: encode it every time
        return json.dumps(owner, separators=(",", ":"), sort_keys=True)
    except KeyError:
        pass
    text = json.dumps(owner, separators=(",", ":"), sort_keys=True)
    if len(_OWNER_JSON_CACHE) >= _OWNER_JSON_CACHE_SIZE:
        _OWNER_JSON_CACHE.clear()  # many threads or guards: start over rather than grow
    _OWNER_JSON_CACHE[key] = text
    return text


def lock_keys(prefix, name):
    """The (lock, fence, waiters, requests) keys of ``name`` under ``prefix``, in
    the order every script takes them; the ``{name}`` hash tag keeps them in one
    Cluster slot (see the key layout above)."""
    base = f"{prefix}:{{{name}}}"
    return f"{base}:lock", f"{base}:fence", f"{base}:waiters", f"{base}:requests"


def name_from_lock_key(prefix, key):
    """The lock name in a ``P:{N}:lock`` key (``lock_keys(prefix, N)[0]``)."""
    return _text(key)[len(prefix) + 2 : -len("}:lock")]


def _escape_glob(text):
    """Escape Redis glob metacharacters so ``text`` only matches itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def import_dotted(path):
    """Import ``path`` ("pkg.module.Class.method"): the longest importable module
    prefix, then attributes. Raises ImportError naming the path."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ImportError(f"cannot import {path!r}")


def _is_positive_number(value):
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


class _Connection:
    """A client and the scripts registered on it (a script object binds its client)."""

    def __init__(self, client, owned):
        self.client = client
        self.owned = owned
        self.acquire = client.register_script(ACQUIRE)
        self.release = client.register_script(RELEASE)
        self.extend = client.register_script(EXTEND)
        self.owns = client.register_script(OWNS)
        self.get = client.register_script(GET)
        self.delete = client.register_script(DELETE)
        self.clear = client.register_script(CLEAR)
        self.stop_waiting = client.register_script(STOP_WAITING)
        # A BLPOP must return before the socket times out (see MAX_BLOCK). A client
        # without a single pool (a cluster client) keeps the MAX_BLOCK default.
        pool = getattr(client, "connection_pool", None)
        socket_timeout = pool.connection_kwargs.get("socket_timeout") if pool else None
        self.max_block = MAX_BLOCK if not socket_timeout else min(MAX_BLOCK, socket_timeout * 0.8)


def require_redis_py(alias, backend_label):
    """Raise ImproperlyConfigured naming ``alias`` unless redis-py is installed."""
    if redis is None:
        raise ImproperlyConfigured(
            f"SETNX_LOCKS[{alias!r}] uses the {backend_label} backend, but redis-py is not "
            f"installed: pip install django-setnx[redis]"
        )


class RedisBackend(BaseLockBackend):
    """Locks in Redis, via redis-py or a django-redis cache's connection."""

    wakes_waiters = True

    def __init__(self, alias, params):
        super().__init__(alias, params)
        require_redis_py(alias, "Redis")
        self.location = params.get("LOCATION")
        self.key_prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        self.cache_alias = self.options.get("CACHE")
        self.retention_ms = ttl_to_ms(self.options.get("STALE_RETENTION", DEFAULT_STALE_RETENTION))
        self.wake_ms = ttl_to_ms(self.options.get("WAKE_TTL", DEFAULT_WAKE_TTL))
        # SCAN MATCH pattern head: escaped so that a prefix such as "a*" cannot match
        # keys outside it.
        self._match_head = _escape_glob(self.key_prefix) + ":{"
        self._errors = (redis.exceptions.RedisError, OSError)
        # redis-py lets some socket errors through unwrapped, hence the builtins.
        self._network_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                                ConnectionError, TimeoutError)
        self._conn = None
        self._conn_lock = threading.Lock()

    # -- configuration ------------------------------------------------------------

    @classmethod
    def check_params(cls, alias, params):
        """Return ``checks.Error`` objects (ids ``django_setnx.E010``-``E019``) for
        this alias' settings. Imports but never connects."""
        where = f"SETNX_LOCKS[{alias!r}]"
        errors = []

        def error(id_, msg, hint=None):
            errors.append(checks.Error(msg, hint=hint, id=f"django_setnx.{id_}"))

        options = params.get("OPTIONS") or {}
        if not isinstance(options, dict):
            error("E019", f"{where}['OPTIONS'] must be a dict, got {options!r}.")
            options = {}
        if redis is None:
            error("E010", f"{where} uses the Redis backend, but redis-py is not installed.",
                  hint="pip install django-setnx[redis]")
        location = params.get("LOCATION")
        cache = options.get("CACHE")
        if location is None and cache is None:
            error("E011", f"{where} needs a LOCATION (a redis:// URL) or OPTIONS['CACHE'] "
                          f"(a django-redis cache alias).")
        elif location is not None and cache is not None:
            error("E012", f"{where} sets both LOCATION and OPTIONS['CACHE']; choose one.")
        elif location is not None and (not isinstance(location, str) or not location):
            error("E011", f"{where}['LOCATION'] must be a non-empty redis:// URL string, "
                          f"got {location!r}.")
        prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        if not isinstance(prefix, str) or not prefix:
            error("E013", f"{where}['KEY_PREFIX'] must be a non-empty str, got {prefix!r}.")
        for option, id_ in (("STALE_RETENTION", "E014"), ("WAKE_TTL", "E015")):
            if option in options and not _is_positive_number(options[option]):
                error(id_, f"{where}['OPTIONS']['{option}'] must be a positive number of "
                           f"seconds, got {options[option]!r}.")
        if cache is not None:
            from django.conf import settings

            if cache not in getattr(settings, "CACHES", {}):
                error("E016", f"{where}['OPTIONS']['CACHE'] is {cache!r}, which is not an "
                              f"alias in settings.CACHES.")
            else:
                try:
                    import django_redis  # noqa: F401
                except ImportError:
                    error("E016", f"{where}['OPTIONS']['CACHE'] needs django-redis, which is "
                                  f"not installed.", hint="pip install django-setnx[django-redis]")
        client_class = options.get("CLIENT_CLASS")
        if client_class is not None and not isinstance(client_class, str):
            error("E017", f"{where}['OPTIONS']['CLIENT_CLASS'] must be a dotted path (str), "
                          f"got {client_class!r}.")
        elif client_class is not None:
            try:
                factory = import_dotted(client_class)
            except ImportError as exc:
                error("E017", f"{where}['OPTIONS']['CLIENT_CLASS'] {client_class!r} cannot be "
                              f"imported: {exc}")
            else:
                if not callable(factory):
                    error("E017", f"{where}['OPTIONS']['CLIENT_CLASS'] {client_class!r} is not "
                                  f"callable.")
        kwargs = options.get("CONNECTION_KWARGS")
        if kwargs is not None and not isinstance(kwargs, dict):
            error("E018", f"{where}['OPTIONS']['CONNECTION_KWARGS'] must be a dict, got "
                          f"{kwargs!r}.")
        unknown = sorted(set(options) - OPTION_NAMES)
        if unknown:
            error("E019", f"{where}['OPTIONS'] has unknown keys {unknown}.",
                  hint=f"Known options: {sorted(OPTION_NAMES)}.")
        return errors

    # -- connection ---------------------------------------------------------------

    def _connect(self):
        if self.cache_alias is not None:
            from django_redis import get_redis_connection

            try:
                return _Connection(get_redis_connection(self.cache_alias), owned=False)
            except NotImplementedError as exc:
                raise ImproperlyConfigured(
                    f"SETNX_LOCKS[{self.alias!r}]['OPTIONS']['CACHE'] = {self.cache_alias!r} "
                    f"is not a django-redis cache."
                ) from exc
        factory = import_dotted(self.options.get("CLIENT_CLASS", DEFAULT_CLIENT_CLASS))
        client = factory(self.location, **self.options.get("CONNECTION_KWARGS", {}))
        return _Connection(client, owned=True)

    @property
    def connection(self):
        """The lazily created client and scripts, shared by every thread."""
        conn = self._conn
        if conn is None:
            with self._conn_lock:
                conn = self._conn
                if conn is None:
                    conn = self._conn = self._connect()
        return conn

    def close(self):
        """Disconnect our connection pool (a django-redis one is left to django-redis)."""
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is not None and conn.owned:
            conn.client.close()

    def _keys(self, name):
        return lock_keys(self.key_prefix, name)

    def _inbox_key(self, name, token):
        """The list a queued caller with ``token`` blocks on (see _GRANT)."""
        return f"{self.key_prefix}:{{{name}}}:inbox:{token}"

    def _name_from_key(self, key):
        return name_from_lock_key(self.key_prefix, key)

    def _info(self, name, fields, now):
        """A LockInfo from a hash's fields (a dict or a flat field/value list)."""
        if not isinstance(fields, dict):
            fields = dict(zip(fields[::2], fields[1::2]))
        fields = {_text(k): v for k, v in fields.items()}
        return LockInfo(
            name=name,
            backend=self.alias,
            fencing_token=int(fields["fencing"]),
            owner=json.loads(fields["owner"]),
            acquired_at_ms=int(fields["acquired"]),
            expires_at_ms=int(fields["expires"]),
            now_ms=int(now),
        )

    def _errors_as(self, action):
        return self.translate_errors(*self._errors, action=action)

    # -- the atomic operations ----------------------------------------------------

    def acquire(self, name, token, ttl, owner, wait=0.0):
        """Returns ``AcquireResult.won(fencing)`` or ``.lost(retry_after=seconds)``.

        A refused caller that will retry (``wait`` > 0 or None) is queued: a release
        hands the lock straight to the longest-waiting queued caller (see :meth:`wait`).
        """
        conn = self.connection
        wait_ms = -1 if wait is None else int(wait * 1000)
        with self._errors_as(f"acquire {name!r}"):
            try:
                won, value = conn.acquire(
                    keys=self._keys(name),
                    args=[token, ttl_to_ms(ttl), _owner_json(owner), self.retention_ms, wait_ms],
                )
            except self._network_errors:
                # The script may have run before the connection broke: undo it (withdraw
                # from the queue, release what we may hold) so no ghost lock blocks
                # others for a whole ttl, then report the failure.
                self._abandon_quietly(name, token)
                raise
        if won:
            return AcquireResult.won(value)
        return AcquireResult.lost(retry_after=value / 1000)

    def stop_waiting(self, name, token):
        """Withdraw ``token`` from the queue. Returns ``AcquireResult.won(fencing)`` if
        a release handed it the lock meanwhile (the caller holds it), else None."""
        conn = self.connection
        with self._errors_as(f"stop waiting for {name!r}"):
            granted, fencing = conn.stop_waiting(
                keys=[*self._keys(name), self._inbox_key(name, token)],
                args=[token, self.retention_ms, self.wake_ms],
            )
        return AcquireResult.won(fencing) if granted else None

    def _abandon_quietly(self, name, token):
        """Best effort, after an error: leave the queue and release whatever we hold."""
        try:
            self.stop_waiting(name, token)
            self._release(self.connection, name, token)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass

    def _release(self, conn, name, token):
        return bool(conn.release(keys=self._keys(name),
                                 args=[token, self.retention_ms, self.wake_ms]))

    def release(self, name, token):
        """Returns True if the record carried ``token`` and was deleted (or handed to
        the longest-waiting queued caller)."""
        conn = self.connection
        with self._errors_as(f"release {name!r}"):
            return self._release(conn, name, token)

    def extend(self, name, token, ttl):
        """Returns True if the record carried ``token`` and now expires at now + ttl."""
        conn = self.connection
        lock_key = self._keys(name)[0]
        with self._errors_as(f"extend {name!r}"):
            return bool(conn.extend(keys=[lock_key],
                                    args=[token, ttl_to_ms(ttl), self.retention_ms]))

    def owns(self, name, token):
        """Returns True if ``name`` is held, not expired, under ``token``."""
        conn = self.connection
        with self._errors_as(f"check {name!r}"):
            return bool(conn.owns(keys=[self._keys(name)[0]], args=[token]))

    def get(self, name):
        """Returns the LockInfo of ``name`` (held or stale), or None."""
        conn = self.connection
        with self._errors_as(f"get {name!r}"):
            now, fields = conn.get(keys=[self._keys(name)[0]])
        return self._info(name, fields, now) if fields else None

    def delete(self, name):
        """Force-release ``name`` (a queued waiter gets it next). Returns the removed
        LockInfo or None."""
        conn = self.connection
        with self._errors_as(f"delete {name!r}"):
            now, fields = conn.delete(keys=self._keys(name), args=[self.retention_ms, self.wake_ms])
        return self._info(name, fields, now) if fields else None

    # -- listing and clearing -----------------------------------------------------

    def _scan_clients(self, conn):
        """Plain clients on every server that holds keys: the client itself, or one
        per primary of a Redis Cluster (SCAN and pipelines then run node by node, and
        every key a node's SCAN returns lives in a slot of that node)."""
        get_primaries = getattr(conn.client, "get_primaries", None)
        if get_primaries is None:
            return [conn.client]
        return [node.redis_connection for node in get_primaries()]

    def _scan_batches(self, client, name_glob):
        """Yield lists of lock keys matching ``name_glob`` on ``client`` (one server),
        one SCAN batch at a time."""
        match = f"{self._match_head}{name_glob or '*'}}}:lock"
        cursor = 0
        while True:
            cursor, keys = client.scan(cursor, match=match, count=SCAN_COUNT, _type="hash")
            if keys:
                yield keys
            if int(cursor) == 0:
                return

    def _scan_all(self, conn, name_glob):
        """Yield ``(client, keys)`` SCAN batches of every server (see _scan_clients)."""
        for client in self._scan_clients(conn):
            for keys in self._scan_batches(client, name_glob):
                yield client, keys

    def list(self, *, state=None, name_glob=None):
        """Yield a LockInfo per record (held and stale), one SCAN batch at a time.

        Unsorted; SCAN may, rarely, return a key twice (while Redis rehashes).
        Raises ValueError for an unknown ``state``.
        """
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        return self._iter_infos(state, name_glob)

    def _iter_infos(self, state, name_glob):
        conn = self.connection
        with self._errors_as("list"):
            for client, keys in self._scan_all(conn, name_glob):
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.hgetall(key)
                pipe.time()
                *records, (seconds, micros) = pipe.execute()
                now = int(seconds) * 1000 + int(micros) // 1000
                for key, fields in zip(keys, records):
                    if not fields:  # released between SCAN and HGETALL
                        continue
                    info = self._info(self._name_from_key(key), fields, now)
                    if state is None or info.state == state:
                        yield info

    def clear(self, *, include_held=False, name_glob=None, older_than=None, dry_run=False,
              progress=None):
        """Remove stale records (held ones too with ``include_held``) and return a
        ClearResult. Each key is re-checked atomically by a script at removal time;
        ``:fence`` keys and keys outside the prefix are never touched."""
        conn = self.connection
        result = ClearResult(self.alias)
        older_than_ms = "" if older_than is None else int(older_than * 1000)
        args = [int(bool(include_held)), self.retention_ms, self.wake_ms, older_than_ms,
                int(bool(dry_run))]
        with self._errors_as("clear"):
            for client, keys in self._scan_all(conn, name_glob):
                # One script call per key, pipelined: each is atomic, and per-key calls
                # keep each script's keys in one Cluster slot (of the node scanned).
                pipe = client.pipeline(transaction=False)
                names = [self._name_from_key(key) for key in keys]
                for name in names:
                    conn.clear(keys=self._keys(name), args=args, client=pipe)
                removed = [name for name, done in zip(names, pipe.execute()) if done]
                if removed:
                    result.names.extend(removed)
                    if progress is not None:
                        progress(removed)
        return result

    # -- waiting ------------------------------------------------------------------

    def wait(self, name, *, token, attempt, max_wait, retry_after):
        """Block on ``token``'s inbox until a release hands it the lock, the holder's
        expiry, ``max_wait`` or ``WAIT_BLOCK`` (then the caller retries, which keeps
        it queued). Returns ``AcquireResult.won(fencing)`` when handed the lock."""
        conn = self.connection
        timeout = min(WAIT_BLOCK, conn.max_block)
        if retry_after is not None:
            timeout = min(timeout, max(retry_after, 0) + 0.001)
        if max_wait is not None:
            timeout = min(timeout, max_wait)
        if timeout <= 0:
            return None
        with self._errors_as(f"wait for {name!r}"):
            reply = conn.client.blpop([self._inbox_key(name, token)],
                                      timeout=max(timeout, MIN_BLOCK))
        return None if reply is None else AcquireResult.won(int(reply[1]))
