"""Locks and the caller's database transaction.

A decorated call (``@locked``, an ``ExclusiveTask`` body) made inside
``transaction.atomic()`` or under ``ATOMIC_REQUESTS`` keeps its lock until the
transaction commits, so the next holder reads what it wrote; after a rollback the
lock is released at once. ``with lock(..., release_on_commit=True)`` opts in to the
same; a plain ``with lock(...)`` releases at the end of its block.

These tests run without pytest-django's per-test transaction (``autocommit``): the
behaviour under test is what COMMIT and ROLLBACK do.
"""

import contextlib
import threading
import time
import uuid

import pytest
from django.conf import settings
from django.db import connections, transaction
from django.http import HttpResponse
from django.test import Client
from django.urls import path

from django_setnx import lock, locked, locks
from django_setnx.exceptions import LockBackendError, LockNotOwned

pytestmark = pytest.mark.autocommit


def held(alias, name):
    info = locks[alias].get(name)
    return info is not None and info.is_held


@contextlib.contextmanager
def lost_names():
    """The names of the locks reported lost (``lock_lost``) inside the block."""
    from django_setnx.signals import lock_lost

    lost, uid = [], f"test-lost-{uuid.uuid4().hex}"
    lock_lost.connect(lambda lock, **kw: lost.append(lock.name), weak=False, dispatch_uid=uid)
    try:
        yield lost
    finally:
        lock_lost.disconnect(dispatch_uid=uid)


@pytest.fixture
def counter_table():
    """A one-row counter table on PostgreSQL, dropped afterwards."""
    if "postgres" not in settings.DATABASES:
        pytest.skip("PostgreSQL is not among SETNX_TEST_BACKENDS")
    table = f"setnx_counter_{uuid.uuid4().hex[:12]}"
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, value int NOT NULL)")
        cursor.execute(f"INSERT INTO {table} VALUES (1, 0)")
    yield table
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"DROP TABLE {table}")


def test_read_modify_write_inside_atomic_loses_no_update(alias, name, counter_table):
    """4 threads x 20 increments, each a @locked read-modify-write called inside the
    thread's own atomic() on PostgreSQL: the lock is released only after COMMIT, so
    every increment reads the previous one's committed value."""

    @locked(name, ttl=30, timeout=60, backend=alias, using="postgres")
    def increment():
        with connections["postgres"].cursor() as cursor:
            cursor.execute(f"SELECT value FROM {counter_table} WHERE id = 1")
            value = cursor.fetchone()[0]
            time.sleep(0.001)
            cursor.execute(f"UPDATE {counter_table} SET value = %s WHERE id = 1", [value + 1])

    errors = []

    def worker():
        try:
            for _ in range(20):
                with transaction.atomic(using="postgres"):
                    increment()
                    # Work after the guarded call, before COMMIT: the window in which
                    # a lock released at the call's end let the next holder in.
                    time.sleep(0.002)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"SELECT value FROM {counter_table} WHERE id = 1")
        assert cursor.fetchone()[0] == 80
    assert not held(alias, name)


def test_sqlite_writer_inside_atomic_releases_after_commit(name):
    """A @locked function that writes to SQLite inside atomic(), with its lock in the
    same SQLite database: no 'database is locked' on release (the release waits for
    the caller's COMMIT, which frees SQLite's single write lock), and the lock is free
    afterwards."""
    from django.contrib.auth.models import Group

    group_name = f"g-{uuid.uuid4().hex}"

    @locked(name, ttl=30, backend="default")
    def write():
        Group.objects.create(name=group_name)

    try:
        with transaction.atomic():
            write()
            assert held("default", name), "released before the transaction committed"
        assert not held("default", name)
        assert Group.objects.filter(name=group_name).exists()
    finally:
        Group.objects.filter(name=group_name).delete()


