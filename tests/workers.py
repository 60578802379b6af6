"""Entry points of the child processes used by the race and crash tests.

Children are started with the ``spawn`` method (a fresh interpreter, as a second
server or worker would be), so they set Django up themselves, against the test
databases and the Redis server the parent is using (see :func:`child_environment`).
"""

import json
import os
import sys
import time


def child_environment():
    """Environment variables that point a child at the parent's test servers."""
    from django.conf import settings
    from django.db import connections

    return {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "SETNX_TEST_BACKENDS": ",".join(settings.TEST_BACKENDS),
        "SETNX_TEST_REDIS_URL": settings.SETNX_LOCKS.get("redis", {}).get("LOCATION", ""),
        "SETNX_TEST_DB_NAMES": json.dumps(
            {alias: connections[alias].settings_dict["NAME"] for alias in settings.DATABASES}
        ),
    }


def _setup(env):
    os.environ.update(env)
    import django

    django.setup()


def takeover_racer(env, alias, name, rounds, barrier, results, ttl):
    """Each round: wait at the barrier, try once to take the (expired) lock, report
    ``(round, pid, won, fencing token, started, finished)`` (monotonic seconds,
    one clock for every process of the host)."""
    _setup(env)
    from django_setnx import lock

    # Connect and import everything before the first round, as in later rounds: a
    # first attempt that stalls past the ttl takes over the expired lock, legitimately.
    with lock(f"{name}:warm-up:{os.getpid()}", ttl=10, backend=alias, blocking=False):
        pass
    for round_no in range(rounds):
        lk = lock(name, ttl=ttl, backend=alias)
        barrier.wait(timeout=60)
        started = time.monotonic()
        won = lk.acquire(blocking=False)
        finished = time.monotonic()
        results.put((round_no, os.getpid(), won, lk.fencing_token, started, finished))
        # Never release: the next round races to take over the expired record.
        barrier.wait(timeout=60)


def counter_incrementer(env, alias, name, counter_path, iterations, results):
    """Read-modify-write a counter file under the lock, ``iterations`` times."""
    _setup(env)
    from django_setnx import lock

    lk = lock(name, ttl=30, backend=alias)
    got = 0
    for _ in range(iterations):
        if not lk.acquire(timeout=120):
            break
        try:
            with open(counter_path) as f:
                value = int(f.read() or 0)
            with open(counter_path, "w") as f:
                f.write(str(value + 1))
            got += 1
        finally:
            lk.release()
    results.put((os.getpid(), got))


def crash_holder(env, alias, name, ttl, acquired):
    """Acquire and then hang, holding the lock, until killed."""
    _setup(env)
    from django_setnx import lock

    lk = lock(name, ttl=ttl, backend=alias)
    lk.acquire(timeout=10)
    acquired.set()
    while True:
        time.sleep(60)


def crash_holder_of_two(env, alias, name, ttl, acquired):
    """Hold ``name`` (its own lock) and ``name:task`` as a Celery enqueue-once lock
    would (its owner names a task), then hang until killed."""
    _setup(env)
    from django_setnx import lock

    own = lock(name, ttl=ttl, backend=alias)
    own.acquire(timeout=10)
    sent = lock(f"{name}:task", ttl=ttl, backend=alias)
    sent.owner_extra["celery_task_id"] = "a-queued-task"
    sent.acquire(timeout=10)
    acquired.set()
    while True:
        time.sleep(60)


def hand_over_then_hang(env, alias, name, ttl, handover, tokens):
    """Acquire ``name`` to hand it over (with the HANDOVER owner field if
    ``handover``), put its token on ``tokens``, then hang until killed."""
    _setup(env)
    from django_setnx import lock
    from django_setnx.dead_owners import HANDOVER

    lk = lock(name, ttl=ttl, backend=alias)
    if handover:
        lk.owner_extra[HANDOVER] = True
    lk.acquire(timeout=10)
    tokens.put(lk._token)
    while True:
        time.sleep(60)


def crash_waiter(env, alias, name, ttl, queued):
    """Wait for a held lock (queued by the backend) until killed."""
    _setup(env)
    from django_setnx import lock
    from django_setnx.signals import lock_contended

    lock_contended.connect(lambda **kwargs: queued.set(), weak=False)
    lock(name, ttl=ttl, backend=alias).acquire(timeout=120)


def probe_locked(env, alias, name, answer):
    """Report whether ``name`` is held, as seen from another process."""
    _setup(env)
    from django_setnx import lock

    answer.put(lock(name, backend=alias).locked())


