"""The :class:`Lock` object: acquire, wait, release, extend and auto-renew one named lock.

Backends only know atomic single steps; this module turns them into the familiar
lock API, identical for every backend:

- a random secret token per acquire, so release and extend are compare-and-act;
- waiting with a timeout (woken by a release where the backend can, otherwise a
  jittered backoff that never sleeps far past the holder's expiry);
- ``auto_renew`` in a background thread that marks the lock lost if it cannot keep it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import Any

from . import signals
from .backends.aio import completed_call, undo, was_undone
from .backends.base import PLAIN_JSON_TYPES, AcquireResult, LockInfo, OwnerRecord
from .conf import DEFAULT_LOCK_ALIAS
from .exceptions import LockBackendError, LockError, LockNotAcquired, LockNotOwned
from .forksafe import ForkSafeLock, PerProcess
from .handler import locks
from .transactions import (
    database_aliases,
    deferred_lock,
    open_transactions,
    release_after_commit,
)
from .validation import validate_name, validate_timeout, validate_token, validate_ttl

logger = logging.getLogger("django_setnx")

_UNSET = object()
_MARK_LOST_GUARD = ForkSafeLock()
_HOSTNAME = None
_UNKNOWN = object()
_PID_NAMESPACE: object = _UNKNOWN


def _hostname() -> str:
    global _HOSTNAME
    if _HOSTNAME is None:
        _HOSTNAME = socket.gethostname()
    return _HOSTNAME


def pid_namespace() -> int | None:
    """The inode of this process' PID namespace (Linux), or None where there is none.

    A pid means a process only within its PID namespace: two containers that share a
    host name (a Kubernetes pod's containers, ``docker run --network host``) each
    have their own pid 2. Owner records carry it, so that the locks of a dead pid are
    only ever freed by an observer in the same namespace (see dead_owners)."""
    global _PID_NAMESPACE
    if _PID_NAMESPACE is _UNKNOWN:
        try:
            _PID_NAMESPACE = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            _PID_NAMESPACE = None
    return _PID_NAMESPACE  # type: ignore[return-value]


#: (pid, its start time) of this process, once read (see process_started).
_STARTED: tuple[int, int | None] | None = None


def process_started(pid: int | None = None) -> int | None:
    """When process ``pid`` (default: this one) started, in clock ticks after the
    host's boot (Linux: field 22 of ``/proc/<pid>/stat``), or None where that cannot
    be read or the process has exited (a zombie, exited but not reaped, counts as
    exited).

    A pid is reused once the kernel's counter wraps (``pid_max`` is 32768 in many
    containers); a pid with its start time names one process for the host's uptime.
    Owner records carry it, so that the locks of a dead pid are never taken for
    those of a new process that got the same pid (see dead_owners)."""
    global _STARTED
    own = os.getpid()
    if pid is None or pid == own:
        known = _STARTED
        if known is not None and known[0] == own:  # not a fork's copy (uWSGI: no hooks)
            return known[1]
        started = _read_start_time(own)
        _STARTED = (own, started)
        return started
    return _read_start_time(pid)


def _read_start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # The command name, in parentheses, may hold spaces and parentheses.
            fields = stat.read().rsplit(b")", 1)[1].split()
        if fields[0] == b"Z":
            return None
        return int(fields[19])  # field 22; fields[0] is field 3 (the state)
    except (OSError, IndexError, ValueError):
        return None


def _forget_pid_namespace() -> None:
    # A child forked after unshare(CLONE_NEWPID) lives in another namespace.
    global _PID_NAMESPACE
    _PID_NAMESPACE = _UNKNOWN


os.register_at_fork(after_in_child=_forget_pid_namespace)


def current_owner(guards: str | None = None) -> dict[str, Any]:
    """The owner record written with each acquire: who holds the lock, and what for."""
    thread = threading.current_thread()
    owner: dict[str, Any] = {
        "host": _hostname(),
        "pid": os.getpid(),
        "thread": f"{thread.name} ({thread.ident})",
    }
    namespace = pid_namespace()
    if namespace is not None:
        owner["pidns"] = namespace
    started = process_started()
    if started is not None:
        owner["started"] = started
    if guards:
        owner["guards"] = guards
    return owner


_thread_owners = threading.local()


def _forget_thread_owners() -> None:
    # A forked child is another pid: its threads build their records anew.
    global _thread_owners
    _thread_owners = threading.local()


os.register_at_fork(after_in_child=_forget_thread_owners)


#: How many owner records with guards or extra fields each thread keeps built.
_OWNER_RECORDS_PER_THREAD = 64


def _thread_records() -> Any:
    """This thread's built owner records: ``.owner`` (the plain one, or None) and
    ``.built`` (those with guards or extra fields). Dropped when the process id or
    the thread's name differs from when they were built: a fork that ran no at-fork
    hook (uWSGI forks its workers in C) must not name its parent, a renamed thread
    must not keep its old name."""
    records = _thread_owners
    who = (os.getpid(), threading.current_thread().name)
    if getattr(records, "who", None) != who:
        records.who, records.owner, records.built = who, None, {}
    return records


def _new_token() -> str:
    """A lock token: 128 random bits, never used twice."""
    return secrets.token_hex(16)


def _owner_record(guards: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The owner record of an acquire. The plain one (no guards, no extra fields) is
    built once per thread and shared by its acquires, with its JSON encoding (an
    OwnerRecord, which the backends store as it is); nothing writes to it. Those
    with guards or extra fields (a semaphore's limit, a task's name) are kept the
    same way, a few per thread, when their values are plain (str, int, bool, None):
    building and encoding one was a measurable part of an uncontended acquire."""
    records = _thread_records()
    if not guards and not extra:
        plain: OwnerRecord | None = records.owner
        if plain is None:
            plain = records.owner = OwnerRecord(current_owner())
        return plain
    types = tuple(map(type, extra.values()))
    if not PLAIN_JSON_TYPES.issuperset(types) or not all(type(key) is str for key in extra):
        return {**current_owner(guards), **extra}  # may change after the acquire
    # The types are part of the key: 1 and True are equal, their JSON is not.
    key = (guards, *extra.items(), *types)
    built: dict[tuple[Any, ...], OwnerRecord] = records.built
    owner = built.get(key)
    if owner is None:
        if len(built) >= _OWNER_RECORDS_PER_THREAD:
            built.clear()  # many task ids or guards: start over rather than grow
        owner = built[key] = OwnerRecord({**current_owner(guards), **extra})
    return owner


