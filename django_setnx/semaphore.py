"""Counting semaphores: at most ``limit`` holders of one name at a time.

A semaphore of limit N is N lock records, its *slots*, named ``<name>\\x1f<i>`` for
i in 1..N (``\\x1f``, the ASCII unit separator, is reserved: lock names may not
contain it, so a slot never collides with a lock). Each slot is an ordinary lock
record of the backend, so a semaphore keeps every guarantee of a lock on every
backend with no code of its own there: the database's unique constraint is the
SETNX of each slot, Redis takes a slot in one script, Redlock a quorum of a slot; a
crashed holder's slot expires after its ttl; a release is token-checked; each
acquire mints a fencing token (strictly increasing per slot); a release wakes a
waiter of that slot.

An acquire tries the slots from a random one, so concurrent callers spread over
them and the common case, a free slot, costs one round trip like a lock. When
every slot is taken, the caller queues on one of them (woken, or handed the slot,
when its holder releases) for a slice, then looks at every slot again. The slice
doubles with each look, from SLOT_WAIT_SLICE to SLOT_WAIT_MAX, so that a long wait
costs about ``limit`` / SLOT_WAIT_MAX attempts a second (each look tries every other
slot), not ten times that (a thousand waiters looking every 0.1 s saturated their
event loop and the server).
"""

from __future__ import annotations

import random
import time
from collections.abc import Generator, Sequence
from typing import Any

from .backends.base import AcquireResult, LockInfo
from .conf import DEFAULT_LOCK_ALIAS, MAX_NAME_LENGTH
from .exceptions import LockError
from .locking import _ACQUIRE, _GET_MANY, FirstAttempt, Lock, Step, Steps, _CallClock, _remaining
from .validation import MAX_LIMIT, SLOT_SEPARATOR, slot_record, split_slot  # noqa: F401

#: How long (seconds, before jitter) a waiter first stays queued on one slot before it
#: looks at the others again. Each later slice is twice as long, up to SLOT_WAIT_MAX:
#: a slot freed with nobody queued on it stays unused for at most about that long
#: while others wait (with at least ``limit`` waiters, every slot likely has a queue,
#: and its release hands it over at once).
SLOT_WAIT_SLICE = 0.1
SLOT_WAIT_MAX = 0.8

#: (backend alias, name, limit) whose slots this process checked for another limit.
#: A set's add and lookup are atomic, so no lock (one that a fork could leave held).
_checked_limits: set[tuple[str, str, int]] = set()
#: How many it remembers: past that it starts over (a per-user semaphore name would
#: otherwise grow it for ever), and a name checked again costs limit + 1 reads.
CHECKED_LIMITS_KEEP = 10_000


def validate_limit(limit: object) -> int:
    """Return ``limit`` if it is a usable semaphore limit, else raise
    TypeError/ValueError naming the value."""
    if type(limit) is not int:  # bool is an int, but limit=True is a bug
        raise TypeError(f"Semaphore limit must be an int, not {type(limit).__name__}: {limit!r}.")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"Semaphore limit must be from 1 to {MAX_LIMIT}, got {limit!r}.")
    return limit


def validate_semaphore_name(name: str, limit: int) -> str:
    """A semaphore's name must leave room in its slots' record names for the slot
    number (the records' names are at most MAX_NAME_LENGTH characters)."""
    longest = MAX_NAME_LENGTH - len(slot_record("", limit))
    if isinstance(name, str) and len(name) > longest:
        raise ValueError(
            f"Semaphore name is {len(name)} characters long, the limit is {longest} "
            f"with limit={limit}: {name[:40]!r}..."
        )
    return name


