"""The single Redis backend on Redis Sentinel and Redis Cluster, against real servers.

Sentinel: a master, one replica and three sentinels (quorum 2); the master is
SIGKILLed and the backend object must report the outage (never a false win) and
then work against the promoted replica. Cluster: three primaries; locks spread
over every primary and ``list``/``clear``/``clearlocks`` see all of them.
"""

import contextlib
import hashlib
import time
import uuid

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

if "redis" not in settings.TEST_BACKENDS:
    pytest.skip("redis is not in settings.TEST_BACKENDS", allow_module_level=True)

import redis
from redis.cluster import key_slot

from django_setnx import lock, locks
from django_setnx.backends.clients import parse_sentinel_url
from django_setnx.backends.redis import WAIT_BLOCK
from django_setnx.backends.redis_scripts import RELEASE
from django_setnx.exceptions import LockBackendError
from tests.servers import RedisSentinelSet, RedisServer, ReplyDroppingProxy, free_cluster_port

OWNER = {"host": "test", "pid": 1, "thread": "t"}
BACKEND = "django_setnx.backends.redis.RedisBackend"


def unique(label="sc"):
    return f"{label}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def alias_on(alias, params):
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, alias: params}):
        try:
            yield alias
        finally:
            locks.close_all()


# -- Sentinel ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "location, sentinels, service, kwargs",
    [
        (
            "redis+sentinel://h1:26379,h2:26380/mymaster/0",
            [("h1", 26379), ("h2", 26380)],
            "mymaster",
            {"db": 0},
        ),
        ("redis+sentinel://h1,h2/svc", [("h1", 26379), ("h2", 26379)], "svc", {}),
        ("redis+sentinel://:s%40cret@h1:1/m/3", [("h1", 1)], "m", {"db": 3, "password": "s@cret"}),
        (
            "redis+sentinel://user:pw@h1:1/m",
            [("h1", 1)],
            "m",
            {"username": "user", "password": "pw"},
        ),
        (
            "rediss+sentinel://[::1]:5000/m/1?socket_timeout=0.5",
            [("::1", 5000)],
            "m",
            {"db": 1, "ssl": True, "socket_timeout": 0.5},
        ),
    ],
)
def test_parse_sentinel_url(location, sentinels, service, kwargs):
    assert parse_sentinel_url(location) == (sentinels, service, kwargs)


@pytest.mark.parametrize(
    "location, message",
    [
        ("redis://h1:26379/m", r"must start with redis\+sentinel://"),
        ("redis+sentinel:///m", "names no sentinel host"),
        ("redis+sentinel://h1:x/m", r"a sentinel.s port is not a number \('h1:x'\)"),
        ("redis+sentinel://h1:1", "must end with /service_name"),
        ("redis+sentinel://h1:1/m/zero", "db 'zero' is not an integer"),
    ],
)
def test_parse_sentinel_url_errors(location, message):
    with pytest.raises(ValueError, match=message):
        parse_sentinel_url(location)


def sentinel_params(sentinel_set):
    return {
        "BACKEND": BACKEND,
        "LOCATION": sentinel_set.location,
        "KEY_PREFIX": "setnx-sentinel",
        "OPTIONS": {
            "CLIENT_CLASS": "django_setnx.backends.clients.sentinel",
            "CONNECTION_KWARGS": {"socket_timeout": 2.0},
        },
    }


def test_sentinel_backend_uses_the_master(sentinel_set):
    name = unique()
    with alias_on("sentinel", sentinel_params(sentinel_set)) as alias:
        with lock(name, ttl=30, backend=alias) as lk:
            assert lock(name, backend=alias).acquire(blocking=False) is False
            master = redis.Redis(port=sentinel_set.master.port)
            assert (
                master.hget(f"setnx-sentinel:{{{name}}}:lock", "fencing")
                == str(lk.fencing_token).encode()
            )
            assert [i.name for i in locks[alias].list(name_glob=name)] == [name]
            found = locks[alias].get_many([name, name + ":never"])
            assert found[name].fencing_token == lk.fencing_token and found[name + ":never"] is None
        assert not lk.locked()