class Lock:
    """One named lock in one backend. Creating it does nothing; :meth:`acquire` does.

    A Lock object holds at most one acquisition at a time and is meant to be used
    by one thread (or task) at a time, like ``threading.Lock`` held across a block.
    """

    #: What the messages call it (a Semaphore says "semaphore").
    _kind = "lock"

    def __init__(
        self,
        name: str,
        ttl: float | None = None,
        *,
        backend: str = DEFAULT_LOCK_ALIAS,
        timeout: float | None = None,
        blocking: bool = True,
        auto_renew: bool = False,
        guards: str | None = None,
        release_on_commit: bool = False,
        using: str | Sequence[str] | None = None,
    ) -> None:
        self.name = validate_name(name)
        self.backend_alias = backend
        # Resolving the alias now makes an unknown alias fail here, before any write.
        self.backend = locks[backend]
        self.ttl = self.backend.default_ttl if ttl is None else self._validate_ttl(ttl)
        self.timeout = validate_timeout(timeout)
        self.blocking = bool(blocking)
        self.auto_renew = bool(auto_renew)
        if guards is not None and not isinstance(guards, str):
            raise TypeError(
                f"guards must be a str describing what the lock protects, got {guards!r}."
            )
        self.guards = guards
        self.release_on_commit = bool(release_on_commit)
        self.using = database_aliases(using)
        self.fencing_token: int | None = None
        self.lost = False
        self._token: str | None = None
        #: The name of the backend record this object holds or last held: the lock's
        #: own name (a semaphore's is the name of one of its slots).
        self._record: str | None = self.name
        self._renewer: _Renewer | None = None
        #: Extra fields of the owner record (integrations: a Celery task's id).
        self.owner_extra: dict[str, Any] = {}
        self._borrowed = False
        #: While borrowed: the Lock whose pending release covers this block.
        self._lender: Lock | None = None

    @property
    def identity(self) -> tuple[Any, ...]:
        """What makes two Lock objects the same lock: ``(backend alias, name)``."""
        return (self.backend_alias, self.name)

    def __repr__(self) -> str:
        state = "lost" if self.lost else ("acquired" if self._token else "unlocked")
        return f"<Lock {self.name!r} backend={self.backend_alias!r} ttl={self.ttl:g} {state}>"

    # -- acquire ------------------------------------------------------------------

    def _prepare_acquire(
        self, blocking: bool | None, timeout: object, *, in_event_loop: bool = False
    ) -> tuple[str, dict[str, Any], float | None]:
        if self._token is not None and not self.lost:
            raise LockError(
                f"{self._kind.capitalize()} {self.name!r} is already acquired by this "
                f"{type(self).__name__} object; release it first (not reentrant)."
            )
        blocking = self.blocking if blocking is None else bool(blocking)
        timeout = self.timeout if timeout is _UNSET else validate_timeout(timeout)
        if self.lost:  # re-acquiring after a loss: the old renewal must not linger
            self._stop_renewer(join=not in_event_loop)
            self._token = None
        if not blocking:
            timeout = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        return _new_token(), _owner_record(self.guards, self.owner_extra), deadline

    def _acquired(self, token: str, result: AcquireResult, written_after: float) -> None:
        self._token = token
        self.fencing_token = result.fencing_token
        self.lost = False
        if self.auto_renew:
            # The record expires ttl after the backend wrote it, which was no earlier
            # than ``written_after`` (monotonic): the renewer must mark the lock lost
            # by then unless it has extended it.
            self._renewer = _Renewer(
                self, valid_until=written_after + self.backend.validity(self.ttl)
            )
            self._renewer.start()
        logger.debug("Acquired lock %r (fencing token %s)", self.name, self.fencing_token)
        signals.lock_acquired.send(sender=Lock, lock=self)

    def _contended(self, result: AcquireResult, calls: _CallClock) -> None:
        """The first refusal of an acquire: logged and signalled once per acquire."""
        if not calls.signalled:
            calls.signalled = True
            logger.debug("Lock %r is contended (retry after %s s)", self.name, result.retry_after)
            signals.lock_contended.send(sender=Lock, lock=self, retry_after=result.retry_after)

    def acquire(self, blocking: bool | None = None, timeout: object = _UNSET) -> bool:
        """Acquire the lock, waiting up to ``timeout`` seconds (``None``: forever).

        ``blocking=False`` is ``timeout=0``. Without arguments the values given to
        :func:`lock` apply. Returns True when acquired, False on timeout or
        non-blocking contention. Raises LockBackendError if the backend is down.
        """
        token, owner, deadline = self._prepare_acquire(blocking, timeout)
        calls = _CallClock()
        backend = self.backend
        first = None
        plan = self._first_attempt(deadline)
        if plan is not None:
            # The common case without the step machinery: a first attempt that wins.
            record, max_wait = plan
            calls.tick()
            won = backend.acquire(record, token, self.ttl, owner, max_wait)
            if won.acquired:
                return self._won(token, record, won, calls)
            first = (record, won, max_wait)
        steps = self._acquire_steps(calls, deadline, first)
        fresh_tokens = backend.token_per_attempt  # the last attempt's token is the winner's
        result: Any
        try:
            step, record, arg = next(steps)
            while step is not None:
                if step is _ACQUIRE:
                    if fresh_tokens:
                        token = _new_token()
                    result = backend.acquire(record, token, self.ttl, owner, arg)
                elif step is _WAIT:
                    result = backend.wait(record, token=token, **arg)
                elif step is _STOP_WAITING:
                    result = self._stop_waiting(record, token)
                else:
                    result = backend.get_many(record)
                step, record, arg = steps.send(result)
        except BaseException as error:
            # Interrupted while queued: leave nothing behind, unless the backend's
            # acquire that failed did so already.
            if calls.queued is not None and not was_undone(error):
                self._abandon(calls.queued, token)
            raise
        return self._won(token, record, arg, calls)

    async def aacquire(self, blocking: bool | None = None, timeout: object = _UNSET) -> bool:
        """Async twin of :meth:`acquire`; waiting does not block the event loop."""
        token, owner, deadline = self._prepare_acquire(blocking, timeout, in_event_loop=True)
        calls = _CallClock()
        backend = self.backend
        first = None
        plan = self._first_attempt(deadline)
        if plan is not None:
            record, max_wait = plan
            calls.tick()
            won = await backend.aacquire(record, token, self.ttl, owner, max_wait)
            if won.acquired:
                return self._won(token, record, won, calls)
            first = (record, won, max_wait)
        steps = self._acquire_steps(calls, deadline, first)
        fresh_tokens = backend.token_per_attempt  # the last attempt's token is the winner's
        result: Any
        try:
            step, record, arg = next(steps)
            while step is not None:
                if step is _WAIT:
                    result = await backend.await_release(record, token=token, **arg)
                elif step is _ACQUIRE:
                    if fresh_tokens:
                        token = _new_token()
                    result = await backend.aacquire(record, token, self.ttl, owner, arg)
                elif step is _STOP_WAITING:
                    result = await self._astop_waiting(record, token)
                else:
                    result = await backend.aget_many(record)
                step, record, arg = steps.send(result)
        except BaseException as error:  # includes asyncio.CancelledError
            if calls.queued is not None and not was_undone(error):
                # In a task of its own: a cancellation must not stop the undo halfway
                # (a lock handed to us, confirmed by stop_waiting, never released).
                await undo(
                    self._aabandon(calls.queued, token),
                    functools.partial(self._abandon, calls.queued, token),
                )
            raise
        return self._won(token, record, arg, calls)

    def _won(
        self, token: str, record: str | None, result: AcquireResult | None, calls: _CallClock
    ) -> bool:
        """The end of an acquire: ``result`` is the winning AcquireResult of the
        record named ``record``, or None."""
        if result is None:
            return False
        self._record = record
        self._acquired(token, result, calls.earliest_write())
        return True

    def _first_attempt(self, deadline: float | None) -> tuple[str, float | None] | None:
        """The attempt acquire() makes itself, before any step machinery (so the
        common case, a free lock, costs nothing more): ``(record, max_wait)``, or
        None to leave every attempt to :meth:`_acquire_steps`. A lock tries its one
        record, queued there if refused and the caller will wait."""
        return self.name, _remaining(deadline)

    def _acquire_steps(
        self, calls: _CallClock, deadline: float | None, first: FirstAttempt | None = None
    ) -> Steps:
        """The backend calls of one acquire, for :meth:`acquire` and :meth:`aacquire`
        alike (they differ only in how they make a call): a generator that yields
        ``(step, record name, argument)`` for each call to make, ``(_ACQUIRE,
        record, max_wait)``, ``(_WAIT, record, kwargs of wait())``,
        ``(_STOP_WAITING, record, None)`` or ``(_GET_MANY, [record, ...], None)``
        (sent ``{record: LockInfo}``, see ``get_many``), and is sent its
        result; it ends with ``(None, record, the winning AcquireResult)`` or
        ``(None, None, None)`` on timeout. A Lock has one record, named as the lock.

        ``first``: the refused attempt the caller already made (see
        :meth:`_first_attempt`), as ``(record, result, the max_wait it was made
        with)``."""
        result = yield from self._steps_on(
            self.name, calls, deadline, None if first is None else (first[1], first[2])
        )
        yield None, self.name, result

    def _steps_on(
        self,
        record: str,
        calls: _CallClock,
        deadline: float | None,
        first: Attempt | None = None,
    ) -> Generator[Step, Any, AcquireResult | None]:
        """The attempts on one record until it is won (returns the AcquireResult) or
        ``deadline`` (monotonic) passes (returns None), queued meanwhile where the
        backend queues waiters; see :meth:`_acquire_steps`. ``first``: an attempt
        already made (see there), whose result is taken as this loop's first."""
        if first is None:
            max_wait = _remaining(deadline)
        else:
            _, max_wait = first
        while True:
            result: AcquireResult
            if first is not None:
                result, first = first[0], None
            else:
                calls.tick()
                result = yield _ACQUIRE, record, max_wait
            if result.acquired:
                calls.queued = None
                return result
            # A refused caller that will retry is queued by the backend.
            if max_wait != 0:
                calls.queued = record
            self._contended(result, calls)
            max_wait = _remaining(deadline)
            if max_wait is not None and max_wait <= 0:
                if calls.queued is None:
                    return None
                calls.tick()
                calls.written_by_next = False  # maybe handed, and written, before it
                # Handed to us just before we gave up: ours after all.
                handed: AcquireResult | None = yield _STOP_WAITING, record, None
                calls.queued = None
                return handed
            calls.tick()
            handed = yield (
                _WAIT,
                record,
                {"attempt": calls.waits, "max_wait": max_wait, "retry_after": result.retry_after},
            )
            calls.waits += 1
            if handed is None:
                # The next attempt writes the record's expiry itself, unless the wait
                # may have written it (an attempt the backend made at its end, whose
                # answer was lost): then the win dates from the wait (review r160:
                # dated from the wait always, locks won on PostgreSQL or locmem after
                # a wait of seconds were reported lost the moment they were won).
                calls.written_by_next = not self.backend.wait_may_have_written
                continue
            if handed.acquired:  # a release handed the lock to us
                # Written by the attempt the backend made during this very wait (the
                # claim confirmed with our ttl, see BaseLockBackend.wait).
                calls.written_by_next = True
                calls.queued = None
                return handed
            # The backend made our next attempt at the end of its wait (see
            # BaseLockBackend.wait), and it was refused: it is this loop's next result.
            first = (handed, max_wait)

    def adopt(self, token: str) -> bool:
        """Take over an acquisition made elsewhere under ``token``: for integrations
        in which one process acquires and another holds (a Celery enqueuer and the
        worker that runs the task). Extends the lock to now + ttl.

        Returns True if the lock was still that acquisition's: this object then holds
        it (renewed with ``auto_renew``, freed by :meth:`release`). Returns False if
        it was lost (expired and taken over, or removed).

        The owner record keeps naming the acquiring process. If that process may
        die hard while this one holds on (a gunicorn worker, a Celery pool child),
        acquire with ``lk.owner_extra["handover"] = True``
        (:data:`django_setnx.dead_owners.HANDOVER`): otherwise the dead-owner cleanup
        frees the lock when its acquirer dies, and another client may take it while
        this one still holds it.
        """
        validate_token(token)
        self._prepare_acquire(blocking=False, timeout=0)
        started = time.monotonic()
        if not self.backend.extend(self.name, token, self.ttl):
            return False
        info = self.backend.get(self.name)
        fencing = info.fencing_token if info is not None else None
        self._acquired(token, AcquireResult.won(fencing or 0), started)
        return True

    def take_token(self, token: str) -> None:
        """Make this object the holder of an acquisition made elsewhere under ``token``
        without any round trip, so that :meth:`release` frees it (token-checked, with
        the lock signals): for integrations that release what another process took
        (a Celery message revoked before it ran). Use :meth:`adopt` to hold it on."""
        validate_token(token)
        if self._token is not None and not self.lost:
            raise LockError(
                f"{self._kind.capitalize()} {self.name!r} is already acquired by this "
                f"{type(self).__name__} object."
            )
        self._token, self.lost = token, False

    def _stop_waiting(self, record: str, token: str) -> AcquireResult | None:
        """Leave the backend's queue of ``record``; returns the AcquireResult if it
        was handed to us meanwhile. A failure is logged, not raised: our place lapses,
        and a lock the withdrawal may have confirmed for us (a release handed it to us
        just before) is the backend's to undo (Redis: see redis_undo)."""
        try:
            return self.backend.stop_waiting(record, token)
        except LockBackendError:
            logger.warning("Could not withdraw from the waiters of %r", self.name, exc_info=True)
            return None

    async def _astop_waiting(self, record: str, token: str) -> AcquireResult | None:
        try:
            return await self.backend.astop_waiting(record, token)
        except LockBackendError:
            logger.warning("Could not withdraw from the waiters of %r", self.name, exc_info=True)
            return None

    def _abandon(self, record: str, token: str) -> None:
        """After an error or interruption while queued for ``record``: withdraw, and
        release a lock handed to us that the caller will never know it holds."""
        try:
            if self._stop_waiting(record, token) is not None:
                self.backend.release(record, token)
        except Exception:
            logger.warning("Could not give up the lock handed to %r", self.name, exc_info=True)

    async def _aabandon(self, record: str, token: str) -> None:
        """Async twin of :meth:`_abandon` (the backend's async calls: no thread on
        Redis, whose waiters may be cancelled by the hundred)."""
        try:
            if await self._astop_waiting(record, token) is not None:
                await self.backend.arelease(record, token)
        except Exception:
            logger.warning("Could not give up the lock handed to %r", self.name, exc_info=True)

    # -- release ------------------------------------------------------------------

    def _held(self) -> tuple[str, str]:
        """``(record name, token)`` of the acquisition this object holds; only called
        once that is known (a typing aid, not a check)."""
        assert self._record is not None and self._token is not None
        return self._record, self._token

    def _check_held_by_us(self, action: str, *, free_lost: bool = True) -> tuple[str, str]:
        """``(record name, token)`` of the acquisition this object holds, or raise
        LockNotOwned (freeing a lost one first, on release, unless ``free_lost`` is
        False: from an event loop, where that sync release must not run)."""
        if self._token is None:
            raise LockNotOwned(
                self.name, f"Cannot {action} {self._kind} {self.name!r}: it is not acquired."
            )
        if self.lost:
            if action == "release" and free_lost:
                self._release_lost()
            self._token = None
            raise self._lost_error(action)
        return self._held()

    def _lost_error(self, action: str) -> LockNotOwned:
        return LockNotOwned(
            self.name,
            f"Cannot {action} {self._kind} {self.name!r}: it was lost (expired, taken over or "
            f"force-released, or not renewed in time).",
        )

    # Marked lost by our own clock, the record may still carry our token (a late
    # renewal that went through, or an expiry nobody took over): free it rather than
    # make the next holder wait out its ttl. Token-checked, so it never touches
    # another holder's lock; a failure changes nothing for the caller.

    def _release_lost(self) -> None:
        # No wait for the renewal: it found the loss, or hangs (a lock_lost receiver
        # releasing from the watchdog's thread would hold up every other lock's
        # report), and a late extend is token-checked.
        self._stop_renewer(join=False)
        self._release_held(None)

    async def _arelease_lost(self, held: tuple[str, str] | None = None) -> None:
        self._stop_renewer(join=False)
        try:
            await self.backend.arelease(*(held or self._held()))
        except LockError:
            logger.debug("Could not free lost lock %r", self.name, exc_info=True)

    def _stop_renewer(self, join: bool = True) -> bool:
        """Stop the renewal thread; with ``join``, wait briefly for an extend in
        flight. Never from an event loop's thread (``join=False``): the wait would
        stall every coroutine of the loop, and a late extend is token-checked.
        Returns False if the renewer or the watchdog found the lock lost first."""
        renewer, self._renewer = self._renewer, None
        return renewer is None or renewer.stop(join=join)

    def _released(self, released: bool) -> None:
        self._token = None
        if not released:
            self._mark_lost()
            raise LockNotOwned(
                self.name,
                f"{self._kind.capitalize()} {self.name!r} was no longer held by this object "
                f"at release: it "
                f"expired (another owner may hold it now) or was force-released (admin, "
                f"clearlocks, a dead owner's cleanup). Nothing was released.",
            )
        logger.debug("Released lock %r", self.name)
        signals.lock_released.send(sender=Lock, lock=self)

    def release(self) -> None:
        """Release the lock now. Raises LockNotOwned if this object no longer holds it.

        Always immediate, even with ``release_on_commit``: that option only delays
        the release at the end of a ``with`` block (see ``__exit__``).
        """
        record, token = self._check_held_by_us("release")
        if not self._stop_renewer():
            # Found lost since the test above (the deadline passed meanwhile): a
            # lost lock, as if that test had seen it.
            self._release_lost()
            self._token = None
            raise self._lost_error("release")
        self._released(self.backend.release(record, token))

    def _release_if_still_held(self) -> bool:
        """Release the lock if its record still carries this object's token: True if
        it did (``lock_released`` is sent). False if the lock was already released
        or has passed to another owner: not a lost lock, so nothing is sent and
        nothing raised. For releases that may come after another one of the same
        acquisition (Celery's revoke and eager paths), where the second is no loss."""
        if self._token is None:
            return False
        if self.lost:  # already reported; free what may be left of it
            self._release_lost()
            self._token = None
            return False
        record, token = self._held()
        if not self._stop_renewer():  # found lost since the test above
            self._release_lost()
            self._token = None
            return False
        released = self.backend.release(record, token)
        self._token = None
        if released:
            logger.debug("Released lock %r", self.name)
            signals.lock_released.send(sender=Lock, lock=self)
        return released

    async def arelease(self) -> None:
        """Async twin of :meth:`release`."""
        if self.lost and self._token is not None:
            await self._arelease_lost()
            self._token = None
            raise self._lost_error("release")
        held = self._held() if self._token is not None else None
        try:
            # free_lost=False: not with a sync call in the event loop.
            record, token = self._check_held_by_us("release", free_lost=False)
        except LockNotOwned:
            if held is not None and self.lost:
                # Marked lost since the test above (by the watchdog's thread): free
                # what may be left of it, as that test would have (review r95), to its
                # end even if the caller is cancelled: the token is gone, so no later
                # call could (review r96).
                await undo(self._arelease_lost(held), functools.partial(self._release_held, held))
            raise
        if not self._stop_renewer(join=False):  # found lost since the test above
            await undo(self._arelease_lost(held), functools.partial(self._release_held, held))
            self._token = None
            raise self._lost_error("release")
        try:
            released = await self.backend.arelease(record, token)
        except asyncio.CancelledError as cancelled:
            completed = completed_call(cancelled)
            if completed is not None:
                # The release ran, then the cancellation came through: record what
                # it did (this object no longer holds the lock) before ending
                # cancelled.
                with contextlib.suppress(LockNotOwned):
                    self._released(bool(completed[0]))
                raise
            # Cancelled while the release was sent or answered: whether it ran is
            # unknown. Release again, to the end (token-checked: nothing happens if
            # the first one ran), so that this object no longer holds the lock.
            await undo(
                self._arelease_again(record, token),
                functools.partial(self._release_again, record, token),
            )
            raise
        self._released(released)

    def _release_held(self, held: tuple[str, str] | None) -> None:
        """The sync end of :meth:`_arelease_lost` (see aio.undo), in a thread."""
        try:
            self.backend.release(*(held or self._held()))
        except LockError:
            logger.debug("Could not free lost lock %r", self.name, exc_info=True)

    def _release_again(self, record: str, token: str) -> None:
        """The sync end of :meth:`_arelease_again` (see aio.undo), in a thread."""
        try:
            self.backend.release(record, token)
        except LockError:
            logger.warning("Could not release lock %r", self.name, exc_info=True)
            return
        self._released(True)

    async def _arelease_again(self, record: str, token: str) -> None:
        try:
            await self.backend.arelease(record, token)
        except LockError:
            logger.warning("Could not release lock %r", self.name, exc_info=True)
            return
        # Released by this call or by the one that was cancelled: not held either way.
        self._released(True)

    # -- extend -------------------------------------------------------------------

    def _validate_ttl(self, ttl: object) -> float:
        # Checked here, before anything is sent, against the backend's documented
        # maximum (OPTIONS["MAX_TTL"]); the backends check again before they write.
        return validate_ttl(ttl, maximum=self.backend.max_ttl, where=self.backend.max_ttl_setting)

    def _extend_ttl(self, ttl: float | None) -> float:
        return self.ttl if ttl is None else self._validate_ttl(ttl)

    def _extended(self, extended: bool) -> None:
        if not extended:
            self._mark_lost()
            raise LockNotOwned(
                self.name,
                f"Cannot extend {self._kind} {self.name!r}: it is no longer held by this object "
                f"(it expired, was taken over or was force-released).",
            )

    def extend(self, ttl: float | None = None) -> None:
        """Set the expiry to now + ``ttl`` (default: the lock's ttl), by the backend's
        clock. Raises LockNotOwned if the lock was lost."""
        record, token = self._check_held_by_us("extend")
        self._extended(self.backend.extend(record, token, self._extend_ttl(ttl)))

    async def aextend(self, ttl: float | None = None) -> None:
        """Async twin of :meth:`extend`."""
        record, token = self._check_held_by_us("extend")
        self._extended(await self.backend.aextend(record, token, self._extend_ttl(ttl)))

    def _mark_lost(self) -> None:
        # The renewer, the watchdog and the owner's own extend() or release() can all
        # find the lock gone; the check-and-set is guarded so lock_lost is sent
        # exactly once per acquisition.
        with _MARK_LOST_GUARD:
            if self.lost:
                return
            self.lost = True
            fencing_token = self.fencing_token
        self._report_lost(fencing_token)

    def _report_lost(self, fencing_token: int | None) -> None:
        """Log and send ``lock_lost`` for the acquisition of ``fencing_token``, once
        the check-and-set of ``lost`` chose us. The token is passed, not read from
        this object: a report that comes late may find it acquired again."""
        logger.warning("Lock %r was lost (fencing token %s)", self.name, fencing_token)
        signals.lock_lost.send(sender=Lock, lock=self, fencing_token=fencing_token)

    # -- inspection ---------------------------------------------------------------

    def locked(self) -> bool:
        """Return True if anyone holds the lock now (a stale record does not count)."""
        info = self.backend.get(self.name)
        return info is not None and info.is_held

    def owned(self) -> bool:
        """Return True if this Lock object holds the lock now (checked with the backend)."""
        if self._token is None or self.lost:
            return False
        return self.backend.owns(*self._held())

    def info(self) -> LockInfo | None:
        """Return the backend's :class:`~django_setnx.backends.base.LockInfo`, or None."""
        return self.backend.get(self.name)

    async def alocked(self) -> bool:
        """Async twin of :meth:`locked`: True if anyone holds the lock now."""
        info = await self.backend.aget(self.name)
        return info is not None and info.is_held

    async def aowned(self) -> bool:
        """Async twin of :meth:`owned`: True if this Lock object holds the lock now."""
        if self._token is None or self.lost:
            return False
        return await self.backend.aowns(*self._held())

    async def ainfo(self) -> LockInfo | None:
        """Async twin of :meth:`info`: the backend's
        :class:`~django_setnx.backends.base.LockInfo`, or None."""
        return await self.backend.aget(self.name)

    # -- context managers ---------------------------------------------------------

    def __enter__(self) -> Lock:
        if self._borrow_deferred():
            return self
        if not self.acquire():
            raise LockNotAcquired(self.name, self.timeout if self.blocking else 0)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release_at_exit(exc)

    async def __aenter__(self) -> Lock:
        if self._borrow_deferred():
            return self
        if not await self.aacquire():
            raise LockNotAcquired(self.name, self.timeout if self.blocking else 0)
        return self

    def _borrow_deferred(self) -> bool:
        """With ``release_on_commit``: a block that finds this very lock held by an
        earlier block of the same transaction, waiting for COMMIT to be released,
        runs under it (it would otherwise wait for itself). True if borrowed."""
        if not self.release_on_commit or self._token is not None:
            return False
        held = deferred_lock(self)
        if held is None:
            return False
        self._token, self.fencing_token, self.lost = held._token, held.fencing_token, False
        self._record = held._record
        self._borrowed, self._lender = True, held
        return True

    def _return_borrowed(self) -> None:
        """The end of a borrowing block: the pending release covers it."""
        self._token = None
        self._borrowed, self._lender = False, None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.arelease_at_exit(exc)

    def release_at_exit(self, exc: BaseException | None = None) -> None:
        """Release at the end of a guarded block (``with``, ``@locked``, a task body).

        With ``release_on_commit`` and an open transaction on one of the ``using``
        databases, the lock is checked with the backend (one round trip): still held,
        its release waits for that transaction (see ``django_setnx.transactions``);
        lost, LockNotOwned is raised, so that the transaction rolls back. A lost lock
        is news the caller must hear (its block was not exclusive): LockNotOwned is
        raised, but never at the price of masking the exception ``exc`` already in
        flight.
        """
        try:
            pending = self._pending_transactions()
            if self._borrowed:
                lender = self._lender
                self._return_borrowed()  # its lender's release is not ours to make
                if pending and lender is not None:
                    lender._confirm_lent()
            elif pending:
                try:
                    held = self.owned() if self._ownership_checkable(pending) else True
                finally:
                    # Held, lost or unknown (the backend did not answer: the error
                    # rolls the transaction back), the release waits for its end
                    # (review r166: an auto_renew lock was left renewing for ever).
                    release_after_commit(self, self.using)
                if not held:
                    self._mark_lost()
                    raise self._lost_before_commit_error()
            else:
                self.release()
        except (LockNotOwned, LockBackendError):
            self._failed_at_exit(exc)

    async def arelease_at_exit(self, exc: BaseException | None = None) -> None:
        """Async twin of :meth:`release_at_exit`."""
        try:
            pending = self._pending_transactions()
            if self._borrowed:
                lender = self._lender
                self._return_borrowed()
                if pending and lender is not None:
                    await lender._aconfirm_lent()
            elif pending:
                try:
                    held = await self.aowned() if self._ownership_checkable(pending) else True
                finally:
                    release_after_commit(self, self.using)
                if not held:
                    self._mark_lost()
                    raise self._lost_before_commit_error()
            else:
                await self.arelease()
        except (LockNotOwned, LockBackendError):
            self._failed_at_exit(exc)

    def _pending_transactions(self) -> list[str]:
        """The ``using`` databases whose open transaction the release waits for (see
        release_at_exit): none without ``release_on_commit``."""
        return open_transactions(self.using) if self.release_on_commit else []

    def _ownership_checkable(self, pending: list[str]) -> bool:
        """Whether the backend can be asked before the transactions ``pending``
        commit: not when even its reads wait for the caller's own open transaction
        (SQLite without WAL, the lock table in the same database: review r166),
        which would stall the call, then fail it."""
        return not any(self.backend.reads_wait_for_transaction(alias) for alias in pending)

    def _confirm_lent(self) -> None:
        """The end of a call that ran under this lock while it waits for its
        transaction's COMMIT (a second guarded call of the same name in one
        transaction: a decorated call or task that ran under ``deferred_lock``, or a
        ``with`` block that borrowed it): raise LockNotOwned if it was lost meanwhile,
        as :meth:`release_at_exit` does at the end of the first call, so that the
        transaction rolls back (review r166). Its pending release frees what may be
        left, after the rollback. Nothing to confirm once that release has run (a
        generator consumed after the COMMIT, review r167): the lock was released,
        not lost."""
        if (
            self._token is not None
            and self._ownership_checkable(open_transactions(self.using))
            and not self.owned()
        ):
            self._mark_lost()
            raise self._lost_before_commit_error()

    async def _aconfirm_lent(self) -> None:
        """Async twin of :meth:`_confirm_lent`."""
        if (
            self._token is not None
            and self._ownership_checkable(open_transactions(self.using))
            and not await self.aowned()
        ):
            self._mark_lost()
            raise self._lost_before_commit_error()

    def _lost_before_commit_error(self) -> LockNotOwned:
        """LockNotOwned for a lock lost before its block's transaction committed:
        raised so that the transaction rolls back rather than commit writes that were
        not exclusive, as a lost lock is an error outside a transaction (review r165:
        a view under ``ATOMIC_REQUESTS`` that outlived its ttl committed, and
        answered 200)."""
        return LockNotOwned(
            self.name,
            f"{self._kind.capitalize()} {self.name!r} was lost before the transaction of "
            f"its block committed (it expired, was taken over or was force-released): "
            f"what the block wrote was not exclusive, so the transaction must not commit.",
        )

    def _failed_at_exit(self, exc: BaseException | None) -> None:
        """A release at exit failed (the error being handled): re-raise it, unless the
        block is already raising ``exc``, which it must not mask."""
        # Called from the caller's except block: the bare raise re-raises its error.
        if exc is None:
            raise  # noqa: PLE0704
        logger.warning(
            "Could not release lock %r while handling %r",
            self.name,
            exc,
            exc_info=True,  # noqa: LOG014 - inside the caller's except block
        )