def fencing_tokens(env, alias, name, count, answer):
    """Acquire and release ``name`` ``count`` times; report the fencing tokens."""
    _setup(env)
    from django_setnx import lock

    tokens = []
    for _ in range(count):
        lk = lock(name, ttl=30, backend=alias)
        lk.acquire(timeout=30)
        tokens.append(lk.fencing_token)
        lk.release()
    answer.put(tokens)


def contended_fencing_tokens(env, alias, name, seconds, counter, answer):
    """Loop on ``acquire(blocking=False)`` of ``name`` for ``seconds``, beside other
    processes doing the same; each win takes the next number of the shared
    ``counter`` while holding the lock (so the numbers order the holds) and reports
    ``(number, fencing token)`` pairs."""
    _setup(env)
    from django_setnx import lock

    pairs = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lk = lock(name, ttl=30, backend=alias)
        if not lk.acquire(blocking=False):
            continue
        with counter.get_lock():
            counter.value += 1
            pairs.append((counter.value, lk.fencing_token))
        lk.release()
    answer.put(pairs)


def release_at(env, alias, name, token, when):
    """Release ``name`` (held under ``token`` by the parent) at time.time() ``when``."""
    _setup(env)
    from django_setnx import locks

    time.sleep(max(when - time.time(), 0))
    if not locks[alias].release(name, token):
        os._exit(2)
    os._exit(0)


def release_when_told(env, alias, name, token, ready, delay, released_at):
    """Set ``ready`` once set up, then release ``name`` (held under ``token`` by the
    parent) ``delay`` seconds later; put time.time() after the release into
    ``released_at`` (a multiprocessing Value)."""
    _setup(env)
    from django_setnx import locks

    backend = locks[alias]
    backend.get(name)  # connected before the clock starts
    ready.set()
    time.sleep(delay)
    if not backend.release(name, token):
        os._exit(2)
    released_at.value = time.time()
    os._exit(0)


def wait_and_report(env, alias, name, safety_poll, queued, answer):
    """Wait for ``name`` (polling only every ``safety_poll`` s on PostgreSQL); put
    time.time() into ``answer`` as soon as it is ours (None if it never is), then
    release it."""
    _setup(env)
    from django_setnx import lock, locks
    from django_setnx.backends import database

    database.PG_SAFETY_POLL = safety_poll
    backend = locks[alias]
    real_wait = backend.wait

    def wait(*args, **kwargs):
        queued.set()  # refused and queued: about to wait
        return real_wait(*args, **kwargs)

    backend.wait = wait
    lk = lock(name, ttl=30, backend=alias)
    acquired = False
    try:
        # Shorter than the parent's wait for the answer (40 s), longer than a poll.
        acquired = lk.acquire(timeout=35)
    finally:
        answer.put(time.time() if acquired else None)  # None: the parent sees exit 2
    if acquired:
        lk.release()
    # os._exit skips the exit that waits for the queue's feeder thread: without
    # this, the answer can still be in this process' buffer when it ends (a test
    # then waited 40 s for it in CI).
    answer.close()
    answer.join_thread()
    os._exit(0 if acquired else 2)


def queue_and_hang(env, alias, name, ready):
    """Queue up for ``name`` (ttl 30 s) and wait, until killed."""
    _setup(env)
    from django_setnx import lock

    lk = lock(name, ttl=30, backend=alias)
    ready.set()
    lk.acquire(timeout=120)
    os._exit(3)  # handed the lock before the kill: the test reports it


def semaphore_user(env, alias, name, limit, iterations, inside, peak, guard, results):
    """Take a slot of semaphore ``name`` ``iterations`` times; while holding it, count
    this process in the shared ``inside`` counter and record the most ever inside."""
    _setup(env)
    from django_setnx import semaphore

    sem = semaphore(name, limit, ttl=30, backend=alias)
    got, tokens = 0, []
    for _ in range(iterations):
        if not sem.acquire(timeout=120):
            break
        try:
            with guard:
                inside.value += 1
                peak.value = max(peak.value, inside.value)
            tokens.append((sem.slot, sem.fencing_token))
            time.sleep(0.002)
            with guard:
                inside.value -= 1
            got += 1
        finally:
            sem.release()
    results.put((os.getpid(), got, tokens))