def test_sentinel_failover(sentinel_set):
    """Kill the master: operations fail with LockBackendError (no false success)
    until the sentinels promote the replica, then the same backend works again."""
    held_name = unique("held")
    with alias_on("sentinel", sentinel_params(sentinel_set)) as alias:
        backend = locks[alias]
        held = lock(held_name, ttl=60, backend=alias)
        assert held.acquire(blocking=False)
        old = sentinel_set.master
        # Replication is asynchronous: make sure the replica has the lock before
        # the crash (a write it never got is lost in a failover; see docs/explanation.md).
        assert redis.Redis(port=old.port).execute_command("WAIT", 1, 5000) == 1
        old.kill()

        outcomes = []
        started = time.monotonic()
        while time.monotonic() - started < 30:
            address = sentinel_set.master_address()
            if address is not None and address[1] != old.port:
                break
            name, token = unique("probe"), uuid.uuid4().hex
            try:
                result = backend.acquire(name, token, 60, OWNER)
            except LockBackendError as exc:
                assert alias in str(exc)
                outcomes.append(("error", name, token))
            else:
                outcomes.append(("won" if result.acquired else "lost", name, token))
            time.sleep(0.05)
        new_master = sentinel_set.wait_for_failover(old.port)
        assert new_master is not old
        assert any(kind == "error" for kind, _, _ in outcomes), outcomes[:5]

        client = redis.Redis(port=new_master.port)
        for kind, name, token in outcomes:
            stored = client.hget(f"setnx-sentinel:{{{name}}}:lock", "token")
            if kind == "won":
                # A win during the failover is only possible on the new master.
                assert stored == token.encode(), f"false success for {name}"
            else:
                assert stored is None, f"{kind} for {name}, yet a record exists"

        # The same backend object works against the new master...
        deadline = time.monotonic() + 20
        while True:
            try:
                with lock(unique("after"), ttl=30, backend=alias) as lk:
                    assert lk.owned()
                break
            except LockBackendError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        # ...and the lock replicated before the crash is still held.
        assert lock(held_name, backend=alias).acquire(blocking=False) is False
        held.release()
        assert lock(held_name, backend=alias).acquire(blocking=False) is True


# -- Cluster -------------------------------------------------------------------------------


def cluster_params(cluster):
    return {
        "BACKEND": BACKEND,
        "LOCATION": cluster.url,
        "KEY_PREFIX": "setnx-cluster",
        "OPTIONS": {"CLIENT_CLASS": "django_setnx.backends.clients.cluster"},
    }


def lock_keys_per_node(cluster, prefix="setnx-cluster"):
    counts = {}
    for server in cluster.servers:
        client = redis.Redis(port=server.port)
        counts[server.port] = sum(
            1 for _ in client.scan_iter(match=f"{prefix}:*}}:lock", count=1000)
        )
    return counts


def test_cluster_keys_of_one_lock_share_a_slot():
    for name in ("a", "reports:daily", "ünïcødé", "x{y}z", "}"[0:0] + "n:{1}"):
        base = f"setnx:{{{name}}}"
        slots = {
            key_slot(f"{base}:{part}".encode())
            for part in ("lock", "fence", "waiters", "requests", "inbox:0123abcd")
        }
        assert len(slots) == 1, name


