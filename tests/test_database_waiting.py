"""Waiting on the database backend: bounded statements behind a long hold, wake-ups
on PostgreSQL (LISTEN/NOTIFY) from other processes, a dead waiter next in line
costing a claim, a listener the server dropped, and async waits without threads.
Real servers and real processes (spawn, SIGKILL)."""

import asyncio
import errno
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import types

import pytest
from django.conf import settings
from django.db import connections

from django_setnx import lock, locks
from django_setnx.backends import database, db_local_wakeups
from tests import workers
from tests.backend_sql import run_sql

DB_ALIASES = [a for a in ("default", "postgres", "mysql") if a in settings.CONTRACT_ALIASES]
PG = [a for a in DB_ALIASES if a == "postgres"]
LOCAL = [a for a in DB_ALIASES if a != "postgres"]  # woken by db_local_wakeups

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


class _StatementCounter:
    """Counts every statement a backend sends from now on, on any of its lock
    connections, and every health check and (re)connection as one more: not the
    server's global count, which other clients of the same server would inflate."""

    def __init__(self, backend, monkeypatch):
        self.count = 0
        self._lock = threading.Lock()
        make_cursor = backend._cursor
        monkeypatch.setattr(backend, "_cursor", lambda raw: self._Cursor(make_cursor(raw), self))
        for owner, attr in ((database, "_usable"), (backend, "_connect")):
            monkeypatch.setattr(owner, attr, self._counted(getattr(owner, attr)))

    def _counted(self, function):
        def counted(*args, **kwargs):
            self.add()
            return function(*args, **kwargs)

        return counted

    def add(self):
        with self._lock:
            self.count += 1

    class _Cursor:
        def __init__(self, cursor, counter):
            self._cursor, self._counter = cursor, counter

        def execute(self, *args, **kwargs):
            self._counter.add()
            return self._cursor.execute(*args, **kwargs)

        def __getattr__(self, attr):
            return getattr(self._cursor, attr)


@pytest.mark.parametrize("backend_alias", DB_ALIASES)
def test_a_waiter_behind_a_long_hold_sends_few_statements(backend_alias, name, monkeypatch):
    """Three waiters behind a holder with 60 s left, for 4 s: on PostgreSQL about one
    statement a second each (woken by NOTIFY, else a slow safety poll); on MySQL and
    SQLite at most 20 (a poll that backs off to HEAD_POLL_MAX)."""
    counter = _StatementCounter(locks[backend_alias], monkeypatch)
    holder = lock(name, ttl=60, backend=backend_alias)
    assert holder.acquire(blocking=False)
    stop = time.monotonic() + 8

    def wait():
        lk = lock(name, ttl=30, backend=backend_alias)
        assert not lk.acquire(timeout=max(stop - time.monotonic(), 0.1))

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)  # past the first, fast retries
    before, started = counter.count, time.monotonic()
    time.sleep(4)
    per_waiter_per_s = (counter.count - before) / (time.monotonic() - started) / 3
    for thread in threads:
        thread.join()
    holder.release()
    assert per_waiter_per_s > 0, "the count saw no statement: it counts nothing"
    limit = 1.0 if backend_alias == "postgres" else 20
    assert per_waiter_per_s <= limit, per_waiter_per_s


@pytest.mark.parametrize("backend_alias", PG)
def test_a_release_in_another_process_wakes_a_postgres_waiter_at_once(
    backend_alias, name, spawn, monkeypatch
):
    """The waiter polls only every 30 s here (PG_SAFETY_POLL): it gets the lock
    within a second of another process' release only because NOTIFY woke it."""
    monkeypatch.setattr(database, "PG_SAFETY_POLL", 30.0)
    backend = locks[backend_alias]
    holder = lock(name, ttl=60, backend=backend_alias)
    assert holder.acquire(blocking=False)
    release_at = time.time() + 2.0
    child = spawn(
        workers.release_at,
        workers.child_environment(),
        backend_alias,
        name,
        holder._token,
        release_at,
    )
    waiter = lock(name, ttl=30, backend=backend_alias)
    assert waiter.acquire(timeout=20)
    got_it = time.time()
    child.join(20)
    assert child.exitcode == 0
    assert got_it - release_at < 1.0, got_it - release_at
    assert backend._listener is not None and backend._listener.ready_at is not None
    waiter.release()