def test_release_waits_for_commit(alias, name):
    """The lock is still held while COMMIT runs (an on_commit callback registered
    before the guarded call sees it held), and free once the atomic block has exited."""
    seen = []

    @locked(name, ttl=30, backend=alias)
    def guarded():
        return "done"

    with transaction.atomic():
        transaction.on_commit(lambda: seen.append(held(alias, name)))
        assert guarded() == "done"
        assert held(alias, name)
    assert seen == [True]
    assert not held(alias, name)


def test_rollback_releases_at_once(alias, name):
    @locked(name, ttl=30, backend=alias)
    def guarded():
        return 1

    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            guarded()
            assert held(alias, name)
            raise ZeroDivisionError
    assert not held(alias, name)


def test_savepoint_rollback_releases_while_the_outer_transaction_goes_on(alias, name):
    @locked(name, ttl=30, backend=alias)
    def guarded():
        return 1

    with transaction.atomic():
        try:
            with transaction.atomic():  # a savepoint
                guarded()
                assert held(alias, name)
                raise KeyError("undo")
        except KeyError:
            pass
        if locks[alias].writes_wait_for_transaction("default"):
            # SQLite, the same database: the backend cannot write before the outer
            # transaction ends, so the release waits for that end.
            assert held(alias, name)
        else:
            assert not held(alias, name), "the savepoint rolled back: nothing to protect"
        other = locked(f"{name}:2", ttl=30, backend=alias)(lambda: 2)
        other()
        assert held(alias, f"{name}:2")
    assert not held(alias, name) and not held(alias, f"{name}:2")


def test_sqlite_savepoint_rollback_after_the_outer_transaction_wrote(name):
    """SQLite, the lock on the same database, a guarded call that wrote in a savepoint
    which then rolled back: the transaction goes on holding SQLite's single write
    lock, so the release cannot happen at the rollback; it happens when the outer
    transaction ends, with no error and no wait."""
    from django.contrib.auth.models import Group

    group_name = f"g-{uuid.uuid4().hex}"

    @locked(name, ttl=30, backend="default")
    def guarded():
        Group.objects.create(name=group_name)  # takes SQLite's write lock

    started = time.monotonic()
    with transaction.atomic():
        try:
            with transaction.atomic():
                guarded()
                raise KeyError("undo")
        except KeyError:
            pass
        assert held("default", name)
    assert time.monotonic() - started < 4, "a release waited for SQLite's write lock"
    assert not held("default", name)
    assert not Group.objects.filter(name=group_name).exists()


def test_sqlite_the_same_writer_twice_in_one_transaction(name):
    """The second call of the same @locked writer in one atomic() on SQLite runs
    under the lock still held, without a write that would wait for the caller's own
    transaction."""
    from django.contrib.auth.models import Group

    prefix = f"g-{uuid.uuid4().hex}"

    @locked(name, ttl=30, backend="default")
    def write(i):
        Group.objects.create(name=f"{prefix}-{i}")

    try:
        started = time.monotonic()
        with transaction.atomic():
            write(1)
            write(2)
        assert time.monotonic() - started < 4
        assert not held("default", name)
        assert Group.objects.filter(name__startswith=prefix).count() == 2
    finally:
        Group.objects.filter(name__startswith=prefix).delete()


def test_exclusive_task_twice_in_one_transaction(alias, name):
    from celery import Celery

    from django_setnx.contrib.celery import ExclusiveTask

    app = Celery("setnx_tx_twice", set_as_current=False)
    app.conf.update(
        task_always_eager=True, broker_url="memory://", result_backend="cache+memory://"
    )

    @app.task(
        base=ExclusiveTask,
        shared=False,
        name=f"tx.twice.{uuid.uuid4().hex}",
        lock_name=name,
        lock_backend=alias,
    )
    def job(n):
        return n

    with transaction.atomic():
        assert job(1) == 1 and job(2) == 2
        assert held(alias, name)
    assert not held(alias, name)


def test_with_blocks_opting_in_twice_in_one_transaction(alias, name):
    with transaction.atomic():
        with lock(name, ttl=30, backend=alias, release_on_commit=True, timeout=3) as first:
            pass
        with lock(name, ttl=30, backend=alias, release_on_commit=True, timeout=3) as second:
            assert second.fencing_token == first.fencing_token
        assert held(alias, name)
    assert not held(alias, name)


