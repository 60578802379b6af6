"""Fencing tokens without permanent per-name state.

A fencing token strictly increases per name across releases, takeovers, restarts,
``clearlocks`` and forced releases, and across the removal of every record of the
name (evicted, purged, deleted by hand, migrated), while no key or row of a name
outlives its last use by more than the stale-retention window. Tokens are a hybrid
clock (the backend's clock in µs, or the name's last token plus one), so they fit
in 53 bits (JSON-safe) for centuries.
"""

import threading
import time

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections
from django.test import override_settings

from django_setnx import lock, locks
from tests import workers
from tests.backend_sql import before_statements

# Rows are deleted by hand and migrations run: every statement must commit.
pytestmark = pytest.mark.autocommit

JSON_SAFE = 2**53


def acquired_token(alias, name, ttl=30):
    lk = lock(name, ttl=ttl, backend=alias)
    assert lk.acquire(timeout=5)
    token = lk.fencing_token
    lk.release()
    return token


def delete_every_record_by_hand(alias, name):
    """Remove every key or row of ``name`` from the storage itself, bypassing the
    backend (as an operator, an eviction or a purge would)."""
    params = settings.SETNX_LOCKS[alias]
    backend = params["BACKEND"].rsplit(".", 1)[-1]
    if backend == "DatabaseBackend":
        database = params.get("OPTIONS", {}).get("DATABASE", "default")
        with connections[database].cursor() as cursor:
            cursor.execute("DELETE FROM django_setnx_lock WHERE name = %s", [name])
    elif backend in ("RedisBackend", "RedlockBackend"):
        import redis

        urls = params["LOCATION"]
        urls = [urls] if isinstance(urls, str) else urls
        prefix = params.get("KEY_PREFIX", "setnx")
        for url in urls:
            client = redis.Redis.from_url(url)
            keys = list(client.scan_iter(match=f"{prefix}:{{{name}}}:*"))
            if keys:
                client.delete(*keys)
            client.close()
    else:  # locmem
        locks[alias]._store.records.pop(name, None)


def test_tokens_are_json_safe_integers(alias, name):
    token = acquired_token(alias, name)
    assert isinstance(token, int) and 0 < token < JSON_SAFE


def test_tokens_increase_after_every_record_is_deleted_by_hand(alias, name):
    first = acquired_token(alias, name)
    holder = lock(name, ttl=30, backend=alias)
    assert holder.acquire(timeout=5)
    second = holder.fencing_token
    assert second > first
    delete_every_record_by_hand(alias, name)
    third = acquired_token(alias, name)
    assert third > second
    delete_every_record_by_hand(alias, name)
    assert acquired_token(alias, name) > third


def test_tokens_increase_across_takeovers_clearlocks_and_force_releases(alias, name):
    tokens = []
    stale = lock(name, ttl=0.05, backend=alias)
    assert stale.acquire(timeout=5)
    tokens.append(stale.fencing_token)
    time.sleep(0.1)
    taker = lock(name, ttl=30, backend=alias)
    assert taker.acquire(timeout=5)  # a takeover of the expired record
    tokens.append(taker.fencing_token)
    call_command("clearlocks", "--all", "--noinput", "--backend", alias, verbosity=0)
    held = lock(name, ttl=30, backend=alias)
    assert held.acquire(timeout=5)
    tokens.append(held.fencing_token)
    locks[alias].delete(name)  # what the admin's force-release does
    tokens.append(acquired_token(alias, name))
    assert tokens == sorted(set(tokens)), tokens


def test_tokens_increase_across_processes(shared_alias, name, spawn):
    env = workers.child_environment()
    before = acquired_token(shared_alias, name)
    answer = spawn.ctx.Queue()
    child = spawn(workers.fencing_tokens, env, shared_alias, name, 3, answer)
    theirs = answer.get(timeout=60)
    child.join(timeout=30)
    after = acquired_token(shared_alias, name)
    assert [before, *theirs, after] == sorted({before, *theirs, after})


def test_tokens_increase_under_contention(shared_alias, name, spawn):
    """Processes racing for one name: in the order the holds happened, every token
    is larger than the one before. (On the databases an acquiring statement reads the
    clock when it begins; one that began before another client acquired and released
    must still get a larger token than that client: the released row is kept as a
    tombstone carrying the last token.)"""
    env = workers.child_environment()
    counter = spawn.ctx.Value("q", 0)
    answer = spawn.ctx.Queue()
    racers = [
        spawn(workers.contended_fencing_tokens, env, shared_alias, name, 3.0, counter, answer)
        for _ in range(4)
    ]
    pairs = sorted(pair for _ in racers for pair in answer.get(timeout=120))
    for racer in racers:
        racer.join(timeout=30)
    assert len(pairs) > 50, "the racers hardly ran"
    backwards = [(a, b) for a, b in zip(pairs, pairs[1:]) if b[1] <= a[1]]
    assert backwards == [], f"{len(backwards)} of {len(pairs)} tokens went backwards"


