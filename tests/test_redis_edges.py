"""The Redis backend where Django apps really run, against throwaway servers.

Each test starts the Redis it needs (a ``maxmemory-policy``, ``CONFIG`` renamed away,
an ACL user, an idle ``timeout``, a proxy that loses a reply) with
:class:`~tests.servers.RedisServer`, so no shared server is ever reconfigured:

- eviction: a server that may evict lock keys is refused on every new connection
  (our own client and a shared django-redis pool), before anything is written;
- bad input that writes: a ttl out of range, scripts called directly with bad
  arguments, an alias without LOCATION;
- records that cannot be read (written by hand) never crash get, list or clear;
- timeouts, retries, idle connections dropped by the server, and forks.
"""

import functools
import hashlib
import json
import os
import threading
import time
import traceback
from io import StringIO

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings

if "redis" not in settings.TEST_BACKENDS:
    pytest.skip("redis is not in settings.TEST_BACKENDS", allow_module_level=True)

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from django_setnx import lock, locks
from django_setnx.backends import redis as redis_backend
from django_setnx.backends.redis import RedisBackend, lock_keys
from django_setnx.backends.redis_scripts import (
    ACQUIRE,
    CLEAR,
    DELETE,
    EXTEND,
    MAX_SCRIPT_MS,
    RELEASE,
    STOP_WAITING,
)
from django_setnx.exceptions import LockBackendError
from tests import workers
from tests.servers import RedisServer, ReplyDroppingProxy

BACKEND = "django_setnx.backends.redis.RedisBackend"
OWNER = {"host": "test", "pid": 1, "thread": "t"}
MAY_EVICT = ["--maxmemory", "3mb", "--maxmemory-policy"]


def make_backend(location, alias="edge", prefix="setnx-edge", **options):
    return RedisBackend(
        alias, {"BACKEND": BACKEND, "LOCATION": location, "KEY_PREFIX": prefix, "OPTIONS": options}
    )


def calls(client, command):
    """How many times the server ran ``command`` (subcommands included)."""
    stats = client.info("commandstats")
    return sum(
        stat["calls"]
        for key, stat in stats.items()
        if key == f"cmdstat_{command}" or key.startswith(f"cmdstat_{command}|")
    )


def wait_until(predicate, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def every_operation(backend, name="n", token="tok"):
    """One call of each backend operation, as (label, callable) pairs."""
    return [
        ("acquire", lambda: backend.acquire(name, token, 30, OWNER)),
        ("acquire, queued", lambda: backend.acquire(name, token, 30, OWNER, wait=5)),
        ("release", lambda: backend.release(name, token)),
        ("extend", lambda: backend.extend(name, token, 30)),
        ("owns", lambda: backend.owns(name, token)),
        ("get", lambda: backend.get(name)),
        ("delete", lambda: backend.delete(name)),
        ("stop_waiting", lambda: backend.stop_waiting(name, token)),
        ("list", lambda: list(backend.list())),
        ("clear", lambda: backend.clear(include_held=True)),
        (
            "wait",
            lambda: backend.wait(name, token=token, attempt=0, max_wait=0.05, retry_after=None),
        ),
    ]


def assert_refused(call, alias, policy):
    with pytest.raises(LockBackendError) as excinfo:
        call()
    assert excinfo.value.alias == alias
    message = str(excinfo.value)
    assert f"'{alias}'" in message and f"'{policy}'" in message, message
    assert "ALLOW_EVICTION" in message, message


# -- eviction: our own client -----------------------------------------------------------


@pytest.mark.parametrize(
    "policy", ["allkeys-lru", "volatile-lru", "allkeys-random", "volatile-ttl"]
)
def test_a_server_that_may_evict_is_refused_before_anything_is_written(policy):
    with RedisServer(*MAY_EVICT, policy) as server:
        backend = make_backend(server.url)
        try:
            for _label, call in every_operation(backend):
                assert_refused(call, "edge", policy)
            client = redis.Redis(port=server.port)
            assert client.dbsize() == 0, "a refused backend wrote something"
            assert calls(client, "evalsha") + calls(client, "eval") == 0
            assert calls(client, "scan") + calls(client, "blpop") == 0
        finally:
            backend.close()


@pytest.mark.parametrize(
    "args",
    [
        [*MAY_EVICT, "noeviction"],
        ["--maxmemory", "0", "--maxmemory-policy", "allkeys-lru"],
    ],
)
def test_a_server_that_cannot_evict_is_checked_once_per_connection_and_accepted(args):
    with RedisServer(*args) as server:
        backend = make_backend(server.url)
        client = redis.Redis(port=server.port)
        try:
            for i in range(50):
                assert backend.acquire("n", f"tok{i}", 30, OWNER).acquired
                assert backend.release("n", f"tok{i}")
            # The policy was read, once for the one connection, not per operation.
            assert calls(client, "config") == 1
        finally:
            backend.close()


def test_with_config_disabled_the_policy_is_read_from_info():
    with RedisServer(*MAY_EVICT, "allkeys-lru", "--rename-command", "CONFIG", "") as server:
        client = redis.Redis(port=server.port)
        with pytest.raises(redis.ResponseError):
            client.config_get("maxmemory")  # the managed-Redis situation
        backend = make_backend(server.url)
        try:
            assert_refused(lambda: backend.acquire("n", "tok", 30, OWNER), "edge", "allkeys-lru")
            assert client.dbsize() == 0
        finally:
            backend.close()
    with RedisServer(*MAY_EVICT, "noeviction", "--rename-command", "CONFIG", "") as server:
        client = redis.Redis(port=server.port)
        backend = make_backend(server.url)
        try:
            info_before = calls(client, "info")
            assert backend.acquire("n", "tok", 30, OWNER).acquired
            # Our INFO memory, plus the INFO commandstats that read the first count.
            assert calls(client, "info") == info_before + 2
        finally:
            backend.close()


def test_a_server_whose_policy_cannot_be_read_is_refused():
    with RedisServer(*MAY_EVICT, "noeviction") as server:
        admin = redis.Redis(port=server.port)
        admin.acl_setuser(
            "locker",
            enabled=True,
            passwords=["+secret"],
            keys=["*"],
            channels=["*"],
            commands=["+@all", "-config", "-info"],
        )
        backend = make_backend(f"redis://locker:secret@127.0.0.1:{server.port}/0")
        try:
            with pytest.raises(LockBackendError, match="neither CONFIG GET nor INFO") as exc:
                backend.acquire("n", "tok", 30, OWNER)
            assert "'edge'" in str(exc.value) and "ALLOW_EVICTION" in str(exc.value)
            assert admin.dbsize() == 0
        finally:
            backend.close()


def test_allow_eviction_accepts_the_risk_and_skips_the_check():
    assert (
        RedisBackend.check_params(
            "edge",
            {"BACKEND": BACKEND, "LOCATION": "redis://h/0", "OPTIONS": {"ALLOW_EVICTION": True}},
        )
        == []
    )
    assert "ALLOW_EVICTION" in RedisBackend.option_names  # no "unknown option" warning
    with RedisServer(*MAY_EVICT, "allkeys-lru") as server:
        backend = make_backend(server.url, ALLOW_EVICTION=True)
        client = redis.Redis(port=server.port)
        try:
            assert backend.acquire("n", "tok", 30, OWNER).acquired
            assert backend.release("n", "tok")
            assert calls(client, "config") + calls(client, "info") == 1  # only our count
        finally:
            backend.close()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_allow_eviction_must_be_a_bool(value):
    params = {"BACKEND": BACKEND, "LOCATION": "redis://h/0", "OPTIONS": {"ALLOW_EVICTION": value}}
    assert [e.id for e in RedisBackend.check_params("edge", params)] == ["django_setnx.E019"]
    with pytest.raises(ImproperlyConfigured, match="ALLOW_EVICTION"):
        RedisBackend("edge", params)


def test_a_policy_changed_later_is_refused_on_the_next_connection():
    with RedisServer(*MAY_EVICT, "noeviction") as server:
        backend = make_backend(server.url)
        admin = redis.Redis(port=server.port)
        try:
            assert backend.acquire("held", "tok", 30, OWNER).acquired
            admin.config_set("maxmemory-policy", "allkeys-lru")
            admin.client_kill_filter(_type="normal", skipme=True)  # our connections go
            for _label, call in every_operation(backend, name="other"):
                assert_refused(call, "edge", "allkeys-lru")
            assert not admin.exists(lock_keys("setnx-edge", "other")[0])
            admin.config_set("maxmemory-policy", "noeviction")  # fixed: usable again
            assert backend.release("held", "tok")
        finally:
            backend.close()


# -- eviction: a shared django-redis pool -----------------------------------------------


def cache_settings(url, alias="viacache", **options):
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "shared": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url},
    }
    lock_settings = {
        **settings.SETNX_LOCKS,
        alias: {
            "BACKEND": BACKEND,
            "KEY_PREFIX": "setnx-edge",
            "OPTIONS": {"CACHE": "shared", **options},
        },
    }
    return override_settings(CACHES=caches, SETNX_LOCKS=lock_settings)


