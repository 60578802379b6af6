"""Redis-specific behaviour of RedisBackend, against real Redis servers.

The contract every backend shares is in test_contract.py; this module covers what
only Redis has: the key layout, SCAN hygiene under a prefix, stale retention, the
queue of waiters and handing the lock over to them, the fence counter, outages, and
reusing a django-redis connection.
"""

import collections
import os
import re
import threading
import time
import uuid

import pytest
from django.conf import settings
from django.core.cache.backends.base import BaseCache
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django.utils.module_loading import import_string

if "redis" not in settings.TEST_BACKENDS:
    pytest.skip("redis is not in settings.TEST_BACKENDS", allow_module_level=True)

import redis
from redis.cluster import key_slot

from django_setnx import lock, locks
from django_setnx.backends.redis import WAIT_BLOCK, RedisBackend
from django_setnx.exceptions import LockBackendError, LockNotOwned
from django_setnx.globs import compile_glob
from tests.servers import free_port

BACKEND = "django_setnx.backends.redis.RedisBackend"
OWNER = {"host": "test", "pid": 1, "thread": "t"}


def unique(label="lock"):
    return f"{label}-{uuid.uuid4().hex[:12]}"


def session_url():
    return os.environ["SETNX_TEST_REDIS_URL"]


def escape_glob(text):
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def delete_prefix(client, prefix):
    """Delete every key under ``prefix:`` (SCAN: KEYS is disabled on our servers)."""
    keys = list(client.scan_iter(match=escape_glob(prefix) + ":*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def make_backend(redis_client):
    """Build RedisBackends on the session server, each under a fresh prefix by default;
    their keys are deleted afterwards."""
    made = []

    def make(prefix=None, location=None, **options):
        prefix = prefix or unique("setnx-t")
        params = {
            "BACKEND": BACKEND,
            "LOCATION": location or session_url(),
            "KEY_PREFIX": prefix,
            "OPTIONS": options,
        }
        backend = RedisBackend(f"alias-{prefix}", params)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
        delete_prefix(redis_client, backend.key_prefix)


@pytest.fixture
def name(redis_client):
    """A fresh lock name on the ``redis`` alias; its keys are deleted afterwards."""
    name = unique()
    yield name
    prefix = settings.SETNX_LOCKS["redis"]["KEY_PREFIX"]
    redis_client.delete(
        *(f"{prefix}:{{{name}}}:{part}" for part in ("lock", "fence", "waiters", "requests"))
    )


def lock_key(name):
    return f"{settings.SETNX_LOCKS['redis']['KEY_PREFIX']}:{{{name}}}:lock"


# -- key layout ---------------------------------------------------------------------


def test_key_layout_under_prefix_shares_one_hash_slot(redis_client, name):
    prefix = settings.SETNX_LOCKS["redis"]["KEY_PREFIX"]
    base = f"{prefix}:{{{name}}}"
    lk = lock(name, ttl=30, backend="redis", guards="tests.key_layout")
    assert lk.acquire(blocking=False)

    record = redis_client.hgetall(f"{base}:lock")
    assert set(record) == {b"token", b"fencing", b"owner", b"acquired", b"expires"}
    assert int(record[b"fencing"]) == lk.fencing_token
    assert int(record[b"expires"]) - int(record[b"acquired"]) == 30_000
    assert b'"guards":"tests.key_layout"' in record[b"owner"]
    assert not redis_client.exists(f"{base}:fence"), "the record carries the token"

    lk.release()
    assert not redis_client.exists(f"{base}:lock")
    # The released lock's token is remembered for FENCING_RETENTION, no longer.
    assert int(redis_client.get(f"{base}:fence")) == lk.fencing_token
    assert 0 < redis_client.pttl(f"{base}:fence") <= 60_000
    # Nobody waited, so nothing was queued.
    assert not redis_client.exists(f"{base}:waiters", f"{base}:requests")
    parts = ("lock", "fence", "waiters", "requests", f"inbox:{'0' * 32}")
    slots = {key_slot(f"{base}:{part}".encode()) for part in parts}
    assert len(slots) == 1


def test_scripts_flushed_from_the_server_are_loaded_again(redis_client, make_backend):
    """The server forgot every script (SCRIPT FLUSH, as a restart or a failover to a
    replica that never saw them): each operation loads its script and runs it,
    including a clear() that runs its script on a pipeline."""
    backend = make_backend()
    name = unique()
    assert backend.acquire(name, "t1", 30, {"pid": 1}).acquired
    assert backend.release(name, "t1")
    operations = [
        lambda: backend.acquire(name, "t2", 30, {"pid": 1}).acquired,
        lambda: backend.extend(name, "t2", 30),
        lambda: backend.owns(name, "t2"),
        lambda: backend.get(name).fencing_token > 0,
        lambda: backend.release(name, "t2"),
        lambda: backend.acquire(name, "t3", 30, {"pid": 1}).acquired,
        lambda: backend.clear(include_held=True).names == [name],
    ]
    for operation in operations:
        redis_client.script_flush()
        assert operation()
    assert backend.get(name) is None


def test_names_with_braces_colons_and_glob_characters_round_trip(make_backend):
    backend = make_backend()
    names = ["a}:lock", "b{c}d", "x*y?[z]\\", "üñí:cödé"]
    for n in names:
        assert backend.acquire(n, "tok", 30, OWNER).acquired
    assert sorted(i.name for i in backend.list()) == sorted(names)
    for n in names:
        assert backend.get(n).name == n
        assert [i.name for i in backend.list(name_glob=escape_glob(n))] == [n]
    assert {i.name for i in backend.list(name_glob="[ab]*")} == {"a}:lock", "b{c}d"}


def test_acquire_retried_with_the_same_token_reports_the_same_win(make_backend):
    # redis-py may resend a command after a broken connection; the script must not
    # then see its own first run as a contender.
    backend = make_backend()
    first = backend.acquire("n", "tok", 30, OWNER)
    again = backend.acquire("n", "tok", 30, OWNER)
    assert first.acquired and again.acquired
    assert again.fencing_token == first.fencing_token
    assert not backend.acquire("n", "other", 30, OWNER).acquired


# -- SCAN hygiene ---------------------------------------------------------------------


def test_clear_and_list_never_touch_keys_outside_the_prefix(redis_client, make_backend):
    run = uuid.uuid4().hex[:8]
    ours = make_backend(f"{run}-setnx-test")
    # Prefixes that, were they not escaped in SCAN MATCH, would match ours.
    globby = [
        make_backend(f"{run}-setnx-tes*"),
        make_backend(f"{run}-setnx-te[s]t"),
        make_backend(f"{run}-setnx-tes?"),
        make_backend(f"{run}-setnx-te\\st"),
    ]

    unrelated = []
    pipe = redis_client.pipeline(transaction=False)
    for i in range(250):  # look-alikes: our shape, other prefixes, stale-looking fields
        for prefix in (f"{run}-setnx-test2", f"{run}-setnx-tes", f"{run}-setnx-test:x"):
            key = f"{prefix}:{{n{i}}}:lock"
            pipe.hset(
                key,
                mapping={"token": "t", "fencing": 1, "owner": "{}", "acquired": 0, "expires": 0},
            )
            unrelated.append(key)
    for i in range(250):
        key = f"{run}-other:{i}"
        if i % 2:
            pipe.set(key, i)
        else:
            pipe.rpush(key, i)
        unrelated.append(key)
    pipe.execute()
    assert len(unrelated) == 1000

    for i in range(300):
        assert ours.acquire(f"n{i}", "tok", 30 if i % 2 else 0.001, OWNER).acquired
    for backend in globby:
        assert backend.acquire("mine", "tok", 30, OWNER).acquired
    time.sleep(0.01)

    assert len(list(ours.list())) == 300
    assert len(list(ours.list(state="stale"))) == 150
    for backend in globby:
        assert [i.name for i in backend.list()] == ["mine"]

    batches = []
    stale = ours.clear(progress=batches.append)
    assert stale.count == 150 and sum(map(len, batches)) == 150
    assert all(int(n[1:]) % 2 == 0 for n in stale.names)
    assert ours.clear(include_held=True).count == 150
    for backend in globby:
        assert backend.clear(include_held=True).names == ["mine"]

    assert redis_client.exists(*unrelated) == 1000
    assert list(ours.list()) == []
    # Fence counters are not lock records: clear leaves them, so tokens keep rising.
    assert redis_client.exists(f"{run}-setnx-test:{{n0}}:fence")
    redis_client.delete(*unrelated)


def test_list_and_clear_stream_in_scan_batches(make_backend):
    backend = make_backend()
    pipe_names = [f"n{i:05d}" for i in range(2500)]
    for n in pipe_names:
        backend.acquire(n, "tok", 0.001, OWNER)
    time.sleep(0.01)
    listed = backend.list(state="stale")
    assert iter(listed) is listed  # a generator, not a loaded list
    assert sorted(i.name for i in listed) == pipe_names
    batches = []
    assert backend.clear(dry_run=True, progress=batches.append).count == 2500
    assert len(batches) > 1 and len(list(backend.list())) == 2500
    assert backend.clear().count == 2500


def test_list_rejects_an_unknown_state(make_backend):
    with pytest.raises(ValueError, match="'expired'"):
        make_backend().list(state="expired")


def test_clear_older_than_keeps_recent_locks(make_backend):
    backend = make_backend()
    backend.acquire("old", "tok", 30, OWNER)
    time.sleep(0.3)
    backend.acquire("new", "tok", 30, OWNER)
    assert backend.clear(include_held=True, older_than=0.2).names == ["old"]
    assert backend.get("new") is not None


# -- stale records --------------------------------------------------------------------


def test_expired_record_stays_visible_as_stale_and_does_not_block(redis_client, name):
    holder = lock(name, ttl=0.2, backend="redis")
    assert holder.acquire(blocking=False)
    retention_ms = 86400 * 1000
    assert retention_ms < redis_client.pttl(lock_key(name)) <= retention_ms + 200
    time.sleep(0.3)

    info = holder.info()
    assert info.state == "stale" and info.fencing_token == holder.fencing_token
    assert not holder.locked() and not holder.owned()
    backend = locks["redis"]
    assert [i.name for i in backend.list(state="stale", name_glob=name)] == [name]
    assert list(backend.list(state="held", name_glob=name)) == []

    taker = lock(name, ttl=30, backend="redis")
    assert taker.acquire(blocking=False)
    assert taker.fencing_token > holder.fencing_token
    with pytest.raises(LockNotOwned):
        holder.release()
    assert taker.owned()
    taker.release()


def test_stale_record_disappears_after_the_retention_window(make_backend):
    backend = make_backend(STALE_RETENTION=0.5)
    assert backend.acquire("n", "tok", 0.1, OWNER).acquired
    time.sleep(0.2)
    assert backend.get("n").is_stale
    time.sleep(0.6)
    assert backend.get("n") is None
    first = backend.acquire("n", "tok2", 30, OWNER).fencing_token
    assert first > 1  # a µs clock, not a counter that a lost record would reset


def test_release_of_an_expired_but_untaken_lock_still_succeeds(make_backend):
    backend = make_backend()
    backend.acquire("n", "tok", 0.05, OWNER)
    time.sleep(0.1)
    assert backend.extend("n", "tok", 30)  # still ours: nobody took it over
    assert backend.owns("n", "tok")
    assert backend.release("n", "tok")


# -- queued waiters and handover ----------------------------------------------------


def test_release_wakes_a_blocked_waiter_long_before_the_ttl(name):
    holder = lock(name, ttl=30, backend="redis")
    assert holder.acquire(blocking=False)
    outcome = {}

    def wait():
        started = time.monotonic()
        waiter = lock(name, ttl=30, backend="redis")
        outcome["acquired"] = waiter.acquire(timeout=25)
        outcome["elapsed"] = time.monotonic() - started
        if outcome["acquired"]:
            waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    holder.release()
    thread.join(30)
    assert outcome["acquired"] is True
    assert outcome["elapsed"] < 10


def test_a_release_before_the_waiter_blocks_is_not_lost(make_backend):
    backend = make_backend(WAKE_TTL=5)
    backend.acquire("n", "holder", 30, OWNER)
    contended = backend.acquire("n", "waiter", 30, OWNER, wait=10)  # refused: queued
    assert not contended.acquired and 29 < contended.retry_after <= 30
    assert backend.release("n", "holder")  # lands before the waiter's BLPOP
    started = time.monotonic()
    # Woken at once; the attempt pipelined behind the BLPOP confirmed the claim.
    handed = backend.wait(
        "n", token="waiter", attempt=0, max_wait=None, retry_after=contended.retry_after
    )
    # Under the shortest wait without a wake-up (WAIT_JITTER * WAIT_BLOCK, 0.54 s).
    assert time.monotonic() - started < 0.5
    assert handed.acquired
    assert backend.get("n").fencing_token == handed.fencing_token
    assert backend.get("n").expires_in > 29  # the whole ttl, not the claim
    # A retry with the same token (an answer lost on the way) finds it ours.
    assert backend.acquire("n", "waiter", 30, OWNER, wait=10) == handed
    assert backend.release("n", "waiter")


def test_a_release_hands_the_lock_to_one_waiter(make_backend, redis_client):
    backend = make_backend()
    handed = {}

    assert backend.acquire("n", "tok", 30, OWNER).acquired

    def wait(i):
        # As the Lock does: a refused attempt queues the caller, then it blocks with
        # its next attempt right behind (which confirms a lock handed to it), then
        # it tries again if that attempt did not win.
        assert not backend.acquire("n", f"waiter{i}", 30, OWNER, wait=3).acquired
        result = backend.wait("n", token=f"waiter{i}", attempt=0, max_wait=3, retry_after=30)
        woken_at = time.monotonic()
        if result is None:
            result = backend.acquire("n", f"waiter{i}", 30, OWNER, wait=3)
        handed[i] = (result, woken_at)

    threads = []
    for i in range(2):  # queued in this order
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        time.sleep(0.2)
    released_at = time.monotonic()
    assert backend.release("n", "tok")
    for thread in threads:
        thread.join(10)
    (first, first_at), (second, second_at) = handed[0], handed[1]
    assert first.acquired and first_at - released_at < 0.4
    # The second was not woken by the handoff: it retried at the end of its own wait
    # (WAIT_BLOCK, jittered, from 0.2 s before the release) and is still refused.
    assert not second.acquired and 0.3 < second_at - released_at < WAIT_BLOCK
    assert backend.owns("n", "waiter0") and not backend.owns("n", "waiter1")
    # The inbox was consumed; only the queue entry of waiter1 (still waiting) is left.
    assert not redis_client.exists(backend._inbox_key("n", "waiter0"))
    assert backend.stop_waiting("n", "waiter1") is None
    assert backend.release("n", "waiter0")
    assert not redis_client.exists(*backend._keys("n")[2:])


def test_a_handoff_wakes_the_waiter_it_hands_the_lock_to_and_nobody_else(
    make_backend, redis_client
):
    """Only the first waiter's inbox gets a message; the one behind it is not woken
    (it finds out about a claim that lapses at its next look, see WAIT_BLOCK)."""
    backend = make_backend()
    assert backend.acquire("n", "tok", 30, OWNER).acquired
    for waiter in ("first", "second", "third"):
        assert not backend.acquire("n", waiter, 30, OWNER, wait=3).acquired
    assert backend.release("n", "tok")
    assert redis_client.lrange(backend._inbox_key("n", "first"), 0, -1) == [
        str(backend.get("n").fencing_token).encode()
    ]
    assert not redis_client.exists(
        backend._inbox_key("n", "second"), backend._inbox_key("n", "third")
    )
    for waiter in ("second", "third"):
        assert backend.stop_waiting("n", waiter) is None
    assert backend.acquire("n", "first", 30, OWNER).acquired  # confirms its claim
    assert backend.release("n", "first")


def test_waiters_are_served_first_come_first_served(make_backend):
    backend = make_backend()
    assert backend.acquire("n", "holder", 30, OWNER).acquired
    for i in range(4):
        assert not backend.acquire("n", f"w{i}", 30, OWNER, wait=10).acquired
    # A re-try keeps the place of a waiter's first refusal.
    assert not backend.acquire("n", "w0", 30, OWNER, wait=10).acquired
    order, fencing = [], []
    current = "holder"
    for _ in range(4):
        assert backend.release("n", current)
        current = _holder_token(backend, "n")
        order.append(current)
        fencing.append(backend.get("n").fencing_token)
    assert order == ["w0", "w1", "w2", "w3"]
    assert fencing == sorted(fencing) and len(set(fencing)) == 4
    # The releaser looping straight back queues behind the others: it cannot barge.
    assert not backend.acquire("n", "holder", 30, OWNER, wait=0).acquired
    assert backend.release("n", "w3")
    assert backend.get("n") is None


def _holder_token(backend, name):
    lock_key = backend._keys(name)[0]
    return _text(backend.connection.client.hget(lock_key, "token"))


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def test_a_lapsed_waiter_is_skipped(make_backend):
    """A waiter that stopped retrying (it died) is not handed the lock once its
    registration lapsed: the lock goes to the next live waiter, or is freed."""
    backend = make_backend()
    assert backend.acquire("n", "holder", 30, OWNER).acquired
    assert not backend.acquire("n", "ghost", 30, OWNER, wait=0.05).acquired
    assert not backend.acquire("n", "live", 30, OWNER, wait=10).acquired
    time.sleep(0.1)  # the ghost's wait is over and it never came back
    assert backend.release("n", "holder")
    assert _holder_token(backend, "n") == "live"
    assert backend.release("n", "live")
    assert backend.get("n") is None  # the ghost got nothing


def test_stop_waiting_keeps_a_lock_handed_over_meanwhile(make_backend):
    backend = make_backend()
    assert backend.acquire("n", "holder", 30, OWNER).acquired
    assert not backend.acquire("n", "waiter", 30, OWNER, wait=10).acquired
    assert backend.release("n", "holder")  # handed to the waiter
    kept = backend.stop_waiting("n", "waiter")
    assert kept is not None and kept.acquired
    assert backend.owns("n", "waiter")
    assert backend.release("n", "waiter")


def test_a_lock_handed_over_but_expired_is_passed_on_when_its_waiter_gives_up(make_backend):
    backend = make_backend()
    assert backend.acquire("n", "holder", 30, OWNER).acquired
    assert not backend.acquire("n", "slow", 0.05, OWNER, wait=10).acquired
    assert not backend.acquire("n", "next", 30, OWNER, wait=10).acquired
    assert backend.release("n", "holder")  # handed to "slow" with a 50 ms ttl
    time.sleep(0.1)
    assert backend.stop_waiting("n", "slow") is None  # too late: it expired unused
    assert _holder_token(backend, "n") == "next"
    assert backend.release("n", "next")


def test_a_waiter_interrupted_while_queued_leaves_nothing_behind(name):
    from django_setnx.signals import lock_contended

    holder = lock(name, ttl=30, backend="redis")
    assert holder.acquire(blocking=False)

    def interrupt(sender, **kwargs):
        raise KeyboardInterrupt

    lock_contended.connect(interrupt, dispatch_uid=name)
    try:
        with pytest.raises(KeyboardInterrupt):
            lock(name, backend="redis").acquire(timeout=10)
    finally:
        lock_contended.disconnect(dispatch_uid=name)
    holder.release()
    assert not lock(name, backend="redis").locked(), "handed to a caller that was gone"
    assert lock(name, backend="redis").acquire(blocking=False)


def test_wait_stays_below_the_client_socket_timeout(make_backend):
    backend = make_backend(CONNECTION_KWARGS={"socket_timeout": 0.5})
    # Each BLPOP is capped below the socket timeout, so waiting never times out.
    assert backend.connection.max_block < 0.5
    backend.wait("n", token="t", attempt=0, max_wait=None, retry_after=30)  # no TimeoutError


# -- fencing --------------------------------------------------------------------------


def test_fencing_tokens_keep_rising_across_release_clear_and_delete(redis_client, name):
    backend = locks["redis"]
    tokens = []
    for step in ("release", "clear", "delete"):
        lk = lock(name, ttl=30 if step != "clear" else 0.01, backend="redis")
        assert lk.acquire(blocking=False)
        tokens.append(lk.fencing_token)
        if step == "release":
            lk.release()
        elif step == "clear":
            time.sleep(0.05)
            assert backend.clear(name_glob=escape_glob(name)).names == [name]
        else:
            assert backend.delete(name).fencing_token == lk.fencing_token
            with pytest.raises(LockNotOwned):
                lk.release()
    lk = lock(name, ttl=30, backend="redis")
    assert lk.acquire(blocking=False)
    tokens.append(lk.fencing_token)
    lk.release()
    assert tokens == sorted(set(tokens)) and len(tokens) == 4
    assert int(redis_client.get(lock_key(name).replace(":lock", ":fence"))) == tokens[-1]


# -- outages --------------------------------------------------------------------------


@pytest.mark.parametrize("outage", ["stop", "kill"])
def test_redis_down_mid_hold_raises_backend_error_then_recovers(redis_server, outage):
    params = {"BACKEND": BACKEND, "LOCATION": redis_server.url, "KEY_PREFIX": "t"}
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "private": params}):
        held = lock("n", ttl=30, backend="private")
        assert held.acquire(blocking=False)
        getattr(redis_server, outage)()

        for call in (held.extend, held.release, lock("n", backend="private").acquire, held.locked):
            with pytest.raises(LockBackendError, match="'private'") as excinfo:
                call()
            assert excinfo.value.alias == "private"

        redis_server.start()  # same port, empty: no persistence
        again = lock("n", ttl=30, backend="private")
        assert again.acquire(blocking=False)
        # An empty server knows no token of this name: the clock still mints a larger.
        assert again.fencing_token > held.fencing_token and again.owned()
        again.release()


