"""Helpers shared by the commands: backend selection, the common arguments, the
confirmation prompt, and safe display of user data (lock names, owners)."""

import unicodedata

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError

from django_setnx.display import printable
from django_setnx.globs import compile_glob
from django_setnx.handler import locks


def add_backend_arguments(parser, action):
    parser.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="ALIAS",
        help=f"{action} only this alias of SETNX_LOCKS (repeatable; default: every alias).",
    )
    parser.add_argument(
        "--name",
        dest="name_glob",
        metavar="GLOB",
        help="Only locks whose name matches this glob (*, ?, [abc], [a-z], [!a] or [^a], "
        "\\ escapes), with the same meaning on every backend.",
    )


def confirm_or_cancel(question, cancelled):
    """Ask ``question`` (which ends by asking for 'yes'); anything but 'yes', or no
    answer at all (EOF, Ctrl-C), raises CommandError(``cancelled``)."""
    try:
        answer = input(
            question + "\nAre you sure you want to do this?\n\n"
            "    Type 'yes' to continue, or 'no' to cancel: "
        )
    except (EOFError, KeyboardInterrupt):
        answer = ""
    if answer.strip() != "yes":
        raise CommandError(cancelled)


def select_backends(requested):
    """Return ``[(alias, backend)]`` for the requested aliases (default: all), or
    raise CommandError naming an unknown or unloadable alias."""
    try:
        configured = list(locks)
    except ImproperlyConfigured as exc:
        raise CommandError(str(exc)) from exc
    aliases = list(dict.fromkeys(requested)) if requested else configured
    unknown = [a for a in aliases if a not in configured]
    if unknown:
        raise CommandError(
            f"Unknown lock backend {', '.join(map(repr, unknown))}; SETNX_LOCKS configures "
            f"{', '.join(map(repr, configured)) or 'none'}."
        )
    selected = []
    for alias in aliases:
        try:
            selected.append((alias, locks[alias]))
        except ImproperlyConfigured as exc:
            raise CommandError(f"Lock backend {alias!r} cannot be loaded: {exc}") from exc
    return selected


def backend_failure(alias, exc):
    """The message of a backend that failed mid-command, naming its alias once."""
    from django_setnx.exceptions import LockBackendError

    if isinstance(exc, LockBackendError) and exc.alias == alias:
        return str(exc)  # "Lock backend 'alias': ..."
    return f"Lock backend {alias!r}: {exc}"


def validate_glob(pattern):
    """Return the ``--name`` glob (None when not given), or raise CommandError for an
    empty or malformed one (see :mod:`django_setnx.globs`)."""
    if pattern is None:
        return None
    if pattern == "":
        raise CommandError("--name must not be empty (use --name '*' for every lock).")
    try:
        compile_glob(pattern)
    except ValueError as exc:
        raise CommandError(f"--name: {exc}") from exc
    return pattern


#: Commands print user data through this (see django_setnx.display).
escape = printable


def char_width(ch):
    """Terminal columns taken by ``ch``: 2 for wide East Asian characters, 0 for
    combining marks, else 1."""
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def display_width(text):
    if text.isascii():
        return len(text)
    return sum(char_width(ch) for ch in text)


def truncate(text, width, ellipsis="..."):
    """``text`` cut to at most ``width`` terminal columns, ending in ``ellipsis`` when cut."""
    if display_width(text) <= width:
        return text
    room = width - len(ellipsis)
    out, used = [], 0
    for ch in text:
        w = char_width(ch)
        if used + w > room:
            break
        out.append(ch)
        used += w
    return "".join(out) + ellipsis


def plural(count, word):
    return f"{count} {word}{'' if count == 1 else 's'}"
