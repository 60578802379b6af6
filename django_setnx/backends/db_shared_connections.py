"""The lock connections that async callers share (database backend).

A sync caller's statements run on a lock connection of its thread's own. An async
caller's run in a thread of the event loop's default executor, which has up to 32
threads: one connection per such thread would be up to 32 lock connections per
worker process, each counted against the server's ``max_connections``, for calls
that each take a millisecond. So the executor thread borrows one of a few
connections that every async caller of the process shares (``ASYNC_CONNECTIONS``),
for the length of one call (its statements, and a contention's retries), and gives
it back. The threads that renew ``auto_renew`` locks, one per lock, borrow them too,
but wait for one at most half the time their lock has left (renewals come every
third of the ttl, so at most a sixth of it, and never past OPERATION_TIMEOUT): a
renewal that finds them all busy that long (async calls stuck behind a row lock,
say) runs on a connection of its thread's own, opened for that call and closed
after it, so that its lock is never lost because of calls it has nothing to do with.

A call may wait up to ``OPERATION_TIMEOUT`` for a free connection, and then its
statements have their own ``OPERATION_TIMEOUT``.

The pool adds no thread. It is one per process (``forksafe.PerProcess``): a forked
child, with or without fork hooks, never waits on its parent's pool, whose
condition another thread of the parent may have held at the fork.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


class ConnectionState:
    """One lock connection and what goes with it: the Django wrapper (None until
    first used), when it was last used (for the idle health check), the statements
    it prepared (MariaDB), whether it calls django-setnx's functions and when it
    last looked for them (PostgreSQL, see db_functions), and whether SQLite's
    switch to WAL mode is still due."""

    __slots__ = (
        "shared",
        "wrapper",
        "used_at",
        "prepared_session",
        "functions",
        "functions_checked_at",
        "sqlite_wal_pending",
        "__weakref__",  # a thread's own is finalized with the thread (see database)
    )

    def __init__(self, shared: bool = False) -> None:
        #: Lent to one thread after another (Django's wrapper must be told so).
        self.shared = shared
        self.wrapper: Any = None
        self.used_at = 0.0
        self.prepared_session: Any = None
        self.functions: dict[str, str] | None = None
        self.functions_checked_at: float | None = None
        self.sqlite_wal_pending = False


class AllBusy(Exception):
    """Every shared connection stayed in use for the whole timeout."""


class SharedConnections:
    """At most ``size`` :class:`ConnectionState` objects, lent one call at a time.

    The most recently returned is lent first, so that under a light load the same
    one or two connections serve every call and the others stay unopened (or, once
    idle past ``HEALTH_CHECK_AFTER``, are checked before their next use)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[ConnectionState] = []
        self._made = 0
        self._condition = threading.Condition(threading.Lock())

    def take(self, timeout: float) -> ConnectionState:
        """A state to use until :meth:`give_back`; raises :class:`AllBusy` if none is
        free within ``timeout`` seconds (0: only one free now)."""
        deadline = time.monotonic() + timeout
        with self._condition:
            while not self._idle and self._made >= self.size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AllBusy
                self._condition.wait(remaining)
            if self._idle:
                return self._idle.pop()
            self._made += 1
            return ConnectionState(shared=True)

    def give_back(self, state: ConnectionState) -> None:
        with self._condition:
            self._idle.append(state)
            self._condition.notify()

    @contextlib.contextmanager
    def borrowed(self, timeout: float) -> Iterator[ConnectionState]:
        """:meth:`take` for the ``with`` block."""
        state = self.take(timeout)
        try:
            yield state
        finally:
            self.give_back(state)
