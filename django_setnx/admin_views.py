"""The data side of the admin's Locks page: listing pages of locks from every
backend, and force-releasing one lock only if it has not changed hands.

The page shows the locks of every configured backend, backend after backend, 100 at
a time, and never reads every lock to show one page. Each backend is read through a
*source*:

- :class:`DatabaseSource` (the database backend) queries the ``LockRecord`` table
  with ``COUNT``, ``ORDER BY name`` and ``LIMIT/OFFSET``, filtering state by the
  database's own clock and names with a regular expression translated from the glob,
  so any page costs two indexed queries and the total is exact.
- :class:`RedisSource` (the Redis backend) walks the key space with ``SCAN`` (key
  names only, following the backend's documented key layout), skipping to the page
  without reading the records it skips, then reads the page's records with
  ``backend.get()``. Filtering by state reads one field per key. Up to
  :data:`SORT_LIMIT` matching locks are sorted by name; beyond that, pages follow
  ``SCAN`` order (stable while Redis does not resize its key table), sorted within
  a page.
- :class:`StreamSource` (any other backend) takes the page from the backend's
  streaming ``list()`` with ``itertools.islice``.

Streamed sources count the remaining records only up to :data:`COUNT_BUDGET`, and
Redis only when the SCAN finds at most :data:`SORT_LIMIT` lock keys; past that the page shows
"next/previous" instead of a total.

That is the default order: backend after backend, by name within each. A page
sorted by a column (:class:`LockPage` with ``ordering``) merges the backends into
one order, by :func:`sort_key`, which every source follows:

- the database sorts in SQL (``ORDER BY`` the column, then the name in code point
  order: ``COLLATE "C"`` on PostgreSQL; the column's own collation is binary on
  SQLite and MySQL/MariaDB), with ``LIMIT/OFFSET``;
- Redis and any streamed backend read at most :data:`SORT_LIMIT` matching records
  from ``backend.list()`` and sort them in Python. A backend with more is sorted
  only partly: those records take their place in the merged order, the others
  follow after every sorted lock in the backend's own order (not counted), and
  the page says so (``LockPage.partially_sorted``).

A page of a sorted listing of several backends reads, from each, the records up to
the end of that page (the merge needs them); one backend alone is read from the
page's offset.

Force-release compares before it deletes: the confirmation page shows each lock's
fencing token and the final POST carries it back. A backend whose ``delete()``
takes ``fencing_token`` does the compare-and-delete itself. On the database and Redis
backends the release is a single atomic compare-and-delete (the record's owner token
is read, checked against the fencing token, and handed to ``backend.release()``,
which deletes only a record that still carries that owner token), so a lock that
changed hands in the meantime is never removed. Other backends get ``get`` →
compare → ``delete``, which leaves a window of one round trip in which a new holder
could be removed; that case is detected (the removed record's fencing token differs)
and reported.
"""

import functools
import heapq
import itertools
import math

from django.db import connections
from django.db.models import BigIntegerField, Case, F, Value, When
from django.db.models.expressions import RawSQL
from django.db.models.functions import Collate

from .backends.base import HELD, STALE, STATES
from .backends.database import row_info
from .backends.redis import _NOW, _whole
from .exceptions import LockBackendError
from .globs import compile_glob, escape, redis_match
from .models import LockRecord

