"""Waking the database backend's waiters: in-process wake-ups for every database,
and PostgreSQL's LISTEN/NOTIFY between processes.

A refused caller that will retry waits (``DatabaseBackend.wait`` and
``await_release``) on a :class:`Wakeups` entry for the lock's name, until a wake-up,
its next poll, the holder's expiry or its timeout:

- A release made in this process wakes one of this process' waiters for that name at
  once (:meth:`Wakeups.wake_one`: the one next in line, else the longest waiting), on
  every database.
- On PostgreSQL, a release that leaves the lock to a waiter next in line, or finds
  the lapsed place of one that died (and a waiter that gives up its place), also
  sends ``NOTIFY`` on the backend's channel,
  with the lock's name as the payload (and the token of the waiter the lock was left
  to, which alone is woken; otherwise one waiter per process is). One :class:`PostgresListener` per backend and
  process (a daemon thread with its own connection, started by the first waiter)
  ``LISTEN``\\ s and wakes one of that process' waiters for the name. The waiters then only
  poll slowly, as a safety net (``PG_SAFETY_POLL``).

A wake-up is only a hint: the waiter retries, and the database decides. Nothing is
lost if one goes missing (the poll catches up), and the wake-ups
:meth:`Wakeups.wake_one` keeps cover the window between a refused attempt and the wait
that follows it. A listener that
fails (the server dropped its connection, a restart) wakes every waiter of its
process, so that they look at once and poll until it is back.

After a fork the child starts with no waiters and no listener (the parent's thread
does not exist there, and its connection is never touched: see
``database._abandon_inherited``).
"""

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import threading
import time

from .aio import wait_at_most

logger = logging.getLogger("django_setnx")

#: A listener that failed is started again at most this often (seconds).
RESTART_AFTER = 1.0
#: How long the listener blocks for notifications before it looks whether it should
#: stop (seconds): the wait of ``close()``, never the delay of a wake-up. An idle
#: listener loops this often, with no statement sent.
LISTEN_BLOCK = 0.2
#: Wake-up times are remembered this long (seconds) for the waiters on their way; older ones
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
    __slots__ = ("event", "rank", "token", "woken")

    def __init__(self, rank, token):
        self.event = threading.Event()
        self.rank = rank
        self.token = token
        self.woken = False

    def wake(self):
        self.woken = True
        self.event.set()


