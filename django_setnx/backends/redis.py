"""Redis backend: one Lua script per operation, expiry judged by Redis' own clock.

Settings::

    "redis": {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        "LOCATION": "redis://127.0.0.1:6379/0",  # or OPTIONS["CACHE"]
        "KEY_PREFIX": "setnx",
        "TTL": 60,
        "OPTIONS": {
            "CACHE": None,              # alias of a django-redis cache whose connection to share
            "CONNECTION_KWARGS": {},    # passed to the client factory with LOCATION
            "CLIENT_CLASS": "redis.Redis.from_url",  # dotted path: (location, **kw) -> client;
                # django_setnx.backends.clients.sentinel / .cluster for Sentinel / Cluster
            "STALE_RETENTION": 86400,   # seconds an expired record stays visible as stale
            "WAKE_TTL": 1,              # seconds a handed-over lock's signal waits for its waiter
            "FENCING_RETENTION": 60,    # seconds a released lock's fencing token is remembered
            "ALLOW_EVICTION": False,    # True: accept a server whose maxmemory-policy may evict
        },
    }

Requires Redis >= 6.0 (float ``BLPOP`` timeouts, ``SCAN ... TYPE``).

Key layout, for a lock named ``N`` under prefix ``P``:

- ``P:{N}:lock`` -- a hash: ``token``, ``fencing``, ``owner`` (JSON), ``acquired`` and
  ``expires`` (ms, Redis clock). Its Redis TTL is the lock's ttl plus
  ``STALE_RETENTION``: a holder that crashes leaves a record that is *stale* (expired
  but visible to the admin and ``listlocks``) until ``clearlocks`` or Redis removes it.
  Whether a lock is held is decided by the ``expires`` field, never by key existence.
  A record whose ``expires`` is not a whole number (written by hand, say) blocks
  nobody: it is taken over like a stale one, listed as unreadable, and cleared.
- ``P:{N}:fence`` -- the fencing token of the name's last record, kept for
  ``FENCING_RETENTION`` after a release or a removal. Tokens are a hybrid clock: Redis'
  clock in µs, or the last token plus one if that is larger (``_FENCING``), so they
  strictly increase per name as long as Redis' clock does not step back by more than
  ``FENCING_RETENTION`` while a name has no record (``P:{N}:fence`` covers that long;
  a record covers its own lifetime). If the clock does step back further (a server
  moved to a host whose clock is behind, an NTP step of minutes), tokens minted
  during that step may repeat or go backwards once. Every key of a name has a Redis
  TTL, so nothing per name outlives its last use by more than ``STALE_RETENTION``.
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
sent with ``EVALSHA`` (loaded and sent again on ``NOSCRIPT``, see _Script), which
reads the time with ``TIME`` inside Redis, so no two app servers' clocks are ever
compared. Every script checks its numeric arguments before its first write, so a
call with a bad one (from any client) fails and writes nothing. ``list`` and
``clear`` walk the prefix with ``SCAN`` (never ``KEYS``), one pipeline per batch; on
a Redis Cluster they scan every primary, node by node (each node's batch only holds
keys of its own slots, so its pipeline stays on that node). A name glob narrows the
``SCAN MATCH`` to its literal prefix only; the glob itself is applied in Python
(:mod:`django_setnx.globs`), so Redis' own glob dialect decides nothing.

Eviction. A Redis with ``maxmemory`` set and any ``maxmemory-policy`` but
``noeviction`` may evict lock keys (``volatile-*`` the lock records, which have a
TTL; ``allkeys-*`` anything), and an evicted lock can be taken by a second holder
while the first still runs. Every new connection therefore reads the policy right
after its handshake (``CONFIG GET``, else ``INFO memory`` where ``CONFIG`` is
disabled), and a server that may evict is refused with ``LockBackendError`` before
any lock command is sent on that connection, unless ``OPTIONS["ALLOW_EVICTION"]``
is True. It costs one round trip per new connection and nothing per operation; a
policy changed on a live connection is seen when the next connection is made
(after a reconnect or a Sentinel failover). With our own client (``LOCATION``) a
refused connection is closed. A shared django-redis pool (``OPTIONS["CACHE"]``) is
never broken for the cache: its new connections record what they read, and the lock
operations refuse on it (a new connection made for one of our own operations
refuses at once).

Connections of our own client (``LOCATION``) default to a ``socket_timeout`` of
``DEFAULT_SOCKET_TIMEOUT`` and a ``socket_connect_timeout`` of
``DEFAULT_SOCKET_CONNECT_TIMEOUT`` seconds, and redis-py does not retry commands
(see ``_no_retry``); ``CONNECTION_KWARGS`` overrides any of these.
"""

import asyncio
import functools
import importlib
import inspect
import itertools
import numbers
import os
import random
import secrets
import socket
import threading

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from ..exceptions import LockBackendError
from ..forksafe import ForkSafeLock
from ..globs import compile_glob, redis_match
from ..globs import escape as _escape_glob
from ..validation import redacted, ttl_to_ms
from . import paging, redis_scripts
from .aio import mark_undone, mark_unsent, undo, was_unsent
from .base import (
    HELD,
    STALE,
    STATES,
    AcquireResult,
    BaseLockBackend,
    ClearResult,
    LockInfo,
    built_once,
    encode_owner,
)
from .paging import LockPage, check_ordering, check_window
from .redis_eviction import (
    ALLOW_EVICTION_OPTION,
    _EvictionCheck,
    _EvictionRisk,
    _pool_label,
    _watch_shared_pool,
    eviction_refusal,
    read_eviction_settings,
    unknown_policy_refusal,
)
from .redis_scripts import MAX_SCRIPT_MS, WAITER_MS
from .redis_settings import (
    UNREADABLE_URL,
    check_client_options,
    check_connection_kwargs,
    connection_kwargs,
    is_readable_url,
    kwargs_setting,
    require_readable_url,
    script_seconds_ms,
    script_seconds_problem,
)
from .redis_undo import UndoRetries

try:
    import redis
except ImportError:  # reported by check_params (E010) and on first use
    redis = None  # type: ignore[assignment]

DEFAULT_KEY_PREFIX = "setnx"


def key_prefix_problem(prefix):
    """Why ``prefix`` cannot be a ``KEY_PREFIX``, or None if it can.

    A key is ``P:{N}:<kind>``: with no brace in P, a key names its prefix and lock
    alone. A prefix with braces would make ``"app"`` with the name ``t}:x:{job``
    and ``"app:{t}:x"`` with ``job`` the same key (so one alias' listlocks and
    clearlocks would reach the other's locks), and on a Redis Cluster its braces
    would be the hash tag of every key instead of ``{N}``."""
    if not isinstance(prefix, str) or not prefix:
        return f"must be a non-empty str, got {prefix!r}"
    if "{" in prefix or "}" in prefix:
        return (
            f"must not contain '{{' or '}}' (the keys' hash tag is {{name}}, and a prefix "
            f"with braces makes keys of two prefixes alike), got {prefix!r}"
        )
    return None


def check_key_prefix(alias, params):
    """``params``' KEY_PREFIX (or the default), or ImproperlyConfigured naming it."""
    prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
    problem = key_prefix_problem(prefix)
    if problem is not None:
        raise ImproperlyConfigured(f"SETNX_LOCKS[{alias!r}]['KEY_PREFIX'] {problem}.")
    return prefix


DEFAULT_STALE_RETENTION = 86400
DEFAULT_WAKE_TTL = 1
#: Default of ``OPTIONS["FENCING_RETENTION"]`` (seconds): how long the last fencing
#: token of a released or removed lock is remembered (``P:{N}:fence``). Tokens keep
#: increasing across a release if Redis' clock steps back by less than this.
DEFAULT_FENCING_RETENTION = 60
DEFAULT_CLIENT_CLASS = "redis.Redis.from_url"
#: The client factories this package ships (django_setnx.backends.clients).
OUR_CLIENTS = "django_setnx.backends.clients."
OPTION_NAMES = {
    "CACHE",
    "CONNECTION_KWARGS",
    "CLIENT_CLASS",
    "STALE_RETENTION",
    "WAKE_TTL",
    "FENCING_RETENTION",
    ALLOW_EVICTION_OPTION,
}

#: Seconds a command of our own client may take to answer (redis-py < 8 waits forever
#: by default). Waits stay below it (see MAX_BLOCK).
DEFAULT_SOCKET_TIMEOUT = 5.0
#: Seconds to establish a connection: shorter, because a healthy server accepts in
#: milliseconds, and a dead master (during a Sentinel failover) should be given up on
#: quickly.
DEFAULT_SOCKET_CONNECT_TIMEOUT = 2.0
#: CONNECTION_KWARGS that choose redis-py's retry policy themselves.
RETRY_KWARGS = frozenset({"retry", "retry_on_error", "retry_on_timeout"})

#: Longest single BLPOP: below the default socket timeout, since a BLPOP that blocks
#: as long as the socket timeout is cut short by a TimeoutError.
MAX_BLOCK = 4.0
#: Share of the socket timeout a BLPOP may block, when the timeout is shorter.
BLOCK_SHARE = 0.8
#: Shortest BLPOP timeout: Redis' timer resolution is about a millisecond.
MIN_BLOCK = 0.005
SCAN_COUNT = 1000
#: How many names get_many() pipelines at once.
GET_MANY_CHUNK = 500
#: A listing by name (``page()``) sorts the names SCAN finds when it finds at most
#: paging.SORT_LIMIT lock keys within this many SCAN calls (a bound on the keys Redis
#: walks, whatever MATCH filters out: about SORT_SCAN_CALLS * SCAN_COUNT).
SORT_SCAN_CALLS = 25
#: Longest single wait of a queued waiter before it retries (and re-registers),
#: drawn between WAIT_JITTER and 1 times this. It bounds what a waiter that died
#: after being handed the lock costs the others: the lock is free again CLAIM_MS
#: after the handoff, and each live waiter finds out at its next retry, at most
#: WAIT_BLOCK after the handoff (a retry during the claim waits for its end). So a
#: dead waiter costs at most about max(CLAIM_MS, WAIT_BLOCK), with no wake-up sent
#: (and waiters killed together, until their places lapse: see WAITER_MS).
WAIT_BLOCK = 0.9
WAIT_JITTER = 0.6