#: Rows per page of the Locks page.
PER_PAGE = 100
#: How many further records a streamed source reads past the page to count the
#: total; beyond that the total is shown as unknown.
COUNT_BUDGET = 10_000
#: Redis: when a listing's SCAN finds at most this many lock keys (before the state
#: filter), the matches are sorted by name (exact total, stable pages); beyond it,
#: pages follow SCAN order and show no total.
SORT_LIMIT = 10_000
#: ... and only when the SCAN completes within this many calls (a bound on the
#: keys Redis walks, whatever MATCH filters out: about SORT_SCAN_CALLS * SCAN_COUNT).
SORT_SCAN_CALLS = 25
#: Keys per Redis SCAN call.
SCAN_COUNT = 1000
#: KEYS: lock keys of one SCAN batch. ARGV: "1" for held, "0" for stale.
#: Returns the keys in that state, by Redis' clock (the backend's rule: held while
#: ``expires`` > now).
FILTER_BY_STATE = _NOW + """
local want_held = ARGV[1] == '1'
local out = {}
for _, key in ipairs(KEYS) do
  local expires = tonumber(redis.call('HGET', key, 'expires'))
  if expires and (expires > now) == want_held then
    out[#out + 1] = key
  end
end
return out
"""


# -- sorting -----------------------------------------------------------------------

#: What a listing can be sorted by, and each field's value for a LockInfo
#: (``backend`` is its alias; the times compare as epoch milliseconds).
SORT_FIELDS = {
    "name": lambda info: info.name,
    "backend": lambda info: info.backend,
    # "held" < "stale": ascending shows held locks first.
    "state": lambda info: info.state,
    "fencing_token": lambda info: info.fencing_token,
    "acquired_at": lambda info: info.acquired_at_ms,
    "expires_at": lambda info: info.expires_at_ms,
}


@functools.total_ordering
class _Descending:
    """A sort key value that sorts in reverse (strings cannot be negated)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return self.value == other.value

    def __lt__(self, other):
        return other.value < self.value


def complete_ordering(ordering):
    """``ordering`` (``[(field, descending)]``) followed by the name, then the
    backend, ascending, unless already in it. Returns a tuple: a total order, since
    a name is unique within a backend, so pages never overlap or skip a lock."""
    present = {field for field, _descending in ordering}
    return tuple(ordering) + tuple(
        (field, False) for field in ("name", "backend") if field not in present)


def sort_key(ordering):
    """The key function (LockInfo -> comparable) of ``complete_ordering(ordering)``;
    names compare by code point, as Python compares strings."""
    parts = [(SORT_FIELDS[field], descending)
             for field, descending in complete_ordering(ordering)]

    def key(info):
        return tuple(_Descending(value(info)) if descending else value(info)
                     for value, descending in parts)

    return key


class StreamRun:
    """A sorted listing of one backend read from ``backend.list()``: at most
    SORT_LIMIT matching records, sorted by ``key`` (the *sorted part*); when there
    are more, the others are the *tail*, in the backend's own order."""

    def __init__(self, alias, stream, key):
        self.alias = alias
        stream = iter(stream)
        head = list(itertools.islice(stream, SORT_LIMIT + 1))
        #: Whether some matching records are left out of the sorted part.
        self.partial = len(head) > SORT_LIMIT
        self._rest = itertools.chain(head[SORT_LIMIT:], stream)
        # SCAN may return a key twice while Redis rehashes: one row per name.
        head = list({info.name: info for info in head[:SORT_LIMIT]}.values())
        head.sort(key=key)
        self._head = head
        #: The number of records in the sorted part.
        self.size = len(head)

    def rows(self, offset, limit):
        """The sorted part's records ``offset`` to ``offset + limit``."""
        return self._head[offset : offset + limit]

    def tail(self, offset, limit):
        """``(infos, total)``: the tail's records ``offset`` to ``offset + limit``,
        and its length when it ends within them, else None: past SORT_LIMIT records,
        counting the rest would double the cost of every page. Call it once."""
        skipped = sum(1 for _ in itertools.islice(self._rest, offset))
        infos = list(itertools.islice(self._rest, limit))
        total = skipped + len(infos) if len(infos) < limit else None
        return list({info.name: info for info in infos}.values()), total


class DatabaseRun:
    """A sorted listing of one database backend: all of it sorted, in SQL."""

    partial = False

    def __init__(self, source, state, glob, ordering):
        self.alias = source.alias
        self._source = source
        self._query = (state, glob, ordering)
        self.size = source.count(state, glob)

    def rows(self, offset, limit):
        return self._source.fetch_sorted(*self._query, offset, limit)


