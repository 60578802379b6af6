"""Lock-name globs: one syntax and one matcher for every backend, the admin's search
and the ``--name`` option of the commands.

Syntax (matched against the whole name, case-sensitively, character by character):

- ``*`` matches any run of characters, the empty one included;
- ``?`` matches exactly one character;
- ``[abc]`` one of the characters listed, ``[a-z]`` a range, ``[!a]`` or ``[^a]``
  any character but those; a ``]`` right after the ``[`` (or after the ``!``/``^``)
  is a member, and ``\\`` escapes inside the brackets too;
- ``\\x`` matches ``x`` itself, so ``\\*`` is a literal star.

A ``[`` without its ``]`` and a trailing lone ``\\`` are errors (``ValueError``
naming the pattern) rather than guesses, because each tool guessed differently.

Matching never backtracks: the pattern is split at its stars into segments of fixed
width, each compiled to a regular expression without quantifiers, and each is
searched for once, leftmost first (a greedy match is also a correct one when every
segment has a fixed width). That is at worst ``len(name) * len(pattern)`` character
comparisons, done by the regex engine in C: microseconds per name for any pattern a
user types into the admin's search box.
"""

import re
from dataclasses import dataclass

from .conf import MAX_NAME_LENGTH

#: Longest pattern accepted (characters): a whole name escaped character by
#: character, between two stars (the admin's substring search). The cap bounds the
#: worst case.
MAX_PATTERN_LENGTH = 2 * MAX_NAME_LENGTH + 2
METACHARACTERS = "*?[]\\"


@dataclass(frozen=True)
class _Class:
    """A bracket expression: ``negate``, single ``chars`` and inclusive ``ranges``."""

    negate: bool
    chars: frozenset
    ranges: tuple

    def regex(self):
        members = "".join(re.escape(ch) for ch in sorted(self.chars))
        members += "".join(f"{re.escape(low)}-{re.escape(high)}" for low, high in self.ranges)
        return f"[{'^' if self.negate else ''}{members}]"


_ANY = object()  # the atom of "?"


def _segment_regex(segment):
    """A compiled regular expression of one segment: fixed-width atoms only (no
    quantifier, no alternation), so a regex engine matches it at a position in time
    proportional to its length, and searches a name for it in C."""
    parts = []
    for atom in segment:
        if atom is _ANY:
            parts.append(".")
        elif isinstance(atom, str):
            parts.append(re.escape(atom))
        else:
            parts.append(atom.regex())
    return re.compile("".join(parts), re.DOTALL)


class Glob:
    """A compiled glob. ``match(name)`` says whether the whole ``name`` matches;
    ``literal_prefix`` is the text every match starts with (for a backend that can
    narrow its search, as Redis' ``SCAN MATCH`` or an SQL ``WHERE`` can)."""

    __slots__ = ("pattern", "_segments", "_starred", "_regexes", "_lengths", "literal_prefix")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._segments, self._starred = _parse(pattern)
        self._regexes = [_segment_regex(segment) for segment in self._segments]
        self._lengths = [len(segment) for segment in self._segments]
        prefix = []
        for atom in self._segments[0]:
            if not isinstance(atom, str):
                break
            prefix.append(atom)
        self.literal_prefix = "".join(prefix)

    def __repr__(self):
        return f"Glob({self.pattern!r})"

    @property
    def is_literal(self):
        """True if the pattern matches exactly one name (no wildcard at all)."""
        return not self._starred and all(isinstance(a, str) for a in self._segments[0])

    def match(self, name: str) -> bool:
        regexes, lengths = self._regexes, self._lengths
        if not self._starred:
            return regexes[0].fullmatch(name) is not None
        end = len(name) - lengths[-1]
        if lengths[0] > end:
            return False
        if regexes[0].match(name) is None or regexes[-1].fullmatch(name, end) is None:
            return False
        # Greedy, leftmost first: with fixed-width segments a leftmost match of each
        # leaves the most room to the ones after it, so it never needs undoing.
        position = lengths[0]
        for regex in regexes[1:-1]:
            found = regex.search(name, position, end)
            if found is None:
                return False
            position = found.end()
        return True

    __call__ = match


def _parse(pattern):
    """``(segments, starred)``: the atoms between stars, and whether there was one."""
    if not isinstance(pattern, str):
        raise TypeError(f"A name glob must be a str, not {type(pattern).__name__}: {pattern!r}.")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(
            f"The name glob is {len(pattern)} characters long; the limit is "
            f"{MAX_PATTERN_LENGTH}: {pattern[:40]!r}..."
        )
    segments = [[]]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            segments.append([])
        elif c == "?":
            segments[-1].append(_ANY)
        elif c == "\\":
            if i + 1 == n:
                raise ValueError(
                    f"The name glob {pattern!r} ends with a lone backslash; write \\\\ for a "
                    f"literal one."
                )
            i += 1
            segments[-1].append(pattern[i])
        elif c == "[":
            atom, i = _parse_class(pattern, i)
            segments[-1].append(atom)
        else:
            segments[-1].append(c)
        i += 1
    return segments, len(segments) > 1


def _parse_class(pattern, start):
    """Parse the bracket expression opening at ``start``; returns (atom, index of ']')."""
    i, n = start + 1, len(pattern)
    negate = i < n and pattern[i] in "!^"
    if negate:
        i += 1
    members = []  # (character, escaped): escapes resolved
    first = True
    while True:
        if i >= n:
            raise ValueError(
                f"The name glob {pattern!r} has a '[' without a closing ']'; write \\[ for a "
                f"literal one."
            )
        c = pattern[i]
        if c == "]" and not first:
            break
        escaped = c == "\\"
        if escaped:
            if i + 1 == n:
                raise ValueError(
                    f"The name glob {pattern!r} ends with a lone backslash; write \\\\ for a "
                    f"literal one."
                )
            i += 1
            c = pattern[i]
        members.append((c, escaped))
        first = False
        i += 1
    chars, ranges = set(), []
    j = 0
    while j < len(members):
        c = members[j][0]
        # "a-z": an unescaped dash between two members makes a range.
        if j + 2 < len(members) and members[j + 1] == ("-", False):
            low, high = sorted((c, members[j + 2][0]))
            ranges.append((low, high))
            j += 3
            continue
        chars.add(c)
        j += 1
    return _Class(negate, frozenset(chars), tuple(ranges)), i


def compile_glob(pattern: str) -> Glob:
    """Return a :class:`Glob` for ``pattern``; raises ValueError/TypeError naming a
    malformed one. ``None`` and ``""`` are not patterns: callers treat them as "all"."""
    return Glob(pattern)


def escape(text):
    """Escape glob metacharacters so ``text`` matches only itself."""
    return "".join("\\" + c if c in METACHARACTERS else c for c in text)


def search_to_glob(query):
    """The admin search box: a query with ``*`` or ``?`` is a glob over the whole name;
    anything else is a substring. Returns None for an empty query."""
    if not query:
        return None
    if "*" in query or "?" in query:
        return query
    return f"*{escape(query)}*"


def redis_match(glob):
    """A Redis ``SCAN MATCH`` fragment selecting a superset of ``glob``'s matches: its
    literal prefix (escaped for Redis) and a star. The exact test is :meth:`Glob.match`,
    applied to what SCAN returns, so Redis' own glob dialect never decides anything."""
    return escape(glob.literal_prefix) + "*"