def test_a_released_row_keeps_its_token_then_goes(db_alias, name):
    """The tombstone a release leaves is no lock (free, hidden), carries the last
    token for the next acquire, and is purged once FENCING_RETENTION_MS old."""
    from django_setnx.backends import db_sql

    backend = locks[db_alias]
    first = acquired_token(db_alias, name)
    assert backend.get(name) is None
    assert [info.name for info in backend.list() if info.name == name] == []
    connection = connections[settings.SETNX_LOCKS[db_alias]["OPTIONS"]["DATABASE"]]
    table = connection.ops.quote_name(db_sql.LOCK_TABLE)
    # Whatever the clock says now, the next token continues from the tombstone's.
    future = first + 10**9
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET fencing = %s WHERE name = %s", [future, name])
    assert acquired_token(db_alias, name) == future + 1
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET acquired_at = 1 WHERE name = %s", [name])
    backend.clear()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {table} WHERE name = %s", [name])
        assert cursor.fetchone() == (0,), "an old tombstone is purged"


def test_a_cleared_row_keeps_its_token_as_a_released_one_does(db_alias, name):
    """clearlocks removes a recently acquired lock (held, or expired and stale) as a
    release does: a tombstone carrying its token, so the next acquire continues from
    it, not from the clock (an acquiring statement that read the clock before that
    holder acquired may still be on its way). A row acquired longer ago than the
    retention is deleted outright."""
    from django_setnx.backends import db_sql

    backend = locks[db_alias]
    connection = connections[settings.SETNX_LOCKS[db_alias]["OPTIONS"]["DATABASE"]]
    table = connection.ops.quote_name(db_sql.LOCK_TABLE)

    def set_fencing(value):
        with connection.cursor() as cursor:
            cursor.execute(f"UPDATE {table} SET fencing = %s WHERE name = %s", [value, name])

    # Held: clearlocks --all.
    holder = lock(name, ttl=30, backend=db_alias)
    assert holder.acquire(timeout=5)
    ahead = holder.fencing_token + 10**9  # tokens ahead of the clock
    set_fencing(ahead)
    assert backend.clear(include_held=True, name_glob=name).names == [name]
    assert backend.get(name) is None
    assert acquired_token(db_alias, name) == ahead + 1
    # Expired, not released: clearlocks.
    stale = lock(name, ttl=0.05, backend=db_alias)
    assert stale.acquire(timeout=5)
    set_fencing(ahead + 10)
    time.sleep(0.1)
    assert backend.clear(name_glob=name).names == [name]
    assert acquired_token(db_alias, name) == ahead + 11
    # Acquired longer ago than the retention: deleted (state stays bounded).
    assert lock(name, ttl=30, backend=db_alias).acquire(timeout=5)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET acquired_at = 1 WHERE name = %s", [name])
    assert backend.clear(include_held=True, name_glob=name).names == [name]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {table} WHERE name = %s", [name])
        assert cursor.fetchone() == (0,)
    # A token past what a lock may be given (written by hand) is not kept: as a
    # tombstone it would refuse every acquire of the name.
    assert lock(name, ttl=30, backend=db_alias).acquire(timeout=5)
    set_fencing(JSON_SAFE + 5)
    assert backend.clear(include_held=True, name_glob=name).names == [name]
    assert 0 < acquired_token(db_alias, name) < JSON_SAFE


def test_clear_leaves_alone_a_lock_taken_while_it_runs(db_alias, name, monkeypatch):
    """Review r162: clearlocks --all tombstones a recent row, then deletes the old
    ones in a second statement. A lock acquired in between (the tombstone is free
    to take) is recent: the DELETE must leave it held, with its token, and the name
    is reported once. Another client's acquire is run just before the DELETE is
    sent (on MySQL it waits for clear's transaction, which holds the row)."""
    backend = locks[db_alias]
    assert lock(name, ttl=30, backend=db_alias).acquire(timeout=5)
    taker = lock(name, ttl=30, backend=db_alias)
    took = threading.Thread(target=taker.acquire, kwargs={"timeout": 10})

    def acquire_before_the_batch_delete(statement):
        # The batch's DELETE, not the purge of old tombstones before it.
        if statement.startswith("DELETE") and "name IN (" in statement and took.ident is None:
            took.start()
            took.join(timeout=1)  # done, or (MySQL) waiting for the row

    before_statements(monkeypatch, backend, "clear", acquire_before_the_batch_delete)
    assert backend.clear(include_held=True, name_glob=name).names == [name]
    monkeypatch.undo()
    took.join(timeout=10)
    assert taker.owned(), "the lock taken while clear ran was removed"
    taker.extend(30)  # raises LockNotOwned if it was removed
    assert acquired_token(db_alias, "other-" + name) > 0
    assert lock(name, backend=db_alias).acquire(blocking=False) is False
    token = taker.fencing_token
    taker.release()
    assert acquired_token(db_alias, name) > token


