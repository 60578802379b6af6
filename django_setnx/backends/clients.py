"""Client factories for Redis Sentinel and Redis Cluster.

Each is a ``(location, **kwargs) -> client`` callable, the shape of the Redis
backend's ``OPTIONS["CLIENT_CLASS"]``, so :class:`~django_setnx.backends.redis.RedisBackend`
runs unchanged on either::

    "sentinel": {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        "LOCATION": "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster/0",
        "OPTIONS": {
            "CLIENT_CLASS": "django_setnx.backends.clients.sentinel",
            "CONNECTION_KWARGS": {            # for the master's connections
                "password": "master-secret",
                "sentinel_kwargs": {"password": "sentinel-secret"},  # for the sentinels'
            },
        },
    },
    "cluster": {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        "LOCATION": "redis://10.0.0.1:7000/0",   # any node: the others are discovered
        "OPTIONS": {"CLIENT_CLASS": "django_setnx.backends.clients.cluster"},
    },

Sentinel: ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``
(``rediss+sentinel://`` for TLS to the master). A password in the URL is the
master's; the sentinels' own credentials go in ``CONNECTION_KWARGS["sentinel_kwargs"]``.
What the URL sets (its credentials, db, ``?key=value`` arguments) wins over
``CONNECTION_KWARGS`` and the backend's defaults, as in a ``redis://`` URL.
The client is ``Sentinel(...).master_for(service)``: every new connection asks the
sentinels for the current master, and a connection to a demoted master is dropped,
so after a failover the same backend object reaches the new master (and checks its
eviction policy: every new connection does). While the failover is in progress
operations fail with ``LockBackendError``; they never report a write that did not
happen.

Cluster: ``redis.cluster.RedisCluster.from_url``. Every lock's keys share the
``{name}`` hash tag, so each script runs on one node; ``list`` and ``clear`` scan
every primary.

The backend passes its defaults in ``kwargs`` (socket timeouts, no retries, the
eviction check as ``redis_connect_func``); a factory of your own must pass them on
to redis-py.
"""

from urllib.parse import parse_qsl, unquote, urlsplit

from ..validation import redacted

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
DEFAULT_SENTINEL_PORT = 26379
#: The master's connection kwargs the sentinels' connections share unless
#: ``sentinel_kwargs`` is given: the socket options, and the retry policy, so that a
#: dead sentinel is skipped at once rather than after redis-py's default retries with
#: backoff (seconds each).
SHARED_WITH_SENTINELS = ("socket_", "retry")


