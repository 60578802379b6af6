"""A small Celery app for ``tests/test_celery.py``, run by real worker processes.

Workers start it with ``celery -A tests.celery_app worker ...`` in an environment
from :func:`tests.workers.child_environment`, so they use the test databases and the
throwaway Redis of the pytest run that started them. The broker and the result
backend are that Redis, databases 1 and 2 (the lock alias ``redis`` uses 0).

For each lock alias under test (``postgres`` and ``redis`` when configured) the same
set of tasks is registered as ``setnx_tests.<kind>.<alias>``: a task's lock backend
is part of its class, so each alias gets classes of its own. Every task body appends
JSON lines (``start``/``end`` with ``time.time()``, pid and retries) to the file
``log`` it is given, so the tests can check that runs never overlapped.
"""

import json
import os
import time
from urllib.parse import urlsplit, urlunsplit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django
from django.apps import apps

if not apps.ready:
    django.setup()

from celery import Celery
from django.conf import settings

from django_setnx.contrib.celery import ExclusiveTask

#: Lock aliases the worker tests cover.
ALIASES = [a for a in ("postgres", "redis") if a in settings.CONTRACT_ALIASES]

#: Short ttls of the crash test: the lock must be free this long after a SIGKILL.
CRASH_TTL = 2.0


def redis_url(db):
    """The suite's Redis, database ``db`` (None when Redis is not under test)."""
    location = settings.SETNX_LOCKS.get("redis", {}).get("LOCATION") or os.environ.get(
        "SETNX_TEST_REDIS_URL", ""
    )
    if "redis" not in settings.CONTRACT_ALIASES or not location or ":0/" in location:
        return None
    parts = urlsplit(location)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", "", ""))


