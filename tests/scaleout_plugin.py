"""pytest plugin: Redis server sets for Redlock, Sentinel and Cluster.

At configure time, when ``redis`` is among ``settings.TEST_BACKENDS`` and
``SETNX_TEST_REDLOCK_URLS`` is unset, three throwaway masters are started
(:class:`~tests.servers.RedisMasterSet`), marked trusted (a brand-new set, see
``RedlockBackend.trust_nodes``), and their URLs exported in
``SETNX_TEST_REDLOCK_URLS``; the ``redlock`` alias is added to ``SETNX_LOCKS``,
``CONTRACT_ALIASES`` and ``MULTIPROCESS_ALIASES``, so the contract suite and the
race tests run on Redlock too. Spawned child processes inherit the variable and get
the same alias from the block at the end of ``tests/settings.py``.

Fixtures (every server binds 127.0.0.1 and is stopped by the fixture):

- ``redlock_masters3`` / ``redlock_masters5``: session sets of 3 and 5 masters, to
  read and write (not to kill);
- ``make_masters``: a factory of private sets, for tests that kill/restart nodes,
  that need masters not trusted yet, or masters started with their own
  ``redis-server`` arguments;
- ``sentinel_set``: a master, a replica and 3 sentinels (quorum 2, down-after 1 s,
  failover-timeout 3 s), module scope;
- ``redis_cluster``: a 3-primary Redis Cluster, session scope.
"""

import os

import pytest

from tests.servers import (
    RedisClusterSet,
    RedisMasterSet,
    RedisSentinelSet,
    RedisServer,
    TLSRedisServer,
    TLSUnavailable,
)

URLS_ENV = "SETNX_TEST_REDLOCK_URLS"
ALIAS = "redlock"
_session_masters = None


def redlock_settings(urls, **options):
    """The ``SETNX_LOCKS`` entry of a Redlock alias on ``urls`` (as tests/settings.py
    builds it for child processes)."""
    return {
        "BACKEND": "django_setnx.backends.redlock.RedlockBackend",
        "LOCATION": list(urls),
        "KEY_PREFIX": "setnx-test",
        # Generous for a loaded CI machine; a slow node is just a "no" vote.
        "OPTIONS": {"NODE_TIMEOUT": 0.5, **options},
    }


def trust(urls, prefix="setnx-test", **options):
    """Mark brand-new masters trusted (RedlockBackend.trust_nodes) under ``prefix``;
    ``options`` are the backend's OPTIONS (ALLOW_EVICTION to reach masters that may
    evict keys)."""
    from django_setnx.backends.redlock import RedlockBackend

    backend = RedlockBackend(
        "trust", {"LOCATION": list(urls), "KEY_PREFIX": prefix, "OPTIONS": options}
    )
    try:
        marked = backend.trust_nodes()
    finally:
        backend.close()
    if len(marked) != len(urls):
        raise RuntimeError(f"could not mark every master trusted: {marked} of {urls}")


def _enabled(settings):
    return "redis" in getattr(settings, "TEST_BACKENDS", ())


def pytest_configure(config):
    global _session_masters
    from django.conf import settings

    if not settings.configured or not _enabled(settings) or os.environ.get(URLS_ENV):
        return
    _session_masters = RedisMasterSet(3)
    try:
        _session_masters.start()
        trust(_session_masters.urls)
    except BaseException:
        _session_masters.cleanup()
        _session_masters = None
        raise
    os.environ[URLS_ENV] = ",".join(_session_masters.urls)
    if ALIAS not in settings.SETNX_LOCKS:
        settings.SETNX_LOCKS[ALIAS] = redlock_settings(_session_masters.urls)
        settings.CONTRACT_ALIASES.append(ALIAS)
        settings.MULTIPROCESS_ALIASES.append(ALIAS)

    from django_setnx.handler import locks

    locks.reset()


def pytest_unconfigure(config):
    global _session_masters
    if _session_masters is None:
        return
    from django_setnx.handler import locks

    locks.close_all()
    locks.reset()
    _session_masters.cleanup()
    _session_masters = None
    os.environ.pop(URLS_ENV, None)


def _require_redis():
    from django.conf import settings

    if not _enabled(settings):
        pytest.skip("redis is not in settings.TEST_BACKENDS")


@pytest.fixture(scope="session")
def redlock_masters3():
    _require_redis()
    with RedisMasterSet(3) as masters:
        trust(masters.urls)
        yield masters


@pytest.fixture(scope="session")
def redlock_masters5():
    _require_redis()
    with RedisMasterSet(5) as masters:
        trust(masters.urls)
        yield masters


@pytest.fixture
def make_masters():
    """``make_masters(n, trusted=True, server_args=None, tls=())``: a private set of n
    masters, stopped after the test. ``trusted=False`` leaves them brand-new (no
    marker: they sit out MAX_TTL once met); ``server_args`` maps a master's index to
    extra ``redis-server`` arguments (``{2: ["--maxmemory", "64mb"]}``); the masters
    whose index is in ``tls`` listen on TLS only (the test skips where this machine
    cannot run them, see TLSRedisServer)."""
    _require_redis()
    made = []

    def make(count=3, *, trusted=True, server_args=None, tls=()):
        masters = RedisMasterSet(count)
        made.append(masters)
        server_args = server_args or {}
        for index in sorted(set(server_args) | set(tls)):
            masters.servers[index].cleanup()  # replaced before it ever started
            server_class = TLSRedisServer if index in tls else RedisServer
            masters.servers[index] = server_class(*server_args.get(index, ()))
        try:
            masters.start()
        except TLSUnavailable as exc:
            pytest.skip(str(exc))
        if trusted:
            trust(masters.urls, ALLOW_EVICTION=True)
        return masters

    yield make
    for masters in made:
        masters.cleanup()


@pytest.fixture(scope="module")
def sentinel_set():
    _require_redis()
    with RedisSentinelSet(
        "mymaster", replicas=1, sentinels=3, quorum=2, down_after_ms=1000, failover_timeout_ms=3000
    ) as servers:
        yield servers


@pytest.fixture(scope="session")
def redis_cluster():
    _require_redis()
    with RedisClusterSet(3, node_timeout_ms=2000) as cluster:
        yield cluster