def test_cluster_locks_on_every_primary_and_clearlocks(redis_cluster):
    batch = uuid.uuid4().hex[:8]
    names = [f"cl-{batch}-{i:03d}" for i in range(200)]
    with alias_on("cluster", cluster_params(redis_cluster)) as alias:
        backend = locks[alias]
        held = [lock(name, ttl=60, backend=alias) for name in names]
        for lk in held:
            assert lk.acquire(blocking=False)
        assert lock(names[0], backend=alias).acquire(blocking=False) is False

        per_node = lock_keys_per_node(redis_cluster)
        assert sum(per_node.values()) == len(names)
        assert all(count > 0 for count in per_node.values()), per_node

        listed = {info.name: info for info in backend.list(name_glob=f"cl-{batch}-*")}
        assert set(listed) == set(names)
        assert all(info.is_held for info in listed.values())

        # Release one, let one expire: list and clear see the difference.
        held[0].release()
        short = lock(f"cl-{batch}-short", ttl=0.05, backend=alias)
        short.acquire()
        time.sleep(0.1)
        assert [i.name for i in backend.list(state="stale", name_glob=f"cl-{batch}-*")] == [
            f"cl-{batch}-short"
        ]
        # Pages (the admin's): the state filter reads one field per key, node by node.
        page = backend.page(state="stale", name_glob=f"cl-{batch}-*")
        assert [i.name for i in page.infos] == [f"cl-{batch}-short"] and page.total == 1
        page = backend.page(state="held", name_glob=f"cl-{batch}-*", offset=10, limit=5)
        assert [i.name for i in page.infos] == names[11:16]
        assert page.total == len(names) - 1
        assert backend.clear(name_glob=f"cl-{batch}-*").names == [f"cl-{batch}-short"]
        assert len(list(backend.list(name_glob=f"cl-{batch}-*"))) == len(names) - 1

        try:
            from django_setnx.management.commands import clearlocks  # noqa: F401
        except ImportError:
            removed = backend.clear(include_held=True).count
        else:
            call_command("clearlocks", "--all", "--noinput", "--backend", alias, verbosity=0)
            removed = None
        assert removed in (None, len(names) - 1)
        assert list(backend.list()) == []
        assert sum(lock_keys_per_node(redis_cluster).values()) == 0
        # Fencing counters survive clearing: the next token is larger.
        with lock(names[1], backend=alias) as again:
            assert again.fencing_token > held[1].fencing_token


def test_cluster_waiting_and_contract_basics(redis_cluster):
    name = unique()
    with alias_on("cluster", cluster_params(redis_cluster)) as alias:
        holder = lock(name, ttl=30, backend=alias)
        holder.acquire()
        import threading

        threading.Timer(0.2, holder.release).start()
        waiter = lock(name, ttl=30, backend=alias)
        started = time.monotonic()
        assert waiter.acquire(timeout=10), "handed over by the release (inbox in the slot)"
        # Handed over at once, not found on a retry after a full WAIT_BLOCK.
        assert time.monotonic() - started < WAIT_BLOCK
        assert waiter.fencing_token > holder.fencing_token
        waiter.extend(60)
        assert waiter.info().expires_in > 30
        # get_many across slots of every primary (a Cluster pipeline loads no script).
        others = [lock(f"{name}:{i}", ttl=30, backend=alias) for i in range(6)]
        for other in others:
            assert other.acquire()
        found = locks[alias].get_many([name, *(o.name for o in others), f"{name}:never"])
        assert [found[o.name].fencing_token for o in others] == [o.fencing_token for o in others]
        assert found[name].fencing_token == waiter.fencing_token and found[f"{name}:never"] is None
        for other in others:
            other.release()
        removed = locks[alias].delete(name)
        assert removed.fencing_token == waiter.fencing_token


# -- eviction, timeouts and retries on Sentinel and Cluster ------------------------------


def test_sentinel_failover_to_a_server_that_may_evict_is_refused():
    """Every new connection checks its server: after a failover to a replica whose
    maxmemory-policy may evict, the same backend object refuses, writing nothing."""
    name = unique()
    with (
        RedisSentinelSet("evicting", replicas=1, sentinels=1, quorum=1) as sentinel_set,
        alias_on("sentinel", sentinel_params(sentinel_set)) as alias,
    ):
        old = sentinel_set.master
        replica = redis.Redis(port=sentinel_set.replicas[0].port)
        replica.config_set("maxmemory", "3mb")
        replica.config_set("maxmemory-policy", "allkeys-lru")
        with lock(unique(), ttl=30, backend=alias):
            pass  # the master (noeviction) is accepted
        redis.Redis(port=sentinel_set.sentinels[0].port).execute_command(
            "SENTINEL", "FAILOVER", "evicting"
        )
        new_master = sentinel_set.wait_for_failover(old.port)
        # Until the sentinel demotes the old master too, a client still connected to
        # it writes there (the failover's own split-brain window, not ours to test).
        deadline = time.monotonic() + 30
        while redis.Redis(port=old.port).role()[0] != b"slave":
            assert time.monotonic() < deadline, "the old master was never demoted"
            time.sleep(0.05)
        messages = []
        for _ in range(3):  # the first may only find its old connection gone
            with pytest.raises(LockBackendError) as excinfo:
                lock(name, ttl=30, backend=alias).acquire(blocking=False)
            messages.append(str(excinfo.value))
        assert "'allkeys-lru'" in messages[-1] and "'sentinel'" in messages[-1], messages
        assert redis.Redis(port=new_master.port).exists(f"setnx-sentinel:{{{name}}}:lock") == 0