def test_unreachable_location_raises_and_never_reports_acquired():
    params = {"BACKEND": BACKEND, "LOCATION": f"redis://127.0.0.1:{free_port()}/0"}
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "nowhere": params}):
        for kwargs in ({"blocking": False}, {"timeout": 1}, {}):
            lk = lock("n", ttl=30, backend="nowhere")
            with pytest.raises(LockBackendError, match="'nowhere'"):
                lk.acquire(**kwargs)
            assert lk.fencing_token is None and not lk.owned()
        with pytest.raises(LockBackendError):
            list(locks["nowhere"].list())


# -- reusing a django-redis connection ----------------------------------------------


def test_cache_option_uses_the_django_redis_connection(redis_client):
    prefix = unique("setnx-cache")
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "shared": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": session_url(),
            "KEY_PREFIX": "cache",
        },
    }
    locks_settings = {
        **settings.SETNX_LOCKS,
        "viacache": {"BACKEND": BACKEND, "KEY_PREFIX": prefix, "OPTIONS": {"CACHE": "shared"}},
    }
    try:
        with override_settings(CACHES=caches, SETNX_LOCKS=locks_settings):
            from django.core.cache import caches as django_caches
            from django_redis import get_redis_connection

            backend = locks["viacache"]
            assert backend.connection.client is get_redis_connection("shared")
            first = lock("n", ttl=30, backend="viacache")
            assert first.acquire(blocking=False)
            assert not lock("n", ttl=30, backend="viacache").acquire(blocking=False)
            # Our keys are raw: no django-redis key prefix or version.
            assert redis_client.exists(f"{prefix}:{{n}}:lock")
            assert [i.name for i in backend.list()] == ["n"]
            first.release()
            assert first.info() is None

            locks.reset()  # close() leaves django-redis' pool to django-redis
            django_caches["shared"].set("k", "v")
            assert django_caches["shared"].get("k") == "v"
            django_caches["shared"].delete("k")
    finally:
        delete_prefix(redis_client, prefix)