@pytest.mark.parametrize("backend_alias", LOCAL)
def test_a_release_in_another_process_of_this_host_wakes_a_waiter_at_once(
    backend_alias, name, spawn, monkeypatch
):
    """SQLite and MySQL cannot notify, but a process of this host that leaves the lock
    to our waiter sends it a datagram (db_local_wakeups). The waiter polls only every
    30 s here: it gets the lock well within a second of the release only because it
    was woken."""
    monkeypatch.setattr(database, "HEAD_POLL", 30.0)
    monkeypatch.setattr(database, "HEAD_POLL_MAX", 30.0)
    backend = locks[backend_alias]
    holder = lock(name, ttl=60, backend=backend_alias)
    assert holder.acquire(blocking=False)
    ready = spawn.ctx.Event()
    released_at = spawn.ctx.Value("d", 0.0)
    child = spawn(
        workers.release_when_told,
        workers.child_environment(),
        backend_alias,
        name,
        holder._token,
        ready,
        0.4,  # the waiter is next in line by then, and its place is fresh
        released_at,
    )
    assert ready.wait(60), "the child did not start"
    waiter = lock(name, ttl=30, backend=backend_alias)
    assert waiter.acquire(timeout=20)
    got_it = time.time()
    child.join(20)
    assert child.exitcode == 0
    assert got_it - released_at.value < 0.5, got_it - released_at.value
    assert backend._local_listener is not None and backend._local_listener.path is not None
    waiter.release()


@pytest.mark.parametrize("backend_alias", PG)
def test_a_lock_handed_on_again_wakes_the_next_waiter_in_another_process(
    backend_alias, name, spawn
):
    """The single statement a lock handed over before is released with (see
    test_database_backend) sends the NOTIFY too: the waiter in another process, which
    polls only every 30 s, has the lock within a second."""
    backend = locks[backend_alias]
    first = lock(name, ttl=60, backend=backend_alias)
    assert first.acquire(blocking=False)
    second = lock(name, ttl=60, backend=backend_alias)
    threading.Timer(0.3, first.release).start()
    assert second.acquire(timeout=10)  # handed over in this process...
    assert name in backend._handed_over  # ...so the next release is the single statement
    child, answer = _slow_polling_waiter(spawn, backend_alias, name)
    time.sleep(0.5)  # its refused attempt has queued it next in line
    released_at = time.time()
    second.release()
    _assert_woken_within_a_second(child, answer, released_at)


def _slow_polling_waiter(spawn, backend_alias, name):
    """A waiter for ``name`` in another process that polls only every 30 s; returns
    it, once it was refused, and the queue it reports its acquisition time on."""
    queued, answer = spawn.ctx.Event(), spawn.ctx.Queue()
    child = spawn(
        workers.wait_and_report,
        workers.child_environment(),
        backend_alias,
        name,
        30.0,
        queued,
        answer,
    )
    assert queued.wait(30)
    return child, answer


def _assert_woken_within_a_second(child, answer, released_at):
    _assert_woken_within(child, answer, released_at, 1.0)


def _assert_woken_within(child, answer, released_at, seconds):
    got_it = answer.get(timeout=40)
    child.join(20)
    assert child.exitcode == 0
    assert got_it - released_at < seconds, got_it - released_at


@pytest.mark.parametrize("backend_alias", DB_ALIASES)
def test_a_killed_waiter_next_in_line_costs_the_others_a_claim(backend_alias, name, spawn):
    """A waiter next in line (ttl 30 s) is SIGKILLed; the holder releases (to it):
    a live waiter behind it holds the lock within about CLAIM_MS, not after the
    dead one's place lapses (8 s on PostgreSQL) or its ttl."""
    holder = lock(name, ttl=60, backend=backend_alias)
    assert holder.acquire(blocking=False)
    ready = spawn.ctx.Event()
    child = spawn(workers.queue_and_hang, workers.child_environment(), backend_alias, name, ready)
    assert ready.wait(30)
    time.sleep(1.0)  # queued, next in line
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    got = []
    live = lock(name, ttl=30, backend=backend_alias)
    thread = threading.Thread(
        target=lambda: got.append((live.acquire(timeout=20), time.monotonic()))
    )
    thread.start()
    time.sleep(0.5)  # the live one waits behind the dead one
    released_at = time.monotonic()
    holder.release()
    thread.join(30)
    ((acquired, at),) = got
    assert acquired
    assert at - released_at < 1.5, at - released_at
    live.release()


