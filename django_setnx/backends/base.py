"""The base class every lock backend implements, and the records it returns.

A backend stores lock records and answers a handful of atomic compare-and-act
operations; everything else (waiting with a timeout, renewing, signals) lives in
:class:`django_setnx.locking.Lock` and is the same for every backend. A new backend
(memcached, etcd, ...) is one module with a subclass of :class:`BaseLockBackend`.

Times cross this interface as integer milliseconds since the Unix epoch **read from
the backend's own clock** (Redis ``TIME``, the database's ``now()``), so no app
server ever compares its own clock with another's.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import datetime
import json
import logging
import numbers
import random
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured

from ..conf import DEFAULT_MAX_TTL, DEFAULT_TTL
from ..exceptions import LockBackendError
from ..globs import compile_glob
from ..validation import (
    MAX_LIMIT,
    MAX_TTL_LIMIT,
    redacted,
    split_slot,
    ttl_to_ms,
    validate_ttl,
)
from .paging import LockPage, check_ordering, check_window, page_of_stream

_P = ParamSpec("_P")
_R = TypeVar("_R")

HELD = "held"
STALE = "stale"
STATES = (HELD, STALE)

#: Waiters never sleep longer than this between two attempts: a bound on how late a
#: waiter can notice an expiry or a release on a backend that cannot signal it.
MAX_BACKOFF = 0.25
#: First backoff step; doubled per failed attempt up to MAX_BACKOFF.
BASE_BACKOFF = 0.002


#: Record times outside 1970..9999 were not written by any backend of this package:
#: such a record is unreadable.
MAX_PLAUSIBLE_MS = 253402300799999
#: Fencing tokens are JSON-safe integers: below 2**53.
MAX_FENCING_TOKEN = 2**53 - 1

_WHOLE_NUMBER = re.compile(r"-?[0-9]+")

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_MIN_DATETIME = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
_MAX_DATETIME = datetime.datetime.max.replace(tzinfo=datetime.timezone.utc)


def ms_to_datetime(ms: int) -> datetime.datetime:
    """Milliseconds since the epoch to an aware UTC ``datetime``, clamped to the range
    ``datetime`` can represent (a record written with an absurd expiry must still
    display, so that it can be seen and cleared)."""
    try:
        return _EPOCH + datetime.timedelta(milliseconds=ms)
    except OverflowError:
        return _MAX_DATETIME if ms > 0 else _MIN_DATETIME


@dataclass(frozen=True)
class LockInfo:
    """A snapshot of one lock record, as its backend saw it at ``now_ms``.

    ``owner`` is a dict with ``host``, ``pid`` and ``thread`` and, when known,
    ``guards`` (the view, function or Celery task the lock protects).
    """

    name: str
    backend: str
    fencing_token: int
    owner: dict[str, Any]
    acquired_at_ms: int
    expires_at_ms: int
    now_ms: int

    @property
    def state(self) -> str:
        """``"held"`` while not expired, ``"stale"`` once expired without a release."""
        return HELD if self.expires_at_ms > self.now_ms else STALE

    @property
    def is_held(self) -> bool:
        return self.state == HELD

    @property
    def is_stale(self) -> bool:
        return self.state == STALE

    @property
    def expires_in(self) -> float:
        """Seconds until expiry by the backend's clock; negative when stale."""
        return (self.expires_at_ms - self.now_ms) / 1000

    @property
    def semaphore(self) -> tuple[str, int, int | None] | None:
        """For a semaphore's slot (see :mod:`django_setnx.semaphore`), ``(semaphore
        name, slot number, limit)``, the limit as its holder took it (None if its
        owner does not say); None for a lock."""
        split = split_slot(self.name)
        if split is None:
            return None
        limit = self.owner.get("limit")
        # The owner is data (a record written by hand, say): only a limit a
        # semaphore can have is believed; the admin reads that many slots.
        usable = type(limit) is int and 1 <= limit <= MAX_LIMIT
        return (*split, limit if usable else None)

    @property
    def display_name(self) -> str:
        """The name people read: a lock's name, or ``"<semaphore> [slot i/N]"``."""
        semaphore = self.semaphore
        if semaphore is None:
            return self.name
        name, slot, limit = semaphore
        return f"{name} [slot {slot}/{limit if limit is not None else '?'}]"

    @property
    def acquired_at(self) -> datetime.datetime:
        return ms_to_datetime(self.acquired_at_ms)

    @property
    def expires_at(self) -> datetime.datetime:
        return ms_to_datetime(self.expires_at_ms)

    @classmethod
    def unreadable(cls, name: str, backend: str, now_ms: int, raw: object) -> LockInfo:
        """The info of a record that cannot be parsed (written by hand, by an older
        version, or corrupted): shown as stale with fencing token 0 and the raw data
        as its owner, so listings never fail on it and ``clearlocks`` removes it."""
        return cls(
            name=name,
            backend=backend,
            fencing_token=0,
            owner={"unreadable": repr(raw)[:500]},
            acquired_at_ms=int(now_ms),
            expires_at_ms=int(now_ms),
            now_ms=int(now_ms),
        )

    @classmethod
    def from_record(
        cls,
        name: str,
        backend: str,
        now_ms: int,
        *,
        owner: object,
        acquired: object,
        expires: object,
        fencing: object,
        raw: object,
        strict_owner: bool = False,
    ) -> LockInfo:
        """The info of a stored record, whatever wrote it: how every backend reads one.

        ``acquired``, ``expires`` (epoch ms) and ``fencing`` may be ints, or the text
        or bytes of a whole number (as Redis stores them), None when missing;
        ``owner`` a dict, or its JSON text or bytes. A record whose times are not
        plausible (1970..9999) or whose fencing token is not a JSON-safe whole number
        is :meth:`unreadable` (``raw`` is what it shows), and so is one whose owner is
        not a JSON object with ``strict_owner`` (Redis); otherwise such an owner is
        kept, as text, under ``"unreadable"``. An unreadable record is stale, unless
        its ``expires`` is plausible and ahead and its ``acquired`` is missing or
        plausible: then the backends' acquire treats it as held, and so is it shown.
        """
        now_ms = int(now_ms)
        acquired_ms, expires_ms = (
            _whole(acquired, MAX_PLAUSIBLE_MS),
            _whole(expires, MAX_PLAUSIBLE_MS),
        )
        fencing = _whole(fencing, MAX_FENCING_TOKEN)
        owner, owner_readable = _owner(owner)
        if (
            acquired_ms is None
            or expires_ms is None
            or fencing is None
            or (strict_owner and not owner_readable)
        ):
            info = cls.unreadable(name, backend, now_ms, raw)
            if (
                expires_ms is not None
                and expires_ms > now_ms
                and (acquired is None or acquired_ms is not None)
            ):
                info = replace(info, expires_at_ms=expires_ms)
            return info
        return cls(
            name=name,
            backend=backend,
            fencing_token=fencing,
            owner=owner,
            acquired_at_ms=acquired_ms,
            expires_at_ms=expires_ms,
            now_ms=now_ms,
        )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what ``listlocks --json`` prints); a semaphore
        slot's has ``"semaphore": {"name", "slot", "limit"}``."""
        semaphore = self.semaphore
        extra = (
            {}
            if semaphore is None
            else {"semaphore": dict(zip(("name", "slot", "limit"), semaphore))}
        )
        return {
            "name": self.name,
            "backend": self.backend,
            "state": self.state,
            "fencing_token": self.fencing_token,
            "owner": dict(self.owner),
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "expires_in": round(self.expires_in, 3),
            **extra,
        }