def assert_cache_works(key="k"):
    from django.core.cache import caches

    caches["shared"].set(key, "v")
    assert caches["shared"].get(key) == "v"


def test_a_shared_pool_that_may_evict_refuses_locks_but_never_breaks_the_cache():
    with RedisServer(*MAY_EVICT, "allkeys-lru") as server, cache_settings(server.url):
        assert_cache_works()  # the cache had connections before the locks did
        backend = locks["viacache"]
        for _label, call in every_operation(backend):
            assert_refused(call, "viacache", "allkeys-lru")
            assert_cache_works()
        client = redis.Redis(port=server.port)
        assert [k for k in client.scan_iter(match="setnx-edge*")] == []
        with cache_settings(server.url, ALLOW_EVICTION=True):
            assert locks["viacache"].acquire("n", "tok", 30, OWNER).acquired


def test_the_first_operation_of_a_second_alias_on_a_shared_pool_is_checked_too():
    """Two lock aliases share one cache; the first was used while the server could
    not evict, so the pool was last seen safe. The server then may evict and drops
    every connection (a restart with a new configuration): the second alias' very
    first operation runs on a connection of its own, made for it, which refuses at
    once. Nothing is written."""
    with RedisServer(*MAY_EVICT, "noeviction") as server:
        caches = {
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "shared": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": server.url},
        }
        aliases = {
            alias: {
                "BACKEND": BACKEND,
                "KEY_PREFIX": f"setnx-{alias}",
                "OPTIONS": {"CACHE": "shared"},
            }
            for alias in ("first", "second")
        }
        with override_settings(CACHES=caches, SETNX_LOCKS={**settings.SETNX_LOCKS, **aliases}):
            assert locks["first"].acquire("n", "tok", 30, OWNER).acquired
            admin = redis.Redis(port=server.port)
            admin.config_set("maxmemory-policy", "allkeys-lru")
            admin.client_kill_filter(_type="normal", skipme=True)
            assert_refused(
                lambda: locks["second"].acquire("n", "tok", 30, OWNER), "second", "allkeys-lru"
            )
            assert not admin.exists(lock_keys("setnx-second", "n")[0])
            assert_cache_works()


@pytest.mark.parametrize("first_user", ["cache", "lock"])
def test_a_shared_pool_refuses_after_the_policy_changed_and_connections_were_made(first_user):
    """After a change of policy, whichever reconnects first (the cache, or a lock
    operation whose connection is the new one) the lock operations are refused and
    the cache keeps working."""
    with RedisServer(*MAY_EVICT, "noeviction") as server, cache_settings(server.url):
        assert_cache_works()
        backend = locks["viacache"]
        assert backend.acquire("held", "tok", 30, OWNER).acquired
        admin = redis.Redis(port=server.port)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        admin.client_kill_filter(_type="normal", skipme=True)
        if first_user == "cache":
            assert_cache_works()
        assert_refused(
            lambda: backend.acquire("other", "tok", 30, OWNER), "viacache", "allkeys-lru"
        )
        assert_cache_works("k2")
        assert not admin.exists(lock_keys("setnx-edge", "other")[0])
        admin.config_set("maxmemory-policy", "noeviction")
        assert backend.release("held", "tok")  # re-checked: accepted again


# -- eviction and forks -----------------------------------------------------------------


