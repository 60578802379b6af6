"""Refusing a Redis that may evict lock keys: an evicted lock is a lock a second
holder can take while the first still runs. Used by the Redis and Redlock backends:
our own clients check every new connection's server in a connect hook, and a
django-redis pool we share is watched (:class:`_SharedPoolWatch`).
"""

import contextlib
import threading
import weakref

from ..forksafe import ForkSafeLock

try:
    import redis
except ImportError:  # the backends report it (require_redis_py)
    redis = None  # type: ignore[assignment]

#: The option that accepts a Redis which may evict lock keys (see eviction_refusal).
ALLOW_EVICTION_OPTION = "ALLOW_EVICTION"


_RedisError: type[Exception] = redis.exceptions.RedisError if redis is not None else Exception


class _EvictionRisk(_RedisError):  # type: ignore[valid-type,misc]
    """A server that may evict lock keys, found while connecting (inside redis-py).

    A RedisError, so that redis-py closes the connection it was found on; not a
    ConnectionError, so that nothing retries it. The backend reports it as
    LockBackendError.
    """


def reply_text(value):
    """A reply as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def read_eviction_settings(client):
    """``(maxmemory, policy)`` of the server behind ``client`` (one connection's view).

    ``CONFIG GET`` first; managed services (ElastiCache, Memorystore, ...) often
    disable ``CONFIG``, so ``INFO memory`` is the fallback. Raises redis-py's errors
    if neither answers.
    """
    try:
        return settings_from_config(client.config_get("maxmemory*"))
    except redis.exceptions.ResponseError:
        return settings_from_info(client.info("memory"))


def settings_from_config(config):
    """``(maxmemory, policy)`` from a ``CONFIG GET maxmemory*`` dict."""
    return int(config.get("maxmemory", 0) or 0), reply_text(config.get("maxmemory-policy", ""))


def settings_from_info(info):
    """``(maxmemory, policy)`` from an ``INFO memory`` dict."""
    return int(info.get("maxmemory", 0) or 0), reply_text(info.get("maxmemory_policy", ""))


def config_reply(reply):
    """A raw ``CONFIG GET`` reply (a flat list, or a map on RESP3) as a dict."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])
    return {reply_text(key): value for key, value in pairs}


def info_reply(reply):
    """A raw ``INFO`` reply (text) as a dict of its ``key:value`` lines."""
    lines = reply_text(reply).splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line and line[0] != "#")


def eviction_refusal(alias, server, maxmemory, policy):
    """The message refusing a server that may evict lock keys, or None if it cannot.

    Keys can only be evicted when ``maxmemory`` is set and the policy is not
    ``noeviction``: ``volatile-*`` policies evict keys with a TTL (every lock
    record has one), ``allkeys-*`` evict anything. An evicted lock is a lock that
    another client can take while its holder still runs.
    """
    if not maxmemory or policy == "noeviction":
        return None
    return (
        f"Redis {server} has maxmemory-policy {policy!r} with maxmemory {maxmemory}: it may "
        f"evict lock keys, and an evicted lock can be taken by a second holder while the "
        f"first still runs. Use a Redis (or a database) with maxmemory-policy noeviction for "
        f"locks, or set SETNX_LOCKS[{alias!r}]['OPTIONS'][{ALLOW_EVICTION_OPTION!r}] = True "
        f"to accept the risk."
    )


def unknown_policy_refusal(alias, server, error):
    """The message refusing a server whose eviction policy cannot be read."""
    return (
        f"Redis {server} answers neither CONFIG GET nor INFO memory ({error}), so whether "
        f"it may evict lock keys is unknown. Allow one of them for this user, or set "
        f"SETNX_LOCKS[{alias!r}]['OPTIONS'][{ALLOW_EVICTION_OPTION!r}] = True to accept "
        f"the risk."
    )


class _OneConnection:
    """The two commands read_eviction_settings sends, on one raw connection and shaped
    as redis-py's client methods return them: inside a connect hook there is a
    connection, but no client to send them through."""

    def __init__(self, connection):
        self._connection = connection

    def _call(self, *args):
        self._connection.send_command(*args)
        return self._connection.read_response()  # raises ResponseError for an error reply

    def config_get(self, pattern):
        return config_reply(self._call("CONFIG", "GET", pattern))

    def info(self, section):
        return info_reply(self._call("INFO", section))