# -- sources -----------------------------------------------------------------------


class StreamSource:
    """Any backend: pages are sliced out of ``backend.list()``."""

    #: Whether count() is cheap enough to call on every page view.
    cheap_count = False
    #: Whether owner_token() + backend.release() give an atomic compare-and-delete.
    atomic_release = False

    def __init__(self, alias, backend):
        self.alias = alias
        self.backend = backend

    def count(self, state, glob):
        """The exact number of matching locks, or None when it would be costly."""
        return self.fetch(state, glob, 0, 0)[1]

    def fetch(self, state, glob, offset, limit, total=None):
        """Return ``(infos, total)``: the matching locks ``offset`` to
        ``offset + limit`` and the total number of matches, or None when counting
        would cost more than COUNT_BUDGET further records. A ``total`` already
        known (from count()) may be passed in."""
        stream = iter(self.backend.list(state=state, name_glob=glob))
        seen = 0
        for _ in itertools.islice(stream, offset):
            seen += 1
        infos = list(itertools.islice(stream, limit))
        seen += len(infos)
        if len(infos) < limit:
            return infos, seen
        for extra, _ in enumerate(stream, 1):
            if extra > COUNT_BUDGET:
                return infos, None
            seen += 1
        return infos, seen

    def sorted_run(self, state, glob, ordering):
        """The matching locks sorted by ``ordering``: a :class:`StreamRun`, which
        reads up to SORT_LIMIT + 1 records now."""
        return StreamRun(self.alias, self.backend.list(state=state, name_glob=glob),
                         sort_key(ordering))

    def owner_token(self, name):
        """``(owner token, fencing token)`` of ``name``'s record, read together,
        or None when there is no record (only where ``atomic_release``)."""
        raise NotImplementedError


