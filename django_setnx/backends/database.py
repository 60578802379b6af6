"""Database backend: a table whose unique constraint emulates Redis ``SETNX``.

One row per held (or stale) lock in ``django_setnx_lock``, unique on ``name``.
Acquire is an insert; when the name exists, the same statement takes the row over
if and only if it has expired (``INSERT ... ON CONFLICT/ON DUPLICATE KEY UPDATE``
with the expiry test inside it), so of two racers for an expired lock exactly one
wins — the race that made the original SETNX recipe need GETSET cannot happen.
Release and extend are single statements conditioned on the token.

Fencing tokens come from ``django_setnx_fence`` (one counter per name, never
deleted), bumped in the same transaction as the insert or takeover, while the lock
row is locked, so they strictly increase per name in commit order. An acquire is
one round trip on PostgreSQL (one statement) and on MySQL/MariaDB (one query of
several statements: our private connection is opened with ``MULTI_STATEMENTS``;
every value in it is a bound parameter), a few calls into the library on SQLite.

Every statement runs on a connection of our own (one per thread) in autocommit,
never on the caller's: a lock taken inside ``transaction.atomic()`` is visible to
other processes at once, survives the caller's rollback, and a contention never
breaks the caller's transaction. Expiry is judged by the database's clock, in
integer milliseconds since the epoch.

Fairness. A caller that was refused and will retry asks for the place *next in
line*, kept in three columns of the lock row (``next_token``, ``next_since``,
``next_seen``): it gets it if nobody has it, if its holder stopped asking for
``NEXT_LAPSE_MS``, or if it has been waiting longer than its holder. While a live
waiter is next in line, only that waiter may take the lock over: a release leaves
the row behind with an empty token (no lock, hidden from ``get``, ``list``, the
admin and ``clearlocks``) instead of deleting it, so a client that releases and
loops straight back to acquire cannot take the lock again ahead of the waiters. The
waiter next in line polls every few milliseconds (``HEAD_POLL``), the others back
off (up to ``WAITER_MAX_BACKOFF``); each waiter takes the place over from a later
one at its next attempt, so the longest-waiting caller gets the lock within about
one ``WAITER_MAX_BACKOFF`` of becoming the longest-waiting. Mutual exclusion never
depends on this: it is only about who wins next.

SQLite has a single writer. The backend switches an SQLite database to WAL mode
(``OPTIONS["SQLITE_WAL"]``, default True; the mode is stored in the database file),
so that a caller's open read transaction does not block our writes. A lock
acquired or released while the caller's own connection holds an open *write*
transaction still waits for it, and fails with ``LockBackendError`` after the
database's ``timeout`` option: take locks outside such blocks on SQLite.
"""

import copy
import json
import os
import threading
import time
import weakref

from django.core import checks

from ..exceptions import LockBackendError
from ..models import FencingCounter, LockRecord
from ..validation import ttl_to_ms
from .base import (
    STALE, STATES, AcquireResult, BaseLockBackend, ClearResult, LockInfo, glob_matcher,
)

LOCK_TABLE = LockRecord._meta.db_table
FENCE_TABLE = FencingCounter._meta.db_table

#: The database's clock as integer milliseconds since the Unix epoch. Each is
#: constant within one statement and independent of the session's time zone.
NOW_MS = {
    "postgresql": "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000)::bigint",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
}

#: How many rows list() and clear() read per round trip.
BATCH_SIZE = 500

#: A waiter next in line that has not asked for this long (ms, database clock) has
#: given up or died: it loses its place. A live one renews it every NEXT_RENEW.
NEXT_LAPSE_MS = 1000
NEXT_RENEW = 0.25
#: The waiter next in line retries after HEAD_POLL seconds, doubling up to
#: HEAD_POLL_MAX: only that one caller per lock polls this fast (the others back
#: off, up to WAITER_MAX_BACKOFF), so a release is taken up within milliseconds at
#: a bounded cost to the database (at most 1 / HEAD_POLL_MAX queries a second while
#: a long hold lasts).
HEAD_POLL = 0.0005
HEAD_POLL_MAX = 0.008
#: The other waiters' longest backoff (seconds), below the base class' MAX_BACKOFF.
WAITER_MAX_BACKOFF = 0.1

