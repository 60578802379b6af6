"""Pages of lock listings: one order for every backend, and the page a backend
gives when it can only stream its records (:meth:`~django_setnx.backends.base.BaseLockBackend.page`).

An *ordering* is a sequence of ``(field, descending)`` pairs over
:data:`SORT_FIELDS`. :func:`complete_ordering` appends the name and the backend, so
every listing has a total order (a name is unique within a backend) and pages never
overlap or skip a lock. Names compare by code point, as Python compares strings.

A backend that streams its records (the default ``page()``) sorts at most
:data:`SORT_LIMIT` matching records; a backend with more returns them first, sorted
(the *sorted part*), and the others after them in its own order, and says so
(``LockPage.sorted_count`` < ``total``). The database backend sorts in SQL and is
never partial.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import LockInfo

#: ``(field, descending)`` pairs: how a listing is sorted.
Ordering = tuple[tuple[str, bool], ...]

#: Matching records a streamed listing reads and sorts at most.
SORT_LIMIT = 10_000
#: Further records a streamed listing reads past a page to count the total; beyond
#: that the total is unknown (None).
COUNT_BUDGET = 10_000

#: What a listing can be sorted by, and each field's value for a LockInfo
#: (``backend`` is its alias; the times compare as epoch milliseconds).
SORT_FIELDS: dict[str, Callable[[LockInfo], Any]] = {
    "name": lambda info: info.name,
    "backend": lambda info: info.backend,
    # "held" < "stale": ascending shows held locks first.
    "state": lambda info: info.state,
    "fencing_token": lambda info: info.fencing_token,
    "acquired_at": lambda info: info.acquired_at_ms,
    "expires_at": lambda info: info.expires_at_ms,
}


@dataclass(frozen=True)
class LockPage:
    """One page of a backend's locks, as
    :meth:`~django_setnx.backends.base.BaseLockBackend.page` returns it.

    ``infos``: the page's LockInfos. ``total``: the number of matching locks, or
    None when counting them would cost too much. ``sorted_count``: how many matching
    locks the backend sorted (the whole listing unless it is *partial*); the first
    ``sorted_count`` of the listing follow the ordering, the rest follow the
    backend's own order.
    """

    infos: list[LockInfo]
    total: int | None
    sorted_count: int

    @property
    def partial(self) -> bool:
        """Whether some matching locks are left out of the sorted part."""
        return self.total is None or self.sorted_count < self.total


@functools.total_ordering
class _Descending:
    """A sort key value that sorts in reverse (strings cannot be negated)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Descending) and bool(self.value == other.value)

    def __lt__(self, other: _Descending) -> bool:
        return bool(other.value < self.value)


def check_ordering(ordering: Iterable[tuple[str, object]]) -> Ordering:
    """``ordering`` as a tuple of ``(field, descending)``; ValueError naming an
    unknown field."""
    checked = tuple((field, bool(descending)) for field, descending in ordering)
    for field, _descending in checked:
        if field not in SORT_FIELDS:
            raise ValueError(
                f"cannot sort locks by {field!r}: choose among {', '.join(SORT_FIELDS)}."
            )
    return checked


def check_window(offset: object, limit: object) -> tuple[int, int]:
    """``(offset, limit)`` of a page, checked: whole numbers >= 0 (ValueError naming
    the value)."""
    for what, value in (("offset", offset), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"page {what} must be a whole number >= 0, got {value!r}.")
    return offset, limit  # type: ignore[return-value]  # checked: ints


def complete_ordering(ordering: Sequence[tuple[str, bool]]) -> Ordering:
    """``ordering`` followed by the name, then the backend, ascending, unless already
    in it: a total order."""
    present = {field for field, _descending in ordering}
    return tuple(ordering) + tuple(
        (field, False) for field in ("name", "backend") if field not in present
    )


def sort_key(ordering: Sequence[tuple[str, bool]]) -> Callable[[LockInfo], tuple[Any, ...]]:
    """The key function (LockInfo -> comparable) of ``complete_ordering(ordering)``."""
    parts = [(SORT_FIELDS[field], descending) for field, descending in complete_ordering(ordering)]

    def key(info: LockInfo) -> tuple[Any, ...]:
        return tuple(
            _Descending(value(info)) if descending else value(info) for value, descending in parts
        )

    return key


def page_of_stream(
    stream: Iterable[LockInfo], ordering: Sequence[tuple[str, bool]], offset: int, limit: int
) -> LockPage:
    """The :class:`LockPage` of a streamed listing (``list()``'s LockInfos): the first
    SORT_LIMIT records sorted by ``ordering``, the rest after them as streamed. Reads
    at most ``SORT_LIMIT + offset + limit + COUNT_BUDGET`` records."""
    stream = iter(stream)
    head = list(itertools.islice(stream, SORT_LIMIT + 1))
    rest = itertools.chain(head[SORT_LIMIT:], stream)
    # SCAN may return a key twice while Redis rehashes: one row per name.
    head = sorted({info.name: info for info in head[:SORT_LIMIT]}.values(), key=sort_key(ordering))
    infos = head[offset : offset + limit]
    from_head = len(infos)
    skipped = sum(1 for _ in itertools.islice(rest, max(0, offset - len(head))))
    seen = {info.name for info in infos}
    for info in rest:
        if len(infos) >= limit:
            rest = itertools.chain([info], rest)
            break
        if info.name not in seen:
            seen.add(info.name)
            infos.append(info)
    counted = sum(1 for _ in itertools.islice(rest, COUNT_BUDGET + 1))
    before = len(head) + skipped + len(infos) - from_head
    return LockPage(infos, None if counted > COUNT_BUDGET else before + counted, len(head))
