"""The :class:`Lock` object: acquire, wait, release, extend and auto-renew one named lock.

Backends only know atomic single steps; this module turns them into the familiar
lock API, identical for every backend:

- a random secret token per acquire, so release and extend are compare-and-act;
- waiting with a timeout (woken by a release where the backend can, otherwise a
  jittered backoff that never sleeps far past the holder's expiry);
- ``auto_renew`` in a background thread that marks the lock lost if it cannot keep it.
"""

import logging
import os
import secrets
import socket
import threading
import time

from asgiref.sync import sync_to_async

from . import signals
from .conf import DEFAULT_LOCK_ALIAS
from .exceptions import LockBackendError, LockError, LockNotAcquired, LockNotOwned
from .handler import locks
from .validation import validate_name, validate_timeout, validate_ttl

logger = logging.getLogger("django_setnx")

_UNSET = object()
_MARK_LOST_GUARD = threading.Lock()
_HOSTNAME = None


def _hostname():
    global _HOSTNAME
    if _HOSTNAME is None:
        _HOSTNAME = socket.gethostname()
    return _HOSTNAME


def current_owner(guards=None):
    """The owner record written with each acquire: who holds the lock, and what for."""
    thread = threading.current_thread()
    owner = {"host": _hostname(), "pid": os.getpid(), "thread": f"{thread.name} ({thread.ident})"}
    if guards:
        owner["guards"] = guards
    return owner


