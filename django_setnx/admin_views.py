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

import itertools
import json
import math

from django.db import connections
from django.db.models import BigIntegerField, OuterRef, Subquery, Value
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce

from .backends.base import HELD, STALE, LockInfo
from .backends.redis import _NOW
from .exceptions import LockBackendError
from .models import FencingCounter, LockRecord

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
GLOB_METACHARACTERS = "*?[]\\"


# -- search ------------------------------------------------------------------------


def escape_glob(text):
    """Escape glob metacharacters so ``text`` only matches itself."""
    return "".join("\\" + c if c in GLOB_METACHARACTERS else c for c in text)


def search_to_glob(query):
    """The name glob for the search box's ``query`` (None for an empty search).

    A query with ``*`` or ``?`` is a Redis-style glob, matched against the whole
    name (``\\`` escapes, ``[abc]`` classes); anything else is a substring, with
    every glob metacharacter in it escaped.
    """
    if not query:
        return None
    if "*" in query or "?" in query:
        return query
    return f"*{escape_glob(query)}*"


def _regex_literal(c):
    # Escape ASCII punctuation only: a backslash before a letter or digit means
    # something else in PostgreSQL's, MySQL's and Python's regex dialects alike.
    return "\\" + c if ord(c) < 128 and not c.isalnum() else c


def glob_to_sql_regex(pattern):
    """Translate a Redis-style glob into a regex that PostgreSQL (ARE), MySQL (ICU),
    MariaDB (PCRE) and SQLite (Python ``re``) all read the same way."""
    out = ["^"]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            out.append(_regex_literal(pattern[i + 1]))
            i += 2
            continue
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = pattern.find("]", i + 2)
            if j == -1:
                out.append(_regex_literal(c))
            else:
                body = pattern[i + 1 : j]
                negate = body[:1] in ("^", "!")
                if negate:
                    body = body[1:]
                body = body.replace("\\", "\\\\")
                out.append(f"[{'^' if negate else ''}{body}]")
                i = j
        else:
            out.append(_regex_literal(c))
        i += 1
    out.append("$")
    return "".join(out)


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

    def _queryset(self, state, glob):
        # An empty token marks a row kept only for the waiter next in line: no lock.
        qs = LockRecord.objects.using(self.database).exclude(token="")
        if state == STALE:
            qs = qs.filter(expires_at__lte=self._now())
        elif state == HELD:
            qs = qs.filter(expires_at__gt=self._now())
        if glob:
            qs = qs.filter(name__regex=glob_to_sql_regex(glob))
        return qs

    def _with_info_columns(self, qs):
        fence = FencingCounter.objects.using(self.database).filter(name=OuterRef("name"))
        return qs.annotate(
            _now_ms=self._now(),
            _fencing=Coalesce(Subquery(fence.values("value")[:1]), Value(0),
                              output_field=BigIntegerField()),
        )

    def _info(self, row):
        name, owner, acquired, expires, fencing, now = row[:6]
        try:
            owner = json.loads(owner) if owner else {}
        except ValueError:
            owner = {"raw": owner}
        if not isinstance(owner, dict):
            owner = {"raw": owner}
        return LockInfo(
            name=name, backend=self.alias, fencing_token=int(fencing), owner=owner,
            acquired_at_ms=int(acquired), expires_at_ms=int(expires), now_ms=int(now),
        )

    def _run(self, action, fn):
        from django.db import Error

        try:
            return fn()
        except Error as exc:
            raise LockBackendError(
                self.alias, f"{action} failed on database {self.database!r}: {exc}"
            ) from exc

    def count(self, state, glob):
        return self._run("count", lambda: self._queryset(state, glob).count())

    def fetch(self, state, glob, offset, limit, total=None):
        def work():
            qs = self._queryset(state, glob)
            count = qs.count() if total is None else total
            if limit <= 0 or offset >= count:
                return [], count
            # The fencing tokens in a second query for the page's names only: in the
            # first, PostgreSQL would evaluate a subquery for every row OFFSET skips.
            rows = list(
                qs.annotate(_now_ms=self._now())
                .order_by("name")
                .values_list("name", "owner", "acquired_at", "expires_at", "_now_ms")
                [offset : offset + limit]
            )
            fences = dict(
                FencingCounter.objects.using(self.database)
                .filter(name__in=[row[0] for row in rows])
                .values_list("name", "value")
            )
            return [
                self._info((name, owner, acquired, expires, fences.get(name, 0), now))
                for name, owner, acquired, expires, now in rows
            ], count

        return self._run("list", work)

    def owner_token(self, name):
        def work():
            rows = (
                self._with_info_columns(
                    LockRecord.objects.using(self.database).filter(name=name).exclude(token=""))
                .values_list("token", "_fencing")[:1]
            )
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
        self.head = escape_glob(backend.key_prefix) + ":{"
        self.head_len = len(backend.key_prefix) + 2

    def _name(self, key):
        if isinstance(key, bytes):
            key = key.decode("utf-8", "surrogateescape")
        return key[self.head_len : -len("}:lock")]

    def _keys(self, client, glob):
        """Yield the lock keys matching ``glob`` of each SCAN call (maybe none)."""
        match = f"{self.head}{glob or '*'}}}:lock"
        cursor = 0
        while True:
            cursor, keys = client.scan(cursor, match=match, count=SCAN_COUNT, _type="hash")
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
        if token is None or fencing is None:
            return None
        if isinstance(token, bytes):
            token = token.decode()
        return token, int(fencing)


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

    ``rows``: the LockInfos of the page; ``errors``: ``{alias: message}`` of
    backends that could not be read; ``total``: the number of matching locks, or
    None when counting would be slow; ``has_next``/``has_previous``;
    ``num_pages`` (None without a total).
    """

    def __init__(self, sources, *, state=None, glob=None, number=1, per_page=PER_PAGE):
        self.number = number
        self.per_page = per_page
        self.errors = {}
        start = (number - 1) * per_page
        skip = start
        want = per_page + 1  # one more than a page: tells whether there is a next page
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
    """``(host, pid, thread, guards)`` of a LockInfo's owner, as strings."""
    owner = info.owner if isinstance(info.owner, dict) else {"raw": info.owner}
    if "raw" in owner and len(owner) == 1:
        return str(owner["raw"]), "", "", ""
    return tuple(
        "" if owner.get(key) is None else str(owner.get(key))
        for key in ("host", "pid", "thread", "guards")
    )