# -- configuration checks -------------------------------------------------------------


def ids(params, alias="x"):
    return [e.id for e in RedisBackend.check_params(alias, {"BACKEND": BACKEND, **params})]


def test_check_params_accepts_valid_settings():
    assert ids({"LOCATION": "redis://h:6379/0"}) == []
    assert (
        ids(
            {
                "LOCATION": "redis://h/0",
                "KEY_PREFIX": "p",
                "OPTIONS": {
                    "CONNECTION_KWARGS": {"socket_timeout": 2},
                    "CLIENT_CLASS": "redis.Redis.from_url",
                    "STALE_RETENTION": 3600,
                    "WAKE_TTL": 0.5,
                },
            }
        )
        == []
    )
    with override_settings(
        CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://h/0"}}
    ):
        assert ids({"OPTIONS": {"CACHE": "default"}}) == []


@pytest.mark.parametrize(
    "params, expected",
    [
        ({}, "E011"),
        ({"LOCATION": ""}, "E011"),
        ({"LOCATION": "http://h/0"}, "E011"),  # review r126: passed, failed the first lock
        ({"LOCATION": "redis://h:port/0"}, "E011"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"CACHE": "default"}}, "E012"),
        ({"LOCATION": "redis://h/0", "KEY_PREFIX": ""}, "E013"),
        ({"LOCATION": "redis://h/0", "KEY_PREFIX": 5}, "E013"),
        ({"LOCATION": "redis://h/0", "KEY_PREFIX": "app:{t}:x"}, "E013"),
        ({"LOCATION": "redis://h/0", "KEY_PREFIX": "app}"}, "E013"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"STALE_RETENTION": 0}}, "E014"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"STALE_RETENTION": "1d"}}, "E014"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"WAKE_TTL": -1}}, "E015"),
        ({"OPTIONS": {"CACHE": "no-such-cache"}}, "E016"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"CLIENT_CLASS": "nope.Factory"}}, "E017"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"CLIENT_CLASS": "redis.Redis.nope"}}, "E017"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"CLIENT_CLASS": 5}}, "E017"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"CONNECTION_KWARGS": "x"}}, "E018"),
        ({"LOCATION": "redis://h/0", "OPTIONS": {"ALLOW_EVICTION": "yes"}}, "E019"),
    ],
)
def test_check_params_errors(params, expected):
    errors = RedisBackend.check_params("x", {"BACKEND": BACKEND, **params})
    assert [e.id for e in errors] == [f"django_setnx.{expected}"]
    assert "SETNX_LOCKS['x']" in errors[0].msg


