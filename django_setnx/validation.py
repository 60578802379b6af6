"""Argument checks shared by the Lock object, the backends and the commands.

Each check raises before anything is written, with a message that names the bad
value, so a typo never turns into a lock that nobody else will ever contend for.
"""

import math
import numbers

from .conf import MAX_NAME_LENGTH


def validate_name(name):
    """Return ``name`` if it is a usable lock name, else raise TypeError/ValueError."""
    if not isinstance(name, str):
        raise TypeError(f"Lock name must be a str, not {type(name).__name__}: {name!r}.")
    if not name:
        raise ValueError("Lock name must not be empty.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"Lock name is {len(name)} characters long, the limit is {MAX_NAME_LENGTH}: "
            f"{name[:40]!r}..."
        )
    if "\x00" in name:
        raise ValueError(f"Lock name must not contain NUL characters: {name!r}.")
    return name


def _is_real_number(value):
    # bool is an int subclass, but ttl=True is a bug, not one second.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def validate_ttl(ttl, *, what="ttl"):
    """Return ``ttl`` as a float number of seconds (> 0 and finite), else raise."""
    if not _is_real_number(ttl):
        raise TypeError(f"{what} must be a number of seconds, not {type(ttl).__name__}: {ttl!r}.")
    ttl = float(ttl)
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {ttl!r}.")
    if ttl < 0.001:
        raise ValueError(f"{what} must be at least 0.001 s (one millisecond), got {ttl!r}.")
    return ttl


def validate_timeout(timeout):
    """Return ``timeout`` (``None`` = wait forever, else seconds >= 0), else raise."""
    if timeout is None:
        return None
    if not _is_real_number(timeout):
        raise TypeError(
            f"timeout must be None or a number of seconds, not {type(timeout).__name__}: "
            f"{timeout!r}."
        )
    timeout = float(timeout)
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}.")
    return None if math.isinf(timeout) else timeout


def ttl_to_ms(ttl):
    """Seconds to whole milliseconds, never rounding a valid ttl down to zero."""
    return max(1, int(round(ttl * 1000)))