def _remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a monotonic time), or None for no deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


#: The backend calls Lock._acquire_steps asks for.
_ACQUIRE, _WAIT, _STOP_WAITING, _GET_MANY = "acquire", "wait", "stop_waiting", "get_many"
#: One backend call of an acquire: ``(step, record name, argument)``; ``(None, record,
#: result)`` ends it (see Lock._acquire_steps).
Step = tuple[Any, Any, Any]
Steps = Generator[Step, Any, None]
#: An attempt already made on one record: ``(its AcquireResult, the max_wait it was
#: made with)``.
Attempt = tuple[AcquireResult, float | None]
#: The refused first attempt of an acquire, made by acquire() itself: ``(record, its
#: AcquireResult, the max_wait it was made with)``.
FirstAttempt = tuple[str, AcquireResult, float | None]


class _CallClock:
    """When each backend call of one acquire() started (monotonic seconds), and
    the record whose queue the caller is in (``queued``).

    A lock won at a call's first attempt was written during that call; one handed
    over by a release (the backend's waiter queue) may have been written as early as
    the call before the one that reported it. ``earliest_write`` is the earlier of
    the two: a safe lower bound for when the record's ttl started.
    """

    __slots__ = ("current", "previous", "queued", "signalled", "waits", "written_by_next")

    def __init__(self) -> None:
        self.current: float | None = None
        self.previous: float | None = None
        #: Whether the record a win reports was written during the call that reported
        #: it (set after a wait that wrote nothing, or one that reported the win
        #: itself), so that call's start is the bound, not the call before.
        self.written_by_next = False
        #: The record whose waiters the caller is among, or None.
        self.queued: str | None = None
        #: Whether the acquire's first refusal was signalled (lock_contended).
        self.signalled = False
        #: The waits of the acquire so far, on every record it tried: a semaphore's
        #: backoff goes on growing when it moves to another slot.
        self.waits = 0

    def tick(self) -> None:
        self.previous, self.current = self.current, time.monotonic()

    def earliest_write(self) -> float:
        assert self.current is not None  # ticked before every call
        if self.previous is None or self.written_by_next:
            return self.current
        return self.previous