def _lenient_text(value):
    """Bytes of a record written by anyone as str, never failing on bad UTF-8."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def record_info(name, alias, now, fields):
    """``(owner token, LockInfo)`` of a lock hash (a dict or a flat field/value list),
    as the Redis and Redlock backends read one (LockInfo.from_record); the token is
    None when the record has none."""
    if not isinstance(fields, dict):
        fields = dict(zip(fields[::2], fields[1::2]))
    fields = {_lenient_text(k): v for k, v in fields.items()}
    token = fields.get("token")
    info = LockInfo.from_record(
        name,
        alias,
        now,
        owner=fields.get("owner"),
        acquired=fields.get("acquired"),
        expires=fields.get("expires"),
        # A record without its owner token was not written by a backend: unreadable.
        fencing=None if token is None else fields.get("fencing"),
        raw={k: _lenient_text(v) for k, v in fields.items()},
        strict_owner=True,
    )
    return (None if token is None else _lenient_text(token)), info


def lock_keys(prefix, name):
    """The (lock, fence, waiters, requests) keys of ``name`` under ``prefix``, in
    the order every script takes them; the ``{name}`` hash tag keeps them in one
    Cluster slot (see the key layout above)."""
    base = f"{prefix}:{{{name}}}"
    return f"{base}:lock", f"{base}:fence", f"{base}:waiters", f"{base}:requests"


def name_from_lock_key(prefix, key):
    """The lock name in a ``P:{N}:lock`` key (``lock_keys(prefix, N)[0]``). A key
    that is not UTF-8 (written by another tool) keeps its bytes as surrogates, so
    that ``scanned_keys`` gives the very same keys back."""
    if isinstance(key, bytes):
        key = key.decode("utf-8", "surrogateescape")
    return key[len(prefix) + 2 : -len("}:lock")]


def _block_timeout(conn, max_wait, retry_after, ttl_ms=None):
    """Seconds one BLPOP of a waiter may block (None: do not block at all): up to
    WAIT_BLOCK, the holder's expiry and ``max_wait``, below the socket timeout. The
    WAIT_BLOCK share is jittered, so that waiters that queued up together do not all
    retry (and renew their place) in the same millisecond.

    And at most a quarter of the ttl the waiter asked for (``ttl_ms``, when known):
    a lock won by the attempt after a wait that returned nothing is dated from the
    start of that wait (it may have written the record: see wait_may_have_written
    and locking._CallClock), and its auto_renew watchdog counts the ttl from there.
    Blocks of WAIT_BLOCK made a lock of ttl 1 s look expired the moment it was won
    (review r157). Redis ends a BLPOP on its timer, every 100 ms at the default
    ``hz``, so below a ttl of about 0.4 s the bound is that, not a quarter."""
    timeout = min(WAIT_BLOCK * random.uniform(WAIT_JITTER, 1.0), conn.max_block)
    if ttl_ms is not None:
        timeout = min(timeout, ttl_ms / 4000)
    if retry_after is not None:
        timeout = min(timeout, max(retry_after, 0) + 0.001)
    if max_wait is not None:
        timeout = min(timeout, max_wait)
    return max(timeout, MIN_BLOCK) if timeout > 0 else None


def scanned_keys(prefix, name):
    """``lock_keys`` of a name read back from a key (see ``name_from_lock_key``): as
    bytes when the name is not UTF-8 text, so that such a key can still be read and
    removed."""
    keys = lock_keys(prefix, name)
    if _is_text(name):
        return keys
    return tuple(key.encode("utf-8", "surrogateescape") for key in keys)


def scan_batches(scan):
    """Yield the keys of each call of one full SCAN iteration (maybe none), where
    ``scan(cursor)`` returns ``(next cursor, keys)``: the SCAN loop of the Redis and
    Redlock backends."""
    cursor = 0
    while True:
        cursor, keys = scan(cursor)
        yield keys
        if int(cursor) == 0:
            return


def _is_text(name):
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def printable_name(name):
    """A name read from a key, fit to show: bytes that are not UTF-8 as \\xNN."""
    if _is_text(name):
        return name
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _not_a_django_redis_cache(alias, redis_cache_class):
    """Why the cache ``alias`` cannot lend its connection to the locks (what
    ``django_redis.get_redis_connection`` needs: ``cache.client.get_client()``), or
    None if it can. Building the cache object connects to nothing; a cache that
    cannot be built is left to Django's own checks. Duck-typed, not a subclass test:
    a cache that wraps or instruments django-redis' lends its connection too (review
    r129)."""
    from django.core.cache import caches

    try:
        cache = caches[alias]
    except Exception:  # noqa: BLE001 - Django's checks and first use report it
        return None
    if isinstance(cache, redis_cache_class):
        return None
    client = getattr(cache, "client", None)
    if callable(getattr(client, "get_client", None)):
        return None
    return f"a {type(cache).__module__}.{type(cache).__qualname__}, not a django-redis cache."


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


def _no_retry():
    """redis-py's retry policy for our own client: none.

    redis.Redis() and RedisCluster (redis-py >= 6) retry a command up to 10 times with
    exponential backoff on a connection error or timeout, so during an outage one
    lock operation could hang for seconds before reporting it. Worse, a retry re-sends a script that may have
    run: ACQUIRE is idempotent under its token (it reports the same win), but a
    RELEASE whose first run deleted the record would report "not ours", and the Lock
    would claim the lock had been taken over. redis-py cannot tell the two apart, so
    nothing is retried: the caller gets LockBackendError at once, and an acquire
    cleans up after itself (see RedisBackend.acquire). A connection the server closed
    while idle costs no retry: the pool replaces it before sending anything.
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


#: The scripts a connection registers, by the attribute that holds them.
SCRIPTS = {
    operation: getattr(redis_scripts, operation.upper())
    for operation in (
        "acquire",
        "release",
        "extend",
        "owns",
        "get",
        "delete",
        "clear",
        "stop_waiting",
    )
}
#: The asyncio connection serves the lock operations only (the admin and the
#: commands are synchronous).
ASYNC_SCRIPTS = {
    attribute: SCRIPTS[attribute]
    for attribute in ("acquire", "release", "extend", "owns", "get", "stop_waiting")
}


#: In a forked child, the asyncio clients inherited from the parent, kept referenced
#: and never used. Collected in the child while one of its own event loops runs,
#: redis-py's Connection.__del__ would close a transport of the parent's loop copy,
#: whose epoll set the parent shares (the fork copied the descriptor, not the set):
#: the parent's socket would leave its loop, and its next reply never arrive.
_INHERITED_ASYNC: list[object] = []


_MISSING = object()


def _close_sockets_of(client):
    """Close the sockets of an asyncio client whose event loop is closed: its
    transports cannot close them any more (that would schedule a callback on the
    closed loop). Best effort, on the standard loop's transports; others are left to
    the garbage collector."""
    pool = getattr(client, "connection_pool", None)
    connections = [
        *getattr(pool, "_available_connections", ()),
        *getattr(pool, "_in_use_connections", ()),
    ]
    for connection in connections:
        transport = getattr(getattr(connection, "_writer", None), "transport", None)
        # Over TLS the StreamWriter's transport is asyncio's SSL transport, which
        # sits on the socket's transport (review r143: TLS sockets stayed open); once
        # the server closed the connection, it sits on none (review r145).
        ssl_protocol = getattr(transport, "_ssl_protocol", None)
        if ssl_protocol is None:
            socket_transport = transport
        else:
            socket_transport = getattr(ssl_protocol, "_transport", None)
        sock = getattr(socket_transport, "_sock", _MISSING)
        if isinstance(sock, socket.socket):
            sock.close()
            # What transport.close() would have recorded, had the loop been open:
            # the transports and the StreamWriter then collect without a
            # ResourceWarning ("unclosed transport", "loop is closed").
            socket_transport._sock = None
            socket_transport._closing = True
        elif sock is _MISSING and socket_transport is not None:
            continue  # not the standard loop's transports (uvloop's): left to the GC
        # else closed already (the server closed it): only let go of it
        if ssl_protocol is not None:
            transport._closed = True
        connection._reader = connection._writer = None


class _AsyncConnection:
    """An event loop's asyncio client, the scripts registered on it, and the waits of
    its coroutines (see redis_asyncio.InboxWaits)."""

    def __init__(self, client, socket_timeout, key_prefix):
        from .redis_asyncio import IN_FLIGHT, BoundedScript, InboxWaits, ReadDeadlines

        self.client = client
        slots = asyncio.Semaphore(IN_FLIGHT)
        deadlines = ReadDeadlines(asyncio.get_running_loop())
        for attribute, source in ASYNC_SCRIPTS.items():
            setattr(self, attribute, BoundedScript(client, source, slots, deadlines))
        self.max_block = _max_block(socket_timeout)
        self.waits = InboxWaits(
            client, f"{key_prefix}:waits:{secrets.token_hex(8)}", self.max_block
        )


class _Connection:
    """A client and the scripts registered on it (a script object binds its client).

    ``watch`` is the _SharedPoolWatch of a shared django-redis pool whose eviction
    policy the lock operations must check, else None.
    """

    def __init__(self, client, owned, socket_timeout, watch=None):
        self.client = client
        self.owned = owned
        self.watch = watch
        if owned:
            # Our own client's retry policy is ours (see _no_retry): it applies.
            own = _OwnConnections.of(client)
        else:
            # A shared pool's retry policy is the cache's (django-redis users often
            # set retry_on_timeout): our lock commands never retry (see _no_retry).
            own = _OwnConnections.of(client, {"retry": _no_retry()})
        if own is not None:
            self.links = own
        else:
            pool = getattr(client, "connection_pool", None)
            self.links = _PoolCheckout(pool, retries=owned)
        _bind_scripts(self, client, SCRIPTS, self.links)
        self.max_block = _max_block(socket_timeout)

    def close(self):
        """Disconnect the connections kept beside the pool, and the pool itself if
        it is ours (a shared django-redis pool is django-redis' to close)."""
        self.links.close()
        if self.owned:
            self.client.close()