@pytest.mark.parametrize("backend_alias", DB_ALIASES)
def test_a_waiter_killed_with_the_holder_costs_the_others_a_claim_after_the_expiry(
    backend_alias, name, spawn
):
    """Review r122: the holder (ttl 2 s) and the waiter next in line are SIGKILLed
    together (an OOM kill, a host taking both down). On PostgreSQL the dead waiter's
    place outlived the expiry until PG_NEXT_LAPSE_MS (8 s) after its last renewal,
    and everyone was refused meanwhile; it now lapses CLAIM_MS after the expiry (on
    the other databases NEXT_LAPSE_MS after its last attempt, as before)."""
    acquired = spawn.ctx.Event()
    holder = spawn(
        workers.crash_holder, workers.child_environment(), backend_alias, name, 2, acquired
    )
    assert acquired.wait(30)
    info = locks[backend_alias].get(name)
    expires_at = time.monotonic() + (info.expires_at_ms - info.now_ms) / 1000
    ready = spawn.ctx.Event()
    waiter = spawn(workers.queue_and_hang, workers.child_environment(), backend_alias, name, ready)
    assert ready.wait(30)
    _queued(backend_alias, name)
    os.kill(waiter.pid, signal.SIGKILL)
    os.kill(holder.pid, signal.SIGKILL)
    waiter.join()
    holder.join()
    live = lock(name, ttl=30, backend=backend_alias)
    assert live.acquire(timeout=20)
    took = time.monotonic() - expires_at
    assert took < 1.5, took
    live.release()


@pytest.mark.parametrize("backend_alias", PG)
def test_a_release_past_a_dead_waiters_lapsed_place_wakes_the_others(backend_alias, name, spawn):
    """The waiter next in line was SIGKILLed and its place has lapsed; a live waiter
    in another process waits behind it, polling only every 30 s (PG_SAFETY_POLL).
    The release finds the lapsed place and NOTIFYs the plain name: the live waiter
    has the lock at once, not at its next poll, nor when a stand-in for the dead one
    would be woken (STAND_IN_AFTER: the lock is free to anyone, there is no claim)."""
    holder = lock(name, ttl=60, backend=backend_alias)
    assert holder.acquire(blocking=False)
    ready = spawn.ctx.Event()
    dead = spawn(workers.queue_and_hang, workers.child_environment(), backend_alias, name, ready)
    assert ready.wait(30)
    dead_token = _queued(backend_alias, name)
    os.kill(dead.pid, signal.SIGKILL)
    dead.join()
    live, answer = _slow_polling_waiter(spawn, backend_alias, name)
    time.sleep(0.5)  # refused: the dead one's place was live, so it waits behind it
    assert _next_in_line(backend_alias, name) == dead_token
    _lapse_next_in_line(backend_alias, name)  # as if PG_NEXT_LAPSE_MS had passed
    released_at = time.time()
    holder.release()
    _assert_woken_within(live, answer, released_at, database.STAND_IN_AFTER)


def _queued(backend_alias, name):
    """The token of the waiter next in line for ``name``, once one is (10 s at most)."""
    deadline = time.monotonic() + 10
    while not (_next_in_line(backend_alias, name) or time.monotonic() > deadline):
        time.sleep(0.01)
    token = _next_in_line(backend_alias, name)
    assert token, "no waiter queued"
    return token


def _next_in_line(backend_alias, name):
    row = run_sql(backend_alias, "SELECT next_token FROM {table} WHERE name = {p}", (name,))
    return row and row[0]


def _lapse_next_in_line(backend_alias, name):
    run_sql(backend_alias, "UPDATE {table} SET next_seen = 1 WHERE name = {p}", (name,))