def test_exception_from_the_call_inside_a_committed_transaction(alias, name):
    """A guarded call that raises, caught by the caller who then commits: the lock is
    kept until that commit, like a call that returned."""

    @locked(name, ttl=30, backend=alias)
    def fails():
        raise ValueError("nope")

    with transaction.atomic():
        with pytest.raises(ValueError):
            fails()
        assert held(alias, name)
    assert not held(alias, name)


def test_several_databases_all_must_commit(alias, name):
    if "postgres" not in settings.DATABASES:
        pytest.skip("PostgreSQL is not among SETNX_TEST_BACKENDS")

    @locked(name, ttl=30, backend=alias, using=["default", "postgres"])
    def guarded():
        return 1

    with transaction.atomic(using="default"):
        with transaction.atomic(using="postgres"):
            guarded()
        assert held(alias, name), "postgres committed, default is still open"
    assert not held(alias, name)


def test_release_on_commit_false_releases_at_the_end_of_the_call(alias, name):
    @locked(name, ttl=30, backend=alias, release_on_commit=False)
    def guarded():
        return 1

    with transaction.atomic():
        guarded()
        assert not held(alias, name)


def test_context_manager_is_opt_in(alias, name):
    with transaction.atomic():
        with lock(name, ttl=30, backend=alias):
            pass
        assert not held(alias, name), "a plain with-block releases at its end"
        with lock(name, ttl=30, backend=alias, release_on_commit=True) as lk:
            pass
        assert held(alias, name) and lk.owned()
    assert not held(alias, name)


def test_explicit_release_is_always_immediate(alias, name):
    lk = lock(name, ttl=30, backend=alias, release_on_commit=True)
    with transaction.atomic():
        lk.acquire()
        lk.release()
        assert not held(alias, name)


def test_outside_a_transaction_nothing_is_deferred(alias, name):
    @locked(name, ttl=30, backend=alias)
    def guarded():
        return held(alias, name)

    assert guarded() is True
    assert not held(alias, name)


def test_unknown_using_alias_is_refused_at_decoration():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="'nowhere'"):
        locked("x", using="nowhere")


def test_a_lock_lost_before_commit_is_reported_not_raised_from_commit(alias, name, caplog):
    """The deferred release finds the lock gone (force-released meanwhile): COMMIT
    still succeeds, lock_lost is sent and a warning logged."""
    from django_setnx.signals import lock_lost

    lost = []
    lock_lost.connect(
        lambda lock, **kw: lost.append(lock.name), weak=False, dispatch_uid="test-tx-lost"
    )
    try:

        @locked(name, ttl=30, backend=alias)
        def guarded():
            return 1

        with transaction.atomic():
            guarded()
            locks[alias].delete(name)  # an operator force-released it
        assert lost == [name]
        assert "after the transaction's commit" in caplog.text
    finally:
        lock_lost.disconnect(dispatch_uid="test-tx-lost")


def test_a_lock_lost_during_the_call_rolls_the_transaction_back(alias, name):
    """Review r165: the guarded call's lock is lost while it runs (force-released
    here; its ttl running out is the same): its writes were not exclusive, so the
    call raises LockNotOwned as it does outside a transaction, and the transaction
    rolls back instead of committing them."""
    from django.contrib.auth.models import Group

    group = f"lost-{uuid.uuid4().hex}"

    @locked(name, ttl=30, backend=alias)
    def guarded():
        # An operator force-releases it mid-call (before the call writes: on SQLite
        # nobody else can write once the caller's transaction has).
        locks[alias].delete(name)
        Group.objects.create(name=group)

    with pytest.raises(LockNotOwned):
        with transaction.atomic():
            guarded()
    assert not Group.objects.filter(name=group).exists(), "committed without the lock"
    with transaction.atomic():  # and the name is free for the next caller
        assert lock(name, backend=alias, release_on_commit=True).acquire(blocking=False)


