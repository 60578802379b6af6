"""The settings of the Redis and Redlock backends that redis-py takes: their system
checks and first-use checks. A connection object is built to see what redis-py
refuses (it connects lazily: no network I/O), and no message ever repeats a URL,
which may hold a password (redis-py's own messages quote parts of one)."""

import codecs
import math
import numbers
import os

from django.core.exceptions import ImproperlyConfigured

from ..validation import redacted, ttl_to_ms
from .redis_eviction import ALLOW_EVICTION_OPTION
from .redis_scripts import MAX_SCRIPT_MS

try:
    import redis
except ImportError:  # reported by the backends' checks (E010, E030)
    redis = None  # type: ignore[assignment]

#: What a Redis URL needs, said instead of redis-py's message for one it cannot read
#: (which may quote part of a password).
UNREADABLE_URL = (
    "that redis-py can read: it needs the scheme redis://, rediss:// or unix://, a "
    "port that is a number, and a password whose #, /, ? and @ are percent-encoded."
)


def check_connection_kwargs(alias, pool):
    """Build one connection object of ``pool`` (it connects lazily: no I/O) so that
    an argument redis-py does not take (a misspelt ``socket_timout``, ``ssl=True``),
    or a timeout we cannot use, is reported as ImproperlyConfigured naming ``alias``,
    rather than as a TypeError from every lock operation."""
    problem = unusable_arguments_problem(alias, pool)
    if problem is not None:
        raise ImproperlyConfigured(problem)
    kwargs = pool.connection_kwargs
    try:
        pool.connection_class(**kwargs)
    except TypeError as exc:
        hint = (
            " For TLS, use a rediss:// URL (its certificate settings as ssl_* arguments)."
            if "'ssl'" in str(exc)
            else ""
        )
        raise ImproperlyConfigured(
            f"{kwargs_setting(alias)} (or the LOCATION URL's query): redis-py's "
            f"{_connection_label(pool)} refuses its arguments: {exc}.{hint}"
        ) from exc


def is_readable_url(url):
    """True if redis-py can read ``url`` (``Redis.from_url`` would take it), read
    without connecting. Its ValueError is never shown: it quotes the "port", which
    is part of a password with an unencoded "/" or "#" (review r129)."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError:
        return False
    return True


def require_readable_url(url, where):
    """Raise ImproperlyConfigured naming ``where`` unless redis-py can read ``url``,
    without the URL or redis-py's message (see :func:`is_readable_url`; not chained
    either: a logged traceback would print the cause, review r150)."""
    if not is_readable_url(url):
        raise ImproperlyConfigured(f"{where} is not a Redis URL {UNREADABLE_URL}")


def is_number(value, *, minimum=0.0, inclusive=False):
    """A finite real number above ``minimum`` (or equal to it, with ``inclusive``),
    not a bool (``True`` is a bug, not 1 s): the numeric options of the Redis and
    Redlock backends."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value >= minimum if inclusive else value > minimum


def script_seconds_problem(value):
    """Why ``value`` cannot be an option of seconds that the Lua scripts take as a
    millisecond argument (``STALE_RETENTION``, ``WAKE_TTL``, ``FENCING_RETENTION``):
    not a positive number, or above what a script accepts (a record written with it
    would be refused at its release, and stay held for its ttl). None if it can."""
    if not is_number(value):
        return f"must be a positive number of seconds, got {value!r}."
    if ttl_to_ms(value) > MAX_SCRIPT_MS:
        return f"is {value!r} s, above the {MAX_SCRIPT_MS / 1000:g} s the Redis scripts take."
    return None


def script_seconds_ms(options, option, default, where):
    """``OPTIONS[option]`` (``default`` when unset) in ms, for a script. Raises
    ImproperlyConfigured naming it, as the system check reports it, for a value
    :func:`script_seconds_problem` refuses."""
    value = options.get(option, default)
    problem = script_seconds_problem(value)
    if problem is not None:
        raise ImproperlyConfigured(f"{where}['OPTIONS'][{option!r}] {problem}")
    return ttl_to_ms(value)


def kwargs_setting(alias):
    return f"SETNX_LOCKS[{alias!r}]['OPTIONS']['CONNECTION_KWARGS']"


def connection_kwargs(options, alias):
    """A copy of ``OPTIONS["CONNECTION_KWARGS"]``: ``{}`` when unset or None. Raises
    ImproperlyConfigured, as the system check reports it (E018/E037), for anything
    but a dict with str keys: a list of pairs would otherwise be taken by one backend
    and refused by the check, and crash the other with a TypeError."""
    kwargs = options.get("CONNECTION_KWARGS")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ImproperlyConfigured(
            f"{kwargs_setting(alias)} must be a dict, got {redacted(kwargs)}."
        )
    if not all(isinstance(key, str) for key in kwargs):
        raise ImproperlyConfigured(
            f"{kwargs_setting(alias)} must have str keys (argument names), got "
            f"{redacted(list(kwargs))}."
        )
    return dict(kwargs)


def _connection_label(pool):
    """``Connection for host:port`` (or the socket's path), as the messages name it."""
    kwargs = pool.connection_kwargs
    host = kwargs.get("host") or "localhost"  # where redis-py connects without one
    server = kwargs.get("path") or f"{host}:{kwargs.get('port') or 6379}"
    cls = pool.connection_class
    return f"{getattr(cls, '__name__', repr(cls))} for {server}"


#: The files (and the directory, ``ssl_ca_path``) a TLS connection reads when it
#: connects: a missing one is otherwise reported by every lock operation as a
#: connection error, "No such file or directory", as if the server were unreachable.
SSL_FILE_ARGUMENTS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
SSL_DIRECTORY_ARGUMENTS = ("ssl_ca_path",)
#: The timeouts our own code computes with (a str, "3", raised a bare TypeError).
TIMEOUT_ARGUMENTS = ("socket_timeout", "socket_connect_timeout")