@pytest.mark.parametrize("backend_alias", PG)
def test_a_listener_closed_while_a_new_one_starts_leaves_the_new_one_in_charge(
    backend_alias, name
):
    """close() lets the old LISTEN thread end while a waiter starts a new listener:
    the old thread's cleanup leaves the new one's stand-in timing alone (it reset
    it, so every stand-in was woken at once, a statement per handoff)."""
    backend = locks[backend_alias]
    with lock(name, ttl=5, backend=backend_alias):
        pass
    for _ in range(5):
        backend.close()
        assert backend._listener_ready()
        old = backend._listener
        closing = threading.Thread(target=backend.close)
        closing.start()
        while backend._listener is old:
            time.sleep(0.0005)
        assert backend._listener_ready()  # a waiter, while the old thread ends
        closing.join()
        new = backend._listener
        assert new is not old and new._thread.is_alive() and new.ready_at is not None
        assert backend._wakeups.stand_in_after == database.STAND_IN_AFTER
    backend.close()


@pytest.mark.parametrize("backend_alias", PG)
def test_a_listener_that_connects_after_its_replacement_leaves_it_in_charge(
    backend_alias, name, monkeypatch
):
    """A listener still connecting when close() gave up waiting for it (a slow
    server), then a new one started by a waiter: the old one's connect returns
    last, and it must not take the stand-in timing over from the new one."""
    backend = locks[backend_alias]
    with lock(name, ttl=5, backend=backend_alias):
        pass
    backend.close()
    connect, gate = database._listen_connection, threading.Event()

    def slow_connect(*args):
        gate.wait(10)
        return connect(*args)

    monkeypatch.setattr(database, "_listen_connection", slow_connect)
    threading.Thread(target=backend._listener_ready, daemon=True).start()
    started_by = time.monotonic() + 10
    while backend._listener is None or backend._listener._thread is None:
        assert time.monotonic() < started_by
        time.sleep(0.001)
    old = backend._listener
    backend.close()  # gives up waiting for the thread stuck connecting
    monkeypatch.setattr(database, "_listen_connection", connect)
    assert backend._listener_ready()
    gate.set()
    old._thread.join(10)
    assert not old._thread.is_alive()
    assert backend._listener._thread.is_alive()
    assert backend._wakeups.stand_in_after == database.STAND_IN_AFTER
    backend.close()


@pytest.mark.parametrize("backend_alias", PG)
def test_a_listener_the_server_dropped_never_strands_its_waiters(backend_alias, name, monkeypatch):
    """pg_terminate_backend on the LISTEN connection: the waiters are woken, poll
    until it is back, and get the lock when it is released."""
    monkeypatch.setattr(database, "PG_SAFETY_POLL", 30.0)
    backend = locks[backend_alias]
    holder = lock(name, ttl=60, backend=backend_alias)
    assert holder.acquire(blocking=False)
    got = []
    waiter = lock(name, ttl=30, backend=backend_alias)
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=20)))
    thread.start()
    deadline = time.monotonic() + 10
    while backend._listener is None or backend._listener.ready_at is None:
        assert time.monotonic() < deadline, "no listener started"
        time.sleep(0.05)
    database_alias = settings.SETNX_LOCKS[backend_alias]["OPTIONS"]["DATABASE"]
    with connections[database_alias].cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN%%'"
        )
        assert cursor.fetchall(), "the LISTEN session was not found"
    time.sleep(1.5)
    released_at = time.monotonic()
    holder.release()
    thread.join(25)
    assert got == [True]
    assert time.monotonic() - released_at < 5
    waiter.release()


def _wait_in_forked_child(backend_alias, name, result):
    from django_setnx import lock as child_lock

    lk = child_lock(name, ttl=30, backend=backend_alias)
    result.put(lk.acquire(timeout=20))
    lk.release()


class _NoThreads(threading.Thread):
    def start(self):
        raise RuntimeError("can't start new thread")