class _Renewer(threading.Thread):
    """Extends a held lock every ttl/3 until stopped; marks it lost if it cannot.

    ``valid_until`` (monotonic) is when the lock expires unless renewed, taken as the
    moment *before* the write that set the expiry. The process-wide watchdog marks
    the lock lost at that moment if no extend has succeeded since, however long a
    hanging extend takes to return.
    """

    def __init__(self, lock: Lock, valid_until: float) -> None:
        super().__init__(name=f"django-setnx renew {lock.name[:40]}", daemon=True)
        self.lock = lock
        self.record, self.token = lock._held()
        self.fencing_token = lock.fencing_token  # of the acquisition it renews
        self.interval = lock.ttl / 3
        self.valid_until = valid_until
        self._stop_event = threading.Event()

    def start(self) -> None:
        _watchdog.watch(self, self.valid_until)
        super().start()

    def _end(self, lost: bool = False) -> bool:
        """End the renewals: True for the first caller only, of stop() and a loss
        (``lost``, which marks the lock lost in the same step). So a lock is either
        released by its owner or lost, never both: a release racing the deadline
        never sends ``lock_released`` after ``lock_lost``, and finds the lock marked
        lost as soon as it lost the race."""
        with _MARK_LOST_GUARD:
            if self._stop_event.is_set():
                return False
            self._stop_event.set()
            if lost:
                if self.lock.lost:  # already reported (the owner's extend found it)
                    return False
                self.lock.lost = True
            return True

    def stop(self, join: bool = True) -> bool:
        """Stop renewing. Returns False if the lock was found lost first (``lock_lost``
        is sent, or about to be, by the thread that found it)."""
        stopped = self._end()
        _watchdog.unwatch(self)
        if join and threading.current_thread() is not self:
            # Wait briefly for an extend in flight. Safe to stop waiting: a late
            # extend is token-checked and finds the released record gone.
            self.join(timeout=min(self.lock.ttl, STOP_JOIN_TIMEOUT))
        return stopped

    def expired(self) -> None:
        """Called when ``valid_until`` passed without a renewal."""
        _watchdog.unwatch(self)
        self._lost()

    def _lost(self) -> None:
        if self._end(lost=True):
            self.lock._report_lost(self.fencing_token)

    def run(self) -> None:
        try:
            self._renew_until_stopped()
        finally:
            self.lock.backend._background_thread_done()

    def _renew_until_stopped(self) -> None:
        lk = self.lock
        wait = self.interval
        while not self._stop_event.wait(wait):
            started = time.monotonic()
            # A database backend lends this thread one of the connections its async
            # callers share, if one frees up within half the time left, instead of
            # opening one per renewed lock (ASYNC_CONNECTIONS); else one of the
            # thread's own for that call. The wait alone never makes the lock lost.
            patience = max(min(self.interval, self.valid_until - started) / 2, 0.0)
            extend = lk.backend._for_background(lk.backend.extend, patience)
            try:
                renewed = extend(self.record, self.token, lk.ttl)
            except LockError:
                logger.warning("Could not renew lock %r", lk.name, exc_info=True)
                left = self.valid_until - time.monotonic()
                if left <= 0:  # the watchdog is due to mark it lost, if it has not
                    self.expired()
                    return
                wait = max(min(self.interval, left / 2), 0.05)  # try again while time is left
                continue
            if self._stop_event.is_set():
                return
            if not renewed:
                _watchdog.unwatch(self)
                self._lost()
                return
            self.valid_until = started + lk.backend.validity(lk.ttl)
            _watchdog.watch(self, self.valid_until)
            wait = self.interval


