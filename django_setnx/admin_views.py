"""The data side of the admin's Locks page: one page of the locks of several
backends, and force-releasing one lock only if it has not changed hands.

Everything here goes through the backends' base class (:class:`BaseLockBackend`):
``page()`` for listings and counts, ``get()`` and ``delete(name, fencing_token=...)``
for releases, so any backend appears in the admin with no code of its own here.

The default order is backend after backend, each by name. A page sorted by a column
(``ordering``) merges the backends into one order (:func:`paging.sort_key`): each
backend returns the first rows of its listing in that order, and a backend that
could sort only part of its locks (more than ``paging.SORT_LIMIT``; see
:meth:`BaseLockBackend.page`) has its sorted part merged with the others and the
rest after every sorted lock, in its own order; the page says so
(``LockPage.partially_sorted``).

Force-release compares before it deletes: the confirmation page shows each lock's
fencing token, the final POST carries it back, and ``backend.delete(name,
fencing_token=...)`` removes the record only if it still carries that token, in one
atomic step, so a lock that changed hands in the meantime is never removed.
"""

import heapq
import itertools
import math

from .backends.base import STATES
from .backends.paging import sort_key
from .exceptions import LockBackendError

#: Rows per page of the Locks page.
PER_PAGE = 100


# -- one page of the listing --------------------------------------------------------


class LockPage:
    """One page of the merged listing of several backends (``[(alias, backend)]``).

    ``ordering`` (``[(field, descending)]``, fields of ``paging.SORT_FIELDS``) sorts
    the listing across backends; without it, backend after backend (see the
    module's docstring).

    ``rows``: the LockInfos of the page; ``errors``: ``{alias: message}`` of
    backends that could not be read; ``total``: the number of matching locks, or
    None when counting would be slow; ``has_next``/``has_previous``;
    ``num_pages`` (None without a total); ``partially_sorted``: the aliases whose
    locks a sorted listing could sort only partly.
    """

    def __init__(
        self, backends, *, state=None, glob=None, number=1, per_page=PER_PAGE, ordering=()
    ):
        self.number = number
        self.per_page = per_page
        self.errors = {}
        self.partially_sorted = []
        self._query = {"state": state, "name_glob": glob, "ordering": tuple(ordering)}
        start = (number - 1) * per_page
        want = per_page + 1  # one more than a page: tells whether there is a next page
        if ordering:
            rows, totals = self._sorted(backends, start, want)
        else:
            rows, totals = self._by_backend(backends, start, want)
        self.has_next = len(rows) > per_page
        self.rows = rows[:per_page]
        self.has_previous = number > 1
        if all(n is not None for n in totals):
            self.total = sum(totals)
        elif not self.has_next and self.rows:
            self.total = start + len(self.rows)
        else:
            self.total = None
        self.num_pages = None if self.total is None else max(1, math.ceil(self.total / per_page))
        self.start_index = start + 1 if self.rows else 0
        self.end_index = start + len(self.rows)

    def _page(self, alias, backend, offset, limit):
        """``backend.page()`` of this listing, or None (the error noted)."""
        try:
            return backend.page(**self._query, offset=offset, limit=limit)
        except LockBackendError as exc:
            self.errors[alias] = str(exc)
            return None

    def _by_backend(self, backends, start, want):
        """``(rows, totals)``: rows ``start`` to ``start + want`` of the backends one
        after the other, and each backend's total (None: not counted)."""
        skip, rows, totals = start, [], []
        for alias, backend in backends:
            page = self._page(alias, backend, skip, want)
            if page is None:
                continue
            rows.extend(page.infos)
            want -= len(page.infos)
            totals.append(page.total)
            skip = 0 if page.total is None else max(0, skip - page.total)
        return rows, totals

    def _sorted(self, backends, start, want):
        """``(rows, totals)`` of the listing sorted by the ordering: the sorted parts of
        every backend merged, then the rest of the partly sorted ones."""
        if len(backends) == 1:
            # One backend: its own listing is the page's.
            ((alias, backend),) = backends
            page = self._page(alias, backend, start, want)
            if page is None:
                return [], []
            if page.partial:
                self.partially_sorted.append(alias)
            return page.infos, [page.total]
        # A merged page's rows are among the first start + want of each backend.
        heads, tails, totals = [], [], []
        for alias, backend in backends:
            page = self._page(alias, backend, 0, start + want)
            if page is None:
                continue
            if page.partial:
                self.partially_sorted.append(alias)
            heads.append(page.infos[: page.sorted_count])
            tails.append(page.infos[page.sorted_count :])
            totals.append(page.total)
        merged = heapq.merge(*heads, key=sort_key(self._query["ordering"]))
        rows = itertools.chain(merged, itertools.chain.from_iterable(tails))
        return list(itertools.islice(rows, start, start + want)), totals


def state_counts(backends, glob):
    """``{alias: {state: count}}`` of the locks matching ``glob`` in each state
    (the admin's filter counts); a count is None where counting would be costly
    (see BaseLockBackend.page) or the backend cannot be read."""
    counts = {}
    for alias, backend in backends:
        counts[alias] = dict.fromkeys(STATES)
        for state in STATES:
            try:
                counts[alias][state] = backend.page(state=state, name_glob=glob, limit=0).total
            except LockBackendError:
                break  # unreachable: not asked again (each try may wait for a timeout)
    return counts


# -- force-release ------------------------------------------------------------------


class ReleaseOutcome:
    RELEASED = "released"
    GONE = "gone"
    CHANGED = "changed"

    def __init__(self, status, info=None, current=None):
        self.status = status
        self.info = info  # the LockInfo removed (RELEASED)
        self.current = current  # the LockInfo found instead (CHANGED)


def release_if_unchanged(backend, name, fencing_token):
    """Force-release ``name`` only if its fencing token is still ``fencing_token``
    (0: a record that cannot be read). Returns a :class:`ReleaseOutcome`. Raises
    LockBackendError."""
    removed = backend.delete(name, fencing_token=fencing_token)
    if removed is not None:
        return ReleaseOutcome(ReleaseOutcome.RELEASED, info=removed)
    current = backend.get(name)
    if current is None:
        return ReleaseOutcome(ReleaseOutcome.GONE)
    return ReleaseOutcome(ReleaseOutcome.CHANGED, current=current)


# -- display helpers ----------------------------------------------------------------


def format_duration(seconds):
    """``3.2 s``, ``4 min 10 s``, ``2 h 5 min``, ``3 d 4 h`` (seconds >= 0)."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    seconds = int(seconds)
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def owner_fields(info):
    """``(host, pid, thread, guards)`` of a LockInfo's owner, as strings; the raw
    text of an owner that could not be read comes first."""
    owner = info.owner if isinstance(info.owner, dict) else {"raw": info.owner}
    for key in ("raw", "unreadable"):
        if key in owner and len(owner) == 1:
            return str(owner[key]), "", "", ""
    return tuple(
        "" if owner.get(key) is None else str(owner.get(key))
        for key in ("host", "pid", "thread", "guards")
    )