_INFO_COLUMNS = "l.name, l.owner, l.acquired_at, l.expires_at, COALESCE(f.value, 0), {now}"


class _Dialect:
    """The SQL of one vendor, with ``%s`` placeholders (``?`` on SQLite)."""

    def __init__(self, vendor, quote, is_mariadb):
        if vendor not in NOW_MS:
            raise LockBackendError("?", f"database vendor {vendor!r} is not supported")
        self.vendor = vendor
        self.is_mariadb = is_mariadb
        now = NOW_MS[vendor]
        lock, fence = quote(LOCK_TABLE), quote(FENCE_TABLE)
        self.now = now
        self.lock_table, self.fence_table = lock, fence
        # Who may take over an expired (or released-to-the-next-waiter) row: anyone
        # when no live waiter is next in line, else only that waiter. {t} is the
        # row's table reference, {x} the new values' ("excluded" row).
        self.may_take = (
            "{t}.expires_at <= {x}.acquired_at AND ({t}.next_token = '' "
            "OR {t}.next_token = {x}.token "
            f"OR {{t}}.next_seen <= {{x}}.acquired_at - {NEXT_LAPSE_MS})"
        )
        self.release = (
            f"DELETE FROM {lock} WHERE name = %s AND token = %s "
            f"AND (next_token = '' OR next_seen <= {now} - {NEXT_LAPSE_MS})"
        )
        # A waiter is next in line: leave it the lock (expired, empty token) instead
        # of deleting the row, so nobody else can take it before that waiter does.
        self.release_to_next = (
            f"UPDATE {lock} SET token = '', owner = '{{}}', expires_at = {now} "
            f"WHERE name = %s AND token = %s"
        )
        # A refused caller that will retry: take the place next in line if it is
        # free, lapsed, already ours, or held by a caller who started waiting later.
        # Params: token, since, name, token, token, since.
        self.queue = (
            f"UPDATE {lock} SET next_token = %s, next_since = %s, next_seen = {now} "
            f"WHERE name = %s AND token <> %s AND (next_token = '' OR next_token = %s "
            f"OR next_seen <= {now} - {NEXT_LAPSE_MS} OR next_since > %s)"
        )
        self.unqueue = (
            f"UPDATE {lock} SET next_token = '', next_since = 0, next_seen = 0 "
            f"WHERE name = %s AND next_token = %s"
        )
        # A row released to a waiter that then withdrew or lapsed is no lock: drop it.
        self.drop_placeholder = f"DELETE FROM {lock} WHERE name = %s AND token = '' AND next_token = ''"
        self.purge_placeholders = (
            f"DELETE FROM {lock} WHERE token = '' AND next_seen <= {now} - {NEXT_LAPSE_MS}"
        )
        self.extend = f"UPDATE {lock} SET expires_at = {now} + %s WHERE name = %s AND token = %s"
        self.owns = f"SELECT 1 FROM {lock} WHERE name = %s AND token = %s AND expires_at > {now}"
        self.info_select = (
            f"SELECT {_INFO_COLUMNS.format(now=now)}, l.id, l.token FROM {lock} l "
            f"LEFT JOIN {fence} f ON f.name = l.name"
        )
        self.get = f"{self.info_select} WHERE l.name = %s AND l.token <> ''"
        self.delete_owned = f"DELETE FROM {lock} WHERE id = %s AND token = %s"
        self.returning = vendor in ("postgresql", "sqlite") or is_mariadb

        if vendor == "postgresql":
            # One statement: insert-or-take-over, then bump the fence only if we won.
            # The fence row stays locked until the statement commits, so tokens are
            # handed out in commit order. On contention, the holder's remaining ms.
            self.acquire = f"""
                WITH taken AS (
                    INSERT INTO {lock} AS l (name, token, owner, acquired_at, expires_at,
                                             next_token, next_since, next_seen)
                    VALUES (%s, %s, %s, {now}, {now} + %s, '', 0, 0)
                    ON CONFLICT (name) DO UPDATE SET
                        token = EXCLUDED.token, owner = EXCLUDED.owner,
                        acquired_at = EXCLUDED.acquired_at, expires_at = EXCLUDED.expires_at,
                        next_token = '', next_since = 0, next_seen = 0
                    WHERE {self.may_take.format(t="l", x="EXCLUDED")}
                    RETURNING l.name
                ), fenced AS (
                    INSERT INTO {fence} AS f (name, value) SELECT name, 1 FROM taken
                    ON CONFLICT (name) DO UPDATE SET value = f.value + 1
                    RETURNING f.value
                )
                SELECT value, NULL FROM fenced
                UNION ALL
                SELECT NULL, h.expires_at - {now} FROM {lock} h
                WHERE h.name = %s AND NOT EXISTS (SELECT 1 FROM taken)
            """
        elif vendor == "sqlite":
            self.take = f"""
                INSERT INTO {lock} (name, token, owner, acquired_at, expires_at,
                                    next_token, next_since, next_seen)
                VALUES (%s, %s, %s, {now}, {now} + %s, '', 0, 0)
                ON CONFLICT (name) DO UPDATE SET
                    token = excluded.token, owner = excluded.owner,
                    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at,
                    next_token = '', next_since = 0, next_seen = 0
                WHERE {self.may_take.format(t=lock, x="excluded")}
                RETURNING token, expires_at - {now}
            """
            self.bump_fence = f"""
                INSERT INTO {fence} (name, value) VALUES (%s, 1)
                ON CONFLICT (name) DO UPDATE SET value = value + 1 RETURNING value
            """
            self.remaining = f"SELECT expires_at - {now} FROM {lock} WHERE name = %s"
        else:  # MySQL / MariaDB
            # MySQL applies the assignments left to right, each seeing the previous
            # ones: once ``token`` is ours, the other columns follow it.
            may_take = (
                "expires_at <= VALUES(acquired_at) AND (next_token = '' "
                "OR next_token = VALUES(token) "
                f"OR next_seen <= VALUES(acquired_at) - {NEXT_LAPSE_MS})"
            )
            upsert = f"""
                INSERT INTO {lock} (name, token, owner, acquired_at, expires_at,
                                    next_token, next_since, next_seen)
                VALUES (%s, %s, %s, {now}, {now} + %s, '', 0, 0)
                ON DUPLICATE KEY UPDATE
                    token = IF({may_take}, VALUES(token), token),
                    owner = IF(token = VALUES(token), VALUES(owner), owner),
                    acquired_at = IF(token = VALUES(token), VALUES(acquired_at), acquired_at),
                    expires_at = IF(token = VALUES(token), VALUES(expires_at), expires_at),
                    next_token = IF(token = VALUES(token), '', next_token),
                    next_since = IF(token = VALUES(token), 0, next_since),
                    next_seen = IF(token = VALUES(token), 0, next_seen)
            """
            # The whole acquire in one round trip (our connection allows several
            # statements per query), in one transaction: the upsert, a fence bump
            # that only happens if the row is ours now, then who holds the row and
            # the fence's value. Params: name, token, owner, ttl_ms, name, token, name.
            self.acquire = f"""
                START TRANSACTION;
                {upsert};
                INSERT INTO {fence} (name, value)
                    SELECT name, 1 FROM {lock} WHERE name = %s AND token = %s
                    ON DUPLICATE KEY UPDATE value = value + 1;
                SELECT l.token, l.expires_at - {now}, f.value
                    FROM {lock} l LEFT JOIN {fence} f ON f.name = l.name WHERE l.name = %s;
                COMMIT
            """

        if vendor == "sqlite":
            for attr, sql in list(vars(self).items()):
                if isinstance(sql, str) and "%s" in sql:
                    setattr(self, attr, sql.replace("%s", "?"))
        self.placeholder = "?" if vendor == "sqlite" else "%s"

    def begin(self):
        # IMMEDIATE takes SQLite's write lock up front, so the read-then-write inside
        # the transaction cannot deadlock with another writer.
        return "BEGIN IMMEDIATE" if self.vendor == "sqlite" else "START TRANSACTION"

    def placeholders(self, count):
        return ", ".join([self.placeholder] * count)