# -- bounded state ---------------------------------------------------------------------


def test_redis_keeps_no_key_without_a_ttl(name, redis_client):
    """Many distinct names, acquired and released, abandoned stale or still held:
    every key under the prefix has a TTL (there used to be a fence counter per name,
    without one)."""
    backend = locks["redis"]
    for i in range(600):
        n = f"{name}:{i}"
        token = f"t{i}"
        assert backend.acquire(n, token, 30 if i % 3 else 0.05, {"host": "h", "pid": 1}).acquired
        if i % 3 == 1:
            assert backend.release(n, token)
    prefix = settings.SETNX_LOCKS["redis"]["KEY_PREFIX"]
    keys = list(redis_client.scan_iter(match=f"{prefix}:{{{name}:*", count=1000))
    assert len(keys) >= 600
    pipe = redis_client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    assert all(ttl > 0 for ttl in pipe.execute()), "a key without a TTL"


def test_redis_legacy_fence_counters_are_dropped_by_clear(name, redis_client):
    """Counters of version 0.1 (``P:{N}:fence`` without a TTL) go at the next clear;
    the next token is larger than the counter anyway."""
    prefix = settings.SETNX_LOCKS["redis"]["KEY_PREFIX"]
    legacy = f"{prefix}:{{{name}}}:fence"
    redis_client.set(legacy, 41)
    assert acquired_token("redis", name) > 41
    released_fence = redis_client.pttl(legacy)
    assert released_fence > 0, "the release wrote the fence with a TTL"
    other = f"{prefix}:{{{name}:old}}:fence"
    redis_client.set(other, 7)
    call_command("clearlocks", "--backend", "redis", verbosity=0)
    assert not redis_client.exists(other)
    assert redis_client.exists(legacy), "a fence with a TTL is today's: left to expire"


def test_database_purges_stale_rows_after_the_retention(db_alias, name):
    """Rows that expired without a release are purged once STALE_RETENTION old, by
    the acquires themselves (at most once per PURGE_EVERY): no cron job needed."""
    params = {
        **settings.SETNX_LOCKS[db_alias],
        "OPTIONS": {**settings.SETNX_LOCKS[db_alias].get("OPTIONS", {}), "STALE_RETENTION": 1},
    }
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "purging": params}):
        backend = locks["purging"]
        for i in range(50):
            assert backend.acquire(f"{name}:{i}", f"t{i}", 0.05, {"host": "h"}).acquired
        assert len(list(backend.list(name_glob=f"{name}:*"))) == 50
        time.sleep(1.3)
        assert acquired_token("purging", f"{name}:fresh") > 0
        assert [info.name for info in backend.list(name_glob=f"{name}:*")] == []
    locks.reset()


# -- the migration that removed the counters table ---------------------------------------


def latest_migration():
    """The name of django_setnx's latest migration."""
    from django.db.migrations.loader import MigrationLoader

    (leaf,) = MigrationLoader(None, ignore_no_migrations=True).graph.leaf_nodes("django_setnx")
    return leaf[1]


@pytest.fixture
def migrate(db_alias):
    """``migrate(target)`` runs django_setnx's migrations on ``db_alias`` to ``target``;
    the app is migrated to its latest migration again afterwards."""
    from django.db.migrations.executor import MigrationExecutor

    connection = connections[db_alias]

    def run(target):
        executor = MigrationExecutor(connection)
        executor.migrate([("django_setnx", target)])
        locks.close_all()  # the backends' connections saw the old table

    yield run
    run(latest_migration())


def test_tokens_issued_after_the_migration_are_larger(db_alias, name, migrate):
    migrate("0002_next_in_line")
    quote = connections[db_alias].ops.quote_name
    now = int(time.time() * 1000)
    with connections[db_alias].cursor() as cursor:
        # What version 0.1 left behind: counters, and a held lock.
        cursor.execute(
            f"INSERT INTO {quote('django_setnx_fence')} (name, value) VALUES (%s, %s), (%s, %s)",
            [name, 5000, f"{name}:gone", 7],
        )
        cursor.execute(
            f"INSERT INTO {quote('django_setnx_lock')} (name, token, owner, acquired_at, "
            f"expires_at, next_token, next_since, next_seen) "
            f"VALUES (%s, %s, '{{}}', %s, %s, '', 0, 0)",
            [name, "old-token", now, now + 60_000],
        )
    migrate("0003_fencing_in_the_lock_row")
    backend = locks[db_alias]
    assert backend.get(name).fencing_token == 5000, "the held lock keeps its token"
    assert backend.release(name, "old-token")
    assert acquired_token(db_alias, name) > 5000
    assert acquired_token(db_alias, f"{name}:gone") > 7


