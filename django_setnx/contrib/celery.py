"""Celery integration: run-exclusive and enqueue-once tasks.

Install with ``pip install django-setnx[celery]``. Every feature is an option of one
Task base class, :class:`ExclusiveTask`, given to ``@app.task`` (or set as class
attributes of a subclass). It builds on Celery's Django task class (``DjangoTask``,
so ``delay_on_commit()`` keeps working); :class:`ExclusiveTaskMixin` carries the
same behaviour onto any task class of your own
(``class MyTask(ExclusiveTaskMixin, MyBaseTask)``)::

    from celery import shared_task
    from django_setnx.contrib.celery import AlreadyQueued, ExclusiveTask

    # run-exclusive: never two runs for one account at once, on any worker
    @shared_task(base=ExclusiveTask, lock_name="report:{account_id}", lock_ttl=300,
                 on_contention="retry", lock_retry_countdown=10, lock_backend="redis")
    def build_report(account_id, month):
        ...

    # enqueue-once: a second delay() while one is queued or running is refused
    @shared_task(base=ExclusiveTask, once_policy="raise", once_name="sync:{shop_id}",
                 once_ttl=3600)
    def sync_shop(shop_id):
        ...

    sync_shop.delay(7)
    try:
        sync_shop.delay(7)
    except AlreadyQueued as exc:
        print("already queued as", exc.task_id)

    # both, with a silent drop of duplicates (delay() returns None)
    @shared_task(base=ExclusiveTask, bind=True, lock_name="index:{doc_id}",
                 on_contention="skip", once_policy="drop", max_retries=5)
    def reindex(self, doc_id):
        ...

To make every task of an app accept these options, make it the app's task class:
``Celery("proj", task_cls="django_setnx.contrib.celery:ExclusiveTask")``; a task with
neither ``lock_name`` nor ``once_policy`` behaves exactly like a plain (Django) Task.

Lock names are ``str.format`` templates filled from the task's arguments exactly like
:func:`~django_setnx.locked` (``"report:{account_id}"``, ``"{order.pk}"``), or a
callable ``name(*args, **kwargs) -> str``. A template field the task does not take is
an ``ImproperlyConfigured`` when the task is defined.

Run-exclusive (``lock_name``)
-----------------------------

The worker takes the lock ``lock_name`` (in ``lock_backend``) around the task body,
with ``guards="celery task <name>[<id>]"`` in its owner record, and releases it when
the body ends, however it ends. ``lock_auto_renew`` (default True) keeps extending it
every ``lock_ttl``/3 while the body runs, so a long task never loses it, while a
worker that dies (SIGKILL, OOM, power loss) stops renewing and the lock is free
``lock_ttl`` seconds later. When the lock is held elsewhere (after waiting
``lock_timeout`` seconds, default 0), ``on_contention`` decides:

- ``"raise"`` (default, as for ``@locked``): the task fails with ``LockNotAcquired``;
- ``"skip"``: the task succeeds at once with result ``None`` without running;
- ``"retry"``: ``self.retry(countdown=lock_retry_countdown, max_retries=lock_max_retries)``
  (``None``: the task's ``max_retries``); once retries are exhausted the task fails
  with ``LockNotAcquired``.

Override :meth:`ExclusiveTaskMixin.lock_contended` for anything else. The run lock is a
plain lock: ``lock("report:7")`` or ``@locked("report:{account_id}")`` elsewhere
exclude the task too. A direct call ``task(...)`` runs the body under the lock as
well (``"retry"`` then raises ``LockNotAcquired``, since there is nothing to retry).
When the body calls ``self.retry()``, the run lock is released *before* the retry
message is sent, so even a ``countdown=0`` retry never contends with its own attempt.
If the lock was lost while the body ran (renewal impossible until it expired and
someone took it over), a body that succeeded still fails the task with
``LockNotOwned``, as ``@locked`` does: that run was not exclusive.

Enqueue-once (``once_policy``)
------------------------------

``apply_async``/``delay`` (and signatures, groups and chains, which call it) first
generate the task id, then take the lock ``once_name`` (default:
``"celery-once:<task name>:<filled lock_name>"``, or, without ``lock_name``, a digest
of all the arguments) for ``once_ttl`` seconds plus any ``countdown``/``eta`` delay,
with the task name and new id in the owner record. If it is held, the call raises
:class:`AlreadyQueued` (``once_policy="raise"``) or sends nothing and returns ``None``
(``"drop"``). The lock's token travels in the message headers
(``django_setnx_once_token`` and ``django_setnx_once_name``), so the worker that runs
the task can release exactly that enqueue's lock with the backend's token-checked
``release(name, token)``:

- on success, failure (the task raised), skip, ``Ignore``, ``Reject(requeue=False)``,
  retry exhaustion, and a revoke or an expiry (the ``task_revoked`` signal); a
  revoke of a message still waiting for its ``countdown``/``eta`` in a worker frees
  the lock when the revoke arrives, not at the ETA;
- **not** when a retry was sent (``self.retry()``, ``autoretry_for``, or
  ``on_contention="retry"``): the retry message keeps the headers, the lock is
  extended to cover its countdown, and the run that ends the chain of retries
  releases it; nor on ``Reject(requeue=True)``. ``self.retry()`` releases the run
  lock before the retry is sent, so that the retry does not meet it; with
  ``throw=False`` the body goes on after the call, so the run lock is kept until it
  returns (a retry due before then meets it, as any other run would).

While the task runs, the worker keeps the once lock extended (every ``once_ttl``/3,
``once_auto_renew``), so ``once_ttl`` only has to cover the time a message may wait
in the queue. If the worker dies, nobody releases it and it expires ``once_ttl``
seconds after the last renewal. The owner record keeps the enqueuer's host and pid.
``app.send_task("name")`` bypasses ``apply_async`` and so this check. One call can
override the task's policy: ``apply_async(..., once_policy="drop")``.

``delay_on_commit()``/``apply_async_on_commit()`` (Celery's ``DjangoTask``) check
the once lock when the transaction commits, since that is when the message is sent.
A duplicate met then is dropped and logged at WARNING whatever ``once_policy``
says: the caller's code has returned, so there is nobody to raise
:class:`AlreadyQueued` to, and an exception there would come out of ``atomic()``
after the data was committed and stop Django from running the transaction's later
``on_commit`` callbacks (another task's ``delay_on_commit``, an e-mail). Call
``delay()`` inside ``transaction.on_commit`` yourself to handle AlreadyQueued.

A derived ``once_name`` longer than a lock name may be (200 characters) keeps its
first 150 characters and ends with a digest of the whole, so long arguments never
make a valid task fail.

Canvases and periodic tasks
---------------------------

A duplicate met *inside a canvas* (a chain's next step, a group or chord member, a
link callback: some caller already waits on its result) is never silently dropped
and never blamed on the step before: its message is sent as usual, marked as a
duplicate, and the worker settles it without running the body. With ``"drop"``
the task succeeds with result ``None`` (the chain goes on, the chord counts it);
with ``"raise"`` the task itself fails with :class:`AlreadyQueued` (the chain stops
there, the chord's error callback runs, ``result.get()`` raises AlreadyQueued).

For a periodic task, use ``once_policy="drop"`` (or ``"options": {"once_policy":
"drop"}`` in its ``beat_schedule`` entry): a tick that finds the previous run still
queued or running is skipped and logged at INFO. With ``"raise"``, Celery beat logs
every such tick as a scheduling error with a traceback, since the exception is what
"raise" asks for.

``acks_late`` and redelivery
----------------------------

With ``acks_late=True`` a message whose worker died is delivered again (with the
Redis and SQS brokers only after their ``visibility_timeout``; with
``task_reject_on_worker_lost`` at once). The redelivered run behaves like any run:

- run lock: the dead worker's lock expired ``lock_ttl`` after it stopped renewing,
  so the redelivered task takes it; while the first worker still runs (a Redis
  ``visibility_timeout`` shorter than the task, which delivers the message twice) the
  second delivery meets the lock and ``on_contention`` applies - the run lock is what
  turns at-least-once delivery into at-most-one-at-a-time execution;
- once lock: the redelivered message carries the same token; the worker re-extends
  the lock (a record that expired but was not taken over is still this enqueue's)
  and releases it at the end. If the lock expired *and* a duplicate was enqueued
  meanwhile, the redelivered task still runs (it was accepted long ago) and leaves
  the duplicate's lock alone; give such tasks a ``lock_name`` too so the two never
  overlap. Without ``acks_late`` a killed worker's message is lost, and the once
  lock simply expires.

Beware that with the ``solo`` pool every message behaves as if ``acks_late`` were
set when the worker is killed: Celery sends acks (early ones too) from the worker's
event loop, which a running solo task blocks, so the ack only leaves once the task
returns, and a SIGKILLed solo worker's message is delivered again (with Redis, after
its ``visibility_timeout``). The locks handle that redelivery as described above.

Options (``@app.task(...)`` keywords or class attributes)
---------------------------------------------------------

``lock_name`` (None), ``lock_ttl`` (None: the backend's ``TTL``), ``lock_backend``
("default"), ``lock_timeout`` (0), ``lock_limit`` (None: a lock; N: a semaphore, at
most N runs at once), ``lock_auto_renew`` (True), ``on_contention``
("raise"), ``lock_retry_countdown`` (10), ``lock_max_retries`` (None);
``once_policy`` (None: off; "raise" or "drop"), ``once_name`` (None: derived),
``once_ttl`` (3600), ``once_backend`` (None: ``lock_backend``), ``once_auto_renew``
(True); ``lock_release_on_commit`` (True) and ``lock_using`` (None: ``"default"``):
a body run inside a transaction (eagerly, or called directly, in ``atomic()``)
releases its run lock after that transaction commits.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import inspect
import json
import logging
import math
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured

try:
    from celery import Task
    from celery import signals as celery_signals
    from celery.exceptions import Reject, Retry, TimeLimitExceeded, WorkerLostError
    from celery.utils import uuid
    from celery.utils.time import maybe_make_aware
except ImportError as exc:  # pragma: no cover - exercised without celery installed
    raise ImproperlyConfigured(
        "django_setnx.contrib.celery needs Celery (>= 5.3): pip install django-setnx[celery]"
    ) from exc

try:  # Celery >= 5.4: the Django task class (delay_on_commit)
    from celery.contrib.django.task import DjangoTask as _DefaultBase
except ImportError:  # pragma: no cover - older Celery
    _DefaultBase = Task

from .. import dead_owners
from ..backends.base import LockInfo
from ..conf import DEFAULT_LOCK_ALIAS, MAX_NAME_LENGTH
from ..decorators import LockName
from ..exceptions import LockBackendError, LockError, LockNotAcquired
from ..handler import locks
from ..locking import Lock
from ..semaphore import Semaphore, validate_limit
from ..transactions import deferred_lock
from ..validation import slot_record, validate_name, validate_timeout, validate_ttl

if TYPE_CHECKING:
    #: (run lock name builder or None, once lock name builder or None, signature).
    _NameBuilders = tuple[LockName | None, LockName | None, inspect.Signature]
    #: A decorator that returns its function unchanged (Celery's signal ``connect``,
    #: untyped: cast to this so that the handlers keep their signatures).
    _F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "ONCE_NAME_HEADER",
    "ONCE_TOKEN_HEADER",
    "AlreadyQueued",
    "ExclusiveTask",
    "ExclusiveTaskMixin",
]

logger = logging.getLogger("django_setnx.celery")

#: Message headers that carry the enqueue-once lock from the enqueuer to the worker.
ONCE_TOKEN_HEADER = "django_setnx_once_token"
ONCE_NAME_HEADER = "django_setnx_once_name"
#: Marks a duplicate sent inside a canvas: the worker settles it by this policy.
DUPLICATE_HEADER = "django_setnx_duplicate"

SKIP = "skip"
RETRY = "retry"
RAISE = "raise"
DROP = "drop"
CONTENTION_POLICIES = (RAISE, SKIP, RETRY)
ONCE_POLICIES = (RAISE, DROP)
#: Options Celery sets when a task is sent as part of a canvas, or with callbacks:
#: someone already waits on its result (see "Canvases and periodic tasks").
CANVAS_OPTIONS = ("chain", "group_id", "chord", "parent_id", "link", "link_error")
#: A derived once name longer than the limit keeps this many characters, then a digest.
KEPT_NAME_CHARACTERS = 150

# Attributes set on the task's request (celery.app.task.Context) during a run.
_RUN_LOCK_ATTR = "_django_setnx_run_lock"
_ONCE_ATTR = "_django_setnx_once"
_RETRY_SENT_ATTR = "_django_setnx_retry_sent"


class AlreadyQueued(LockNotAcquired):
    """``apply_async``/``delay`` refused a duplicate of a task that is queued or running.

    ``name`` is the enqueue-once lock name, ``task_name`` the task, ``task_id`` the
    id of the copy that holds the lock (when known) and ``info`` its
    :class:`~django_setnx.backends.base.LockInfo` (or None).
    """

    def __init__(
        self,
        name: str,
        task_name: str | None = None,
        task_id: str | None = None,
        info: LockInfo | dict[str, Any] | None = None,
    ) -> None:
        holder = f" as {task_id}" if task_id else ""
        super().__init__(
            name,
            0,
            (
                f"Task {task_name} is already queued or running{holder} (enqueue-once lock "
                f"{name!r}); not enqueued again."
            ),
        )
        if isinstance(info, dict):  # rebuilt from args (pickle, Celery's JSON)
            info = LockInfo(**info)
        # ``info`` travels as a plain dict, so that JSON carries it whole too.
        self.args = (name, task_name, task_id, None if info is None else asdict(info))
        self.task_name = task_name
        self.task_id = task_id
        self.info = info


def _header(request: Any, key: str) -> Any:
    """A custom message header of ``request``: the worker flattens custom headers
    into request attributes, ``apply()`` (eager mode) keeps them in ``headers``."""
    value = getattr(request, key, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(key)
    return value


def _delay_seconds(
    countdown: float | str | None = None,
    eta: datetime.datetime | str | None = None,
    timezone: datetime.tzinfo | None = None,
) -> float:
    """Seconds until a message with this countdown/eta is due (0 if due now). A naive
    ``eta`` is read in ``timezone``, the Celery app's (``app.timezone``), as Celery
    reads it: not in the process' local time, which Django sets to its TIME_ZONE."""
    if countdown is not None:
        return max(float(countdown), 0.0)
    if eta is not None:
        due = datetime.datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if due.tzinfo is None:
            due = maybe_make_aware(due, timezone or datetime.timezone.utc)
        return max((due - datetime.datetime.now(datetime.timezone.utc)).total_seconds(), 0.0)
    return 0.0