class DatabaseBackend(BaseLockBackend):
    """Locks in a table of a Django database (``OPTIONS["DATABASE"]``, default ``"default"``)."""

    #: Waiters poll: the longest-waiting one must come back soon enough to claim the
    #: place next in line (see "Fairness" above) before a newer one does.
    max_backoff = WAITER_MAX_BACKOFF

    def __init__(self, alias, params):
        super().__init__(alias, params)
        # token -> _Waiter, for the refused callers of this process that will retry.
        self._waiting = {}
        self.database = self.options.get("DATABASE", "default")
        self.sqlite_wal = bool(self.options.get("SQLITE_WAL", True))
        self._local = threading.local()
        self._dialect = None
        # Every wrapper we opened, to close them all from close() (any thread).
        self._wrappers = weakref.WeakSet()
        self._wrappers_lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget_connections)

    @classmethod
    def check_params(cls, alias, params):
        from django.conf import settings

        database = (params.get("OPTIONS") or {}).get("DATABASE", "default")
        if database not in getattr(settings, "DATABASES", {}):
            return [checks.Error(
                f"SETNX_LOCKS[{alias!r}]['OPTIONS']['DATABASE'] is {database!r}, which is not "
                f"in DATABASES (configured: {', '.join(map(repr, settings.DATABASES)) or 'none'}).",
                id="django_setnx.E020",
            )]
        engine = settings.DATABASES[database].get("ENGINE", "")
        if not any(v in engine for v in ("postgresql", "postgis", "mysql", "sqlite")):
            return [checks.Error(
                f"SETNX_LOCKS[{alias!r}] uses database {database!r} with ENGINE {engine!r}; "
                f"the database backend supports PostgreSQL, MySQL/MariaDB and SQLite.",
                id="django_setnx.E021",
            )]
        return []

    # -- connections --------------------------------------------------------------

    def _forget_connections(self):
        # A forked child must not talk over its parent's sockets; it reconnects.
        self._local = threading.local()
        self._wrappers = weakref.WeakSet()

    def _wrapper(self):
        wrapper = getattr(self._local, "wrapper", None)
        if wrapper is None:
            from django.db import connections
            from django.utils.connection import ConnectionDoesNotExist

            try:
                base = connections[self.database]
            except ConnectionDoesNotExist as exc:
                raise LockBackendError(self.alias, f"database {self.database!r} is not configured") from exc
            # A private copy of the caller's connection: same settings (including a
            # test database's name), but its own socket and transaction state.
            settings_dict = copy.deepcopy(base.settings_dict)
            if base.vendor == "mysql":
                # Several statements per query, for the one-round-trip acquire.
                from MySQLdb.constants import CLIENT  # what Django's MySQL backend uses

                options = settings_dict.setdefault("OPTIONS", {})
                options["client_flag"] = (options.get("client_flag", CLIENT.FOUND_ROWS)
                                          | CLIENT.MULTI_STATEMENTS)
            wrapper = base.__class__(settings_dict, alias=self.database)
            self._local.wrapper = wrapper
            with self._wrappers_lock:
                self._wrappers.add(wrapper)
        return wrapper

    def _raw_connection(self):
        wrapper = self._wrapper()
        if wrapper.connection is None:
            try:
                wrapper.ensure_connection()
            except Exception as exc:  # the driver's errors, wrapped by Django
                self._drop(wrapper)
                raise LockBackendError(self.alias, f"cannot connect to database {self.database!r}: {exc}") from exc
            if self._dialect is None:
                self._dialect = _Dialect(
                    wrapper.vendor, wrapper.ops.quote_name, getattr(wrapper, "mysql_is_mariadb", False)
                )
            if wrapper.vendor == "sqlite" and self.sqlite_wal:
                self._run("enable WAL", lambda cursor, sql, raw: cursor.execute("PRAGMA journal_mode=WAL"))
        return wrapper, wrapper.connection

    def _drop(self, wrapper):
        try:
            wrapper.close()
        except Exception:
            pass
        wrapper.connection = None

    def _run(self, action, work):
        """Run ``work(cursor, dialect, raw_connection)`` and translate driver errors.

        A connection that raised anything but an integrity error is dropped, so the
        next call reconnects instead of reusing a broken socket.
        """
        wrapper, raw = self._raw_connection()
        try:
            cursor = raw.cursor()
            try:
                return work(cursor, self._dialect, raw)
            finally:
                cursor.close()
        except wrapper.Database.Error as exc:
            self._drop(wrapper)
            raise LockBackendError(self.alias, f"{action} failed on database {self.database!r}: {exc}") from exc

    def close(self):
        with self._wrappers_lock:
            wrappers = list(self._wrappers)
        for wrapper in wrappers:
            self._drop(wrapper)

    # -- acquire ------------------------------------------------------------------

    def acquire(self, name, token, ttl, owner, wait=0.0):
        """Returns ``AcquireResult.won(fencing)`` or ``.lost(retry_after=seconds)``.

        A refused caller that will retry (``wait`` > 0 or None) also asks for the
        place next in line (see "Fairness" in the module docstring).
        """
        owner_json = json.dumps(owner, sort_keys=True)
        ttl_ms = ttl_to_ms(ttl)

        def work(cursor, sql, raw):
            if sql.vendor == "postgresql":
                cursor.execute(sql.acquire, (name, token, owner_json, ttl_ms, name))
                row = cursor.fetchone()
                if row is not None and row[0] is not None:
                    result = AcquireResult.won(row[0])
                else:
                    result = AcquireResult.lost(retry_after=_remaining(row and row[1]))
            elif sql.vendor == "mysql":
                result = self._acquire_mysql(cursor, sql, name, token, owner_json, ttl_ms)
            else:
                result = self._acquire_in_transaction(cursor, sql, raw, name, token, owner_json,
                                                      ttl_ms)
            if result.acquired:
                # Taking the row cleared the place next in line if it was ours.
                self._waiting.pop(token, None)
            elif wait != 0:
                self._queue(cursor, sql, name, token)
            return result

        return self._run("acquire", work)

    def _queue(self, cursor, sql, name, token):
        """Ask for (or renew) the place next in line; remember whether we have it."""
        waiter = self._waiting.get(token)
        if waiter is None:
            waiter = self._waiting[token] = _Waiter()
        elif waiter.head and time.monotonic() - waiter.renewed < NEXT_RENEW:
            return  # ours, and renewed recently enough not to lapse
        cursor.execute(sql.queue, (token, waiter.since_ms, name, token, token, waiter.since_ms))
        head = cursor.rowcount == 1
        if head and not waiter.head:
            waiter.polls = 0
        waiter.head = head
        waiter.renewed = time.monotonic()

    def stop_waiting(self, name, token):
        """Give up the place next in line, if this caller had asked for it. Returns
        None: a database lock is never handed to a caller that is not retrying."""
        if self._waiting.pop(token, None) is None:
            return None

        def work(cursor, sql, raw):
            cursor.execute(sql.unqueue, (name, token))
            if cursor.rowcount:
                # Released to us and we leave: the row is no lock any more.
                cursor.execute(sql.drop_placeholder, (name,))

        self._run("stop waiting", work)
        return None

    def retry_delay(self, token, attempt, max_wait, retry_after):
        """Briefly (HEAD_POLL, doubling to HEAD_POLL_MAX) for the caller next in
        line; the usual capped, jittered backoff for the others."""
        waiter = self._waiting.get(token)
        if waiter is None or not waiter.head:
            return self.backoff(attempt, max_wait, retry_after)
        delay = min(HEAD_POLL * (2 ** min(waiter.polls, 8)), HEAD_POLL_MAX)
        waiter.polls += 1
        return max(delay if max_wait is None else min(delay, max_wait), 0)

    def _acquire_mysql(self, cursor, sql, name, token, owner_json, ttl_ms):
        """MySQL/MariaDB: the multi-statement acquire; reads each statement's result
        in turn (an error in one is raised here, and _run drops the connection,
        which rolls the open transaction back)."""
        row = None
        try:
            cursor.execute(sql.acquire, (name, token, owner_json, ttl_ms, name, token, name))
            while True:  # every statement's result must be read, in order
                if cursor.description is not None:
                    row = cursor.fetchone()
                if not cursor.nextset():
                    break
        except BaseException:
            # Interrupted halfway (an error, a KeyboardInterrupt): unread results and
            # the open transaction must not reach the next call on this connection.
            self._drop(self._wrapper())
            raise
        holder_token, remaining_ms, fencing = row
        if holder_token == token:
            return AcquireResult.won(fencing)
        return AcquireResult.lost(retry_after=_remaining(remaining_ms))

    def _acquire_in_transaction(self, cursor, sql, raw, name, token, owner_json, ttl_ms):
        """SQLite: the upsert and the fence bump in one write transaction."""
        cursor.execute(sql.begin())
        try:
            cursor.execute(sql.take, (name, token, owner_json, ttl_ms))
            row = cursor.fetchone()
            if row is None or row[0] != token:
                # A refused upsert returns no row; ask how long the holder has left.
                cursor.execute(sql.remaining, (name,))
                row = cursor.fetchone()
                cursor.execute("ROLLBACK")
                return AcquireResult.lost(retry_after=_remaining(row and row[0]))
            cursor.execute(sql.bump_fence, (name,))
            fencing = cursor.fetchone()[0]
            cursor.execute("COMMIT")
            return AcquireResult.won(fencing)
        except BaseException:
            try:
                cursor.execute("ROLLBACK")
            except Exception:
                pass
            raise

    # -- token-checked single statements -------------------------------------------

    def release(self, name, token):
        """Returns True if the row carried ``token`` and was deleted (or, with a
        waiter next in line, left to that waiter)."""
        def work(cursor, sql, raw):
            cursor.execute(sql.release, (name, token))
            if cursor.rowcount == 1:
                return True
            cursor.execute(sql.release_to_next, (name, token))
            return cursor.rowcount == 1

        return self._run("release", work)

    def extend(self, name, token, ttl):
        def work(cursor, sql, raw):
            cursor.execute(sql.extend, (ttl_to_ms(ttl), name, token))
            return cursor.rowcount == 1

        return self._run("extend", work)

    def owns(self, name, token):
        def work(cursor, sql, raw):
            cursor.execute(sql.owns, (name, token))
            return cursor.fetchone() is not None

        return self._run("owns", work)

    # -- reading ------------------------------------------------------------------

    def _info(self, row):
        name, owner, acquired, expires, fencing, now = row[:6]
        try:
            owner = json.loads(owner) if owner else {}
        except ValueError:
            owner = {"raw": owner}
        return LockInfo(
            name=name, backend=self.alias, fencing_token=int(fencing), owner=owner,
            acquired_at_ms=int(acquired), expires_at_ms=int(expires), now_ms=int(now),
        )

    def get(self, name):
        def work(cursor, sql, raw):
            cursor.execute(sql.get, (name,))
            row = cursor.fetchone()
            return None if row is None else self._info(row)

        return self._run("get", work)

    def _scan(self, *, state=None, after_id=0):
        """Yield raw rows in id order, BATCH_SIZE per query (keyset pagination)."""
        while True:
            def work(cursor, sql, raw, after_id=after_id):
                where = f"l.id > {sql.placeholder} AND l.token <> ''"
                if state is not None:
                    where += f" AND l.expires_at {'<=' if state == STALE else '>'} {sql.now}"
                cursor.execute(
                    f"{sql.info_select} WHERE {where} ORDER BY l.id LIMIT {BATCH_SIZE}", (after_id,)
                )
                return cursor.fetchall()

            rows = self._run("list", work)
            yield from rows
            if len(rows) < BATCH_SIZE:
                return
            after_id = rows[-1][6]

    def list(self, *, state=None, name_glob=None):
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        infos = (self._info(row) for row in self._scan(state=state))
        return self.filter_infos(infos, name_glob=name_glob)

    # -- removing -----------------------------------------------------------------

    def delete(self, name):
        def work(cursor, sql, raw):
            cursor.execute(sql.get, (name,))
            row = cursor.fetchone()
            if row is None:
                return None, True
            cursor.execute(sql.delete_owned, (row[6], row[7]))
            # rowcount 0: re-acquired between the two statements; look again.
            return self._info(row), cursor.rowcount == 1

        for _ in range(5):
            info, done = self._run("delete", work)
            if done:
                return info
        raise LockBackendError(self.alias, f"could not delete lock {name!r}: it keeps changing hands")

    def clear(self, *, include_held=False, name_glob=None, older_than=None, dry_run=False,
              progress=None):
        result = ClearResult(self.alias)
        matches = glob_matcher(name_glob) if name_glob else None
        batch = {}  # row id -> name

        def flush():
            removed = list(batch.values()) if dry_run else self._delete_batch(
                list(batch), include_held, older_than)
            batch.clear()
            if removed:
                result.names.extend(removed)
                if progress is not None:
                    progress(removed)

        if not dry_run:
            self._run("clear", lambda cursor, sql, raw: cursor.execute(sql.purge_placeholders))
        for row in self._scan(state=None if include_held else STALE):
            info = self._info(row)
            if matches is not None and not matches(info.name):
                continue
            if older_than is not None and info.now_ms - info.acquired_at_ms < older_than * 1000:
                continue
            batch[row[6]] = info.name
            if len(batch) >= BATCH_SIZE:
                flush()
        if batch:
            flush()
        return result

    def _delete_batch(self, ids, include_held, older_than):
        """Delete the given rows, re-checking in the DELETE itself that each is still
        stale (and old enough), so a lock re-acquired meanwhile is never removed.
        Returns the names actually deleted."""
        def work(cursor, sql, raw):
            where = f"id IN ({sql.placeholders(len(ids))}) AND token <> ''"
            params = list(ids)
            if not include_held:
                where += f" AND expires_at <= {sql.now}"
            if older_than is not None:
                where += f" AND acquired_at <= {sql.now} - {sql.placeholder}"
                params.append(int(older_than * 1000))
            if sql.returning:
                cursor.execute(f"DELETE FROM {sql.lock_table} WHERE {where} RETURNING name", params)
                return [r[0] for r in cursor.fetchall()]
            cursor.execute(sql.begin())
            try:
                cursor.execute(f"SELECT name FROM {sql.lock_table} WHERE {where} FOR UPDATE", params)
                names = [r[0] for r in cursor.fetchall()]
                cursor.execute(f"DELETE FROM {sql.lock_table} WHERE {where}", params)
                cursor.execute("COMMIT")
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            return names

        return self._run("clear", work)


class _Waiter:
    """A refused caller of this process that will retry."""

    __slots__ = ("since_ms", "head", "renewed", "polls")

    def __init__(self):
        # When it started waiting, by this app server's clock: only compared with
        # other waiters' to find the longest-waiting one (fairness, never safety).
        self.since_ms = int(time.time() * 1000)
        self.head = False  # it has the place next in line
        self.renewed = 0.0  # monotonic time of its last queue statement
        self.polls = 0  # retries since it became next in line


def _remaining(ms):
    return None if ms is None else max(int(ms), 0) / 1000