REDLOCK = "django_setnx.backends.redlock.RedlockBackend"
MASTERS = [f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)]


@pytest.mark.parametrize(
    "backend_path, location, kwargs, expected",
    [
        (BACKEND, "redis://h/0", {"socket_timout": 1}, "E018"),
        (BACKEND, "redis://h/0?socket_timout=1", {}, "E018"),  # what the first lock meets
        (BACKEND, "redis://h/0", {"ssl": True}, "E018"),
        (BACKEND, "rediss://h/0", {"ssl_cert_reqs": "sometimes"}, "E018"),
        (BACKEND, "unix:///tmp/r.sock", {"socket_keepalive": True, "host": "x"}, "E018"),
        (BACKEND, "redis://h/0", {"socket_timeout": 2, "health_check_interval": 30}, None),
        (BACKEND, "rediss://h/0", {"ssl_cert_reqs": "required", "ssl_ca_certs": __file__}, None),
        # Review r149: values refused by the pool, not the URL (D2); errors other than
        # TypeError/ValueError (D3); TLS files that are not there (D4); no port (D6).
        (BACKEND, "redis://h/0", {"max_connections": "20"}, "E018"),
        (BACKEND, "redis://h/0", {"connection_class": "redis.connection.SSLConnection"}, "E018"),
        (BACKEND, "redis://h/0", {"maint_notifications_config": {"enabled": False}}, "E018"),
        # A missing TLS file is a warning: the checks may run where it is not mounted.
        (BACKEND, "rediss://h/0", {"ssl_ca_certs": "/nonexistent/ca.pem"}, "W010"),
        (BACKEND, "rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem", {}, "W010"),
        (BACKEND, "rediss://h/0", {"ssl_ca_certs": os.path.dirname(__file__)}, "W010"),
        (BACKEND, "rediss://h/0", {"ssl_ca_path": __file__}, "W010"),
        (
            REDLOCK,
            [u.replace("redis:", "rediss:") for u in MASTERS],
            {"ssl_keyfile": "/x"},
            "W031",
        ),
        (BACKEND, "redis://h/0", {"socket_timeout": "3"}, "E018"),
        (BACKEND, "redis://h/0?socket_connect_timeout=0", {}, "E018"),
        (REDLOCK, MASTERS, {"socket_timout": 1}, "E037"),
        (REDLOCK, MASTERS, {"max_connections": -1}, "E037"),
        (REDLOCK, MASTERS, {"single_connection_client": True}, "E037"),
        (REDLOCK, MASTERS, {"socket_timeout": 2}, None),
    ],
)
def test_the_checks_report_connection_kwargs_redis_py_does_not_take(
    backend_path, location, kwargs, expected
):
    """Review r145 N8: a misspelt CONNECTION_KWARGS passed ``manage.py check`` and
    failed the first lock. The check builds a connection object, which does no I/O
    (the hosts here do not exist)."""
    from django.utils.module_loading import import_string

    params = {"BACKEND": backend_path, "LOCATION": location}
    params["OPTIONS"] = {"CONNECTION_KWARGS": kwargs}
    errors = import_string(backend_path).check_params("x", params)
    if expected is None:
        assert errors == []
        return
    assert [e.id for e in errors] == [f"django_setnx.{expected}"], errors  # once per alias
    assert all("SETNX_LOCKS['x']['OPTIONS']['CONNECTION_KWARGS']" in e.msg for e in errors)
    assert all("h:" not in e.msg or "for h:6379" in e.msg for e in errors)
    # The message names the argument, or the value refused.
    named = next(iter(kwargs.items()), ("socket_timout", "/nonexistent/ca.pem", "connect"))
    assert all(any(str(part) in e.msg for part in named) for e in errors), errors


