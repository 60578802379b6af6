"""The SQL of the database backend, one :class:`Dialect` per vendor (PostgreSQL,
MySQL/MariaDB, SQLite): every statement the backend sends, each judging expiry by
the database's own clock, with the timing constants the statements embed.
"""

from ..exceptions import LockBackendError
from ..models import LockRecord
from .base import MAX_PLAUSIBLE_MS

LOCK_TABLE = LockRecord._meta.db_table

#: The database's clock as integer milliseconds since the Unix epoch. Each is
#: constant within one statement and independent of the session's time zone.
NOW_MS = {
    "postgresql": "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000)::bigint",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
}

#: The database's clock in µs since the epoch, for fencing tokens. SQLite's clock
#: has only millisecond resolution: there the app server's clock is bound instead
#: (the database file is on that machine, see ``_sqlite_now_us``).
NOW_US = {
    "postgresql": "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000000)::bigint",
    "mysql": "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
}

#: A waiter next in line that has not asked for this long (ms, database clock) has
#: given up or died: it loses its place. A live one renews it every NEXT_RENEW
#: seconds. On PostgreSQL, whose waiters are woken by NOTIFY and otherwise poll only
#: every PG_SAFETY_POLL, both are longer.
NEXT_LAPSE_MS = 1000
NEXT_RENEW = 0.25
PG_NEXT_LAPSE_MS = 8000
PG_NEXT_RENEW = 1.0
#: A release that leaves the lock to the waiter next in line gives it this long (ms)
#: to take it (a *claim*, as on Redis): a live waiter is woken at once (PostgreSQL)
#: or polls well within it, and a dead one holds the others up for this long only.
CLAIM_MS = 500
#: A released row is kept this long (ms), token-less (a *tombstone*: no lock, hidden
#: like a row released to a waiter), so that the next acquire continues its fencing
#: tokens from the row's last one. Without it the next token would come from the
#: clock alone, read when the acquiring statement began: a statement that began
#: before another client acquired and released (it waited for a CPU, or for the row)
#: would insert a smaller token than that client's. As long as no acquiring
#: statement takes longer than this, tokens strictly increase. The purge (and
#: ``clearlocks``) drops older tombstones, so state stays bounded.
FENCING_RETENTION_MS = 60_000
#: PostgreSQL: a filter, always true, that makes the statement's transaction (one
#: statement: the lock connection is in autocommit) commit without waiting for its
#: WAL to reach the disk — for the statements whose loss in a database crash costs
#: only liveness: a release (the row would be held again until its expiry), a place
#: in line, a refused attempt (it writes only a row lock), a purge. An fsync costs
#: about 0.25 ms here, the rest of such a statement 0.04 ms. It is never safe for
#: a *winning* acquire (the crash could then hand the lock, and its fencing token,
#: to a second client) or an extend (the lock would expire earlier than its holder
#: was told): those commit synchronously, and since WAL is flushed in order, their
#: flush also makes durable every release they saw. ``is_local``: the setting ends
#: with the transaction, so it neither leaks into the session nor survives a
#: pooler (PgBouncer in transaction mode) handing the connection on.
PG_NO_FLUSH = "set_config('synchronous_commit', 'off', true) IS NOT NULL"
_INFO_COLUMNS = "l.name, l.owner, l.acquired_at, l.expires_at, l.fencing, {now}"