def run_in_child(target):
    """Fork; run ``target()`` in the child and return what it returned (or raised, as
    ``("raised", type name, message)``), via a pipe. The child never returns to pytest."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            try:
                outcome = ("returned", repr(target()))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                outcome = ("raised", type(exc).__name__, str(exc), traceback.format_exc())
            os.write(write_end, json.dumps(outcome).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


@pytest.mark.parametrize("shared", [False, True], ids=["own client", "django-redis pool"])
def test_a_forked_child_checks_its_own_connections(shared):
    """The parent's connection was checked before the policy changed; the child's
    connections are its own, made after the change, and refuse."""
    with RedisServer(*MAY_EVICT, "noeviction") as server:
        admin = redis.Redis(port=server.port)
        with cache_settings(server.url) if shared else override_settings():
            backend = locks["viacache"] if shared else make_backend(server.url)
            alias = "viacache" if shared else "edge"
            try:
                assert backend.acquire("parent", "tok", 30, OWNER).acquired
                admin.config_set("maxmemory-policy", "allkeys-lru")
                outcome = run_in_child(lambda: backend.acquire("child", "tok", 30, OWNER))
                assert outcome[:2] == ["raised", "LockBackendError"], outcome
                assert f"'{alias}'" in outcome[2] and "'allkeys-lru'" in outcome[2], outcome
                assert not admin.exists(lock_keys("setnx-edge", "child")[0])
            finally:
                if not shared:
                    backend.close()


# -- bad input that writes ------------------------------------------------------------


@pytest.fixture
def private_redis():
    """A private server and a client on it; the backend under test uses prefix
    ``setnx-edge``."""
    with RedisServer() as server:
        client = redis.Redis(port=server.port)
        yield server, client
        client.close()


@pytest.mark.parametrize("ttl", [1e20, 10**30, float("inf"), float("nan"), 0, -1, 86400 * 365])
def test_a_ttl_out_of_range_is_refused_before_anything_is_sent(private_redis, ttl):
    server, client = private_redis
    backend = make_backend(server.url)
    try:
        with pytest.raises(ValueError, match="ttl"):
            backend.acquire("n", "tok", ttl, OWNER)
        assert client.dbsize() == 0
        assert backend.acquire("n", "tok", 30, OWNER).acquired
        expires = client.hget(lock_keys("setnx-edge", "n")[0], "expires")
        with pytest.raises(ValueError, match="ttl"):
            backend.extend("n", "tok", ttl)
        assert client.hget(lock_keys("setnx-edge", "n")[0], "expires") == expires
        assert backend.get("n").is_held  # still listable, still releasable
        assert backend.release("n", "tok")
    finally:
        backend.close()


BAD_MS = ["1e+23", "1e20", "-5", "abc", "", "1.5", "0x", str(MAX_SCRIPT_MS + 1), "inf", "nan"]


def script_calls(keys):
    """(label, script, its KEYS, valid ARGV, index of the numeric argument to spoil)."""
    lock_key = keys[0]
    inbox = f"{lock_key[:-4]}inbox:tok"
    return [
        ("ACQUIRE ttl", ACQUIRE, keys, ["tok", "1000", "{}", "1000", "0"], 1),
        ("ACQUIRE retention", ACQUIRE, keys, ["tok", "1000", "{}", "1000", "0"], 3),
        ("ACQUIRE wait", ACQUIRE, keys, ["tok", "1000", "{}", "1000", "0"], 4),
        ("RELEASE retention", RELEASE, keys, ["tok", "1000", "1000"], 1),
        ("RELEASE signal", RELEASE, keys, ["tok", "1000", "1000"], 2),
        ("STOP_WAITING retention", STOP_WAITING, [*keys, inbox], ["tok", "1000", "1000"], 1),
        ("EXTEND ttl", EXTEND, [lock_key], ["tok", "1000", "1000"], 1),
        ("EXTEND retention", EXTEND, [lock_key], ["tok", "1000", "1000"], 2),
        ("DELETE retention", DELETE, keys, ["1000", "1000"], 0),
        ("DELETE signal", DELETE, keys, ["1000", "1000"], 1),
        ("CLEAR include_held", CLEAR, keys, ["1", "1000", "1000", "", "0"], 0),
        ("CLEAR retention", CLEAR, keys, ["1", "1000", "1000", "", "0"], 1),
        ("CLEAR older_than", CLEAR, keys, ["1", "1000", "1000", "", "0"], 3),
        ("CLEAR dry_run", CLEAR, keys, ["1", "1000", "1000", "", "0"], 4),
    ]


def test_every_script_checks_its_numeric_arguments_before_writing(private_redis):
    """Another client (or an older version) calling a script with a bad number gets an
    error and nothing is written: no record without an expiry, no lock released."""
    server, client = private_redis
    keys = lock_keys("setnx-edge", "n")
    backend = make_backend(server.url)
    try:
        for label, script, script_keys, argv, index in script_calls(keys):
            bad_values = (
                ["2", "", "yes"] if label.startswith("CLEAR") and index in (0, 4) else BAD_MS
            )
            if label == "CLEAR older_than":
                bad_values = [v for v in BAD_MS if v != ""]  # '' means "any age"
            for bad in bad_values:
                # A held lock under "tok" with a queued waiter: something to write over.
                client.flushall()
                assert backend.acquire("n", "tok", 30, OWNER).acquired
                assert not backend.acquire("n", "waiter", 30, OWNER, wait=5).acquired
                before = {key: client.dump(key) for key in keys}
                ttls = {key: client.pttl(key) for key in keys}
                spoiled = [*argv]
                spoiled[index] = bad
                with pytest.raises(redis.ResponseError, match="django-setnx") as excinfo:
                    client.eval(script, len(script_keys), *script_keys, *spoiled)
                assert f"got {bad}" in str(excinfo.value), (label, bad)
                assert {key: client.dump(key) for key in keys} == before, (label, bad)
                assert all(abs(client.pttl(key) - ttls[key]) < 1000 for key in keys), (label, bad)
                assert client.exists(f"{keys[0][:-4]}inbox:waiter") == 0
    finally:
        backend.close()


def test_an_alias_without_location_fails_at_creation_naming_it():
    for params in (
        {"BACKEND": BACKEND},
        {"BACKEND": BACKEND, "LOCATION": "redis://h/0", "OPTIONS": {"CACHE": "x"}},
        {"BACKEND": BACKEND, "LOCATION": ""},
    ):
        with (
            override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "nowhere": params}),
            pytest.raises(ImproperlyConfigured, match=r"SETNX_LOCKS\['nowhere'\]"),
        ):
            locks["nowhere"]


# -- records that cannot be read --------------------------------------------------------


UNREADABLE = {
    "only-a-token": {"token": "t"},
    "owner-not-json": {
        "token": "t",
        "fencing": "1",
        "owner": "{oops",
        "acquired": "1",
        "expires": "2",
    },
    "owner-a-list": {
        "token": "t",
        "fencing": "1",
        "owner": "[1]",
        "acquired": "1",
        "expires": "2",
    },
    "expires-a-word": {
        "token": "t",
        "fencing": "1",
        "owner": "{}",
        "acquired": "1",
        "expires": "soon",
    },
    "expires-1e20": {
        "token": "t",
        "fencing": "1",
        "owner": "{}",
        "acquired": "1",
        "expires": "1e20",
    },
    "no-fencing": {"token": "t", "owner": "{}", "acquired": "1", "expires": "2"},
    "bad-utf8": {
        "token": "t",
        "fencing": "1",
        "owner": b"{\xff}",
        "acquired": "1",
        "expires": "2",
    },
}


def test_unreadable_records_never_crash_get_list_or_clear(private_redis):
    server, client = private_redis
    backend = make_backend(server.url)
    try:
        for name, fields in UNREADABLE.items():
            client.hset(lock_keys("setnx-edge", name)[0], mapping=fields)
        # A broken record whose expiry is readable and ahead blocks acquires (the
        # scripts judge by expires alone), so it is shown as held, never as stale.
        far = int(time.time() * 1000) + 3_600_000
        client.hset(
            lock_keys("setnx-edge", "held-broken")[0],
            mapping={"token": "t", "owner": "{oops", "expires": far},
        )
        assert backend.acquire("fine", "tok", 30, OWNER).acquired

        for name in UNREADABLE:
            info = backend.get(name)
            assert info.is_stale and info.fencing_token == 0, name
            assert "unreadable" in info.owner, name
            info.as_dict()  # what listlocks --json prints
        held_broken = backend.get("held-broken")
        assert held_broken.is_held and held_broken.expires_at_ms == far
        assert {i.name for i in backend.list(state="stale")} == set(UNREADABLE)
        assert {i.name for i in backend.list(state="held")} == {"held-broken", "fine"}
        # The admin's pages filter by state in a script: the same verdicts.
        assert {i.name for i in backend.page(state="stale").infos} == set(UNREADABLE)
        assert {i.name for i in backend.page(state="held").infos} == {"held-broken", "fine"}

        # An unreadable name can be taken (it blocks nobody)...
        assert backend.acquire("expires-1e20", "tok", 30, OWNER).acquired
        assert backend.get("expires-1e20").owner == OWNER
        assert not backend.acquire("held-broken", "tok", 30, OWNER).acquired
        # ...and clear (stale mode) removes exactly the unreadable stale ones.
        stale = set(UNREADABLE) - {"expires-1e20"}
        assert set(backend.clear(dry_run=True).names) == stale
        assert set(backend.clear().names) == stale
        assert {i.name for i in backend.list()} == {"held-broken", "fine", "expires-1e20"}
        assert backend.clear(include_held=True, older_than=3600).names == ["held-broken"]
    finally:
        backend.close()


def test_listlocks_and_clearlocks_handle_an_unreadable_record(private_redis):
    server, client = private_redis
    params = {"BACKEND": BACKEND, "LOCATION": server.url, "KEY_PREFIX": "setnx-edge"}
    client.hset(lock_keys("setnx-edge", "by-hand")[0], mapping={"token": "t", "expires": "x"})
    with override_settings(
        SETNX_LOCKS={"default": settings.SETNX_LOCKS["default"], "private": params}
    ):
        out = StringIO()
        call_command("listlocks", "--backend", "private", "--json", stdout=out)
        [record] = [json.loads(line) for line in out.getvalue().splitlines()]  # NDJSON
        assert record["name"] == "by-hand" and record["state"] == "stale"
        call_command("clearlocks", "--backend", "private", stdout=StringIO(), stderr=StringIO())
        assert client.exists(lock_keys("setnx-edge", "by-hand")[0]) == 0
        locks.close_all()


# -- timeouts and retries -------------------------------------------------------------


def retries(retry):
    """How many times ``retry`` (a redis-py Retry) retries: ``get_retries()`` is
    redis-py >= 5.1's, the attribute older versions'."""
    get = getattr(retry, "get_retries", None)
    return get() if get is not None else retry._retries


def test_our_client_has_socket_timeouts_and_no_retries_by_default(private_redis):
    server, _ = private_redis
    backend = make_backend(server.url)
    try:
        kwargs = backend.connection.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == redis_backend.DEFAULT_SOCKET_TIMEOUT
        assert kwargs["socket_connect_timeout"] == redis_backend.DEFAULT_SOCKET_CONNECT_TIMEOUT
        assert retries(kwargs["retry"]) == 0
        assert backend.connection.max_block < redis_backend.DEFAULT_SOCKET_TIMEOUT
    finally:
        backend.close()
    mine = make_backend(
        server.url, CONNECTION_KWARGS={"socket_timeout": 0.5, "retry": Retry(NoBackoff(), 3)}
    )
    try:
        kwargs = mine.connection.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.5 and retries(kwargs["retry"]) == 3
        assert mine.connection.max_block < 0.5
    finally:
        mine.close()


RELEASE_SHA = hashlib.sha1(RELEASE.encode()).hexdigest().encode()
ACQUIRE_SHA = hashlib.sha1(ACQUIRE.encode()).hexdigest().encode()
STOP_WAITING_SHA = hashlib.sha1(STOP_WAITING.encode()).hexdigest().encode()


def assert_a_lost_release_reply_is_reported(proxy, client, alias):
    """The release of lock "n" on ``alias`` runs, but its reply is lost: the Lock
    reports LockBackendError (outcome unknown), never a takeover."""
    with lock("n", ttl=30, backend=alias):  # both scripts are loaded: EVALSHA from now on
        pass
    held = lock("n", ttl=30, backend=alias)
    assert held.acquire(blocking=False)
    proxy.drop_reply_to(RELEASE_SHA)
    with pytest.raises(LockBackendError, match=f"'{alias}'"):
        held.release()
    assert proxy.dropped == 1
    assert client.exists(lock_keys("setnx-edge", "n")[0]) == 0  # it did run


def test_a_release_whose_reply_was_lost_is_not_retried_into_not_ours(private_redis):
    """The release ran; the reply never came. A retry would find the record gone and
    report "not ours" (LockNotOwned: "taken over by another owner"), which is false.
    Not retried, the outcome is reported as unknown: LockBackendError."""
    server, client = private_redis
    with ReplyDroppingProxy(server.port) as proxy:
        params = {"BACKEND": BACKEND, "LOCATION": proxy.url, "KEY_PREFIX": "setnx-edge"}
        with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "proxied": params}):
            assert_a_lost_release_reply_is_reported(proxy, client, "proxied")

            # An acquire whose reply is lost is reported, and leaves no ghost lock.
            proxy.drop_reply_to(ACQUIRE_SHA)
            with pytest.raises(LockBackendError, match="'proxied'"):
                lock("n", ttl=30, backend="proxied").acquire(blocking=False)
            assert client.exists(lock_keys("setnx-edge", "n")[0]) == 0
            with lock("n", ttl=30, backend="proxied", timeout=0) as again:
                assert again.owned()
            locks.close_all()


@pytest.mark.parametrize(
    "pool_class",
    # Connections kept beside the pool; the pool's checkout (a blocking pool lends
    # none, see _OwnConnections.of).
    ["redis.ConnectionPool", "redis.BlockingConnectionPool"],
)
def test_a_django_redis_caches_retry_policy_never_retries_a_lock_script(private_redis, pool_class):
    """A cache whose pool retries on connection errors (a common django-redis
    setting) lends its settings to the lock commands, but not that policy: the
    release whose reply was lost is reported as unknown (LockBackendError), not
    retried into a false "taken over by another owner". The cache keeps it."""
    server, client = private_redis
    with ReplyDroppingProxy(server.port) as proxy:
        policy = {"retry": Retry(NoBackoff(), 2), "retry_on_error": [redis.ConnectionError]}
        caches = {
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "shared": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": proxy.url,
                "OPTIONS": {"CONNECTION_POOL_KWARGS": policy, "CONNECTION_POOL_CLASS": pool_class},
            },
        }
        viacache = {"BACKEND": BACKEND, "KEY_PREFIX": "setnx-edge", "OPTIONS": {"CACHE": "shared"}}
        with override_settings(
            CACHES=caches, SETNX_LOCKS={**settings.SETNX_LOCKS, "viacache": viacache}
        ):
            assert_a_lost_release_reply_is_reported(proxy, client, "viacache")
            pool = locks["viacache"].connection.client.connection_pool
            assert retries(pool.connection_kwargs["retry"]) == 2  # the cache's own
            locks.close_all()


def test_a_retry_policy_the_user_chose_applies_to_the_lock_scripts(private_redis):
    """Lock scripts are sent on the pool's connections directly (not through
    ``execute_command``), and still under the connection's retry policy: with one
    given in CONNECTION_KWARGS, an acquire whose reply was lost is sent again, finds
    the record already carrying its token, and wins (with the default, no retry, it
    is reported: see the test above)."""
    server, client = private_redis
    with ReplyDroppingProxy(server.port) as proxy:
        # retry_on_error too: redis-py < 6 retries only the errors listed there.
        policy = {"retry": Retry(NoBackoff(), 2), "retry_on_error": [redis.ConnectionError]}
        backend = make_backend(proxy.url, CONNECTION_KWARGS=policy)
        try:
            assert redis_backend._sends_plainly(backend.connection.client)
            assert backend.acquire("warm", "tok0", 30, OWNER).acquired  # scripts loaded
            proxy.drop_reply_to(ACQUIRE_SHA)
            result = backend.acquire("n", "tok1", 30, OWNER)
            assert proxy.dropped == 1
            assert result.acquired
            record = client.hgetall(lock_keys("setnx-edge", "n")[0])
            assert record[b"token"] == b"tok1"
            assert int(record[b"fencing"]) == result.fencing_token
            assert backend.release("n", "tok1")
        finally:
            backend.close()


class CountingRedis(redis.Redis):
    """A client whose ``execute_command`` is its own (as instrumentation makes it):
    it counts the commands sent through it."""

    sent: list = []

    def execute_command(self, *args, **options):
        CountingRedis.sent.append(args[0])
        return super().execute_command(*args, **options)


def test_a_client_with_its_own_execute_command_gets_every_lock_command(private_redis):
    """A client class that overrides ``execute_command`` (CLIENT_CLASS) sees our
    scripts go through it, so its tracing or metrics see every lock operation."""
    server, _ = private_redis
    CountingRedis.sent = []
    backend = make_backend(
        server.url, CLIENT_CLASS="tests.test_redis_edges.CountingRedis.from_url"
    )
    try:
        assert not redis_backend._sends_plainly(backend.connection.client)
        assert backend.acquire("warm", "tok0", 30, OWNER).acquired
        assert backend.release("warm", "tok0")  # both scripts are loaded now
        CountingRedis.sent = []
        assert backend.acquire("n", "tok", 30, OWNER).acquired
        assert backend.release("n", "tok")
        assert CountingRedis.sent == ["EVALSHA", "EVALSHA"]
    finally:
        backend.close()


@pytest.mark.parametrize("hook", ["execute_command on the client", "EVALSHA response callback"])
def test_a_client_patched_or_given_a_callback_gets_every_lock_command(private_redis, hook):
    """Patching ``execute_command`` on the client object itself (as
    ``mock.patch.object`` does in a user's test) or registering a response callback
    for ``EVALSHA`` puts every lock command back through redis-py's own path."""
    server, _ = private_redis
    backend = make_backend(server.url)
    client = backend.connection.client
    seen = []
    try:
        assert backend.acquire("warm", "tok0", 30, OWNER).acquired
        assert backend.release("warm", "tok0")  # both scripts are loaded now
        if hook == "EVALSHA response callback":

            def callback(response, **options):
                seen.append("EVALSHA")
                return response

            client.set_response_callback("EVALSHA", callback)
        else:
            plain = client.execute_command

            def patched(*args, **options):
                seen.append(args[0])
                return plain(*args, **options)

            client.execute_command = patched
        assert not redis_backend._sends_plainly(client)
        assert backend.acquire("n", "tok", 30, OWNER).acquired
        assert backend.release("n", "tok")
        assert seen == ["EVALSHA", "EVALSHA"]
    finally:
        backend.close()


def test_an_execute_command_instrumented_at_run_time_gets_every_lock_command(
    private_redis, monkeypatch
):
    """APM libraries (OpenTelemetry, Sentry) wrap ``redis.Redis.execute_command`` in
    place, possibly after the backend connected: from then on our scripts go
    through the wrapper."""
    server, _ = private_redis
    backend = make_backend(server.url)
    sent = []
    original = redis.Redis.execute_command

    @functools.wraps(original)
    def traced(self, *args, **options):
        sent.append(args[0])
        return original(self, *args, **options)

    try:
        assert backend.acquire("n", "tok1", 30, OWNER).acquired
        assert backend.release("n", "tok1")
        assert sent == []  # plain redis-py: sent on the pool's connection directly
        monkeypatch.setattr(redis.Redis, "execute_command", traced)
        assert backend.acquire("n", "tok2", 30, OWNER).acquired
        assert backend.release("n", "tok2")
        assert sent.count("EVALSHA") == 2
    finally:
        backend.close()


# -- our own client's connections -------------------------------------------------------


def every_lock_command(backend, token):
    """acquire, extend, owns, get, a queued waiter's wait and give-up, release."""
    assert backend.acquire("n", token, 30, OWNER).acquired
    assert backend.extend("n", token, 30)
    assert backend.owns("n", token)
    assert backend.get("n") is not None
    assert not backend.acquire("n", f"{token}-waiter", 30, OWNER, wait=1).acquired
    kwargs = {"token": f"{token}-waiter", "attempt": 0, "max_wait": 0.01, "retry_after": 30}
    assert not backend.wait("n", **kwargs).acquired  # its attempt, refused: still held
    assert backend.stop_waiting("n", f"{token}-waiter") is None
    assert backend.release("n", token)


def test_the_lock_commands_of_our_own_client_use_one_connection_beside_its_pool():
    """Lock commands skip the pool's per-command checkout (its lock, pid check and
    metrics): they run on connections kept beside it, one here, reused for every
    command; close() disconnects them too."""
    with RedisServer() as server:
        backend = make_backend(server.url)
        client = redis.Redis(port=server.port)
        try:
            for i in range(20):
                every_lock_command(backend, f"tok{i}")
            pool = backend.connection.client.connection_pool
            assert not pool._in_use_connections and not pool._available_connections
            assert client.info("clients")["connected_clients"] == 2  # ours and this one
            assert calls(client, "config") == 1  # its eviction policy was read once
        finally:
            backend.close()
        wait_until(
            lambda: client.info("clients")["connected_clients"] == 1,
            "close() to disconnect our connection",
        )


def test_the_lock_commands_through_a_django_redis_cache_use_one_connection_beside_its_pool():
    """Through OPTIONS["CACHE"] too, lock commands skip the pool's checkout: they run
    on one connection made from the cache pool's settings, never on the cache's own
    connections, which keep working; close() disconnects ours and leaves the
    cache's pool to django-redis."""
    from django.core.cache import caches

    with RedisServer() as server, cache_settings(server.url):
        client = redis.Redis(port=server.port)
        assert_cache_works()  # the cache's pool has one connection now
        backend = locks["viacache"]
        pool = backend.connection.client.connection_pool
        assert pool is caches["shared"].client.get_client().connection_pool
        cache_connections = list(pool._available_connections)
        try:
            for i in range(20):
                every_lock_command(backend, f"tok{i}")
                assert_cache_works()
            assert list(pool._available_connections) == cache_connections
            assert not pool._in_use_connections
            # the cache's, ours, and this one
            assert client.info("clients")["connected_clients"] == 3
        finally:
            backend.close()
        wait_until(
            lambda: client.info("clients")["connected_clients"] == 2,
            "close() to disconnect our connection, and only ours",
        )
        assert_cache_works()
        assert list(pool._available_connections) == cache_connections


def test_a_pool_with_a_credential_provider_keeps_its_checkout():
    """redis-py re-authenticates the pool's own connections when a streaming
    credential provider renews its token; connections kept beside the pool would
    keep the old one. So such a pool's checkout is used for the lock commands."""
    from redis.credentials import UsernamePasswordCredentialProvider

    with RedisServer() as server:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret")
        provider = UsernamePasswordCredentialProvider(password="s3cret")
        backend = make_backend(server.url, CONNECTION_KWARGS={"credential_provider": provider})
        try:
            links = backend.connection.links
            assert isinstance(links, redis_backend._PoolCheckout)
            assert links.retries  # our own client: its connections' policy applies
            every_lock_command(backend, "tok")
        finally:
            backend.close()


def test_a_connection_whose_server_the_pool_moved_is_replaced():
    """redis-py applies a maintenance MOVING notice (Redis Enterprise) by changing
    the pool's host and its own connections: ours follow the pool's host too."""
    with RedisServer() as server:
        backend = make_backend(server.url)
        client = redis.Redis(port=server.port)

        def ours():
            me = client.client_id()
            return {c["id"] for c in client.client_list() if int(c["id"]) != me}

        try:
            every_lock_command(backend, "before")
            before = ours()
            pool = backend.connection.client.connection_pool
            assert pool.connection_kwargs["host"] == "127.0.0.1"
            pool.connection_kwargs["host"] = "localhost"  # the same server, moved
            every_lock_command(backend, "after")
            after = ours()
            assert len(before) == len(after) == 1 and before != after
        finally:
            backend.close()


@pytest.mark.parametrize(
    "fork", [os.fork, workers.fork_without_hooks], ids=["os.fork", "no-fork-hooks"]
)
def test_a_forked_child_never_sends_on_the_parents_connection(fork):
    """The child of a fork inherits our idle connection; it must open its own. The
    parent is blocked on that connection (a waiter's BLPOP) while the child locks:
    had the child written to the same socket, its command would queue behind the
    BLPOP and the two processes would read each other's replies. Also when the fork
    runs no fork hooks (uWSGI's default)."""
    with RedisServer() as server:
        backend = make_backend(server.url)
        client = redis.Redis(port=server.port)
        try:
            assert backend.acquire("held", "holder", 30, OWNER).acquired
            assert not backend.acquire("held", "waiter", 30, OWNER, wait=5).acquired
            read_end, write_end = os.pipe()
            pid = fork()
            if pid == 0:  # the child: never return into pytest
                outcome = b"E"
                try:
                    wait_until(lambda: client.info("clients")["blocked_clients"] == 1, "BLPOP")
                    result = backend.acquire("child", "tok", 30, OWNER)
                    released = backend.release("child", "tok")
                    outcome = b"1" if result.acquired and released else b"0"
                finally:
                    os.write(write_end, outcome)
                    os._exit(0)
            kwargs = {"token": "waiter", "attempt": 0, "max_wait": 3, "retry_after": 30}
            assert not backend.wait("held", **kwargs).acquired  # not handed the lock
            os.waitpid(pid, 0)
            assert os.read(read_end, 1) == b"1"
            assert (
                backend.owns("held", "holder") and backend.stop_waiting("held", "waiter") is None
            )
            assert backend.release("held", "holder")
        finally:
            backend.close()


def test_threads_share_our_own_connections_without_mixing_replies():
    """8 threads, each acquiring and releasing its own names: every reply is its
    own (a connection is never used by two threads at once), and no more
    connections are opened than threads ran at once."""
    with RedisServer() as server:
        backend = make_backend(server.url)
        client = redis.Redis(port=server.port)
        errors = []

        def work(t):
            try:
                for i in range(150):
                    name = f"t{t}:{i % 5}"
                    result = backend.acquire(name, f"tok{t}:{i}", 30, OWNER)
                    assert result.acquired, (name, result)
                    assert backend.get(name).fencing_token == result.fencing_token
                    assert backend.release(name, f"tok{t}:{i}")
            except Exception:  # noqa: BLE001 - reported below
                errors.append(traceback.format_exc())

        try:
            threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert errors == []
            assert 2 <= client.info("clients")["connected_clients"] <= 9
        finally:
            backend.close()


def test_our_own_client_keeps_its_connection_limit():
    """CONNECTION_KWARGS' max_connections bounds the connections our lock commands
    open, as it bounds the pool's: a second command while the only one is busy (a
    waiter blocked on it) fails as the pool would, with LockBackendError."""
    with RedisServer() as server:
        backend = make_backend(server.url, CONNECTION_KWARGS={"max_connections": 1})
        try:
            assert backend.acquire("held", "holder", 30, OWNER).acquired
            assert not backend.acquire("held", "waiter", 30, OWNER, wait=5).acquired
            blocked = threading.Thread(
                target=backend.wait,
                args=("held",),
                kwargs={"token": "waiter", "attempt": 0, "max_wait": 1.5, "retry_after": 30},
            )
            blocked.start()
            client = redis.Redis(port=server.port)
            wait_until(lambda: client.info("clients")["blocked_clients"] == 1, "the waiter")
            with pytest.raises(LockBackendError, match="Too many connections"):
                backend.acquire("other", "tok", 30, OWNER)
            blocked.join(10)
            assert backend.acquire("other", "tok", 30, OWNER).acquired  # free again
        finally:
            backend.close()


# -- idle connections dropped by the server ---------------------------------------------


def test_connections_the_server_dropped_while_idle_are_replaced_and_rechecked():
    with RedisServer("--timeout", "1") as server:
        backend = make_backend(server.url)
        client = redis.Redis(port=server.port)
        try:
            assert backend.acquire("n", "tok1", 30, OWNER).acquired
            assert backend.release("n", "tok1")
            wait_until(
                lambda: client.info("clients")["connected_clients"] == 1,
                "the server's idle sweep to close our connection",
            )
            result = backend.acquire("n", "tok2", 30, OWNER)
            assert result.acquired
            assert client.hget(lock_keys("setnx-edge", "n")[0], "token") == b"tok2"
            # The replacement connection had its eviction policy read too.
            assert calls(client, "config") == 2
            assert backend.release("n", "tok2")
        finally:
            backend.close()


def test_a_waiter_whose_connection_the_server_killed_still_gets_the_lock(private_redis):
    """CLIENT KILL TYPE normal drops every client connection, the one blocked in BLPOP
    too: the waiter carries on (reconnecting) and takes the lock when it is released,
    never reporting a win it does not hold."""
    server, client = private_redis
    params = {"BACKEND": BACKEND, "LOCATION": server.url, "KEY_PREFIX": "setnx-edge"}
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "private": params}):
        holder = lock("n", ttl=30, backend="private")
        assert holder.acquire(blocking=False)
        outcome = {}

        def wait():
            waiter = lock("n", ttl=30, backend="private")
            try:
                outcome["acquired"] = waiter.acquire(timeout=20)
                outcome["fencing_in_redis"] = client.hget(
                    lock_keys("setnx-edge", "n")[0], "fencing"
                )
                outcome["fencing"] = waiter.fencing_token
                waiter.release()
            except Exception as exc:  # noqa: BLE001 - reported below
                outcome["error"] = exc

        thread = threading.Thread(target=wait)
        thread.start()
        wait_until(
            lambda: client.info("clients")["blocked_clients"] == 1, "the waiter to block in BLPOP"
        )
        client.client_kill_filter(_type="normal", skipme=True)
        holder.release()
        thread.join(30)
        assert "error" not in outcome, outcome
        assert outcome["acquired"] is True
        assert int(outcome["fencing_in_redis"]) == outcome["fencing"] > holder.fencing_token
        locks.close_all()