def test_a_client_class_takes_its_own_connection_kwargs_unchecked():
    params = {
        "BACKEND": BACKEND,
        "LOCATION": "redis://h/0",
        "OPTIONS": {"CLIENT_CLASS": "redis.StrictRedis.from_url", "CONNECTION_KWARGS": {"x": 1}},
    }
    assert RedisBackend.check_params("x", params) == []
    # The default, set explicitly, is redis-py's own client: checked (review r149 D7).
    params["OPTIONS"]["CLIENT_CLASS"] = "redis.Redis.from_url"
    assert [e.id for e in RedisBackend.check_params("x", params)] == ["django_setnx.E018"]
    params["LOCATION"] = "http://h/0"
    assert [e.id for e in RedisBackend.check_params("x", params)] == ["django_setnx.E011"]


@pytest.mark.parametrize("backend_path", [BACKEND, REDLOCK])
@pytest.mark.parametrize(
    "kwargs, works",
    [
        ([("password", "pairs-s3cret"), ("socket_timeout", 2)], False),
        ((("socket_timeout", 2),), False),
        (None, True),
        ({}, True),
    ],
)
def test_connection_kwargs_the_check_refuses_are_refused_at_first_use(
    request, backend_path, kwargs, works
):
    """A list of pairs for CONNECTION_KWARGS was refused by ``manage.py check``
    (E018/E037) but taken by the Redis backend, and crashed Redlock with a TypeError,
    as None did (which the check lets pass). Now the check and first use agree: a
    dict or None, else ImproperlyConfigured naming the setting, never the password."""
    if backend_path == BACKEND:
        location = request.getfixturevalue("redis_server").url
    else:
        location = request.getfixturevalue("redlock_masters3").urls
    params = {
        "BACKEND": backend_path,
        "LOCATION": location,
        "KEY_PREFIX": "setnx-test",
        "OPTIONS": {"CONNECTION_KWARGS": kwargs},
    }
    checked = [e.id for e in import_string(backend_path).check_params("kw", params)]
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "kw": params}):
        try:
            if works:
                assert checked == []
                with lock(unique(), ttl=5, backend="kw") as held:
                    assert held.owned()
            else:
                assert checked == [
                    "django_setnx.E018" if backend_path == BACKEND else "django_setnx.E037"
                ]
                with pytest.raises(ImproperlyConfigured, match="must be a dict") as refused:
                    lock(unique(), ttl=5, backend="kw").acquire(blocking=False)
                assert "SETNX_LOCKS['kw']['OPTIONS']['CONNECTION_KWARGS']" in str(refused.value)
                assert "pairs-s3cret" not in str(refused.value)
        finally:
            locks.close_all()


