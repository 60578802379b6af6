"""``locks["alias"]``: the configured lock backends, as ``caches["alias"]`` is for caches."""

from __future__ import annotations

import contextvars
import os
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.utils.connection import BaseConnectionHandler
from django.utils.module_loading import import_string

from .conf import get_lock_settings
from .exceptions import InvalidLockBackendError
from .forksafe import ForkSafeLock
from .validation import redacted

if TYPE_CHECKING:
    from .backends.base import BaseLockBackend

    _Handler = BaseConnectionHandler["BaseLockBackend"]
else:  # generic for the type checker only (django-stubs)
    _Handler = BaseConnectionHandler


#: The creation (a token) that the running code is part of: set by _create around a
#: backend's constructor. A context variable, not the thread: asgiref's
#: async_to_sync runs a constructor's coroutine in another thread, with its context.
_creation: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "django_setnx_creation", default=None
)


class LockHandler(_Handler):
    """Creates each configured backend on first use and keeps it for the process.

    Unlike ``CacheHandler`` the instances are shared by every thread: backends are
    thread-safe and own their connection pools, and one Redis pool per thread would
    multiply connections for nothing. Settings are read on first use, never at
    import, and re-read after ``override_settings(SETNX_LOCKS=...)``.
    """

    settings_name = "SETNX_LOCKS"
    exception_class = InvalidLockBackendError

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        super().__init__(settings)
        # What we were given (None: SETNX_LOCKS), read afresh after each reset().
        self._given_settings = settings
        #: The settings as last read, with the generation they were read in; reset()
        #: starts a new generation, which makes any older read stale at once.
        self._settings_read: tuple[int, dict[str, Any]] | None = None
        self._generation = 0
        self._backends: dict[str, BaseLockBackend] = {}
        self._creating = ForkSafeLock()
        #: The creation in progress (whose thread holds _creating) as (pid, token),
        #: or None; code running as part of it has it in _creation. A child forked
        #: meanwhile copies both, but is not part of it: it has its own lock.
        self._creator: tuple[int, object] | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """SETNX_LOCKS (or the settings given), read on first use and again after
        each reset().

        Not BaseConnectionHandler's cached_property: a read that began before a
        reset() and finished after it would keep the old settings for good (until
        the next reset). Here such a read is tagged with the generation it began in,
        so the next read after the reset reads again."""
        generation = self._generation
        read = self._settings_read
        if read is not None and read[0] == generation:
            return read[1]
        settings = self.configure_settings(self._given_settings)
        self._settings_read = (generation, settings)
        return settings

    def configure_settings(self, settings: dict[str, Any] | None) -> dict[str, Any]:
        settings = get_lock_settings() if settings is None else settings
        if not isinstance(settings, dict):
            raise self.exception_class(
                f"SETNX_LOCKS must be a dict of aliases, not {type(settings).__name__}: "
                f"{redacted(settings)}."
            )
        return settings

    def create_connection(self, alias: str) -> BaseLockBackend:
        params = self.settings.get(alias)
        if params is None:  # removed by a reset() since __getitem__ looked
            raise self.exception_class(
                f"The lock backend {alias!r} is not configured in SETNX_LOCKS."
            )
        if not isinstance(params, dict) or not params.get("BACKEND"):
            raise self.exception_class(
                f"SETNX_LOCKS[{alias!r}] must be a dict with a 'BACKEND' dotted path, "
                f"got {redacted(params)}."
            )
        try:
            backend_cls = import_string(params["BACKEND"])
        except ImportError as exc:
            raise self.exception_class(
                f"Could not load lock backend {params['BACKEND']!r} for alias {alias!r}: {exc}"
            ) from exc
        backend: BaseLockBackend = backend_cls(alias, params)
        return backend

    def __getitem__(self, alias: str) -> BaseLockBackend:
        try:
            return self._backends[alias]
        except KeyError:
            pass
        if not isinstance(alias, str) or alias not in self.settings:
            known = ", ".join(repr(a) for a in self.settings) or "none"
            raise self.exception_class(
                f"The lock backend {alias!r} is not configured in SETNX_LOCKS "
                f"(configured: {known})."
            )
        if self._inside_creation():
            # The creation lock is held for this very code: waiting would never end.
            raise self.exception_class(
                f"The lock backend {alias!r} was asked for while another lock backend "
                f"was being created (by its constructor, or code it imported or ran): "
                f"a backend cannot use locks[...] while it is created."
            )
        # A fork-safe lock: a child forked while a parent thread was creating a
        # backend must not wait for that thread (uWSGI forks without at-fork hooks).
        with self._creating:
            backend = self._backends.get(alias)
            if backend is None:
                backend = self._create(alias)
        return backend

    def _inside_creation(self) -> bool:
        """Whether the running code is part of the backend creation in progress
        (the thread that holds _creating may wait for it): it runs in the creation's
        context, or in a copy of it (async_to_sync, a thread started with
        ``copy_context().run``), in the same process."""
        creator = self._creator  # (pid, token): a forked child is not part of it
        return creator is not None and creator[0] == os.getpid() and _creation.get() is creator

    def _create(self, alias: str) -> BaseLockBackend:
        """Create and keep the backend of ``alias``; called holding _creating."""
        for last in (False, True):
            backends = self._backends
            token = self._creator = (os.getpid(), object())
            context_token = _creation.set(token)
            try:
                created = self.create_connection(alias)
            finally:
                self._creator = None
                _creation.reset(context_token)
            if self._backends is backends or last:
                break
            # The constructor changed a setting, and this thread reset the handler:
            # made from the settings before, so made once more from those of now.
            created.close()
        backend = self._backends.setdefault(alias, created)  # __setitem__ may win
        if backend is not created:
            created.close()
        return backend

    def __setitem__(self, alias: str, backend: BaseLockBackend) -> None:
        self._backends[alias] = backend

    def __delitem__(self, alias: str) -> None:
        del self._backends[alias]

    def all(self, initialized_only: bool = False) -> list[BaseLockBackend]:
        """Return the backend of every configured alias, creating those not created
        yet; with ``initialized_only=True``, only those already created."""
        return [self[alias] for alias in self if not initialized_only or alias in self._backends]

    def close_all(self) -> None:
        """Close the connections of every backend created so far; returns None. The
        backends stay usable: they connect again on their next use."""
        for backend in list(self._backends.values()):
            backend.close()

    def reset(self) -> None:
        """Close every backend and forget the settings (after they changed)."""
        # Under the creation lock: a backend being created from the old settings is
        # finished first, and closed below with the others; none is created from the
        # old settings into the new dict. Unless this thread is the one creating (a
        # backend's constructor that changes a setting): it holds the lock already.
        guard = nullcontext() if self._inside_creation() else self._creating
        with guard:
            backends, self._backends = self._backends, {}
            self._generation += 1
            self._settings_read = None
        for backend in backends.values():
            backend.close()


locks = LockHandler()


def _reset_on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("SETNX_LOCKS", "DATABASES", "CACHES"):
        locks.reset()


setting_changed.connect(_reset_on_setting_changed, dispatch_uid="django_setnx_reset_locks")