class _OwnConnections:
    """The idle connections the lock commands use, kept beside the client's pool
    (ours, or a django-redis cache's with ``OPTIONS["CACHE"]``) rather than checked
    out of it for every command.

    redis-py's ``get_connection`` and ``release`` take the pool's lock, check its
    pid and update its metrics on every command: about 12 µs of CPU per command
    with redis-py 8 (more on a busy machine), and an acquire + release sends two.
    Here a command takes an idle connection of this process (``list.pop`` and
    ``append`` are atomic: no lock) and, as the pool does, reconnects one that has
    something to read while idle (the server closed it: a restart, its ``timeout``,
    ``CLIENT KILL``). Connections are made as the pool makes them, from its
    current ``connection_kwargs`` (the same server, timeouts, retry policy, health
    checks and connect hook, so our eviction check runs on each; on a shared
    django-redis pool, with no retry instead of the cache's), at most the
    pool's ``max_connections`` of them per process. One made before the pool took
    a maintenance ``MOVING`` notice of Redis Enterprise (which redis-py applies to
    the pool and its own connections: a new host, or the notice's mark) is
    replaced at its next use. After a fork
    the child drops each inherited connection as it meets it, closing only its own
    copy of the socket (redis-py shuts a socket down only in the process that opened
    it), so a parent and its child never read each other's replies.

    A django-redis cache's pool thus lends the lock commands its settings (server,
    credentials, TLS, timeouts, its connect hook), not its connections: they would
    cost the same checkout, which took our Redis acquire + release from 1.07× the
    floor to 1.14–1.29× in benchmarks/bench_core.py. The price is up to one more
    connection per thread that locks; the cache's own stay the cache's.

    Only for a plain ``redis.ConnectionPool`` without a client-side cache or a
    credential provider (see :meth:`of`): a Sentinel pool (which finds the master)
    and a blocking pool keep the pool's checkout (through _PoolCheckout).
    """

    retries = True  # the connections' own policy (see _exchange_on_pool)

    __slots__ = (
        "_closed",
        "_created",
        "_creating",
        "_idle",
        "_max",
        "_overrides",
        "_pid",
        "_pool",
    )

    def __init__(self, pool, overrides=None):
        self._pool = pool
        self._overrides = overrides or {}
        self._max = pool.max_connections
        self._idle = []
        self._closed = False
        self._creating = threading.Lock()
        self._created = 0
        self._pid = os.getpid()

    @classmethod
    def of(cls, client, overrides=None):
        """The connections for ``client``'s lock commands, or None where its pool's
        checkout must be used (_PoolCheckout). ``overrides``: connection arguments
        that replace the pool's.

        A pool with a credential provider keeps its checkout too: redis-py
        re-authenticates the pool's own connections when a streaming provider
        (Entra ID, say) renews its token, and ours would keep the old one."""
        pool = getattr(client, "connection_pool", None)
        if (
            type(pool) is not redis.ConnectionPool
            or getattr(pool, "cache", None) is not None
            or pool.connection_kwargs.get("credential_provider") is not None
        ):
            return None
        return cls(pool, overrides)

    def take(self):
        """An idle connection of this process, ready to send, or a new one (which
        connects when it first sends)."""
        pid = os.getpid()  # not a fork hook's: uWSGI forks without running them
        if self._pid != pid:
            self._forked(pid)
        idle = self._idle
        while idle:
            try:
                conn = idle.pop()
            except IndexError:
                break
            try:
                if conn.pid != pid:
                    conn.disconnect()  # inherited across a fork: closes only our copy
                    continue
                if self._moved(conn):
                    conn.disconnect()  # the server moved (see above): a new connection
                    self._count(-1)
                    continue
                if conn._sock is not None:
                    try:
                        readable = conn.can_read()
                    except (
                        redis.exceptions.ConnectionError,
                        redis.exceptions.TimeoutError,
                        OSError,
                    ):
                        readable = True
                    if readable:
                        conn.disconnect()  # the send reconnects
            except BaseException:
                # Interrupted (a signal handler's exception): keep the connection,
                # dropped, rather than lose it and its place under max_connections.
                conn.disconnect()
                idle.append(conn)
                raise
            return conn
        self._count(+1)
        try:
            pool = self._pool
            return pool.connection_class(**{**pool.connection_kwargs, **self._overrides})
        except BaseException:
            self._count(-1)
            raise

    def _forked(self, pid):
        """First use in a forked child: the parent's count is not ours, and the
        lock may have been held by another thread of the parent at the fork."""
        self._creating = threading.Lock()
        self._created = 0
        self._pid = pid

    def _count(self, change):
        with self._creating:
            if change > 0 and self._created >= self._max:
                raise _MAX_CONNECTIONS_ERROR("Too many connections")
            self._created += change

    def _moved(self, conn):
        """Whether the pool's server address or maintenance notice changed since
        ``conn`` was made (a MOVING notice changes the pool's host, or only marks it
        with the notice's hash when the endpoint stays: redis-py then reconnects its
        own connections)."""
        kwargs = self._pool.connection_kwargs
        host = getattr(conn, "host", None)
        notice = getattr(conn, "maintenance_notification_hash", None)
        return host != kwargs.get("host", host) or notice != kwargs.get(
            "maintenance_notification_hash", notice
        )

    def give_back(self, conn):
        self._idle.append(conn)
        if self._closed:  # close() ran while it was in use (or while we appended)
            self.close()

    def close(self):
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()


class _PoolCheckout:
    """The lock commands' way to a pool that cannot lend connections to be kept
    beside it (see _OwnConnections.of: a blocking, Sentinel, client-side-cache or
    credential-provider pool): its own checkout, ``get_connection`` and ``release``
    for every command.

    ``retries``: whether a command is sent under its connection's retry policy.
    True for our own client, whose policy is ours (none unless CONNECTION_KWARGS
    gives one, see _no_retry). False for a shared django-redis pool, whose policy is
    the cache's: each command is sent once, since a retried lock script could report
    a release that ran as a takeover (see _no_retry).

    ``pool`` is None for a client without one (a RedisCluster): such a client sends
    its own commands (see _sends_plainly), never through this.
    """

    __slots__ = ("_pool", "retries")

    def __init__(self, pool, retries):
        self._pool = pool
        self.retries = retries

    def take(self):
        return self._pool.get_connection(*_GET_CONNECTION_ARGS)

    def give_back(self, conn):
        self._pool.release(conn)

    def close(self):
        """Nothing: the pool is its client's, closed with it when the client is ours
        (see _Connection.close), django-redis' to close when shared."""


def _bind_scripts(connection, client, scripts, links):
    """Register each script on ``client`` as an attribute of ``connection``: a
    script object binds its client, so each connection has its own. ``links``: where
    they take a connection (_OwnConnections or _PoolCheckout)."""
    for attribute, source in scripts.items():
        setattr(connection, attribute, _Script(client, source, links))