@pytest.mark.parametrize(
    "backend_path, location",
    [
        (BACKEND, ["redis://:Secr3tPW@10.0.0.1:6379/0"]),  # a list, not a str
        (REDLOCK, "redis://:Secr3tPW@10.0.0.1:6379/0"),  # a str, not a list
        (REDLOCK, ["redis://u:Secr3tPW@10.0.0.1:6379/0"] * 3),  # duplicates
        (REDLOCK, ["redis://u:Secr3t/PW@10.0.0.1:6379/0"] * 3),  # unreadable
    ],
)
def test_messages_about_a_location_never_show_its_password(backend_path, location):
    """Review r150: E011/E031/E033 and the backends' ImproperlyConfigured repeated
    the LOCATION, password included."""
    from django.utils.module_loading import import_string

    cls = import_string(backend_path)
    params = {"BACKEND": backend_path, "LOCATION": location}
    messages = [e.msg for e in cls.check_params("x", params)]
    with pytest.raises(ImproperlyConfigured) as refused:
        cls("x", params).get("anything")
    messages.append(str(refused.value))
    # Masked where the URL is shown; masters are named by position (E031, E033).
    assert all(
        "***@10.0.0.1:6379/0" in m or re.search(r"master \d is not|master\(s\) 2, 3", m)
        for m in messages
    ), messages
    assert not any("Secr3t" in m or "PW" in m for m in messages), messages


@pytest.mark.parametrize(
    "setting",
    [
        {"default": {"LOCATION": "redis://:Secr3tPW@10.0.0.1:6379/0"}},  # no BACKEND
        {"default": "redis://:Secr3tPW@10.0.0.1:6379/0"},  # a URL, not a dict
        {"default": {"BACKEND": BACKEND, "OPTIONS": "redis://h/0?password=Secr3tPW"}},
        {"default": {"BACKEND": REDLOCK, "LOCATION": {f"redis://:Secr3tPW@h{i}" for i in "123"}}},
        {
            "default": {
                "BACKEND": REDLOCK,
                "LOCATION": [f"redis://h{i}?password=Secr3tPW" for i in "12"],
            }
        },
        {"default": {"BACKEND": BACKEND, "LOCATION": b"redis://:Secr3tPW@h/0"}},
        # Review r154: a password as a connection argument, not in a URL.
        {
            "default": {
                "BACKNED": BACKEND,
                "OPTIONS": {"CONNECTION_KWARGS": {"password": "Secr3tPW"}},
            }
        },
        {
            "default": {
                "BACKEND": BACKEND,
                "OPTIONS": [("CONNECTION_KWARGS", {"password": "Secr3tPW"})],
            }
        },
        {
            "default": {
                "BACKEND": BACKEND,
                "LOCATION": "redis://h/0",
                "OPTIONS": {"CONNECTION_KWARGS": [("password", "Secr3tPW")]},
            }
        },
        {
            "default": {
                "BACKEND": BACKEND,
                "LOCATION": "redis://h/0",
                "OPTIONS": {"CONNECTION_KWARGS": "password=Secr3tPW"},
            }
        },
        {
            "default": {
                "BACKEND": REDLOCK,
                "LOCATION": MASTERS,
                "OPTIONS": {"CONNECTION_KWARGS": ("ssl_password", "Secr3tPW")},
            }
        },
        [
            {
                "LOCATION": "redis://u:Secr3tPW@h/0",
                "OPTIONS": {"CONNECTION_KWARGS": {"password": "Secr3tPW"}},
            }
        ],
        # Review r155: a URL as the django-redis alias; pairs as lists; a query
        # password with an unencoded "&"; a namedtuple (it crashed the checks).
        {"default": {"BACKEND": BACKEND, "OPTIONS": {"CACHE": "redis://:Secr3tPW@h/0"}}},
        {
            "default": {
                "BACKEND": BACKEND,
                "LOCATION": "redis://h/0",
                "OPTIONS": {"CONNECTION_KWARGS": [["password", "Secr3tPW"]]},
            }
        },
        {"default": {"BACKEND": REDLOCK, "LOCATION": ["redis://h/0?password=ab&Secr3tPW"]}},
        {
            "default": collections.namedtuple("Pair", "key value")(
                "LOCATION", "redis://:Secr3tPW@h"
            )
        },
    ],
)
def test_no_settings_error_shows_a_password(setting):
    """Review r153: E003 and the handler's InvalidLockBackendError printed the whole
    alias; a password in the URL's query, or in a set or bytes, was not masked."""
    from django.core.checks import run_checks

    from django_setnx.handler import LockHandler

    with override_settings(SETNX_LOCKS=setting):
        messages = [e.msg for e in run_checks(tags=["django_setnx"])]
        assert messages
        with pytest.raises(Exception) as refused:  # whatever it is: its message
            LockHandler()["default"].get("x")
        messages.append(str(refused.value))
    assert not any("Secr3tPW" in m for m in messages), messages


def test_a_socket_timeout_of_the_wrong_type_is_a_configuration_error_at_first_use():
    """Review r153: the checks refused socket_timeout="3", but gunicorn and Celery do
    not run them, and the first lock raised a bare TypeError."""
    from decimal import Decimal
    from fractions import Fraction

    for value in ("3", Decimal("2.5"), Fraction(5, 2), 0, -1, True, 10**400):
        options = {"CONNECTION_KWARGS": {"socket_timeout": value}}
        backend = RedisBackend("x", {"LOCATION": session_url(), "OPTIONS": options})
        with pytest.raises(
            ImproperlyConfigured, match="socket_timeout must be None or a positive"
        ):
            backend.get("anything")


def test_a_sentinel_location_s_errors_never_show_its_password():
    from django_setnx.backends.clients import parse_sentinel_url

    # The checks and the backend say what is wrong with it (review r153: the
    # backend's message was the one for redis:// URLs, and the checks said nothing).
    params = {
        "BACKEND": BACKEND,
        "LOCATION": "redis+sentinel://:Secr3tPW@127.0.0.1:26379",
        "OPTIONS": {"CLIENT_CLASS": "django_setnx.backends.clients.sentinel"},
    }
    (error,) = RedisBackend.check_params("x", params)
    assert error.id == "django_setnx.E011" and "must end with /service_name" in error.msg
    with pytest.raises(ImproperlyConfigured, match="must end with /service_name") as refused:
        RedisBackend("x", params).get("anything")
    assert "Secr3tPW" not in error.msg + str(refused.value)

    for bad in ("redis+sentinel://:pa/ss@h:26379/m", "redis+sentinel://:pa#ss@h:26379/a/b/c"):
        with pytest.raises(ValueError) as refused:
            parse_sentinel_url(bad)
        assert "pa" not in str(refused.value).replace("password", ""), refused.value