def _validate_attribute(
    where: str, attribute: str, validate: Callable[[Any], Any], value: Any
) -> None:
    """Run ``validate(value)``; its TypeError/ValueError (whose message names neither
    the task nor the attribute: "timeout must be...") becomes an ImproperlyConfigured
    that names both."""
    try:
        validate(value)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"{where}: {attribute}: {exc}") from exc


def _find_run(cls: type) -> Callable[..., Any] | None:
    """The task's body function as a bound-looking callable (first param dropped when
    it is a method), or None while ``run`` is still Celery's abstract one."""
    for klass in cls.__mro__:
        if klass is Task:
            return None
        run = klass.__dict__.get("run")
        if run is None:
            continue
        if isinstance(run, staticmethod):
            return run.__func__
        # A plain function in the class (bind=True or a class-based task): as a method
        # its first parameter is the task itself, not an argument of the call.
        return types.MethodType(run, cls)
    return None


def _canonical(value: object) -> Any:
    """``value`` as JSON-able data with one spelling per value: dict items ordered by
    their keys' canonical JSON (so mixed key types sort), sets sorted, tuples as
    lists, anything else by ``repr``."""
    if isinstance(value, dict):
        items = [(_canonical(k), _canonical(v)) for k, v in value.items()]
        return {"{}": sorted(items, key=lambda kv: json.dumps(kv[0], sort_keys=True))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"set": sorted((_canonical(v) for v in value), key=json.dumps)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return {"repr": repr(value)}


def _bounded_name(name: str) -> str:
    """``name``, or for one over the limit its first KEPT_NAME_CHARACTERS characters
    and a digest of the whole (a derived name must never make a valid call fail)."""
    if len(name) <= MAX_NAME_LENGTH:
        return name
    digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{name[:KEPT_NAME_CHARACTERS]}:{digest}"


def _once_lock(task: ExclusiveTaskMixin, name: str, ttl: float) -> Lock:
    return Lock(name, ttl, backend=task._once_backend_alias(), auto_renew=task.once_auto_renew)


class ExclusiveTaskMixin:
    """Run-exclusive and enqueue-once locks for a Celery task class (see the module
    documentation). Put it before the task class it extends."""

    if TYPE_CHECKING:
        # Provided by the Celery Task class the mixin extends.
        name: str
        request: Any
        app: Any
        acks_late: bool
        max_retries: int | None
        default_retry_delay: float | None

        def run(self, *args: Any, **kwargs: Any) -> Any: ...

        # Set on each class by _setnx_check_options / _setnx_name_builders.
        _setnx_names: ClassVar[_NameBuilders | None]

    #: Run-exclusive: name template (or callable) of the lock held while the body runs.
    lock_name: str | Callable[..., str] | None = None
    #: Seconds; None: the backend's TTL. A dead worker's lock is free after this long.
    lock_ttl: float | None = None
    #: Alias in SETNX_LOCKS of the run lock (and, by default, of the once lock).
    lock_backend: str = DEFAULT_LOCK_ALIAS
    #: Seconds to wait for the run lock before ``on_contention`` applies.
    lock_timeout: float | None = 0
    #: None: the run lock is a lock. An int N: it is a semaphore of N slots, so at
    #: most N runs of the same ``lock_name`` at once.
    lock_limit: int | None = None
    #: Extend the run lock every ttl/3 while the body runs.
    lock_auto_renew: bool = True
    #: "raise" (LockNotAcquired), "skip" (result None) or "retry".
    on_contention: str = RAISE
    #: Countdown of a retry on contention.
    lock_retry_countdown: float | None = 10
    #: Retries on contention; None: the task's ``max_retries``.
    lock_max_retries: int | None = None
    #: When the body runs inside a transaction on one of ``lock_using`` (eager
    #: tasks, or a direct call, made in ``atomic()`` or under ``ATOMIC_REQUESTS``),
    #: release the run lock after that transaction commits (at once on rollback).
    lock_release_on_commit: bool = True
    #: Database alias(es) whose transactions count; None: ``"default"``.
    lock_using: str | Sequence[str] | None = None

    #: Enqueue-once: None (off), "raise" (AlreadyQueued) or "drop" (apply_async returns None).
    once_policy: str | None = None
    #: Name template (or callable) of the enqueue-once lock; None: derived.
    once_name: str | Callable[..., str] | None = None
    #: Seconds the once lock outlives a queued message (plus its countdown/eta).
    once_ttl: float = 3600
    #: Alias of the once lock; None: ``lock_backend``.
    once_backend: str | None = None
    #: Extend the once lock every once_ttl/3 while the task runs.
    once_auto_renew: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._setnx_check_options()

    # -- configuration ----------------------------------------------------------

    @classmethod
    def _setnx_check_options(cls) -> None:
        where = f"task {cls.__dict__.get('name') or cls.__qualname__}"
        if cls.on_contention not in CONTENTION_POLICIES:
            raise ImproperlyConfigured(
                f"{where}: on_contention must be one of {', '.join(CONTENTION_POLICIES)}, "
                f"got {cls.on_contention!r}."
            )
        if cls.once_policy is not None and cls.once_policy not in ONCE_POLICIES:
            raise ImproperlyConfigured(
                f"{where}: once_policy must be None, 'raise' or 'drop', got {cls.once_policy!r}."
            )
        try:
            if cls.lock_ttl is not None:
                validate_ttl(cls.lock_ttl, what=f"{where}: lock_ttl")
            validate_ttl(cls.once_ttl, what=f"{where}: once_ttl")
            _validate_attribute(where, "lock_timeout", validate_timeout, cls.lock_timeout)
            if cls.lock_limit is not None:
                _validate_attribute(where, "lock_limit", validate_limit, cls.lock_limit)
            countdown = cls.lock_retry_countdown
            if countdown is not None and (
                not isinstance(countdown, (int, float))  # what Celery's timedelta takes
                or isinstance(countdown, bool)
                or not 0 <= countdown < math.inf
            ):
                raise ValueError(
                    f"{where}: lock_retry_countdown must be None or a number of seconds "
                    f">= 0, got {countdown!r}."
                )
            retries = cls.lock_max_retries
            if retries is not None and (
                not isinstance(retries, int) or isinstance(retries, bool) or retries < 0
            ):
                raise ValueError(
                    f"{where}: lock_max_retries must be None or an int >= 0, got {retries!r}."
                )
            for attribute in ("lock_name", "once_name"):
                if getattr(cls, attribute) == "":
                    # Falsy: it would turn the lock off (lock_name) or fall back to the
                    # derived name (once_name) without a word (review r164).
                    raise ValueError(
                        f"{where}: {attribute} must be a non-empty name template, or None."
                    )
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(str(exc)) from exc
        # Build the name templates now, so a field the task does not take fails at
        # definition time rather than on the first run.
        cls._setnx_names = None
        if _find_run(cls) is not None:
            cls._setnx_name_builders()

    @classmethod
    def _setnx_name_builders(cls) -> _NameBuilders:
        """(run lock name builder or None, once lock name builder or None, signature)."""
        builders: _NameBuilders | None = cls.__dict__.get("_setnx_names")
        if builders is None:
            run = _find_run(cls)
            if run is None:
                raise ImproperlyConfigured(f"{cls.__qualname__} has no run method.")
            make_lock = LockName(run, cls.lock_name) if cls.lock_name else None
            make_once = LockName(run, cls.once_name) if cls.once_name else None
            builders = (make_lock, make_once, inspect.signature(run))
            cls._setnx_names = builders
        return builders

    def _once_backend_alias(self) -> str:
        return self.once_backend or self.lock_backend

    def run_lock_name(self, args: Iterable[Any], kwargs: Mapping[str, Any]) -> str | None:
        """The run lock's name for a call with ``args``/``kwargs`` (None if off)."""
        make_lock = self._setnx_name_builders()[0]
        return None if make_lock is None else validate_name(make_lock(tuple(args), dict(kwargs)))

    def once_lock_name(self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        """The enqueue-once lock's name for a call with ``args``/``kwargs``.

        An explicit ``once_name`` is used as given (and must be a valid name); a
        derived one is kept within the name limit (see ``_bounded_name``).
        """
        make_lock, make_once, signature = self._setnx_name_builders()
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if make_once is not None:
            return validate_name(make_once(args, kwargs))
        if make_lock is not None:
            return validate_name(
                _bounded_name(f"celery-once:{self.name}:{make_lock(args, kwargs)}")
            )
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        payload = json.dumps(_canonical(dict(bound.arguments)), separators=(",", ":"))
        digest = hashlib.sha1(payload.encode("utf-8", "surrogatepass")).hexdigest()
        return validate_name(_bounded_name(f"celery-once:{self.name}:{digest}"))

    # -- enqueue-once -----------------------------------------------------------

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay(*args, **kwargs)`` when the current transaction commits (at once
        outside one). Returns None. A duplicate found then is dropped and logged,
        whatever ``once_policy`` says (see "Enqueue-once")."""
        self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``apply_async(*args, **kwargs)`` when the current transaction commits.
        Returns None. A duplicate found then is dropped and logged."""
        from django.db import transaction

        transaction.on_commit(functools.partial(self._apply_async_at_commit, args, kwargs))

    def _apply_async_at_commit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self.apply_async(*args, **kwargs)
        except AlreadyQueued as exc:
            # Raised here it would leave atomic() after COMMIT and cancel the
            # transaction's later on_commit callbacks: log it instead.
            logger.warning("Task %s not enqueued at commit: %s", self.name, exc)

    def apply_async(
        self,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Send the task; with ``once_policy``, only if no copy is queued or running.

        Returns the AsyncResult, or None when ``once_policy="drop"`` dropped a
        duplicate; raises :class:`AlreadyQueued` with ``once_policy="raise"``. A
        duplicate inside a canvas is sent, to be settled by the worker (see
        "Canvases and periodic tasks"). ``once_policy=`` overrides the task's policy
        for this call.
        """
        policy = options.pop("once_policy", self.once_policy)
        if policy is not None and policy not in ONCE_POLICIES:
            raise ValueError(f"once_policy must be None, 'raise' or 'drop', got {policy!r}.")
        options.update(producer=producer, link=link, link_error=link_error, shadow=shadow)
        headers = options.get("headers") or {}
        if not policy or options.get("retries") or ONCE_TOKEN_HEADER in headers:
            # Off, or a retry/resend of a message that already carries its once lock.
            self._extend_carried_once(headers, options)
            return cast(Any, super()).apply_async(args, kwargs, task_id, **options)

        # The id first, so that the lock's owner record can name it.
        task_id = task_id or uuid()
        name = self.once_lock_name(args, kwargs)
        backend = self._once_backend_alias()
        delay = _delay_seconds(options.get("countdown"), options.get("eta"), self.app.timezone)
        ttl = self.once_ttl + delay
        max_ttl = locks[backend].max_ttl
        if delay and ttl > max_ttl:
            # Due further ahead than the backend's MAX_TTL allows: a shorter lock beats
            # a message not sent at all, as for a retry (_extend_carried_once; review
            # r164). A once_ttl above MAX_TTL is still refused by the Lock.
            ttl = max(max_ttl, self.once_ttl)
        lk = Lock(
            name,
            ttl,
            backend=backend,
            guards=f"celery task {self.name}[{task_id}]",
        )
        lk.owner_extra["celery_task_id"] = task_id
        lk.owner_extra[dead_owners.HANDOVER] = True  # adopted by the worker that runs it
        if not lk.acquire(blocking=False):
            if any(options.get(key) for key in CANVAS_OPTIONS):
                return self._send_duplicate(policy, name, args, kwargs, task_id, options)
            return self.already_queued(name, args, kwargs, options, policy)

        options["headers"] = {**headers, ONCE_TOKEN_HEADER: lk._token, ONCE_NAME_HEADER: name}
        try:
            return cast(Any, super()).apply_async(args, kwargs, task_id, **options)
        except BaseException:
            # Not sent (broker down), or run eagerly and raised: either way no queued
            # copy holds the lock any more. Token-checked, so never someone else's;
            # an eager run has released it already, which is no lost lock.
            try:
                lk._release_if_still_held()
            except LockError:
                logger.warning("Could not release enqueue-once lock %r", name, exc_info=True)
            raise

    def _extend_carried_once(self, headers: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        """A message sent again with the enqueue-once lock it carries (a retry; with
        ``retry_on_worker_lost``, from the worker's main process after a lost pool
        child, due in ``default_retry_delay``): extend that lock to cover the wait
        until it is due, as the first enqueue did, so that no duplicate gets in
        meanwhile. Token-checked and quiet: a lock that expired and passed to another
        enqueue is left alone (the resent run then says so when it starts)."""
        token, name = headers.get(ONCE_TOKEN_HEADER), headers.get(ONCE_NAME_HEADER)
        if not token or not name:
            return
        delay = _delay_seconds(options.get("countdown"), options.get("eta"), self.app.timezone)
        try:
            backend = locks[self._once_backend_alias()]
            # Never more than the backend takes (MAX_TTL): a shorter lock beats a
            # message not sent at all.
            backend.extend(name, token, min(self.once_ttl + delay, backend.max_ttl))
        except (LockError, ValueError):
            logger.warning(
                "Could not extend enqueue-once lock %r for a message sent again",
                name,
                exc_info=True,
            )

    def _send_duplicate(
        self,
        policy: str,
        name: str,
        args: Iterable[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str,
        options: dict[str, Any],
    ) -> Any:
        """A duplicate inside a canvas: send it marked, for the worker to settle by
        ``policy`` without running the body, so the canvas neither hangs nor blames
        the step before."""
        holder = self._holder(name)
        options["headers"] = {
            **(options.get("headers") or {}),
            DUPLICATE_HEADER: [policy, name, holder],
        }
        logger.info(
            "Task %s[%s] is a duplicate inside a canvas (%r held by %s): sent to be "
            "settled by once_policy=%r",
            self.name,
            task_id,
            name,
            holder,
            policy,
        )
        return cast(Any, super()).apply_async(args, kwargs, task_id, **options)

    def _holder(self, name: str) -> str | None:
        try:
            info = locks[self._once_backend_alias()].get(name)
        except LockBackendError:
            return None
        return info.owner.get("celery_task_id") if info is not None else None

    def already_queued(
        self,
        name: str,
        args: Iterable[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: dict[str, Any],
        policy: str | None = None,
    ) -> None:
        """Called when ``apply_async`` finds a copy queued or running: raise or drop."""
        if (policy or self.once_policy) == DROP:
            logger.info(
                "Task %s not enqueued: a copy is already queued or running (%r)", self.name, name
            )
            return  # apply_async() returns None
        info: LockInfo | None = None
        try:
            info = locks[self._once_backend_alias()].get(name)
        except LockBackendError:
            pass
        holder_id = info.owner.get("celery_task_id") if info is not None else None
        raise AlreadyQueued(name, self.name, holder_id, info)

    # -- running ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # A plain call: Task.__call__ pushes a request and runs the body, which
            # we wrap in the run lock.
            return self._run_exclusive(
                request,
                args,
                kwargs,
                lambda: cast(Any, super(ExclusiveTaskMixin, self)).__call__(*args, **kwargs),
            )
        duplicate = _header(request, DUPLICATE_HEADER)
        if duplicate:
            return self._settle_duplicate(*duplicate)
        # A worker (or apply()/eager mode) is running us: the request is on the stack.
        once = self._adopt_once(request)
        setattr(request, _ONCE_ATTR, once)
        keep_once = False
        try:
            return self._run_exclusive(request, args, kwargs, lambda: self.run(*args, **kwargs))
        except Retry:
            keep_once = True
            raise
        except Reject as exc:
            keep_once = bool(exc.requeue)  # requeued: it will run again
            raise
        except Exception:
            raise
        except BaseException:
            # The worker is going down (SystemExit, KeyboardInterrupt, WorkerLostError):
            # with acks_late the message comes back and still holds its place.
            keep_once = bool(self.acks_late)
            raise
        finally:
            if once is not None:
                if keep_once or getattr(request, _RETRY_SENT_ATTR, False):
                    once._stop_renewer()
                else:
                    _release_quietly(once)

    def _settle_duplicate(self, policy: str, name: str, holder: str | None) -> None:
        if policy == DROP:
            logger.info(
                "Task %s[%s] not run: a copy is already queued or running (%r)",
                self.name,
                self.request.id,
                name,
            )
            return None
        raise AlreadyQueued(name, self.name, holder)

    def _adopt_once(self, request: Any) -> Lock | None:
        """The enqueue-once lock this message carries, held by this run (or None)."""
        token = _header(request, ONCE_TOKEN_HEADER)
        name = _header(request, ONCE_NAME_HEADER)
        if not token or not name:
            # No once lock travels with this message. (One that does is adopted
            # whatever the task's own policy: apply_async(once_policy=...) and beat
            # entries can ask for one per call.)
            return None
        once = _once_lock(self, name, self.once_ttl)
        try:
            adopted = once.adopt(token)
        except LockError:
            logger.warning("Could not extend enqueue-once lock %r", name, exc_info=True)
            adopted = False
        if not adopted:
            logger.warning(
                "Task %s[%s]: its enqueue-once lock %r expired and was taken over (or "
                "removed) before it ran; running it anyway, a duplicate may be queued.",
                self.name,
                request.id,
                name,
            )
            return None
        return once

    def _run_exclusive(
        self,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        body: Callable[[], Any],
    ) -> Any:
        name = self.run_lock_name(args, kwargs)
        if name is None:
            return body()
        if request.called_directly:
            guards = f"celery task {self.name} (called directly)"
        else:
            guards = f"celery task {self.name}[{request.id}]"
        options: dict[str, Any] = {
            "backend": self.lock_backend,
            "timeout": self.lock_timeout,
            "auto_renew": self.lock_auto_renew,
            "guards": guards,
            "release_on_commit": self.lock_release_on_commit,
            "using": self.lock_using,
        }
        if self.lock_limit is None:
            lk = Lock(name, self.lock_ttl, **options)
        else:
            lk = Semaphore(name, self.lock_limit, self.lock_ttl, **options)
        if request.id:
            lk.owner_extra["celery_task_id"] = request.id
        once = getattr(request, _ONCE_ATTR, None)
        if once is not None:
            # Where this run's enqueue-once lock is: the worker's main process frees
            # both if the pool child running it dies (see _PoolChildWatch).
            lk.owner_extra["celery_once_lock"] = [once.backend_alias, once.name]
        if self._requeued_if_lost():
            # Celery puts the message back, or sends it again, if the child dies: its
            # once lock stays.
            lk.owner_extra["celery_requeued_if_lost"] = True
        if self._requeued_on_timeout():
            # Likewise when the child is killed for its hard time limit.
            lk.owner_extra["celery_requeued_on_timeout"] = True
        lent = deferred_lock(lk) if self.lock_release_on_commit else None
        if lent is not None:
            # An earlier run in this transaction holds it until COMMIT: run under it.
            result = body()
            lent._confirm_lent()  # LockNotOwned: lost meanwhile, roll back
            return result
        if not lk.acquire() and not (
            request.id and _free_own_dead_run(lk, request.id) and lk.acquire()
        ):
            return self.lock_contended(lk, args, kwargs)
        holder = request if not request.called_directly else None
        if holder is not None:
            setattr(holder, _RUN_LOCK_ATTR, lk)
        try:
            result = body()
        except BaseException as exc:
            if self._take_run_lock(holder, lk):
                # Release without masking ``exc``, even if the lock was lost meanwhile.
                lk.release_at_exit(exc)
            raise
        if self._take_run_lock(holder, lk):
            lk.release_at_exit()  # LockNotOwned here: the run was not exclusive; say so.
        return result

    def _requeued_if_lost(self) -> bool:
        """Whether Celery puts this run's message back, or sends it again, when its
        pool child dies: ``acks_late`` with ``reject_on_worker_lost``, or (Celery >=
        5.7) ``retry_on_worker_lost`` with retries left; per task or app-wide."""
        reject = getattr(self, "reject_on_worker_lost", None)
        if reject is None:
            reject = self.app.conf.get("task_reject_on_worker_lost")
        if getattr(self, "acks_late", False) and reject:
            return True
        retry = getattr(self, "retry_on_worker_lost", None)
        if retry is None:
            retry = self.app.conf.get("task_retry_on_worker_lost")
        max_retries = self.max_retries
        return bool(retry) and (max_retries is None or self.request.retries < max_retries)

    def _requeued_on_timeout(self) -> bool:
        """Whether Celery puts this task's message back when its run passes the hard
        time limit: ``acks_late`` without ``acks_on_timeout`` (Celery >= 5.7; before,
        ``acks_on_failure_or_timeout``), per task or app-wide."""
        if not getattr(self, "acks_late", False):
            return False
        acks = getattr(self, "acks_on_timeout", None)
        if acks is None:
            acks = getattr(self, "acks_on_failure_or_timeout", None)
        if acks is None:
            acks = self.app.conf.get("task_acks_on_failure_or_timeout", True)
        return not acks

    @staticmethod
    def _take_run_lock(holder: Any, lk: Lock) -> bool:
        """True if ``lk`` is still ours to release (retry() may have released it)."""
        if holder is None:
            return True
        if getattr(holder, _RUN_LOCK_ATTR, None) is not lk:
            return False
        setattr(holder, _RUN_LOCK_ATTR, None)
        return True

    def lock_contended(self, lock: Lock, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called when the run lock is held elsewhere; applies ``on_contention``.

        Return a value to make it the task's result, or raise. Override for a
        policy of your own (``lock`` is the :class:`~django_setnx.Lock` not acquired).
        """
        task_id = self.request.id
        if self.on_contention == SKIP:
            logger.info("Task %s[%s] skipped: lock %r is held", self.name, task_id, lock.name)
            return  # the task's result is None
        holder = ""
        try:
            infos = lock.holders() if isinstance(lock, Semaphore) else [lock.info()]
        except LockBackendError:
            infos = []
        owners = [info.owner for info in infos if info is not None and info.is_held]
        if owners:
            holder = " by " + ", ".join(
                owner.get("guards") or f"pid {owner.get('pid')} on {owner.get('host')}"
                for owner in owners
            )
        what = (
            f"lock {lock.name!r} is held"
            if not isinstance(lock, Semaphore)
            else f"semaphore {lock.name!r} has all {lock.limit} slots held"
        )
        exc = LockNotAcquired(
            lock.name, lock.timeout, f"Task {self.name}[{task_id}]: {what}{holder}."
        )
        if self.on_contention == RETRY:
            raise self.retry(
                exc=exc, countdown=self.lock_retry_countdown, max_retries=self.lock_max_retries
            )
        raise exc

    # -- retries ----------------------------------------------------------------

    def retry(
        self,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime.datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, keeping the locks right.

        When a retry message will be sent: the run lock is released first (the retry
        must not contend with this attempt), and the enqueue-once lock is extended to
        cover the countdown and travels on in the retry's headers. On exhaustion
        nothing changes here; the task fails and both locks are released as usual.
        """
        request = self.request
        if not request.called_directly:
            limit = self.max_retries if max_retries is None else max_retries
            if limit is None or request.retries + 1 <= limit:
                # With throw=False the body goes on after this call: the run lock is
                # kept to its end (the retry meets it as any other run would). Not
                # in eager mode, where Celery runs the retry inside this call.
                early = throw or request.is_eager
                run_lock = getattr(request, _RUN_LOCK_ATTR, None) if early else None
                if run_lock is not None and self._take_run_lock(request, run_lock):
                    try:
                        run_lock.release()
                    except LockError:
                        logger.warning(
                            "Could not release lock %r before a retry",
                            run_lock.name,
                            exc_info=True,
                        )
                once = getattr(request, _ONCE_ATTR, None)
                if once is not None:
                    # Stop the renewer: it would shorten the expiry that the retry's
                    # apply_async sets to cover its countdown (_extend_carried_once).
                    once._stop_renewer()
                    options["headers"] = {
                        **(options.get("headers") or request.headers or {}),
                        ONCE_TOKEN_HEADER: once._token,
                        ONCE_NAME_HEADER: once.name,
                    }
        try:
            ret = cast(Any, super()).retry(
                args=args,
                kwargs=kwargs,
                exc=exc,
                throw=throw,
                eta=eta,
                countdown=countdown,
                max_retries=max_retries,
                **options,
            )
        except Retry:
            setattr(request, _RETRY_SENT_ATTR, True)
            raise
        setattr(request, _RETRY_SENT_ATTR, True)
        return ret


class ExclusiveTask(ExclusiveTaskMixin, _DefaultBase):
    """A Celery Task (Celery's ``DjangoTask`` where available) with run-exclusive and
    enqueue-once locks (see the module documentation).

    Without ``lock_name`` and ``once_policy`` it is a plain task.
    """


def _release_quietly(once: Lock) -> None:
    try:
        once.release()
    except LockError:
        logger.info(
            "Enqueue-once lock %r was no longer this task's, or could not be "
            "released; it expires by itself",
            once.name,
            exc_info=True,
        )


def _release_once_of(task: ExclusiveTaskMixin, request_like: Any) -> bool:
    """Release the enqueue-once lock a message carries (revoked or expired: it never
    runs), with the lock signals. Token-checked: a lock that passed to a later
    enqueue is left alone."""
    token = _header(request_like, ONCE_TOKEN_HEADER)
    name = _header(request_like, ONCE_NAME_HEADER)
    if not token or not name:
        return False
    once = _once_lock(task, name, task.once_ttl)
    once.take_token(token)
    try:
        # Both the revoke command and task_revoked may come here for one message,
        # and a later enqueue may hold the name by then: no lost lock either way.
        return once._release_if_still_held()
    except LockError:
        logger.info(
            "Enqueue-once lock %r of a task that never ran could not be released",
            name,
            exc_info=True,
        )
        return False


@cast(
    "Callable[[_F], _F]",
    celery_signals.task_revoked.connect(weak=False, dispatch_uid="django_setnx_once_revoked"),
)
def _release_once_on_revoke(
    sender: Any = None, request: Any = None, terminated: bool = False, **kwargs: Any
) -> None:
    """A revoked or expired message never runs: release its enqueue-once lock. A run
    terminated by ``revoke(..., terminate=True)`` has both of its locks freed once its
    pool child has exited (see _free_locks_of_a_dead_run), not before: a signal that
    does not kill it (``SIGUSR1``, a handler that unwinds slowly) leaves the run
    going, and it releases its own locks when it ends."""
    if not isinstance(sender, ExclusiveTaskMixin) or request is None:
        return
    try:
        if not terminated:
            _release_once_of(sender, request)
        else:
            _free_locks_of_a_dead_run(
                sender,
                request.id,
                getattr(request, "args", None),
                getattr(request, "kwargs", None),
                "it was revoked with terminate=True",
                pid=getattr(request, "worker_pid", None),
            )
    except Exception:  # a signal handler must never break the worker
        logger.warning("Could not release the locks of a revoked task", exc_info=True)


#: When a run that held no run lock is lost, how long the worker's main process
#: waits before it frees its enqueue-once lock (the pool kills a child that passed
#: its hard time limit within a fraction of a second of reporting it).
ONCE_ONLY_GRACE = 1.0


@cast(
    "Callable[[_F], _F]",
    celery_signals.task_failure.connect(weak=False, dispatch_uid="django_setnx_lost_run"),
)
def _free_locks_on_lost_run(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Iterable[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    **extra: Any,
) -> None:
    """The worker's main process reports a pool child lost mid-task (SIGKILL, the OOM
    killer: WorkerLostError) or killed for its hard ``time_limit``
    (TimeLimitExceeded): free that run's locks now rather than after their ttl."""
    if not isinstance(sender, ExclusiveTaskMixin) or not task_id:
        return
    free_once = True
    if isinstance(exception, WorkerLostError):
        # (Celery sends no task_failure when it puts the message back or sends it
        # again: here the message is gone.)
        reason = "its worker process was lost (killed, or out of memory)"
    elif isinstance(exception, TimeLimitExceeded):
        reason = "it passed its hard time limit and its worker process was killed"
        # Sent even when Celery then puts the message back (acks_late without
        # acks_on_timeout): that message still holds its enqueue-once lock.
        free_once = not sender._requeued_on_timeout()
    else:
        return  # an ordinary failure: the run released its own locks
    try:
        _free_locks_of_a_dead_run(sender, task_id, args, kwargs, reason, free_once=free_once)
    except Exception:  # a signal handler must never break the worker
        logger.warning("Could not free the locks of lost task %s", task_id, exc_info=True)


class _PoolChildWatch(threading.Thread):
    """In a prefork worker's main process: notices a pool child that died (SIGKILL,
    the OOM killer) within POLL_INTERVAL, before Celery reports it (its pool
    maintenance may take seconds), and frees the run locks that child held and their
    enqueue-once locks (see _free_runs_of_dead_child). Reads the pool's list of
    processes only; reaping stays the pool's."""

    POLL_INTERVAL = 0.1

    def __init__(self, pool: Any) -> None:
        super().__init__(name="django-setnx-pool-watch", daemon=True)
        self.pool = pool
        self.handled: set[int] = set()
        #: Children seen at the last look: the pool may drop a dead child from its
        #: list within milliseconds, so one seen once and gone since counts too.
        self.known: set[int] = set()

    def children(self) -> set[int]:
        return {proc.pid for proc in list(getattr(self.pool, "_pool", None) or ()) if proc.pid}

    def run(self) -> None:
        while True:
            time.sleep(self.POLL_INTERVAL)
            try:
                current = self.children()
            except Exception:  # noqa: BLE001 - the pool is being rebuilt: look again
                continue
            # A pid new in the list is a new child, even one with the pid of a child
            # handled before (pids are reused): it is watched again. One handled
            # and out of the list is forgotten (the set grew by one pid per child
            # ever replaced: review r133).
            self.handled -= current - self.known
            dead = [
                pid
                for pid in (self.known | current) - self.handled
                if pid not in current or dead_owners.has_exited(pid)
            ]
            self.handled &= self.known | current
            self.known = current
            for pid in dead:
                self.handled.add(pid)
                # A child retired normally (max_tasks_per_child) released its locks:
                # the scan then finds nothing. One gone from the list may not be
                # reaped yet: wait for its exit first. In a process of its own: the
                # pool forks the dead child's replacement meanwhile (see
                # dead_owners.in_cleanup_process).
                dead_owners.in_cleanup_process(_free_runs_after_exit, pid)


@cast(
    "Callable[[_F], _F]",
    celery_signals.worker_ready.connect(weak=False, dispatch_uid="django_setnx_pool_watch"),
)
def _watch_pool_children(sender: Any = None, **kwargs: Any) -> None:
    """Start a _PoolChildWatch in a prefork worker's main process."""
    global _pool_watch
    pool = getattr(getattr(sender, "pool", None), "_pool", None)  # TaskPool -> AsynPool
    if pool is None or not hasattr(pool, "_pool"):
        return  # solo, threads, eventlet: no pool children
    with _pool_watch_lock:
        if _pool_watch is not None and _pool_watch.is_alive() and _pool_watch.pool is pool:
            return  # one watch per pool, whatever signals a restarted consumer sends
        _pool_watch = _PoolChildWatch(pool)
        _pool_watch.start()


_pool_watch: _PoolChildWatch | None = None
_pool_watch_lock = threading.Lock()


def _free_runs_after_exit(pid: int) -> None:
    if dead_owners.wait_for_exit(pid):
        _free_runs_of_dead_child(pid)


def _free_runs_of_dead_child(pid: int) -> None:
    """Free the run locks the dead pool child ``pid`` held (records naming this host,
    ``pid`` and a Celery task) and the enqueue-once lock of each of those runs."""
    for alias in list(locks):
        try:
            runs = [
                run
                for run in locks[alias].list()
                if run.owner.get("celery_task_id")
                and dead_owners.owned_by(run, pid)
                # A new child with the dead one's pid (review r133): its own run.
                and not dead_owners.runs_now(run.owner)
            ]
            for run in runs:
                reason = f"{run.owner.get('guards', 'celery task')}: its worker process {pid} died"
                dead_owners.free(alias, run, reason)
                if run.owner.get("celery_requeued_if_lost") or run.owner.get(
                    "celery_requeued_on_timeout"
                ):
                    # The message may be queued again (a lost child, or one killed
                    # for its time limit: this watch cannot tell which): its once lock
                    # stays. If Celery does not requeue it, its task_failure frees it.
                    continue
                # [alias, name] of the run's enqueue-once lock, or (None, None).
                once_alias: Any
                once_name: Any
                once_alias, once_name = run.owner.get("celery_once_lock") or (None, None)
                if once_alias in locks:
                    once = locks[once_alias].get(once_name)
                    if once is not None and (
                        once.owner.get("celery_task_id") == run.owner["celery_task_id"]
                    ):
                        dead_owners.free(once_alias, once, reason)
        except LockBackendError:
            logger.warning(
                "Could not free the locks of dead pool child %s on %r", pid, alias, exc_info=True
            )


def _free_own_dead_run(lk: Lock, task_id: str) -> bool:
    """A message delivered again (``acks_late``: its pool child died) may find its run
    lock still held by its own earlier run, if the cleanup has not run yet: free the
    records of that run (same task id, this host and PID namespace, a pid that has
    exited; fencing-checked) so that the new run can take the lock. Returns True if
    the new run should try again: the lock is free by now (the cleanup in the worker's
    main process may free it between the new run's refused acquire and this look), or
    a record of the dead run was found and is gone now, whoever removed it (that
    cleanup may also free it between this look and our fencing-checked delete, which
    then finds nothing: the lock is free all the same). The attempt itself tells
    whether the lock is ours."""
    infos: Sequence[LockInfo | None]
    try:
        if isinstance(lk, Semaphore):
            infos = lk.holders()
            free_now = len(infos) < lk.limit
        else:
            info = lk.info()
            infos, free_now = [info], info is None or not info.is_held
        if free_now:
            return True
        found = False
        for info in infos:
            if info is None or info.owner.get("celery_task_id") != task_id:
                continue
            pid = cast(int, info.owner.get("pid"))  # owner records carry an int pid
            if dead_owners.owned_by(info, pid, celery_task_id=task_id) and (
                dead_owners.has_exited(pid)
            ):
                reason = f"task {task_id} delivered again: its earlier run's process {pid} died"
                # None: no longer that record (freed by the pool watch's cleanup since
                # we looked, or taken by another run): try again either way.
                dead_owners.free(lk.backend_alias, info, reason)
                found = True
        return found
    except LockBackendError:
        return False


def _free_locks_of_a_dead_run(
    task: ExclusiveTaskMixin,
    task_id: str,
    args: Iterable[Any] | None,
    kwargs: Mapping[str, Any] | None,
    reason: str,
    *,
    pid: int | None = None,
    free_once: bool = True,
) -> None:
    """Free the run lock and (with ``free_once``) the enqueue-once lock of the run
    ``task_id``, in the background, once the pool child that ran it (``pid`` if
    known, else the run lock's owner) has exited: only records that name
    ``task_id`` (and, for the run lock, this host), each fencing-checked, so a lock
    that passed to another run is never touched (see :mod:`django_setnx.dead_owners`)."""
    targets: dict[str, tuple[str, list[str]]] = {}
    kinds = [("run", task.lock_backend, task.run_lock_name)]
    if free_once:
        kinds.append(("once", task._once_backend_alias(), task.once_lock_name))
    for kind, alias, build in kinds:
        try:
            name = build(args or (), kwargs or {})
        except Exception:  # noqa: BLE001 - arguments the name cannot be built from
            name = None
        if name is None:
            continue
        if kind == "run" and task.lock_limit is not None:
            # A semaphore's run holds one of its slots: whichever names task_id.
            targets[kind] = (
                alias,
                [slot_record(name, slot) for slot in range(1, task.lock_limit + 1)],
            )
        else:
            targets[kind] = (alias, [name])
    if targets:
        # Not in a thread: the pool forks the lost child's replacement meanwhile.
        dead_owners.in_cleanup_process(
            _free_after_exit, targets, task_id, f"task {task.name}[{task_id}]: {reason}", pid
        )


def _free_after_exit(
    targets: dict[str, tuple[str, list[str]]], task_id: str, reason: str, pid: int | None = None
) -> None:
    """``targets``: ``{"run"/"once": (alias, record names)}`` of the dead run
    ``task_id``; ``pid``: the pool child that ran it, if known. Nothing is freed
    while that child runs: the run then releases its own locks when it ends."""
    found: dict[str, tuple[str, LockInfo]] = {}
    for kind, (alias, names) in targets.items():
        for name in names:
            info = locks[alias].get(name)
            if info is not None and info.owner.get("celery_task_id") == task_id:
                found[kind] = (alias, info)
                break
    if "run" in found:
        # The run lock's owner is the pool child that ran the task.
        run = found["run"][1]
        pid = cast(int, run.owner.get("pid"))  # owner records carry an int pid
        if not dead_owners.owned_by(run, pid, celery_task_id=task_id):
            return  # taken on another machine (a redelivered run): nothing of ours
        if not dead_owners.wait_for_exit(run.owner["pid"]):
            return  # still running: a redelivered run in another child, or a slow death
    elif found:
        if pid is not None:
            if not dead_owners.wait_for_exit(pid):
                return  # still running (SIGUSR1, a slow unwind): its own end releases
        else:
            time.sleep(ONCE_ONLY_GRACE)
    for alias, info in found.values():
        dead_owners.free(alias, info, reason)


def _install_revoke_hook() -> None:
    """Wrap the worker's ``revoke`` control command so that revoking a message that
    waits for its countdown/eta in this worker frees its enqueue-once lock at once.

    Celery only discards such a message (and sends ``task_revoked``) when its ETA
    comes; until then its once lock would refuse every new enqueue. Control commands
    only ever run in workers, so this changes nothing elsewhere.
    """
    try:
        from celery.worker import control, state
    except ImportError:  # pragma: no cover
        return
    original = control.Panel.data.get("revoke")
    if original is None or getattr(original, "_django_setnx", False):
        return

    def revoke(panel: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(panel, task_id, *args, **kwargs)
        ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
        for waiting in list(state.scheduled_requests) + list(state.reserved_requests):
            if waiting.id in ids and isinstance(waiting.task, ExclusiveTaskMixin):
                if waiting in state.active_requests or _started(waiting):
                    # Running, or terminated by this revoke: task_revoked frees its
                    # locks once its pool child has exited.
                    continue
                try:
                    released = _release_once_of(waiting.task, _RequestHeaders(waiting))
                except Exception:
                    logger.warning(
                        "Could not release the enqueue-once lock of revoked task %s",
                        waiting.id,
                        exc_info=True,
                    )
                else:
                    if released:
                        logger.info(
                            "Released the enqueue-once lock of revoked task %s", waiting.id
                        )
        return result

    revoke.__dict__.update(original.__dict__)
    revoke.__doc__ = original.__doc__
    cast(Any, revoke)._django_setnx = True
    control.Panel.data["revoke"] = revoke


def _started(request: Any) -> bool:
    """Whether a worker Request was handed to a pool process (it may be running, or
    have been terminated by this very revoke)."""
    return bool(getattr(request, "time_start", None) or getattr(request, "worker_pid", None))


class _RequestHeaders:
    """A worker Request's message headers, seen the way _header() reads a request."""

    def __init__(self, request: Any) -> None:
        self.headers = request.request_dict


_install_revoke_hook()


@cast(
    "Callable[[_F], _F]",
    celery_signals.worker_process_shutdown.connect(
        weak=False, dispatch_uid="django_setnx_undos_at_child_exit"
    ),
)
def _send_undos_at_child_exit(sender: Any = None, **kwargs: Any) -> None:
    """A prefork pool child ends with ``os._exit``, which skips atexit: the undos of
    its failed Redis acquires still unanswered are sent once more here, as at any
    interpreter exit (redis_undo.send_at_exit, AT_EXIT seconds at most)."""
    from ..backends import redis_undo

    redis_undo.send_at_exit()