class _Script:
    """A Lua script bound to a client, called as redis-py's ``Script`` is (``keys``,
    ``args``, optionally a pipeline as ``client``) and, like it, loaded and run once
    more when the server does not know it (``NOSCRIPT``: a restart, ``SCRIPT FLUSH``,
    a failover; the script did not run, so running it again is safe).

    Our own because ``Script.__call__`` imports redis-py's Pipeline class and tests
    for it on every call, which costs a few µs of CPU, twice per acquire+release; a
    call on a pipeline (clear()) goes through redis-py's, which registers the script
    with the pipeline. On a plain ``redis.Redis`` it also sends the command itself
    (see :func:`_send_on_pool`).
    """

    __slots__ = ("client", "for_pipelines", "links", "sha", "source")

    def __init__(self, client, source, links):
        self.client = client
        self.source = source
        self.links = links
        self.for_pipelines = client.register_script(source)
        self.sha = self.for_pipelines.sha

    def __call__(self, keys=(), args=(), client=None):
        if client is not None:
            return self.for_pipelines(keys=keys, args=args, client=client)
        try:
            return self._send("EVALSHA", self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self._send("SCRIPT", "LOAD", self.source)
            return self._send("EVALSHA", self.sha, len(keys), *keys, *args)

    def _send(self, *command):
        client = self.client
        if _sends_plainly(client):
            return _send_on_pool(client, *command, links=self.links)
        return client.execute_command(*command)


def _sends_plainly(client):
    """True if ``client`` is a plain ``redis.Redis`` (or a subclass that leaves
    ``execute_command`` alone) with a connection pool: a command sent on one of its
    pool's connections is then exactly what ``execute_command`` would send. False for
    RedisCluster, a single-connection client, a client whose ``execute_command`` is
    replaced or instrumented (OpenTelemetry, Sentry; patched on the class or on the
    client itself, as ``mock.patch.object`` does in a test), one with its own
    ``EVALSHA`` response callback, and while redis-py's own metrics are on: those
    get ``execute_command``."""
    return (
        type(client).execute_command is _PLAIN_EXECUTE
        and client.connection is None
        and "execute_command" not in vars(client)
        and "EVALSHA" not in client.response_callbacks
        and not _redis_py_metrics_on()
    )


def _send_on_pool(client, *command, links):
    """Send ``command`` on a connection of ``links`` (``client``'s pool's checkout or
    connections kept beside it, see _PoolCheckout and _OwnConnections) and return
    its reply, as redis-py's ``execute_command`` does, less its per-command
    bookkeeping (about 6 µs of CPU per command with redis-py 8: observability hooks,
    its own closures). Everything that decides the outcome is kept (see
    :func:`_exchange_on_pool`)."""

    def exchange(conn):
        conn.send_command(*command)
        return conn.read_response()

    return _exchange_on_pool(client, exchange, links)


def _pipeline_on_pool(client, commands, links):
    """Send ``commands`` in one write on a connection of ``links`` (see
    _send_on_pool), as redis-py's ``Pipeline.execute(raise_on_error=False)`` does,
    less its bookkeeping (about 30 µs of CPU for a BLPOP and an EVALSHA). Returns
    their replies in order; an error reply (``NOSCRIPT``) is returned in its place,
    not raised: reading it leaves the connection in step. A connection error or
    timeout is raised, and the connection with replies still pending is dropped (see
    _exchange_on_pool)."""

    def exchange(conn):
        conn.send_packed_command(conn.pack_commands(commands))
        replies = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as error:
                replies.append(error)
        return replies

    return _exchange_on_pool(client, exchange, links)


def _exchange_on_pool(client, exchange, links):
    """Run ``exchange(connection)`` on a connection of ``links`` (see _OwnConnections
    and _PoolCheckout), a connection of ``client``'s pool or kept beside it. Kept
    from redis-py: the connection's health check before sending (in ``send_*``), its
    disconnect on any error while sending or reading (a broken connection never goes
    back with a reply pending), and the retry policy as that redis-py version
    applies it, when ``links.retries`` (on our own client, none unless
    CONNECTION_KWARGS gives one, see _no_retry; on a shared django-redis pool, none:
    never the cache's)."""
    try:
        conn = links.take()  # a pool's get_connection connects (see _PoolCheckout)
    except Exception as error:
        mark_unsent(error)
        raise

    if _RETRY_ONLY_ON_LISTED_ERRORS:
        # redis-py < 6 retries only the errors in the connection's retry_on_error
        # (retry_on_timeout: TimeoutError), whatever its Retry object supports.
        def failed(error):
            client._disconnect_raise(conn, error)
    else:

        def failed(error):
            conn.disconnect()

    try:
        if getattr(conn, "_sock", True) is None:  # (a CacheProxyConnection has none)
            # Connect first (under the connection's own retry policy, as the send
            # would): refused here, the command never left, and an acquire has
            # nothing to undo (see aio.mark_unsent).
            try:
                conn.connect()
            except Exception as error:
                mark_unsent(error)
                raise
        if not links.retries:
            return exchange(conn)  # once (see _PoolCheckout); errors handled below
        return conn.retry.call_with_retry(lambda: exchange(conn), failed)
    except redis.exceptions.ResponseError:
        raise  # an error reply (NOSCRIPT): read, so the connection is in step
    except BaseException:
        # Interrupted between a write and its read (KeyboardInterrupt, a signal
        # handler's exception): a reply may still be on its way. redis-py drops a
        # connection that fails inside its own calls; this covers the gaps between.
        conn.disconnect()
        raise
    finally:
        if _should_reconnect(conn):  # a server maintenance notice (redis-py >= 7)
            conn.disconnect()
        links.give_back(conn)


def _should_reconnect(conn):
    check = getattr(conn, "should_reconnect", None)
    return bool(check is not None and check())


def _plain_execute():
    """redis-py's own ``Redis.execute_command``, or None if something (APM
    instrumentation) replaced it before we looked: then every client keeps its own.
    A replacement is told by its ``__wrapped__`` (``functools.wraps``, wrapt) or by
    code that is not in redis-py's client module."""
    execute = redis.Redis.execute_command
    code = getattr(execute, "__code__", None)
    plain = (
        getattr(execute, "__qualname__", None) == "Redis.execute_command"
        and not hasattr(execute, "__wrapped__")
        and code is not None
        and code.co_name == "execute_command"
        and os.path.normcase(code.co_filename)
        == os.path.normcase(getattr(redis.client, "__file__", "") or "")
    )
    return execute if plain else None


def _metrics_switch():
    """redis-py's own metrics switch (``is_enabled`` of its observability instance,
    redis-py >= 8), or None where there is none."""
    try:
        from redis.observability.providers import get_observability_instance
    except ImportError:
        return None
    return get_observability_instance


def _redis_py_metrics_on():
    instance = _METRICS_SWITCH() if _METRICS_SWITCH is not None else None
    return instance is not None and instance.is_enabled()


if redis is not None:
    _PLAIN_EXECUTE = _plain_execute()
    _METRICS_SWITCH = _metrics_switch()
    _RETRY_ONLY_ON_LISTED_ERRORS = hasattr(redis.Redis, "_disconnect_raise")


def get_connection_args(pool_class):
    """What ``pool_class.get_connection`` (sync or asyncio) must be given: a command
    name before redis-py 5.3 (required then), nothing after (deprecated: it warns)."""
    command_name = inspect.signature(pool_class.get_connection).parameters.get("command_name")
    required = command_name is not None and command_name.default is inspect.Parameter.empty
    return ("EVALSHA",) if required else ()


if redis is not None:
    _GET_CONNECTION_ARGS = get_connection_args(redis.ConnectionPool)
    # What a full pool raises (a ConnectionError; its own class since redis-py 5.1).
    _MAX_CONNECTIONS_ERROR = getattr(
        redis.exceptions, "MaxConnectionsError", redis.exceptions.ConnectionError
    )


def _max_block(socket_timeout):
    """The longest BLPOP on a connection: it must return before the socket times
    out (see MAX_BLOCK)."""
    return MAX_BLOCK if not socket_timeout else min(MAX_BLOCK, socket_timeout * BLOCK_SHARE)


def require_redis_py(alias, backend_label):
    """Raise ImproperlyConfigured naming ``alias`` unless redis-py is installed."""
    if redis is None:
        raise ImproperlyConfigured(
            f"SETNX_LOCKS[{alias!r}] uses the {backend_label} backend, but redis-py is not "
            f"installed: pip install django-setnx[redis]"
        )


class _ReportedAs:
    """The context of RedisBackend._errors_as (a class: it wraps every operation, and a
    generator-based context manager costs about a microsecond more).

    With a shared pool, it also marks this thread as running a lock operation, so that
    a new connection made for it refuses a server that may evict (see
    _SharedPoolWatch). Generators hold it around each call to Redis, never across a
    ``yield``: the caller may use the cache in between.
    """

    __slots__ = ("action", "backend", "marker", "name", "outer")

    def __init__(self, backend, action, name, shared=True):
        self.backend = backend
        self.action = action
        self.name = name
        # ``shared=False``: an operation on our own asyncio pool, never the shared one.
        if shared and backend._watch is None and backend.watches_shared_pool:
            # The watch is installed when the connection is built: before the first
            # operation's own new connection is made (it must refuse at once).
            backend._built_connection()
        watch = backend._watch if shared else None
        self.marker = watch.lock_operation if watch is not None else None

    def __enter__(self):
        marker = self.marker
        if marker is not None:
            self.outer = getattr(marker, "alias", None)
            marker.alias = self.backend.alias

    def __exit__(self, exc_type, exc, traceback):
        if self.marker is not None:
            self.marker.alias = self.outer
        if exc_type is None:
            return False
        backend = self.backend
        if issubclass(exc_type, _EvictionRisk):
            raise LockBackendError(backend.alias, str(exc)) from exc
        if issubclass(exc_type, backend._errors):
            action = self.action if self.name is None else f"{self.action} {self.name!r}"
            raise LockBackendError(
                backend.alias, f"{action} failed: {exc_type.__name__}: {exc}"
            ) from exc
        return False


class RedisBackend(BaseLockBackend):
    """Locks in Redis, via redis-py or a django-redis cache's connection."""

    option_names = BaseLockBackend.option_names | frozenset(OPTION_NAMES)

    wakes_waiters = True
    wait_may_have_written = True  # the attempt pipelined behind BLPOP (see wait)

    def __init__(self, alias, params):
        super().__init__(alias, params)
        require_redis_py(alias, "Redis")
        where = f"SETNX_LOCKS[{alias!r}]"
        self.location = params.get("LOCATION")
        self.key_prefix = check_key_prefix(alias, params)
        self.cache_alias = self.options.get("CACHE")
        if self.cache_alias is not None and not isinstance(self.cache_alias, str):
            raise ImproperlyConfigured(
                f"{where}['OPTIONS']['CACHE'] must be the alias (a str) of a django-redis "
                f"cache in settings.CACHES, got {redacted(self.cache_alias)}."
            )
        # The system checks report these too (E011, E012); an alias used without
        # running them must still fail here, naming itself, not at its first acquire.
        if self.location is None and self.cache_alias is None:
            raise ImproperlyConfigured(
                f"{where} needs a LOCATION (a redis:// URL) or OPTIONS['CACHE'] (a "
                f"django-redis cache alias)."
            )
        if self.location is not None and self.cache_alias is not None:
            raise ImproperlyConfigured(
                f"{where} sets both LOCATION and OPTIONS['CACHE']; choose one."
            )
        if self.location is not None and (not isinstance(self.location, str) or not self.location):
            raise ImproperlyConfigured(
                f"{where}['LOCATION'] must be a non-empty redis:// URL "
                f"string, got {redacted(self.location)}."
            )
        self.allow_eviction = self.options.get(ALLOW_EVICTION_OPTION, False)
        if not isinstance(self.allow_eviction, bool):
            raise ImproperlyConfigured(
                f"{where}['OPTIONS'][{ALLOW_EVICTION_OPTION!r}] must be "
                f"True or False, got {self.allow_eviction!r}."
            )
        #: Whether the lock operations watch a shared pool's eviction policy.
        self.watches_shared_pool = self.cache_alias is not None and not self.allow_eviction
        # As the system checks report them (E014, E015): a value the scripts refuse
        # would make every release fail, and the lock stay held for its ttl.
        opts = self.options
        self.retention_ms = script_seconds_ms(
            opts, "STALE_RETENTION", DEFAULT_STALE_RETENTION, where
        )
        self.wake_ms = script_seconds_ms(opts, "WAKE_TTL", DEFAULT_WAKE_TTL, where)
        self.fence_ms = script_seconds_ms(
            opts, "FENCING_RETENTION", DEFAULT_FENCING_RETENTION, where
        )
        if ttl_to_ms(self.max_ttl) > MAX_SCRIPT_MS:
            raise ImproperlyConfigured(
                f"{where}['OPTIONS']['MAX_TTL'] is above the Redis backend's limit of "
                f"{MAX_SCRIPT_MS / 1000:g} s."
            )
        # SCAN MATCH pattern head: escaped so that a prefix such as "a*" cannot match
        # keys outside it.
        self._match_head = _escape_glob(self.key_prefix) + ":{"
        # RedisCluster reports an unreachable cluster with an error outside RedisError.
        self._errors = (
            redis.exceptions.RedisError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        # redis-py lets some socket errors through unwrapped, hence the builtins.
        self._network_errors = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            ConnectionError,
            TimeoutError,
        )
        #: token -> (ttl_ms, owner_json) of a queued caller's attempt (see wait).
        self._queued = {}
        #: token -> ttl_ms of an async caller queued by an aacquire (see _ran_nothing
        #: and stop_waiting).
        self._aqueued = {}
        self._conn = None
        self._conn_lock = ForkSafeLock()  # a child may build its client
        self._watch = None  # the _SharedPoolWatch of OPTIONS["CACHE"]'s pool, once connected
        #: id(event loop) -> (loop, pid, _AsyncConnection or None): see _aconnection.
        self._async_conns = {}
        #: The undos of failed acquires that the server did not answer (redis_undo),
        #: made at the first.
        self._undo_retries = None

    # -- configuration ------------------------------------------------------------

    @classmethod
    def check_params(cls, alias, params):
        """Return ``checks.Error`` objects (ids ``django_setnx.E010``-``E019``, ``W010``) for
        this alias' settings. Imports but never connects."""
        where = f"SETNX_LOCKS[{alias!r}]"
        errors = []

        def error(id_, msg, hint=None):
            errors.append(checks.Error(msg, hint=hint, id=f"django_setnx.{id_}"))

        def warn(id_, msg):
            errors.append(checks.Warning(msg, id=f"django_setnx.{id_}"))

        options = params.get("OPTIONS") or {}
        if not isinstance(options, dict):
            error("E019", f"{where}['OPTIONS'] must be a dict, got {redacted(options)}.")
            options = {}
        if redis is None:
            error(
                "E010",
                f"{where} uses the Redis backend, but redis-py is not installed.",
                hint="pip install django-setnx[redis]",
            )
        location = params.get("LOCATION")
        cache = options.get("CACHE")
        if location is None and cache is None:
            error(
                "E011",
                f"{where} needs a LOCATION (a redis:// URL) or OPTIONS['CACHE'] "
                f"(a django-redis cache alias).",
            )
        elif location is not None and cache is not None:
            error("E012", f"{where} sets both LOCATION and OPTIONS['CACHE']; choose one.")
        elif location is not None and (not isinstance(location, str) or not location):
            error(
                "E011",
                f"{where}['LOCATION'] must be a non-empty redis:// URL string, got "
                f"{redacted(location)}.",
            )
        elif (
            location is not None
            and redis is not None
            and options.get("CLIENT_CLASS") in (None, DEFAULT_CLIENT_CLASS)
        ):
            # What redis.Redis.from_url will make of it, without connecting (review
            # r126: an http:// URL or a port that is not a number passed the checks
            # and failed the first lock). The message never repeats the URL: it may
            # hold a password. A CLIENT_CLASS may take other URLs.
            if not is_readable_url(location):
                error("E011", f"{where}['LOCATION'] is not a Redis URL {UNREADABLE_URL}")
        elif location is not None and options.get("CLIENT_CLASS") == f"{OUR_CLIENTS}sentinel":
            from .clients import parse_sentinel_url

            try:
                parse_sentinel_url(location)
            except (TypeError, ValueError) as exc:  # its messages show no credentials
                error("E011", f"{where}['LOCATION']: {exc}")
        prefix_problem = key_prefix_problem(params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX))
        if prefix_problem is not None:
            error("E013", f"{where}['KEY_PREFIX'] {prefix_problem}.")
        for option, id_ in (
            ("STALE_RETENTION", "E014"),
            ("WAKE_TTL", "E015"),
            ("FENCING_RETENTION", "E015"),
        ):
            problem = option in options and script_seconds_problem(options[option])
            if problem:
                error(id_, f"{where}['OPTIONS'][{option!r}] {problem}")
        if cache is not None and location is None:
            from django.conf import settings

            if not isinstance(cache, str):
                error(
                    "E016",
                    f"{where}['OPTIONS']['CACHE'] must be the alias (a str) of a "
                    f"django-redis cache in settings.CACHES, got {redacted(cache)}.",
                )
            elif cache not in getattr(settings, "CACHES", {}):
                error(
                    "E016",
                    f"{where}['OPTIONS']['CACHE'] is {redacted(cache)}, which is not an "
                    f"alias in settings.CACHES.",
                )
            else:
                try:
                    from django_redis.cache import RedisCache
                except ImportError:
                    error(
                        "E016",
                        f"{where}['OPTIONS']['CACHE'] needs django-redis, which is not installed.",
                        hint="pip install django-setnx[django-redis]",
                    )
                else:
                    problem = _not_a_django_redis_cache(cache, RedisCache)
                    if problem is not None:
                        error(
                            "E016",
                            f"{where}['OPTIONS']['CACHE'] is {redacted(cache)}, {problem}",
                            hint="Point it at a django_redis.cache.RedisCache alias, or set "
                            "LOCATION to the Redis URL instead.",
                        )
        client_class = options.get("CLIENT_CLASS")
        if client_class is not None and not isinstance(client_class, str):
            error(
                "E017",
                f"{where}['OPTIONS']['CLIENT_CLASS'] must be a dotted path (str), "
                f"got {client_class!r}.",
            )
        elif client_class is not None:
            try:
                factory = import_dotted(client_class)
            except ImportError as exc:
                error(
                    "E017",
                    f"{where}['OPTIONS']['CLIENT_CLASS'] {client_class!r} cannot be "
                    f"imported: {exc}",
                )
            else:
                if not callable(factory):
                    error(
                        "E017",
                        f"{where}['OPTIONS']['CLIENT_CLASS'] {client_class!r} is not callable.",
                    )
        # A URL is checked with CONNECTION_KWARGS only when the client is redis-py's
        # own (a CLIENT_CLASS may take other arguments) and LOCATION was readable.
        # (The default CLIENT_CLASS, set explicitly, is redis-py's own too.)
        own_client = client_class in (None, DEFAULT_CLIENT_CLASS)
        urls = [location] if isinstance(location, str) and location and own_client else []
        if any(e.id == "django_setnx.E011" for e in errors):
            urls = []
        check_client_options(
            options,
            where,
            error,
            warn,
            kwargs_id="E018",
            eviction_id="E019",
            tls_id="W010",
            alias=alias,
            urls=urls,
        )
        return errors

    # -- connection ---------------------------------------------------------------

    def _client_kwargs(self, check):
        """CONNECTION_KWARGS with our defaults (timeouts, no retries) and, unless
        eviction is allowed, ``check`` as the connect hook."""
        kwargs = connection_kwargs(self.options, self.alias)
        kwargs.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
        kwargs.setdefault("socket_connect_timeout", DEFAULT_SOCKET_CONNECT_TIMEOUT)
        if not RETRY_KWARGS & kwargs.keys():
            kwargs["retry"] = _no_retry()
        if check is not None:
            check.chained = kwargs.get("redis_connect_func")
            kwargs["redis_connect_func"] = check
        return kwargs

    def _connect(self):
        if self.cache_alias is not None:
            return self._connect_to_cache()
        check = None if self.allow_eviction else _EvictionCheck(self.alias)
        kwargs = self._client_kwargs(check)
        client_class = self.options.get("CLIENT_CLASS", DEFAULT_CLIENT_CLASS)
        factory = import_dotted(client_class)
        own_client = client_class == DEFAULT_CLIENT_CLASS
        if own_client:
            require_readable_url(self.location, f"SETNX_LOCKS[{self.alias!r}]['LOCATION']")
        try:
            client = factory(self.location, **kwargs)
        except ValueError as exc:
            if own_client:  # the URL was readable: the arguments are not (review r149)
                raise ImproperlyConfigured(
                    f"{kwargs_setting(self.alias)}: redis-py refuses it: {exc}"
                ) from exc
            if client_class.startswith(OUR_CLIENTS):
                # Ours (Sentinel, Cluster): the message is specific, and never shows
                # credentials (review r153: "must end with /service_name" was lost).
                raise ImproperlyConfigured(
                    f"SETNX_LOCKS[{self.alias!r}]['LOCATION']: {exc}"
                ) from None
            # A client class of the user's: the URL may be what it cannot read. A
            # configuration error naming the alias, not a bare ValueError at the first
            # lock; neither the URL nor the message, which may quote part of it
            # (review r129), not even as the cause (review r150: tracebacks print it).
            raise ImproperlyConfigured(
                f"SETNX_LOCKS[{self.alias!r}]: cannot make a Redis client from LOCATION "
                f"and CONNECTION_KWARGS with {client_class}: LOCATION may not be a Redis "
                f"URL {UNREADABLE_URL}"
            ) from None
        except TypeError as exc:
            if not (own_client or client_class.startswith(OUR_CLIENTS)):
                raise
            # redis-py's clients refuse an argument they do not take when they are
            # built (Sentinel's master does): a configuration error naming the
            # setting. The message names the argument, never a value.
            raise ImproperlyConfigured(
                f"{kwargs_setting(self.alias)} (or the LOCATION URL's query): the Redis "
                f"client refuses its arguments: {exc}"
            ) from None
        except Exception as exc:
            # A client that connects while it is built (RedisCluster) wraps a refusal
            # found on its first node in an error of its own.
            if isinstance(exc.__cause__, _EvictionRisk):
                raise _EvictionRisk(str(exc.__cause__)) from exc
            raise
        try:
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                self._check_connection_kwargs(pool)
            if check is not None:
                self._connect_every_primary(client)
            # The URL's query string may set the timeout too, and wins over kwargs.
            socket_timeout = (
                pool.connection_kwargs.get("socket_timeout")
                if pool is not None
                else kwargs["socket_timeout"]
            )
            return _Connection(client, owned=True, socket_timeout=socket_timeout)
        except BaseException:
            client.close()
            raise

    def _check_connection_kwargs(self, pool):
        check_connection_kwargs(self.alias, pool)

    def _connect_every_primary(self, client):
        """On a Redis Cluster, connect to every primary now, so that each one's eviction
        policy is checked on first use (each new connection checks its own server),
        not only those of the slots used first."""
        get_primaries = getattr(client, "get_primaries", None)
        if get_primaries is not None:
            for node in get_primaries():
                client.get_redis_connection(node).ping()

    def _connect_to_cache(self):
        from django.core.cache import InvalidCacheBackendError
        from django_redis import get_redis_connection

        where = f"SETNX_LOCKS[{self.alias!r}]['OPTIONS']['CACHE'] = {redacted(self.cache_alias)}"
        try:
            client = get_redis_connection(self.cache_alias)
        except NotImplementedError as exc:
            raise ImproperlyConfigured(f"{where} is not a django-redis cache.") from exc
        except InvalidCacheBackendError:
            # Not chained: Django's message quotes the alias, which may be a URL given
            # here by mistake, password included (review r155).
            raise ImproperlyConfigured(f"{where} is not an alias in settings.CACHES.") from None
        pool = client.connection_pool
        watch = None if self.allow_eviction else _watch_shared_pool(pool)
        self._watch = watch
        return _Connection(
            client,
            owned=False,
            watch=watch,
            socket_timeout=pool.connection_kwargs.get("socket_timeout"),
        )

    @property
    def connection(self):
        """The lazily created client and scripts, shared by every thread.

        On a shared pool whose server was last seen to (or may) evict, the eviction
        policy is read again first, and _EvictionRisk raised if it still may.
        """
        conn = self._built_connection()
        if conn.watch is not None and not conn.watch.safe:
            self._check_shared_pool(conn)
        return conn

    def _built_connection(self):
        """The client and scripts, built on first use (building does no I/O)."""
        conn = self._conn
        if conn is None:
            conn = built_once(self, "_conn", self._conn_lock, self._connect)
        return conn

    def _check_shared_pool(self, conn):
        pool = conn.client.connection_pool
        try:
            maxmemory, policy = read_eviction_settings(conn.client)
        except redis.exceptions.ResponseError as exc:
            refusal = unknown_policy_refusal(self.alias, _pool_label(pool), exc)
        else:
            refusal = eviction_refusal(self.alias, _pool_label(pool), maxmemory, policy)
        conn.watch.safe = refusal is None
        if refusal is not None:
            raise _EvictionRisk(refusal)

    def close(self):
        """Disconnect our connection pool (a django-redis one is left to django-redis)
        and the connections our lock commands keep beside it, and forget the asyncio
        clients (see :meth:`aclose`). Undos still being sent again (redis_undo) go
        on, on a connection of their own making: the backend, kept by their thread,
        is garbage once they are done, and its connections with it."""
        with self._conn_lock:
            conn, self._conn = self._conn, None
            entries, self._async_conns = self._async_conns, {}
        if conn is not None:
            conn.close()
        for entry in entries.values():
            loop, pid, async_conn = entry
            if pid != os.getpid():
                _INHERITED_ASYNC.append(entry)  # see there
            # An open loop's sockets are that loop's to close (aclose); a closed
            # loop's can only be closed here.
            elif loop.is_closed() and async_conn is not None:
                _close_sockets_of(async_conn.client)

    async def aclose(self):
        """Disconnect the running event loop's asyncio client (the others belong to
        other loops: a closed loop's are closed when another loop first uses this
        backend, see _aconnection, or by :meth:`close`)."""
        loop = asyncio.get_running_loop()
        with self._conn_lock:
            entry = self._async_conns.get(id(loop))
            if entry is not None and entry[0] is loop:
                del self._async_conns[id(loop)]
            else:
                entry = None
        if entry is not None and entry[2] is not None:
            from .redis_asyncio import close_pool

            client = entry[2].client
            await client.aclose()
            # A client given its pool leaves it open on aclose(): the pool is ours.
            await close_pool(client.connection_pool)

    # -- asyncio -------------------------------------------------------------------

    def _aconnection(self):
        """The running event loop's asyncio client and scripts (built on first use in
        each loop and process), or None if this configuration has none (Sentinel,
        Cluster, a custom CLIENT_CLASS: see redis_asyncio); the async methods then
        run the sync ones in threads."""
        loop = asyncio.get_running_loop()
        me = os.getpid()  # not a fork hook's: uWSGI forks without running them
        entry = self._async_conns.get(id(loop))
        if entry is None or entry[0] is not loop or entry[1] != me:
            sync = self._built_connection()
            with self._conn_lock:
                entry = self._async_conns.get(id(loop))
                if entry is None or entry[0] is not loop or entry[1] != me:
                    # A loop's client keeps its loop alive (its connections'
                    # transports refer to it), so entries never go by themselves:
                    # each new loop drops those of the loops that have been closed
                    # (asyncio.run and async_to_sync make one per call), and closes
                    # their sockets, which no closed loop can do any more.
                    for key, (other, pid, conn) in list(self._async_conns.items()):
                        if other.is_closed() or pid != me:
                            entry = self._async_conns.pop(key)
                            if pid != me:
                                _INHERITED_ASYNC.append(entry)  # see there
                            elif conn is not None:
                                _close_sockets_of(conn.client)
                    entry = (loop, me, self._async_connect(sync))
                    self._async_conns[id(loop)] = entry
        return entry[2]

    def _async_connect(self, sync):
        from . import redis_asyncio

        check = None
        if not self.allow_eviction:
            alias = self.alias
            check = redis_asyncio.AsyncEvictionCheck(
                refusal_for=lambda maxmemory, policy, server: eviction_refusal(
                    alias, server, maxmemory, policy
                ),
                unknown_policy=lambda error, server: unknown_policy_refusal(alias, server, error),
                refusal_error=_EvictionRisk,
            )
        client = redis_asyncio.async_client_from(sync.client, check)
        if client is None:
            return None
        return _AsyncConnection(
            client, client.connection_pool.connection_kwargs.get("socket_timeout"), self.key_prefix
        )

    async def aacquire(self, name, token, ttl, owner, wait=0.0):
        """Async twin of :meth:`acquire`, on the event loop's own client."""
        conn = self._aconnection()
        if conn is None:
            return await super().aacquire(name, token, ttl, owner, wait)
        ttl_ms = self.check_ttl(ttl)
        wait_ms = -1 if wait is None else int(min(max(wait, 0), WAITER_MS / 1000) * 1000)
        retries = self._undo_retries
        withdrew = retries is not None and retries.has(name, token)
        if withdrew:
            # Trying again with that token (see redis_undo): in a thread, since an
            # attempt of the undo being sent now (maybe by a task of this loop) is
            # waited for.
            try:
                await asyncio.to_thread(retries.withdraw, name, token)
            except asyncio.CancelledError:
                # The thread may take the undo back all the same, and this acquire,
                # which would have replaced it, is not sent: the undo is sent again
                # (review r128). Harmless if the lock is ours or nobody's by then.
                retries.pend(name, token, ttl_ms / 1000)
                raise
        with _ReportedAs(self, "acquire", name, shared=False):
            try:
                won, value = await conn.acquire(
                    keys=self._keys(name),
                    args=[token, ttl_ms, encode_owner(owner), self.retention_ms, wait_ms],
                )
            except (*self._network_errors, asyncio.CancelledError) as error:
                # As in acquire(): the script may have run. Undo it (also when the
                # caller was cancelled mid-call), then report: after UNDO_PATIENCE at
                # most, the undo going on in its own task (see aio.undo), known to
                # the retries from now on: a caller trying again with this token
                # waits for it (see redis_undo). Unless it ran nothing, nor may an
                # earlier attempt under its token have (see _ran_nothing).
                if not self._ran_nothing(error, token, withdrew):
                    self._undo_retries_made().begin(name, token)
                    await undo(
                        self._aabandon_quietly(name, token, ttl_ms / 1000),
                        functools.partial(self._abandon_quietly, name, token, ttl_ms / 1000),
                    )
                mark_undone(error)
                raise
        if won:
            self._aqueued.pop(token, None)
            return AcquireResult.won(value)
        if wait != 0:
            self._aqueued[token] = ttl_ms  # queued: a release may hand it the lock
        return AcquireResult.lost(retry_after=value / 1000)

    async def _aabandon_quietly(self, name, token, ttl):
        """Async twin of :meth:`_abandon_quietly`, its first attempt begun by the
        caller (the retries are sync: a thread of the process, not a task of this
        loop, which may end before the server answers). Cancelled (the loop shuts
        down), it leaves the attempt to its sync twin, which ends it."""
        answered = True
        self._forget_queued(token)
        try:
            conn = self._aconnection()
            if conn is None:  # (not on this loop's client: its sync calls, in a thread)
                await self.astop_waiting(name, token)
            else:
                await self._awithdraw(conn, name, token)
            await self.arelease(name, token)
        except Exception as error:  # noqa: BLE001 - the original error is the one to report
            answered = not self._unanswered(error)
        self._undo_retries_made().end(name, token, answered, ttl)

    async def arelease(self, name, token):
        """Async twin of :meth:`release`."""
        conn = self._aconnection()
        if conn is None:
            return await super().arelease(name, token)
        with _ReportedAs(self, "release", name, shared=False):
            return bool(
                await conn.release(
                    keys=self._keys(name),
                    args=[token, self.retention_ms, self.wake_ms, self.fence_ms],
                )
            )

    async def aextend(self, name, token, ttl):
        """Async twin of :meth:`extend`."""
        conn = self._aconnection()
        if conn is None:
            return await super().aextend(name, token, ttl)
        ttl_ms = self.check_ttl(ttl)
        with _ReportedAs(self, "extend", name, shared=False):
            return bool(
                await conn.extend(
                    keys=[self._keys(name)[0]], args=[token, ttl_ms, self.retention_ms]
                )
            )

    async def aowns(self, name, token):
        """Async twin of :meth:`owns`."""
        conn = self._aconnection()
        if conn is None:
            return await super().aowns(name, token)
        with _ReportedAs(self, "check", name, shared=False):
            return bool(await conn.owns(keys=[self._keys(name)[0]], args=[token]))

    async def aget(self, name):
        """Async twin of :meth:`get`."""
        conn = self._aconnection()
        if conn is None:
            return await super().aget(name)
        with _ReportedAs(self, "get", name, shared=False):
            now, fields = await conn.get(keys=[self._keys(name)[0]])
        return self._info(name, fields, now) if fields else None

    async def astop_waiting(self, name, token):
        """Async twin of :meth:`stop_waiting`."""
        conn = self._aconnection()
        if conn is None:
            return await super().astop_waiting(name, token)
        ttl_ms = self._forget_queued(token)
        try:
            return await self._awithdraw(conn, name, token)
        except LockBackendError as error:
            self._undo_unanswered_withdrawal(error, name, token, ttl_ms)
            raise

    async def _awithdraw(self, conn, name, token):
        """Async twin of :meth:`_withdraw`, on the loop's connection ``conn``."""
        with _ReportedAs(self, "stop waiting for", name, shared=False):
            granted, fencing = await conn.stop_waiting(
                keys=[*self._keys(name), self._inbox_key(name, token)],
                args=[token, self.retention_ms, self.wake_ms, self.fence_ms],
            )
        return AcquireResult.won(fencing) if granted else None

    async def await_release(self, name, *, token, attempt, max_wait, retry_after):
        """Async twin of :meth:`wait`: the waiter's inbox is watched by the loop's one
        waiting connection (see redis_asyncio.InboxWaits): no thread, and no
        connection of its own, per waiting coroutine. Returns None."""
        conn = self._aconnection()
        if conn is None:
            return await super().await_release(
                name, token=token, attempt=attempt, max_wait=max_wait, retry_after=retry_after
            )
        timeout = _block_timeout(conn, max_wait, retry_after, self._aqueued.get(token))
        if timeout is None:
            return None
        with _ReportedAs(self, "wait for", name, shared=False):
            await conn.waits.wait(self._inbox_key(name, token), timeout)
        return None

    def _keys(self, name):
        return lock_keys(self.key_prefix, name)

    def _inbox_key(self, name, token):
        """The list a queued caller with ``token`` blocks on (see _GRANT)."""
        return f"{self.key_prefix}:{{{name}}}:inbox:{token}"

    def _name_from_key(self, key):
        return name_from_lock_key(self.key_prefix, key)

    def _info(self, name, fields, now):
        return record_info(name, self.alias, now, fields)[1]

    def _errors_as(self, action, name=None):
        """A context that reports redis-py's errors (an eviction refusal too) as
        LockBackendError naming the alias, ``action`` and the lock ``name``."""
        return _ReportedAs(self, action, name)

    # -- the atomic operations ----------------------------------------------------

    def acquire(self, name, token, ttl, owner, wait=0.0):
        """Returns ``AcquireResult.won(fencing)`` or ``.lost(retry_after=seconds)``.

        A refused caller that will retry (``wait`` > 0 or None) is queued: a release
        hands the lock straight to the longest-waiting queued caller (see :meth:`wait`).
        Raises ValueError/TypeError for a bad ``ttl`` before anything is sent.
        """
        ttl_ms = self.check_ttl(ttl)
        # The script caps the wait at WAITER_MS anyway; capping here keeps an absurd
        # one (a timeout of 1e20 s) a valid argument.
        wait_ms = -1 if wait is None else int(min(max(wait, 0), WAITER_MS / 1000) * 1000)
        retries = self._undo_retries
        withdrew = retries is not None and retries.has(name, token)
        if withdrew:
            retries.withdraw(name, token)  # trying again with that token: see redis_undo
        with self._errors_as("acquire", name):
            conn = self.connection
            try:
                won, value = conn.acquire(
                    keys=self._keys(name),
                    args=[token, ttl_ms, encode_owner(owner), self.retention_ms, wait_ms],
                )
            except self._network_errors as error:
                # The script may have run before the connection broke: undo it (withdraw
                # from the queue, release what we may hold) so no ghost lock blocks
                # others for a whole ttl, then report the failure (the Lock does not
                # undo it again: see aio.mark_undone). Unless it ran nothing, nor may
                # an earlier attempt under its token have (see _ran_nothing).
                if not self._ran_nothing(error, token, withdrew):
                    self._abandon_quietly(name, token, ttl_ms / 1000)
                mark_undone(error)
                raise
        if won:
            self._queued.pop(token, None)
            return AcquireResult.won(value)
        if wait != 0:
            # Queued: wait() sends this very attempt again right behind its BLPOP.
            self._queued[token] = (ttl_ms, encode_owner(owner))
        return AcquireResult.lost(retry_after=value / 1000)

    def stop_waiting(self, name, token):
        """Withdraw ``token`` from the queue. Returns ``AcquireResult.won(fencing)`` if
        a release handed it the lock meanwhile (the caller holds it), else None."""
        ttl_ms = self._forget_queued(token)
        try:
            return self._withdraw(name, token)
        except LockBackendError as error:
            self._undo_unanswered_withdrawal(error, name, token, ttl_ms)
            raise

    def _forget_queued(self, token):
        """Forget that the caller with ``token`` queued (it leaves the queue, or its
        acquire failed and is undone); returns the ttl (ms) it asked for, or None if
        unknown. Not when the retries send an undo later: a semaphore's token may
        have queued on another slot meanwhile (review r135)."""
        queued = self._queued.pop(token, None)
        ttl_ms = self._aqueued.pop(token, None)
        return queued[0] if queued is not None else ttl_ms

    def _withdraw(self, name, token):
        """STOP_WAITING: what stop_waiting sends, once."""
        with self._errors_as("stop waiting for", name):
            granted, fencing = self.connection.stop_waiting(
                keys=[*self._keys(name), self._inbox_key(name, token)],
                args=[token, self.retention_ms, self.wake_ms, self.fence_ms],
            )
        return AcquireResult.won(fencing) if granted else None

    def _undo_unanswered_withdrawal(self, error, name, token, ttl_ms):
        """After a STOP_WAITING that got no answer: it may have run, and if a release
        had handed the caller the lock, it confirmed it for the caller's whole ttl,
        which the caller, told of an error, never releases (review r134). Its undo
        (STOP_WAITING, then RELEASE under the token) is left to the retries, sent
        from their thread until the server answers it; the error is marked undone."""
        if was_unsent(error) or not self._unanswered(error):
            return
        self._undo_retries_made().pend(name, token, (ttl_ms or 0) / 1000)
        mark_undone(error)

    def _ran_nothing(self, error, token, withdrew):
        """True if an acquire that failed with ``error`` has nothing to undo: the
        server ran nothing of it (a server still loading its data, LOADING; a
        connection refused or failed in its handshake, see aio.mark_unsent), and no
        earlier attempt under ``token`` may have written anything either. One may
        have if the caller queued with it (a release may have handed it the lock, and
        the attempt pipelined behind a sync waiter's BLPOP confirms that: review
        r132), or if an undo of an earlier attempt was just taken back
        (``withdrew``)."""
        if withdrew or token in self._queued or token in self._aqueued:
            return False
        return isinstance(error, redis.exceptions.BusyLoadingError) or was_unsent(error)

    def _abandon_quietly(self, name, token, ttl):
        """After an acquire that got no answer: leave the queue and release whatever
        we hold. An undo that gets no answer either is sent again later, until the
        server answers it (see redis_undo); its errors are never raised (the
        acquire's is the one to report)."""
        retries = self._undo_retries_made()
        retries.begin(name, token)
        self._forget_queued(token)  # (not in _undo_once: see _forget_queued)
        answered = False  # unless it ends (an interruption does not: review r128)
        try:
            answered = self._undo_once(name, token)
        except Exception:  # noqa: BLE001 - answered, with an error: nothing to retry
            answered = True
        finally:
            retries.end(name, token, answered, ttl)

    def _undo_once(self, name, token):
        """Withdraw ``token`` from ``name``'s queue and release what it may hold.
        Returns True if the server answered, False if it did not (see
        :meth:`_unanswered`); raises for an answer that is an error."""
        try:
            self._withdraw(name, token)
            self._release(self.connection, name, token)
        except Exception as error:
            if self._unanswered(error):
                return False
            raise
        return True

    def _unanswered(self, error):
        """True if ``error`` (or the error it was raised from) says the server did not
        run the command, or may not have: a timeout, a broken connection, a server
        still loading its data (BusyLoadingError is a ConnectionError) or busy with
        a script (BUSY)."""
        for _ in range(3):
            if isinstance(error, self._network_errors):
                return True
            if isinstance(error, redis.exceptions.ResponseError) and str(error).startswith("BUSY"):
                return True
            error = error.__cause__
            if error is None:
                return False
        return False

    def _undo_retries_made(self):
        """This backend's UndoRetries, made at the first undo."""
        retries = self._undo_retries
        if retries is None:
            with self._conn_lock:
                retries = self._undo_retries
                if retries is None:
                    retries = self._undo_retries = UndoRetries(self.alias, self._undo_once)
        return retries

    def _release(self, conn, name, token):
        return bool(
            conn.release(
                keys=self._keys(name), args=[token, self.retention_ms, self.wake_ms, self.fence_ms]
            )
        )

    def release(self, name, token):
        """Returns True if the record carried ``token`` and was deleted (or handed to
        the longest-waiting queued caller). Not retried after a connection error (see
        _no_retry): the outcome is then unknown, and LockBackendError says so."""
        with self._errors_as("release", name):
            return self._release(self.connection, name, token)

    def extend(self, name, token, ttl):
        """Returns True if the record carried ``token`` and now expires at now + ttl.
        Raises ValueError/TypeError for a bad ``ttl`` before anything is sent."""
        ttl_ms = self.check_ttl(ttl)
        lock_key = self._keys(name)[0]
        with self._errors_as("extend", name):
            return bool(
                self.connection.extend(keys=[lock_key], args=[token, ttl_ms, self.retention_ms])
            )

    def owns(self, name, token):
        """Returns True if ``name`` is held, not expired, under ``token``."""
        with self._errors_as("check", name):
            return bool(self.connection.owns(keys=[self._keys(name)[0]], args=[token]))

    def get(self, name):
        """Returns the LockInfo of ``name`` (held or stale), or None."""
        with self._errors_as("get", name):
            now, fields = self.connection.get(keys=[self._keys(name)[0]])
        return self._info(name, fields, now) if fields else None

    def get_many(self, names):
        """``{name: LockInfo or None}``, each as :meth:`get` gives it: the scripts of
        GET_MANY_CHUNK names at a time in one pipeline (on a Redis Cluster, whose
        pipelines do not load scripts, one name at a time)."""
        names = list(dict.fromkeys(names))
        if not names:
            return {}
        with self._errors_as("get", names[0]):
            conn = self.connection
        if getattr(conn.client, "get_primaries", None) is not None:
            return super().get_many(names)
        found = {}
        for start in range(0, len(names), GET_MANY_CHUNK):
            chunk = names[start : start + GET_MANY_CHUNK]
            with self._errors_as("get", chunk[0]):
                pipe = conn.client.pipeline(transaction=False)
                for name in chunk:
                    conn.get(keys=[self._keys(name)[0]], client=pipe)
                replies = pipe.execute()
            for name, (now, fields) in zip(chunk, replies):
                found[name] = self._info(name, fields, now) if fields else None
        return found

    def delete(self, name, fencing_token=None):
        """Force-release ``name`` (a queued waiter gets it next); with
        ``fencing_token``, only if the record still carries it, in the same script.
        Returns the removed LockInfo or None."""
        expected = "" if fencing_token is None else str(int(fencing_token))
        with self._errors_as("delete", name):
            now, fields = self.connection.delete(
                keys=self._keys(name),
                args=[self.retention_ms, self.wake_ms, self.fence_ms, "", expected],
            )
        return self._info(name, fields, now) if fields else None

    # -- listing and clearing -----------------------------------------------------

    def _scan_clients(self, conn):
        """Plain clients on every server that holds keys: the client itself, or one
        per primary of a Redis Cluster (SCAN and pipelines then run node by node, and
        every key a node's SCAN returns lives in a slot of that node)."""
        get_primaries = getattr(conn.client, "get_primaries", None)
        if get_primaries is None:
            return [conn.client]
        return [conn.client.get_redis_connection(node) for node in get_primaries()]

    def _scan_all(self, action, glob, suffix="lock", type_=None, with_names=True):
        """Yield ``(client, keys, names)`` per SCAN call on every server (see
        _scan_clients), maybe empty: the ``P:{N}:<suffix>`` keys of the names ``glob``
        matches (every one when ``glob`` is None), of any type unless ``type_``.
        ``names`` is None when not ``with_names`` and there is no glob (a listing
        that decodes only the names it shows).

        ``SCAN MATCH`` only narrows the scan to the glob's literal prefix, escaped
        (redis_match: a superset of its matches); Glob.match decides, in Python.
        """
        match = f"{self._match_head}{redis_match(glob) if glob is not None else '*'}}}:{suffix}"
        head, tail = len(self.key_prefix) + 2, -len(suffix) - 2
        with self._errors_as(action):
            clients = self._scan_clients(self.connection)
        for client in clients:

            def scan(cursor, client=client):
                with self._errors_as(action):
                    return client.scan(cursor, match=match, count=SCAN_COUNT, _type=type_)

            for keys in scan_batches(scan):
                if not (with_names or glob):
                    yield client, keys, None
                    continue
                found = [
                    (
                        key,
                        _lenient_text(key)[head:tail]
                        if suffix != "lock"
                        else self._name_from_key(key),
                    )
                    for key in keys
                ]
                if glob is not None:
                    found = [(key, name) for key, name in found if glob.match(name)]
                yield client, [key for key, _ in found], [name for _, name in found]

    def list(self, *, state=None, name_glob=None):
        """Yield a LockInfo per record (held and stale), one SCAN batch at a time.

        Unsorted; SCAN may, rarely, return a key twice (while Redis rehashes).
        Raises ValueError for an unknown ``state`` or a malformed ``name_glob`` at
        once, before anything is sent. A record that cannot be parsed is listed as
        LockInfo.unreadable.
        """
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        glob = compile_glob(name_glob) if name_glob else None
        return self._iter_infos(state, glob)

    def page(self, *, state=None, name_glob=None, ordering=(), offset=0, limit=100):
        """In the default order, the names come from SCAN (key names only; with a
        state, one script call per SCAN batch keeps the keys in that state), and only
        the page's records are read: nothing is read for the locks a page skips. When
        SCAN finds at most paging.SORT_LIMIT lock keys within SORT_SCAN_CALLS calls,
        the matches are sorted by name and counted; beyond, pages follow SCAN order
        (stable while Redis does not resize its key table), sorted within a page,
        with no total. A page sorted by a column is the default one (the records of
        :meth:`list`)."""
        ordering = check_ordering(ordering)
        if ordering:
            return super().page(
                state=state, name_glob=name_glob, ordering=ordering, offset=offset, limit=limit
            )
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        offset, limit = check_window(offset, limit)
        glob = compile_glob(name_glob) if name_glob else None
        batches = (
            (len(keys), [(client, key) for key in self._in_state(client, keys, state)])
            for client, keys, _ in self._scan_all("list", glob, with_names=False)
        )
        first, examined, complete = [], 0, True
        for calls, (count, found) in enumerate(batches, 1):
            first.extend(found)
            examined += count
            if examined > paging.SORT_LIMIT or calls >= SORT_SCAN_CALLS:
                complete = False
                break
        if complete:
            # SCAN may return a key twice while Redis rehashes: each key once.
            found = sorted(
                dict(((key, client) for client, key in first)).items(),
                key=lambda item: self._name_from_key(item[0]),
            )
            total = sorted_count = len(found)
            found = [(client, key) for key, client in found[offset : offset + limit]]
        else:
            rest = itertools.chain(
                first, itertools.chain.from_iterable(found for _count, found in batches)
            )
            found, seen, total, sorted_count = [], 0, None, 0
            for pair in rest:
                if seen >= offset + limit:
                    break
                if seen >= offset:
                    found.append(pair)
                seen += 1
            else:
                total = seen
        by_client = {}
        for client, key in dict.fromkeys(found):
            by_client.setdefault(client, []).append(key)
        infos = [
            info for client, keys in by_client.items() for info in self._records(client, keys)
        ]
        infos.sort(key=lambda info: info.name)
        return LockPage(infos, total, sorted_count)

    def _in_state(self, client, keys, state):
        """The lock ``keys`` (on the server of ``client``) whose record is in
        ``state`` (all of them for None), by Redis' clock."""
        if state is None or not keys:
            return keys
        with self._errors_as("list"):
            if getattr(self.connection.client, "get_primaries", None) is None:
                script = client.register_script(redis_scripts.FILTER_BY_STATE)
                kept = set(script(keys=keys, args=["1" if state == HELD else "0"]))
                return [key for key in keys if key in kept]
            # A Cluster node: a script cannot take keys of several slots.
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "expires")
            pipe.time()
            *expiries, (seconds, micros) = pipe.execute(raise_on_error=False)
        now = int(seconds) * 1000 + int(micros) // 1000
        # The rule of every listing (LockInfo.from_record) on ``expires``: the scripts
        # judge a Redis lock held by it alone.
        return [
            key
            for key, expires in zip(keys, expiries)
            if (
                state == STALE
                if isinstance(expires, Exception)
                else LockInfo.from_record(
                    "",
                    self.alias,
                    now,
                    owner="{}",
                    acquired=None,
                    expires=expires,
                    fencing=0,
                    raw=None,
                ).state
                == state
            )
        ]

    def _iter_infos(self, state, glob):
        for client, keys, _names in self._scan_all("list", glob, with_names=False):
            for info in self._records(client, keys):
                if state is None or info.state == state:
                    yield info

    def _records(self, client, keys):
        """The LockInfos of the lock ``keys`` on the server of ``client``, read in one
        pipeline with Redis' clock; keys gone meanwhile are left out. A key of another
        type (WRONGTYPE) or whose name is not UTF-8 is an unreadable record."""
        if not keys:
            return []
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        pipe.time()
        with self._errors_as("list"):
            *records, (seconds, micros) = pipe.execute(raise_on_error=False)
        now = int(seconds) * 1000 + int(micros) // 1000
        infos = []
        for key, fields in zip(keys, records):
            if isinstance(fields, redis.exceptions.ResponseError):
                fields = {"error": str(fields)}
            if not fields:  # released between SCAN and HGETALL
                continue
            name = self._name_from_key(key)
            if not _is_text(name):
                infos.append(LockInfo.unreadable(printable_name(name), self.alias, now, fields))
            else:
                infos.append(self._info(name, fields, now))
        return infos

    def clear(
        self, *, include_held=False, name_glob=None, older_than=None, dry_run=False, progress=None
    ):
        """Remove stale records (held ones too with ``include_held``) and return a
        ClearResult. Each key is re-checked atomically by a script at removal time;
        ``:fence`` keys and keys outside the prefix are never touched. Unreadable
        records are stale (see _unreadable). Raises ValueError for a malformed
        ``name_glob`` or a negative ``older_than`` before anything is sent."""
        glob = compile_glob(name_glob) if name_glob else None
        if older_than is None:
            older_than_ms = ""
        elif (
            isinstance(older_than, numbers.Real)
            and not isinstance(older_than, bool)
            and older_than >= 0
        ):
            # Beyond the scripts' limit (31 years) nothing is that old anyway.
            older_than_ms = int(min(older_than * 1000, MAX_SCRIPT_MS))
        else:
            raise ValueError(
                f"older_than must be None or a number of seconds >= 0, got {older_than!r}."
            )
        result = ClearResult(self.alias)
        args = [
            int(bool(include_held)),
            self.retention_ms,
            self.wake_ms,
            older_than_ms,
            int(bool(dry_run)),
            self.fence_ms,
        ]
        with self._errors_as("clear"):
            conn = self.connection
        for client, _, names in self._scan_all("clear", glob):
            if not names:
                continue
            # One script call per key, pipelined: each is atomic, and per-key calls
            # keep each script's keys in one Cluster slot (of the node scanned).
            pipe = client.pipeline(transaction=False)
            for name in names:
                conn.clear(keys=scanned_keys(self.key_prefix, name), args=args, client=pipe)
            with self._errors_as("clear"):
                done = pipe.execute()
            removed = [printable_name(name) for name, removed in zip(names, done) if removed]
            if removed:
                result.names.extend(removed)
                if progress is not None:
                    progress(removed)
        if not dry_run:
            self._drop_legacy_fences(glob)
        return result

    def _drop_legacy_fences(self, glob):
        """Remove the fence counters of django-setnx 0.1, which had no expiry (one per
        name ever locked). Today's ``P:{N}:fence`` keys always have one, and every
        token minted now is larger than any such counter (a µs clock)."""
        for client, keys, _names in self._scan_all("clear", glob, "fence", "string"):
            if not keys:
                continue
            with self._errors_as("clear"):
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.pttl(key)
                legacy = [key for key, ttl in zip(keys, pipe.execute()) if ttl == -1]
                # One key per command: on a Cluster, keys of different slots.
                pipe = client.pipeline(transaction=False)
                for key in legacy:
                    pipe.unlink(key)
                pipe.execute()

    # -- waiting ------------------------------------------------------------------

    def wait(self, name, *, token, attempt, max_wait, retry_after):
        """Block on ``token``'s inbox until a release hands it the lock, the holder's
        expiry, ``max_wait`` or ``WAIT_BLOCK``.

        The caller's next attempt is pipelined right behind the ``BLPOP`` on the same
        connection: Redis runs it the moment the ``BLPOP`` returns, before this
        process has even woken up, so a handoff costs one wake-up, not a wake-up and
        a round trip. That attempt confirms a lock handed to us (a claim, see _GRANT),
        takes over one whose claim lapsed, or queues us again. Returns
        ``AcquireResult.won(fencing)`` when it won, its refusal (``AcquireResult.lost``:
        it queued us again, so the caller waits again without an attempt of its own)
        when it did not, None if no attempt was made (the caller retries).
        Also None when the connection broke while blocked: the retry reconnects and
        finds out (an attempt that ran before the reply was lost left our token on
        the lock, which ACQUIRE recognises; if the server is down, it raises
        LockBackendError)."""
        with self._errors_as("wait for", name):
            conn = self.connection
            queued = self._queued.get(token)
            ttl_ms = None if queued is None else queued[0]
            timeout = _block_timeout(conn, max_wait, retry_after, ttl_ms)
            if timeout is None:
                return None
            try:
                result = self._block_then_retry(conn, name, token, timeout, max_wait)
            except self._network_errors:
                return None
        if result is not None and result.acquired:
            self._queued.pop(token, None)
        return result

    def _block_then_retry(self, conn, name, token, timeout, max_wait):
        """``BLPOP`` our inbox for up to ``timeout`` s with our next ACQUIRE pipelined
        behind it. Returns that attempt's AcquireResult, won or refused, or None if
        none was made.
        The message itself does not matter: a wake-up, or the token of a lock handed
        to us, which the attempt confirms."""
        queued = self._queued.get(token)
        inbox = self._inbox_key(name, token)
        if queued is None:  # not queued by acquire() (a direct call): only block
            conn.client.blpop([inbox], timeout=timeout)
            return None
        ttl_ms, owner_json = queued
        keys = self._keys(name)
        wait_ms = -1 if max_wait is None else int(min(max(max_wait, 0), WAITER_MS / 1000) * 1000)
        args = [token, ttl_ms, owner_json, self.retention_ms, wait_ms]
        client = conn.client
        attempt_command = ("EVALSHA", conn.acquire.sha, len(keys), *keys, *args)
        if _sends_plainly(client):
            reply, attempt = _pipeline_on_pool(
                client, [("BLPOP", inbox, timeout), attempt_command], conn.links
            )
        else:
            with client.pipeline(transaction=False) as pipe:
                pipe.blpop([inbox], timeout=timeout)
                pipe.execute_command(*attempt_command)
                reply, attempt = pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(attempt, redis.exceptions.NoScriptError):
            attempt = conn.acquire(keys=keys, args=args)  # loads the script, runs it
        elif isinstance(attempt, Exception):
            raise attempt
        won, value = attempt
        return AcquireResult.won(value) if won else AcquireResult.lost(retry_after=value / 1000)
