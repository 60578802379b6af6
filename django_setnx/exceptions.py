"""Exceptions raised by django-setnx.

Every exception derives from :class:`LockError`, so ``except LockError`` catches
anything this package raises on purpose. Configuration mistakes raise Django's
``ImproperlyConfigured`` (an unknown alias raises :class:`InvalidLockBackendError`,
a subclass of it) and bad arguments raise ``ValueError``/``TypeError``.

Every exception survives ``pickle`` (multiprocessing, Celery's pickle serializer)
and Celery's JSON serialization of task errors with the same class, message and
attributes: ``args`` holds exactly the constructor's arguments (both rebuild an
exception as ``cls(*args)``), and ``str()`` is the message.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class LockError(Exception):
    """Base class of every lock error."""

    #: The text ``str()`` returns; subclasses compose it from their arguments.
    message = ""

    def __str__(self) -> str:
        return self.message or super().__str__()


class LockNotAcquired(LockError):
    """The lock could not be acquired within the timeout (``with lock(...)``)."""

    def __init__(
        self, name: str, timeout: float | None = None, message: str | None = None
    ) -> None:
        super().__init__(name, timeout, message)
        self.name = name
        self.timeout = timeout
        if message is None:
            if timeout is None or timeout == 0:
                message = f"Lock {name!r} is held by another owner."
            else:
                message = f"Lock {name!r} was not acquired within {timeout:g} s."
        self.message = message


class LockNotOwned(LockError):
    """Release or extend of a lock this Lock object no longer holds.

    Raised when the lock was never acquired, was already released, or is no longer
    this object's: it expired (and maybe passed to another owner) or was
    force-released (its token no longer matches).
    """

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(name, message)
        self.name = name
        self.message = message or f"Lock {name!r} is not owned by this Lock object."


class LockBackendError(LockError):
    """The backend could not be reached or failed; nothing was reported as acquired.

    ``alias`` names the backend; ``reason`` is what failed (the ``message``
    argument), without the alias.
    """

    def __init__(self, alias: str, message: str) -> None:
        super().__init__(alias, message)
        self.alias = alias
        self.reason = message
        self.message = f"Lock backend {alias!r}: {message}"


class InvalidLockBackendError(ImproperlyConfigured):
    """An alias that ``SETNX_LOCKS`` does not define, or a backend that cannot load."""
