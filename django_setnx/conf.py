"""Settings of django-setnx, read lazily from ``settings.SETNX_LOCKS``.

Nothing here runs at import time; :func:`get_lock_settings` reads the current
settings each time it is called, and the handler caches the result until a
``setting_changed`` signal for ``SETNX_LOCKS`` resets it.
"""

from typing import Any

from django.conf import settings

DEFAULT_LOCK_ALIAS = "default"
DATABASE_BACKEND = "django_setnx.backends.database.DatabaseBackend"

#: Used when ``SETNX_LOCKS`` is not set: the project's own database, zero setup.
DEFAULT_SETNX_LOCKS = {
    DEFAULT_LOCK_ALIAS: {
        "BACKEND": DATABASE_BACKEND,
        "OPTIONS": {"DATABASE": "default"},
    }
}

#: Default ttl in seconds when neither the call nor the backend's ``TTL`` sets one.
DEFAULT_TTL = 60.0

#: Default of a backend's ``OPTIONS["MAX_TTL"]`` (seconds): the longest ttl accepted,
#: checked before anything is written. 30 days: longer than any sane lock, and long
#: enough for an enqueue-once lock that covers a Celery ``eta`` weeks ahead.
DEFAULT_MAX_TTL = 30 * 86400.0

#: Longest lock name, in characters (the database column's width).
MAX_NAME_LENGTH = 200


def get_lock_settings() -> Any:
    """Return the ``SETNX_LOCKS`` dict, or the built-in default when it is unset."""
    configured = getattr(settings, "SETNX_LOCKS", None)
    # An explicit but malformed value (``{}``, a list) is reported by the system
    # checks and the handler; only an absent setting falls back to the default.
    return DEFAULT_SETNX_LOCKS if configured is None else configured