class Lock:
    """One named lock in one backend. Creating it does nothing; :meth:`acquire` does.

    A Lock object holds at most one acquisition at a time and is meant to be used
    by one thread (or task) at a time, like ``threading.Lock`` held across a block.
    """

    def __init__(self, name, ttl=None, *, backend=DEFAULT_LOCK_ALIAS, timeout=None,
                 blocking=True, auto_renew=False, guards=None):
        self.name = validate_name(name)
        self.backend_alias = backend
        # Resolving the alias now makes an unknown alias fail here, before any write.
        self.backend = locks[backend]
        self.ttl = self.backend.default_ttl if ttl is None else validate_ttl(ttl)
        self.timeout = validate_timeout(timeout)
        self.blocking = bool(blocking)
        self.auto_renew = bool(auto_renew)
        if guards is not None and not isinstance(guards, str):
            raise TypeError(f"guards must be a str describing what the lock protects, got {guards!r}.")
        self.guards = guards
        self.fencing_token = None
        self.lost = False
        self._token = None
        self._renewer = None

    def __repr__(self):
        state = "lost" if self.lost else ("acquired" if self._token else "unlocked")
        return f"<Lock {self.name!r} backend={self.backend_alias!r} ttl={self.ttl:g} {state}>"

    # -- acquire ------------------------------------------------------------------

    def _prepare_acquire(self, blocking, timeout):
        if self._token is not None and not self.lost:
            raise LockError(
                f"Lock {self.name!r} is already acquired by this Lock object; release it "
                f"first (locks are not reentrant)."
            )
        blocking = self.blocking if blocking is None else bool(blocking)
        timeout = self.timeout if timeout is _UNSET else validate_timeout(timeout)
        if self.lost:  # re-acquiring after a loss: the old renewal must not linger
            self._stop_renewer()
            self._token = None
        if not blocking:
            timeout = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        return secrets.token_hex(16), current_owner(self.guards), deadline

    def _acquired(self, token, result):
        self._token = token
        self.fencing_token = result.fencing_token
        self.lost = False
        if self.auto_renew:
            self._renewer = _Renewer(self)
            self._renewer.start()
        logger.debug("Acquired lock %r (fencing token %s)", self.name, self.fencing_token)
        signals.lock_acquired.send(sender=Lock, lock=self)

    def _contended(self, result, already_signalled):
        if not already_signalled:
            logger.debug("Lock %r is contended (retry after %s s)", self.name, result.retry_after)
            signals.lock_contended.send(sender=Lock, lock=self, retry_after=result.retry_after)

    def acquire(self, blocking=None, timeout=_UNSET):
        """Acquire the lock, waiting up to ``timeout`` seconds (``None``: forever).

        ``blocking=False`` is ``timeout=0``. Without arguments the values given to
        :func:`lock` apply. Returns True when acquired, False on timeout or
        non-blocking contention. Raises LockBackendError if the backend is down.
        """
        token, owner, deadline = self._prepare_acquire(blocking, timeout)
        attempt = 0
        max_wait = _remaining(deadline)
        queued = False  # a refused caller that will retry is queued by the backend
        try:
            while True:
                result = self.backend.acquire(self.name, token, self.ttl, owner, max_wait)
                if result.acquired:
                    break
                queued = max_wait != 0
                self._contended(result, attempt > 0)
                max_wait = _remaining(deadline)
                if max_wait is not None and max_wait <= 0:
                    result = self._stop_waiting(token) if queued else None
                    if result is None:
                        return False
                    break  # handed to us just before we gave up: ours after all
                result = self.backend.wait(self.name, token=token, attempt=attempt,
                                           max_wait=max_wait, retry_after=result.retry_after)
                if result is not None:  # a release handed the lock to us
                    break
                attempt += 1
        except BaseException:
            if queued:  # interrupted while queued: leave nothing held or queued behind
                self._abandon(token)
            raise
        self._acquired(token, result)
        return True

    async def aacquire(self, blocking=None, timeout=_UNSET):
        """Async twin of :meth:`acquire`; waiting does not block the event loop."""
        token, owner, deadline = self._prepare_acquire(blocking, timeout)
        attempt = 0
        max_wait = _remaining(deadline)
        queued = False
        try:
            while True:
                result = await self.backend.aacquire(self.name, token, self.ttl, owner, max_wait)
                if result.acquired:
                    break
                queued = max_wait != 0
                self._contended(result, attempt > 0)
                max_wait = _remaining(deadline)
                if max_wait is not None and max_wait <= 0:
                    result = await self._astop_waiting(token) if queued else None
                    if result is None:
                        return False
                    break
                result = await self.backend.await_release(
                    self.name, token=token, attempt=attempt, max_wait=max_wait,
                    retry_after=result.retry_after)
                if result is not None:
                    break
                attempt += 1
        except BaseException:  # includes asyncio.CancelledError
            if queued:
                await sync_to_async(self._abandon, thread_sensitive=False)(token)
            raise
        self._acquired(token, result)
        return True

    def _stop_waiting(self, token):
        """Leave the backend's queue; returns the AcquireResult if the lock was handed
        to us meanwhile. A failure here only delays others (our place lapses)."""
        try:
            return self.backend.stop_waiting(self.name, token)
        except LockBackendError:
            logger.warning("Could not withdraw from the waiters of %r", self.name, exc_info=True)
            return None

    async def _astop_waiting(self, token):
        try:
            return await self.backend.astop_waiting(self.name, token)
        except LockBackendError:
            logger.warning("Could not withdraw from the waiters of %r", self.name, exc_info=True)
            return None

    def _abandon(self, token):
        """After an error or interruption while queued: withdraw, and release a lock
        handed to us that the caller will never know it holds."""
        try:
            if self._stop_waiting(token) is not None:
                self.backend.release(self.name, token)
        except Exception:  # noqa: BLE001 - the error in flight is the one to report
            logger.warning("Could not give up the lock handed to %r", self.name, exc_info=True)

    # -- release ------------------------------------------------------------------

    def _check_held_by_us(self, action):
        if self._token is None:
            raise LockNotOwned(self.name, f"Cannot {action} lock {self.name!r}: it is not acquired.")
        if self.lost:
            self._token = None
            raise LockNotOwned(
                self.name,
                f"Cannot {action} lock {self.name!r}: it was lost (expired and taken over, "
                f"or not renewed in time).",
            )

    def _stop_renewer(self):
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()

    def _released(self, released):
        self._token = None
        if not released:
            self.lost = True
            raise LockNotOwned(
                self.name,
                f"Lock {self.name!r} expired and was taken over by another owner before "
                f"release; the new holder keeps it.",
            )
        logger.debug("Released lock %r", self.name)
        signals.lock_released.send(sender=Lock, lock=self)

    def release(self):
        """Release the lock. Raises LockNotOwned if this object no longer holds it."""
        self._check_held_by_us("release")
        self._stop_renewer()
        self._released(self.backend.release(self.name, self._token))

    async def arelease(self):
        """Async twin of :meth:`release`."""
        self._check_held_by_us("release")
        self._stop_renewer()
        self._released(await self.backend.arelease(self.name, self._token))

    # -- extend -------------------------------------------------------------------

    def _extend_ttl(self, ttl):
        return self.ttl if ttl is None else validate_ttl(ttl)

    def _extended(self, extended):
        if not extended:
            self._mark_lost()
            raise LockNotOwned(
                self.name, f"Cannot extend lock {self.name!r}: it expired and was taken over."
            )

    def extend(self, ttl=None):
        """Set the expiry to now + ``ttl`` (default: the lock's ttl), by the backend's
        clock. Raises LockNotOwned if the lock was lost."""
        self._check_held_by_us("extend")
        ttl = self._extend_ttl(ttl)
        self._extended(self.backend.extend(self.name, self._token, ttl))

    async def aextend(self, ttl=None):
        """Async twin of :meth:`extend`."""
        self._check_held_by_us("extend")
        ttl = self._extend_ttl(ttl)
        self._extended(await self.backend.aextend(self.name, self._token, ttl))

    def _mark_lost(self):
        # The renewer thread and the owner's own extend() can both find the lock gone;
        # the check-and-set is guarded so lock_lost is sent exactly once.
        with _MARK_LOST_GUARD:
            if self.lost:
                return
            self.lost = True
        logger.warning("Lock %r was lost (fencing token %s)", self.name, self.fencing_token)
        signals.lock_lost.send(sender=Lock, lock=self)

    # -- inspection ---------------------------------------------------------------

    def locked(self):
        """Return True if anyone holds the lock now (a stale record does not count)."""
        info = self.backend.get(self.name)
        return info is not None and info.is_held

    def owned(self):
        """Return True if this Lock object holds the lock now (checked with the backend)."""
        if self._token is None or self.lost:
            return False
        return self.backend.owns(self.name, self._token)

    def info(self):
        """Return the backend's :class:`~django_setnx.backends.base.LockInfo`, or None."""
        return self.backend.get(self.name)

    async def alocked(self):
        info = await self.backend.aget(self.name)
        return info is not None and info.is_held

    async def aowned(self):
        if self._token is None or self.lost:
            return False
        return await self.backend.aowns(self.name, self._token)

    async def ainfo(self):
        return await self.backend.aget(self.name)

    # -- context managers ---------------------------------------------------------

    def __enter__(self):
        if not self.acquire():
            raise LockNotAcquired(self.name, self.timeout if self.blocking else 0)
        return self

    def __exit__(self, exc_type, exc, tb):
        self._exit_release(self.release, exc)

    async def __aenter__(self):
        if not await self.aacquire():
            raise LockNotAcquired(self.name, self.timeout if self.blocking else 0)
        return self

    async def __aexit__(self, exc_type, exc, tb):
        if exc is None:
            await self.arelease()
            return
        try:
            await self.arelease()
        except (LockNotOwned, LockBackendError):
            logger.warning("Could not release lock %r while handling %r", self.name, exc,
                           exc_info=True)

    def _exit_release(self, release, exc):
        # A lost lock is news the caller must hear (its critical section was not
        # exclusive), but never at the price of masking the exception in flight.
        if exc is None:
            release()
            return
        try:
            release()
        except (LockNotOwned, LockBackendError):
            logger.warning("Could not release lock %r while handling %r", self.name, exc,
                           exc_info=True)