class Dialect:
    """The SQL of one vendor, with ``%s`` placeholders (``?`` on SQLite)."""

    def __init__(self, vendor, quote, is_mariadb):
        if vendor not in NOW_MS:
            raise LockBackendError("?", f"database vendor {vendor!r} is not supported")
        self.vendor = vendor
        self.is_mariadb = is_mariadb
        now = NOW_MS[vendor]
        lock = quote(LOCK_TABLE)
        self.now = now
        lapse = self.next_lapse_ms = PG_NEXT_LAPSE_MS if vendor == "postgresql" else NEXT_LAPSE_MS
        self.next_renew = PG_NEXT_RENEW if vendor == "postgresql" else NEXT_RENEW
        self.lock_table = lock
        # Milliseconds until the row's expiry, never negative. Tested first, so that
        # a row with an absurd (hand-written) expiry cannot overflow the subtraction.
        remaining = "CASE WHEN {t}.expires_at > {now} THEN {t}.expires_at - {now} ELSE 0 END"
        # A stale row: expired, or with times that this backend never writes (see
        # MAX_PLAUSIBLE_MS; on SQLite a text value also compares above it), so that
        # clearlocks removes an unreadable row instead of showing it as held forever.
        # {t} is the table reference.
        self.stale = (
            f"({{t}}.expires_at <= {now} OR {{t}}.expires_at > {MAX_PLAUSIBLE_MS} "
            f"OR {{t}}.acquired_at < 0 OR {{t}}.acquired_at > {MAX_PLAUSIBLE_MS})"
        )
        # Who may take over an expired (or released-to-the-next-waiter) row: anyone
        # when no live waiter is next in line, else only that waiter. {t} is the
        # row's table reference, {x} the new values' ("excluded" row).
        # A row whose expiry this backend could not have written (see
        # MAX_PLAUSIBLE_MS: a hand-written year 33715, say) is listed as stale, so it
        # must not block an acquire either.
        # On PostgreSQL the place next in line outlives its waiter's last renewal by
        # PG_NEXT_LAPSE_MS (8 s): a waiter killed with the holder (an OOM kill, a host
        # taking both down) kept the expired lock from everyone that long. Its waiter
        # wakes at the expiry, so the place gives it CLAIM_MS from the expiry, as
        # from a release that left it the lock (``release_any``); then anyone may
        # take the lock.
        claim_lapsed = (
            f" OR {{t}}.expires_at <= {{x}}.acquired_at - {CLAIM_MS}"
            if vendor == "postgresql"
            else ""
        )
        self.may_take = (
            f"({{t}}.expires_at <= {{x}}.acquired_at OR {{t}}.expires_at > {MAX_PLAUSIBLE_MS} "
            f"OR {{t}}.acquired_at < 0 OR {{t}}.acquired_at > {MAX_PLAUSIBLE_MS}) "
            "AND ({t}.next_token = '' OR {t}.next_token = {x}.token "
            f"OR {{t}}.next_seen <= {{x}}.acquired_at - {lapse}{claim_lapsed})"
        )
        # Leaves a tombstone (see FENCING_RETENTION_MS) that keeps the fencing token:
        # expired since the epoch, so free to an acquiring statement that began before
        # the release, and released at ``acquired_at`` (for the purge). Only when no
        # live waiter is next in line; on PostgreSQL only when none is recorded at all:
        # the other waiters there sleep until a NOTIFY (or the slow safety poll), and
        # a waiter whose place lapsed (it died) says that others may be waiting behind
        # it, so the release that wakes them (``release_any``) is used instead.
        # See PG_NO_FLUSH: appended to the WHERE of the statements it suits.
        no_flush = f" AND {PG_NO_FLUSH}" if vendor == "postgresql" else ""
        no_waiter = (
            "next_token = ''"
            if vendor == "postgresql"
            else f"(next_token = '' OR next_seen <= {now} - {lapse})"
        )
        # The assignments that make a row a tombstone (no lock, nobody next in line).
        self.tombstone = (
            f"token = '', owner = '{{}}', acquired_at = {now}, "
            f"expires_at = 0, next_token = '', next_since = 0, next_seen = 0"
        )
        self.release = (
            f"UPDATE {lock} SET {self.tombstone} "
            f"WHERE name = %s AND token = %s AND {no_waiter}{no_flush}"
        )
        claim_end = f"{now} - {lapse} + {CLAIM_MS}"
        # Both releases in one statement, for a lock that was just left to a waiter
        # (the backend then expects another waiter next in line; otherwise it sends
        # the shorter ``release`` first), and for one that ``release`` refused: to a
        # live waiter next in line, leaving it the lock (expired, empty token) instead
        # of a tombstone, so nobody else can take it before that waiter does, for
        # CLAIM_MS at most (its place then lapses, see CLAIM_MS); else a tombstone as
        # ``release``. (Longer to parse than ``release``, so not the first choice for
        # a lock nobody waits for.) PostgreSQL and SQLite return one row if released,
        # with the token of the waiter the lock was left to ('' for none); MySQL,
        # whose UPDATE returns no row, matches one row if released, and its insert id
        # is the ``next_since`` of the waiter it was left to (when that waiter began
        # waiting, by its own clock: what names it to the processes that wake it), or
        # 0 for none. Params: name, token (and channel, on PostgreSQL).
        live_next = f"(next_token <> '' AND next_seen > {now} - {lapse})"
        claimed = f"CASE WHEN next_seen < {claim_end} THEN next_seen ELSE {claim_end} END"
        if vendor == "mysql":
            # The decision is made once, in the first assignment, and read back with
            # LAST_INSERT_ID() by the others, as in ``acquire`` below (see there): it
            # holds whether MySQL applies the assignments one after another or all at
            # once (MariaDB's SIMULTANEOUS_ASSIGNMENT).
            self.release_any = (
                f"UPDATE {lock} SET "
                f"next_seen = IF(LAST_INSERT_ID(CASE WHEN {live_next} "
                f"THEN GREATEST(next_since, 1) ELSE 0 END), {claimed}, 0), "
                f"expires_at = IF(LAST_INSERT_ID(), {now}, 0), "
                f"next_since = IF(LAST_INSERT_ID(), next_since, 0), "
                f"next_token = IF(LAST_INSERT_ID(), next_token, ''), "
                f"token = '', owner = '{{}}', acquired_at = {now} "
                f"WHERE name = %s AND token = %s"
            )
        else:
            # On PostgreSQL a lapsed waiter's token stays in the tombstone (its place
            # is free to anyone: ``next_seen`` is 0), so that the statement sees it
            # and NOTIFYs: the waiters behind the dead one wake now, not at their
            # safety poll.
            kept_token = (
                "next_token"
                if vendor == "postgresql"
                else f"CASE WHEN {live_next} THEN next_token ELSE '' END"
            )
            release_any = (
                f"UPDATE {lock} SET token = '', owner = '{{}}', acquired_at = {now}, "
                f"expires_at = CASE WHEN {live_next} THEN {now} ELSE 0 END, "
                f"next_since = CASE WHEN {live_next} THEN next_since ELSE 0 END, "
                f"next_seen = CASE WHEN {live_next} THEN {claimed} ELSE 0 END, "
                f"next_token = {kept_token} "
                f"WHERE name = %s AND token = %s{no_flush}"
            )
            if vendor == "postgresql":
                self.release_any_update = release_any  # for its function (db_functions)
                # ... waking the waiters of every process: when it leaves the lock
                # to a live waiter (a claim: ``next_seen`` > 0), NOTIFY names that
                # waiter (the others wake only if its claim lapses unused, see
                # Wakeups.wake_token), and the statement returns its token; when the
                # place had lapsed, the lock is free to anyone at once: NOTIFY is the
                # plain name (one waiter of each process looks now) and the
                # statement returns '' as for no waiter.
                self.release_any = (
                    f"WITH released AS ({release_any} RETURNING name, next_token, next_seen) "
                    f"SELECT CASE WHEN next_seen > 0 THEN next_token ELSE '' END, "
                    f"CASE WHEN next_seen > 0 THEN "
                    f"pg_notify(%s, chr(30) || next_token || chr(30) || name) "
                    f"WHEN next_token <> '' THEN pg_notify(%s, name) END "
                    f"FROM released"
                )
            else:
                self.release_any = f"{release_any} RETURNING next_token"
        # A refused caller that will retry: take the place next in line if it is
        # free, lapsed, already ours, or held by a caller who started waiting later.
        # Params: token, since, name, token, token, since.
        # Never onto a released row (empty token: a tombstone, or one left to a
        # waiter): that lock is free, or soon, so the caller must look again at
        # once; queued there it would wait for a release that already happened.
        self.queue = (
            f"UPDATE {lock} SET next_token = %s, next_since = %s, next_seen = {now} "
            f"WHERE name = %s AND token <> %s AND token <> '' "
            f"AND (next_token = '' OR next_token = %s "
            f"OR next_seen <= {now} - {lapse} OR next_since > %s){no_flush}"
        )
        self.unqueue = (
            f"UPDATE {lock} SET next_token = '', next_since = 0, next_seen = 0 "
            f"WHERE name = %s AND next_token = %s{no_flush}"
        )
        # Token-less rows (released, to nobody or to a waiter whose place lapsed)
        # once their fencing token is FENCING_RETENTION_MS old.
        self.purge_placeholders = (
            f"DELETE FROM {lock} WHERE token = '' AND next_seen <= {now} - {lapse} "
            f"AND acquired_at <= {now} - {FENCING_RETENTION_MS}{no_flush}"
        )
        self.extend = f"UPDATE {lock} SET expires_at = {now} + %s WHERE name = %s AND token = %s"
        self.owns = f"SELECT 1 FROM {lock} WHERE name = %s AND token = %s AND expires_at > {now}"
        self.info_select = f"SELECT {_INFO_COLUMNS.format(now=now)}, l.name, l.token FROM {lock} l"
        self.get = f"{self.info_select} WHERE l.name = %s AND l.token <> ''"
        self.delete_owned = f"DELETE FROM {lock} WHERE name = %s AND token = %s"
        # Rows that expired STALE_RETENTION ago without a release (param: its ms).
        self.purge_stale = (
            f"DELETE FROM {lock} WHERE token <> '' AND expires_at <= {now} - %s{no_flush}"
        )

        # Who holds the row, for a refused attempt: its remaining ms, token and
        # fencing token (the holder may be this very caller, see ``acquire``), and
        # the ms until anyone but the waiter next in line may take it: the holder's
        # expiry, or after it (or after a release to that waiter) the end of that
        # waiter's place.
        place_kept = f"l.next_token <> '' AND l.next_seen > {now} - {lapse}"
        place_left = f"l.next_seen + {lapse} - {now}"
        if vendor == "postgresql":  # or CLAIM_MS after the expiry (see may_take)
            place_kept += f" AND l.expires_at > {now} - {CLAIM_MS}"
            place_left = f"LEAST(l.next_seen + {lapse}, l.expires_at + {CLAIM_MS}) - {now}"
        until_free = (
            f"CASE WHEN l.expires_at > {now} THEN l.expires_at - {now} "
            f"WHEN {place_kept} THEN {place_left} ELSE 0 END"
        )
        self.holder = (
            f"SELECT {remaining.format(t='l', now=now)}, l.token, l.fencing, {until_free} "
            f"FROM {lock} l WHERE l.name = %s"
        )
        self.queue_and_holder = None
        if vendor == "postgresql":
            # A refused caller that will retry, in one statement: queue (as above)
            # and read the holder as it was when the statement began, or nothing if
            # the row is gone (released since the refused attempt: retry at once; a
            # waiter that learnt this only from the failed queue statement would
            # sleep until its next poll). Params: the queue's, then token, since,
            # name. Returns the holder's columns (NULLs: no row), 1 if queued, else
            # 0, and whether the place was free as the statement began: free but
            # not queued means the row changed under the statement (deleted by a
            # release, or taken): retry at once.
            self.queue_and_holder = (
                f"WITH queued AS ({self.queue} RETURNING 1) "
                f"SELECT {remaining.format(t='l', now=now)}, l.token, l.fencing, {until_free}, "
                f"(SELECT count(*) FROM queued), "
                f"(l.next_token = '' OR l.next_token = %s OR l.next_seen <= {now} - {lapse} "
                f"OR l.next_since > %s) "
                f"FROM (SELECT 1) AS one LEFT JOIN {lock} l ON l.name = %s"
            )
        if vendor == "postgresql":
            # One statement: insert, or take over an expired row, with the next
            # fencing token, which it returns; a refused attempt returns no row and
            # does not wait for a flush (it locked the row, so it commits: see
            # PG_NO_FLUSH), except one that finds the row carrying its own token: an
            # earlier attempt of this acquire took it and lost its answer with the
            # connection, maybe before that commit was flushed (or confirmed by a
            # synchronous standby), and this attempt reports it won (see
            # DatabaseBackend.acquire): its own flush, which covers the earlier
            # commit, must come first. CASE, not OR: it fixes the order, so a
            # winning attempt never reaches the set_config.
            us = NOW_US[vendor]
            self.acquire = f"""
                INSERT INTO {lock} AS l (name, token, owner, acquired_at, expires_at,
                                         fencing, next_token, next_since, next_seen)
                VALUES (%s, %s, %s, {now}, {now} + %s, {us}, '', 0, 0)
                ON CONFLICT (name) DO UPDATE SET
                    token = EXCLUDED.token, owner = EXCLUDED.owner,
                    acquired_at = EXCLUDED.acquired_at, expires_at = EXCLUDED.expires_at,
                    fencing = GREATEST(l.fencing + 1, EXCLUDED.fencing),
                    next_token = '', next_since = 0, next_seen = 0
                WHERE CASE WHEN {self.may_take.format(t="l", x="EXCLUDED")} THEN TRUE
                           WHEN l.token = EXCLUDED.token THEN FALSE
                           ELSE NOT ({PG_NO_FLUSH}) END
                RETURNING l.fencing
            """
            # The same for a caller that queued: if it takes the lock, the other
            # waiters lost the race for the place next in line to it; NOTIFY them in
            # the same statement, so that one of them takes that place now, not at
            # its next poll. Params: the acquire's, then channel, name.
            self.acquire_queued = (
                f"WITH taken AS ({self.acquire}) SELECT fencing, pg_notify(%s, %s) FROM taken"
            )
        elif vendor == "sqlite":
            # One statement (an upsert is atomic: no transaction needed). The µs clock
            # is bound (see NOW_US). A refused upsert returns no row.
            self.acquire = f"""
                INSERT INTO {lock} (name, token, owner, acquired_at, expires_at, fencing,
                                    next_token, next_since, next_seen)
                VALUES (%s, %s, %s, {now}, {now} + %s, MAX(%s, {now} * 1000), '', 0, 0)
                ON CONFLICT (name) DO UPDATE SET
                    token = excluded.token, owner = excluded.owner,
                    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at,
                    fencing = MAX({lock}.fencing + 1, excluded.fencing),
                    next_token = '', next_since = 0, next_seen = 0
                WHERE {self.may_take.format(t=lock, x="excluded")}
                RETURNING fencing
            """
        else:  # MySQL / MariaDB
            # The statement's insert id says what happened, with no second statement:
            # LAST_INSERT_ID(x) makes x the insert id (the table has no
            # AUTO_INCREMENT column), the last call in the statement winning. A new
            # row: its fencing token (the µs clock, from VALUES); a row taken over: its
            # next token; a refused attempt: 0. The takeover test is made once, in the
            # first assignment, which sets that insert id; the assignments after it
            # (evaluated left to right) read the decision back with LAST_INSERT_ID(),
            # never a column, so the row is taken whole or left alone whether MySQL
            # applies the assignments one after another (the default) or all at once
            # (MariaDB's SIMULTANEOUS_ASSIGNMENT). One test instead of one per column
            # halves the statement's parse time. (The functions of the current time
            # are evaluated once per statement: {now} is one value throughout.
            # LAST_INSERT_ID() is unsigned: a refused attempt adds it as a signed 0, so
            # that a hand-written negative fencing token is refused, not an error.)
            may_take = (
                f"(expires_at <= VALUES(acquired_at) OR expires_at > {MAX_PLAUSIBLE_MS} "
                f"OR acquired_at < 0 OR acquired_at > {MAX_PLAUSIBLE_MS}) "
                "AND (next_token = '' OR next_token = VALUES(token) "
                f"OR next_seen <= VALUES(acquired_at) - {lapse})"
            )
            self.acquire = f"""
                INSERT INTO {lock} (name, token, owner, acquired_at, expires_at, fencing,
                                    next_token, next_since, next_seen)
                VALUES (%s, %s, %s, {now}, {now} + %s, LAST_INSERT_ID({NOW_US[vendor]}),
                        '', 0, 0)
                ON DUPLICATE KEY UPDATE
                    fencing = IF({may_take},
                                 LAST_INSERT_ID(GREATEST(fencing + 1, VALUES(fencing))),
                                 fencing + CAST(LAST_INSERT_ID(0) AS SIGNED)),
                    token = IF(LAST_INSERT_ID(), VALUES(token), token),
                    owner = IF(LAST_INSERT_ID(), VALUES(owner), owner),
                    acquired_at = IF(LAST_INSERT_ID(), VALUES(acquired_at), acquired_at),
                    expires_at = IF(LAST_INSERT_ID(), VALUES(expires_at), expires_at),
                    next_token = IF(LAST_INSERT_ID(), '', next_token),
                    next_since = IF(LAST_INSERT_ID(), 0, next_since),
                    next_seen = IF(LAST_INSERT_ID(), 0, next_seen)
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