def semaphore_crash_holder(env, alias, name, limit, ttl, acquired):
    """Take a slot of semaphore ``name`` and hang, holding it, until killed."""
    _setup(env)
    from django_setnx import semaphore

    semaphore(name, limit, ttl=ttl, backend=alias).acquire(timeout=10)
    acquired.set()
    while True:
        time.sleep(60)


def crash_holder_as(env, alias, name, ttl, owner_extra, acquired):
    """As crash_holder, with ``owner_extra`` in the owner record (the namespace
    another container's process would write, say)."""
    _setup(env)
    from django_setnx import lock

    lk = lock(name, ttl=ttl, backend=alias)
    lk.owner_extra.update(owner_extra)
    lk.acquire(timeout=10)
    acquired.set()
    while True:
        time.sleep(60)


def cancel_waiters_of_a_stopped_server(env, url, server_pid, returned):
    """Waiters queue on the Redis server at ``url`` through a client with no socket
    timeout; that server stops answering (SIGSTOP), every waiter is cancelled, and
    asyncio.run returns. The undos that its shutdown cancels go on in threads (see
    aio.undo): they must not keep this process from exiting."""
    _setup(env)
    import asyncio
    import signal

    from django.conf import settings
    from django.test import override_settings

    from django_setnx import lock

    params = {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        "LOCATION": url,
        "KEY_PREFIX": "setnx-exit",
        "OPTIONS": {"CONNECTION_KWARGS": {"socket_timeout": None}},
    }
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "exit": params}):
        assert lock("held", ttl=60, backend="exit").acquire()

        async def main():
            waiters = [
                asyncio.ensure_future(lock("held", ttl=30, backend="exit").aacquire(timeout=30))
                for _ in range(5)
            ]
            await asyncio.sleep(0.3)  # queued
            os.kill(server_pid, signal.SIGSTOP)
            await asyncio.sleep(0.1)
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

        asyncio.run(main())
    returned.set()


def fail_an_acquire_then_exit(env, url, server_pid, failed):
    """An acquire against the Redis server at ``url``, which stops answering
    (SIGSTOP) just before: it times out, so does its undo, and the process then
    exits with the undo pending (review r125: a short-lived process, a management
    command or a recycled worker, left the lock held by nobody). The exit hook of
    redis_undo sends it once more, for AT_EXIT seconds at most."""
    _setup(env)
    _fail_an_acquire(url, server_pid, failed)


def fail_an_acquire_in_a_forked_child(env, url, server_pid, failed):
    """fail_an_acquire_then_exit in a multiprocessing child started by fork, which
    ends with ``os._exit`` (atexit hooks skipped): its finalizers send the undo
    (review r128)."""
    _setup(env)
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(
        target=_fail_an_acquire, args=(url, server_pid, failed)
    )
    child.start()
    child.join()
    sys.exit(child.exitcode)


def fail_an_acquire_then_end_as_a_celery_child(env, url, server_pid, failed):
    """fail_an_acquire_then_exit, ended as a Celery prefork pool child ends: its
    ``worker_process_shutdown`` signal, then ``os._exit`` (atexit hooks skipped)."""
    _setup(env)
    from celery import signals

    import django_setnx.contrib.celery  # noqa: F401 - connects its receivers

    _fail_an_acquire(url, server_pid, failed)
    signals.worker_process_shutdown.send(sender="worker", pid=os.getpid(), exitcode=0)
    os._exit(0)


def _fail_an_acquire(url, server_pid, failed):
    import signal

    from django_setnx.backends.redis import RedisBackend
    from django_setnx.exceptions import LockBackendError

    backend = RedisBackend(
        "exiting",
        {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": url,
            "KEY_PREFIX": "setnx-exit",
            "OPTIONS": {"CONNECTION_KWARGS": {"socket_timeout": 0.5}},
        },
    )
    assert backend.acquire("warm", "t", 30, {}).acquired  # a connection to the server
    assert backend.release("warm", "t")
    os.kill(server_pid, signal.SIGSTOP)
    try:
        backend.acquire("left-at-exit", "token-at-exit", 600, {})
    except LockBackendError:
        pass
    assert len(backend._undo_retries) == 1
    failed.set()