#: Longest wait for an extend in flight when a renewed lock is released (seconds).
STOP_JOIN_TIMEOUT = 5.0


class _WatchdogState:
    """One process' watchdog: its deadlines, their condition and its thread."""

    __slots__ = ("cond", "deadlines", "thread")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.deadlines: dict[_Renewer, float] = {}
        self.thread: threading.Thread | None = None


class _Watchdog:
    """One thread per process that marks renewed locks lost when their validity ends.

    A renewer blocked in a hanging ``extend`` cannot notice its own deadline, so the
    deadlines live here: a heap-free dict (few locks are auto-renewed at once) and a
    condition variable, woken whenever a deadline moves. Started lazily, and again in
    a forked child (threads do not survive a fork): the state is one per process id,
    so a child forked without at-fork hooks (uWSGI) starts over as well, and never
    waits on a condition a parent thread held at the fork.
    """

    def __init__(self) -> None:
        self._state = PerProcess(_WatchdogState)

    def condition(self) -> threading.Condition:
        """This process' condition (for tests of forks)."""
        return self._state.get().cond

    def watch(self, renewer: _Renewer, deadline: float) -> None:
        state = self._state.get()
        with state.cond:
            state.deadlines[renewer] = deadline
            if state.thread is None:
                thread = threading.Thread(
                    target=self._run, args=(state,), name="django-setnx watchdog", daemon=True
                )
                thread.start()
                state.thread = thread
            state.cond.notify()

    def unwatch(self, renewer: _Renewer) -> None:
        state = self._state.get()
        with state.cond:
            state.deadlines.pop(renewer, None)

    @staticmethod
    def _run(state: _WatchdogState) -> None:
        cond, deadlines = state.cond, state.deadlines
        while True:
            with cond:
                now = time.monotonic()
                due = [r for r, deadline in deadlines.items() if deadline <= now]
                for renewer in due:
                    del deadlines[renewer]
                if not due:
                    nearest = min(deadlines.values(), default=None)
                    cond.wait(None if nearest is None else nearest - now)
                    continue
            for renewer in due:  # outside the condition: signal receivers may block
                try:
                    renewer.expired()
                except Exception:
                    logger.exception("lock_lost receiver failed")


