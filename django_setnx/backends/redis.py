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
            "WAKE_TTL": 1,              # seconds a release's wake signal waits for a waiter
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
- ``P:{N}:wake`` -- a short-lived list; a release pushes one element and waiters
  ``BLPOP`` it, so one release wakes one waiter (no thundering herd), and a release
  that happens between a waiter's failed acquire and its ``BLPOP`` is not lost.
- ``P:{N}:waiters`` -- a sorted set of the tokens of callers that were refused and
  will retry, scored by when they stop waiting; ``P:{N}:handoff`` -- set for
  ``HANDOFF_MS`` by a release that left live waiters. While it exists only a
  registered waiter may take the lock, so a client that releases and loops straight
  back to acquire cannot starve the waiter it just woke (fair, FIFO by ``BLPOP``
  order). It only decides *who* gets a free lock first, never whether two can hold it.

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


def _wake(wake_ms):
    """Lua that wakes exactly one waiter blocked on the wake list KEYS[2].

    The list holds at most one element (DEL before RPUSH), which outlives the release
    by ``wake_ms`` so that a waiter which BLPOPs a moment later still sees it.
    """
    return f"""
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], 1)
redis.call('PEXPIRE', KEYS[2], {wake_ms})
"""


#: How long a release with live waiters reserves the lock for them: newcomers are
#: refused meanwhile, so a client that releases and loops straight back to acquire
#: cannot starve the waiter it just woke. Only fairness rides on it, never safety.
HANDOFF_MS = 50
#: Longest a waiter stays registered without retrying (it re-registers on every
#: refused attempt, at least every MAX_BLOCK seconds).
WAITER_MS = 5000

# KEYS: lock, fence, waiters, handoff.
# ARGV: token, ttl_ms, owner_json, retention_ms, wait_ms (-1: the caller waits
#       indefinitely, 0: it will not retry, n: it retries for n ms).
# Returns {1, fencing} when written, {0, ms worth waiting before retrying} when not.
ACQUIRE = _NOW + f"""
local held = redis.call('HMGET', KEYS[1], 'token', 'expires', 'fencing')
if held[1] == ARGV[1] then
  -- Already ours under this token: a retried call (redis-py retries on a broken
  -- connection) must report the win, not contend with itself.
  return {{1, tonumber(held[3])}}
end
local function refuse(retry_ms)
  -- A caller that will retry joins the waiters, scored by when it stops waiting.
  local wait = tonumber(ARGV[5])
  if wait ~= 0 then
    if wait < 0 or wait > {WAITER_MS} then wait = {WAITER_MS} end
    redis.call('ZADD', KEYS[3], now + wait + {HANDOFF_MS}, ARGV[1])
    redis.call('PEXPIRE', KEYS[3], {WAITER_MS + HANDOFF_MS})
  end
  return {{0, retry_ms}}
end
local expires = tonumber(held[2])
if expires and expires > now then
  return refuse(expires - now)
end
-- Absent or stale. Just released to waiters? Then only a waiter may take it.
local reserved = redis.call('PTTL', KEYS[4])
if reserved > 0 and not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  return refuse(reserved)
end
-- Take it over in this same atomic step.
redis.call('ZREM', KEYS[3], ARGV[1])
if reserved > 0 then
  redis.call('DEL', KEYS[4])
end
local fencing = redis.call('INCR', KEYS[2])
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fencing', fencing, 'owner', ARGV[3],
           'acquired', now, 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[4]))
return {{1, fencing}}
"""

# KEYS: lock, wake, waiters, handoff. ARGV: token, wake_ms.
# Returns 1 if released, 0 if not ours. An expired record still carrying our token
# is ours: nobody else held it since.
RELEASE = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
-- Every refused caller that will retry registered itself as a waiter, so with no
-- waiters there is nobody to wake: the common, uncontended release stops here.
if redis.call('EXISTS', KEYS[3]) == 0 then
  return 1
end
""" + _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZCARD', KEYS[3]) == 0 then
  return 1
end
redis.call('SET', KEYS[4], 1, 'PX', """ + str(HANDOFF_MS) + """)
""" + _wake("ARGV[2]") + """
return 1
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

# KEYS: lock, wake. ARGV: wake_ms. Force-release whoever holds it.
# Returns {now, {field, value, ...}} of the removed record ({} when there was none).
DELETE = _NOW + """
local fields = redis.call('HGETALL', KEYS[1])
if #fields > 0 then
  redis.call('DEL', KEYS[1])
