"""``@locked``: run a function, method, generator or Django view under a lock.

    @locked("invoice:{invoice_id}", ttl=60)
    def charge(invoice_id): ...

The lock name is a ``str.format`` template filled from the call's bound arguments
(attribute and index lookups work: ``"checkout:{request.user.pk}"``), or a callable
that returns the name from the call's arguments.

What is held, and for how long:

- a function, method or ``async def``: for the call;
- a generator or async generator: from its first step until it is exhausted,
  raises or is closed (``close()``, or the garbage collector closing an abandoned
  one); a contended generator yields nothing (``skip``) or raises at its first step;
- a view: for the view call, and when it returns a streaming response
  (``StreamingHttpResponse``, ``FileResponse``), until the response has been sent
  or closed: the lock covers the streamed body too;
- inside a database transaction, until the transaction commits (see
  :mod:`django_setnx.transactions`).

Views are recognised by their request argument: a Django ``HttpRequest``, or an
object wrapping one in ``_request`` (Django REST framework's ``Request``) as the
first argument, or the second for a method (``self, request``). Class-based views
work through Django's ``method_decorator`` on ``dispatch`` or on a handler method.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import math
import os
import queue
import string
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import BadRequest, ImproperlyConfigured, SynchronousOnlyOperation
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import View

from .conf import DEFAULT_LOCK_ALIAS
from .exceptions import LockBackendError, LockError, LockNotAcquired
from .forksafe import ForkSafeLock
from .locking import Lock
from .semaphore import Semaphore, validate_limit, validate_semaphore_name
from .transactions import database_aliases, deferred_lock
from .validation import validate_name, validate_timeout, validate_ttl

logger = logging.getLogger("django_setnx")

RAISE = "raise"
SKIP = "skip"
#: ``begin(args, kwargs[, lock_name]) -> (lock or None, request, HttpRequest or None)`` and
#: ``contended(lock, request, args, kwargs) -> result`` of one decorated callable.
_Begin = Callable[..., tuple[Lock | None, Any, HttpRequest | None]]
_Contended = Callable[[Lock, Any, Sequence[Any], dict[str, Any]], Any]

_formatter = string.Formatter()


@functools.lru_cache(maxsize=512)
def _template_roots(template: str) -> frozenset[str]:
    """The argument names a template refers to: ``"{request.user.pk}"`` -> {"request"}.
    ImproperlyConfigured, naming the template, if ``str.format`` could never fill it."""
    roots = set()
    try:
        fields = list(_formatter.parse(template))
    except ValueError as exc:  # an unmatched brace
        raise ImproperlyConfigured(
            f"Lock name template {template!r} is not a valid str.format template ({exc}); "
            f"write a literal brace as '{{{{' or '}}}}'."
        ) from None
    for _, field, _, conversion in fields:
        if field is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            raise ImproperlyConfigured(
                f"Lock name template {template!r} uses the conversion !{conversion}; "
                f"str.format knows only !r, !s and !a."
            )
        if field == "" or field.isdigit():
            raise ImproperlyConfigured(
                f"Lock name template {template!r} uses a positional field; name the "
                f"argument instead, e.g. '{{invoice_id}}'."
            )
        roots.add(field.split(".", 1)[0].split("[", 1)[0])
    return frozenset(roots)


#: Parameter kinds a bound method's instance is passed as.
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _instance_parameter(function: Callable[..., Any]) -> str | None:
    """The name of ``function``'s first parameter if a bound method's instance is
    passed as it, else None (``(*args, **kwargs)``, a decorator that kept no
    signature: the instance is one of ``args``)."""
    first = next(iter(inspect.signature(function).parameters.values()), None)
    return first.name if first is not None and first.kind in _POSITIONAL else None


@functools.lru_cache(maxsize=512)
def _unbound_signature(function: Callable[..., Any]) -> inspect.Signature:
    """The signature of ``function`` called as a bound method (its first parameter
    dropped, if the instance is passed as it), computed once per function."""
    signature = inspect.signature(function)
    if _instance_parameter(function) is None:
        return signature  # (*args, **kwargs): binding takes the instance from args
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def call_signature(func: Callable[..., Any]) -> inspect.Signature:
    """The signature ``func`` is *called* with.

    ``inspect.signature`` follows ``__wrapped__``, which is right for a function
    wrapped by another decorator but wrong for the per-call ``functools.partial``
    that Django's ``method_decorator`` builds around a bound method: its
    ``__wrapped__`` is the unbound method, whose signature has ``self`` first. So the
    ``__wrapped__`` chain is followed by hand, and stops at such a partial, also
    behind other decorators (``method_decorator([never_cache, locked(...)])``), and at
    a class-based view's ``as_view()`` function.
    """
    target, seen = func, set()
    while id(target) not in seen:
        seen.add(id(target))
        if getattr(target, "view_class", None) is not None:
            # ``View.as_view()``'s function, ``(request, *args, **kwargs)``: it copies
            # ``dispatch.__dict__``, so a method_decorator on dispatch left a
            # ``__wrapped__`` there that names the unbound dispatch.
            return inspect.signature(target, follow_wrapped=False)
        if isinstance(target, functools.partial):
            inner = target.func
            if inspect.ismethod(inner) and not target.args and not target.keywords:
                return _unbound_signature(inner.__func__)
            return inspect.signature(target, follow_wrapped=False)
        wrapped = getattr(target, "__wrapped__", None)
        if wrapped is None:
            break
        target = wrapped
    return inspect.signature(func)


def _bound_instance(func: Callable[..., Any]) -> tuple[str, Any] | None:
    """``(name of the method's first parameter, instance)`` for the per-call
    ``functools.partial`` of a bound method that Django's ``method_decorator`` makes
    (also behind other decorators), else None: the template may refer to that
    instance as the method itself does (``{self.kwargs[pk]}``), though the call
    passes it bound, not as an argument."""
    target: Any = func
    seen = set()
    while target is not None and id(target) not in seen:
        seen.add(id(target))
        if isinstance(target, functools.partial):
            inner = target.func
            if inspect.ismethod(inner) and not target.args and not target.keywords:
                first = _instance_parameter(inner.__func__)
                return None if first is None else (first, inner.__self__)
            return None
        target = getattr(target, "__wrapped__", None)
    return None


def _is_async_view_dispatch(func: Callable[..., Any]) -> bool:
    """True for the per-call partial of an async class-based view's method that is
    itself sync and returns the handler's coroutine (``View.dispatch`` of a view whose
    handlers are ``async def``): it must be locked the async way."""
    target: Any = func
    while not isinstance(target, functools.partial):
        target = getattr(target, "__wrapped__", None)
        if target is None:
            return False
    view = getattr(target.func, "__self__", None)
    return bool(getattr(view, "view_is_async", False)) and not iscoroutinefunction(target)


class LockName:
    """Builds the lock name of one call from the decorated callable's arguments."""

    def __init__(self, func: Callable[..., Any], template: str | Callable[..., str]) -> None:
        self.func = func
        self.template = template
        self.signature = call_signature(func)
        self.instance = None if callable(template) else _bound_instance(func)
        if callable(template):
            return
        if not isinstance(template, str) or not template:
            raise ImproperlyConfigured(
                f"@locked needs a lock name template (a non-empty str) or a callable, "
                f"got {template!r}."
            )
        params = self.signature.parameters
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = set(_template_roots(template)) - set(params)
        if self.instance is not None:
            unknown.discard(self.instance[0])
        if unknown and not takes_any_keyword:
            raise ImproperlyConfigured(
                f"Lock name template {template!r} refers to {', '.join(sorted(unknown))}, "
                f"which {qualname(func)}{self.signature} does not take."
            )

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        if callable(self.template):
            name = self.template(*args, **kwargs)
            if not isinstance(name, str):
                raise TypeError(
                    f"The lock name callable {self.template!r} returned {name!r}, not a str."
                )
            return name
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for param in self.signature.parameters.values():
            if param.kind is param.VAR_KEYWORD:
                arguments.update(arguments.pop(param.name, {}))
        if self.instance is not None:
            arguments.setdefault(*self.instance)
        try:
            return _formatter.vformat(self.template, (), arguments)
        except (KeyError, AttributeError, IndexError, LookupError) as exc:
            raise ValueError(
                f"Lock name template {self.template!r} cannot be filled from the call to "
                f"{qualname(self.func)} ({type(exc).__name__}: {exc}); arguments were "
                f"{sorted(arguments)}."
            ) from exc