def _remaining(deadline):
    """Seconds left until ``deadline`` (a monotonic time), or None for no deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class _Renewer(threading.Thread):
    """Extends a held lock every ttl/3 until stopped; marks it lost if it cannot."""

    def __init__(self, lock):
        super().__init__(name=f"django-setnx renew {lock.name[:40]}", daemon=True)
        self.lock = lock
        self.token = lock._token
        self.interval = lock.ttl / 3
        self._stop_event = threading.Event()

    def stop(self):
        self._stop_event.set()
        if threading.current_thread() is not self:
            # Wait for an extend in flight, so it cannot race the release that follows.
            self.join(timeout=self.lock.ttl)

    def run(self):
        lk = self.lock
        last_renewed = time.monotonic()
        while not self._stop_event.wait(self.interval):
            try:
                renewed = lk.backend.extend(lk.name, self.token, lk.ttl)
            except LockBackendError:
                logger.warning("Could not renew lock %r", lk.name, exc_info=True)
                if time.monotonic() - last_renewed >= lk.ttl:
                    lk._mark_lost()
                    return
                continue
            if self._stop_event.is_set():
                return
            if not renewed:
                lk._mark_lost()
                return
            last_renewed = time.monotonic()


def lock(name, ttl=None, *, backend=DEFAULT_LOCK_ALIAS, timeout=None, blocking=True,
         auto_renew=False, guards=None):
    """Return a :class:`Lock` for ``name`` in ``backend``; nothing is written yet.

    ``ttl`` (seconds) defaults to the backend's ``TTL`` setting (60 s). ``timeout``
    and ``blocking`` are the defaults of :meth:`Lock.acquire` and of ``with``.
    ``guards`` describes what the lock protects, for the admin and ``listlocks``.
    Raises TypeError/ValueError for a bad name, ttl or timeout and
    ImproperlyConfigured (InvalidLockBackendError) for an unknown alias.
    """
    return Lock(name, ttl, backend=backend, timeout=timeout, blocking=blocking,
                auto_renew=auto_renew, guards=guards)