def _whole(value: object, maximum: int) -> int | None:
    """A whole number from 0 to ``maximum`` from an int, a whole Real, or the text or
    bytes of a whole number; None for anything else."""
    if type(value) is int:  # the common case, first: every listing reads a few per row
        return value if 0 <= value <= maximum else None
    if isinstance(value, (bytes, str)):
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        value = int(value) if _WHOLE_NUMBER.fullmatch(value) else None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            value = int(value) if value == int(value) else None  # type: ignore[call-overload]
        except (OverflowError, ValueError):  # inf, nan
            value = None
    else:
        value = None
    return value if value is not None and 0 <= value <= maximum else None


def _owner(owner: object) -> tuple[dict[str, Any], bool]:
    """``(owner dict, readable)`` of a record's owner; one that is not a JSON object
    (written by hand or corrupted) is kept, as text, under ``"unreadable"``."""
    if isinstance(owner, dict):
        return dict(owner), True
    try:
        parsed = json.loads(owner) if owner else {}  # type: ignore[arg-type]  # TypeError
    except (TypeError, ValueError, RecursionError):  # RecursionError: absurdly nested
        parsed = None
    if isinstance(parsed, dict):
        return parsed, True
    return {"unreadable": repr(owner)[:500]}, False


class OwnerRecord(dict[str, Any]):
    """An owner record that carries its JSON encoding (:func:`encode_owner`'s),
    computed once when it is built: the plain record each thread builds once and
    shares among all its acquires (see ``locking._owner_record``). Never modified
    after it is built; a copy (``dict(record)``, ``copy.copy``, ``deepcopy``, a
    pickle) is a plain dict."""

    __slots__ = ("json",)

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.json = _encode(fields)

    # A copy, pickled or not, is a plain dict: it may be changed, its JSON would not.
    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __reduce__(self) -> tuple[type[dict[str, Any]], tuple[dict[str, Any]]]:
        return dict, (dict(self),)


