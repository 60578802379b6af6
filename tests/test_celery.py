"""``django_setnx.contrib.celery``: run-exclusive and enqueue-once Celery tasks.

Two kinds of tests:

- eager-mode unit tests (``task_always_eager``) of name templates, policies and
  lock bookkeeping, on every backend of the contract suite;
- real ``celery worker`` processes (``tests/celery_app.py``, solo pool) with the
  suite's throwaway Redis as broker (db 1) and result backend (db 2), and the
  ``postgres`` database backend and ``redis`` as lock backends: two workers never
  overlap, duplicates are refused or dropped, failures and exhausted retries release,
  and a SIGKILLed worker's locks expire after their ttl (with and without
  ``acks_late``). Each worker consumes a queue of its own, so a test chooses which
  worker runs what; the workers reach this run's test databases through
  ``tests.workers.child_environment()``.
"""

import datetime
import importlib
import itertools
import json
import sys
import time
import uuid

import pytest
from celery import Celery
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from django_setnx import lock, locks, semaphore
from django_setnx.contrib.celery import (
    ONCE_NAME_HEADER,
    ONCE_ONLY_GRACE,
    ONCE_TOKEN_HEADER,
    AlreadyQueued,
    ExclusiveTask,
)
from django_setnx.exceptions import LockNotAcquired

# Task bodies release their run lock after COMMIT when run inside a transaction;
# these tests check the plain behaviour, outside any atomic block.
pytestmark = pytest.mark.autocommit

# ---------------------------------------------------------------------------
# Eager mode
# ---------------------------------------------------------------------------

eager_app = Celery("setnx_eager", set_as_current=False)
eager_app.conf.update(
    task_always_eager=True,
    task_eager_propagates=False,
    broker_url="memory://",
    result_backend="cache+memory://",
)
eager_app.finalize()


#: What a worker logs when a task finds one of its locks lost: the once lock's warning
#: (ExclusiveTask), LockNotOwned from release() or extend() of a lock no longer held,
#: or from any call on one marked lost, and the lock_lost warning (Lock).
LOST_LOCK_MESSAGES = ("expired and was taken over", "no longer held by this object", "was lost")


def eager_task(**options):
    """Define a one-off eager task (unique name) with ExclusiveTask as its base."""
    options.setdefault("base", ExclusiveTask)
    options.setdefault("shared", False)  # not also added to every other app
    options.setdefault("name", f"eager.{uuid.uuid4().hex}")
    return eager_app.task(**options)


def held(alias, name):
    info = locks[alias].get(name)
    return info is not None and info.is_held


def test_run_lock_name_is_filled_from_arguments(alias, name):
    seen = []

    @eager_task(bind=True, lock_name=name + ":{account_id}:{month}", lock_backend=alias)
    def report(self, account_id, month=1, **extra):
        info = lock(f"{name}:{account_id}:{month}", backend=alias).info()
        seen.append((self.request.id, info))
        return account_id

    assert report.delay(7, month=3).get() == 7
    assert report.apply_async((8,)).get() == 8
    assert report.apply(kwargs={"account_id": 9, "month": 12, "x": 1}).get() == 9
    assert [info.name for _, info in seen] == [f"{name}:7:3", f"{name}:8:1", f"{name}:9:12"]
    for task_id, info in seen:
        assert info.is_held
        assert info.owner["guards"] == f"celery task {report.name}[{task_id}]"
    for n in (f"{name}:7:3", f"{name}:8:1", f"{name}:9:12"):
        assert locks[alias].get(n) is None
    assert report.run_lock_name((5,), {"month": 6}) == f"{name}:5:6"


def test_callable_names_and_index_lookups(alias, name):
    @eager_task(
        lock_name=lambda account, **kw: f"{name}:{account['pk']}",
        lock_backend=alias,
        once_policy="raise",
        once_name=name + ":once:{account[pk]}",
    )
    def sync(account):
        return held(alias, f"{name}:42"), held(alias, f"{name}:once:42")

    assert tuple(sync.delay({"pk": 42}).get()) == (True, True)
    assert sync.once_lock_name(({"pk": 42},), {}) == f"{name}:once:42"


def test_bad_templates_and_options_fail_at_definition():
    with pytest.raises(ImproperlyConfigured, match="invoice_id"):

        @eager_task(lock_name="x:{invoice_id}")
        def charge(order_id):
            pass

    with pytest.raises(ImproperlyConfigured, match="positional"):

        @eager_task(once_policy="raise", once_name="x:{0}")
        def sync(shop_id):
            pass

    with pytest.raises(ImproperlyConfigured, match="on_contention"):

        @eager_task(lock_name="x", on_contention="wait")
        def a():
            pass

    with pytest.raises(ImproperlyConfigured, match="once_policy"):

        @eager_task(once_policy="skip")
        def b():
            pass

    with pytest.raises(ImproperlyConfigured, match="lock_ttl"):

        @eager_task(lock_name="x", lock_ttl=0)
        def c():
            pass

    # ``self`` of a bound task is not an argument of the call.
    with pytest.raises(ImproperlyConfigured, match="self"):

        @eager_task(bind=True, lock_name="x:{self}")
        def d(self, n):
            pass


def test_abstract_subclass_carries_options(alias, name):
    class AccountTask(ExclusiveTask):
        abstract = True
        lock_backend = alias
        on_contention = "skip"

    @eager_task(base=AccountTask, lock_name=name + ":{account_id}")
    def job(account_id):
        return "ran"

    with lock(f"{name}:1", backend=alias):
        assert job.delay(1).get() is None
    assert job.delay(1).get() == "ran"


@pytest.mark.parametrize("policy", ["skip", "raise", "retry"])
def test_contention_policies(alias, name, policy):
    attempts = []

    @eager_task(
        bind=True,
        lock_name=name,
        lock_backend=alias,
        on_contention=policy,
        lock_retry_countdown=0,
        lock_max_retries=2,
    )
    def job(self):
        attempts.append(self.request.retries)
        return "ran"

    with lock(name, ttl=30, backend=alias, guards="the test"):
        result = job.delay()
        assert attempts == []
        if policy == "skip":
            assert result.successful() and result.get() is None
        else:
            # retry: eager mode retries at once (countdown is not waited for) and
            # fails with LockNotAcquired once the retries are exhausted.
            assert result.failed()
            assert isinstance(result.result, LockNotAcquired)
            assert name in str(result.result)
            assert "is held by the test" in str(result.result)  # names the holder
            if policy == "retry":
                assert result.result.name == name
    assert not held(alias, name)
    assert job.delay().get() == "ran"


def test_lock_limit_runs_at_most_that_many(alias, name):
    """``lock_limit=N``: the run lock is a semaphore of N slots."""

    @eager_task(bind=True, lock_name=name, lock_backend=alias, lock_limit=2, lock_ttl=30)
    def job(self):
        holders = semaphore(name, 2, backend=alias).holders()
        return [info.owner.get("celery_task_id") for info in holders]

    result = job.delay()
    assert result.get() == [result.id]  # it held one slot of two
    first = semaphore(name, 2, ttl=30, backend=alias, guards="the test")
    assert first.acquire(blocking=False)
    assert job.delay().successful()  # one slot left
    second = semaphore(name, 2, ttl=30, backend=alias, guards="the test")
    assert second.acquire(blocking=False)
    result = job.delay()
    assert result.failed() and isinstance(result.result, LockNotAcquired)
    assert f"semaphore {name!r} has all 2 slots held by the test, the test" in str(result.result)
    first.release()
    second.release()
    assert semaphore(name, 2, backend=alias).holders() == []