@contextlib.contextmanager
def evicting(server):
    client = redis.Redis(port=server.port)
    client.config_set("maxmemory", "3mb")
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        yield
    finally:
        client.config_set("maxmemory", "0")
        client.config_set("maxmemory-policy", "noeviction")


def test_cluster_every_primary_is_checked_for_eviction(redis_cluster):
    """One primary that may evict is enough to refuse on first use, even for a lock
    whose slot lives on another primary."""
    risky = redis_cluster.servers[2]
    safe_name = next(
        f"n{i}"
        for i in range(1000)
        if redis.Redis(port=redis_cluster.servers[0].port).execute_command(
            "CLUSTER", "KEYSLOT", f"setnx-cluster:{{n{i}}}:lock"
        )
        < 16384 // 3
    )
    with evicting(risky), alias_on("cluster", cluster_params(redis_cluster)) as alias:
        with pytest.raises(LockBackendError) as excinfo:
            lock(safe_name, ttl=30, backend=alias).acquire(blocking=False)
        assert f"127.0.0.1:{risky.port}" in str(excinfo.value)
        assert "'allkeys-lru'" in str(excinfo.value) and "'cluster'" in str(excinfo.value)
        assert sum(lock_keys_per_node(redis_cluster).values()) == 0
    with (
        alias_on("cluster", cluster_params(redis_cluster)) as alias,
        lock(safe_name, ttl=30, backend=alias) as lk,
    ):  # fixed: accepted
        assert lk.owned()


def test_cluster_waits_stay_below_a_short_socket_timeout(redis_cluster):
    """A Cluster client has no single pool to read the socket timeout from: the
    backend's own setting bounds each BLPOP, so waiting never times the socket out."""
    name = unique()
    params = cluster_params(redis_cluster)
    params["OPTIONS"]["CONNECTION_KWARGS"] = {"socket_timeout": 0.5}
    with alias_on("cluster", params) as alias, lock(name, ttl=30, backend=alias):
        assert lock(name, ttl=30, backend=alias).acquire(timeout=1.5) is False


def test_cluster_release_whose_reply_was_lost_is_not_retried():
    """RedisCluster retries a command 10 times on a connection error by default; a
    retried RELEASE whose first run deleted the record reports "not ours", and the
    Lock would claim it was taken over. Ours is not retried: LockBackendError."""
    port = free_cluster_port()
    with (
        ReplyDroppingProxy(port) as proxy,
        RedisServer(
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-announce-ip",
            "127.0.0.1",
            "--cluster-announce-port",
            proxy.port,
            "--cluster-announce-bus-port",
            port + 10000,
            port=port,
        ) as node,
    ):
        client = redis.Redis(port=node.port)
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 10
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node cluster did not come up"
            time.sleep(0.05)
        params = {
            "BACKEND": BACKEND,
            "LOCATION": proxy.url,
            "KEY_PREFIX": "setnx-cluster",
            "OPTIONS": {"CLIENT_CLASS": "django_setnx.backends.clients.cluster"},
        }
        with alias_on("proxied", params) as alias:
            with lock("warm", ttl=30, backend=alias):
                pass  # ACQUIRE and RELEASE are loaded: EVALSHA from now on
            held = lock("n", ttl=30, backend=alias)
            assert held.acquire(blocking=False)
            proxy.drop_reply_to(hashlib.sha1(RELEASE.encode()).hexdigest().encode())
            with pytest.raises(LockBackendError, match="'proxied'"):
                held.release()
            assert proxy.dropped == 1
            assert client.exists("setnx-cluster:{n}:lock") == 0  # it did run, once