def _encode(owner: dict[str, Any]) -> str:
    return json.dumps(owner, separators=(",", ":"), sort_keys=True)


#: The value types whose equal values always have the same JSON (not float: 0.0 and
#: -0.0 are equal; not containers: their items may be equal but not the same).
PLAIN_JSON_TYPES = frozenset({str, int, bool, type(None)})
_OWNER_JSON_CACHE: dict[tuple[object, ...], str] = {}
_OWNER_JSON_CACHE_SIZE = 1024


def encode_owner(owner: dict[str, Any]) -> str:
    """``owner`` as the compact JSON every backend stores, with sorted keys. An
    :class:`OwnerRecord` brings its own; other records (with ``guards`` or extra
    fields: the same few again and again) are cached by content, because encoding
    is a measurable part of an uncontended acquire."""
    if type(owner) is OwnerRecord:
        return owner.json
    types = tuple(map(type, owner.values()))
    if not PLAIN_JSON_TYPES.issuperset(types) or not all(type(key) is str for key in owner):
        # Equal values with different JSON (0.0 and -0.0, (1,) and (True,), keys 1
        # and True) would share a cache entry: encode anything else every time.
        return _encode(owner)
    # The value types are part of the key: 1 and True are equal, their JSON is not.
    key = (*owner.items(), *types)
    text = _OWNER_JSON_CACHE.get(key)
    if text is not None:
        return text
    text = _encode(owner)
    if len(_OWNER_JSON_CACHE) >= _OWNER_JSON_CACHE_SIZE:
        _OWNER_JSON_CACHE.clear()  # many threads or guards: start over rather than grow
    _OWNER_JSON_CACHE[key] = text
    return text


@dataclass(frozen=True)
class AcquireResult:
    """What one acquire attempt did.

    ``acquired`` is True only when the backend wrote the record; then
    ``fencing_token`` is set. On contention ``retry_after`` is the seconds until the
    current holder's expiry (by the backend's clock), when the backend knows it.
    """

    acquired: bool
    fencing_token: int | None = None
    retry_after: float | None = None

    @classmethod
    def won(cls, fencing_token: int) -> AcquireResult:
        return cls(True, fencing_token=int(fencing_token))

    @classmethod
    def lost(cls, retry_after: float | None = None) -> AcquireResult:
        return cls(False, retry_after=retry_after)