class DatabaseSource(StreamSource):
    """The database backend: SQL COUNT / ORDER BY name / LIMIT-OFFSET on LockRecord."""

    cheap_count = True
    atomic_release = True

    def __init__(self, alias, backend, now_sql):
        super().__init__(alias, backend)
        self.database = backend.database
        self.now_sql = now_sql

    def _now(self):
        return RawSQL(self.now_sql, (), output_field=BigIntegerField())

    def _queryset(self, state, glob=None):
        # An empty token marks a row kept only for the waiter next in line: no lock.
        qs = LockRecord.objects.using(self.database).exclude(token="")
        if state == STALE:
            qs = qs.filter(expires_at__lte=self._now())
        elif state == HELD:
            qs = qs.filter(expires_at__gt=self._now())
        if glob and glob.literal_prefix:
            # A prefilter only (case-insensitive on some databases): the glob itself
            # is matched in Python, in linear time, whatever a user types.
            qs = qs.filter(name__startswith=glob.literal_prefix)
        return qs

    def _matching_names(self, state, glob):
        """The names matching ``glob`` (a Glob), in name order."""
        names = (self._queryset(state, glob).order_by("name")
                 .values_list("name", flat=True).iterator(chunk_size=2000))
        return [name for name in names if glob.match(name)]


    def _info(self, row):
        # The backend's own reading of a row, tolerant of rows it never wrote.
        return row_info(self.alias, row)

    def _run(self, action, fn):
        from django.db import Error

        try:
            return fn()
        except Error as exc:
            raise LockBackendError(
                self.alias, f"{action} failed on database {self.database!r}: {exc}"
            ) from exc

    def count(self, state, glob):
        if glob:
            glob = compile_glob(glob)
            return self._run("count", lambda: len(self._matching_names(state, glob)))
        return self._run("count", lambda: self._queryset(state).count())

    def fetch(self, state, glob, offset, limit, total=None):
        def work():
            qs = self._queryset(state)
            if glob:
                matching = self._matching_names(state, compile_glob(glob))
                count = len(matching)
                qs = qs.filter(name__in=matching[offset : offset + limit])
                window = (0, limit)
            else:
                count = qs.count() if total is None else total
                window = (offset, offset + limit)
            if limit <= 0 or offset >= count:
                return [], count
            rows = list(
                qs.annotate(_now_ms=self._now())
                .order_by("name")
                .values_list(*self.PAGE_COLUMNS)
                [window[0] : window[1]]
            )
            return [self._info(row) for row in rows], count

        return self._run("list", work)

    #: The columns of a page's rows, as row_info() takes them.
    PAGE_COLUMNS = ("name", "owner", "acquired_at", "expires_at", "fencing", "_now_ms")

    def _name_in_code_point_order(self):
        """The name as ORDER BY must see it to sort as Python sorts strings: by code
        point, which is UTF-8's byte order. The column's collation is that already
        on SQLite (BINARY) and MySQL/MariaDB (binary, migration 0001); PostgreSQL
        sorts by the database's collation unless told "C"."""
        if connections[self.database].vendor == "postgresql":
            return Collate(F("name"), "C")
        return F("name")

    def _order_by(self, ordering):
        """ORDER BY expressions of ``complete_ordering(ordering)``, matching
        sort_key() (the backend is the same for every row: left out)."""
        expressions = {
            "name": self._name_in_code_point_order(),
            "state": Case(When(expires_at__gt=self._now(), then=Value(0)), default=Value(1)),
            "fencing_token": F("fencing"),
            "acquired_at": F("acquired_at"),
            "expires_at": F("expires_at"),
        }
        return [
            expressions[field].desc() if descending else expressions[field].asc()
            for field, descending in complete_ordering(ordering) if field != "backend"
        ]

    def sorted_run(self, state, glob, ordering):
        """A :class:`DatabaseRun` (it counts the matches now)."""
        return DatabaseRun(self, state, glob, ordering)

    def fetch_sorted(self, state, glob, ordering, offset, limit):
        """The matching locks ``offset`` to ``offset + limit`` in ``ordering``
        (LockInfos). With a glob, the rows are read in order, prefiltered by its
        literal prefix, until ``offset + limit`` of them match."""
        def work():
            glob_ = compile_glob(glob) if glob else None
            qs = self._queryset(state, glob_)
            qs = qs.annotate(_now_ms=self._now())
            rows = qs.order_by(*self._order_by(ordering)).values_list(*self.PAGE_COLUMNS)
            if glob_ is None:
                rows = list(rows[offset : offset + limit])
            else:
                matching = (row for row in rows.iterator(chunk_size=2000) if glob_.match(row[0]))
                rows = list(itertools.islice(matching, offset, offset + limit))
            return [self._info(row) for row in rows]

        return self._run("list", work)

    def owner_token(self, name):
        def work():
            rows = (LockRecord.objects.using(self.database).filter(name=name).exclude(token="")
                    .values_list("token", "fencing")[:1])
            return tuple(rows[0]) if rows else None

        return self._run("read", work)