def _connection_label(connection):
    path = getattr(connection, "path", None)
    return path or f"{connection.host}:{connection.port}"


def _refusal_on(alias, connection):
    """The refusal message for the server behind a fresh ``connection``, or None."""
    server = _connection_label(connection)
    try:
        maxmemory, policy = read_eviction_settings(_OneConnection(connection))
    except redis.exceptions.ResponseError as exc:
        return unknown_policy_refusal(alias, server, exc)
    return eviction_refusal(alias, server, maxmemory, policy)


class _EvictionCheck:
    """The ``redis_connect_func`` of our own client: every new connection reads its
    server's eviction policy right after the handshake and raises _EvictionRisk if
    it may evict. redis-py then closes the connection, and the operation that needed
    it fails before sending anything: no lock command ever runs on a server that was
    not checked, including one reached after a reconnect or a Sentinel failover.
    """

    def __init__(self, alias, chained=None):
        self.alias = alias
        # A redis_connect_func from CONNECTION_KWARGS; it does the handshake itself.
        self.chained = chained

    def __call__(self, connection):
        """redis.Redis' contract: called instead of ``connection.on_connect()``."""
        if self.chained is not None:
            self.chained(connection)
        else:
            connection.on_connect()
        self._check(connection)

    def after_handshake(self, connection):
        """RedisCluster's contract: called after its own ``on_connect()``."""
        if self.chained is not None:
            self.chained(connection)
        self._check(connection)

    def _check(self, connection):
        refusal = _refusal_on(self.alias, connection)
        if refusal is not None:
            raise _EvictionRisk(refusal)


class _SharedPoolWatch:
    """The ``redis_connect_func`` installed on a shared django-redis pool.

    It must never break the cache's own connections, so for them it only records
    whether the server may evict (``safe``); the lock operations refuse on that (see
    RedisBackend.connection). A connection made *for* one of our lock operations
    (``lock_operation`` names its alias on this thread) refuses at once, like our own
    client's, so no lock command runs on a new connection before it is checked.
    ``safe`` starts False: unknown until checked.
    """

    def __init__(self, chained=None):
        self.chained = chained
        self.safe = False
        self.lock_operation = threading.local()

    def __call__(self, connection):
        if self.chained is not None:
            self.chained(connection)
        else:
            connection.on_connect()
        alias = getattr(self.lock_operation, "alias", None)
        try:
            refusal = _refusal_on(alias, connection)
        except (redis.exceptions.RedisError, OSError):
            if alias is not None:
                raise
            self.safe = False  # unknown: the next lock operation checks for itself
            return
        self.safe = refusal is None
        if refusal is not None and alias is not None:
            raise _EvictionRisk(refusal)


_WATCHES: weakref.WeakKeyDictionary[object, object] = (
    weakref.WeakKeyDictionary()
)  # pool -> its _SharedPoolWatch
_WATCHES_LOCK = ForkSafeLock()


def _watch_shared_pool(pool):
    """Install (once per pool) and return the _SharedPoolWatch of a shared pool: on its
    future connections, and on the connection objects it already has, which call
    their own ``redis_connect_func`` when they reconnect."""
    with _WATCHES_LOCK:
        watch = _WATCHES.get(pool)
        if watch is not None:
            return watch
        previous = pool.connection_kwargs.get("redis_connect_func")
        watch = _WATCHES[pool] = _SharedPoolWatch(previous)
        with getattr(pool, "_lock", None) or contextlib.nullcontext():
            pool.connection_kwargs["redis_connect_func"] = watch
            # redis-py keeps these in private lists (names differ by pool class);
            # a pool class without them just leaves its existing ones unwatched.
            for attr in ("_available_connections", "_in_use_connections", "_connections"):
                for connection in getattr(pool, attr, None) or ():
                    if getattr(connection, "redis_connect_func", None) is previous:
                        connection.redis_connect_func = watch
        return watch


def _pool_label(pool):
    kwargs = pool.connection_kwargs
    if kwargs.get("path"):
        return kwargs["path"]
    if "host" in kwargs:
        return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
    return f"of service {getattr(pool, 'service_name', '?')!r}"
