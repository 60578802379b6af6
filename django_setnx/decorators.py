"""``@locked``: run a function, method, async function or Django view under a lock.

    @locked("invoice:{invoice_id}", ttl=60)
    def charge(invoice_id): ...

The lock name is a ``str.format`` template filled from the call's bound arguments
(attribute and index lookups work: ``"checkout:{request.user.pk}"``), or a callable
that returns the name from the call's arguments.
"""

import functools
import inspect
import math
import string

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse

from .conf import DEFAULT_LOCK_ALIAS
from .exceptions import LockNotAcquired
from .locking import Lock
from .validation import validate_timeout

RAISE = "raise"
SKIP = "skip"

_formatter = string.Formatter()


def _template_roots(template):
    """The argument names a template refers to: ``"{request.user.pk}"`` -> {"request"}."""
    roots = set()
    for _, field, _, _ in _formatter.parse(template):
        if field is None:
            continue
        if field == "" or field.isdigit():
            raise ImproperlyConfigured(
                f"Lock name template {template!r} uses a positional field; name the "
                f"argument instead, e.g. '{{invoice_id}}'."
            )
        root = field.split(".", 1)[0].split("[", 1)[0]
        roots.add(root)
    return roots


class _LockName:
    """Builds the lock name of one call from the decorated function's arguments."""

    def __init__(self, func, template):
        self.func = func
        self.template = template
        self.signature = inspect.signature(func)
        if callable(template):
            return
        if not isinstance(template, str) or not template:
            raise ImproperlyConfigured(
                f"@locked needs a lock name template (a non-empty str) or a callable, "
                f"got {template!r}."
            )
        params = self.signature.parameters
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = _template_roots(template) - set(params)
        if unknown and not takes_any_keyword:
            raise ImproperlyConfigured(
                f"Lock name template {template!r} refers to {', '.join(sorted(unknown))}, "
                f"which {_qualname(func)}{self.signature} does not take."
            )

    def __call__(self, args, kwargs):
        if callable(self.template):
            name = self.template(*args, **kwargs)
            if not isinstance(name, str):
                raise TypeError(f"The lock name callable {self.template!r} returned {name!r}, not a str.")
            return name
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for param in self.signature.parameters.values():
            if param.kind is param.VAR_KEYWORD:
                arguments.update(arguments.pop(param.name, {}))
        try:
            return _formatter.vformat(self.template, (), arguments)
        except (KeyError, AttributeError, IndexError, LookupError) as exc:
            raise ValueError(
                f"Lock name template {self.template!r} cannot be filled from the call to "
                f"{_qualname(self.func)} ({type(exc).__name__}: {exc}); arguments were "
                f"{sorted(arguments)}."
            ) from exc


def _qualname(func):
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _find_request(args):
    # A function view's first argument, or a class-based view method's second.
    for arg in args[:2]:
        if isinstance(arg, HttpRequest):
            return arg
    return None


def default_contention_response(request, lock, status=409):
    """The view response on contention: ``status`` (409) with ``Retry-After``.

    ``Retry-After`` is the holder's remaining time by the backend's clock, rounded
    up to whole seconds (at least 1).
    """
    retry_after = 1
    try:
        info = lock.info()
    except Exception:  # an outage must not turn a 409 into a 500
        info = None
    if info is not None and info.is_held:
        retry_after = max(1, math.ceil(info.expires_in))
    response = HttpResponse(
        f"The resource is busy (lock held by another request). Retry in {retry_after} s.\n",
        status=status,
        content_type="text/plain; charset=utf-8",
    )
    response["Retry-After"] = str(retry_after)
    return response


def locked(name, ttl=None, *, timeout=0, backend=DEFAULT_LOCK_ALIAS, on_contention=None,
           auto_renew=False, status=409):
    """Decorate a callable so that each call runs while holding a lock.

    - ``name``: a ``str.format`` template over the call's arguments, or a callable
      ``name(*args, **kwargs) -> str``. A template field the function does not take
      is an ``ImproperlyConfigured`` at decoration time; a field the call cannot
      fill is a ``ValueError`` at call time (never a lock literally named
      ``"invoice:{invoice_id}"``).
    - ``ttl``, ``backend``, ``auto_renew``: as for :func:`~django_setnx.lock`.
    - ``timeout``: seconds to wait for the lock (default 0: do not wait; ``None``
      waits forever).
    - ``on_contention``: ``"raise"`` (``LockNotAcquired``; the default for
      functions), ``"skip"`` (return None without calling), or a callable
      ``on_contention(lock, *args, **kwargs)`` whose result is returned. For views
      (a first argument that is an ``HttpRequest``) the default is an HTTP
      ``status`` (409) response with ``Retry-After``.

    Works on functions, methods, ``async def`` functions and sync or async views.
    The owner record says what is guarded: the view's method and path, or the
    function's dotted name.
    """
    validate_timeout(timeout)
    if on_contention is not None and on_contention not in (RAISE, SKIP) and not callable(on_contention):
        raise ImproperlyConfigured(
            f"on_contention must be 'raise', 'skip' or a callable, got {on_contention!r}."
        )

    def decorator(func):
        make_name = _LockName(func, name)
        dotted = _qualname(func)

        def build_lock(args, kwargs):
            request = _find_request(args)
            guards = f"{request.method} {request.path} ({dotted})" if request is not None else dotted
            lk = Lock(make_name(args, kwargs), ttl, backend=backend, timeout=timeout,
                      auto_renew=auto_renew, guards=guards)
            return lk, request

        def contended(lk, request, args, kwargs):
            if callable(on_contention):
                return on_contention(lk, *args, **kwargs)
            if on_contention == SKIP:
                return None
            if on_contention is None and request is not None:
                return default_contention_response(request, lk, status)
            raise LockNotAcquired(lk.name, timeout)

        if iscoroutinefunction(func):
            @functools.wraps(func)
            async def async_wrapper(*args, **kwargs):
                lk, request = build_lock(args, kwargs)
                if not await lk.aacquire():
                    result = contended(lk, request, args, kwargs)
                    return await result if inspect.isawaitable(result) else result
                try:
                    result = await func(*args, **kwargs)
                except BaseException as exc:
                    await lk.__aexit__(type(exc), exc, exc.__traceback__)
                    raise
                await lk.arelease()
                return result

            async_wrapper.lock_name = make_name
            return async_wrapper

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            lk, request = build_lock(args, kwargs)
            if not lk.acquire():
                return contended(lk, request, args, kwargs)
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:
                # Releases without masking ``exc`` even if the lock was lost meanwhile.
                lk.__exit__(type(exc), exc, exc.__traceback__)
                raise
            lk.release()  # LockNotOwned here: the call was not exclusive; say so.
            return result

        wrapper.lock_name = make_name
        return wrapper

    return decorator