def test_a_run_delivered_again_tries_again_when_the_cleanup_freed_its_lock(alias, name):
    """A run delivered again after its pool child died is refused while the dead run's
    lock is held. If the worker's cleanup frees that lock between the refusal and the
    run's look at the holder, the run tries again instead of reporting the lock held
    (a race seen in CI)."""
    from django_setnx.contrib.celery import _free_own_dead_run

    other = lock(name, ttl=30, backend=alias)
    other.owner_extra["celery_task_id"] = "another task"
    assert other.acquire()
    run = lock(name, ttl=30, backend=alias)
    assert _free_own_dead_run(run, "this task") is False  # a live run of another task
    assert other.owned()
    other.release()  # the cleanup, meanwhile
    assert _free_own_dead_run(run, "this task") is True

    slot = semaphore(name, 2, ttl=30, backend=alias)
    slot.owner_extra["celery_task_id"] = "another task"
    assert slot.acquire()
    run_slot = semaphore(name, 2, ttl=30, backend=alias)
    assert _free_own_dead_run(run_slot, "this task") is True  # a slot is free
    slot.release()


def test_a_run_delivered_again_tries_again_when_the_cleanup_frees_its_lock_as_it_looks(
    alias, name, monkeypatch
):
    """The worker's cleanup may also free the dead run's record between the new run's
    look and its own fencing-checked delete, which then finds nothing: the lock is
    free all the same, and the run tries again (a race seen in CI)."""
    import subprocess

    from django_setnx import dead_owners
    from django_setnx.contrib.celery import _free_own_dead_run

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that has exited, as the dead pool child's
    dead_run = lock(name, ttl=30, backend=alias)
    dead_run.owner_extra.update({"celery_task_id": "this task", "pid": child.pid})
    assert dead_run.acquire()
    real_free = dead_owners.free

    def freed_by_the_cleanup_first(alias_, info, reason):
        locks[alias_].delete(info.name)  # the pool watch's cleanup, a moment earlier
        return real_free(alias_, info, reason)

    monkeypatch.setattr(dead_owners, "free", freed_by_the_cleanup_first)
    run = lock(name, ttl=30, backend=alias)
    assert _free_own_dead_run(run, "this task") is True
    assert run.acquire()
    run.release()


def test_bad_lock_limits_and_timeouts_fail_at_definition_naming_task_and_attribute():
    cases = (
        ({"lock_limit": 0}, "lock_limit: Semaphore limit must be from 1 to 1000, got 0"),
        ({"lock_limit": "2"}, "lock_limit: Semaphore limit must be an int, not str"),
        ({"lock_timeout": -1}, "lock_timeout: timeout must be None or >= 0 seconds, got -1"),
        # Review r164: accepted, then a bare TypeError at the first contention; or the
        # lock silently off.
        ({"lock_max_retries": "3"}, "lock_max_retries must be None or an int >= 0, got '3'"),
        ({"lock_max_retries": -1}, "lock_max_retries must be None or an int >= 0, got -1"),
        ({"lock_retry_countdown": "1"}, "lock_retry_countdown must be None or a number"),
        ({"lock_name": ""}, "lock_name must be a non-empty name template, or None"),
        ({"once_name": "", "once_policy": "drop"}, "once_name must be a non-empty name"),
    )
    for options, message in cases:
        task_name = f"tasks.badly_set.{uuid.uuid4().hex}"
        with pytest.raises(ImproperlyConfigured, match=rf"^task {task_name}: {message}"):

            @eager_task(name=task_name, **{"lock_name": "x", **options})
            def badly_set():
                pass


def test_retry_on_contention_runs_once_free(alias, name):
    attempts = []
    holder = lock(name, ttl=30, backend=alias)

    @eager_task(
        bind=True,
        lock_name=name,
        lock_backend=alias,
        on_contention="retry",
        lock_retry_countdown=0,
        lock_max_retries=3,
    )
    def job(self):
        attempts.append(self.request.retries)
        return "ran"

    holder.acquire()

    def release_on_second_retry(sender=None, **kwargs):
        if holder.owned() and sender.request.retries >= 1:
            holder.release()

    from celery.signals import task_prerun

    task_prerun.connect(release_on_second_retry, weak=False)
    try:
        assert job.delay().get() == "ran"
    finally:
        task_prerun.disconnect(release_on_second_retry)
    assert attempts == [1]


def test_direct_call_runs_under_the_lock(alias, name):
    @eager_task(lock_name=name + ":{n}", lock_backend=alias, on_contention="retry")
    def double(n):
        info = locks[alias].get(f"{name}:{n}")
        assert info.is_held and "called directly" in info.owner["guards"]
        return n * 2

    assert double(21) == 42
    with lock(f"{name}:1", backend=alias), pytest.raises(LockNotAcquired):
        double(1)  # nothing to retry in a plain call


def test_lock_timeout_waits(alias, name):
    @eager_task(lock_name=name, lock_backend=alias, lock_timeout=5)
    def job():
        return "ran"

    holder = lock(name, ttl=0.3, backend=alias)
    holder.acquire()
    started = time.monotonic()
    assert job.delay().get() == "ran"  # the holder's lock expires while we wait
    assert time.monotonic() - started < 4


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_enqueue_once_refuses_duplicates(alias, name, policy):
    inner = {}

    @eager_task(
        bind=True,
        once_policy=policy,
        once_name=name + ":{shop_id}",
        lock_backend=alias,
        once_ttl=30,
    )
    def sync(self, shop_id, nested=True):
        info = locks[alias].get(f"{name}:{shop_id}")
        inner["info"] = info
        inner["id"] = self.request.id
        if nested:
            try:
                inner["nested"] = sync.delay(shop_id, nested=False)
            except AlreadyQueued as exc:
                inner["nested"] = exc
        return shop_id

    result = sync.apply_async((7,), task_id="my-task-id")
    assert result.get() == 7
    info = inner["info"]
    assert inner["id"] == "my-task-id"
    assert info.is_held and info.owner["celery_task_id"] == "my-task-id"
    assert info.owner["guards"] == f"celery task {sync.name}[my-task-id]"
    if policy == "raise":
        exc = inner["nested"]
        assert isinstance(exc, AlreadyQueued) and isinstance(exc, LockNotAcquired)
        assert exc.task_id == "my-task-id" and exc.name == f"{name}:7"
        assert sync.name in str(exc) and "my-task-id" in str(exc)
    else:
        assert inner["nested"] is None
    assert not held(alias, f"{name}:7")
    assert sync.delay(7, nested=False).get() == 7  # free again


def test_enqueue_once_default_names(alias, name):
    @eager_task(once_policy="raise", lock_backend=alias)
    def by_args(a, b=2):
        return a

    @eager_task(once_policy="raise", lock_backend=alias, lock_name=name + ":{a}")
    def by_lock_name(a):
        return a

    # Normalised by the signature: positional, keyword and default spell one call.
    assert by_args.once_lock_name((1,), {}) == by_args.once_lock_name((), {"a": 1, "b": 2})
    assert by_args.once_lock_name((1,), {}) != by_args.once_lock_name((2,), {})
    assert by_args.once_lock_name((1,), {}).startswith(f"celery-once:{by_args.name}:")
    assert by_lock_name.once_lock_name((5,), {}) == f"celery-once:{by_lock_name.name}:{name}:5"
    # The once lock and the run lock are different records.
    assert by_lock_name.delay(5).get() == 5


def test_failure_releases_both_locks(alias, name):
    @eager_task(lock_name=name, once_policy="raise", once_name=name + ":once", lock_backend=alias)
    def boom():
        assert held(alias, name) and held(alias, name + ":once")
        raise RuntimeError("boom")

    result = boom.delay()
    assert result.failed() and isinstance(result.result, RuntimeError)
    assert locks[alias].get(name) is None
    assert locks[alias].get(name + ":once") is None


def test_eager_failure_that_propagates_reports_no_lost_lock(alias, name):
    # task_eager_propagates=True (the usual test setup): the run releases its once
    # lock, then the exception reaches apply_async, which releases it again: that
    # second release is no lost lock (it once logged "taken over by another owner"
    # and sent lock_lost for every failing task).
    from django_setnx.signals import lock_lost

    eager_app.conf.task_eager_propagates = True
    lost = []

    def on_lost(sender, lock, **kwargs):
        lost.append(lock.name)

    lock_lost.connect(on_lost)
    try:

        @eager_task(once_policy="raise", once_name=name + ":once", lock_backend=alias)
        def boom():
            assert held(alias, name + ":once")
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            boom.delay()
    finally:
        eager_app.conf.task_eager_propagates = False
        lock_lost.disconnect(on_lost)
    assert lost == []
    assert locks[alias].get(name + ":once") is None