def test_a_lock_that_expired_during_the_call_rolls_the_transaction_back(name):
    """The same for a ttl that ran out while the call ran (review r165's case: a
    view that outlived its ttl committed, and answered 200)."""
    from django.contrib.auth.models import Group

    group = f"expired-{uuid.uuid4().hex}"

    @locked(name, ttl=0.2, backend="default")
    def slow():
        Group.objects.create(name=group)
        time.sleep(0.4)

    with pytest.raises(LockNotOwned):
        with transaction.atomic():
            slow()
    assert not Group.objects.filter(name=group).exists()


# -- views under ATOMIC_REQUESTS --------------------------------------------------

SEEN_AT_COMMIT = []


@locked("tx-view:{pk}", ttl=30)
def atomic_view(request, pk):
    from django.contrib.auth.models import Group

    Group.objects.create(name=f"tx-view-{pk}")
    lock_name = f"tx-view:{pk}"
    transaction.on_commit(lambda: SEEN_AT_COMMIT.append(held("default", lock_name)))
    return HttpResponse("ok")


urlpatterns = [path("atomic/<str:pk>/", atomic_view)]


@pytest.fixture
def atomic_requests():
    settings_dict = connections["default"].settings_dict
    before = settings_dict["ATOMIC_REQUESTS"]
    settings_dict["ATOMIC_REQUESTS"] = True
    yield
    settings_dict["ATOMIC_REQUESTS"] = before


@pytest.mark.urls("tests.test_transactions")
def test_view_under_atomic_requests_releases_after_commit(atomic_requests):
    from django.contrib.auth.models import Group

    pk = uuid.uuid4().hex
    SEEN_AT_COMMIT.clear()
    try:
        response = Client().get(f"/atomic/{pk}/")
        assert response.status_code == 200
        assert SEEN_AT_COMMIT == [True], "released before ATOMIC_REQUESTS committed"
        assert not held("default", f"tx-view:{pk}")
    finally:
        Group.objects.filter(name=f"tx-view-{pk}").delete()


@locked("tx-view-fail:{pk}", ttl=30)
def failing_view(request, pk):
    from django.contrib.auth.models import Group

    Group.objects.create(name=f"tx-view-fail-{pk}")
    raise RuntimeError("boom")


urlpatterns.append(path("fail/<str:pk>/", failing_view))


@pytest.mark.urls("tests.test_transactions")
def test_view_under_atomic_requests_rollback_releases(atomic_requests):
    """A view that raises under ATOMIC_REQUESTS: the request's transaction rolls back,
    and the lock is free at once."""
    from django.contrib.auth.models import Group

    pk = uuid.uuid4().hex
    response = Client(raise_request_exception=False).get(f"/fail/{pk}/")
    assert response.status_code == 500
    assert not held("default", f"tx-view-fail:{pk}")
    assert not Group.objects.filter(name=f"tx-view-fail-{pk}").exists(), "rolled back"


@locked("tx-view-lost:{pk}", ttl=30)
def losing_view(request, pk):
    from django.contrib.auth.models import Group

    locks["default"].delete(f"tx-view-lost:{pk}")  # lost while the view ran
    Group.objects.create(name=f"tx-view-lost-{pk}")
    return HttpResponse("ok")


urlpatterns.append(path("lost/<str:pk>/", losing_view))


@pytest.mark.urls("tests.test_transactions")
def test_view_under_atomic_requests_that_lost_its_lock_is_rolled_back(atomic_requests):
    """Review r165: a view whose lock was lost before it returned is an error, as
    without ATOMIC_REQUESTS, and the request's transaction rolls back."""
    from django.contrib.auth.models import Group

    pk = uuid.uuid4().hex
    response = Client(raise_request_exception=False).get(f"/lost/{pk}/")
    assert response.status_code == 500
    assert not Group.objects.filter(name=f"tx-view-lost-{pk}").exists(), "rolled back"


