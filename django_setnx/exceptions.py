"""Exceptions raised by django-setnx.

Every exception derives from :class:`LockError`, so ``except LockError`` catches
anything this package raises on purpose. Configuration mistakes raise Django's
``ImproperlyConfigured`` (an unknown alias raises :class:`InvalidLockBackendError`,
a subclass of it) and bad arguments raise ``ValueError``/``TypeError``.
"""

from django.core.exceptions import ImproperlyConfigured


class LockError(Exception):
    """Base class of every lock error."""


class LockNotAcquired(LockError):
    """The lock could not be acquired within the timeout (``with lock(...)``)."""

    def __init__(self, name, timeout=None, message=None):
        self.name = name
        self.timeout = timeout
        if message is None:
            if timeout is None or timeout == 0:
                message = f"Lock {name!r} is held by another owner."
            else:
                message = f"Lock {name!r} was not acquired within {timeout:g} s."
        super().__init__(message)


class LockNotOwned(LockError):
    """Release or extend of a lock this Lock object no longer holds.

    Raised when the lock was never acquired, was already released, or expired and
    was taken over by another owner (its token no longer matches).
    """

    def __init__(self, name, message=None):
        self.name = name
        super().__init__(message or f"Lock {name!r} is not owned by this Lock object.")


class LockBackendError(LockError):
    """The backend could not be reached or failed; nothing was reported as acquired."""

    def __init__(self, alias, message):
        self.alias = alias
        super().__init__(f"Lock backend {alias!r}: {message}")


class InvalidLockBackendError(ImproperlyConfigured):
    """An alias that ``SETNX_LOCKS`` does not define, or a backend that cannot load."""