def test_a_naive_eta_is_read_in_the_celery_apps_timezone():
    # Django sets the process' local time to TIME_ZONE; Celery reads a naive eta in
    # app.timezone (UTC here). Read as local time, Tokyo's +9 h made the once lock
    # last once_ttl while the message was due in 150 s.
    from django.test import override_settings

    from django_setnx.contrib.celery import _delay_seconds

    due = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=150)
    naive_utc = due.replace(tzinfo=None)
    with override_settings(TIME_ZONE="Asia/Tokyo"):
        assert eager_app.timezone == datetime.timezone.utc or str(eager_app.timezone) == "UTC"
        assert 140 < _delay_seconds(None, naive_utc, eager_app.timezone) <= 150
        assert 140 < _delay_seconds(None, naive_utc.isoformat(), eager_app.timezone) <= 150
        assert 140 < _delay_seconds(None, due) <= 150


def test_retry_keeps_once_lock_until_exhausted(alias, name):
    seen = []

    @eager_task(
        bind=True,
        lock_name=name,
        once_policy="raise",
        once_name=name + ":once",
        lock_backend=alias,
        max_retries=2,
    )
    def flaky(self):
        once = locks[alias].get(name + ":once")
        seen.append((self.request.retries, once.is_held, once.fencing_token, held(alias, name)))
        raise self.retry(exc=RuntimeError("flaky"), countdown=0)

    result = flaky.delay()
    assert result.failed() and isinstance(result.result, RuntimeError)
    # One enqueue-once lock (same fencing token) across all three attempts.
    assert [s[0] for s in seen] == [0, 1, 2]
    assert all(s[1] and s[3] for s in seen)
    assert len({s[2] for s in seen}) == 1
    assert locks[alias].get(name + ":once") is None
    assert locks[alias].get(name) is None


def test_headers_carry_the_once_lock(alias, name):
    @eager_task(bind=True, once_policy="raise", once_name=name, lock_backend=alias)
    def job(self):
        headers = self.request.headers or {}
        return {k: headers.get(k) for k in (ONCE_TOKEN_HEADER, ONCE_NAME_HEADER)}

    headers = job.delay().get()
    assert headers[ONCE_NAME_HEADER] == name
    assert len(headers[ONCE_TOKEN_HEADER]) == 32
    # A forged token cannot release somebody else's lock.
    with lock(name, backend=alias) as lk:
        assert locks[alias].release(name, headers[ONCE_TOKEN_HEADER]) is False
        assert lk.owned()


def test_once_ttl_covers_countdown(alias, name):
    from celery.signals import task_prerun

    @eager_task(once_policy="raise", once_name=name, lock_backend=alias, once_ttl=1)
    def job():
        # Running, the worker keeps the lock at once_ttl (the delay is over).
        return locks[alias].get(name).expires_in

    at_enqueue = []

    def before_run(sender=None, **kwargs):
        if sender is job:
            at_enqueue.append(locks[alias].get(name).expires_in)

    task_prerun.connect(before_run, weak=False)
    try:
        assert job.apply_async(countdown=30).get() <= 1  # eager: runs at once
        eta = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=30)
        assert job.apply_async(eta=eta).get() <= 1
    finally:
        task_prerun.disconnect(before_run)
    # Taken at enqueue for once_ttl plus the countdown/eta delay.
    assert len(at_enqueue) == 2 and all(29 < t <= 31 for t in at_enqueue)


def test_a_first_enqueue_due_past_max_ttl_is_sent(alias, name):
    """Review r164: the first enqueue of a message due further ahead than the
    backend's MAX_TTL raised ValueError (the lock's ttl is once_ttl + the delay), as
    a retry no longer did: its once lock is taken for MAX_TTL instead."""
    max_ttl = locks[alias].max_ttl
    at_enqueue = []

    @eager_task(once_policy="raise", once_name=name, lock_backend=alias, once_ttl=60)
    def job():
        return "ran"

    from celery.signals import task_prerun

    def before_run(sender=None, **kwargs):
        if sender is job:
            at_enqueue.append(locks[alias].get(name).expires_in)

    task_prerun.connect(before_run, weak=False)
    try:
        assert job.apply_async(countdown=max_ttl + 3600).get() == "ran"
    finally:
        task_prerun.disconnect(before_run)
    assert len(at_enqueue) == 1 and max_ttl - 60 < at_enqueue[0] <= max_ttl


def test_a_message_sent_again_is_sent_whatever_its_countdown(alias, name):
    # A message that carries its once lock (a retry, Celery's retry_on_worker_lost)
    # has that lock extended to cover its countdown, but never past the backend's
    # MAX_TTL: a countdown that would need more is still sent (ValueError escaped
    # apply_async before, and the message was never sent again).
    max_ttl = locks[alias].max_ttl

    @eager_task(once_policy="raise", once_name=name, lock_backend=alias, once_ttl=max_ttl)
    def job():
        return "ran"

    carried = lock(name, ttl=10, backend=alias)
    assert carried.acquire()
    headers = {ONCE_TOKEN_HEADER: carried._token, ONCE_NAME_HEADER: name}
    assert job.apply_async(headers=headers, retries=1, countdown=180).get() == "ran"
    assert locks[alias].get(name) is None  # the run adopted it and released it


def test_app_wide_task_class(alias, name):
    app = Celery(
        "setnx_cls", set_as_current=False, task_cls="django_setnx.contrib.celery:ExclusiveTask"
    )
    app.conf.update(
        task_always_eager=True, broker_url="memory://", result_backend="cache+memory://"
    )
    app.finalize()

    @app.task(shared=False)
    def plain():
        return 1

    @app.task(shared=False, lock_name=name, lock_backend=alias, on_contention="skip")
    def exclusive():
        return 2

    assert isinstance(plain, ExclusiveTask) and isinstance(exclusive, ExclusiveTask)
    with lock(name, backend=alias):
        assert plain.delay().get() == 1  # no options: a plain task
        assert exclusive.delay().get() is None
    assert exclusive.delay().get() == 2


def test_django_task_class_is_kept(alias, name):
    """``base=ExclusiveTask`` and the app-wide task class keep Celery's DjangoTask:
    ``delay_on_commit`` sends only after COMMIT (and, with enqueue-once, takes the once
    lock then)."""
    from celery.contrib.django.task import DjangoTask
    from django.db import transaction

    ran = []

    @eager_task(once_policy="drop", once_name=name + ":{n}", lock_backend=alias)
    def job(n):
        ran.append(n)

    assert isinstance(job, DjangoTask)
    with transaction.atomic():
        assert job.delay_on_commit(1) is None
        assert ran == [] and locks[alias].get(f"{name}:1") is None
    assert ran == [1]

    app = Celery(
        "setnx_cls_django",
        set_as_current=False,
        task_cls="django_setnx.contrib.celery:ExclusiveTask",
    )
    app.conf.update(
        task_always_eager=True, broker_url="memory://", result_backend="cache+memory://"
    )

    @app.task(shared=False)
    def plain(n):
        ran.append(n)

    with transaction.atomic():
        plain.delay_on_commit(2)
        assert ran == [1]
    assert ran == [1, 2]


def test_a_duplicate_found_at_commit_is_dropped_and_the_other_hooks_run(alias, name, caplog):
    """``delay_on_commit`` with ``once_policy="raise"``: at COMMIT there is nobody to
    raise AlreadyQueued to, and raising would cancel the transaction's later
    on_commit callbacks after the data was committed. It is logged instead."""
    import logging

    from django.db import transaction

    ran, hooks = [], []

    @eager_task(once_policy="raise", once_name=name, lock_backend=alias)
    def job():
        ran.append(1)

    with lock(name, ttl=30, backend=alias):  # a copy queued or running
        with caplog.at_level(logging.WARNING, logger="django_setnx.celery"):
            with transaction.atomic():
                assert job.delay_on_commit() is None
                transaction.on_commit(lambda: hooks.append("later"))
    assert ran == [] and hooks == ["later"]
    assert "not enqueued at commit" in caplog.text
    with transaction.atomic():
        job.apply_async_on_commit()
    assert ran == [1], "sent at commit once the lock is free"


