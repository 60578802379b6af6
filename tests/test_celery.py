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

from django_setnx import lock, locks
from django_setnx.contrib.celery import (
    ONCE_NAME_HEADER,
    ONCE_TOKEN_HEADER,
    AlreadyQueued,
    ExclusiveTask,
)
from django_setnx.exceptions import LockNotAcquired

# ---------------------------------------------------------------------------
# Eager mode
# ---------------------------------------------------------------------------

eager_app = Celery("setnx_eager", set_as_current=False)
eager_app.conf.update(task_always_eager=True, task_eager_propagates=False,
                      broker_url="memory://", result_backend="cache+memory://")
eager_app.finalize()


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
    @eager_task(lock_name=lambda account, **kw: f"{name}:{account['pk']}", lock_backend=alias,
                once_policy="raise", once_name=name + ":once:{account[pk]}")
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

    @eager_task(bind=True, lock_name=name, lock_backend=alias, on_contention=policy,
                lock_retry_countdown=0, lock_max_retries=2)
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


def test_retry_on_contention_runs_once_free(alias, name):
    attempts = []
    holder = lock(name, ttl=30, backend=alias)

    @eager_task(bind=True, lock_name=name, lock_backend=alias, on_contention="retry",
                lock_retry_countdown=0, lock_max_retries=3)
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

    @eager_task(bind=True, once_policy=policy, once_name=name + ":{shop_id}",
                lock_backend=alias, once_ttl=30)
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
    @eager_task(lock_name=name, once_policy="raise", once_name=name + ":once",
                lock_backend=alias)
    def boom():
        assert held(alias, name) and held(alias, name + ":once")
        raise RuntimeError("boom")

    result = boom.delay()
    assert result.failed() and isinstance(result.result, RuntimeError)
    assert locks[alias].get(name) is None
    assert locks[alias].get(name + ":once") is None


def test_retry_keeps_once_lock_until_exhausted(alias, name):
    seen = []

    @eager_task(bind=True, lock_name=name, once_policy="raise", once_name=name + ":once",
                lock_backend=alias, max_retries=2)
    def flaky(self):
        once = locks[alias].get(name + ":once")
        seen.append((self.request.retries, once.is_held, once.fencing_token,
                     held(alias, name)))
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


def test_app_wide_task_class(alias, name):
    app = Celery("setnx_cls", set_as_current=False,
                 task_cls="django_setnx.contrib.celery:ExclusiveTask")
    app.conf.update(task_always_eager=True, broker_url="memory://",
                    result_backend="cache+memory://")
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
            metafunc.parametrize("worker_alias", [pytest.param(
                None, marks=pytest.mark.skip(
                    reason="the Celery worker tests use the suite's Redis as broker, and "
                           "'redis' is not in settings.CONTRACT_ALIASES "
                           "(SETNX_TEST_BACKENDS)"))])


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
    results = [job.apply_async((key, log, tag, 1.0), queue=w.queue)
               for tag, w in (("a", w1), ("b", w2))]
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
    assert locks[worker_alias].get(once_name) is None


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["crash", "crash_late"])
def test_sigkill_mid_task_locks_expire_after_ttl(workers, victim_worker, worker_alias, tmp_path,
                                                 kind):
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
    wait_until(lambda: not held(worker_alias, run_name) and not held(worker_alias, once_name),
               CRASH_TTL + 2, "the dead worker's locks to expire", workers)
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
        wait_until(lambda: any(r[2]["task_id"] == victim.id for r in runs(log)), 30,
                   "the redelivered run", [victim_worker])
        assert get(victim, workers) == "victim"
        ((_, _, rec),) = runs(log)
        assert rec["pid"] == victim_worker.pid and rec["task_id"] == victim.id
        assert "expired and was taken over" not in victim_worker.log_tail(20000)
    assert backend.get(run_name) is None
    assert backend.get(once_name) is None
    assert lock(run_name, backend=worker_alias).acquire(blocking=False)