def test_a_connection_without_a_port_is_named_with_redis_default_port():
    params = {
        "BACKEND": BACKEND,
        "LOCATION": "redis://cache.internal/0",
        "OPTIONS": {"CONNECTION_KWARGS": {"socket_timout": 1}},
    }
    (error,) = RedisBackend.check_params("x", params)
    assert "Connection for cache.internal:6379 refuses its arguments" in error.msg


@pytest.mark.parametrize("backend_path", [BACKEND, REDLOCK])
def test_a_master_url_redis_py_cannot_read_is_reported_and_never_quoted(backend_path):
    """Review r149 D1: a Redlock master whose password holds an unencoded "#" passed
    the checks, and its first lock raised redis-py's ValueError, which quotes the
    part of the password before the "#" as the port."""
    from django.utils.module_loading import import_string

    bad = "redis://:Xy7#kLm@127.0.0.1:7401/0"
    location = bad if backend_path == BACKEND else [bad, *MASTERS[1:]]
    params = {"BACKEND": backend_path, "LOCATION": location}
    cls = import_string(backend_path)
    errors = cls.check_params("x", params)
    expected = "E011" if backend_path == BACKEND else "E031"
    assert [e.id for e in errors] == [f"django_setnx.{expected}"], errors
    assert "Xy7" not in errors[0].msg and "kLm" not in errors[0].msg
    with pytest.raises(ImproperlyConfigured, match="is not a Redis URL") as refused:
        backend = cls("x", params)
        backend.get("anything")  # the first operation makes the clients
    assert "Xy7" not in str(refused.value) and "kLm" not in str(refused.value)


@pytest.mark.parametrize(
    "backend_path, location",
    [
        (BACKEND, "redis://127.0.0.1:1/0"),
        (
            "django_setnx.backends.redlock.RedlockBackend",
            [f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)],
        ),
    ],
)
@pytest.mark.parametrize("prefix", ["app:{t}:x", "}", "a{"])
def test_a_key_prefix_with_braces_is_refused_by_the_backend_too(backend_path, location, prefix):
    # With "app" and "app:{t}:x" both allowed, the name "t}:x:{job" under the first
    # and "job" under the second were one key (app:{t}:x:{job}:lock): each alias'
    # listlocks and clearlocks reached the other's locks. Refused before any use,
    # also where the system checks were not run.
    from django.utils.module_loading import import_string

    with pytest.raises(
        ImproperlyConfigured, match=r"\['KEY_PREFIX'\] must not contain"
    ) as refused:
        import_string(backend_path)(
            "x", {"BACKEND": backend_path, "LOCATION": location, "KEY_PREFIX": prefix}
        )
    assert repr(prefix) in str(refused.value)


def test_a_cache_that_is_not_django_redis_is_refused_by_the_checks():
    """Review r126: OPTIONS['CACHE'] naming a locmem cache passed the checks and
    failed the first lock."""
    with override_settings(
        CACHES={"local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    ):
        errors = RedisBackend.check_params(
            "x", {"BACKEND": BACKEND, "OPTIONS": {"CACHE": "local"}}
        )
    assert [e.id for e in errors] == ["django_setnx.E016"]
    assert "not a django-redis cache" in errors[0].msg and "'local'" in errors[0].msg


@pytest.mark.parametrize("location", ["http://:secret@h/0", "redis://default:secret/pw@h:6379/0"])
def test_a_location_redis_py_cannot_read_is_a_configuration_error_naming_the_alias(location):
    """Review r126: the first lock raised redis-py's bare ValueError. Review r129:
    neither message repeats the password, which redis-py quotes as a "port" when it
    has an unencoded "/" or "#"."""
    (error,) = RedisBackend.check_params("bad-url", {"BACKEND": BACKEND, "LOCATION": location})
    assert error.id == "django_setnx.E011" and "secret" not in error.msg
    backend = RedisBackend("bad-url", {"BACKEND": BACKEND, "LOCATION": location})
    with pytest.raises(ImproperlyConfigured, match=r"SETNX_LOCKS\['bad-url'\]") as refused:
        backend.owns("name", "token")
    assert "secret" not in str(refused.value)


class WrappingCache(BaseCache):
    """A cache that wraps django-redis' (an instrumenting one, say), not a subclass:
    it lends its connection all the same (``client.get_client()``)."""

    def __init__(self, location, params):
        from django_redis.cache import RedisCache

        super().__init__(params)
        self.inner = RedisCache(location, params)

    @property
    def client(self):
        return self.inner.client


def test_a_cache_that_wraps_django_redis_passes_the_checks():
    """Review r129: E016 asked for a subclass of django-redis' cache, and refused a
    wrapping one that works (so `check` and `migrate` failed)."""
    with override_settings(
        CACHES={
            "wrapped": {
                "BACKEND": "tests.test_redis_backend.WrappingCache",
                "LOCATION": "redis://h/0",
            }
        }
    ):
        assert ids({"OPTIONS": {"CACHE": "wrapped"}}) == []


def test_an_unknown_option_is_left_to_the_system_checks_warning():
    # check_params no longer reports it (E019); checks.py warns (W002) for every backend.
    from django_setnx.checks import check_setnx_locks

    params = {"BACKEND": BACKEND, "LOCATION": "redis://h/0", "OPTIONS": {"STALE_RETENTON": 5}}
    assert ids(params) == []
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "x": params}):
        warnings = [m for m in check_setnx_locks() if "SETNX_LOCKS['x']" in m.msg]
    assert [m.id for m in warnings] == ["django_setnx.W002"]
    assert "STALE_RETENTION" in warnings[0].hint


def test_check_params_does_not_connect():
    # A host that cannot resolve: any connection attempt would fail loudly or hang.
    assert ids({"LOCATION": "redis://no-such-host.invalid:1/0"}) == []