def test_keys_of_another_type_or_not_utf8_are_unreadable_records(private_redis):
    """Keys written under the prefix by another tool: a list where a hash should be,
    and a name that is not UTF-8. get, list and clear show them as unreadable stale
    records and remove them; an acquire takes the wrong-typed one over."""
    server, client = private_redis
    backend = make_backend(server.url)
    wrong_type = lock_keys("setnx-edge", "a-list")[0]
    not_utf8 = b"setnx-edge:{caf\xe9}:lock"
    try:
        client.rpush(wrong_type, "x")
        client.hset(
            not_utf8,
            mapping={"token": "t", "fencing": "1", "owner": "{}", "acquired": "1", "expires": "2"},
        )
        info = backend.get("a-list")
        assert info.is_stale and info.fencing_token == 0
        assert "WRONGTYPE" in info.owner["unreadable"]
        listed = {i.name: i for i in backend.list()}
        assert set(listed) == {"a-list", "caf\\xe9"}
        assert all(i.is_stale and i.fencing_token == 0 for i in listed.values())
        for listed_info in listed.values():
            json.dumps(listed_info.as_dict())  # what listlocks --json prints
        # The admin's pages (names from SCAN, records read for the page only).
        for state in (None, "stale"):
            page = backend.page(state=state)
            assert sorted(i.name for i in page.infos) == ["a-list", "caf\\xe9"], state
            assert page.total == 2 and all(i.is_stale for i in page.infos)

        assert sorted(backend.clear(dry_run=True).names) == ["a-list", "caf\\xe9"]
        assert client.exists(wrong_type, not_utf8) == 2  # a dry run writes nothing
        assert sorted(backend.clear().names) == ["a-list", "caf\\xe9"]
        assert client.exists(wrong_type, not_utf8) == 0

        client.rpush(wrong_type, "x")
        result = backend.acquire("a-list", "tok", 30, OWNER)
        assert result.acquired and result.fencing_token > 0
        assert backend.get("a-list").owner == OWNER
        assert backend.release("a-list", "tok")
    finally:
        backend.close()