app = Celery("setnx_tests", set_as_current=False)
app.conf.update(
    broker_url=redis_url(1) or "memory://",
    result_backend=redis_url(2) or "cache+memory://",
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,
    result_expires=600,
    task_default_queue="setnx-tests-unused",
    # Redis keeps a delivered message until it is acked; one that a dead worker never
    # acked (acks_late) is delivered again after visibility_timeout. Short here, so the
    # redelivery test takes seconds; every other test task is acked at its start.
    broker_transport_options={
        "visibility_timeout": 4,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
)


def record(log, tag, event, task, **extra):
    """Append one JSON line to ``log`` (one write, so lines never interleave)."""
    line = json.dumps(
        {
            "tag": tag,
            "event": event,
            "t": time.time(),
            "pid": os.getpid(),
            "task_id": task.request.id,
            "retries": task.request.retries,
            **extra,
        }
    )
    with open(log, "a") as f:
        f.write(line + "\n")


def already_started(log, task_id):
    """True if ``log`` shows an earlier start of the task ``task_id``."""
    try:
        with open(log) as f:
            return any(json.loads(line).get("task_id") == task_id for line in f if line.strip())
    except FileNotFoundError:
        return False


def work(task, log, tag, duration, fail=False):
    record(log, tag, "start", task)
    time.sleep(duration)
    record(log, tag, "end", task)
    if fail:
        raise RuntimeError(f"{tag} failed on purpose")
    return tag


@app.task(name="setnx_tests.ping", shared=False)
def ping():
    return os.getpid()


def _register(alias):
    opts = {"base": ExclusiveTask, "bind": True, "lock_backend": alias, "shared": False}

    # Run-exclusive, one task per contention policy.
    for policy in ("skip", "retry", "raise"):

        def exclusive(self, key, log, tag, duration):
            return work(self, log, tag, duration)

        app.task(
            name=f"setnx_tests.exclusive_{policy}.{alias}",
            lock_name="celery-test:{key}",
            lock_ttl=10,
            on_contention=policy,
            lock_retry_countdown=1,
            lock_max_retries=10,
            **opts,
        )(exclusive)

    # Enqueue-once, one task per policy.
    for policy in ("raise", "drop"):

        def once(self, key, log, tag, duration):
            return work(self, log, tag, duration)

        app.task(
            name=f"setnx_tests.once_{policy}.{alias}",
            once_policy=policy,
            once_name="celery-once-test:{key}",
            once_ttl=30,
            **opts,
        )(once)

    # Both locks; raises after its work.
    def both_failing(self, key, log, tag, duration):
        return work(self, log, tag, duration, fail=True)

    app.task(
        name=f"setnx_tests.both_failing.{alias}",
        lock_name="celery-test:{key}",
        lock_ttl=10,
        once_policy="raise",
        once_ttl=30,
        **opts,
    )(both_failing)

    # Fails and retries until its retries are exhausted.
    def flaky(self, key, log, tag, duration, countdown):
        work(self, log, tag, duration)
        raise self.retry(
            exc=RuntimeError(f"{tag} attempt {self.request.retries}"), countdown=countdown
        )

    app.task(
        name=f"setnx_tests.flaky.{alias}",
        lock_name="celery-test:{key}",
        lock_ttl=10,
        once_policy="raise",
        once_name="celery-once-test:{key}",
        once_ttl=30,
        max_retries=2,
        **opts,
    )(flaky)

    # Holds both locks with short ttls; the test SIGKILLs its worker mid-run. A
    # redelivered message (acks_late) finishes quickly the second time.
    def crash(self, key, log, tag, duration):
        if already_started(log, self.request.id):
            duration = 0.2
        return work(self, log, tag, duration)

    app.task(
        name=f"setnx_tests.crash.{alias}",
        lock_name="celery-test:{key}",
        lock_ttl=CRASH_TTL,
        once_policy="raise",
        once_name="celery-once-test:{key}",
        once_ttl=CRASH_TTL,
        **opts,
    )(crash)

    # As crash, acknowledged late: a killed worker's message is delivered again.
    app.task(
        name=f"setnx_tests.crash_late.{alias}",
        lock_name="celery-test:{key}",
        lock_ttl=CRASH_TTL,
        once_policy="raise",
        once_name="celery-once-test:{key}",
        once_ttl=CRASH_TTL,
        acks_late=True,
        **opts,
    )(crash)

    both_locks_60s = {
        "lock_name": "celery-test:{key}",
        "lock_ttl": 60,
        "once_policy": "raise",
        "once_name": "celery-once-test:{key}",
        "once_ttl": 60,
    }

    # Both locks with a long ttl (60 s): the dead-owner tests kill its pool child
    # (SIGKILL, or a hard time_limit given per call) and expect the locks back at once.
    def hang(self, key, log, tag, duration):
        return work(self, log, tag, duration)

    app.task(
        name=f"setnx_tests.hang.{alias}",
        **both_locks_60s,
        **opts,
    )(hang)

    # As hang, acknowledged late and rejected when its child is lost: Celery puts the
    # message back at once, and the run delivered again lasts 1 s.
    def hang_requeue(self, key, log, tag, duration):
        if already_started(log, self.request.id):
            tag, duration = "again", 1
        return work(self, log, tag, duration)

    app.task(
        name=f"setnx_tests.hang_requeue.{alias}",
        **both_locks_60s,
        acks_late=True,
        reject_on_worker_lost=True,
        **opts,
    )(hang_requeue)

    # As hang, acknowledged late and put back by Celery when killed for its hard time
    # limit (acks_on_failure_or_timeout=False); the run delivered again lasts 1 s.
    app.task(
        name=f"setnx_tests.hang_timeout_requeue.{alias}",
        **both_locks_60s,
        acks_late=True,
        acks_on_failure_or_timeout=False,
        **opts,
    )(hang_requeue)

    # As hang, sent again by Celery (retry_on_worker_lost, Celery >= 5.7) when its
    # pool child is lost; the run sent again lasts 1 s.
    app.task(
        name=f"setnx_tests.hang_retry_lost.{alias}",
        **both_locks_60s,
        retry_on_worker_lost=True,
        default_retry_delay=1,
        max_retries=3,
        **opts,
    )(hang_requeue)

    # As hang_retry_lost, with a 10 s once lock and a 3.5 s countdown (below the test
    # broker's 4 s visibility_timeout): the resent message's once lock must be
    # extended to cover the countdown.
    app.task(
        name=f"setnx_tests.hang_retry_lost_slow.{alias}",
        **{**both_locks_60s, "once_ttl": 10},
        retry_on_worker_lost=True,
        default_retry_delay=3.5,
        max_retries=3,
        **opts,
    )(hang_requeue)

    # Both locks; survives SIGUSR1 (revoke(terminate=True, signal="SIGUSR1")): it
    # records the soft limit, then goes on working for ``duration`` more seconds.
    def stubborn(self, key, log, tag, duration):
        from celery.exceptions import SoftTimeLimitExceeded

        record(log, tag, "start", self)
        try:
            time.sleep(60)
        except SoftTimeLimitExceeded:
            record(log, tag, "soft", self)
        time.sleep(duration)
        record(log, tag, "end", self)
        return tag

    app.task(
        name=f"setnx_tests.stubborn.{alias}",
        **both_locks_60s,
        **opts,
    )(stubborn)

    # Schedules its retry on ``queue`` (another worker's) without raising, then
    # works ``duration`` more seconds: the retry must not run meanwhile.
    def retry_nothrow(self, key, log, tag, duration, queue):
        record(log, tag, "start", self, attempt=self.request.retries)
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False, queue=queue)
            time.sleep(duration)
        record(log, tag, "end", self, attempt=self.request.retries)
        return tag

    app.task(
        name=f"setnx_tests.retry_nothrow.{alias}",
        lock_name="celery-test:{key}",
        lock_ttl=60,
        on_contention="retry",
        lock_retry_countdown=0.5,
        lock_max_retries=20,
        max_retries=30,
        **opts,
    )(retry_nothrow)

    # As hang, with a semaphore of two slots as its run lock (lock_limit=2).
    app.task(
        name=f"setnx_tests.hang_limited.{alias}",
        lock_name="celery-test:{key}",
        lock_limit=2,
        lock_ttl=60,
        **opts,
    )(hang)

    # Enqueue-once tasks that return their key: canvases (chains, groups, chords).
    for policy in ("raise", "drop"):

        def once_value(self, key, pause=0):
            time.sleep(pause)  # still running while a duplicate is enqueued
            return key

        app.task(
            name=f"setnx_tests.once_value_{policy}.{alias}",
            once_policy=policy,
            once_name="celery-once-test:{key}",
            once_ttl=30,
            **opts,
        )(once_value)

    # A periodic task: "raise" by default; the beat entry asks for "drop".
    def periodic(self, key, log, duration):
        return work(self, log, "tick", duration)

    app.task(
        name=f"setnx_tests.periodic.{alias}",
        once_policy="raise",
        once_name="celery-once-test:{key}",
        once_ttl=30,
        **opts,
    )(periodic)


@app.task(name="setnx_tests.echo", shared=False)
def echo(value):
    return value


@app.task(name="setnx_tests.collect", shared=False)
def collect(values):
    return list(values)


for _alias in ALIASES:
    _register(_alias)

# Celery beat (tests/test_celery.py::test_beat_...): one entry, configured by the test.
if os.environ.get("SETNX_TEST_BEAT_QUEUE"):
    app.conf.beat_schedule = {
        "periodic-once": {
            "task": f"setnx_tests.periodic.{os.environ['SETNX_TEST_BEAT_ALIAS']}",
            "schedule": 1.0,
            "args": (os.environ["SETNX_TEST_BEAT_KEY"], os.environ["SETNX_TEST_BEAT_LOG"], 2.5),
            "options": {"queue": os.environ["SETNX_TEST_BEAT_QUEUE"], "once_policy": "drop"},
        },
    }


def task(kind, alias):
    """The registered task ``kind`` for lock alias ``alias``."""
    return app.tasks[f"setnx_tests.{kind}.{alias}"]