@pytest.mark.parametrize("backend_alias", LOCAL)
@pytest.mark.parametrize("shortage", ["file descriptors", "threads"])
def test_a_wakeup_channel_that_cannot_start_never_fails_a_lock(
    backend_alias, name, monkeypatch, shortage, caplog
):
    """Out of file descriptors or threads, the listener cannot start: the waiters
    poll, the acquire works as ever, and the shortage is logged once."""
    if shortage == "file descriptors":

        def no_descriptor(*args, **kwargs):
            raise OSError(errno.EMFILE, "Too many open files")

        fake = types.SimpleNamespace(**{**vars(socket), "socket": no_descriptor})
        monkeypatch.setattr(db_local_wakeups, "socket", fake)
    else:
        fake = types.SimpleNamespace(**{**vars(threading), "Thread": _NoThreads})
        monkeypatch.setattr(db_local_wakeups, "threading", fake)
    backend = locks[backend_alias]
    backend.close()  # its listener starts again, under the shortage
    holder = lock(name, ttl=30, backend=backend_alias)
    assert holder.acquire(blocking=False)
    with caplog.at_level(logging.WARNING, logger="django_setnx"):
        for _ in range(2):
            assert lock(name, ttl=30, backend=backend_alias).acquire(timeout=0.3) is False
    assert caplog.text.count("no wake-ups from other processes for now") == 1, caplog.text
    holder.release()
    waiter = lock(name, ttl=30, backend=backend_alias)
    assert waiter.acquire(timeout=5)
    waiter.release()
    backend.close()


def _wait_in_forked_child_and_time_it(backend_alias, name, result):
    from django_setnx import lock as child_lock

    lk = child_lock(name, ttl=30, backend=backend_alias)
    acquired = lk.acquire(timeout=20)
    result.put((acquired, time.time()))
    lk.release()


@pytest.mark.parametrize("backend_alias", LOCAL)
def test_a_forked_child_binds_its_own_wakeup_socket(backend_alias, name, monkeypatch):
    """The parent listens for wake-ups from this host's other processes; a forked
    child that waits binds a socket of its own (it never reads or removes the
    parent's) and is woken through it by the parent's release, while the parent's
    socket stays in place."""
    monkeypatch.setattr(database, "HEAD_POLL", 30.0)
    monkeypatch.setattr(database, "HEAD_POLL_MAX", 30.0)
    backend = locks[backend_alias]
    backend.get(name)  # connected: the channel is known from the first connection
    backend._listen_locally()
    parent_socket = backend._local_listener.path
    assert parent_socket is not None and os.path.exists(parent_socket)
    holder = lock(name, ttl=30, backend=backend_alias)
    assert holder.acquire(blocking=False)
    ctx = multiprocessing.get_context("fork")
    result = ctx.Queue()
    child = ctx.Process(
        target=_wait_in_forked_child_and_time_it, args=(backend_alias, name, result)
    )
    child.start()
    time.sleep(0.5)  # the child is next in line, its place fresh (it lapses after 1 s)
    holder.release()
    released_at = time.time()
    acquired, got_it = result.get(timeout=25)
    child.join(10)
    assert acquired is True
    assert got_it - released_at < 0.5, got_it - released_at
    assert backend._local_listener.path == parent_socket and os.path.exists(parent_socket)
    directory = os.path.dirname(parent_socket)
    [child_socket] = [s for s in os.listdir(directory) if s.startswith(f"{child.pid}-")]
    # The child ended without removing it (os._exit: no atexit): the next sender
    # finds that it refuses, and removes it.
    backend._wake_locally(name)
    assert child_socket not in os.listdir(directory)
    assert os.path.exists(parent_socket)


@pytest.mark.parametrize("backend_alias", PG)
def test_a_forked_child_listens_on_its_own_connection(backend_alias, name, monkeypatch):
    """The parent's listener runs; a forked child waits on a lock the parent then
    releases: the child is woken by its own listener (the parent's thread does not
    exist in it, and its connection is never used), and the parent's keeps working."""
    monkeypatch.setattr(database, "PG_SAFETY_POLL", 30.0)
    backend = locks[backend_alias]
    first = lock(name, ttl=30, backend=backend_alias)
    assert first.acquire(blocking=False)
    waiter = lock(name, ttl=30, backend=backend_alias)
    waiter_thread = threading.Thread(target=lambda: waiter.acquire(timeout=20))
    waiter_thread.start()
    while backend._listener is None or backend._listener.ready_at is None:
        time.sleep(0.05)
    first.release()
    waiter_thread.join(10)
    assert waiter.fencing_token is not None  # the parent's listener woke it
    ctx = multiprocessing.get_context("fork")
    result = ctx.Queue()
    child = ctx.Process(target=_wait_in_forked_child, args=(backend_alias, name, result))
    child.start()
    time.sleep(1.5)  # the child queued behind the parent's hold
    released_at = time.monotonic()
    waiter.release()
    assert result.get(timeout=20) is True
    assert time.monotonic() - released_at < 2.0
    child.join(10)
    assert child.exitcode == 0
    # The parent's listener still works.
    again = lock(name, ttl=30, backend=backend_alias)
    assert again.acquire(timeout=5)
    again.release()