class RedisSource(StreamSource):
    """The Redis backend: SCAN key names (the backend's documented layout
    ``P:{name}:lock``), then ``backend.get()`` for the page's names only."""

    atomic_release = True

    def __init__(self, alias, backend):
        super().__init__(alias, backend)
        import redis

        self.errors = (redis.exceptions.RedisError, OSError)
        self.head = escape(backend.key_prefix) + ":{"
        self.head_len = len(backend.key_prefix) + 2

    def _name(self, key):
        if isinstance(key, bytes):
            key = key.decode("utf-8", "surrogateescape")
        return key[self.head_len : -len("}:lock")]

    def _keys(self, client, glob):
        """Yield the lock keys matching ``glob`` of each SCAN call (maybe none).

        SCAN MATCH only narrows by the glob's literal prefix; the glob itself is
        matched here, so Redis' own glob dialect never decides what matches."""
        glob = compile_glob(glob) if glob else None
        match = f"{self.head}{redis_match(glob) if glob else '*'}}}:lock"
        cursor = 0
        while True:
            cursor, keys = client.scan(cursor, match=match, count=SCAN_COUNT, _type="hash")
            if glob is not None:
                keys = [key for key in keys if glob.match(self._name(key))]
            yield keys
            if int(cursor) == 0:
                return

    def _matching(self, client, state, glob):
        """Yield ``(keys examined, matching keys)`` per SCAN call; with ``state``,
        each key's ``expires`` decides (one script call per batch; one HGET per key
        on Redis Cluster)."""
        batches = self._keys(client, glob)
        if state is None:
            for keys in batches:
                yield len(keys), keys
            return
        want_held = "1" if state == HELD else "0"
        try:
            from redis.cluster import RedisCluster
        except ImportError:  # pragma: no cover - old redis-py
            RedisCluster = ()
        if isinstance(client, RedisCluster):
            for keys in batches:
                if not keys:
                    yield 0, []
                    continue
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.hget(key, "expires")
                pipe.time()
                *expires, (seconds, micros) = pipe.execute()
                now = int(seconds) * 1000 + int(micros) // 1000
                yield len(keys), [
                    key for key, exp in zip(keys, expires)
                    if exp is not None and (int(exp) > now) == (want_held == "1")
                ]
            return
        script = client.register_script(FILTER_BY_STATE)
        for keys in batches:
            yield len(keys), (script(keys=keys, args=[want_held]) if keys else [])

    def fetch(self, state, glob, offset, limit, total=None):
        with self.backend.translate_errors(*self.errors, action="list"):
            client = self.backend.connection.client
            batches = self._matching(client, state, glob)
            first, examined, complete = [], 0, True
            for calls, (count, keys) in enumerate(batches, 1):
                first.extend(keys)
                examined += count
                if examined > SORT_LIMIT or calls >= SORT_SCAN_CALLS:
                    complete = False
                    break
            if complete:
                # Few enough to sort: name order, an exact total, stable pages.
                names = sorted({self._name(key) for key in first})
                total = len(names)
                names = names[offset : offset + limit]
            else:
                # Many: SCAN order, skipping key names only (no total: counting them
                # all would cost a full SCAN). SCAN's order is stable while Redis does
                # not resize its key table.
                names, total = [], None
                keys = itertools.chain(first, itertools.chain.from_iterable(
                    keys for _count, keys in batches))
                seen = 0
                for key in keys:
                    if seen >= offset + limit:
                        break
                    if seen >= offset:
                        names.append(self._name(key))
                    seen += 1  # noqa: SIM113 - also the total when the loop ends
                else:
                    total = seen
                # SCAN may return a key twice while Redis rehashes.
                names = list(dict.fromkeys(names))
        infos = [info for info in map(self.backend.get, names) if info is not None]
        infos.sort(key=lambda info: info.name)
        return infos, total

    def owner_token(self, name):
        key = f"{self.backend.key_prefix}:{{{name}}}:lock"
        with self.backend.translate_errors(*self.errors, action=f"read {name!r}"):
            token, fencing = self.backend.connection.client.hmget(key, "token", "fencing")
        fencing = _whole(fencing)
        if token is None or fencing is None:
            return None
        if isinstance(token, bytes):
            token = token.decode(errors="replace")
        return token, fencing


def source_for(alias, backend):
    """The fastest source that understands ``backend``."""
    try:
        from .backends.database import NOW_MS, DatabaseBackend
    except ImportError:  # pragma: no cover
        DatabaseBackend = None
    try:
        from .backends.redis import RedisBackend
    except ImportError:  # pragma: no cover
        RedisBackend = None
    if DatabaseBackend is not None and isinstance(backend, DatabaseBackend):
        try:
            vendor = connections[backend.database].vendor
        except Exception:  # noqa: BLE001 - misconfigured: the stream reports it
            vendor = None
        if vendor in NOW_MS:
            return DatabaseSource(alias, backend, NOW_MS[vendor])
    if RedisBackend is not None and isinstance(backend, RedisBackend):
        try:
            import redis  # noqa: F401
        except ImportError:
            pass
        else:
            return RedisSource(alias, backend)
    return StreamSource(alias, backend)