def test_the_migration_refuses_a_counter_ahead_of_the_clock(db_alias, name, migrate):
    migrate("0002_next_in_line")
    quote = connections[db_alias].ops.quote_name
    with connections[db_alias].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote('django_setnx_fence')} (name, value) VALUES (%s, %s)",
            [name, 10**17],
        )
    with pytest.raises(RuntimeError, match="at least the database clock"):
        migrate("0003_fencing_in_the_lock_row")
    with connections[db_alias].cursor() as cursor:
        cursor.execute(f"DELETE FROM {quote('django_setnx_fence')} WHERE name = %s", [name])


def test_a_released_row_is_nobodys(alias, name):
    """The empty token marks a released record: no call can claim it (adopting it
    would make an invisible lock that blocks every acquire)."""
    from django_setnx import lock

    acquired_token(alias, name)  # leaves a released record on the databases
    backend = locks[alias]
    assert backend.extend(name, "", 30) is False
    assert backend.owns(name, "") is False
    assert backend.release(name, "") is False
    with pytest.raises(ValueError, match="non-empty"):
        lock(name, backend=alias).adopt("")
    taker = lock(name, ttl=30, backend=alias)
    assert taker.acquire(blocking=False)
    taker.release()


def set_last_token_by_hand(alias, name, value):
    """Make ``value`` the last fencing token of the released ``name``, in the
    storage itself (a hand-written value, or one a clock set centuries ahead left)."""
    params = settings.SETNX_LOCKS[alias]
    if params["BACKEND"].endswith("DatabaseBackend"):
        database = params.get("OPTIONS", {}).get("DATABASE", "default")
        with connections[database].cursor() as cursor:
            cursor.execute(
                "UPDATE django_setnx_lock SET fencing = %s WHERE name = %s", [value, name]
            )
            assert cursor.rowcount == 1
        return
    import redis

    urls = params["LOCATION"]
    for url in [urls] if isinstance(urls, str) else urls:
        client = redis.Redis.from_url(url)
        key = f"{params.get('KEY_PREFIX', 'setnx')}:{{{name}}}:fence"
        assert client.set(key, value, px=60_000, xx=True)
        client.close()


def test_tokens_past_53_bits_are_refused_not_repeated(shared_alias, name):
    """Review r158: a remembered token near 2**53 made Redis repeat 2**53 to three
    holders in turn (Lua's doubles), and the databases hand out tokens above
    2**53 - 1, which the listing shows as 0; a corrupt one ("inf", 1e300) made Redis
    hand out a negative token, again and again. The last token that fits is given;
    past it every acquire fails with LockBackendError, and the lock is left free."""
    from django_setnx.exceptions import LockBackendError

    acquired_token(shared_alias, name)
    set_last_token_by_hand(shared_alias, name, JSON_SAFE - 2)
    holder = lock(name, ttl=30, backend=shared_alias)
    assert holder.acquire(timeout=5)
    assert holder.fencing_token == JSON_SAFE - 1
    # A waiter queued behind the last token: the release still goes through (review
    # r160: on Redis it failed, and dropped the waiter from the queue), and the
    # waiter hears of the exhaustion at its next attempt.
    waited = []

    def wait_for_it():
        try:
            waited.append(lock(name, ttl=30, backend=shared_alias).acquire(timeout=10))
        except LockBackendError as exc:
            waited.append(exc)

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    time.sleep(0.5)
    holder.release()
    waiter.join(15)
    assert len(waited) == 1 and isinstance(waited[0], LockBackendError), waited
    assert "fencing tokens" in str(waited[0])
    for _ in range(2):
        refused = lock(name, ttl=30, backend=shared_alias)
        with pytest.raises(LockBackendError, match="fencing tokens"):
            refused.acquire(timeout=0)
        assert not refused.owned()
        info = locks[shared_alias].get(name)
        assert info is None or not info.is_held
    # Force-release and clearlocks of an exhausted name go through too.
    locks[shared_alias].delete(name)
    call_command("clearlocks", "--all", "--noinput", "--backend", shared_alias, verbosity=0)
    if not settings.SETNX_LOCKS[shared_alias]["BACKEND"].endswith("DatabaseBackend"):
        for corrupt in ("inf", "1e300"):
            set_last_token_by_hand(shared_alias, name, corrupt)
            with pytest.raises(LockBackendError, match="fencing tokens"):
                lock(name, ttl=30, backend=shared_alias).acquire(timeout=0)