def parse_sentinel_url(location):
    """Split a ``redis+sentinel://`` URL. Returns ``(sentinels, service, kwargs)``:
    ``[(host, port), ...]``, the master's service name and connection kwargs (``db``,
    ``username``, ``password``, ``ssl`` and any ``?key=value`` query arguments).
    Raises ValueError (TypeError for a non-str) naming the location when it is
    malformed."""
    if not isinstance(location, str):
        raise TypeError(f"a Sentinel LOCATION must be a str, got {redacted(location)}.")
    parts = urlsplit(location)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(
            f"Sentinel LOCATION {redacted(location)} must start with redis+sentinel:// or "
            f"rediss+sentinel://."
        )
    netloc = parts.netloc
    userinfo, _, hosts = netloc.rpartition("@")
    kwargs = {}
    if userinfo:
        username, has_password, password = userinfo.partition(":")
        if has_password:
            if username:
                kwargs["username"] = unquote(username)
            kwargs["password"] = unquote(password)
        else:
            kwargs["password"] = unquote(username)
    sentinels = []
    for hostport in hosts.split(","):
        hostport = hostport.strip()
        if not hostport:
            continue
        if hostport.startswith("["):  # [IPv6]:port
            host, _, rest = hostport[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port = hostport.partition(":")
        try:
            sentinels.append((host, int(port) if port else DEFAULT_SENTINEL_PORT))
        except ValueError:
            # Not the host itself if the URL has credentials: with a "/" in the
            # password, urlsplit ends the netloc early, and the "host" is a piece of
            # the password.
            which = "" if "@" in location else f" ({hostport!r})"
            raise ValueError(
                f"Sentinel LOCATION {redacted(location)}: a sentinel's port is not a "
                f"number{which} (a password's /, # and ? must be percent-encoded)."
            ) from None
    if not sentinels:
        raise ValueError(f"Sentinel LOCATION {redacted(location)} names no sentinel host.")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(
            f"Sentinel LOCATION {redacted(location)} must end with /service_name or "
            f"/service_name/db, e.g. redis+sentinel://host:26379/mymaster/0."
        )
    service = path[0]
    if len(path) == 2:
        try:
            kwargs["db"] = int(path[1])
        except ValueError:
            raise ValueError(
                f"Sentinel LOCATION {redacted(location)}: db {path[1]!r} is not an integer."
            ) from None
    if SENTINEL_SCHEMES[parts.scheme]:
        kwargs["ssl"] = True
    for key, value in parse_qsl(parts.query):
        kwargs[key] = _query_value(value)
    return sentinels, service, kwargs


def _query_value(value):
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    lowered = value.lower()
    if lowered in ("true", "yes"):
        return True
    if lowered in ("false", "no"):
        return False
    return value


def sentinel(location, **kwargs):
    """A ``redis.Redis`` bound to the master that the sentinels of ``location`` name.

    ``kwargs`` (the backend's ``CONNECTION_KWARGS`` and defaults) go to the master's
    connections; ``sentinel_kwargs`` among them to the sentinels' (default: the
    master's ``socket_*`` options and ``retry``, see SHARED_WITH_SENTINELS; never the
    ``redis_connect_func``: a sentinel holds no locks).
    """
    from redis.sentinel import Sentinel

    sentinels, service, url_kwargs = parse_sentinel_url(location)
    # The URL's arguments win, as redis-py's from_url makes them win for a redis://
    # URL: the backend's defaults (socket timeouts) are among ``kwargs``.
    kwargs = {**kwargs, **url_kwargs}
    sentinel_kwargs = kwargs.pop("sentinel_kwargs", None)
    min_other_sentinels = kwargs.pop("min_other_sentinels", 0)
    # TypeError: the backend reports it as its CONNECTION_KWARGS' fault. The
    # messages name types, never values (a password may be one).
    if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, dict):
        raise TypeError(
            f"sentinel_kwargs must be a dict of the sentinels' connection arguments, "
            f"got a {type(sentinel_kwargs).__name__}"
        )
    if not isinstance(min_other_sentinels, int) or min_other_sentinels < 0:
        raise TypeError(
            f"min_other_sentinels must be an int >= 0, got a {type(min_other_sentinels).__name__}"
        )
    if sentinel_kwargs is None:
        sentinel_kwargs = {k: v for k, v in kwargs.items() if k.startswith(SHARED_WITH_SENTINELS)}
    return Sentinel(
        sentinels, min_other_sentinels=min_other_sentinels, sentinel_kwargs=sentinel_kwargs
    ).master_for(service, **kwargs)


def cluster(location, **kwargs):
    """A ``redis.cluster.RedisCluster`` from ``location`` (any node's ``redis://`` URL;
    the other nodes are discovered).

    redis.Redis calls a ``redis_connect_func`` *instead of* the connection's handshake;
    RedisCluster does its own handshake and calls it *after*. A function that has an
    ``after_handshake`` variant for that (the Redis backend's eviction check) is given
    that one, so no connection shakes hands twice.
    """
    from redis.cluster import RedisCluster

    connect = kwargs.get("redis_connect_func")
    if connect is not None:
        kwargs["redis_connect_func"] = getattr(connect, "after_handshake", connect)
    return RedisCluster.from_url(location, **kwargs)