async def _waiters_behind_a_holder(backend_alias, name, count, hold=0.0):
    """Take ``name``, then start ``count`` tasks that each wait for it (60 s), hold it
    ``hold`` seconds and release it. Returns (holder, tasks, the indexes that won)."""
    holder = lock(name, ttl=60, backend=backend_alias)
    assert await holder.aacquire(blocking=False)
    got = []

    async def waiter(i):
        lk = lock(name, ttl=30, backend=backend_alias)
        assert await lk.aacquire(timeout=60)
        got.append(i)
        if hold:
            await asyncio.sleep(hold)
        await lk.arelease()

    return holder, [asyncio.create_task(waiter(i)) for i in range(count)], got


@pytest.mark.parametrize("backend_alias", LOCAL)
def test_waiters_behind_one_of_their_process_next_in_line_do_not_poll(
    backend_alias, name, monkeypatch
):
    """Review r127: without wake-ups from the server, every waiter polled (up to 20
    statements a second each), so 300 coroutines on MariaDB sent about 215
    statements an acquisition through the process' few shared connections, and
    every other async lock call waited behind them. A waiter behind one of its own
    process that is next in line waits for it instead (LOCAL_HEAD_POLL at most):
    50 of them cost about what one does."""
    counter = _StatementCounter(locks[backend_alias], monkeypatch)

    async def main():
        holder, tasks, got = await _waiters_behind_a_holder(backend_alias, name, 50)
        await asyncio.sleep(1.5)  # past the first attempts and the fast retries
        before, started = counter.count, time.monotonic()
        await asyncio.sleep(3)
        per_s = (counter.count - before) / (time.monotonic() - started)
        await holder.arelease()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert sorted(got) == list(range(50))
        return per_s

    per_s = asyncio.run(main())
    assert per_s > 0, "the count saw no statement: it counts nothing"
    # One waiter polling: at most about 20 a second; 49 more at 2 s each: ~75 more.
    # (Polling, the 50 sent about 600 a second.)
    assert per_s <= 150, per_s


@pytest.mark.parametrize("backend_alias", LOCAL)
def test_a_waiter_woken_to_take_its_turn_that_leaves_instead_wakes_the_next(
    backend_alias, name, monkeypatch
):
    """Review r130: the head of this process' waiters (A) leaves and wakes the next
    (B), which is cancelled before it acts on the wake-up. B, not next in line,
    woke nobody when it left, so C, waiting for A, slept on until A's place would
    have lapsed, with the lock possibly free. B now passes the wake-up on."""
    backend = locks[backend_alias]
    wake_ups = []
    wake_one = backend._wakeups.wake_one

    def recorded(lock_name):
        woke = wake_one(lock_name)
        wake_ups.append(woke)
        return woke

    monkeypatch.setattr(backend._wakeups, "wake_one", recorded)

    async def until(condition, what):
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0)

    def waiting_on_wakeups(token):
        return [w for w in backend._wakeups._waiters.get(name, ()) if w.token == token]

    async def main():
        holder = lock(name, ttl=30, backend=backend_alias)
        assert await holder.aacquire()
        tasks, tokens, waiters = [], [], []
        for what in "ABC":
            waiters.append(lock(name, ttl=30, backend=backend_alias))
            tasks.append(asyncio.create_task(waiters[-1].aacquire(timeout=30)))
            await until(lambda: len(backend._waiting) == len(tasks), f"{what} never queued")
            tokens.append(list(backend._waiting)[-1])
            await until(lambda: waiting_on_wakeups(tokens[-1]), f"{what} never waited")
        a, b, c = tasks
        await until(lambda: backend._waiting[tokens[0]].head, "A is not next in line")
        await until(lambda: waiting_on_wakeups(tokens[2]), "C is not waiting")
        a.cancel()  # A leaves the line: it wakes B
        await until(
            lambda: any(w.woken for w in waiting_on_wakeups(tokens[1])), "A's leaving woke nobody"
        )
        woken_before = len(wake_ups)
        b.cancel()  # before B acts on its wake-up
        for task in (a, b):
            with pytest.raises(asyncio.CancelledError):
                await task
        # B passes the wake-up on: to C, or, if C is between a poll and its next
        # wait (a slow machine), kept for C (wake_one returns False then).
        assert wake_ups[woken_before:], "B left without passing its wake-up on"
        await holder.arelease()
        assert await asyncio.wait_for(c, 30)
        await waiters[2].arelease()

    asyncio.run(main())