# -- one page of the listing --------------------------------------------------------


class LockPage:
    """One page of the merged listing of several backends.

    ``ordering`` (``[(field, descending)]``, fields of SORT_FIELDS) sorts the
    listing across backends; without it, backend after backend (see the module's
    docstring).

    ``rows``: the LockInfos of the page; ``errors``: ``{alias: message}`` of
    backends that could not be read; ``total``: the number of matching locks, or
    None when counting would be slow; ``has_next``/``has_previous``;
    ``num_pages`` (None without a total); ``partially_sorted``: the aliases whose
    locks a sorted listing could sort only partly.
    """

    def __init__(self, sources, *, state=None, glob=None, number=1, per_page=PER_PAGE,
                 ordering=()):
        self.number = number
        self.per_page = per_page
        self.errors = {}
        self.partially_sorted = []
        start = (number - 1) * per_page
        want = per_page + 1  # one more than a page: tells whether there is a next page
        if ordering:
            rows, totals = self._sorted(sources, state, glob, ordering, start, want)
        else:
            rows, totals = self._by_backend(sources, state, glob, start, want)
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

    def _by_backend(self, sources, state, glob, start, want):
        """``(rows, totals)``: rows ``start`` to ``start + want`` of the backends one
        after the other, and each backend's total (None: not counted)."""
        skip = start
        rows = []
        totals = []
        for src in sources:
            try:
                n = None
                if src.cheap_count:
                    n = src.count(state, glob)
                    if want <= 0 or skip >= n:
                        skip = max(0, skip - n)
                        totals.append(n)
                        continue
                elif want <= 0:
                    totals.append(src.count(state, glob))
                    continue
                infos, n = src.fetch(state, glob, skip, want, total=n)
            except LockBackendError as exc:
                self.errors[src.alias] = str(exc)
                continue
            rows.extend(infos)
            want -= len(infos)
            totals.append(n)
            skip = 0 if n is None else max(0, skip - n)
        return rows, totals

    def _sorted(self, sources, state, glob, ordering, start, want):
        """``(rows, totals)`` of the listing sorted by ``ordering``: the sorted parts
        of every backend merged, then the tails of the partly sorted ones."""
        runs = []
        for src in sources:
            try:
                runs.append(src.sorted_run(state, glob, ordering))
            except LockBackendError as exc:
                self.errors[src.alias] = str(exc)
        rows = []
        if start < sum(run.size for run in runs):
            nonempty = [run for run in runs if run.size]
            if len(nonempty) == 1:
                offset, limit = start, want
            else:
                # A merged page's rows are among the first start + want of each run.
                offset, limit = 0, start + want
            parts = []
            for run in nonempty:
                try:
                    parts.append(run.rows(offset, limit))
                except LockBackendError as exc:
                    self.errors[run.alias] = str(exc)
                    runs.remove(run)
            merged = heapq.merge(*parts, key=sort_key(ordering))
            rows = list(itertools.islice(merged, start - offset, start - offset + want))
        sorted_size = sum(run.size for run in runs)
        totals = [sorted_size]
        skip = max(0, start - sorted_size)
        want -= len(rows)
        for run in runs:
            if not run.partial:
                continue
            self.partially_sorted.append(run.alias)
            try:
                infos, n = run.tail(skip, max(want, 0))
            except LockBackendError as exc:
                self.errors[run.alias] = str(exc)
                continue
            rows.extend(infos)
            want -= len(infos)
            totals.append(n)
            skip = 0 if n is None else max(0, skip - n)
        return rows, totals


