"""Waking the database backend's waiters: in-process wake-ups for every database,
and PostgreSQL's LISTEN/NOTIFY between processes.

A refused caller that will retry waits (``DatabaseBackend.wait`` and
``await_release``) on a :class:`Wakeups` entry for the lock's name, until a wake-up,
its next poll, the holder's expiry or its timeout:

- A release made in this process wakes this process' waiters for that name at once
  (:meth:`Wakeups.wake`), on every database.
- On PostgreSQL, a release that leaves the lock to a waiter next in line (and a
  waiter that gives up its place) also sends ``NOTIFY`` on the backend's channel,
  with the lock's name as the payload. One :class:`PostgresListener` per backend and
  process (a daemon thread with its own connection, started by the first waiter)
  ``LISTEN``\\ s and wakes that process' waiters for the name. The waiters then only
  poll slowly, as a safety net (``PG_SAFETY_POLL``).

A wake-up is only a hint: the waiter retries, and the database decides. Nothing is
lost if one goes missing (the poll catches up), and :meth:`Wakeups.woken_since` covers
the window between a refused attempt and the wait that follows it. A listener that
fails (the server dropped its connection, a restart) wakes every waiter of its
process, so that they look at once and poll until it is back.

After a fork the child starts with no waiters and no listener (the parent's thread
does not exist there, and its connection is never touched: see
``database._abandon_inherited``).
"""

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
import time

logger = logging.getLogger("django_setnx")

#: A listener that failed is started again at most this often (seconds).
RESTART_AFTER = 1.0
#: How long the listener blocks for notifications before it looks whether it should
#: stop (seconds): the delay of ``close()``, never of a wake-up.
LISTEN_BLOCK = 1.0
#: Wake-up times are remembered this long (seconds) for ``woken_since``; older ones
#: are dropped once there are more than WOKEN_KEEP of them.
WOKEN_TTL = 10.0
WOKEN_KEEP = 10_000


def channel_name(database_name, table):
    """The NOTIFY channel of a lock table in a database: distinct per database and
    table, so that projects sharing a server never wake each other, and a plain
    identifier (no quoting needed) well under PostgreSQL's 63 characters."""
    digest = hashlib.sha1(f"{database_name}\0{table}".encode()).hexdigest()[:20]
    return f"django_setnx_{digest}"


class _ThreadWaiter:
    __slots__ = ("event",)

    def __init__(self):
        self.event = threading.Event()

    def wake(self):
        self.event.set()


class _TaskWaiter:
    __slots__ = ("loop", "future")

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.future = self.loop.create_future()

    def wake(self):
        # From any thread (the listener's, or a releasing thread).
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self.loop.call_soon_threadsafe(_resolve, self.future)


def _resolve(future):
    if not future.done():
        future.set_result(None)