""" + _wake("ARGV[1]") + """
end
return {now, fields}
"""

# KEYS: lock, wake. ARGV: include_held (0/1), wake_ms, older_than_ms ('' = any), dry_run.
# Re-checks at removal time what SCAN found, so a lock re-acquired in between is kept.
# Returns 1 if removed (or removable, on a dry run), else 0.
CLEAR = _NOW + """
local f = redis.call('HMGET', KEYS[1], 'acquired', 'expires')
local acquired, expires = tonumber(f[1]), tonumber(f[2])
if not expires then
  return 0
end
local held = expires > now
if held and ARGV[1] == '0' then
  return 0
end
if ARGV[3] ~= '' and acquired > now - tonumber(ARGV[3]) then
  return 0
end
if ARGV[4] == '0' then
  redis.call('UNLINK', KEYS[1])
  if held then
""" + _wake("ARGV[2]") + """
  end
end
return 1
"""


def _text(value):
    """A reply as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


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
        """The (lock, fence, wake) keys of ``name``; they share one hash slot."""
        base = f"{self.key_prefix}:{{{name}}}"
        return f"{base}:lock", f"{base}:fence", f"{base}:wake"

    def _queue_keys(self, name):
        """The (waiters, handoff) keys of ``name``, in the same hash slot."""
        base = f"{self.key_prefix}:{{{name}}}"
        return f"{base}:waiters", f"{base}:handoff"

    def _name_from_key(self, key):
        return _text(key)[len(self.key_prefix) + 2 : -len("}:lock")]

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

        A refused caller that will retry (``wait`` > 0 or None) is registered as a
        waiter; a release with live waiters reserves the lock for them briefly.
        """
        conn = self.connection
        lock_key, fence_key, _ = self._keys(name)
        waiters_key, handoff_key = self._queue_keys(name)
        owner_json = json.dumps(owner, separators=(",", ":"), sort_keys=True)
        wait_ms = -1 if wait is None else int(wait * 1000)
        with self._errors_as(f"acquire {name!r}"):
            try:
                won, value = conn.acquire(
                    keys=[lock_key, fence_key, waiters_key, handoff_key],
                    args=[token, ttl_to_ms(ttl), owner_json, self.retention_ms, wait_ms],
                )
            except self._network_errors:
                # The script may have run before the connection broke: undo it so no
                # ghost lock blocks others for a whole ttl, then report the failure.
                self._release_quietly(name, token)
                raise
        if won:
            return AcquireResult.won(value)
        return AcquireResult.lost(retry_after=value / 1000)

    def stop_waiting(self, name, token):
        """Forget ``token`` as a waiter (it timed out), so it holds no handoff back."""
        waiters_key, _ = self._queue_keys(name)
        with self._errors_as(f"stop waiting for {name!r}"):
            self.connection.client.zrem(waiters_key, token)

    def _release_quietly(self, name, token):
        try:
            self._release(self.connection, name, token)
        except self._errors:
            pass

    def _release(self, conn, name, token):
        lock_key, _, wake_key = self._keys(name)
        waiters_key, handoff_key = self._queue_keys(name)
        return bool(conn.release(keys=[lock_key, wake_key, waiters_key, handoff_key],
                                 args=[token, self.wake_ms]))

    def release(self, name, token):
        """Returns True if the record carried ``token`` and was deleted."""
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
        """Force-release ``name`` and wake a waiter. Returns the removed LockInfo or None."""
        conn = self.connection
        lock_key, _, wake_key = self._keys(name)
        with self._errors_as(f"delete {name!r}"):
            now, fields = conn.delete(keys=[lock_key, wake_key], args=[self.wake_ms])
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
        args = [int(bool(include_held)), self.wake_ms, older_than_ms, int(bool(dry_run))]
        with self._errors_as("clear"):
            for client, keys in self._scan_all(conn, name_glob):
                # One script call per key, pipelined: each is atomic, and per-key calls
                # keep each script's keys in one Cluster slot (of the node scanned).
                pipe = client.pipeline(transaction=False)
                names = [self._name_from_key(key) for key in keys]
                for name in names:
                    lock_key, _, wake_key = self._keys(name)
                    conn.clear(keys=[lock_key, wake_key], args=args, client=pipe)
                removed = [name for name, done in zip(names, pipe.execute()) if done]
                if removed:
                    result.names.extend(removed)
                    if progress is not None:
                        progress(removed)
        return result

    # -- waiting ------------------------------------------------------------------

    def wait(self, name, *, attempt, max_wait, retry_after):
        """Block on the wake list until a release, the holder's expiry or ``max_wait``."""
        conn = self.connection
        timeout = conn.max_block
        if retry_after is not None:
            timeout = min(timeout, max(retry_after, 0) + 0.001)
        if max_wait is not None:
            timeout = min(timeout, max_wait)
        if timeout <= 0:
            return
        with self._errors_as(f"wait for {name!r}"):
            conn.client.blpop([self._keys(name)[2]], timeout=max(timeout, MIN_BLOCK))