def state_counts(sources, glob):
    """``{alias: {state: count}}`` of the locks matching ``glob`` in each state
    (the admin's filter counts); a count is None where counting would be costly
    (see each source's count()) or the backend cannot be read."""
    counts = {}
    for src in sources:
        counts[src.alias] = dict.fromkeys(STATES)
        for state in STATES:
            try:
                counts[src.alias][state] = src.count(state, glob)
            except LockBackendError:
                break  # unreachable: not asked again (each try may wait for a timeout)
    return counts


# -- force-release ------------------------------------------------------------------


class ReleaseOutcome:
    RELEASED = "released"
    GONE = "gone"
    CHANGED = "changed"
    #: get → compare → delete removed a record re-acquired in between.
    RACED = "raced"

    def __init__(self, status, info=None, current=None):
        self.status = status
        self.info = info          # the LockInfo removed (RELEASED, RACED)
        self.current = current    # the LockInfo found instead (CHANGED)


def _has_compare_and_delete(backend):
    """Whether ``backend.delete`` takes ``fencing_token`` (an atomic compare-and-delete)."""
    import inspect

    try:
        return "fencing_token" in inspect.signature(backend.delete).parameters
    except (TypeError, ValueError):
        return False


def release_if_unchanged(source, name, fencing_token):
    """Force-release ``name`` only if its fencing token is still ``fencing_token``.

    Returns a :class:`ReleaseOutcome`. Raises LockBackendError.
    """
    backend = source.backend
    if fencing_token == 0:
        # An unreadable record (no backend mints token 0): nothing to compare it by
        # but that it is still unreadable. Forcing it out is what the user asked.
        current = backend.get(name)
        if current is None:
            return ReleaseOutcome(ReleaseOutcome.GONE)
        if current.fencing_token != 0:
            return ReleaseOutcome(ReleaseOutcome.CHANGED, current=current)
        removed = backend.delete(name)
        if removed is None:
            return ReleaseOutcome(ReleaseOutcome.GONE)
        return ReleaseOutcome(ReleaseOutcome.RELEASED, info=removed)
    if _has_compare_and_delete(backend):
        removed = backend.delete(name, fencing_token=fencing_token)
        if removed is not None:
            return ReleaseOutcome(ReleaseOutcome.RELEASED, info=removed)
        current = backend.get(name)
        if current is None:
            return ReleaseOutcome(ReleaseOutcome.GONE)
        return ReleaseOutcome(ReleaseOutcome.CHANGED, current=current)
    info = backend.get(name)
    if info is None:
        return ReleaseOutcome(ReleaseOutcome.GONE)
    if info.fencing_token != fencing_token:
        return ReleaseOutcome(ReleaseOutcome.CHANGED, current=info)
    if source.atomic_release:
        # Compare-and-delete in one atomic step: release() deletes the record only
        # if it still carries this owner token, i.e. it is the very acquisition
        # whose fencing token we checked (a fencing token is never handed out twice
        # for a name).
        owned = source.owner_token(name)
        if owned is None:
            return ReleaseOutcome(ReleaseOutcome.GONE)
        token, fencing = owned
        if fencing != fencing_token:
            return ReleaseOutcome(ReleaseOutcome.CHANGED, current=backend.get(name))
        if backend.release(name, token):
            return ReleaseOutcome(ReleaseOutcome.RELEASED, info=info)
        current = backend.get(name)
        if current is None:
            return ReleaseOutcome(ReleaseOutcome.GONE)
        return ReleaseOutcome(ReleaseOutcome.CHANGED, current=current)
    # Any other backend: get -> compare -> delete, a window of one round trip.
    removed = backend.delete(name)
    if removed is None:
        return ReleaseOutcome(ReleaseOutcome.GONE)
    if removed.fencing_token != fencing_token:
        return ReleaseOutcome(ReleaseOutcome.RACED, info=removed)
    return ReleaseOutcome(ReleaseOutcome.RELEASED, info=removed)


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
