"""Releasing a lock only once the caller's database transaction is over.

A lock that guards a read-modify-write must stay held until the write is visible to
the next holder. Inside ``transaction.atomic()`` (or a view under
``ATOMIC_REQUESTS``) the write only becomes visible at COMMIT, which comes *after*
the guarded block returns: releasing at the end of the block would let the next
holder read the old value and overwrite the first holder's write.

:func:`release_after_commit` therefore hands the release to Django's
``transaction.on_commit`` when a transaction is open on one of the databases that
count (the ``using`` aliases, ``"default"`` unless told otherwise):

- after every one of them has committed, the lock is released;
- if one of them rolls back (the outermost block, or the savepoint the release was
  registered in), the lock is released at once: nothing was written that the next
  holder could miss.

Django has no hook for a rollback. What it does on one is drop the ``on_commit``
callbacks registered inside the rolled-back block, so each callback we register is
also watched with :func:`weakref.finalize`: a callback that is dropped unrun is a
rollback. CPython frees a dropped callback at once; elsewhere the lock is freed when
the garbage collector gets to it, and its ttl remains the bound.

Outside any transaction (autocommit) nothing is deferred. Nor is it with
``AUTOCOMMIT: False``, even inside ``atomic()``: Django's atomic blocks then commit
nothing, your ``commit()`` is what commits, and Django runs no ``on_commit``
callback after it (only when autocommit is switched back on), so a deferred release
would wait for the ttl. The lock is released when the guarded call returns: commit
before it returns if the next holder must see what it wrote.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, transaction

from .exceptions import LockBackendError, LockError

if TYPE_CHECKING:
    from .locking import Lock

logger = logging.getLogger("django_setnx")


def database_aliases(using: str | Sequence[str] | None) -> tuple[str, ...]:
    """``using`` (None, an alias or a sequence of aliases) as a tuple of aliases.

    Unknown aliases are an ImproperlyConfigured naming them; the check runs when
    the lock or decorator is created, not at release time.
    """
    if using is None:
        return (DEFAULT_DB_ALIAS,)
    aliases = (using,) if isinstance(using, str) else tuple(using)
    if not aliases or not all(isinstance(alias, str) for alias in aliases):
        raise ImproperlyConfigured(
            f"using must be a database alias or a sequence of aliases, got {using!r}."
        )
    unknown = [alias for alias in aliases if alias not in connections.settings]
    if unknown:
        raise ImproperlyConfigured(
            f"using names {', '.join(map(repr, unknown))}, which DATABASES does not define "
            f"(defined: {', '.join(map(repr, connections.settings)) or 'none'})."
        )
    return aliases


def open_transactions(aliases: Iterable[str]) -> list[str]:
    """The aliases among ``aliases`` whose connection in this thread is inside an
    ``atomic`` block that commits when it ends (reading the flags opens no
    connection). An outermost block entered with autocommit off (``AUTOCOMMIT:
    False``) does not commit (``commit_on_exit`` is False): its ``on_commit``
    callbacks would never run."""
    return [
        alias
        for alias in aliases
        if connections[alias].in_atomic_block and connections[alias].commit_on_exit
    ]


#: Per thread: Lock.identity -> the _DeferredRelease waiting for COMMIT.
_pending = threading.local()


def _pending_releases():
    try:
        return _pending.by_key
    except AttributeError:
        _pending.by_key = {}
        return _pending.by_key


def deferred_lock(lock: Lock) -> Lock | None:
    """The Lock this thread still holds under ``lock``'s backend and name, waiting to
    release it after COMMIT, or None.

    A second guarded call with the same name in the same transaction runs under that
    lock instead of waiting for it (which would wait for itself until the ttl); the
    pending release covers both. Its expiry still counts from the first acquisition
    (extending it would be a write, and on SQLite a write waits for the caller's own
    open transaction): give the lock a ttl, or ``auto_renew``, that covers the
    transaction.
    """
    deferred = _pending_releases().get(lock.identity)
    if deferred is None or deferred.done:
        return None
    try:
        return deferred.lock if deferred.lock.owned() else None
    except LockError:
        return None


def release_after_commit(lock: Lock, aliases: Iterable[str]) -> bool:
    """Defer ``lock.release()`` until the open transactions on ``aliases`` end.

    Returns True if the release was deferred (a transaction is open), False if the
    caller must release now. A deferred release that finds the lock lost, or the
    backend down, logs a warning (with ``lock_lost`` sent) instead of raising from
    inside Django's commit.
    """
    pending = open_transactions(aliases)
    if not pending:
        return False
    _DeferredRelease(lock, pending)
    return True


class _DeferredRelease:
    """Releases one lock once each of ``aliases`` has committed, or at the first
    rollback. One :class:`_CommitHook` per alias is given to ``on_commit``."""

    def __init__(self, lock, aliases):
        self.lock = lock
        self.waiting = set(aliases)
        self.done = False
        self._guard = threading.Lock()
        self._key = lock.identity
        self._registry = _pending_releases()
        self._registry[self._key] = self
        for alias in aliases:
            hook = _CommitHook(self, alias)
            # The finalizer holds no reference to the hook: when Django drops the
            # hook (a rollback), it runs; after the hook has run, it does nothing.
            weakref.finalize(hook, self.dropped, alias)
            transaction.on_commit(hook, using=alias)

    def committed(self, alias):
        with self._guard:
            self.waiting.discard(alias)
            if self.waiting or self.done:
                return
            self.done = True
        self._release("commit")

    def dropped(self, alias):
        with self._guard:
            if alias not in self.waiting or self.done:
                return  # it ran (committed), or the lock is already released
            self.done = True
        if connections[alias].in_atomic_block and self.lock.backend.writes_wait_for_transaction(
            alias
        ):
            # A savepoint rolled back inside a transaction that goes on, and the lock
            # backend cannot write before that transaction ends (SQLite, the same
            # database: one writer at a time). Release when the outer one ends.
            if self._registry.get(self._key) is self:
                del self._registry[self._key]
            _DeferredRelease(self.lock, [alias])
            return
        self._release("rollback")

    def _release(self, why):
        if self._registry.get(self._key) is self:
            del self._registry[self._key]
        lock = self.lock
        if lock.lost and lock._token is not None:
            # Reported lost when its block ended (Lock.release_at_exit): only
            # what may be left of it is freed, quietly.
            lock._release_lost()
            lock._token = None
            return
        try:
            lock.release()
        except LockError as exc:
            if isinstance(exc, LockBackendError):
                # Whether it is still held is unknown: to its holder, it is lost.
                lock._mark_lost()
            logger.warning(
                "Could not release lock %r after the transaction's %s",
                lock.name,
                why,
                exc_info=True,
            )
        else:
            logger.debug("Released lock %r after the transaction's %s", lock.name, why)


class _CommitHook:
    __slots__ = ("owner", "alias", "__weakref__")

    def __init__(self, owner, alias):
        self.owner = owner
        self.alias = alias

    def __call__(self):
        self.owner.committed(self.alias)