def test_mixin_on_a_task_class_of_ones_own(alias, name):
    from celery import Task

    from django_setnx.contrib.celery import ExclusiveTaskMixin

    class AuditedTask(Task):
        audited = []

        def before_start(self, task_id, args, kwargs):
            self.audited.append(task_id)

    class ExclusiveAuditedTask(ExclusiveTaskMixin, AuditedTask):
        pass

    @eager_task(base=ExclusiveAuditedTask, once_policy="raise", once_name=name, lock_backend=alias)
    def job():
        return "ran"

    held_by_test = lock(name, ttl=30, backend=alias)
    assert held_by_test.acquire(blocking=False)
    with pytest.raises(AlreadyQueued):
        job.delay()
    held_by_test.release()
    result = job.delay()
    assert result.get() == "ran" and AuditedTask.audited == [result.id]


def test_long_derived_once_names_are_bounded(alias, name):
    """A run lock name under the 200-character limit gives a derived once name over it
    ("celery-once:<task>:" comes first): it is shortened with a digest, never refused."""
    long_key = "k" * 180

    @eager_task(lock_name=name[:5] + ":{key}", once_policy="raise", lock_backend=alias)
    def job(key):
        return len(key)

    once_name = job.once_lock_name((long_key,), {})
    assert len(once_name) <= 200 and once_name.startswith("celery-once:")
    assert once_name != job.once_lock_name(("k" * 179 + "j",), {})
    assert job.delay(long_key).get() == 180


def test_once_policy_given_per_call_is_held_and_released_by_the_run(alias, name):
    """A task without a once_policy of its own, enqueued with one (as a beat entry's
    options do): the run adopts and releases the lock the message carries."""

    @eager_task(once_name=name + ":{n}", lock_backend=alias)
    def job(n):
        return locks[alias].get(f"{name}:{n}")

    info = job.apply_async((1,), once_policy="raise").get()
    assert info is not None and info.is_held, "the run held the once lock"
    assert locks[alias].get(f"{name}:1") is None, "and released it"
    assert job.apply_async((1,), once_policy="drop").get() is not None


def test_a_revoked_message_releases_its_once_lock_with_signals(alias, name):
    """What the revoke paths do for a message that never ran: a token-checked release
    that sends lock_released like any other."""
    from django_setnx.contrib.celery import _release_once_of
    from django_setnx.signals import lock_released

    @eager_task(once_policy="raise", once_name=name, lock_backend=alias)
    def job():
        return 1

    holder = lock(name, ttl=30, backend=alias)
    assert holder.acquire(blocking=False)

    class Message:
        headers = {ONCE_TOKEN_HEADER: holder._token, ONCE_NAME_HEADER: name}

    released = []
    lock_released.connect(
        lambda lock, **kw: released.append(lock.name),
        weak=False,
        dispatch_uid="test-revoke-signal",
    )
    try:
        assert _release_once_of(job, Message()) is True
    finally:
        lock_released.disconnect(dispatch_uid="test-revoke-signal")
    assert released == [name] and locks[alias].get(name) is None
    Message.headers = {ONCE_TOKEN_HEADER: "not-the-token", ONCE_NAME_HEADER: name}
    other = lock(name, ttl=30, backend=alias)
    assert other.acquire(blocking=False)
    assert _release_once_of(job, Message()) is False
    assert other.owned(), "a lock that changed hands is left alone"


def test_argument_digest_with_mixed_key_types(alias, name):
    @eager_task(once_policy="raise", lock_backend=alias)
    def job(mapping, items=()):
        return 1

    first = job.once_lock_name(({1: "a", "b": 2, (3, 4): None},), {})
    same = job.once_lock_name(({"b": 2, (3, 4): None, 1: "a"},), {})
    other = job.once_lock_name(({1: "a", "b": 3, (3, 4): None},), {})
    assert first == same != other
    assert job.once_lock_name(({1: "a"},), {"items": {2, "x"}}) == job.once_lock_name(
        ({1: "a"},), {"items": {"x", 2}}
    )
    assert job.delay({1: "a", "b": 2}).get() == 1


def test_enqueue_once_locks_send_signals(alias, name):
    from django_setnx.signals import lock_acquired, lock_released

    events = []
    lock_acquired.connect(
        lambda lock, **kw: events.append(("acquired", lock.name)),
        weak=False,
        dispatch_uid="test-once-signals-a",
    )
    lock_released.connect(
        lambda lock, **kw: events.append(("released", lock.name)),
        weak=False,
        dispatch_uid="test-once-signals-r",
    )
    try:

        @eager_task(once_policy="raise", once_name=name, lock_backend=alias)
        def job():
            return 1

        assert job.delay().get() == 1
    finally:
        lock_acquired.disconnect(dispatch_uid="test-once-signals-a")
        lock_released.disconnect(dispatch_uid="test-once-signals-r")
    # Taken at enqueue, adopted by the run, released after it.
    assert events == [("acquired", name), ("acquired", name), ("released", name)]


def test_missing_celery_is_improperly_configured(monkeypatch):
    monkeypatch.setitem(sys.modules, "celery", None)
    monkeypatch.delitem(sys.modules, "django_setnx.contrib.celery")
    with pytest.raises(ImproperlyConfigured, match=r"pip install django-setnx\[celery\]"):
        importlib.import_module("django_setnx.contrib.celery")


# ---------------------------------------------------------------------------
# Real workers
# ---------------------------------------------------------------------------

WORKER_ALIASES = [a for a in ("postgres", "redis") if a in settings.CONTRACT_ALIASES]


def pytest_generate_tests(metafunc):
    if "worker_alias" in metafunc.fixturenames:
        if "redis" in settings.CONTRACT_ALIASES:
            metafunc.parametrize("worker_alias", WORKER_ALIASES)
        else:
            metafunc.parametrize(
                "worker_alias",
                [
                    pytest.param(
                        None,
                        marks=pytest.mark.skip(
                            reason="the Celery worker tests use the suite's Redis as broker, and "
                            "'redis' is not in settings.CONTRACT_ALIASES "
                            "(SETNX_TEST_BACKENDS)"
                        ),
                    )
                ],
            )


@pytest.fixture(scope="module")
def worker_env(django_db_setup, tmp_path_factory):
    """What a worker needs: this run's test databases and Redis, and a log directory."""
    from tests.workers import child_environment

    return child_environment(), tmp_path_factory.mktemp("celery-workers")


@pytest.fixture(scope="module")
def worker_pair(worker_env):
    """Two ``celery worker`` processes (w1, w2), for the whole module."""
    from tests import celery_app
    from tests.celery_support.worker import CeleryWorker

    env, log_dir = worker_env
    run_id = uuid.uuid4().hex[:8]
    pair = [CeleryWorker(label, env, log_dir, run_id) for label in ("w1", "w2")]
    try:
        for worker in pair:
            worker.start()
        for worker in pair:
            worker.wait_ready(celery_app.app)
        yield pair
    finally:
        for worker in pair:
            worker.stop()


@pytest.fixture
def workers(worker_pair, worker_alias):
    """The running worker pair (started again if an earlier test killed one)."""
    from tests import celery_app

    restarted = [w.start() for w in worker_pair if not w.alive]
    for worker in restarted:
        worker.wait_ready(celery_app.app)
    return worker_pair


@pytest.fixture
def victim_worker(worker_env, workers):
    """A third worker of its own, for a test that SIGKILLs it (stopped afterwards)."""
    from tests import celery_app
    from tests.celery_support.worker import CeleryWorker

    env, log_dir = worker_env
    worker = CeleryWorker("victim", env, log_dir).start()
    try:
        worker.wait_ready(celery_app.app)
        yield worker
    finally:
        worker.stop()