def test_clearlocks_removes_a_key_whose_name_is_not_utf8(private_redis):
    server, client = private_redis
    params = {"BACKEND": BACKEND, "LOCATION": server.url, "KEY_PREFIX": "setnx-edge"}
    key = b"setnx-edge:{\xff\xfe}:lock"
    client.hset(key, mapping={"token": "t", "expires": "1"})
    client.set(b"elsewhere:{\xff}:lock", "not ours")
    with override_settings(
        SETNX_LOCKS={"default": settings.SETNX_LOCKS["default"], "private": params}
    ):
        out = StringIO()
        call_command("listlocks", "--backend", "private", "--json", stdout=out)
        [record] = [json.loads(line) for line in out.getvalue().splitlines()]
        assert record["name"] == "\\xff\\xfe" and record["state"] == "stale"
        out = StringIO()
        call_command(
            "clearlocks", "--backend", "private", verbosity=2, stdout=out, stderr=StringIO()
        )
        # The name as listed (bytes shown as \xNN), escaped as every printed name is.
        assert "  removed \\\\xff\\\\xfe" in out.getvalue()
        assert client.exists(key) == 0
        assert client.get(b"elsewhere:{\xff}:lock") == b"not ours"  # outside the prefix
        locks.close_all()


@pytest.mark.parametrize(
    "location_query", ["", "?socket_timout=3"], ids=["CONNECTION_KWARGS", "URL query"]
)
def test_a_connection_argument_redis_py_does_not_take_is_named(private_redis, location_query):
    server, client = private_redis
    options = {} if location_query else {"CONNECTION_KWARGS": {"socket_timout": 3}}
    backend = make_backend(server.url + location_query, **options)
    try:
        with pytest.raises(ImproperlyConfigured, match=r"SETNX_LOCKS\['edge'\].*socket_timout"):
            backend.acquire("n", "tok", 30, OWNER)
        assert list(client.scan_iter("setnx-edge:*")) == []
    finally:
        backend.close()