def _connection_kwargs_problem(alias, url, kwargs):
    """``(error, pool)``: what the first lock operation would report about
    ``kwargs`` for the server of ``url`` (see :func:`check_connection_kwargs`), or
    None; and the pool built from them, if one could be. Builds a pool and one
    connection object, as redis-py's ``Redis.from_url`` does: no I/O. A URL
    redis-py cannot read is the LOCATION checks' to report."""
    if not is_readable_url(url):
        return None, None
    kwargs = {k: v for k, v in kwargs.items() if k != "single_connection_client"}
    try:
        pool = redis.ConnectionPool.from_url(url, **kwargs)
        check_connection_kwargs(alias, pool)
    except ImproperlyConfigured as exc:
        return str(exc), None
    except Exception as exc:  # noqa: BLE001 - whatever it is, the first lock meets it too
        # redis-py's message may not say which argument (an AttributeError from deep
        # inside, say): the ones given are listed.
        given = ", ".join(sorted(map(str, kwargs))) or "none given"
        return (
            f"{kwargs_setting(alias)} ({given}; or the LOCATION URL's query): redis-py "
            f"refuses it: {type(exc).__name__}: {exc}"
        ), None
    return unusable_arguments_problem(alias, pool), pool


def unusable_arguments_problem(alias, pool):
    """What is wrong with ``pool``'s connection arguments that building a connection
    object does not find, or None: the socket timeouts (our own code computes with
    them, and the socket module takes an int or a float only: a str ("3"), a Decimal
    or a Fraction failed every lock with a bare TypeError, review r153), and the
    arguments read only when connecting (see _connect_arguments_problem)."""
    kwargs = pool.connection_kwargs
    where = f"{kwargs_setting(alias)} (or the LOCATION URL's query)"
    for argument in TIMEOUT_ARGUMENTS:
        value = kwargs.get(argument)
        if value is not None and not _is_seconds(value):
            return (
                f"{where}: {argument} must be None or a positive int or float (seconds), "
                f"got {value!r}."
            )
    return _connect_arguments_problem(where, kwargs)


def _connect_arguments_problem(where, kwargs):
    """What is wrong with the arguments redis-py reads only when it connects (so a
    connection object built without I/O takes them), or None: they failed the first
    lock with a bare TypeError, AttributeError or LookupError (review r159)."""
    interval = kwargs.get("health_check_interval", 0)
    if not _is_seconds(interval) and interval != 0:
        return (
            f"{where}: health_check_interval must be a number of seconds >= 0, got {interval!r}."
        )
    options = kwargs.get("socket_keepalive_options")
    if options is not None and not (
        isinstance(options, dict) and all(isinstance(k, int) for k in options)
    ):
        return (
            f"{where}: socket_keepalive_options must be a dict of socket option numbers "
            f"(socket.TCP_KEEPIDLE, ...) to values, got {options!r}."
        )
    encoding = kwargs.get("encoding", "utf-8")
    try:
        codecs.lookup(encoding)
    except (LookupError, TypeError):
        return f"{where}: encoding {encoding!r} is not a codec Python knows."
    return None


def _is_seconds(value):
    """A positive, finite int or float (a subclass too; not a bool)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int too large for a float (review r155)
        return False


def _missing_tls_file(alias, pool):
    """A warning about a TLS file (or directory) that ``pool``'s connections name and
    this machine lacks, or None. A warning, not an error: a job that runs the
    checks (``migrate``) may run where the certificates are not mounted (review
    r150)."""
    for arguments, exists, kind in (
        (SSL_FILE_ARGUMENTS, os.path.isfile, "file"),
        (SSL_DIRECTORY_ARGUMENTS, os.path.isdir, "directory"),
    ):
        for argument in arguments:
            path = pool.connection_kwargs.get(argument)
            if isinstance(path, (str, os.PathLike)) and not exists(path):
                return (
                    f"{kwargs_setting(alias)} (or the LOCATION URL's query): {argument} is "
                    f"{os.fspath(path)!r}, which is not a {kind} on this machine "
                    f"({_connection_label(pool)}): every lock operation will fail to "
                    f"connect where that is so."
                )
    return None


def check_client_options(
    options, where, error, warn, *, kwargs_id, eviction_id, tls_id, alias, urls=()
):
    """The system checks of the options the Redis and Redlock backends share:
    ``error(id, message)`` for a CONNECTION_KWARGS that is not a dict with str keys
    (as first use says, see :func:`connection_kwargs`), or that,
    with one of ``urls`` (the servers a plain redis-py client is made for), has an
    argument redis-py's connection does not take or a value it (or we) cannot use;
    or an ALLOW_EVICTION that is not a bool. ``warn(id, message)`` for a TLS file
    missing here."""
    try:
        kwargs = connection_kwargs(options, alias)
    except ImproperlyConfigured as exc:  # the very message of first use
        error(kwargs_id, str(exc))
        kwargs = None
    if kwargs is not None and redis is not None:
        # The first of each only: the same arguments are refused for every master.
        problem = missing = None
        for url in urls:
            problem, pool = _connection_kwargs_problem(alias, url, kwargs)
            if problem is not None:
                error(kwargs_id, problem)
                break
            if missing is None and pool is not None:
                missing = _missing_tls_file(alias, pool)
        if problem is None and missing is not None:
            warn(tls_id, missing)
    allow = options.get(ALLOW_EVICTION_OPTION, False)
    if not isinstance(allow, bool):
        error(
            eviction_id,
            f"{where}['OPTIONS'][{ALLOW_EVICTION_OPTION!r}] must be True or False, got {allow!r}.",
        )