def qualname(func: object) -> str:
    """The dotted name of what ``func`` runs, for the owner record's ``guards``. A
    bound method (``method_decorator`` decorates one per call) is named after its
    instance's class, so that ``ReportView``'s ``dispatch`` is not
    ``django.views.generic.base.View.dispatch``."""
    func = getattr(func, "func", func)  # a partial: name what it calls
    if inspect.ismethod(func) and not isinstance(func.__self__, type):
        cls = type(func.__self__)
        return f"{cls.__module__}.{cls.__qualname__}.{func.__name__}"
    func = getattr(func, "__func__", func)  # a classmethod's: its function
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def find_request(args: Sequence[Any]) -> tuple[Any, HttpRequest | None]:
    """``(request, http_request)`` of a view call, or ``(None, None)``.

    ``request`` is what the view got (a Django ``HttpRequest``, or a wrapper such as
    DRF's ``Request``), ``http_request`` the Django ``HttpRequest`` itself. DRF is
    recognised without importing it: its ``Request`` keeps the ``HttpRequest`` in
    ``_request``.
    """
    for arg in args[:2]:  # a function view's first argument, a method's second
        if isinstance(arg, HttpRequest):
            return arg, arg
        inner = getattr(arg, "_request", None)
        if isinstance(inner, HttpRequest):
            return arg, inner
    return None, None