@pytest.mark.parametrize("backend_alias", PG)
def test_postgres_followers_of_a_stuck_local_head_find_the_lock_it_left_free(backend_alias, name):
    """Review r131: with the PostgreSQL listener up, a waiter whose safety poll
    (PG_SAFETY_POLL, 3.5 s) ran out went back to waiting while a waiter of its
    process ahead of it in line had renewed its place in the last PG_NEXT_LAPSE_MS
    (8 s), even if that one could not act (its event loop blocked): the lock that a
    release left to it sat free until then. A follower's safety poll finds it."""
    holder = lock(name, ttl=30, backend=backend_alias)
    assert holder.acquire()
    queued, unblocked = threading.Event(), threading.Event()

    def stuck_head():
        async def main():
            head = lock(name, ttl=30, backend=backend_alias)
            attempt = asyncio.create_task(head.aacquire(timeout=60))
            await asyncio.sleep(0.6)  # queued first: the place next in line
            queued.set()
            time.sleep(6.0)  # the loop blocked: it can take nothing
            unblocked.set()
            if await attempt:
                await head.arelease()

        asyncio.run(main())

    def follow():
        follower = lock(name, ttl=30, backend=backend_alias)
        if follower.acquire(timeout=60):
            seen.append(unblocked.is_set())
            follower.release()

    seen = []
    head_thread = threading.Thread(target=stuck_head)
    head_thread.start()
    try:
        assert queued.wait(10)
        followed = threading.Thread(target=follow)
        followed.start()
        time.sleep(0.6)
        holder.release()  # left to the head, whose claim lapses unconfirmed
        followed.join(60)
        assert seen, "the follower never got the lock"
        # Its safety poll (3.5 s at most) and the head's claim (0.5 s) end well
        # before the head's loop runs again (6 s).
        assert seen == [False], "the lock left free was taken only once the head woke"
    finally:
        head_thread.join(60)


@pytest.mark.parametrize("backend_alias", DB_ALIASES)
def test_async_waiters_hold_no_thread_while_they_wait(backend_alias, name):
    """200 coroutines wait on a held lock: the threads in use stay those of the
    executor (statements only) and, on PostgreSQL, the listener; each gets the lock."""

    async def main():
        baseline = threading.active_count()
        holder, tasks, got = await _waiters_behind_a_holder(backend_alias, name, 200)
        await asyncio.sleep(3)
        # asyncio's default executor has at most min(32, cpus + 4) threads; a thread
        # per waiter would be 200.
        assert threading.active_count() <= baseline + min(32, (os.cpu_count() or 1) + 4) + 1
        await holder.arelease()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert sorted(got) == list(range(200))

    asyncio.run(main())