class _TaskWaiter:
    __slots__ = ("loop", "future", "rank", "token", "woken")

    def __init__(self, rank, token):
        self.loop = asyncio.get_running_loop()
        self.future = self.loop.create_future()
        self.rank = rank
        self.token = token
        self.woken = False

    def wake(self):
        # From any thread (the listener's, or a releasing thread).
        self.woken = True
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
        self._all_woken = 0.0  # monotonic time of the last wake_all
        #: name -> monotonic time of a wake_one that found no waiter to wake: the
        #: next waiter of that name whose refused attempt began before it takes it.
        self._unclaimed = {}
        #: token -> whether a refused caller of this process holds it (set by the
        #: backend): a wake-up for a waiter that is not ours wakes one of ours.
        self.is_ours = lambda token: False
        #: name -> monotonic time of its last release (or change of the waiter next
        #: in line): the waiter next in line does not wait if one came after its
        #: refused attempt began, even if that wake-up went to another waiter (it
        #: took that place after the release, between its attempt and its wait).
        self._released = {}
        #: None: a stand-in (see wake_token) is woken at once. Else the seconds
        #: after which it is, unless a wake-up for that name comes first: set while
        #: a PostgresListener runs, whose thread wakes the stand-ins when due
        #: (:meth:`wake_due_stand_ins`).
        self.stand_in_after = None
        self._stand_ins_woken_by = None  # the listener that set stand_in_after
        # name -> monotonic time its stand-in is due, in that order (each is
        # now + stand_in_after, and a name is popped before it is added again): the
        # first is the next due, so waking them is O(1) each however many wait.
        self._stand_ins = {}

    def stand_ins_woken_by(self, listener, after):
        """``listener``'s thread wakes the stand-ins from now on, ``after`` seconds
        after their claims, unless a newer listener does already (an old one whose
        connect returned late, after close() gave up waiting for it)."""
        with self._lock:
            current = self._stand_ins_woken_by
            if current is None or listener.generation >= current.generation:
                self._stand_ins_woken_by, self.stand_in_after = listener, after

    def stand_ins_no_longer_woken_by(self, listener):
        """``listener`` stopped: if it was the one waking the stand-ins, they are
        woken at once again; returns whether it was (a listener that replaced it
        meanwhile keeps its own setting)."""
        with self._lock:
            if self._stand_ins_woken_by is not listener:
                return False
            self._stand_ins_woken_by = self.stand_in_after = None
            return True

    def wait(self, name, timeout, since, rank=(0,), token=None):
        """Block up to ``timeout`` seconds for a wake-up of ``name``; returns at once
        if one came after ``since`` (monotonic: when the caller's refused attempt
        started). ``rank`` orders the waiters for :meth:`wake_one` (lowest first);
        ``token`` is the caller's, for :meth:`wake_token`. A rank ``(0, ...)`` is the
        waiter next in line. Returns True if woken."""
        head = rank[0] == 0
        if self._woken_or_claim(name, since, token, head):
            return True
        waiter = _ThreadWaiter(rank, token)
        self._add(name, waiter)
        try:
            if self._woken_or_claim(name, since, token, head):  # between the check and _add
                return True
            return waiter.event.wait(timeout)
        finally:
            self._remove(name, waiter)

    async def await_wakeup(self, name, timeout, since, rank=(0,), token=None):
        """Async twin of :meth:`wait`: no thread is held while waiting."""
        head = rank[0] == 0
        if self._woken_or_claim(name, since, token, head):
            return True
        waiter = _TaskWaiter(rank, token)
        self._add(name, waiter)
        try:
            if self._woken_or_claim(name, since, token, head):
                return True
            return await wait_at_most(waiter.future, timeout)
        finally:
            self._remove(name, waiter)

    def has_waiters(self, name):
        return name in self._waiters

    def wake_one(self, name):
        """Wake the first waiter of ``name`` in this process (lowest rank: the one
        next in line, else the longest waiting) that is not woken yet. With none
        waiting, the wake-up is kept for the next one whose refused attempt began
        before it (it was on its way to wait).

        A release leaves the lock to one waiter, so one is woken, not all: each
        woken waiter sends a statement, and waking them all on every release made a
        handoff cost a statement per waiter. A waiter that does not take the lock
        when woken (it gave up, or lost it to another process) wakes the next one
        when it leaves, or the others' polls catch up. Returns whether a waiter
        was woken (False: none waits here now; the wake-up is kept).

        Any wake-up of a name also says that a claim on it was taken (the waiter it
        was left to took the lock and sent its NOTIFY, or it was released here): a
        stand-in due for it (see :meth:`wake_token`) is not needed any more."""
        now = time.monotonic()
        with self._lock:
            self._stand_ins.pop(name, None)
            self._released[name] = now
            self._prune_unclaimed(now)
            candidates = [w for w in self._waiters.get(name, ()) if not w.woken]
            if not candidates:
                self._unclaimed[name] = now
                return False
            waiter = min(candidates, key=lambda w: w.rank)
            waiter.woken = True  # before releasing the lock: no second wake_one picks it
        waiter.wake()
        return True

    def wake_token(self, name, token, stand_in=True):
        """Wake the waiter of ``name`` whose token is ``token`` (the one a release
        left the lock to), if it waits in this process; if it is on its way to wait,
        the wake-up is kept for it (see :meth:`wake_one`). If it is not ours, and
        ``stand_in``, one of ours stands in for it: it takes the lock if the other
        one died, which nobody else would notice before the next safety poll
        (waiters that poll anyway need no stand-in). It is woken once that waiter's
        claim has lapsed (``stand_in_after``), unless a wake-up for the name comes
        first: the other waiter taking the lock sends one (its NOTIFY, see
        ``acquire_queued``), so a live waiter costs the other processes nothing.
        Woken at once, it would only be refused, at two statements a process per
        handoff."""
        now = time.monotonic()
        with self._lock:
            self._stand_ins.pop(name, None)  # news of the name: the last claim was taken
            waiters = [w for w in self._waiters.get(name, ()) if w.token == token]
            if not waiters and stand_in and self.stand_in_after is not None:
                if not self.is_ours(token):
                    # Bounded: each goes stand_in_after later (the listener wakes it).
                    self._stand_ins[name] = now + self.stand_in_after
                    return
            if waiters or self.is_ours(token):
                self._released[name] = now
                self._prune_unclaimed(now)
                if not waiters:
                    self._unclaimed[(name, token)] = now
                    return
                for waiter in waiters:
                    waiter.woken = True
        if not waiters:
            if stand_in:
                self.wake_one(name)
            return
        for waiter in waiters:
            waiter.wake()

    def wake_due_stand_ins(self):
        """Wake the stand-ins that are due (see wake_token). Returns the seconds
        until the next one is, or None if none waits to be."""
        if not self._stand_ins:
            return None
        now = time.monotonic()
        due = []
        with self._lock:
            for name, at in self._stand_ins.items():  # in due order (see __init__)
                if at > now:
                    break
                due.append(name)
            for name in due:
                del self._stand_ins[name]
            upcoming = next(iter(self._stand_ins.values()), None)
        for name in due:
            self.wake_one(name)
        return None if upcoming is None else max(upcoming - now, 0.0)

    def wake_head(self, name, since=None):
        """Wake the waiter of ``name`` next in line, if it waits in this process (a
        release left it the lock without knowing its token: MySQL): the one that
        began waiting at ``since`` (ms, its ``rank[1]``) when given, which is exact
        where a waiter's belief that it is next in line may be out of date (a
        waiter that waited longer took the place over); else the one that believes
        it is. If it is on its way to wait, it sees the release and does not (see
        ``_released``). Nobody else is woken."""
        now = time.monotonic()
        with self._lock:
            self._released[name] = now
            self._prune_unclaimed(now)
            heads = [
                w
                for w in self._waiters.get(name, ())
                if not w.woken and (w.rank[0] == 0 if since is None else w.rank[1] == since)
            ]
            if not heads:
                return
            waiter = min(heads, key=lambda w: w.rank)
            waiter.woken = True
        waiter.wake()

    def _prune_unclaimed(self, now):
        if len(self._unclaimed) > WOKEN_KEEP:
            self._unclaimed = {n: t for n, t in self._unclaimed.items() if now - t < WOKEN_TTL}
        if len(self._released) > WOKEN_KEEP:
            self._released = {n: t for n, t in self._released.items() if now - t < WOKEN_TTL}

    def _woken_or_claim(self, name, since, token=None, head=False):
        if self._all_woken >= since:  # wake_all: the listener failed
            return True
        with self._lock:
            if head and self._released.get(name, 0.0) >= since:
                return True
            for key in (name, (name, token)):
                woken_at = self._unclaimed.get(key)
                if woken_at is not None and woken_at >= since:
                    del self._unclaimed[key]
                    return True
        return False

    def wake_all(self):
        """Wake every waiter (the listener failed: they must look, then poll)."""
        with self._lock:
            self._all_woken = time.monotonic()
            self._stand_ins.clear()  # every waiter looks now
            waiters = [w for group in self._waiters.values() for w in group]
        for waiter in waiters:
            waiter.wake()

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


