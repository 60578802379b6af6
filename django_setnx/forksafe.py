"""A mutex that a forked child never finds held by a thread it does not have.

A fork copies every lock in the state it is in, and only the forking thread goes
into the child: a lock that another thread held at that instant stays held in the
child for ever, and the child's first use of it hangs. ``os.register_at_fork``
hooks can replace such locks, but uWSGI forks its workers in C without running
them. A :class:`ForkSafeLock` is one lock per process id, so a child uses a lock of
its own, hook or not.
"""

from __future__ import annotations

import os
import threading
from typing import Any


class ForkSafeLock:
    """A mutex for ``with`` blocks: one ``threading.Lock`` per process id.

    Every thread of a process gets the same lock (``dict.setdefault`` is atomic),
    and a forked child a new one. A process keeps the locks of its ancestors, one
    per generation of forks. The thread that forks must not hold it: in the child,
    that thread would release the child's lock at the end of its block.
    """

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {os.getpid(): threading.Lock()}

    def _lock(self) -> threading.Lock:
        pid = os.getpid()
        lock = self._locks.get(pid)
        if lock is None:
            lock = self._locks.setdefault(pid, threading.Lock())
        return lock

    def __enter__(self) -> None:
        self._lock().acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self._locks[os.getpid()].release()