def test_private_server_restarts_on_the_same_port_and_refuses_keys(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    with pytest.raises(redis.ResponseError):
        client.keys("*")  # renamed away: our code must use SCAN
    redis_server.kill()
    assert not redis_server.ping()
    redis_server.start()
    assert client.ping()
    client.close()


def test_release_hands_the_lock_to_a_waiter_before_a_newcomer(name):
    """A release with a live waiter hands the lock straight to it: a newcomer (say, the
    releaser looping straight back to acquire) finds it held by the waiter."""
    backend = locks["redis"]
    owner = {"host": "h", "pid": 1, "thread": "t"}
    assert backend.acquire(name, "holder", 30, owner).acquired
    assert not backend.acquire(name, "waiter", 10, owner, wait=10).acquired  # queued
    assert backend.release(name, "holder")

    newcomer = backend.acquire(name, "newcomer", 30, owner, wait=0)
    assert not newcomer.acquired, "the lock must go to the waiter first"
    assert 0.3 < newcomer.retry_after <= 0.5  # the waiter's claim, until it confirms
    retried = backend.acquire(name, "waiter", 10, owner, wait=10)  # the waiter's next look
    assert retried.acquired and retried.fencing_token == backend.get(name).fencing_token
    newcomer = backend.acquire(name, "newcomer", 30, owner, wait=0)
    assert not newcomer.acquired and 9 < newcomer.retry_after <= 10  # confirmed: its ttl
    assert backend.release(name, "waiter")
    # No waiter left: a newcomer gets a free lock at once.
    assert backend.acquire(name, "newcomer", 30, owner, wait=0).acquired
    assert backend.release(name, "newcomer")


def test_a_waiter_that_gave_up_holds_nothing_back(name):
    holder = lock(name, ttl=30, backend="redis")
    holder.acquire()
    assert lock(name, backend="redis").acquire(timeout=0.05) is False  # queued, then gave up
    holder.release()
    assert lock(name, backend="redis").acquire(blocking=False), "no reservation for a quitter"


GLOB_NAMES = [
    "a",
    "ab",
    "a]",
    "a!",
    "a-",
    "a^",
    "ac",
    "a[",
    "a\\",
    "b",
    "abc",
    "a*",
    "a?",
    "ü",
    "a}:lock",
    "}",
    "{a}",
    "a{b}:lock",
    "é" * 3,
    "a" * 200,
]
GLOB_PATTERNS = [
    "a*",
    "a?",
    "a[bc]",
    "a[!b]",
    "a[^b]",
    "a[]]",
    "a[\\]]",
    "a[b-]",
    "a[c-a]",
    "a\\*",
    "a\\?",
    "*",
    "?",
    "[a-b]*",
    "a[\\\\]",
    "[ü]",
    "a[b-c]*",
    "??",
    "[é]*",
]
# Patterns that tried, through Redis' own dialect, to reach past the name part of
# the key (its "}:lock" suffix, the hash tag's braces), or to make matching slow.
HOSTILE_GLOBS = [
    "*}:lock",
    "*}:lock*",
    "a}*",
    "}*",
    "*{*",
    "*}",
    "{*}",
    "*:lock",
    "a{b}:lock",
    "*a" * 40 + "*b",
    "*" * 200,
    "?" * 200,
    "[!a]*",
    "\\*\\?\\[\\]\\\\",
]
MALFORMED_GLOBS = ["a[", "a[^]", "[", "a\\", "a[b\\", "x" * 1001]


@pytest.mark.parametrize("pattern", GLOB_PATTERNS + HOSTILE_GLOBS)
def test_list_and_clear_select_exactly_what_the_glob_matches(make_backend, redis_client, pattern):
    """On Redis ``name_glob`` selects exactly the names ``compile_glob`` matches, as on
    every other backend: SCAN MATCH only narrows the scan (to the literal prefix),
    Redis' byte-wise dialect decides nothing, and no key outside the prefix is touched."""
    backend = make_backend()
    # Look-alike prefixes next door (braces are not allowed in a prefix).
    neighbour = make_backend(backend.key_prefix + ":x")
    for n in GLOB_NAMES:
        assert backend.acquire(n, "tok", 30, OWNER).acquired
        assert neighbour.acquire(n, "tok", 30, OWNER).acquired
    expected = sorted(n for n in GLOB_NAMES if compile_glob(pattern).match(n))

    assert sorted(i.name for i in backend.list(name_glob=pattern)) == expected
    assert (
        sorted(backend.clear(include_held=True, dry_run=True, name_glob=pattern).names) == expected
    )
    assert sorted(backend.clear(include_held=True, name_glob=pattern).names) == expected
    assert sorted(i.name for i in backend.list()) == sorted(set(GLOB_NAMES) - set(expected))
    assert sorted(i.name for i in neighbour.list()) == sorted(GLOB_NAMES)


@pytest.mark.parametrize("pattern", MALFORMED_GLOBS)
def test_a_malformed_glob_is_refused_before_anything_is_sent(pattern):
    # Nothing listens there: anything sent would fail with LockBackendError instead.
    backend = RedisBackend(
        "nowhere", {"BACKEND": BACKEND, "LOCATION": f"redis://127.0.0.1:{free_port()}/0"}
    )
    with pytest.raises(ValueError, match="glob"):
        backend.list(name_glob=pattern)
    with pytest.raises(ValueError, match="glob"):
        backend.clear(name_glob=pattern)


def test_a_handoff_confirmed_too_late_is_never_reported_as_held(make_backend):
    """The waiter a lock was handed to confirms after its claim (CLAIM_MS) ran out:
    if someone took the lock meanwhile, it is refused; if nobody did, it takes the
    lock over afresh (a new fencing token, its whole ttl), never the lapsed record."""
    from django_setnx.backends.redis_scripts import CLAIM_MS

    backend = make_backend()
    for someone_else_took_it in (True, False):
        assert backend.acquire("n", "holder", 30, OWNER).acquired
        assert not backend.acquire("n", "slow", 30, OWNER, wait=10).acquired  # queued
        assert backend.release("n", "holder")  # handed to "slow": a claim
        claimed = backend.get("n")
        assert claimed.expires_in <= CLAIM_MS / 1000
        time.sleep(CLAIM_MS / 1000 + 0.1)
        if someone_else_took_it:
            assert backend.acquire("n", "other", 30, OWNER).acquired
            late = backend.acquire("n", "slow", 30, OWNER, wait=0)
            assert not late.acquired and late.retry_after > 29
            assert backend.release("n", "other")
        else:
            late = backend.acquire("n", "slow", 30, OWNER, wait=0)
            assert late.acquired and late.fencing_token > claimed.fencing_token
            assert backend.get("n").expires_in > 29
            assert backend.release("n", "slow")


def test_a_waiter_that_gives_up_keeps_a_handed_lock_with_its_whole_ttl(make_backend):
    backend = make_backend()
    assert backend.acquire("n", "holder", 30, OWNER).acquired
    assert not backend.acquire("n", "waiter", 20, OWNER, wait=10).acquired
    assert backend.release("n", "holder")  # a claim for "waiter"
    kept = backend.stop_waiting("n", "waiter")
    assert kept is not None and kept.acquired
    assert backend.get("n").expires_in > 19  # confirmed: its ttl, not the claim
    assert backend.release("n", "waiter")
