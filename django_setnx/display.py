"""Showing user data (lock names, owners' hosts and threads) where it could forge
what is around it: a terminal line, an admin page, a message.

A lock name is often built from a request (``invoice:{id}``), so it may carry a
newline, an ESC sequence, or a bidi override (U+202E) that makes a browser show the
rest of a line, fencing token and owner included, reversed. Such characters are
shown escaped, ``repr``-style; everything else as it is.
"""

import json
import unicodedata

from django.utils.html import escape, format_html
from django.utils.safestring import mark_safe

from .validation import split_slot

#: Unicode categories never shown raw: controls (newline, ESC, ...), format
#: characters (bidi overrides, isolates), line/paragraph separators and lone
#: surrogates.
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})

#: FIRST STRONG ISOLATE and POP DIRECTIONAL ISOLATE: plain text's <bdi>.
_ISOLATE, _POP_ISOLATE = "\u2068", "\u2069"


def printable(text, *, backslash=True):
    """``text`` with every character that could forge output lines, drive a terminal
    or reorder the text around it escaped ``repr``-style: ``"a\\nb"`` -> ``a\\nb``,
    ESC -> ``\\x1b``, U+202E -> ``\\u202e``. With ``backslash`` (the commands'
    output) the backslash too, so that the result is unambiguous; the admin keeps
    it, so that a name reads as it is typed into the search box."""
    text = str(text)
    if text.isprintable() and not (backslash and "\\" in text):
        return text  # the common case, without a per-character loop
    out = []
    for ch in text:
        if ch == "\\" and backslash:
            out.append("\\\\")
        elif unicodedata.category(ch) in UNSAFE_CATEGORIES:
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def marked_html(text):
    """HTML for ``printable(text, backslash=False)`` (the admin's form) in which each
    escape stands out from typed text: ``<span class="setnx-escaped" title="U+000A">
    \\n</span>``. A name holding a real newline and one typed with a backslash
    and an ``n`` read the same as text, but no longer look alike on the page.
    Returns a SafeString; everything else is HTML-escaped."""
    text = str(text)
    if text.isprintable():
        return escape(text)  # always: a name marked safe by its caller is still data
    out, run = [], []
    for ch in text:
        if unicodedata.category(ch) not in UNSAFE_CATEGORIES:
            run.append(ch)
            continue
        out.append(escape("".join(run)))
        run.clear()
        out.append(
            format_html(
                '<span class="setnx-escaped" title="{}">{}</span>',
                f"U+{ord(ch):04X}",
                printable(ch, backslash=False),
            )
        )
    out.append(escape("".join(run)))
    return mark_safe("".join(out))


def record_display_name(record):
    """A record's name as people read it, with no record at hand: a lock's name, or
    ``"<semaphore> [slot i]"`` for a slot's (see ``LockInfo.display_name``, which
    knows the limit too)."""
    split = split_slot(record)
    return record if split is None else f"{split[0]} [slot {split[1]}]"


def isolated(text):
    """:func:`printable` ``text`` between bidi isolates, for plain text (a message)
    where HTML's ``<bdi>`` cannot be used: right-to-left letters in a name never
    reorder the text after it."""
    return f"{_ISOLATE}{printable(text, backslash=False)}{_POP_ISOLATE}"


def json_line(value):
    """``value`` as one line of JSON (NDJSON) that stays one line for every reader:
    non-ASCII text is kept as it is, except the characters :func:`printable` escapes,
    written as ``\\uXXXX`` (U+2028, U+2029 and U+0085 end a line for Python's
    ``str.splitlines()`` and other Unicode-aware readers)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    if text.isprintable():
        return text
    return "".join(
        _json_escape(ch) if unicodedata.category(ch) in UNSAFE_CATEGORIES else ch for ch in text
    )


def _json_escape(ch):
    code = ord(ch)
    if code > 0xFFFF:  # JSON escapes a character beyond the BMP as a surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"