def retry_after_seconds(
    lock: Lock,
    retry_after: float | Callable[[Lock, Any], float] | None = None,
    request: Any = None,
) -> int:
    """The ``Retry-After`` of a contended view, in whole seconds (at least 1).

    ``retry_after``: None (the holder's remaining ttl, by the backend's clock), a
    number of seconds, or a callable ``(lock, request) -> seconds``.
    """
    if callable(retry_after):
        retry_after = retry_after(lock, request)
    if retry_after is None:
        try:
            # A semaphore's first slot to free is its holder's that expires first.
            infos = lock.holders() if isinstance(lock, Semaphore) else [lock.info()]
        except LockError:  # an outage must not turn a 409 into a 500
            infos = []
        retry_after = _first_expiry(infos)
    return max(1, math.ceil(retry_after))


async def _call_from_async(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a user's ``on_contention`` or ``retry_after`` from async code: a
    coroutine function is awaited; a plain function runs in Django's sync thread
    (``sync_to_async``), as a sync view would, so that it may use the ORM or a lock's
    sync API (review r151: in the event loop, both raised SynchronousOnlyOperation,
    and only under contention). What it returns is awaited if awaitable."""
    if iscoroutinefunction(func) or iscoroutinefunction(type(func).__call__):
        result = func(*args, **kwargs)
    else:
        result = await sync_to_async(func, thread_sensitive=True)(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def aretry_after_seconds(
    lock: Lock,
    retry_after: float | Callable[[Lock, Any], float] | None = None,
    request: Any = None,
) -> int:
    """:func:`retry_after_seconds` for async code: the holder is looked up with the
    async API (a database backend refuses sync calls in an event loop)."""
    seconds: Any = (
        await _call_from_async(retry_after, lock, request)
        if callable(retry_after)
        else retry_after
    )
    if seconds is None:
        try:
            infos = await lock.aholders() if isinstance(lock, Semaphore) else [await lock.ainfo()]
        except LockError:
            infos = []
        seconds = _first_expiry(infos)
    return max(1, math.ceil(float(seconds)))


def _first_expiry(infos: Sequence[Any]) -> float:
    held = [info.expires_in for info in infos if info is not None and info.is_held]
    return min(held) if held else 1


def _wants_json(http_request: HttpRequest, is_api: bool) -> bool:
    """Content negotiation for the contention response: JSON when the client
    prefers it (or sent no preference to an API view, as DRF's are), else text."""
    accept = http_request.headers.get("Accept", "").strip()
    if not accept or accept == "*/*":
        return is_api
    preferred = getattr(http_request, "get_preferred_type", None)  # Django >= 5.2
    if preferred is not None:
        return bool(
            preferred(["text/plain", "text/html", "application/json"]) == "application/json"
        )
    return http_request.accepts("application/json") and not http_request.accepts("text/html")


def default_contention_response(
    request: Any,
    lock: Lock,
    status: int = 409,
    retry_after: float | Callable[[Lock, Any], float] | None = None,
) -> HttpResponse:
    """The view response on contention: ``status`` (409) with ``Retry-After``.

    JSON (``{"detail": ..., "retry_after": seconds}``) when content negotiation asks
    for it, plain text otherwise. ``request`` may be a Django ``HttpRequest`` or a
    DRF ``Request``.
    """
    request, http_request = find_request((request,))
    seconds = retry_after_seconds(lock, retry_after, request)
    detail = f"The resource is busy (a lock is held by another request). Retry in {seconds} s."
    response: HttpResponse
    if http_request is not None and _wants_json(http_request, request is not http_request):
        response = JsonResponse({"detail": detail, "retry_after": seconds}, status=status)
    else:
        response = HttpResponse(
            detail + "\n", status=status, content_type="text/plain; charset=utf-8"
        )
    response["Retry-After"] = str(seconds)
    return response


# -- re-entry -------------------------------------------------------------------------

#: The locks held by @locked calls in progress in this thread or task.
_in_progress: contextvars.ContextVar[tuple[_Held, ...]] = contextvars.ContextVar(
    "django_setnx_in_progress", default=()
)


def _current_runner() -> object:
    """The asyncio task running this code, or else this thread's id."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop running here
        task = None
    return task if task is not None else threading.get_ident()


class _Held:
    __slots__ = ("key", "runner", "active")

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.runner = _current_runner()
        self.active = True


def _refuse_reentry(lk: Lock, func: Callable[..., Any]) -> None:
    """Raise a clear LockError for a recursive call: a lock is not reentrant, and the
    inner call would wait for its own caller's lock until the ttl (then the outer
    call's release would fail with LockNotOwned)."""
    key = lk.identity
    # Only the same task or thread: an asyncio task created inside a guarded call
    # copies the context, but waiting there for the lock is waiting for another task
    # (``active`` also clears the mark once that call has ended).
    runner = _current_runner()
    if any(
        held.active and held.key == key and held.runner == runner for held in _in_progress.get()
    ):
        raise LockError(
            f"Lock {lk.name!r} is already held by this thread or task, in a call to "
            f"{qualname(func)} that has not returned (a recursive call?); locks are not "
            f"reentrant."
        )


def _enter(lk: Lock) -> tuple[_Held, contextvars.Token[tuple[_Held, ...]]]:
    held = _Held(lk.identity)
    return held, _in_progress.set(_in_progress.get() + (held,))


def _leave(entered: tuple[_Held, contextvars.Token[tuple[_Held, ...]]]) -> None:
    held, token = entered
    held.active = False
    try:
        _in_progress.reset(token)
    except ValueError:  # reset from another context (a generator resumed elsewhere)
        pass


# -- the decorator ----------------------------------------------------------------------


def locked(
    name: str | Callable[..., str],
    ttl: float | None = None,
    *,
    timeout: float | None = 0,
    backend: str = DEFAULT_LOCK_ALIAS,
    on_contention: str | Callable[..., Any] | None = None,
    auto_renew: bool = False,
    status: int = 409,
    retry_after: float | Callable[[Lock, Any], float] | None = None,
    unlocked_methods: Sequence[str] | None = None,
    release_on_commit: bool = True,
    using: str | Sequence[str] | None = None,
    limit: int | None = None,
) -> Callable[[Callable[..., Any]], Any]:
    """Decorate a callable so that each call runs while holding a lock (or, with
    ``limit``, one of the ``limit`` slots of a semaphore).

    - ``name``: a ``str.format`` template over the call's arguments, or a callable
      ``name(*args, **kwargs) -> str``. A template field the function does not take
      is an ``ImproperlyConfigured`` at decoration time; a field the call cannot
      fill is a ``ValueError`` at call time (never a lock literally named
      ``"invoice:{invoice_id}"``). In a view, a name filled from the request that
      is not a valid lock name (longer than ``MAX_NAME_LENGTH``, or with a NUL or
      ``\\x1f`` in it, from a URL's slug say) raises Django's ``BadRequest``: the
      client gets a 400, not a 500. Elsewhere it is the ``ValueError`` of
      :func:`~django_setnx.lock`.
    - ``ttl``, ``backend``, ``auto_renew``: as for :func:`~django_setnx.lock`.
    - ``limit``: None (a lock, the default) or an int N: at most N calls run at
      once, each holding a slot of :func:`~django_setnx.semaphore` ``name``.
    - ``timeout``: seconds to wait for the lock (default 0: do not wait; ``None``
      waits forever).
    - ``on_contention``: ``"raise"`` (``LockNotAcquired``; the default for
      functions), ``"skip"`` (return None without calling; a view answers ``204 No
      Content``; a generator yields nothing), or a callable
      ``on_contention(lock, *args, **kwargs)`` whose result is returned. A view's
      default is an HTTP ``status`` (409; any error status from 400 to 599)
      response with ``Retry-After``, in JSON when the client asks for JSON.
    - ``retry_after``: the view's ``Retry-After``: None (the holder's remaining
      ttl), seconds, or a callable ``(lock, request) -> seconds``.
    - ``unlocked_methods``: request methods a view serves without the lock (default:
      none, every method takes it, ``HEAD`` and ``OPTIONS`` included: Django runs
      the GET code for ``HEAD``, and a function view, or a class-based view's own
      ``dispatch``, ``options()`` or mixins, run project code for ``OPTIONS``). A
      sequence such as ``("OPTIONS",)`` serves those methods unlocked: the view's
      code then runs without the lock for them, so list only methods it answers
      without side effects.
    - ``release_on_commit`` (default True) and ``using`` (a database alias or a
      sequence of them; default ``"default"``): a call made inside a transaction on
      one of those databases (``atomic()``, ``ATOMIC_REQUESTS``) keeps the lock until
      that transaction commits, so the next holder reads what this call wrote; after
      a rollback the lock is released at once. A second call with the same lock
      name before that commit, in the same thread, runs under the lock still held.
    - A recursive call (the same lock, while a call holding it has not returned) is
      a ``LockError``: locks are not reentrant.

    Works on functions, methods (also above ``@staticmethod``/``@classmethod``),
    generators, ``async def`` functions and async generators, and sync or async
    views, class-based ones through ``method_decorator``. The owner record says what
    is guarded: the view's method and path, or the function's dotted name.
    """
    # Checked here, not on the first call, which may be a rare contended one in
    # production: everything but the backend alias, which names a setting read lazily.
    try:
        validate_timeout(timeout)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"@locked: {exc}") from exc
    if ttl is not None:
        try:
            validate_ttl(ttl)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(f"@locked: {exc}") from exc
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise ImproperlyConfigured(
            f"status must be an HTTP error status from 400 to 599 (what a view answers "
            f"while the lock is busy), got {status!r}."
        )
    if not isinstance(auto_renew, bool):
        raise ImproperlyConfigured(f"auto_renew must be True or False, got {auto_renew!r}.")
    if not isinstance(backend, str) or not backend:
        raise ImproperlyConfigured(
            f"backend must be the alias of a lock backend (a key of SETNX_LOCKS), got {backend!r}."
        )
    if limit is not None:
        try:
            validate_limit(limit)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(str(exc)) from exc
    if (
        on_contention is not None
        and on_contention not in (RAISE, SKIP)
        and not callable(on_contention)
    ):
        raise ImproperlyConfigured(
            f"on_contention must be 'raise', 'skip' or a callable, got {on_contention!r}."
        )
    if retry_after is not None and not callable(retry_after):
        if (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, (int, float))
            or not math.isfinite(retry_after)
            or retry_after < 0
        ):
            raise ImproperlyConfigured(
                f"retry_after must be None, a number of seconds >= 0 or a callable, got "
                f"{retry_after!r}."
            )
    if isinstance(unlocked_methods, str) or not all(
        isinstance(method, str) for method in unlocked_methods or ()
    ):
        raise ImproperlyConfigured(
            f"unlocked_methods must be a sequence of HTTP method names such as "
            f"('HEAD', 'OPTIONS'), got {unlocked_methods!r}."
        )
    unlocked = frozenset(method.upper() for method in unlocked_methods or ())
    using = database_aliases(using)

    def decorator(func: Any) -> Any:
        if isinstance(func, (staticmethod, classmethod)):
            # Decorate the function inside, and keep the descriptor around it.
            return type(func)(decorator(func.__func__))
        if not callable(func):
            raise ImproperlyConfigured(f"@locked can only decorate a callable, not {func!r}.")
        if isinstance(func, type) and issubclass(func, View):
            # It would become a function: as_view() then fails far from the cause.
            raise ImproperlyConfigured(
                f"@locked cannot decorate the class-based view {func.__qualname__}: use "
                f'@method_decorator(locked(...), name="dispatch") on the class, or '
                f"@locked on a handler method."
            )
        make_name = LockName(func, name)
        if isinstance(name, str) and not _template_roots(name):
            # Nothing filled from the call: a name no lock may have is the code's
            # fault, not the client's (whose requests would all get a 400).
            literal = name.format()  # "{{" and "}}" are braces of the name
            try:
                validate_name(literal)
                if limit is not None:
                    validate_semaphore_name(literal, limit)
            except (TypeError, ValueError) as exc:
                raise ImproperlyConfigured(f"@locked: {exc}") from exc
        dotted = qualname(func)

        def begin(
            args: Sequence[Any], kwargs: dict[str, Any], lock_name: str | None = None
        ) -> tuple[Lock | None, Any, HttpRequest | None]:
            """``(lock, request, http_request)`` for one call; lock is None for an
            unlocked request method. ``lock_name``: the name, if built already."""
            request, http_request = find_request(args)
            if http_request is not None and http_request.method in unlocked:
                return None, request, http_request
            if lock_name is None:
                lock_name = make_name(args, kwargs)
            if http_request is not None:
                try:
                    validate_name(lock_name)
                    if limit is not None:
                        validate_semaphore_name(lock_name, limit)
                except (TypeError, ValueError) as exc:
                    # Filled from the request (a URL's slug, say): the client's
                    # input, so Django answers 400 rather than 500.
                    raise BadRequest(
                        f"The lock name built from this request is not valid: {exc}"
                    ) from exc
            guards = (
                f"{http_request.method} {http_request.path} ({dotted})"
                if http_request is not None
                else dotted
            )
            options: dict[str, Any] = {
                "backend": backend,
                "timeout": timeout,
                "auto_renew": auto_renew,
                "guards": guards,
                "release_on_commit": release_on_commit,
                "using": using,
            }
            if limit is None:
                lk = Lock(lock_name, ttl, **options)
            else:
                lk = Semaphore(lock_name, limit, ttl, **options)
            if limit is None or limit == 1:
                # A semaphore of N > 1 slots may be taken again by its holder: the
                # nested call takes a slot of its own (or meets contention).
                _refuse_reentry(lk, func)
            return lk, request, http_request

        begin.make_name = make_name  # type: ignore[attr-defined]  # see _abegin

        async def acontended(
            lk: Lock, request: Any, args: Sequence[Any], kwargs: dict[str, Any]
        ) -> Any:
            if request is not None and on_contention is None:
                seconds = await aretry_after_seconds(lk, retry_after, request)
                return default_contention_response(request, lk, status, seconds)
            if callable(on_contention):
                return await _call_from_async(on_contention, lk, *args, **kwargs)
            return contended(lk, request, args, kwargs)  # no call that may block

        def contended(lk: Lock, request: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
            if callable(on_contention):
                return on_contention(lk, *args, **kwargs)
            if request is not None and on_contention in (None, SKIP):
                if on_contention == SKIP:
                    return HttpResponse(status=204)
                return default_contention_response(request, lk, status, retry_after)
            if on_contention == SKIP:
                return None
            raise LockNotAcquired(lk.name, timeout)

        if inspect.isasyncgenfunction(func):
            wrapper = _async_generator_wrapper(func, begin, acontended)
        elif inspect.isgeneratorfunction(func):
            wrapper = _generator_wrapper(func, begin, contended)
        elif iscoroutinefunction(func):
            wrapper = _coroutine_wrapper(func, begin, acontended)
        elif _is_async_view_dispatch(func):
            wrapper = _coroutine_wrapper(func, begin, acontended, returns_awaitable=True)
        else:
            wrapper = _function_wrapper(func, begin, contended)
        wrapper.lock_name = make_name  # type: ignore[attr-defined]
        return wrapper

    return decorator


class _Running:
    """Around the protected call (``with`` or ``async with``): marks the lock as
    entered by this thread or task (re-entry is refused, see _enter), and if the call
    raises, releases the lock without masking the error, even if it was lost
    meanwhile. A normal exit leaves the release to the wrapper: a streaming response
    holds the lock on."""

    __slots__ = ("lk", "entered")

    def __init__(self, lk: Lock) -> None:
        self.lk = lk

    def __enter__(self) -> Lock:
        self.entered = _enter(self.lk)
        return self.lk

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        _leave(self.entered)
        if exc is not None:
            self.lk.release_at_exit(exc)

    async def __aenter__(self) -> Lock:
        self.entered = _enter(self.lk)
        return self.lk

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        _leave(self.entered)
        if exc is not None:
            await self.lk.arelease_at_exit(exc)


def _function_wrapper(
    func: Callable[..., Any], begin: _Begin, contended: _Contended
) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        lk, request, http_request = begin(args, kwargs)
        lent = None if lk is None else deferred_lock(lk)
        if lk is None or lent is not None:
            # An unlocked method, or this transaction's earlier call still holds it.
            result = func(*args, **kwargs)
            if lent is not None:
                lent._confirm_lent()  # LockNotOwned: lost meanwhile, roll back
            return result
        if not lk.acquire():
            return contended(lk, request, args, kwargs)
        with _Running(lk):
            result = func(*args, **kwargs)
        if http_request is not None and getattr(result, "streaming", False):
            return _hold_while_streaming(result, lk)
        lk.release_at_exit()  # LockNotOwned here: the call was not exclusive; say so.
        return result

    return wrapper


async def _abegin(
    begin: _Begin, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Lock | None, Any, HttpRequest | None]:
    """``begin(args, kwargs)`` for an async callable, in the event loop. A name that
    needs the database (``{request.user.pk}`` loads the session's user: Django
    refuses that in an event loop) is built again in a thread, as Django runs sync
    code for an async view (review r126: every logged-in request was a 500); the
    rest of ``begin``, the re-entry check included, runs in the loop (review r129:
    in the thread, a recursive call was not seen as one, and waited for its own
    lock). So a name callable may run twice for one call: once up to its query, then
    whole."""
    try:
        return begin(args, kwargs)
    except SynchronousOnlyOperation:
        pass  # (the thread is called outside the except: its errors are its own)
    name = await sync_to_async(begin.make_name, thread_sensitive=True)(args, kwargs)  # type: ignore[attr-defined]
    return begin(args, kwargs, name)


def _coroutine_wrapper(
    func: Callable[..., Any],
    begin: _Begin,
    contended: _Contended,
    returns_awaitable: bool = False,
) -> Callable[..., Any]:
    """``async def`` functions, and (``returns_awaitable``) sync callables whose
    result is awaited by the caller: held until that result has been awaited."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        lk, request, http_request = await _abegin(begin, args, kwargs)
        lent = None if lk is None else deferred_lock(lk)
        if lk is None or lent is not None:
            result = func(*args, **kwargs)
            result = await result if inspect.isawaitable(result) else result
            if lent is not None:
                await lent._aconfirm_lent()
            return result
        if not await lk.aacquire():
            return await contended(lk, request, args, kwargs)
        async with _Running(lk):
            result = func(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        if http_request is not None and getattr(result, "streaming", False):
            return _hold_while_streaming(result, lk)
        await lk.arelease_at_exit()
        return result

    return wrapper


def _generator_wrapper(
    func: Callable[..., Any], begin: _Begin, contended: _Contended
) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        lk, request, _ = begin(args, kwargs)
        lent = None if lk is None else deferred_lock(lk)
        if lk is None or lent is not None:
            result = yield from func(*args, **kwargs)
            if lent is not None:
                lent._confirm_lent()
            return result
        if not lk.acquire():
            result = contended(lk, request, args, kwargs)
            if result is not None:
                yield from result
            return None
        try:
            result = yield from _marked_steps(lk, func(*args, **kwargs))
        except BaseException as exc:  # close() (GeneratorExit) included
            lk.release_at_exit(exc)
            raise
        lk.release_at_exit()
        return result

    return wrapper


def _marked_steps(lk: Lock, gen: Any) -> Any:
    """``yield from gen`` (send, throw and close passed through), with ``lk`` marked
    as entered (see _enter) only while ``gen`` runs. A generator has no context of
    its own: a mark kept across a ``yield`` would stay in the consumer's context, and
    the consumer's next call of the same lock would be taken for a recursive one."""
    to_send: Any = None
    to_throw: BaseException | None = None
    while True:
        entered = _enter(lk)
        try:
            if to_throw is not None:
                item = gen.throw(to_throw)
            else:
                item = gen.send(to_send)
        except StopIteration as stop:
            return stop.value
        finally:
            _leave(entered)
            to_throw = None
        try:
            to_send = yield item
        except GeneratorExit:
            entered = _enter(lk)
            try:
                gen.close()
            finally:
                _leave(entered)
            raise
        except BaseException as exc:  # noqa: BLE001 - thrown in: passed on to gen
            to_throw, to_send = exc, None


def _async_generator_wrapper(
    func: Callable[..., Any], begin: _Begin, contended: _Contended
) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        lk, request, _ = await _abegin(begin, args, kwargs)
        lent = None if lk is None else deferred_lock(lk)
        if lk is None or lent is not None:
            async for item in _delegate(func(*args, **kwargs)):
                yield item
            if lent is not None:
                await lent._aconfirm_lent()
            return
        if not await lk.aacquire():
            result = await contended(lk, request, args, kwargs)
            if result is not None:
                async for item in result:
                    yield item
            return
        try:
            async for item in _delegate(func(*args, **kwargs), lk):
                yield item
        except BaseException as exc:  # aclose() (GeneratorExit) included
            await lk.arelease_at_exit(exc)
            raise
        await lk.arelease_at_exit()

    return wrapper


async def _delegate(agen: Any, lk: Lock | None = None) -> AsyncIterator[Any]:
    """Iterate ``agen``, closing it when the consumer stops early (an async
    generator has no ``yield from``: asend/athrow are not passed on). With ``lk``,
    marks it as entered only while ``agen`` runs, as _marked_steps does."""
    try:
        while True:
            entered = _enter(lk) if lk is not None else None
            try:
                item = await agen.__anext__()
            except StopAsyncIteration:
                return
            finally:
                if entered is not None:
                    _leave(entered)
            yield item
    finally:
        await agen.aclose()


#: Releases handed over by garbage-collected streaming responses (and by close()
#: called in an event loop's thread), run by one daemon thread per process.
#: SimpleQueue.put may be called from a finalizer (it is reentrant).
_release_queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_releaser_pid: int | None = None
_releaser_guard = ForkSafeLock()


def _released_elsewhere(release: Callable[[], None]) -> None:
    _release_queue.put(release)


def _start_releaser() -> None:
    """Start this process' releaser thread if it is not running (once per process:
    a forked child starts its own)."""
    global _releaser_pid
    if _releaser_pid == os.getpid():
        return
    with _releaser_guard:
        if _releaser_pid != os.getpid():
            threading.Thread(
                target=_run_releases, name="django-setnx-releaser", daemon=True
            ).start()
            _releaser_pid = os.getpid()


def _run_releases() -> None:
    while True:
        release = _release_queue.get()
        try:
            release()
        except Exception:
            logger.warning("Could not release the lock of a streaming response", exc_info=True)


def _forget_releases_after_fork() -> None:
    # The parent's pending releases are the parent's to run; its thread is not here.
    global _release_queue, _releaser_pid
    _release_queue = queue.SimpleQueue()
    _releaser_pid = None


os.register_at_fork(after_in_child=_forget_releases_after_fork)


def _hold_while_streaming(response: Any, lk: Lock) -> Any:
    """Keep ``lk`` held until the streaming ``response`` is sent or discarded.

    The server iterates the body after the view returned, then calls
    ``response.close()``: the release happens when the body is exhausted or the
    response closed (a client that disconnects makes the server close it), or when
    the response object is dropped unsent (a middleware that answers 304 instead).
    A ``FileResponse`` keeps its file for the server's ``sendfile``
    (``wsgi.file_wrapper``): it is released when the server closes it.
    """
    state = {"released": False}
    guard = threading.Lock()  # close(), the stream's end and the releaser thread
    pid = os.getpid()

    def claim() -> bool:
        if os.getpid() != pid:
            # A forked child's copy of the response (its finalizer fires there too
            # when the copy is collected): the lock is the parent's, still streaming.
            return False
        with guard:
            if state["released"]:
                return False
            state["released"] = True
            return True

    def release(exc: BaseException | None = None) -> None:
        if claim():
            lk.release_at_exit(exc)

    def release_logged() -> None:
        try:
            release()
        except LockBackendError as exc:
            logger.warning(
                "Could not release lock %r of a streaming response (backend error); it "
                "expires with its ttl",
                lk.name,
                exc_info=exc,
            )
        except LockError as exc:
            logger.warning(
                "Lock %r of a streaming response was lost before the response was closed",
                lk.name,
                exc_info=exc,
            )

    def release_on_close() -> None:
        # From close(): nobody to raise to. A lock lost meanwhile has sent
        # lock_lost; say so in the log. In an event loop's thread a database
        # backend refuses sync calls (and a sync call would block the loop).
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            release_logged()
        else:
            _released_elsewhere(release_logged)

    async def arelease(exc: BaseException | None = None) -> None:
        if claim():
            await lk.arelease_at_exit(exc)

    _start_releaser()  # here, not in the finalizer: it may run inside any code
    response._resource_closers.append(release_on_close)
    # The finalizer holds no reference to the response: it runs when the response
    # is collected, so a response that is never sent nor closed frees the lock too.
    # It runs wherever the garbage collector does, maybe inside this backend's own
    # call on the same connection (whose lock is not reentrant): it only queues the
    # release for the releaser thread.
    weakref.finalize(response, _released_elsewhere, release_logged)
    if getattr(response, "file_to_stream", None) is not None:
        return response
    content = response.streaming_content

    async def astream() -> AsyncIterator[Any]:
        try:
            async for chunk in content:
                yield chunk
        except BaseException as exc:
            await arelease(exc)
            raise
        await arelease()

    def stream() -> Iterator[Any]:
        try:
            yield from content
        except BaseException as exc:
            release(exc)
            raise
        release()

    if getattr(response, "is_async", False) or isinstance(content, AsyncIterator):
        response.streaming_content = astream()
    else:
        response.streaming_content = stream()
    return response