def fork_without_hooks():
    """fork(2) through libc, as uWSGI forks its workers by default: the
    ``os.register_at_fork`` hooks do not run in the child. Called through PyDLL,
    which keeps the GIL: through CDLL, which releases it for the call, another
    thread of this process (a listener) could take it at the instant of the fork,
    and the child would wait for it forever.

    The import lock and threading's registry lock are held across the call
    (``os.fork`` holds the first, and resets the second in the child): another
    thread of the test run (one ending, one importing) caught holding either at
    the fork would leave it held in the child, whose first import or ``Thread.start()`` would then hang now and then,
    whatever this library does. So are logging's module lock and its handlers'
    locks (``os.fork`` holds the first and renews the others in the child): a
    thread of the parent caught logging at the fork would leave the child's first
    log record waiting forever. The tests are about the library's own locks."""
    import _imp
    import ctypes
    import logging
    import threading

    _imp.acquire_lock()
    threading._active_limbo_lock.acquire()
    logging._lock.acquire()  # as logging's own at-fork hook; then the handlers'
    handlers = [ref() for ref in list(logging._handlerList)]
    handlers = [handler for handler in handlers if handler is not None and handler.lock]
    for handler in handlers:
        handler.acquire()
    try:
        pid = ctypes.PyDLL(None, use_errno=True).fork()
    finally:  # in both processes: the child's main thread is the thread that held them
        for handler in reversed(handlers):
            handler.release()
        logging._lock.release()
        threading._active_limbo_lock.release()
        _imp.release_lock()
    if pid == 0:
        # A child that hangs all the same (on a lock another thread of the parent held
        # at the fork) prints every thread's stack to stderr after 15 s, which pytest
        # shows with the failure, before the test's own limit (20 s and more) ends it;
        # one that crashes (CPython 3.13 with threads: its runtime was not reset after
        # this fork) prints them at once.
        import contextlib
        import faulthandler

        with contextlib.suppress(Exception):  # a stderr without a file descriptor
            faulthandler.enable()
            faulthandler.dump_traceback_later(15, exit=False)
        # Under coverage (patch = ["_exit"]), os._exit first saves the coverage data:
        # here, without coverage's fork handling, into the parent's data file through
        # the parent's SQLite connection, which SQLite says never to use across a fork
        # (a CI run hung in a child of this fork once). The child's exit is plain.
        import posix

        os._exit = posix._exit
    return pid


def reap(pid, seconds=60, clean=True):
    """Reap the forked child ``pid`` and return its wait status. A child still running
    after ``seconds`` hung: it is killed, and the test fails; with ``clean``, so does
    one that did not exit with status 0 (a crash, an alarm, an exit code)."""
    import pytest

    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child hung for {seconds} s")
        time.sleep(0.01)
    assert not clean or status == 0, f"the child ended with wait status {status}"
    return status


def run_scenario(env, module, function, args, reply):
    """Run ``module.function(*args)`` in this fresh process (Django set up against
    the parent's test servers) and send ``("ok", its result)`` or ``("error", the
    traceback)`` through ``reply`` (a Connection: a multiprocessing Queue would start
    a feeder thread). See tests.test_forks._in_a_fresh_process."""
    _setup(env)
    import importlib
    import traceback
    import warnings

    warnings.filterwarnings("error", category=RuntimeWarning)  # as the suite's settings
    try:
        result = getattr(importlib.import_module(module), function)(*args)
    except BaseException:  # noqa: BLE001 - pytest.fail raises a BaseException
        reply.send(("error", traceback.format_exc()))
    else:
        reply.send(("ok", result))


def orphaned_helper_of_a_worker(env, result):
    """Act as a gunicorn arbiter that is a subreaper (or PID 1 in a container):
    fork a "worker" that forks a helper and exits at once, so that the helper,
    orphaned, becomes this process' child; the helper then exits in order. Puts
    whether the hook takes the helper's exit for a worker's on ``result``."""
    _setup(env)
    import ctypes

    from django_setnx.contrib import gunicorn as hook

    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0
    pid_read, pid_write = os.pipe()  # worker -> arbiter: the helper's pid
    go_read, go_write = os.pipe()  # arbiter -> helper: its worker is gone
    worker = os.fork()
    if worker == 0:
        helper = os.fork()
        if helper == 0:
            os.read(go_read, 1)
            assert os.getppid() != worker  # orphaned: the arbiter's child now
            sys.exit(0)  # in order: its exit handlers run
        os.write(pid_write, str(helper).encode().rjust(16))
        os._exit(0)
    os.waitpid(worker, 0)
    helper = int(os.read(pid_read, 16))
    os.write(go_write, b"x")  # the worker is gone: the helper is ours now
    _, status = os.waitpid(helper, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the helper was not orphaned"
    result.put(hook.exited_in_order(helper))