#: Starts a NOTIFY payload that names the waiter the lock was left to:
#: ``RS token RS name`` (lock names cannot start with it in practice; a plain name is
#: a payload of an earlier version).
TOKEN_MARK = "\x1e"
#: Starts a local wake-up (db_local_wakeups) for the waiter next in line: ``GS since
#: GS name``, ``since`` (decimal ms) when it began waiting, which a MySQL release can
#: tell where it cannot tell its token; ``GS name`` (an earlier version): whichever
#: believes it is next in line.
HEAD_MARK = "\x1d"
#: Starts a local wake-up for one waiter of the process, whichever: ``US h name``,
#: ``h`` the number of times a process without a waiter may still pass it on.
PLAIN_MARK = "\x1f"


def deliver(wakeups, payload, stand_in=True):
    """Wake this process' waiter(s) for one NOTIFY (or local wake-up, see
    db_local_wakeups): the waiter a release left the lock to, if it is ours; else,
    with ``stand_in``, one waiter of ours (see :meth:`Wakeups.wake_token`). A plain
    name wakes one waiter per process (the lock goes to one); ``HEAD_MARK``, the
    waiter next in line only (see HEAD_MARK). Returns False for a ``PLAIN_MARK`` wake-up
    that found no waiter here (see db_local_wakeups: it is passed on)."""
    if payload.startswith(TOKEN_MARK):
        token, _, name = payload[1:].partition(TOKEN_MARK)
        wakeups.wake_token(name, token, stand_in)
    elif payload.startswith(HEAD_MARK):
        since, mark, name = payload[1:].partition(HEAD_MARK)
        if mark and since.isascii() and since.isdigit():
            wakeups.wake_head(name, int(since))
        else:
            wakeups.wake_head(payload[1:])
    elif payload.startswith(PLAIN_MARK):
        return wakeups.wake_one(payload[2:])
    else:
        wakeups.wake_one(payload)  # also cancels a stand-in: the claim was taken