def celery_task(kind, alias):
    from tests import celery_app

    return celery_app.task(kind, alias)


def read_log(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def runs(path):
    """(start, end, record) of every finished run in the log, by start time."""
    starts, out = {}, []
    for rec in read_log(path):
        key = (rec["task_id"], rec["retries"], rec["pid"])
        if rec["event"] == "start":
            starts[key] = rec
        elif key in starts:
            out.append((starts.pop(key)["t"], rec["t"], rec))
    return sorted(out, key=lambda r: r[0])


def assert_no_overlap(path):
    intervals = runs(path)
    for (_, e1, r1), (s2, _, r2) in itertools.pairwise(intervals):
        assert s2 >= e1, f"runs overlap: {r1} ended at {e1}, {r2} started at {s2}"
    return intervals


def wait_until(predicate, timeout, what, workers=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    logs = "\n".join(f"--- {w.label} ---\n{w.log_tail(2500)}" for w in workers)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


def get(result, workers, timeout=30):
    """Wait for ``result`` (no raise) and return it, with the workers' logs on timeout."""
    wait_until(result.ready, timeout, f"the result of {result.id}", workers)
    return result.get(propagate=False, timeout=5)


def started(path, tag):
    return any(r["event"] == "start" and r["tag"] == tag for r in read_log(path))


@pytest.mark.parametrize("policy", ["skip", "raise", "retry"])
def test_two_workers_never_overlap(workers, worker_alias, tmp_path, policy):
    w1, w2 = workers
    job = celery_task(f"exclusive_{policy}", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    # The same lock name, one message per worker, at once: they race for the lock.
    results = [
        job.apply_async((key, log, tag, 1.0), queue=w.queue) for tag, w in (("a", w1), ("b", w2))
    ]
    values = [get(r, workers) for r in results]
    intervals = assert_no_overlap(log)
    states = sorted(r.state for r in results)
    if policy == "skip":
        assert states == ["SUCCESS", "SUCCESS"]
        assert sorted(values, key=str) == sorted([None, runs(log)[0][2]["tag"]], key=str)
        assert len(intervals) == 1
    elif policy == "raise":
        assert states == ["FAILURE", "SUCCESS"]
        failed = next(r for r in results if r.failed())
        assert isinstance(failed.result, LockNotAcquired)
        assert f"celery-test:{key}" in str(failed.result)
        assert len(intervals) == 1
    else:
        assert states == ["SUCCESS", "SUCCESS"] and sorted(values) == ["a", "b"]
        assert len(intervals) == 2
        assert max(rec["retries"] for _, _, rec in intervals) >= 1  # one was retried
        assert {rec["pid"] for _, _, rec in intervals} == {w1.pid, w2.pid}
    assert locks[worker_alias].get(f"celery-test:{key}") is None


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_duplicate_enqueue_refused_or_dropped(workers, worker_alias, tmp_path, policy):
    w1, w2 = workers
    job = celery_task(f"once_{policy}", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    name = f"celery-once-test:{key}"
    first = job.apply_async((key, log, "first", 0.5), queue=w1.queue)
    info = locks[worker_alias].get(name)
    assert info.is_held and info.owner["guards"] == f"celery task {job.name}[{first.id}]"
    # Refused while queued or running, whichever worker it would go to.
    for _ in range(2):
        if policy == "raise":
            with pytest.raises(AlreadyQueued) as caught:
                job.apply_async((key, log, "dup", 0), queue=w2.queue)
            assert caught.value.task_id == first.id
        else:
            assert job.apply_async((key, log, "dup", 0), queue=w2.queue) is None
            assert job.delay(key, log, "dup", 0) is None
        wait_until(lambda: started(log, "first"), 20, "the first run", workers)
    assert get(first, workers) == "first"
    # The worker released it (token-checked, from the headers) before storing the result.
    assert locks[worker_alias].get(name) is None
    again = job.apply_async((key, log, "again", 0), queue=w2.queue)
    assert get(again, workers) == "again"
    assert [r[2]["tag"] for r in runs(log)] == ["first", "again"]


def test_once_with_countdown_and_eta(workers, worker_alias, tmp_path):
    w1, w2 = workers
    job = celery_task("once_raise", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    name = f"celery-once-test:{key}"
    for use_eta in (False, True):
        sent = time.time()
        if use_eta:
            eta = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=1)
            options = {"eta": eta}
        else:
            options = {"countdown": 1}
        result = job.apply_async((key, log, "later", 0), queue=w1.queue, **options)
        assert locks[worker_alias].get(name).expires_in > 30  # once_ttl + the delay
        with pytest.raises(AlreadyQueued):
            job.apply_async((key, log, "dup", 0), queue=w2.queue)
        assert get(result, workers) == "later"
        assert runs(log)[-1][0] >= sent + 0.9
        assert locks[worker_alias].get(name) is None


def test_failing_task_releases_both_locks(workers, worker_alias, tmp_path):
    w1, _ = workers
    job = celery_task("both_failing", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    result = job.apply_async((key, log, "boom", 0.5), queue=w1.queue)
    once_name = job.once_lock_name((key, log, "boom", 0.5), {})
    wait_until(lambda: started(log, "boom"), 20, "the run", workers)
    assert held(worker_alias, f"celery-test:{key}") and held(worker_alias, once_name)
    with pytest.raises(AlreadyQueued):
        job.delay(key, log, "boom", 0.5)
    get(result, workers)
    assert result.failed() and "failed on purpose" in str(result.result)
    assert locks[worker_alias].get(f"celery-test:{key}") is None
    assert locks[worker_alias].get(once_name) is None


def test_retry_exhaustion_releases(workers, worker_alias, tmp_path):
    w1, w2 = workers
    job = celery_task("flaky", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    once_name = f"celery-once-test:{key}"
    result = job.apply_async((key, log, "flaky", 0.2, 0.6), queue=w1.queue)
    first_token = locks[worker_alias].get(once_name).fencing_token

    def first_attempt_over():
        return any(r["event"] == "end" for r in read_log(log))

    wait_until(first_attempt_over, 20, "the first attempt", workers)
    # Between attempts (the retry is waiting its countdown) the task is still queued.
    with pytest.raises(AlreadyQueued) as caught:
        job.apply_async((key, log, "dup", 0, 0), queue=w2.queue)
    assert caught.value.task_id == result.id
    get(result, workers)
    assert result.failed() and "flaky attempt 2" in str(result.result)
    attempts = assert_no_overlap(log)
    assert [rec["retries"] for _, _, rec in attempts] == [0, 1, 2]
    assert {rec["task_id"] for _, _, rec in attempts} == {result.id}
    assert locks[worker_alias].get(once_name) is None
    assert locks[worker_alias].get(f"celery-test:{key}") is None
    # A new enqueue gets a new lock.
    again = job.apply_async((key, log, "again", 0, 0), queue=w2.queue, countdown=0)
    assert locks[worker_alias].get(once_name).fencing_token > first_token
    get(again, workers)


def test_expired_message_releases_once_lock(workers, worker_alias, tmp_path):
    w1, _ = workers
    blocker = celery_task("exclusive_skip", worker_alias)
    job = celery_task("once_raise", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    once_name = f"celery-once-test:{key}"
    busy = blocker.apply_async((uuid.uuid4().hex, log, "blocker", 1.0), queue=w1.queue)
    # Queued behind the blocker, it expires before w1 gets to it: the worker revokes
    # it (task_revoked) without running it, and that releases its once lock.
    expired = job.apply_async((key, log, "expired", 0), queue=w1.queue, expires=0.3)
    assert held(worker_alias, once_name)
    get(busy, workers)
    get(expired, workers)
    assert expired.state == "REVOKED"
    assert not started(log, "expired")
    # Celery stores REVOKED, then sends task_revoked, whose handler releases the
    # lock: the result can be seen a moment before the release (seen in CI).
    wait_until(
        lambda: locks[worker_alias].get(once_name) is None,
        5,
        "the expired message's once lock to be released",
        workers,
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["crash", "crash_late"])
def test_sigkill_mid_task_locks_expire_after_ttl(
    workers, victim_worker, worker_alias, tmp_path, kind
):
    from tests.celery_app import CRASH_TTL

    _, w2 = workers
    job = celery_task(kind, worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    run_name, once_name = f"celery-test:{key}", f"celery-once-test:{key}"
    backend = locks[worker_alias]
    victim = job.apply_async((key, log, "victim", 60), queue=victim_worker.queue)
    wait_until(lambda: started(log, "victim"), 20, "the victim's run", [victim_worker])
    run_info = backend.get(run_name)
    assert run_info.owner["guards"] == f"celery task {job.name}[{victim.id}]"
    assert run_info.owner["pid"] == victim_worker.pid
    # Renewed while the worker lives: still held well past the ttl.
    time.sleep(CRASH_TTL + 0.5)
    assert held(worker_alias, run_name) and held(worker_alias, once_name)
    with pytest.raises(AlreadyQueued):
        job.apply_async((key, log, "dup", 0), queue=w2.queue)

    victim_worker.kill()
    killed = time.monotonic()
    assert held(worker_alias, run_name)  # nobody released it
    wait_until(
        lambda: not held(worker_alias, run_name) and not held(worker_alias, once_name),
        CRASH_TTL + 2,
        "the dead worker's locks to expire",
        workers,
    )
    assert time.monotonic() - killed <= CRASH_TTL + 0.5

    if kind == "crash":
        # The lock is free, so a new task runs at once, on another worker.
        successor = job.apply_async((key, log, "successor", 0.1), queue=w2.queue)
        assert get(successor, workers) == "successor"
        assert [r[2]["tag"] for r in runs(log)] == ["successor"]
        assert backend.get(once_name) is None
    else:
        # acks_late: the message comes back (visibility_timeout 4 s) to the victim's
        # queue; a worker started on it runs it again. The redelivered run takes the
        # expired run lock, re-adopts its own enqueue-once lock (the same token, from
        # the headers: a record that expired but was not taken over) and releases both.
        victim_worker.start().wait_ready(job.app)
        wait_until(
            lambda: any(r[2]["task_id"] == victim.id for r in runs(log)),
            30,
            "the redelivered run",
            [victim_worker],
        )
        assert get(victim, workers) == "victim"
        ((_, _, rec),) = runs(log)
        assert rec["pid"] == victim_worker.pid and rec["task_id"] == victim.id
        tail = victim_worker.log_tail(20000)
        assert not any(lost in tail for lost in LOST_LOCK_MESSAGES), tail
    assert backend.get(run_name) is None
    assert backend.get(once_name) is None
    assert lock(run_name, backend=worker_alias).acquire(blocking=False)


# -- dead owners: a lost pool child's locks come back at once --------------------------------


@pytest.fixture
def prefork_worker(worker_env, workers):
    """A prefork worker (one pool child), for the tests that kill its child."""
    from tests import celery_app
    from tests.celery_support.worker import CeleryWorker

    env, log_dir = worker_env
    worker = CeleryWorker("prefork", env, log_dir, pool="prefork").start()
    try:
        worker.wait_ready(celery_app.app)
        yield worker
    finally:
        worker.stop()


def start_hang(alias, worker, tmp_path, **options):
    """Send the ``hang`` task (both locks, ttl 60 s) to ``worker``; return what the
    test needs once its run has started: the task's result, the lock names, the run
    lock's LockInfo (its owner is the pool child) and the log path."""
    job = celery_task("hang", alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    result = job.apply_async((key, log, "hang", 60), queue=worker.queue, **options)
    wait_until(lambda: started(log, "hang"), 30, "the hanging run", [worker])
    run_name, once_name = f"celery-test:{key}", f"celery-once-test:{key}"
    run = locks[alias].get(run_name)
    assert run.owner["celery_task_id"] == result.id and run.owner["pid"] != worker.pid
    assert run.expires_in > 50 and held(alias, once_name)
    return job, key, log, run_name, once_name, run


def wait_for_exit(pid, workers):
    from django_setnx.dead_owners import has_exited

    wait_until(lambda: has_exited(pid), 30, f"pool child {pid} to exit", workers)
    return time.monotonic()


@pytest.mark.parametrize("death", ["time_limit", "sigkill", "revoke"])
def test_a_lost_pool_child_frees_its_locks_at_once(
    workers, prefork_worker, worker_alias, tmp_path, death
):
    """A run killed for its hard time limit, SIGKILLed (the OOM killer, kill -9) or
    revoked with terminate=True: the worker's main process frees its run lock and its
    enqueue-once lock within 2 s of the death, not after their 60 s ttl, and the next
    run starts at once."""
    import os
    import signal

    options = {"time_limit": 2} if death == "time_limit" else {}
    job, key, log, run_name, once_name, run = start_hang(
        worker_alias, prefork_worker, tmp_path, **options
    )
    if death == "sigkill":
        os.kill(run.owner["pid"], signal.SIGKILL)
    elif death == "revoke":
        job.app.control.revoke(run.owner["celery_task_id"], terminate=True, signal="SIGKILL")
    dead = wait_for_exit(run.owner["pid"], [prefork_worker])
    wait_until(
        lambda: not held(worker_alias, run_name) and not held(worker_alias, once_name),
        5,
        "the dead run's locks to be freed",
        [prefork_worker],
    )
    assert time.monotonic() - dead <= 2.0
    assert prefork_worker.alive
    if death != "time_limit":
        # (Past its time limit the child is sent SIGTERM first: the run then unwinds
        # and releases its own locks, unless it is stuck; then SIGKILL, and this.)
        # (The record goes first, then the line is logged: wait for it.)
        wait_until(
            lambda: "Freed lock" in prefork_worker.log_tail(20000),
            5,
            "the log line of the freed lock",
            [prefork_worker],
        )
    _, w2 = workers
    successor = job.apply_async((key, log, "successor", 0.1), queue=w2.queue)
    assert get(successor, workers) == "successor"
    # The pool child forked to replace the dead one works: the cleanup ran in no
    # thread of the main process (a fork copies a lock such a thread holds, SQLite's
    # mutex or a connection pool's, locked for good into the new child).
    probes = [
        job.apply_async((f"{key}:probe{i}", log, f"probe{i}", 0.05), queue=prefork_worker.queue)
        for i in range(3)
    ]
    assert [get(probe, [prefork_worker]) for probe in probes] == ["probe0", "probe1", "probe2"]


def test_a_lock_that_changed_hands_is_never_freed_for_a_dead_run(
    workers, prefork_worker, worker_alias, tmp_path
):
    """Between the run's start and its child's death, both of its locks pass to other
    holders: the dead-owner cleanup leaves them alone (fencing-checked, and only
    records naming the dead run's task id)."""
    import os
    import signal

    _job, _key, _log, run_name, once_name, run = start_hang(worker_alias, prefork_worker, tmp_path)
    backend = locks[worker_alias]
    successors = []
    for name in (run_name, once_name):
        assert backend.delete(name) is not None
        successor = lock(name, ttl=60, backend=worker_alias)
        assert successor.acquire(blocking=False)
        successors.append(successor)
    tokens = [backend.get(name).fencing_token for name in (run_name, once_name)]
    os.kill(run.owner["pid"], signal.SIGKILL)
    wait_for_exit(run.owner["pid"], [prefork_worker])
    time.sleep(3)  # well past the moment the cleanup would have run
    assert [backend.get(name).fencing_token for name in (run_name, once_name)] == tokens
    for successor in successors:
        assert successor.owned()
        successor.release()
    assert "Freed lock" not in prefork_worker.log_tail(20000)


def test_a_requeued_run_runs_again_and_keeps_its_once_lock(
    workers, prefork_worker, worker_alias, tmp_path
):
    """``acks_late`` + ``reject_on_worker_lost``: Celery puts the message of a
    SIGKILLed child back at once. The run delivered again gets its run lock (the dead
    run's is freed, by the pool watch or by the new run itself) and succeeds; its
    enqueue-once lock stays held meanwhile, so a duplicate is refused."""
    import os
    import signal

    job = celery_task("hang_requeue", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    once_name = f"celery-once-test:{key}"
    original = job.apply_async((key, log, "first", 60), queue=prefork_worker.queue)
    wait_until(lambda: started(log, "first"), 30, "the run", [prefork_worker])
    run = locks[worker_alias].get(f"celery-test:{key}")
    assert run.owner["celery_requeued_if_lost"] is True
    os.kill(run.owner["pid"], signal.SIGKILL)
    wait_for_exit(run.owner["pid"], [prefork_worker])
    assert held(worker_alias, once_name), "the requeued message's once lock was freed"
    with pytest.raises(AlreadyQueued):
        job.apply_async((key, log, "duplicate", 0.1), queue=workers[1].queue)
    assert get(original, [prefork_worker], timeout=60) == "again"
    assert original.state == "SUCCESS"
    assert not held(worker_alias, once_name)


@pytest.mark.parametrize("kind", ["hang_timeout_requeue", "hang_retry_lost"])
def test_a_run_celery_sends_again_keeps_its_once_lock(
    workers, prefork_worker, worker_alias, tmp_path, kind
):
    """Two more ways Celery sends a dead run's message again: ``acks_late`` without
    ``acks_on_failure_or_timeout`` puts back a run killed for its hard time limit (and
    still sends ``task_failure``), ``retry_on_worker_lost`` sends a lost run again
    (Celery >= 5.7). Meanwhile the enqueue-once lock stays held (a duplicate is
    refused), and the run sent again adopts it and succeeds."""
    import os
    import signal

    job = celery_task(kind, worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    once_name = f"celery-once-test:{key}"
    options = {"time_limit": 2} if kind == "hang_timeout_requeue" else {}
    job.apply_async((key, log, "first", 60), queue=prefork_worker.queue, **options)
    wait_until(lambda: started(log, "first"), 30, "the run", [prefork_worker])
    run = locks[worker_alias].get(f"celery-test:{key}")
    flag = "celery_requeued_on_timeout" if options else "celery_requeued_if_lost"
    assert run.owner[flag] is True
    if not options:
        os.kill(run.owner["pid"], signal.SIGKILL)
    wait_for_exit(run.owner["pid"], [prefork_worker])
    with pytest.raises(AlreadyQueued):
        job.apply_async((key, log, "duplicate", 0.1), queue=workers[1].queue)
    # (After a time limit Celery stores the failure before it puts the message back:
    # the result is ready before the run sent again; the log tells.)
    wait_until(
        lambda: any(r["tag"] == "again" and r["event"] == "end" for r in read_log(log)),
        60,
        "the run sent again",
        [prefork_worker],
    )
    wait_until(lambda: not held(worker_alias, once_name), 5, "its once lock's release")
    assert not started(log, "duplicate")
    worker_log = prefork_worker.log_tail(40000)
    # Freed by a cleanup, the run sent again would have found it gone and said so.
    assert f"Freed lock '{once_name}'" not in worker_log
    assert "expired and was taken over (or removed) before it ran" not in worker_log
    assert "was lost" not in worker_log


def test_a_lost_run_sent_again_later_keeps_its_once_lock_until_it_is_due(
    workers, prefork_worker, worker_alias, tmp_path
):
    """``retry_on_worker_lost`` sends a lost run again from the worker's main process,
    due in ``default_retry_delay``: the once lock it carries is extended to cover that
    wait (once_ttl + the countdown, here 10 + 3.5 s), as ``self.retry()`` does, so that
    no duplicate gets in before the run sent again starts."""
    import os
    import signal

    job = celery_task("hang_retry_lost_slow", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    once_name = f"celery-once-test:{key}"
    first = job.apply_async((key, log, "first", 60), queue=prefork_worker.queue)
    wait_until(lambda: started(log, "first"), 30, "the run", [prefork_worker])
    run = locks[worker_alias].get(f"celery-test:{key}")
    os.kill(run.owner["pid"], signal.SIGKILL)
    wait_for_exit(run.owner["pid"], [prefork_worker])
    wait_until(
        lambda: f"[{first.id}] retry: Retry in" in prefork_worker.log_tail(40000),
        30,
        "Celery to send the lost run again",
        [prefork_worker],
    )
    info = locks[worker_alias].get(once_name)
    assert info is not None and info.expires_in > 10.5, info  # 10 s at most unextended
    with pytest.raises(AlreadyQueued):
        job.apply_async((key, log, "duplicate", 0.1), queue=workers[1].queue)
    wait_until(
        lambda: any(r["tag"] == "again" and r["event"] == "end" for r in read_log(log)),
        40,
        "the run sent again",
        [prefork_worker],
    )
    wait_until(lambda: not held(worker_alias, once_name), 5, "its once lock's release")
    assert not started(log, "duplicate")
    tail = prefork_worker.log_tail(40000)
    assert not any(lost in tail for lost in LOST_LOCK_MESSAGES), tail


def test_a_revoke_that_does_not_kill_leaves_the_run_its_locks(
    workers, prefork_worker, worker_alias, tmp_path
):
    """``revoke(terminate=True, signal="SIGUSR1")``: the run gets SoftTimeLimitExceeded
    and goes on. Its locks stay its own until it returns (a duplicate is refused, no
    second run starts), then it releases them; no lock is reported lost."""
    job = celery_task("stubborn", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    run_name, once_name = f"celery-test:{key}", f"celery-once-test:{key}"
    original = job.apply_async((key, log, "first", 3), queue=prefork_worker.queue)
    wait_until(lambda: started(log, "first"), 30, "the run", [prefork_worker])
    job.app.control.revoke(original.id, terminate=True, signal="SIGUSR1")
    wait_until(
        lambda: any(r["event"] == "soft" for r in read_log(log)),
        10,
        "the soft time limit in the run",
        [prefork_worker],
    )
    time.sleep(ONCE_ONLY_GRACE + 0.5)
    assert held(worker_alias, run_name) and held(worker_alias, once_name)
    with pytest.raises(AlreadyQueued):
        job.apply_async((key, log, "duplicate", 0.1), queue=workers[1].queue)
    wait_until(
        lambda: any(r["event"] == "end" for r in read_log(log)),
        15,
        "the run's end",
        [prefork_worker],
    )
    wait_until(
        lambda: not held(worker_alias, run_name) and not held(worker_alias, once_name),
        5,
        "the run to release its locks",
        [prefork_worker],
    )
    assert not started(log, "duplicate")
    assert "was lost" not in prefork_worker.log_tail(20000)
    assert "Freed lock" not in prefork_worker.log_tail(20000)


def test_retry_without_throw_keeps_the_run_lock_until_the_body_returns(
    workers, worker_alias, tmp_path
):
    """``self.retry(throw=False)`` sends the retry and the body goes on: the retry
    (sent to the other worker, due at once) must not run until the body returns."""
    w1, w2 = workers
    job = celery_task("retry_nothrow", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    result = job.apply_async((key, log, "nothrow", 2, w2.queue), queue=w1.queue)
    wait_until(
        lambda: len([r for r in read_log(log) if r["event"] == "end"]) == 2,
        60,
        "both attempts to end",
        workers,
    )
    (first_start, first_end, first), (second_start, _, second) = runs(log)
    # (The retry may have met the lock and retried: on_contention="retry".)
    assert first["retries"] == 0 and second["retries"] >= 1
    assert second_start >= first_end, "the retry ran while the first attempt still did"
    assert get(result, workers, timeout=60) == "nothrow"
    assert not held(worker_alias, f"celery-test:{key}")


def test_a_lost_pool_child_frees_its_semaphore_slot_at_once(
    workers, prefork_worker, worker_alias, tmp_path
):
    """``lock_limit=2``: the dead run's slot is freed within 2 s, the other slot's
    holder is left alone."""
    import os
    import signal

    from django_setnx.semaphore import slot_record

    job = celery_task("hang_limited", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    other = semaphore(f"celery-test:{key}", 2, ttl=60, backend=worker_alias)
    assert other.acquire(blocking=False)
    result = job.apply_async((key, log, "hang", 60), queue=prefork_worker.queue)
    wait_until(lambda: started(log, "hang"), 30, "the hanging run", [prefork_worker])
    run = next(info for info in other.holders() if info.owner.get("celery_task_id") == result.id)
    assert run.name == slot_record(other.name, 3 - other.slot) and run.owner["limit"] == 2
    os.kill(run.owner["pid"], signal.SIGKILL)
    dead = wait_for_exit(run.owner["pid"], [prefork_worker])
    wait_until(
        lambda: len(other.holders()) == 1, 5, "the dead run's slot to be freed", [prefork_worker]
    )
    assert time.monotonic() - dead <= 2.0
    assert other.owned()
    other.release()


# -- canvases, beat, revoke: what a project does with enqueue-once tasks ---------------------


def hold_once(alias, key):
    """Hold ``key``'s enqueue-once lock as a queued copy of the task would."""
    lk = lock(f"celery-once-test:{key}", ttl=60, backend=alias)
    assert lk.acquire(blocking=False)
    return lk


@pytest.mark.parametrize("policy", ["drop", "raise"])
def test_duplicate_step_of_a_chain(workers, worker_alias, policy):
    """A chain whose second step is a duplicate: the chain completes (drop: with None)
    or fails at that step (raise: AlreadyQueued); the first step is never blamed."""
    from celery import chain

    from tests.celery_app import app

    w1, _ = workers
    key = uuid.uuid4().hex
    holder = hold_once(worker_alias, key)
    try:
        result = chain(
            app.tasks["setnx_tests.echo"].si("first").set(queue=w1.queue),
            celery_task(f"once_value_{policy}", worker_alias).si(key).set(queue=w1.queue),
        ).apply_async()
        value = get(result, workers)
        assert result.parent.state == "SUCCESS" and result.parent.result == "first"
        if policy == "drop":
            assert result.state == "SUCCESS" and value is None
        else:
            assert result.state == "FAILURE" and isinstance(value, AlreadyQueued)
            assert value.name == f"celery-once-test:{key}"
        assert holder.owned(), "the duplicate never touched the holder's lock"
    finally:
        holder.release()


@pytest.mark.parametrize("policy", ["drop", "raise"])
def test_duplicate_members_of_a_group_and_a_chord(workers, worker_alias, policy):
    from celery import chord, group

    from tests.celery_app import app

    w1, _ = workers
    once_value = celery_task(f"once_value_{policy}", worker_alias)
    key = uuid.uuid4().hex
    # The first member runs for a while: the second is enqueued while it holds its
    # once lock, however slowly the canvas is sent.
    members = [once_value.si(key, 1.0).set(queue=w1.queue) for _ in range(2)]
    result = group(members).apply_async()
    wait_until(result.ready, 30, "the group", workers)
    values = [get(r, workers) for r in result.results]
    assert values[0] == key
    if policy == "drop":
        assert values[1] is None and result.results[1].state == "SUCCESS"
    else:
        assert result.results[1].state == "FAILURE" and isinstance(values[1], AlreadyQueued)
    wait_until(
        lambda: locks[worker_alias].get(f"celery-once-test:{key}") is None,
        10,
        "the first member's once lock to be released",
        workers,
    )

    key = uuid.uuid4().hex
    members = [once_value.si(key, 1.0).set(queue=w1.queue) for _ in range(2)]
    body = app.tasks["setnx_tests.collect"].s().set(queue=w1.queue)
    result = chord(members)(body)
    value = get(result, workers, timeout=40)
    if policy == "drop":
        assert result.state == "SUCCESS" and value == [key, None]
    else:
        assert result.state == "FAILURE" and "AlreadyQueued" in repr(value)


def test_revoked_countdown_task_frees_its_once_lock_at_once(workers, worker_alias, tmp_path):
    """Revoking a message that waits for its countdown in a worker frees its enqueue-once
    lock when the revoke arrives, not when the countdown ends."""
    w1, _ = workers
    job = celery_task("once_raise", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    name = f"celery-once-test:{key}"
    result = job.apply_async((key, log, "later", 0), queue=w1.queue, countdown=60)
    assert held(worker_alias, name)

    def scheduled_by_w1():
        scheduled = (
            job.app.control.inspect(
                destination=[w1.nodename.replace("%h", _host())], timeout=1
            ).scheduled()
            or {}
        )
        return any(
            entry["request"]["id"] == result.id
            for entries in scheduled.values()
            for entry in entries
        )

    wait_until(scheduled_by_w1, 20, "the worker to hold the message for its countdown", workers)
    job.app.control.revoke(result.id)
    # Well inside the broker's visibility_timeout (4 s here), after which Redis would
    # deliver the unacked message again and the worker would discard it (and so free
    # the lock) anyway: with Redis' default of an hour, that is the ETA or an hour.
    wait_until(
        lambda: not held(worker_alias, name), 2.5, "the revoke to free the once lock", workers
    )
    again = job.apply_async((key, log, "again", 0), queue=w1.queue)
    assert get(again, workers) == "again"
    assert not started(log, "later")
    # The message comes back after the visibility_timeout and is discarded as revoked
    # (task_revoked releases its once lock a second time): no lost lock is reported,
    # though the name is another enqueue's by then.
    wait_until(
        lambda: f"Discarding revoked task: {job.name}[{result.id}]" in w1.log_tail(40000),
        20,
        "the revoked message to be discarded",
        workers,
    )
    assert "was lost" not in w1.log_tail(40000)


def _host():
    import socket

    return socket.gethostname()


def test_contention_error_comes_back_whole_from_a_worker(workers, worker_alias, tmp_path):
    """The LockNotAcquired a worker stores (JSON result backend) is rebuilt with its
    class, its message (not wrapped twice) and its lock name."""
    w1, _ = workers
    job = celery_task("exclusive_raise", worker_alias)
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    with lock(f"celery-test:{key}", ttl=60, backend=worker_alias, guards="the test"):
        result = job.apply_async((key, log, "refused", 0), queue=w1.queue)
        error = get(result, workers)
    assert type(error) is LockNotAcquired
    assert error.name == f"celery-test:{key}"
    assert str(error) == (
        f"Task {job.name}[{result.id}]: lock 'celery-test:{key}' is held by the test."
    )
    with pytest.raises(LockNotAcquired, match=r"^Task .* is held by the test\.$"):
        result.get(timeout=5)


@pytest.mark.slow
def test_beat_skips_ticks_while_a_run_is_going(worker_env, workers, worker_alias, tmp_path):
    """A periodic enqueue-once task whose run (2.5 s) outlasts its interval (1 s),
    scheduled by a real ``celery beat`` with ``once_policy="drop"`` in the entry's
    options: runs never overlap, the ticks in between are skipped quietly (no error,
    no traceback in beat's log), and a tick after a run enqueues the next one."""
    from tests.celery_support.worker import CeleryBeat

    w1, _ = workers
    env, log_dir = worker_env
    key, log = uuid.uuid4().hex, str(tmp_path / "runs.jsonl")
    beat = CeleryBeat(
        {
            **env,
            "SETNX_TEST_BEAT_QUEUE": w1.queue,
            "SETNX_TEST_BEAT_ALIAS": worker_alias,
            "SETNX_TEST_BEAT_KEY": key,
            "SETNX_TEST_BEAT_LOG": log,
        },
        log_dir,
    ).start()
    try:
        wait_until(lambda: len(runs(log)) >= 2, 40, "two periodic runs", workers)
    finally:
        beat.stop()
    text = beat.log()
    intervals = assert_no_overlap(log)
    assert len(intervals) >= 2
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    assert "not enqueued: a copy is already queued or running" in text, text[-3000:]
    wait_until(
        lambda: locks[worker_alias].get(f"celery-once-test:{key}") is None,
        10,
        "the last run's once lock to be released",
        workers,
    )