def test_a_waiting_cycle_is_one_blocking_read_and_one_attempt(private_redis):
    """A waiter's next attempt goes out right behind its BLPOP (see
    RedisBackend.wait); when that attempt is refused, its refusal is the waiter's
    next result, so the waiter blocks again at once instead of sending an attempt of
    its own: one EVALSHA per BLPOP, plus the first attempt and the withdrawal."""
    server, client = private_redis
    params = {"BACKEND": BACKEND, "LOCATION": server.url, "KEY_PREFIX": "setnx-edge"}
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "private": params}):
        holder = lock("n", ttl=30, backend="private")
        assert holder.acquire(blocking=False)
        client.config_resetstat()
        waiter = lock("n", ttl=30, backend="private")
        assert waiter.acquire(timeout=3) is False
        stats = client.info("commandstats")
        blocking_reads = stats["cmdstat_blpop"]["calls"]
        # A script's first EVALSHA on this server fails (NOSCRIPT) and is sent again.
        attempts = stats["cmdstat_evalsha"]["calls"] - stats["cmdstat_evalsha"]["failed_calls"]
        assert blocking_reads >= 3, blocking_reads  # waits of at most WAIT_BLOCK
        assert attempts == blocking_reads + 2, (blocking_reads, attempts)
        holder.release()
        locks.close_all()