_GENERATIONS = itertools.count()


class PostgresListener:
    """``LISTEN`` on ``channel`` over a connection of its own, in a daemon thread,
    waking ``wakeups`` for each notified name.

    ``connect()`` returns a new psycopg 3 connection in autocommit mode (the
    backend builds it like its lock connections). :meth:`ensure_running` starts the
    thread and waits until the ``LISTEN`` is in place; ``ready_at`` is the monotonic
    time it was, so that a waiter refused before that knows it may have missed a
    notification.
    """

    def __init__(self, alias, channel, wakeups, connect, stand_in_after=None):
        self.alias = alias
        self.channel = channel
        self.wakeups = wakeups
        self.connect = connect
        self.stand_in_after = stand_in_after  # see Wakeups.stand_in_after
        self.generation = next(_GENERATIONS)  # a later listener has a larger one
        self.pid = os.getpid()
        self.ready_at = None
        self.failed_at = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = None
        self._connection = None
        self._closed = False

    def ensure_running(self, timeout):
        """Start the listener unless it runs; returns True once it listens, False if
        it cannot now (it failed less than RESTART_AFTER ago, or did not start within
        ``timeout``): the waiters then poll."""
        if self._ready.is_set() and self._thread is not None and self._thread.is_alive():
            return True
        with self._lock:
            if self._closed:
                return False  # a waiter that took it before close(): it polls once
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

    def close(self, wait=True):
        """Stop listening: the thread ends within LISTEN_BLOCK and closes its
        connection itself, which this waits for (from another thread) unless
        ``wait`` is False. Closed from here while the thread waits on it or runs a
        statement, psycopg would free a connection in use and crash the process."""
        with self._lock:  # a thread made under it is started under it
            self._closed = True
            self._stop.set()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(LISTEN_BLOCK + 1)

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
            self.wakeups.stand_ins_woken_by(self, self.stand_in_after)
            self._ready.set()
            while not self._stop.is_set():
                # One notification at a time, so that the stand-ins (see
                # Wakeups.wake_token) are woken when due, not a LISTEN_BLOCK later.
                due = self.wakeups.wake_due_stand_ins()
                timeout = LISTEN_BLOCK if due is None else min(due, LISTEN_BLOCK)
                for notify in connection.notifies(timeout=timeout, stop_after=1):
                    deliver(self.wakeups, notify.payload)
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
            # Nobody would wake them: at once again, unless a newer listener does.
            still_ours = self.wakeups.stand_ins_no_longer_woken_by(self)
            self._ready.set()  # nobody waits for a start that failed
            if self._connection is connection:
                self._connection = None
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()
            if still_ours:
                self.wakeups.wake_all()