_watchdog = _Watchdog()


def lock(
    name: str,
    ttl: float | None = None,
    *,
    backend: str = DEFAULT_LOCK_ALIAS,
    timeout: float | None = None,
    blocking: bool = True,
    auto_renew: bool = False,
    guards: str | None = None,
    release_on_commit: bool = False,
    using: str | Sequence[str] | None = None,
) -> Lock:
    """Return a :class:`Lock` for ``name`` in ``backend``; nothing is written yet.

    ``ttl`` (seconds) defaults to the backend's ``TTL`` setting (60 s). ``timeout``
    and ``blocking`` are the defaults of :meth:`Lock.acquire` and of ``with``.
    ``guards`` describes what the lock protects, for the admin and ``listlocks``.
    ``release_on_commit=True`` makes the end of a ``with`` block inside a
    transaction on one of the ``using`` databases (default: ``"default"``) release
    the lock only after that transaction commits, or at once after it rolls back.
    Raises TypeError/ValueError for a bad name, ttl or timeout and
    ImproperlyConfigured (InvalidLockBackendError) for an unknown alias.
    """
    return Lock(
        name,
        ttl,
        backend=backend,
        timeout=timeout,
        blocking=blocking,
        auto_renew=auto_renew,
        guards=guards,
        release_on_commit=release_on_commit,
        using=using,
    )