def test_a_waiter_whose_next_attempt_is_refused_at_connect_undoes_the_lock_it_was_handed(
    private_redis,
):
    """Review r132: a queued waiter's attempt pipelined behind its BLPOP took the
    lock a release handed it, and the reply was lost (wait() says nothing: the next
    attempt reports). That next attempt, refused at connect, ran nothing itself, so
    it was not undone: the lock stayed held by a token nobody knew, for its whole
    ttl. An attempt refused at connect is skipped by the undo only if no earlier
    attempt under its token may have run."""
    server, client = private_redis
    proxy = ReplyDroppingProxy(server.port).start()
    waiter = make_backend(proxy.url, alias="waiter", CONNECTION_KWARGS={"socket_timeout": 2.0})
    holder = make_backend(server.url, alias="holder")
    name, token = "handed", "token-of-the-waiter"
    try:
        assert holder.acquire(name, "holder", 60, OWNER).acquired
        assert not waiter.acquire(name, token, 60, OWNER, wait=30).acquired  # queued
        proxy.drop_reply_to(b"BLPOP")
        waited = threading.Thread(
            target=waiter.wait,
            args=(name,),
            kwargs={"token": token, "attempt": 1, "max_wait": 30, "retry_after": 60},
        )
        waited.start()
        time.sleep(0.3)  # blocked in its BLPOP, its next attempt right behind
        assert holder.release(name, "holder")  # handed to the waiter
        waited.join(10)
        assert proxy.dropped == 1
        assert client.hget(lock_keys("setnx-edge", name)[0], "token") == token.encode()
        port = proxy.port
        proxy.close()  # connections refused from now on
        with pytest.raises(LockBackendError):
            waiter.acquire(name, token, 60, OWNER, wait=30)
        proxy = ReplyDroppingProxy(server.port, port=port).start()  # the server is back
        deadline = time.monotonic() + 10
        while client.exists(lock_keys("setnx-edge", name)[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.exists(lock_keys("setnx-edge", name)[0]), (
            "the lock handed to the waiter is held by nobody until its ttl"
        )
    finally:
        waiter.close()
        holder.close()
        proxy.close()


def test_a_pool_with_a_client_side_cache_sends_the_lock_commands(private_redis, monkeypatch):
    """Review r132: a pool with a client-side cache lends CacheProxyConnection,
    which keeps its socket on the connection it wraps: reading ``_sock`` on it
    failed every lock command with AttributeError. (redis-py asks for Redis 7.4 for
    its cache; what it uses, CLIENT TRACKING over RESP3, is in 6.0, so the test's
    server stands in for one.)"""
    CacheConfig = pytest.importorskip("redis.cache", reason="redis-py < 5.1").CacheConfig
    monkeypatch.setattr(redis.connection.CacheProxyConnection, "MIN_ALLOWED_VERSION", "6.0.0")
    server, client = private_redis
    backend = make_backend(
        server.url, CONNECTION_KWARGS={"protocol": 3, "cache_config": CacheConfig()}
    )
    try:
        conn = backend.connection.client.connection_pool.get_connection()
        assert isinstance(conn, redis.connection.CacheProxyConnection)
        backend.connection.client.connection_pool.release(conn)
        result = backend.acquire("cached", "token", 30, OWNER)
        assert result.acquired
        assert backend.owns("cached", "token")
        assert backend.release("cached", "token")
        assert not client.exists(lock_keys("setnx-edge", "cached")[0])
    finally:
        backend.close()


@pytest.mark.parametrize("call", ["stop_waiting", "astop_waiting"])
def test_a_withdrawal_whose_reply_is_lost_after_a_handoff_undoes_the_lock(private_redis, call):
    """Review r134: STOP_WAITING confirms, for the caller's whole ttl, a lock that a
    release handed it just before; a waiter giving up (its timeout) as the lock was
    handed to it, whose STOP_WAITING reply was lost, was told of an error (the Lock
    logs it) while the lock stayed held by its token, for 60 s here. The withdrawal
    is now undone (STOP_WAITING, then RELEASE under the token) until the server
    answers."""
    import asyncio

    server, client = private_redis
    proxy = ReplyDroppingProxy(server.port).start()
    waiter = make_backend(proxy.url, alias="waiter", CONNECTION_KWARGS={"socket_timeout": 2.0})
    holder = make_backend(server.url, alias="holder")
    name, token = "handed-then-withdrawn", "token-of-the-waiter"
    lock_key = lock_keys("setnx-edge", name)[0]
    try:
        assert holder.acquire(name, "holder", 60, OWNER).acquired
        if call == "stop_waiting":
            assert not waiter.acquire(name, token, 60, OWNER, wait=30).acquired  # queued
        else:
            queued = asyncio.run(waiter.aacquire(name, token, 60, OWNER, wait=30))
            assert not queued.acquired
        assert holder.release(name, "holder")  # handed to the waiter (a claim)
        assert client.hget(lock_key, "token") == token.encode()
        proxy.drop_reply_to(STOP_WAITING_SHA)
        with pytest.raises(LockBackendError):
            if call == "stop_waiting":
                waiter.stop_waiting(name, token)
            else:
                asyncio.run(waiter.astop_waiting(name, token))
        assert proxy.dropped == 1
        deadline = time.monotonic() + 10
        while client.exists(lock_key) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.exists(lock_key), "the lock is held by nobody until its ttl"
    finally:
        waiter.close()
        holder.close()
        proxy.close()
