"""Argument checks shared by the Lock object, the backends and the commands.

Each check raises before anything is written, with a message that names the bad
value, so a typo never turns into a lock that nobody else will ever contend for.
"""

import math
import numbers
import re

from .conf import MAX_NAME_LENGTH

#: Separates a semaphore's name from its slot number in the slot's record name
#: (see django_setnx.semaphore); lock names may not contain it.
SLOT_SEPARATOR = RESERVED_IN_NAMES = "\x1f"


#: The most slots a semaphore may have: an acquire of a full semaphore looks at each.
MAX_LIMIT = 1000


def slot_record(name: str, slot: int) -> str:
    """The record name of slot ``slot`` (1-based) of semaphore ``name``."""
    return f"{name}{SLOT_SEPARATOR}{slot}"


def split_slot(record: str) -> tuple[str, int] | None:
    """``(semaphore name, slot)`` of a slot's record name, or None for a lock's."""
    name, sep, slot = record.rpartition(SLOT_SEPARATOR)
    if not sep or not slot.isdigit() or not slot.isascii():
        return None
    return name, int(slot)


def validate_name(name: object) -> str:
    """Return ``name`` if it is a usable lock or semaphore name, else raise
    TypeError/ValueError."""
    name = validate_record_name(name)
    if RESERVED_IN_NAMES in name:
        raise ValueError(
            f"Lock name must not contain \\x1f, which names a semaphore's slots: {name!r}."
        )
    return name


#: The longest token a backend record takes (the database column's length).
MAX_TOKEN_LENGTH = 64


def validate_token(token: object) -> str:
    """Return ``token`` if an acquisition may carry it: a non-empty string of at most
    MAX_TOKEN_LENGTH characters (the empty token marks a released record, nobody's:
    a record written with it could be neither seen nor released). Else raise
    ValueError."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_LENGTH:
        raise ValueError(
            f"A lock token must be a non-empty string of at most {MAX_TOKEN_LENGTH} "
            f"characters, got {token!r}."
        )
    return token


def validate_record_name(name: object) -> str:
    """Return ``name`` if a backend record may have it (a lock's name or a semaphore
    slot's), else raise TypeError/ValueError."""
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
    if not name.isascii():
        try:
            name.encode()
        except UnicodeEncodeError:
            raise ValueError(
                f"Lock name must be text that UTF-8 can encode (no lone surrogates): {name!r}."
            ) from None
    return name


def _is_real_number(value: object) -> bool:
    # bool is an int subclass, but ttl=True is a bug, not one second.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: The largest MAX_TTL any backend accepts (10 years): every backend stores expiries
#: as milliseconds since 1970 in 64 bits (and Redis' scripts below 10**12 ms of ttl).
MAX_TTL_LIMIT = 10 * 365 * 86400.0


def validate_ttl(
    ttl: object, *, what: str = "ttl", maximum: float | None = None, where: str = ""
) -> float:
    """Return ``ttl`` as a float number of seconds (> 0, finite and at most
    ``maximum`` when given), else raise TypeError/ValueError naming the value.

    ``where`` names the setting that sets the maximum, for the message.
    """
    if not _is_real_number(ttl):
        raise TypeError(f"{what} must be a number of seconds, not {type(ttl).__name__}: {ttl!r}.")
    try:
        ttl = float(ttl)  # type: ignore[arg-type]  # a Real: checked above
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{what} must be a finite number of seconds, got {ttl!r}.") from None
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {ttl!r}.")
    if ttl < 0.001:
        raise ValueError(f"{what} must be at least 0.001 s (one millisecond), got {ttl!r}.")
    if maximum is not None and ttl > maximum:
        raise ValueError(
            f"{what} {_seconds(ttl)} s is above the maximum of {_seconds(maximum)} s"
            f"{f' ({where})' if where else ''}."
        )
    return ttl


def _seconds(value: float) -> str:
    """A number of seconds, exactly as given and without a needless ".0" (3601, 0.5,
    2592000.25): never rounded, so the message shows the very value refused."""
    value = float(value)
    return repr(int(value)) if value.is_integer() else repr(value)


def validate_timeout(timeout: object) -> float | None:
    """Return ``timeout`` (``None`` = wait forever, else seconds >= 0), else raise."""
    if timeout is None:
        return None
    if not _is_real_number(timeout):
        raise TypeError(
            f"timeout must be None or a number of seconds, not {type(timeout).__name__}: "
            f"{timeout!r}."
        )
    timeout = float(timeout)  # type: ignore[arg-type]  # a Real: checked above
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}.")
    return None if math.isinf(timeout) else timeout


def ttl_to_ms(ttl: float) -> int:
    """Seconds to whole milliseconds, never rounding a valid ttl down to zero."""
    return max(1, int(round(ttl * 1000)))


def redacted(value: object) -> str:
    """``repr(value)`` for an error message, with every credential in it replaced by
    ``***``: a settings value (a str, bytes, or a list, tuple, set or dict of them,
    at any depth) may be a LOCATION with a password, or connection arguments with
    one. Masked: a URL's userinfo, everything up to the last "@" after its "://" (a
    password may hold unencoded "/", "#" or "@": the very URLs that are refused; a
    "@" elsewhere is masked with it, which errs on the safe side); a ``password=``,
    ``username=`` (redis-py reads both) or other credential-like query argument; the
    value of a credential-like key in a dict, or in a ``(key, value)`` pair."""
    return repr(_without_credentials(value))


#: The names whose values are secret, or may be: in query strings, dict keys and
#: ``(key, value)`` pairs (``password``, ``sentinel_password``, ``ssl_password``,
#: ``credential_provider``, ``username``, ``token``...).
_SECRET_NAME = r"[a-z0-9_-]*(?:pass|secret|token|credential|username|auth)[a-z0-9_-]*"
_SECRET_KEY = re.compile(rf"(?i){_SECRET_NAME}")
#: Masked to the end: an unencoded "&" or "#" may be part of the password (r155).
#: After a space too: a libpq connection string ("host=db password=...", r161).
_QUERY_CREDENTIAL = re.compile(rf"(?i)((?:^|[?&;\s]){_SECRET_NAME}\s*=).*")


def _without_credentials(value: object) -> object:
    if isinstance(value, dict):
        return {
            key: "***" if _is_secret_name(key) else _without_credentials(item)
            for key, item in value.items()
        }
    if isinstance(value, (tuple, list)) and len(value) == 2 and _is_secret_name(value[0]):
        return (value[0], "***")
    # Plain types rebuilt (a namedtuple's type takes its fields, not an iterable:
    # review r155).
    for kind in (list, tuple, set, frozenset):
        if isinstance(value, kind):
            return kind(_without_credentials(item) for item in value)
    if isinstance(value, bytes):
        text = value.decode("utf-8", "replace")
        masked = _masked(text)
        return value if masked == text else masked.encode()
    return _masked(value) if isinstance(value, str) else value


def _masked(text: str) -> str:
    scheme, separator, rest = text.partition("://")
    if separator and "@" in rest:
        text = f"{scheme}://***@{rest.rpartition('@')[2]}"
    return _QUERY_CREDENTIAL.sub(r"\1***", text)


def _is_secret_name(key: object) -> bool:
    if isinstance(key, bytes):
        key = key.decode("utf-8", "replace")
    return isinstance(key, str) and _SECRET_KEY.fullmatch(key) is not None
