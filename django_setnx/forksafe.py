"""Locks that a forked child never finds held by a thread it does not have.

A fork copies every lock in the state it is in, and only the forking thread goes
into the child: a lock that another thread held at that instant stays held in the
child for ever, and the child's first use of it hangs. ``os.register_at_fork``
hooks can replace such locks, but uWSGI forks its workers in C without running
them. A :class:`PerProcess` lock (:class:`ForkSafeLock`, or a condition) is one
per process id, so a child uses one of its own, hook or not.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Every PerProcess object, for the at-fork hook.
_ALL: weakref.WeakSet[PerProcess[Any]] = weakref.WeakSet()


class PerProcess(Generic[T]):
    """One ``factory()`` object (a lock, a condition) per process id.

    Every thread of a process gets the same one (``dict.setdefault`` is atomic),
    and a forked child a new one: at the fork (an at-fork hook), or at its first
    use when no hook ran. That first use also drops the parent's, so that a later
    process given the parent's pid again does not find it. The thread that forks
    must not hold it: in the child, that thread would release the child's at the
    end of its block.
    """

    __slots__ = ("_factory", "_objects", "__weakref__")

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._objects: dict[int, T] = {os.getpid(): factory()}
        _ALL.add(self)

    def get(self) -> T:
        """This process' object."""
        pid = os.getpid()
        found = self._objects.get(pid)
        if found is None:
            objects = self._objects
            found = objects.setdefault(pid, self._factory())
            for other in list(objects):  # list(): a copy taken at once, under the GIL
                if other != pid:  # an ancestor's
                    objects.pop(other, None)
        return found

    def _renew(self) -> None:
        self._objects = {os.getpid(): self._factory()}


class ForkSafeLock(PerProcess[threading.Lock]):
    """A mutex for ``with`` blocks: one ``threading.Lock`` per process id (see
    :class:`PerProcess`)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(threading.Lock)

    def __enter__(self) -> None:
        self.get().acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self._objects[os.getpid()].release()


def _renew_all() -> None:
    for per_process in list(_ALL):
        per_process._renew()


os.register_at_fork(after_in_child=_renew_all)