class Semaphore(Lock):
    """A named semaphore in one backend: at most ``limit`` holders at a time.

    The same object, methods and semantics as a :class:`~django_setnx.locking.Lock`
    (one acquisition per object; ``acquire``/``release``/``extend``/``owned`` and
    their async twins, context managers, ``auto_renew``, a fencing token per
    acquire), holding one of the ``limit`` slots. ``limit=1`` is a mutex.
    """

    _kind = "semaphore"

    def __init__(self, name: str, limit: int, ttl: float | None = None, **kwargs: Any) -> None:
        self.limit = validate_limit(limit)
        super().__init__(validate_semaphore_name(name, self.limit), ttl, **kwargs)
        self.owner_extra["limit"] = self.limit
        self._record = None
        self._slots: list[str] | None = None

    @property
    def slots(self) -> list[str]:
        """The record names of the slots, slot 1 first (built when first needed:
        an uncontended acquire names only the slot it takes)."""
        # Not functools.cached_property: before Python 3.12 it takes one lock shared
        # by every instance, which a fork can leave held in the child for good.
        if self._slots is None:
            self._slots = [slot_record(self.name, slot) for slot in range(1, self.limit + 1)]
        return self._slots

    def __repr__(self) -> str:
        state = "lost" if self.lost else ("acquired" if self._token else "unlocked")
        return (
            f"<Semaphore {self.name!r} limit={self.limit} backend={self.backend_alias!r} "
            f"ttl={self.ttl:g} {state}>"
        )

    @property
    def identity(self) -> tuple[Any, ...]:
        """``(backend alias, name, limit)``: never the same as a lock's (see
        :attr:`Lock.identity`), so a semaphore never borrows a lock's acquisition."""
        return (self.backend_alias, self.name, self.limit)

    def adopt(self, token: str) -> bool:
        """Not for semaphores: an acquisition made elsewhere names no slot."""
        raise LockError(f"Semaphore {self.name!r}: adopt() is for locks only.")

    def take_token(self, token: str) -> None:
        """Not for semaphores: an acquisition made elsewhere names no slot."""
        raise LockError(f"Semaphore {self.name!r}: take_token() is for locks only.")

    @property
    def slot(self) -> int | None:
        """The number (1..limit) of the slot this object holds or last held, or None."""
        split = None if self._record is None else split_slot(self._record)
        return None if split is None else split[1]

    def _first_attempt(self, deadline: float | None) -> tuple[str, float | None] | None:
        """See :meth:`Lock._first_attempt`: a random slot, not queued there when
        refused (unless it is the only one): the other slots come next. None until
        this process has checked the semaphore's limit (see :meth:`_check_limit`),
        which must come before anything is written."""
        if (self.backend_alias, self.name, self.limit) not in _checked_limits:
            return None
        if self.limit == 1:
            return slot_record(self.name, 1), _remaining(deadline)
        return slot_record(self.name, random.randrange(self.limit) + 1), 0

    def _acquire_steps(
        self, calls: _CallClock, deadline: float | None, first: FirstAttempt | None = None
    ) -> Steps:
        """See :meth:`Lock._acquire_steps`: the same calls, spread over the slots.
        ``first``: the refused attempt acquire() made on one slot (see
        :meth:`_first_attempt`)."""
        key = (self.backend_alias, self.name, self.limit)
        if key not in _checked_limits:
            yield from self._check_limit()
            if len(_checked_limits) >= CHECKED_LIMITS_KEEP:
                _checked_limits.clear()
            _checked_limits.add(key)
        if self.limit == 1:
            attempt = None if first is None else (first[1], first[2])
            result = yield from self._steps_on(self.slots[0], calls, deadline, attempt)
            yield None, self.slots[0], result
        slice_length = SLOT_WAIT_SLICE
        while True:
            if first is None:
                start = random.randrange(self.limit)
                others = order = self.slots[start:] + self.slots[:start]
            else:  # the attempt acquire() made on a slot, refused: the others next
                start = self.slots.index(first[0])
                order = self.slots[start:] + self.slots[:start]
                others = order[1:]
                self._contended(first[1], calls)
                first = None
            # Only the slots that are free (or whose holder's ttl ran out) are tried:
            # one read of all of them, not a refused attempt on each, which with
            # Redlock and a silent master cost a round each (review r144).
            infos = yield _GET_MANY, others, None
            for record in others[:-1]:
                info = infos.get(record)
                if info is not None and info.is_held:
                    continue
                calls.tick()
                result = yield _ACQUIRE, record, 0
                if result.acquired:
                    yield None, record, result
                self._contended(result, calls)
            last = infos.get(order[-1])
            if _remaining(deadline) == 0 and last is not None and last.is_held:
                # No time left to queue on it (review r146): refused, as an attempt
                # there would have been.
                soonest = min(i.expires_in for i in infos.values() if i is not None and i.is_held)
                self._contended(AcquireResult.lost(retry_after=soonest), calls)
                yield None, None, None
            # Every other slot is taken: queue on the last one for a slice (a release
            # of it hands it over at once), then look at all of them again.
            left = _remaining(deadline)
            slice_ = slice_length * random.uniform(0.5, 1.5)
            slice_length = min(2 * slice_length, SLOT_WAIT_MAX)
            slice_deadline = (
                deadline if left is not None and left <= slice_ else (time.monotonic() + slice_)
            )
            result = yield from self._steps_on(order[-1], calls, slice_deadline)
            if result is not None:
                yield None, order[-1], result
            if _remaining(deadline) == 0:
                yield None, None, None

    def _check_limit(self) -> Generator[Step, Any, None]:
        """Refuse, before anything is written, a limit other than the one the
        semaphore's current holders took it with. Done once per process and
        (alias, name, limit): a second limit is a programming error, found on first
        use wherever it meets a holder of the first."""
        records = self.slots + [slot_record(self.name, self.limit + 1)]
        infos = yield _GET_MANY, records, None  # one read (review r144: one per slot)
        for record in records:
            info = infos.get(record)
            if info is None or not info.is_held:
                continue
            other = info.owner.get("limit")
            if record not in self.slots or (other is not None and other != self.limit):
                raise ValueError(
                    f"Semaphore {self.name!r} on backend {self.backend_alias!r} is held "
                    f"with limit={other!r}; it cannot also be used with "
                    f"limit={self.limit!r}."
                )

    # -- inspection ---------------------------------------------------------------

    def holders(self) -> list[LockInfo]:
        """Return the :class:`~django_setnx.backends.base.LockInfo` of every held
        slot, in slot order (stale slots are left out)."""
        infos = self.backend.get_many(self.slots)
        return [info for info in map(infos.get, self.slots) if info is not None and info.is_held]

    async def aholders(self) -> list[LockInfo]:
        """Async twin of :meth:`holders`."""
        infos = await self.backend.aget_many(self.slots)
        return [info for info in map(infos.get, self.slots) if info is not None and info.is_held]

    def locked(self) -> bool:
        """Return True if every slot is held: an acquire now would have to wait
        (as :meth:`asyncio.Semaphore.locked`)."""
        return len(self.holders()) >= self.limit

    async def alocked(self) -> bool:
        """Async twin of :meth:`locked`: True if every slot is held."""
        return len(await self.aholders()) >= self.limit

    def info(self) -> LockInfo | None:
        """Return the :class:`~django_setnx.backends.base.LockInfo` of the slot this
        object holds, or None when it holds none (see :meth:`holders` for all)."""
        if self._token is None or self._record is None:
            return None
        return self.backend.get(self._record)

    async def ainfo(self) -> LockInfo | None:
        """Async twin of :meth:`info`: the :class:`~django_setnx.backends.base.LockInfo`
        of the slot this object holds, or None when it holds none."""
        if self._token is None or self._record is None:
            return None
        return await self.backend.aget(self._record)


def semaphore(
    name: str,
    limit: int,
    ttl: float | None = None,
    *,
    backend: str = DEFAULT_LOCK_ALIAS,
    timeout: float | None = None,
    blocking: bool = True,
    auto_renew: bool = False,
    guards: str | None = None,
    release_on_commit: bool = False,
    using: str | Sequence[str] | None = None,
) -> Semaphore:
    """Return a :class:`Semaphore` of ``limit`` slots for ``name`` in ``backend``;
    nothing is written yet. The other arguments are those of
    :func:`~django_setnx.lock`. Raises TypeError/ValueError for a bad name,
    limit (an int from 1 to 1000), ttl or timeout and ImproperlyConfigured
    (InvalidLockBackendError) for an unknown alias."""
    return Semaphore(
        name,
        limit,
        ttl,
        backend=backend,
        timeout=timeout,
        blocking=blocking,
        auto_renew=auto_renew,
        guards=guards,
        release_on_commit=release_on_commit,
        using=using,
    )