def built_once(owner: object, attribute: str, guard: Any, build: Callable[[], Any]) -> Any:
    """``owner.<attribute>``, set to ``build()`` by the first thread that finds it None
    (the others wait on ``guard`` and take the same): a backend's lazily created
    clients. Callers test the attribute first, so the common case costs nothing."""
    with guard:
        value = getattr(owner, attribute)
        if value is None:
            value = build()
            setattr(owner, attribute, value)
    return value


@dataclass
class ClearResult:
    """What :meth:`BaseLockBackend.clear` removed (or would remove, on a dry run)."""

    backend: str
    names: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.names)


class BaseLockBackend:
    """Stores lock records and performs the atomic operations on them.

    Subclasses implement the synchronous methods; the ``a``-prefixed async twins run
    them in a worker thread unless a subclass has a native async client. Every
    method raises :class:`~django_setnx.exceptions.LockBackendError` (naming the
    alias) when the backend cannot be reached; none of them ever reports a write
    that did not happen.

    A backend instance is shared by every thread of the process (the handler
    creates one per alias), so implementations must be thread-safe.
    """

    #: Whether :meth:`wait` is woken by a release (True) or polls with backoff.
    wakes_waiters = False
    #: Whether each acquire attempt of one :meth:`Lock.acquire` gets a token of its
    #: own (True), rather than every retry reusing the first one's. A backend whose
    #: failed attempt is undone by a release under its token, which may reach a node
    #: after the next attempt was granted there (Redlock: another connection, or a
    #: late one), needs it: that release would delete the next attempt's record.
    #: Backends with a waiter queue keep one token, their place in the queue.
    token_per_attempt = False
    #: Whether :meth:`wait` may have written the caller's record even when it
    #: returns None (Redis: an attempt pipelined behind its blocking read, whose
    #: answer was lost with the connection). The Lock then dates a lock won by the
    #: next attempt from the wait, not from that attempt (see locking._CallClock).
    wait_may_have_written = False
    #: The longest sleep of :meth:`backoff` (seconds).
    max_backoff = MAX_BACKOFF
    #: The keys this backend reads from ``OPTIONS``; the system checks warn about any
    #: other (a misspelt option would otherwise be ignored in silence).
    option_names = frozenset({"MAX_TTL"})
    #: Default of ``OPTIONS["MAX_TTL"]``: the longest ttl this backend accepts.
    default_max_ttl = DEFAULT_MAX_TTL

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        self.alias = alias
        self.params = params
        where = f"SETNX_LOCKS[{alias!r}]"
        options = params.get("OPTIONS")
        if options is not None and not isinstance(options, dict):
            # The system check's E006, said at first use too: a list of pairs would
            # otherwise be taken (dict() of it) where the check refuses it.
            raise ImproperlyConfigured(
                f"{where}['OPTIONS'] must be a dict, got {redacted(options)}."
            )
        self.options = dict(options or {})
        #: Names the setting in the message of a ttl above MAX_TTL (built once here:
        #: the check runs on every acquire).
        self.max_ttl_setting = f"{where}['OPTIONS']['MAX_TTL']"
        #: The last ttl check_ttl accepted, with its ms: the hot path checks once.
        self._last_ttl: tuple[object, int] = (None, 0)
        try:
            self.max_ttl = validate_ttl(
                self.options.get("MAX_TTL", self.default_max_ttl),
                what=self.max_ttl_setting,
                maximum=MAX_TTL_LIMIT,
                where="the most any backend accepts: 10 years",
            )
            self.default_ttl = validate_ttl(
                params.get("TTL", min(DEFAULT_TTL, self.max_ttl)),
                what=f"{where}['TTL']",
                maximum=self.max_ttl,
                where=f"{where}['OPTIONS']['MAX_TTL']",
            )
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(str(exc)) from exc

    def __repr__(self) -> str:
        return f"<{type(self).__name__} alias={self.alias!r}>"

    @classmethod
    def check_params(cls, alias: str, params: dict[str, Any]) -> builtins.list[Any]:
        """Return a list of ``django.core.checks`` messages for this alias' settings.

        Called by the system checks without instantiating the backend, so it must not
        connect anywhere.
        """
        return []

    # -- the atomic operations --------------------------------------------------

    def acquire(
        self, name: str, token: str, ttl: float, owner: dict[str, Any], wait: float | None = 0.0
    ) -> AcquireResult:
        """Create the record for ``name`` unless a non-expired one exists.

        An expired record is taken over in the same atomic step, so of two racers
        exactly one wins. ``ttl`` is in seconds; ``owner`` is a JSON-serialisable
        dict. ``wait`` says how long the caller will keep retrying if refused
        (seconds; ``None``: indefinitely; ``0``: it will not retry), so a backend
        that wakes waiters may queue it and hand the lock to waiters before newcomers;
        ``token`` stays the same across one caller's retries. Returns an
        :class:`AcquireResult`; on success its fencing token is strictly greater than
        every earlier one for this name.
        """
        raise NotImplementedError

    def release(self, name: str, token: str) -> bool:
        """Delete the record if its token is ``token``. Returns True if deleted.

        A record that expired but was not taken over still carries our token, so it
        is still ours to release (nobody else held the lock meanwhile).
        """
        raise NotImplementedError

    def extend(self, name: str, token: str, ttl: float) -> bool:
        """Set the expiry to backend-now + ``ttl`` if the token matches. Returns bool."""
        raise NotImplementedError

    def owns(self, name: str, token: str) -> bool:
        """Return True if ``name`` is held (not expired) under ``token``."""
        raise NotImplementedError

    def get(self, name: str) -> LockInfo | None:
        """Return the :class:`LockInfo` of ``name`` (held or stale), or None."""
        raise NotImplementedError

    def get_many(self, names: Iterable[str]) -> dict[str, LockInfo | None]:
        """Return ``{name: LockInfo or None}`` for every name in ``names``, each as
        :meth:`get` returns it, in as few round trips as the backend allows (a
        semaphore's slots, the admin's semaphore headings). This default calls
        :meth:`get` once per name."""
        return {name: self.get(name) for name in dict.fromkeys(names)}

    def list(
        self, *, state: str | None = None, name_glob: str | None = None
    ) -> Iterator[LockInfo]:
        """Yield a :class:`LockInfo` for every record, held and stale, name order
        where the backend can. ``state`` (``"held"``/``"stale"``) and ``name_glob``
        (a glob, see ``django_setnx.globs``) filter. Streams: never loads every record at once.
        """
        raise NotImplementedError

    def delete(self, name: str, fencing_token: int | None = None) -> LockInfo | None:
        """Force-release ``name`` whoever holds it; a queued waiter gets it next.

        With ``fencing_token``, only if the record still carries that fencing token
        (``0``: a record that cannot be read, see :meth:`LockInfo.unreadable`), in one
        atomic step, so a lock that changed hands is never removed. Returns the
        removed :class:`LockInfo`, or None if nothing was removed (no record, or
        another fencing token).
        """
        raise NotImplementedError

    def page(
        self,
        *,
        state: str | None = None,
        name_glob: str | None = None,
        ordering: Iterable[tuple[str, object]] = (),
        offset: int = 0,
        limit: int = 100,
    ) -> LockPage:
        """Return a :class:`~django_setnx.backends.paging.LockPage`: the matching
        locks ``offset`` to ``offset + limit`` in ``ordering`` (``(field,
        descending)`` pairs of :data:`~django_setnx.backends.paging.SORT_FIELDS`, then
        by name), with their total when counting is cheap. ``limit=0`` only counts.

        The default reads :meth:`list` (see
        :func:`~django_setnx.backends.paging.page_of_stream`); backends that can sort
        or count on the server override it. Raises ValueError for an unknown state,
        field or a malformed glob before anything is read.
        """
        ordering = check_ordering(ordering)
        offset, limit = check_window(offset, limit)
        return page_of_stream(self.list(state=state, name_glob=name_glob), ordering, offset, limit)

    def clear(
        self,
        *,
        include_held: bool = False,
        name_glob: str | None = None,
        older_than: float | None = None,
        dry_run: bool = False,
        progress: Callable[[builtins.list[str]], object] | None = None,
    ) -> ClearResult:
        """Remove stale records (and held ones too with ``include_held``).

        ``older_than`` (seconds) keeps records acquired more recently than that.
        ``progress``, if given, is called with each batch of removed names. Returns a
        :class:`ClearResult`. With ``dry_run`` nothing is removed and the result lists
        what would have been.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release connections held by this backend (connections are reopened lazily)."""

    def writes_wait_for_transaction(self, using: str) -> bool:
        """Return True if this backend cannot write while the calling thread's
        connection to database ``using`` has a transaction open (SQLite: one writer
        at a time, on the same database). The default: False."""
        return False

    def reads_wait_for_transaction(self, using: str) -> bool:
        """Return True if even a read of this backend waits while the calling thread's
        connection to database ``using`` has a transaction open that wrote (SQLite
        without WAL, on the same database). The default: False."""
        return False

    def validity(self, ttl: float) -> float:
        """Return how long (seconds) a lock acquired with ``ttl`` is certainly still
        held, counted from before the write: ``ttl``, minus whatever the backend must
        allow for (Redlock: the clock-drift allowance). Renewal deadlines use it."""
        return ttl

    # -- waiting ----------------------------------------------------------------

    def backoff(self, attempt: int, max_wait: float | None, retry_after: float | None) -> float:
        """Seconds to sleep before attempt ``attempt + 1``: capped exponential with
        jitter, never past ``max_wait`` nor much past the holder's expiry."""
        ceiling = min(self.max_backoff, BASE_BACKOFF * (2 ** min(attempt, 16)))
        delay = random.uniform(ceiling / 2, ceiling)
        if retry_after is not None:
            # Wake up right after the holder's expiry rather than up to MAX_BACKOFF late.
            delay = min(delay, max(retry_after, 0) + 0.001)
        if max_wait is not None:
            delay = min(delay, max_wait)
        return max(delay, 0)

    def retry_delay(
        self, token: str, attempt: int, max_wait: float | None, retry_after: float | None
    ) -> float:
        """Seconds the caller with ``token`` sleeps before its next attempt, in the
        default :meth:`wait` and :meth:`await_release`: :meth:`backoff`, unless a
        backend paces some waiters differently."""
        return self.backoff(attempt, max_wait, retry_after)

    def wait(
        self,
        name: str,
        *,
        token: str,
        attempt: int,
        max_wait: float | None,
        retry_after: float | None,
    ) -> AcquireResult | None:
        """Block until the lock may be free: a release, an expiry or ``max_wait``.

        ``token`` is the caller's, as in its refused :meth:`acquire`. Returns None
        (the caller retries), or ``AcquireResult.won(fencing)`` when a backend that
        queues waiters handed the lock to this caller while it waited (it holds the
        lock). A backend that made the caller's next attempt itself at the end of
        the wait (Redis sends it right behind its blocking read) returns that
        attempt's result, won or refused: the caller takes a refusal as the result
        of its next :meth:`acquire` (queued again, with its ``retry_after``) and
        waits again without making one. A won result's expiry must have been
        written during this call: the Lock's ``auto_renew`` dates the lock from the
        call's start (see locking._CallClock). The default sleeps
        :meth:`retry_delay`; backends that can be woken by a release override it.
        Returning early is always allowed.
        """
        time.sleep(self.retry_delay(token, attempt, max_wait, retry_after))
        return None

    def stop_waiting(self, name: str, token: str) -> AcquireResult | None:
        """The caller whose refused attempts used ``token`` gave up waiting.

        Backends that queue waiters (see ``wait`` in :meth:`acquire`) withdraw it
        here, so its place holds nothing back. Returns ``AcquireResult.won(fencing)``
        if the lock was handed to it before it withdrew (it holds the lock and must
        use or release it), else None; the default does nothing and returns None.
        """
        return None

    async def astop_waiting(self, name: str, token: str) -> AcquireResult | None:
        """Async twin of :meth:`stop_waiting`."""
        if type(self).stop_waiting is BaseLockBackend.stop_waiting:
            return None
        return await self._in_executor(self.stop_waiting)(name, token)

    async def await_release(
        self,
        name: str,
        *,
        token: str,
        attempt: int,
        max_wait: float | None,
        retry_after: float | None,
    ) -> AcquireResult | None:
        """Async twin of :meth:`wait`. A backend that wakes its waiters waits in a
        thread; if the caller is cancelled meanwhile, whatever the wait's own attempt
        won is released when it ends (see :meth:`_undone_if_cancelled`)."""
        if self.wakes_waiters:
            return await self._undone_if_cancelled(
                lambda: self.wait(
                    name, token=token, attempt=attempt, max_wait=max_wait, retry_after=retry_after
                ),
                name,
                token,
            )
        await asyncio.sleep(self.retry_delay(token, attempt, max_wait, retry_after))
        return None

    # -- async twins ------------------------------------------------------------

    def _for_executor(self, func: Callable[_P, _R]) -> Callable[_P, _R]:
        """``func`` as the async twins run it in a thread other than the caller's:
        here, as it is. A backend with a connection per thread wraps it so that
        each call borrows one of a few shared connections instead (see
        DatabaseBackend)."""
        return func

    def _for_background(self, func: Callable[_P, _R], patience: float) -> Callable[_P, _R]:
        """``func`` as a thread of ours (the renewal of an ``auto_renew`` lock) runs
        it: here, as it is. A backend with a connection per thread wraps it so that
        each call borrows a shared connection if one frees up within ``patience``
        seconds (see DatabaseBackend). Such a thread calls
        :meth:`_background_thread_done` as it ends."""
        return func

    def _background_thread_done(self) -> None:
        """Called by a thread of ours as it ends: free what it opened (nothing here)."""
        return None

    def _in_executor(self, func: Callable[_P, _R]) -> Callable[_P, Coroutine[Any, Any, _R]]:
        """``func`` as a coroutine function that runs it in the event loop's default
        executor (see :meth:`_for_executor`)."""
        return sync_to_async(self._for_executor(func), thread_sensitive=False)

    async def aacquire(
        self, name: str, token: str, ttl: float, owner: dict[str, Any], wait: float | None = 0.0
    ) -> AcquireResult:
        """Async twin of :meth:`acquire` (returns an :class:`AcquireResult`), run in a
        thread. A caller cancelled while the statement runs does not stop it: when it
        ends, the thread itself undoes it (releases what it won, or withdraws the
        place next in line a refused attempt took), even if the event loop is gone
        by then (``asyncio.run`` cancels, then waits for its executor's threads)."""
        result = await self._undone_if_cancelled(
            lambda: self.acquire(name, token, ttl, owner, wait), name, token
        )
        assert result is not None  # acquire() always returns an AcquireResult
        return result

    async def _undone_if_cancelled(
        self, attempt: Callable[[], AcquireResult | None], name: str, token: str
    ) -> AcquireResult | None:
        """Run ``attempt`` (an acquire, or a wait that may end with one) in a thread
        and return its result. A caller cancelled meanwhile does not stop it: when it
        ends, the thread itself undoes what it did (see :meth:`_undo_attempt`), even
        if the event loop is gone by then (``asyncio.run`` cancels, then waits for its
        executor's threads)."""
        guard = threading.Lock()
        state: dict[str, Any] = {}

        def guarded() -> AcquireResult | None:
            result = attempt()
            with guard:
                state["done"] = True
                state["result"] = result
                abandoned = state.get("abandoned", False)
            if abandoned and result is not None:
                self._undo_attempt(name, token, result)
            return result

        future = asyncio.get_running_loop().run_in_executor(None, self._for_executor(guarded))
        try:
            return await future
        except asyncio.CancelledError:
            with guard:
                state["abandoned"] = True
                finished = state.get("result") if state.get("done") else None
            if finished is not None:
                # It ended just before the cancellation reached us: undo it here, in
                # a thread (a database backend refuses sync calls in the loop).
                threading.Thread(
                    target=self._for_executor(self._undo_attempt),
                    args=(name, token, finished),
                    name="django-setnx-undo-acquire",
                ).start()
            raise

    def _undo_attempt(self, name: str, token: str, result: AcquireResult) -> None:
        """After a cancelled acquire (or wait): release what its attempt won, or
        withdraw the place next in line a refused attempt may have queued for (a
        release would otherwise be left to a caller that is gone)."""
        try:
            won = result.acquired
            if not won:
                handed = self.stop_waiting(name, token)
                won = handed is not None and handed.acquired
            if won:
                self.release(name, token)
        except Exception:
            logging.getLogger("django_setnx").warning(
                "Could not undo a cancelled acquire of %r", name, exc_info=True
            )

    async def arelease(self, name: str, token: str) -> bool:
        """Async twin of :meth:`release`; returns True if the record was deleted."""
        return await self._in_executor(self.release)(name, token)

    async def aextend(self, name: str, token: str, ttl: float) -> bool:
        """Async twin of :meth:`extend`; returns True if the expiry was set."""
        return await self._in_executor(self.extend)(name, token, ttl)

    async def aowns(self, name: str, token: str) -> bool:
        """Async twin of :meth:`owns`; returns True if held under ``token``."""
        return await self._in_executor(self.owns)(name, token)

    async def aget(self, name: str) -> LockInfo | None:
        """Async twin of :meth:`get`; returns a :class:`LockInfo` or None."""
        return await self._in_executor(self.get)(name)

    async def aget_many(self, names: Iterable[str]) -> dict[str, LockInfo | None]:
        """Async twin of :meth:`get_many`; returns ``{name: LockInfo or None}``."""
        return await self._in_executor(self.get_many)(list(names))

    async def adelete(self, name: str, fencing_token: int | None = None) -> LockInfo | None:
        """Async twin of :meth:`delete`; returns the deleted record's :class:`LockInfo`,
        or None."""
        return await self._in_executor(self.delete)(name, fencing_token)

    async def apage(self, **kwargs: Any) -> LockPage:
        """Async twin of :meth:`page` (same keyword arguments); returns a
        :class:`~django_setnx.backends.paging.LockPage`."""
        return await self._in_executor(self.page)(**kwargs)

    async def aclear(self, **kwargs: Any) -> ClearResult:
        """Async twin of :meth:`clear` (same keyword arguments); returns a
        :class:`ClearResult`."""
        return await self._in_executor(self.clear)(**kwargs)

    # -- helpers for subclasses -------------------------------------------------

    def check_ttl(self, ttl: object, what: str = "ttl") -> int:
        """Validate ``ttl`` (seconds) against this backend's ``MAX_TTL`` before anything
        is written; returns it in whole milliseconds. Raises TypeError/ValueError
        naming the value, the maximum and the alias."""
        last = self._last_ttl
        if last[0] == ttl and type(ttl) is float:
            # The same ttl as last time (a Lock passes its validated float): checked.
            return last[1]
        ttl_ms = ttl_to_ms(
            validate_ttl(ttl, what=what, maximum=self.max_ttl, where=self.max_ttl_setting)
        )
        self._last_ttl = (ttl, ttl_ms)  # one tuple: threads read a consistent pair
        return ttl_ms

    @contextlib.contextmanager
    def translate_errors(
        self, *error_types: type[BaseException], action: str = "operation"
    ) -> Iterator[None]:
        """Re-raise ``error_types`` as :class:`~django_setnx.exceptions.LockBackendError` naming this alias."""
        try:
            yield
        except error_types as exc:
            raise LockBackendError(
                self.alias, f"{action} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def filter_infos(
        self, infos: Iterable[LockInfo], *, state: str | None = None, name_glob: str | None = None
    ) -> Iterator[LockInfo]:
        """Apply the ``state``/``name_glob`` filters of :meth:`list` in Python."""
        matcher = compile_glob(name_glob).match if name_glob else None
        for info in infos:
            if state is not None and info.state != state:
                continue
            if matcher is not None and not matcher(info.name):
                continue
            yield info