class Wakeups:
    """The waiting callers of one backend in this process, by lock name."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiters = {}  # name -> set of _ThreadWaiter / _TaskWaiter
        self._woken = {}  # name -> monotonic time of its last wake-up
        self._all_woken = 0.0  # monotonic time of the last wake_all

    def wait(self, name, timeout, since):
        """Block up to ``timeout`` seconds for a wake-up of ``name``; returns at once
        if one came after ``since`` (monotonic: when the caller's refused attempt
        started). Returns True if woken."""
        if self.woken_since(name, since):
            return True
        waiter = _ThreadWaiter()
        self._add(name, waiter)
        try:
            if self.woken_since(name, since):  # between the check and _add
                return True
            return waiter.event.wait(timeout)
        finally:
            self._remove(name, waiter)

    async def await_wakeup(self, name, timeout, since):
        """Async twin of :meth:`wait`: no thread is held while waiting."""
        if self.woken_since(name, since):
            return True
        waiter = _TaskWaiter()
        self._add(name, waiter)
        try:
            if self.woken_since(name, since):
                return True
            try:
                await asyncio.wait_for(waiter.future, timeout)
            except asyncio.TimeoutError:
                return False
            return True
        finally:
            self._remove(name, waiter)

    def has_waiters(self, name):
        return name in self._waiters

    def wake(self, name):
        """Wake every waiter of ``name`` in this process."""
        now = time.monotonic()
        with self._lock:
            self._woken[name] = now
            if len(self._woken) > WOKEN_KEEP:
                self._woken = {n: t for n, t in self._woken.items() if now - t < WOKEN_TTL}
            waiters = list(self._waiters.get(name, ()))
        for waiter in waiters:
            waiter.wake()

    def wake_all(self):
        """Wake every waiter (the listener failed: they must look, then poll)."""
        with self._lock:
            self._all_woken = time.monotonic()
            waiters = [w for group in self._waiters.values() for w in group]
        for waiter in waiters:
            waiter.wake()

    def woken_since(self, name, since):
        return self._woken.get(name, 0.0) >= since or self._all_woken >= since

    def _add(self, name, waiter):
        with self._lock:
            self._waiters.setdefault(name, set()).add(waiter)

    def _remove(self, name, waiter):
        with self._lock:
            group = self._waiters.get(name)
            if group is not None:
                group.discard(waiter)
                if not group:
                    del self._waiters[name]


class PostgresListener:
    """``LISTEN`` on ``channel`` over a connection of its own, in a daemon thread,
    waking ``wakeups`` for each notified name.

    ``connect()`` returns a new psycopg 3 connection in autocommit mode (the
    backend builds it like its lock connections). :meth:`ensure_running` starts the
    thread and waits until the ``LISTEN`` is in place; ``ready_at`` is the monotonic
    time it was, so that a waiter refused before that knows it may have missed a
    notification.
    """

    def __init__(self, alias, channel, wakeups, connect):
        self.alias = alias
        self.channel = channel
        self.wakeups = wakeups
        self.connect = connect
        self.pid = os.getpid()
        self.ready_at = None
        self.failed_at = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = None
        self._connection = None

    def ensure_running(self, timeout):
        """Start the listener unless it runs; returns True once it listens, False if
        it cannot now (it failed less than RESTART_AFTER ago, or did not start within
        ``timeout``): the waiters then poll."""
        if self._ready.is_set() and self._thread is not None and self._thread.is_alive():
            return True
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                thread = self._thread
            else:
                if (
                    self.failed_at is not None
                    and time.monotonic() - self.failed_at < RESTART_AFTER
                ):
                    return False
                self._ready.clear()
                self._stop.clear()
                thread = self._thread = threading.Thread(
                    target=self._run, name=f"django-setnx listener {self.alias}", daemon=True
                )
                thread.start()
        return self._ready.wait(timeout) and thread.is_alive()

    def close(self):
        """Stop listening (the thread ends within LISTEN_BLOCK) and close the
        connection."""
        self._stop.set()
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()

    def abandon(self, abandon_connection):
        """In a forked child: never use the parent's connection (``abandon_connection``
        makes it harmless); the parent's thread does not exist here."""
        connection, self._connection = self._connection, None
        if connection is not None:
            abandon_connection(connection)

    def _run(self):
        connection = None
        try:
            connection = self._connection = self.connect()
            connection.execute(f"LISTEN {self.channel}")
            self.ready_at = time.monotonic()
            self._ready.set()
            while not self._stop.is_set():
                for notify in connection.notifies(timeout=LISTEN_BLOCK):
                    self.wakeups.wake(notify.payload)
        except Exception as exc:  # noqa: BLE001 - any failure: the waiters poll
            if not self._stop.is_set():
                self.failed_at = time.monotonic()
                logger.warning(
                    "Lock backend %r: the LISTEN connection failed (%s: %s); waiters "
                    "poll until it is back",
                    self.alias,
                    type(exc).__name__,
                    exc,
                )
        finally:
            self.ready_at = None
            self._ready.set()  # nobody waits for a start that failed
            if self._connection is connection:
                self._connection = None
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()
            self.wakeups.wake_all()