def test_an_async_acquire_cancelled_mid_statement_leaves_no_lock(db_alias, name):
    """The statement runs in a thread that a cancellation does not stop: a lock it
    wins for a caller that is gone is released, not held until its ttl."""

    async def main():
        cancelled = 0
        for i in range(30):
            lk = lock(f"{name}:{i}", ttl=60, backend=db_alias)
            attempt = asyncio.ensure_future(lk.aacquire())
            await asyncio.sleep(0.001 * (i % 5))
            attempt.cancel()
            try:
                if await attempt:  # done before the cancellation: ours, release it
                    await lk.arelease()
            except asyncio.CancelledError:
                cancelled += 1
        assert cancelled, "no acquire was cancelled: the test proves nothing"
        deadline = time.monotonic() + 5
        held = list(range(30))
        while held and time.monotonic() < deadline:
            held = [i for i in held if await lock(f"{name}:{i}", backend=db_alias).alocked()]
            await asyncio.sleep(0.05)
        return held

    assert asyncio.run(main()) == [], "locks left held by cancelled acquires"


@pytest.mark.parametrize("backend_alias", DB_ALIASES)
def test_a_release_wakes_one_waiter_not_all(backend_alias, name, monkeypatch):
    """50 coroutines pass one lock around: a release leaves it to one waiter and
    wakes that one, so an acquisition costs a few attempts, not one per waiter
    (waking them all made the statements grow with the square of the waiters)."""
    backend = locks[backend_alias]
    attempts = []
    acquire = type(backend).acquire

    def counted(self, *args, **kwargs):
        attempts.append(1)
        return acquire(self, *args, **kwargs)

    monkeypatch.setattr(type(backend), "acquire", counted)

    async def main():
        holder, tasks, got = await _waiters_behind_a_holder(backend_alias, name, 50, hold=0.001)
        await asyncio.sleep(1.5)  # every waiter queued or waiting
        attempts.clear()
        await holder.arelease()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return got

    assert sorted(asyncio.run(main())) == list(range(50))
    per_acquisition = len(attempts) / 50
    assert per_acquisition < 10, per_acquisition


@pytest.mark.parametrize("backend_alias", PG)
def test_an_async_acquire_cancelled_while_refused_leaves_no_place_in_line(backend_alias, name):
    """The cancelled acquire's statement, held up by a row lock, is refused after the
    cancellation and queues its caller next in line: that place is withdrawn, so the
    next release goes to a live waiter at once, not to the cancelled one."""
    import psycopg

    backend = locks[backend_alias]
    database = connections[settings.SETNX_LOCKS[backend_alias]["OPTIONS"]["DATABASE"]]
    params = database.get_connection_params()

    async def main():
        holder = lock(name, ttl=30, backend=backend_alias)
        assert await holder.aacquire(blocking=False)
        blocker = psycopg.connect(**params, autocommit=False)
        blocker.execute("SELECT 1 FROM django_setnx_lock WHERE name = %s FOR UPDATE", [name])
        victim = asyncio.ensure_future(
            lock(name, ttl=30, backend=backend_alias).aacquire(timeout=20)
        )
        await asyncio.sleep(0.3)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        blocker.commit()
        blocker.close()
        await asyncio.sleep(0.3)  # the refused statement has queued, then withdrawn
        assert backend._waiting == {}
        live = lock(name, ttl=30, backend=backend_alias)
        waiting = asyncio.ensure_future(live.aacquire(timeout=20))
        await asyncio.sleep(0.5)
        released_at = time.monotonic()
        await holder.arelease()
        assert await waiting
        took = time.monotonic() - released_at
        await live.arelease()
        return took

    assert asyncio.run(main()) < 1.0


@pytest.mark.parametrize("backend_alias", DB_ALIASES)
def test_an_async_acquire_cancelled_as_its_loop_ends_leaves_no_lock(backend_alias, name):
    """``asyncio.run`` per job: the loop ends right after the acquire starts and
    cancels it (every task, even a shielded one) while its statement runs in a
    thread; the thread undoes what it won, though the loop is gone."""

    def run_once(i):
        async def job():
            asyncio.ensure_future(lock(f"{name}:{i}", ttl=60, backend=backend_alias).aacquire())
            await asyncio.sleep(0)

        asyncio.run(job())

    for i in range(20):
        run_once(i)
    deadline = time.monotonic() + 5
    held = list(range(20))
    while held and time.monotonic() < deadline:
        held = [i for i in held if lock(f"{name}:{i}", backend=backend_alias).locked()]
        time.sleep(0.05)
    assert held == [], "locks left held by acquires cancelled at the loop's end"
    assert locks[backend_alias]._waiting == {}