def _with_redis_alias(alias, redis_server):
    """SETNX_LOCKS plus ``alias``: a Redis backend on ``redis_server`` whose calls
    give up after a second when the server is down."""
    return {
        **settings.SETNX_LOCKS,
        alias: {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": redis_server.url,
            "KEY_PREFIX": "tx",
            "OPTIONS": {"CONNECTION_KWARGS": {"socket_timeout": 1, "socket_connect_timeout": 1}},
        },
    }


def test_backend_outage_in_deferred_release_does_not_break_commit(name, redis_server, caplog):
    """The backend is down when the transaction commits: COMMIT succeeds, the
    failure is logged, and the lock's ttl is the bound (nothing false is reported)."""
    from django.test import override_settings

    alias = "tx-redis"
    with override_settings(SETNX_LOCKS=_with_redis_alias(alias, redis_server)):

        @locked(name, ttl=30, backend=alias)
        def guarded():
            return 1

        from django_setnx.signals import lock_lost

        lost = []
        lock_lost.connect(
            lambda lock, **kw: lost.append(lock.name), weak=False, dispatch_uid="test-tx-outage"
        )
        try:
            with transaction.atomic():
                guarded()
                redis_server.stop()
        finally:
            lock_lost.disconnect(dispatch_uid="test-tx-outage")
        assert "Could not release lock" in caplog.text
        assert lost == [name], "whether it is still held is unknown: lost to its holder"
        with pytest.raises(LockBackendError):
            locks[alias].get(name)


def test_a_backend_down_at_the_end_of_the_call_rolls_back_and_stops_renewing(
    name, redis_server, caplog
):
    """Review r166: the backend does not answer when the guarded call ends inside a
    transaction: the call raises LockBackendError (whether the lock is still held is
    unknown), the transaction rolls back, and the release is still made after the
    rollback: an auto_renew lock's renewal stops (it was left renewing for ever)."""
    from django.contrib.auth.models import Group
    from django.test import override_settings

    alias = "tx-redis-check"
    group = f"down-{uuid.uuid4().hex}"
    with override_settings(SETNX_LOCKS=_with_redis_alias(alias, redis_server)):
        lk = lock(name, ttl=30, backend=alias, auto_renew=True, release_on_commit=True)
        try:
            with pytest.raises(LockBackendError):
                with transaction.atomic():
                    with lk:
                        Group.objects.create(name=group)
                        redis_server.stop()
        finally:
            redis_server.start()
        assert not Group.objects.filter(name=group).exists(), "rolled back"
        assert lk._renewer is None, "still renewing a lock whose transaction rolled back"
        assert "Could not release lock" in caplog.text  # tried after the rollback


def test_a_borrowing_call_that_outlived_the_lock_rolls_back(alias, name):
    """Review r166: a second guarded call of the same name in one transaction runs
    under the lock the first one left to COMMIT; if that lock is lost while the
    second runs, it raises LockNotOwned too, and lock_lost is sent once."""
    from django.contrib.auth.models import Group

    prefix = f"borrow-{uuid.uuid4().hex}"

    @locked(name, ttl=30, backend=alias)
    def step(label, lose=False, write=True):
        if lose:
            # Force-released while the second call runs (before anything in the
            # transaction writes: on SQLite nobody else could write after that).
            locks[alias].delete(name)
        if write:
            Group.objects.create(name=f"{prefix}-{label}")

    with lost_names() as lost:
        with pytest.raises(LockNotOwned):
            with transaction.atomic():
                step("first", write=False)
                step("second", lose=True)
    assert not Group.objects.filter(name__startswith=prefix).exists(), "rolled back"
    assert lost == [name]
    assert lock(name, backend=alias).acquire(blocking=False)


