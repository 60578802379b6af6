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
import weakref
from typing import Any

#: Every ForkSafeLock, for the at-fork hook.
_ALL: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


class ForkSafeLock:
    """A mutex for ``with`` blocks: one ``threading.Lock`` per process id.

    Every thread of a process gets the same lock (``dict.setdefault`` is atomic),
    and a forked child a new one: at the fork (an at-fork hook), or at its first
    use when no hook ran. That first use also drops the parent's lock, so that a
    later process given the parent's pid again does not find it. The thread that
    forks must not hold it: in the child, that thread would release the child's
    lock at the end of its block.
    """

    __slots__ = ("_locks", "__weakref__")

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {os.getpid(): threading.Lock()}
        _ALL.add(self)

    def _lock(self) -> threading.Lock:
        pid = os.getpid()
        lock = self._locks.get(pid)
        if lock is None:
            locks = self._locks
            lock = locks.setdefault(pid, threading.Lock())
            for other in list(locks):  # list(): a copy taken at once, under the GIL
                if other != pid:  # an ancestor's
                    locks.pop(other, None)
        return lock

    def _renew(self) -> None:
        self._locks = {os.getpid(): threading.Lock()}

    def __enter__(self) -> None:
        self._lock().acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self._locks[os.getpid()].release()


def _renew_all() -> None:
    for fork_safe in list(_ALL):
        fork_safe._renew()


os.register_at_fork(after_in_child=_renew_all)