def test_a_borrowing_generator_consumed_after_the_commit_reports_no_loss(alias, name):
    """Review r167: a guarded generator started inside the transaction runs under the
    lock the transaction's first call left to COMMIT; consumed after the COMMIT
    released it, it ends without a LockNotOwned or a lock_lost for a lock that was
    released, not lost."""

    @locked(name, ttl=30, backend=alias)
    def step():
        return 1

    @locked(name, ttl=30, backend=alias)
    def numbers():
        yield 1
        yield 2

    with lost_names() as lost:
        with transaction.atomic():
            step()
            started = numbers()
            assert next(started) == 1
        assert not held(alias, name), "released at the COMMIT"
        assert list(started) == [2]
    assert lost == []


def test_no_ownership_check_where_even_reads_wait_for_the_transaction(name):
    """Review r166: on SQLite without WAL, with the lock table in the caller's
    database, a transaction that wrote much keeps every reader out, so the check at
    the end of the call would stall it for OPERATION_TIMEOUT, then fail it: it is
    not made there (the release waits for the commit, as before the check)."""
    from django.contrib.auth.models import Group
    from django.test import override_settings

    alias = "tx-sqlite-no-wal"
    config = {
        **settings.SETNX_LOCKS,
        alias: {
            "BACKEND": "django_setnx.backends.database.DatabaseBackend",
            "OPTIONS": {"DATABASE": "default", "SQLITE_WAL": False},
        },
    }
    with override_settings(SETNX_LOCKS=config):
        backend = locks[alias]
        assert backend.reads_wait_for_transaction("default")
        assert not locks["default"].reads_wait_for_transaction("default")  # WAL
        group = f"no-wal-{uuid.uuid4().hex}"
        lk = lock(name, ttl=30, backend=alias, release_on_commit=True)
        with transaction.atomic():
            with lk:
                Group.objects.create(name=group)
            assert lk._ownership_checkable(lk._pending_transactions()) is False
        assert Group.objects.filter(name=group).exists()
        assert not held(alias, name), "released after the commit"
        Group.objects.filter(name=group).delete()


# -- Celery: an ExclusiveTask run inside a transaction ------------------------------


@pytest.fixture(scope="module")
def eager_app():
    from celery import Celery

    app = Celery("setnx_tx_eager", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        broker_url="memory://",
        result_backend="cache+memory://",
    )
    app.finalize()
    return app


@pytest.mark.parametrize("how", ["delay", "direct call"])
def test_exclusive_task_inside_atomic_releases_after_commit(alias, name, eager_app, how):
    """An eager (or directly called) ExclusiveTask inside atomic(): its run lock is
    held until COMMIT; after a rollback it is free at once."""
    from django_setnx.contrib.celery import ExclusiveTask

    @eager_app.task(
        base=ExclusiveTask,
        shared=False,
        name=f"tx.{uuid.uuid4().hex}",
        lock_name=name + ":{n}",
        lock_backend=alias,
    )
    def job(n):
        return n

    def run(n):
        return job.delay(n).get() if how == "delay" else job(n)

    with transaction.atomic():
        assert run(1) == 1
        assert held(alias, f"{name}:1"), "released before the transaction committed"
    assert not held(alias, f"{name}:1")

    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            run(2)
            raise ZeroDivisionError
    assert not held(alias, f"{name}:2")


def test_a_semaphore_slot_is_released_after_commit(alias, name):
    """``@locked(limit=N)`` inside ``atomic()``: the slot is kept until COMMIT; a
    second call in the same transaction runs under it; a lock of the same name is
    another thing (never borrowed by the semaphore, nor the other way round)."""
    from django_setnx import semaphore

    @locked(name, ttl=30, backend=alias, limit=2)
    def guarded():
        return len(semaphore(name, 2, backend=alias).holders())

    @locked(name, ttl=30, backend=alias)
    def as_a_lock():
        return held(alias, name)

    with transaction.atomic():
        assert guarded() == 1
        assert guarded() == 1  # under the slot still held, not a second one
        assert as_a_lock() is True  # the lock "name" is another record
        assert len(semaphore(name, 2, backend=alias).holders()) == 1
    assert semaphore(name, 2, backend=alias).holders() == []
    assert not held(alias, name)
