"""Database backend: a table whose unique constraint emulates Redis ``SETNX``.

One row per held (or stale) lock in ``django_setnx_lock``, unique on ``name``.
Acquire is an insert; when the name exists, the same statement takes the row over
if and only if it has expired (``INSERT ... ON CONFLICT/ON DUPLICATE KEY UPDATE``
with the expiry test inside it), so of two racers for an expired lock exactly one
wins — the race that made the original SETNX recipe need GETSET cannot happen.
Release and extend are single statements conditioned on the token.

Fencing tokens live on the lock row (``fencing``): a hybrid clock, the database's
clock in µs (``NOW_US``), or the row's previous token plus one if that is larger, set
by the same statement that takes the row. So tokens strictly increase per name while a
row exists. A release leaves the row as a token-less *tombstone* for
``FENCING_RETENTION_MS`` (60 s), so the next acquire still continues from its last
token (the clock alone is read when the acquiring statement begins, which may be
before the previous holder acquired and released; ``clearlocks`` leaves one too for a
row acquired in the last 60 s, see ``_delete_batch``). After a row is gone (its
tombstone purged, or a stale row purged) the next token starts from the clock, above
every earlier token as long as the database's clock does not step back (SQLite: the
app server's clock, see ``_sqlite_now_us``). No table grows with every name ever
locked: tombstones are purged once they are FENCING_RETENTION_MS old and stale rows
once they are ``STALE_RETENTION`` old (see ``_purge_if_due``). An acquire is one
statement on every database (MySQL/MariaDB return the new token through
``LAST_INSERT_ID(x)``).

Every statement runs on a connection of our own in autocommit, never on the
caller's (one per thread for sync callers; async callers and the renewal threads
of ``auto_renew`` locks share ``OPTIONS["ASYNC_CONNECTIONS"]`` per process, see
db_shared_connections): a lock taken inside ``transaction.atomic()`` is visible to
other processes at once, survives the caller's rollback, and a contention never
breaks the caller's transaction. Expiry is judged by the database's clock, in
integer milliseconds since the epoch.

Connections. The lock connection is opened from a copy of ``DATABASES[alias]``
with whatever would make it not ours removed: it is always in autocommit (a lock
row written in a transaction nobody commits would be invisible to everyone else,
and would block the next acquirer), never taken from Django's connection pool
(``OPTIONS["pool"]``: a per-thread connection is never handed back, so it would
drain the pool the ORM needs), and ``CONN_MAX_AGE``, ``CONN_HEALTH_CHECKS`` and
``ATOMIC_REQUESTS`` do not apply to it. It carries the timeouts of
``OPTIONS["OPERATION_TIMEOUT"]`` (see ``_timeout_options``; on PostgreSQL with
psycopg >= 3.2 every wait for an answer is also bounded client-side, see
``_bound_waits``), so no operation waits forever on a dead network, a stopped
server or a stuck row lock; one that got no answer in time is not retried, because
whether it ran is unknown. A connection that sat idle for
``OPTIONS["HEALTH_CHECK_AFTER"]`` seconds is checked (one round trip) before it is
used again and replaced if the server dropped it; a busy connection is never
checked, so the hot path pays nothing. A connection that breaks during an
operation anyway is replaced and the operation retried once, when retrying is
safe (see ``_run``). Deadlocks and lock-wait timeouts are retried a few times
with jitter (``CONTENTION_RETRIES``): under contention they are a normal outcome,
not an outage.

Fairness. A caller that was refused and will retry asks for the place *next in
line*, kept in three columns of the lock row (``next_token``, ``next_since``,
``next_seen``): it gets it if nobody has it, if its holder stopped asking for
``NEXT_LAPSE_MS`` (PG_NEXT_LAPSE_MS on PostgreSQL), or if it has been waiting longer
than its holder. While a live waiter is next in line, only that waiter may take the
lock over: a release leaves the row behind with an empty token (no lock, hidden from
``get``, ``list``, the admin and ``clearlocks``) instead of deleting it, so a client
that releases and loops straight back to acquire cannot take the lock again ahead of
the waiters. That reservation is a *claim* of CLAIM_MS: a waiter that died while
next in line holds the others up for that long, not until its place lapses. Each
waiter takes the place over from a later one at its next attempt. Mutual exclusion
never depends on this: it is only about who wins next.

Waiting (see db_wakeups). A release wakes the waiters of its own process at once. On
PostgreSQL (psycopg >= 3.2) it also sends NOTIFY when it leaves the lock to a waiter
next in line, or finds the place of one that stopped asking (it died: the waiters
behind it wake now, not at their safety poll), in the same statement; and so does a
waiter that takes the lock over from a queue (the others then compete for the place
next in line at once); each process LISTENs on one connection of its own, and its
waiters otherwise retry only at the holder's expiry or every PG_SAFETY_POLL (about
one statement a second per waiter behind a long hold). Elsewhere (MySQL/MariaDB,
SQLite, psycopg 2) the waiter next in line polls from HEAD_POLL, backing off to
HEAD_POLL_MAX, and the others back off to WAITER_MAX_BACKOFF (at most about 20
statements a second each), never past the holder's expiry, except behind a waiter
of their own process that is next in line: they wait for it (LOCAL_HEAD_POLL at
most, a safety net); and on SQLite and MySQL
the processes of one host wake each other's waiters where a PostgreSQL release
would NOTIFY (``OPTIONS["LOCAL_WAKEUPS"]``, see db_local_wakeups). Async waits await a
future or ``asyncio.sleep``: a coroutine holds a thread (and a shared connection)
only while one of its calls runs.

SQLite has a single writer. The backend switches an SQLite database to WAL mode
(``OPTIONS["SQLITE_WAL"]``, default True; the mode is stored in the database file),
so that a caller's open read transaction does not block our writes. (Django creates
the file in the rollback journal mode; the switch needs the file to itself, so it
is made at the first operation that finds nobody else reading or writing, see
_sqlite_wal. Until then a caller's read transaction blocks our writes too.) In WAL mode our
own connection commits with ``PRAGMA synchronous=NORMAL``
(``OPTIONS["SQLITE_SYNCHRONOUS"]``): no ``fsync`` per commit, which is most of what
an SQLite write costs. WAL with NORMAL never corrupts the database; a power loss or
an OS crash may undo the last commits, and since every process that uses an SQLite
file runs on its host, that crash also ended every process that held or waited for
those locks (what it can leave behind, a lock held by a dead process until its ttl,
is what a holder killed while holding leaves; see the how-to for the rest). A
database whose ``init_command`` sets ``synchronous`` keeps it; the caller's own
connections keep their setting. A lock acquired or released while the caller's own
connection holds an open *write* transaction still waits for it, and fails with
``LockBackendError`` after ``OPERATION_TIMEOUT``, with a message that says so: take
the lock before writing, or release it after the commit.
"""

import contextlib
import functools
import inspect
import logging
import math
import numbers
import os
import random
import select
import threading
import time
import weakref

from asgiref.sync import sync_to_async
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from ..exceptions import LockBackendError
from ..forksafe import ForkSafeLock, PerProcess
from ..globs import compile_glob
from ..validation import MAX_TTL_LIMIT, redacted, validate_record_name, validate_token
from .base import (
    MAX_FENCING_TOKEN,
    STALE,
    STATES,
    AcquireResult,
    BaseLockBackend,
    ClearResult,
    LockInfo,
    encode_owner,
)
from .db_functions import PostgresFunctions, connection_lost
from .db_local_wakeups import LocalListener, LocalNotifier, channel_directory
from .db_local_wakeups import encode as encode_wakeup
from .db_prepared import MariaDBStatements, PreparedSession
from .db_shared_connections import AllBusy, ConnectionState, SharedConnections
from .db_sql import CLAIM_MS, FENCING_RETENTION_MS, LOCK_TABLE, Dialect
from .db_wakeups import PostgresListener, Wakeups, channel_name, deliver
from .paging import LockPage, check_ordering, check_window, complete_ordering

logger = logging.getLogger("django_setnx")

#: Default of ``OPTIONS["STALE_RETENTION"]`` (seconds): a row that expired this long
#: ago without a release is purged (see ``_purge_if_due``), as the Redis backend's
#: records are dropped by Redis.
DEFAULT_STALE_RETENTION = 86400.0
#: The largest ``OPTIONS["STALE_RETENTION"]`` (seconds): 10 years, as the longest
#: ttl (``MAX_TTL_LIMIT``). Its milliseconds are a 64-bit statement parameter.
MAX_STALE_RETENTION = MAX_TTL_LIMIT
#: At most one purge of old stale rows per backend and this many seconds.
PURGE_EVERY = 60.0

#: How many rows list() and clear() read per round trip.
BATCH_SIZE = 500
#: Default of ``OPTIONS["ASYNC_CONNECTIONS"]``: lock connections per process (and
#: backend) shared by async callers (see db_shared_connections).
DEFAULT_ASYNC_CONNECTIONS = 4
#: How many names get_many() asks for per statement.
GET_MANY_CHUNK = 500

#: Without wake-ups (MySQL/MariaDB, SQLite, or PostgreSQL while its listener is
#: down) the waiter next in line retries after HEAD_POLL seconds, doubling up to
#: HEAD_POLL_MAX: a short critical section's release is taken up within a
#: millisecond or two, and behind a long one the waiter costs at most about
#: 1 / HEAD_POLL_MAX attempts a second (two statements each, plus a renewal of its
#: place every NEXT_RENEW: about 18 statements a second). The others back off up to
#: WAITER_MAX_BACKOFF (three statements an attempt: about 12 a second).
#: At most this many names are remembered as just left to a waiter (see release).
HANDED_OVER_KEEP = 1024
HEAD_POLL = 0.0005
#: ``PRAGMA synchronous`` values the lock connection may use on an SQLite database in
#: WAL mode (``OPTIONS["SQLITE_SYNCHRONOUS"]``; OFF could corrupt the file).
SQLITE_SYNCHRONOUS = ("NORMAL", "FULL", "EXTRA")
HEAD_POLL_MAX = 0.125
WAITER_MAX_BACKOFF = 0.25
#: Without wake-ups, a waiter behind another waiter of its own process that has the
#: place next in line does not poll: it waits for that waiter to wake it (when it
#: takes the lock or gives up), rechecking, without a statement, at most this often
#: (jittered down by up to a sixth) and when that waiter's place would lapse had it
#: stopped renewing it. The place next in line cannot be taken from a live waiter,
#: nor the lock before it, so its polls would only find what the waiter ahead finds
#: first.
LOCAL_HEAD_POLL = 2.0
#: What DatabaseBackend._wait_on returns when a wait is over.
_RETRY = object()
#: PostgreSQL with its listener up: a waiter retries when NOTIFY wakes it, at the
#: holder's expiry, or after this many seconds (jittered down by up to a sixth), a
#: safety net: about one statement a second per waiter behind a long hold.
PG_SAFETY_POLL = 3.5
#: PostgreSQL: how long after a release left the lock to a waiter of another process
#: one waiter of this process stands in for it, in case it died (see
#: Wakeups.wake_token): when its claim (CLAIM_MS) has lapsed, with a margin.
STAND_IN_AFTER = CLAIM_MS / 1000 + 0.05

#: psycopg 3's own default ``prepare_threshold``, set on a PostgreSQL lock connection
#: that prepares its statements when Django left it at None (see _connect).
PREPARE_THRESHOLD = 5

#: Default of ``OPTIONS["OPERATION_TIMEOUT"]`` (seconds): how long the lock
#: connection waits to connect, for a row or table lock, and for a silent network,
#: before the operation fails with LockBackendError.
DEFAULT_OPERATION_TIMEOUT = 5.0
#: The largest ``OPTIONS["OPERATION_TIMEOUT"]`` (seconds): a day. Every connection
#: option derived from it stays within its driver's and server's limits (see
#: ``_timeout_options``): PostgreSQL's ``tcp_user_timeout`` in ms (at most
#: 2**31 - 1), MySQL's ``connect_timeout`` and ``lock_wait_timeout`` (at most
#: 31536000 s), SQLite's busy timeout in ms (a C int). A larger value would be refused
#: by the driver at every connection, which would look like an outage.
MAX_OPERATION_TIMEOUT = 86400.0
#: The longest TCP keepalive idle time and probe interval (seconds) Linux accepts
#: (``MAX_TCP_KEEPIDLE``, ``MAX_TCP_KEEPINTVL``): PostgreSQL's keepalive options,
#: which scale with OPERATION_TIMEOUT, are capped at it (``tcp_user_timeout`` still
#: bounds a silent network by OPERATION_TIMEOUT).
MAX_TCP_KEEPALIVE = 32767

#: MySQL/MariaDB: how much longer than OPERATION_TIMEOUT (whole seconds) a read or
#: write may take, so that the server's own lock-wait error arrives first.
MYSQL_READ_MARGIN = 2
#: Default of ``OPTIONS["HEALTH_CHECK_AFTER"]`` (seconds): a lock connection idle for
#: this long is checked before it is used again. Shorter than every idle limit seen
#: in practice (MySQL ``wait_timeout``, PostgreSQL ``idle_session_timeout``, NAT and
#: load balancer idle timers: minutes), and a busy connection is never checked.
DEFAULT_HEALTH_CHECK_AFTER = 10.0

#: A deadlock or a lock-wait timeout is retried at most this many times (and never
#: once the operation has taken OPERATION_TIMEOUT), after a jittered pause of up to
#: CONTENTION_BACKOFF * 2**n seconds, capped at CONTENTION_MAX_BACKOFF.
CONTENTION_RETRIES = 8
CONTENTION_BACKOFF = 0.002
CONTENTION_MAX_BACKOFF = 0.1

#: Errors of MySQL/MariaDB that mean the statement was rolled back, most likely
#: because of a concurrent one: deadlock, lock wait timeout, MariaDB's
#: max_statement_time, which a project may set (see POSTGRESQL_CONTENTION), and a
#: statement interrupted by ``KILL QUERY`` (a DBA, pt-kill: review r127), as a
#: PostgreSQL cancel is. Retried.
MYSQL_CONTENTION = frozenset({1213, 1205, 1969, 1317})
#: ... and those that mean the connection is gone: server gone away, lost during
#: query, lost (system error), killed (MariaDB), disconnected for inactivity
#: (MySQL 8), server shutting down.
MYSQL_DISCONNECTED = frozenset({2006, 2013, 2055, 1927, 4031, 1053})
#: PostgreSQL SQLSTATEs that mean: deadlock detected, serialization failure, lock
#: not available (lock_timeout), query canceled (statement_timeout, which a project
#: may set on the database: our one-row statements only run that long while they wait
#: for a row lock; and pg_cancel_backend). Retried, within OPERATION_TIMEOUT.
POSTGRESQL_CONTENTION = frozenset({"40P01", "40001", "55P03", "57014"})
#: SQLite's primary result codes for "database is locked" and "table is locked".
SQLITE_BUSY_CODES = frozenset({5, 6})

_CONTENTION = "contention"
_DISCONNECTED = "disconnected"


class DatabaseBackend(BaseLockBackend):
    """Locks in a table of a Django database (``OPTIONS["DATABASE"]``, default ``"default"``)."""

    option_names = BaseLockBackend.option_names | frozenset(
        {
            "DATABASE",
            "SQLITE_WAL",
            "SQLITE_SYNCHRONOUS",
            "OPERATION_TIMEOUT",
            "HEALTH_CHECK_AFTER",
            "STALE_RETENTION",
            "PREPARED_STATEMENTS",
            "LOCAL_WAKEUPS",
            "ASYNC_CONNECTIONS",
        }
    )

    #: Waiters poll: the longest-waiting one must come back soon enough to claim the
    #: place next in line (see "Fairness" above) before a newer one does.
    max_backoff = WAITER_MAX_BACKOFF
    #: A release wakes the waiters of this process, and on PostgreSQL of every
    #: process (see wait and db_wakeups).
    wakes_waiters = True

    def __init__(self, alias, params):
        from django.db import connections

        super().__init__(alias, params)
        # The aliases the lock connections will be made from (see _private_wrapper):
        # DATABASES, read now (a change of it resets the backends).
        problems = _option_problems(alias, self.options, connections.settings)
        if problems:
            raise ImproperlyConfigured(" ".join(message for _, message in problems))
        # token -> _Waiter, for the refused callers of this process that will retry;
        # and name -> the one of them that last took the place next in line (see
        # _local_head_until), weakly: the entry goes with the waiter (review r130).
        self._waiting = {}
        self._heads = weakref.WeakValueDictionary()
        self._wakeups = Wakeups()  # their wake-ups, by lock name (see db_wakeups)
        self._wakeups.is_ours = self._waiting.__contains__
        # What a dropped backend leaves behind, stopped or closed when it is garbage
        # (_close_leftovers), not at interpreter exit: among them the PostgreSQL
        # LISTEN thread (``_listener``), once a waiter needed it.
        self._leftovers = _Leftovers(os.getpid())
        weakref.finalize(self, _close_leftovers, self._leftovers).atexit = False
        # SQLite, MySQL: wake-ups between the processes of this host (db_local_wakeups),
        # known at the first connection; the listener starts with the first waiter.
        self.local_wakeups = self.options.get("LOCAL_WAKEUPS", True)
        self._local_notifier = None
        self._local_listener = None
        self._local_finalizer = None
        # The names whose last release here left the lock to a waiter: the next
        # release of each goes straight to the statement that handles both cases.
        self._handed_over = set()
        # The driver's connection class and the NOTIFY channel: both known at the
        # first connection.
        self._wrapper_class = None
        self._channel = None
        self.database = self.options.get("DATABASE", "default")
        self.sqlite_wal = self.options.get("SQLITE_WAL", True)
        # None: NORMAL, unless the database's own init_command sets it (see _connect).
        synchronous = self.options.get("SQLITE_SYNCHRONOUS")
        self.sqlite_synchronous = None if synchronous is None else str(synchronous).upper()
        self.operation_timeout = float(
            self.options.get("OPERATION_TIMEOUT", DEFAULT_OPERATION_TIMEOUT)
        )
        health_check_after = self.options.get("HEALTH_CHECK_AFTER", DEFAULT_HEALTH_CHECK_AFTER)
        self.health_check_after = None if health_check_after is None else float(health_check_after)
        self.stale_retention = float(self.options.get("STALE_RETENTION", DEFAULT_STALE_RETENTION))
        # Prepared statements: decided when the first connection is made. On
        # PostgreSQL psycopg prepares them (_prepared); on MariaDB, _mariadb_prepared
        # does (see db_prepared), with what each connection prepared in
        # its ConnectionState's prepared_session.
        self._prepared = False
        self._mariadb_prepared = None
        # PostgreSQL without prepared statements: the hot statements run through the
        # functions the migrations made, where a connection finds them (db_functions).
        self._postgres_functions = None
        self._next_purge = 0.0  # monotonic time of the next purge of old stale rows
        # self._local.current: the ConnectionState of this thread's lock connection, or
        # of the shared one its async caller borrowed (see _borrowing_a_connection).
        self._local = threading.local()
        self._async_connections = self.options.get("ASYNC_CONNECTIONS", DEFAULT_ASYNC_CONNECTIONS)
        # A partial, not a lambda of self: that cycle kept a dropped backend, and every
        # connection it had opened, alive until a garbage collection.
        self._shared = PerProcess(functools.partial(SharedConnections, self._async_connections))
        # The process the connections are of: a fork hook (_forget_connections_after_fork)
        # resets them in a child, and _connection() checks too, for a fork that
        # runs no hook (uWSGI's default).
        self._pid = os.getpid()
        self._dialect = None
        # Every wrapper we opened, to close them all from close() (any thread).
        self._wrappers = weakref.WeakSet()
        self._wrappers_lock = threading.Lock()
        # Under _wrappers_lock: the wrappers a thread is running statements on (how
        # many calls deep), and those of them that close() left to that thread.
        self._in_use = {}
        self._close_when_done = set()
        _BACKENDS.add(self)

    @property
    def _wrappers(self):
        """The Django connections this backend made (a WeakSet), for close(), a fork
        and the finalizer; kept in the leftovers."""
        return self._leftovers.wrappers

    @_wrappers.setter
    def _wrappers(self, wrappers):
        self._leftovers.wrappers = wrappers

    @property
    def _listener(self):
        """The PostgreSQL LISTEN thread (a PostgresListener), or None; kept in the
        leftovers, so that the finalizer stops the one that runs."""
        return self._leftovers.listener

    @_listener.setter
    def _listener(self, listener):
        self._leftovers.listener = listener

    @classmethod
    def check_params(cls, alias, params):
        from django.conf import settings

        options = params.get("OPTIONS") or {}
        databases = getattr(settings, "DATABASES", None) or {}
        problems = _option_problems(alias, options, databases)
        errors = [checks.Error(message, id=check_id) for check_id, message in problems]
        for key in ("KEY_PREFIX", "LOCATION"):
            if params.get(key) is not None:
                # Accepted by every backend (handler.py), used only by Redis': an alias
                # moved from Redis keeps them, and KEY_PREFIX would seem to separate
                # two projects' locks in one database.
                errors.append(
                    checks.Warning(
                        f"SETNX_LOCKS[{alias!r}][{key!r}] is ignored by the database "
                        f"backend: its locks are rows of the django_setnx_lock table of "
                        f"database {options.get('DATABASE', 'default')!r}, named as given.",
                        hint=(
                            "Remove it. To keep two projects' locks apart in one database, "
                            "give each a database of its own (OPTIONS['DATABASE']), or "
                            "prefix the lock names."
                        ),
                        id="django_setnx.W022",
                    )
                )
        if any(check_id == "django_setnx.E020" for check_id, _ in problems):
            return errors  # no database to look at
        database = options.get("DATABASE", "default")
        engine = settings.DATABASES[database].get("ENGINE", "")
        if not any(
            v in engine for v in ("postgresql", "postgis", "mysql", "sqlite", "spatialite")
        ):
            errors.append(
                checks.Error(
                    f"SETNX_LOCKS[{alias!r}] uses database {database!r} with ENGINE {engine!r}; "
                    f"the database backend supports PostgreSQL, MySQL/MariaDB and SQLite.",
                    id="django_setnx.E021",
                )
            )
        if ("sqlite" in engine or "spatialite" in engine) and settings.DATABASES[database].get(
            "ATOMIC_REQUESTS"
        ):
            errors.append(
                checks.Warning(
                    f"SETNX_LOCKS[{alias!r}] keeps its locks in SQLite database {database!r}, "
                    f"which has ATOMIC_REQUESTS: SQLite has one writer, so every lock "
                    f"operation waits while any request's transaction has written (even "
                    f"acquire(blocking=False), and @locked's 409), and fails with "
                    f"LockBackendError after OPERATION_TIMEOUT.",
                    hint=(
                        "Keep the locks in an SQLite file of their own: add a DATABASES "
                        "alias (say 'locks'), set OPTIONS['DATABASE'] to it and run "
                        "`manage.py migrate django_setnx --database locks`."
                    ),
                    id="django_setnx.W021",
                )
            )
        unused = _prepared_statements_unused(engine, options)
        if unused:
            errors.append(
                checks.Warning(
                    f"SETNX_LOCKS[{alias!r}]['OPTIONS']['PREPARED_STATEMENTS'] is True, "
                    f"but database {database!r} {unused}: its statements are sent as text.",
                    hint="Remove the option, or use PostgreSQL with psycopg 3, or MariaDB.",
                    id="django_setnx.W020",
                )
            )
        return errors

    # -- connections --------------------------------------------------------------

    def _forget_connections(self):
        """In a forked child (see ``_forget_connections_after_fork``): never use the
        parent's connections again, and never close them either. Without a fork
        hook, the child's threads that use the backend first all come here: one
        does the work, and the pid changes last, so that none of them goes on with
        the parent's state meanwhile."""
        with _FORGET_GUARD:  # one lock per process: never one a parent thread held
            if self._pid == os.getpid():
                return  # another thread of this child did it
            with contextlib.suppress(Exception):
                for wrapper in list(self._wrappers):
                    raw, wrapper.connection = wrapper.connection, None
                    if raw is not None:
                        _abandon_inherited(raw)
            self._local = threading.local()
            self._shared = PerProcess(
                functools.partial(SharedConnections, self._async_connections)
            )
            self._wrappers = weakref.WeakSet()
            # Another thread of the parent may have held it at the fork: it stays held.
            self._wrappers_lock = threading.Lock()
            self._in_use = {}
            self._close_when_done = set()
            # The waiting threads were the parent's, and so is the listener.
            self._waiting = {}
            self._wakeups = Wakeups()
            self._wakeups.is_ours = self._waiting.__contains__
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.abandon(_abandon_inherited)
            listener, self._local_listener = self._local_listener, None
            if listener is not None:
                listener.abandon()  # the parent's socket: never read or removed here
            self._handed_over = set()
            # Read on every operation: an attribute of its own, set with the leftovers'.
            self._leftovers.pid = self._pid = os.getpid()

    def _state(self):
        """The :class:`ConnectionState` this thread's statements run on: its own, or
        the shared one its async caller borrowed."""
        state = getattr(self._local, "current", None)
        if state is None:
            state = self._local.current = ConnectionState()
        return state

    def _for_executor(self, func):
        """``func``, run by an async twin in an executor thread, borrows one of the
        ASYNC_CONNECTIONS connections that this process' async callers share for
        the length of the call (see db_shared_connections) instead of opening one
        for the thread."""
        return self._on_a_shared_connection(func)

    def _for_background(self, func, patience):
        """``func``, run by a lock's renewal thread: on a shared connection if one is
        free within ``patience`` seconds, else on the thread's own (see
        :meth:`_background_thread_done`). A renewal never waits long behind async
        calls stuck on something else: its lock would be lost."""
        return self._on_a_shared_connection(func, or_own_after=patience)

    def _on_a_shared_connection(self, func, or_own_after=None):
        @functools.wraps(func)
        def borrowing(*args, **kwargs):
            with self._borrowing_a_connection(or_own_after=or_own_after):
                return func(*args, **kwargs)

        return borrowing

    def _background_thread_done(self):
        """Close the calling thread's own connection, if it opened one, now rather
        than whenever the garbage collector finds it."""
        state = getattr(self._local, "current", None)
        if state is not None and not state.shared and state.wrapper is not None:
            wrapper, state.wrapper = state.wrapper, None
            with self._wrappers_lock:  # not in use: close() could be closing it too
                self._wrappers.discard(wrapper)
                self._drop(wrapper)

    @contextlib.contextmanager
    def _borrowing_a_connection(self, *, or_own_after=None):
        """Run the block on one of the shared connections, waiting for one up to
        OPERATION_TIMEOUT; with ``or_own_after`` (seconds), on this thread's own
        connection if none is free by then."""
        if self._pid != os.getpid():  # forked without a fork hook (uWSGI's default)
            self._forget_connections()
        pool = self._shared.get()
        or_own = or_own_after is not None
        try:
            state = pool.take(
                min(or_own_after, self.operation_timeout) if or_own else self.operation_timeout
            )
        except AllBusy:
            if not or_own:
                raise LockBackendError(
                    self.alias,
                    f"all {self._async_connections} lock connections of this process' "
                    f"async callers (OPTIONS['ASYNC_CONNECTIONS']) stayed busy for "
                    f"{self.operation_timeout:g} s (OPERATION_TIMEOUT)",
                ) from None
            try:
                yield
            finally:
                # The thread's own connection serves this call only: kept, it would
                # sit idle for the rest of a long ttl (an hour for a Celery task's).
                self._background_thread_done()
            return
        local = self._local
        previous = getattr(local, "current", None)
        local.current = state
        try:
            yield
        finally:
            local.current = previous
            pool.give_back(state)

    def _private_wrapper(self):
        wrapper = _private_wrapper(self.alias, self.database, self.operation_timeout)
        with self._wrappers_lock:  # registered: for close(), a fork and the finalizer
            self._wrappers.add(wrapper)
        return wrapper

    def _connection(self):
        """This thread's ``(wrapper, raw connection)``, connected, and in use until
        :meth:`_done_with` (close() from another thread leaves it to this one). A
        connection whose server hung up meanwhile (its socket is readable with no
        statement in flight, see :func:`_hung_up`: no round trip) is replaced before
        anything is sent on it, and so is one that sat idle for
        ``health_check_after`` seconds and fails a check (one round trip)."""
        if self._pid != os.getpid():  # forked without a fork hook (uWSGI's default)
            self._forget_connections()
        state = self._state()
        wrapper = state.wrapper
        if wrapper is None:
            wrapper = state.wrapper = self._private_wrapper()
            if state.shared:
                # Django refuses a wrapper in a thread other than the one that made
                # it (e.g. MySQL's server-version query) unless told it is shared.
                wrapper.inc_thread_sharing()
            else:
                # The thread's own: its state goes with the thread (threading.local),
                # and the connection then, not at a cyclic garbage collection.
                # Not at interpreter exit: daemon threads (renewals) may still be
                # running statements on theirs then (review r119).
                weakref.finalize(
                    state, _close_thread_connection, wrapper, os.getpid()
                ).atexit = False
        with self._wrappers_lock:
            self._in_use[wrapper] = self._in_use.get(wrapper, 0) + 1
        try:
            now = time.monotonic()
            if wrapper.connection is not None and (
                # Known lost before a statement is sent, the operation runs once, on
                # a new connection, and is not a retry: a retried release could not
                # tell "lost" from "done before its answer was lost" (see release).
                _hung_up(wrapper)
                or (
                    self.health_check_after is not None
                    and now - state.used_at >= self.health_check_after
                    and not _usable(wrapper)
                )
            ):
                self._drop(wrapper)
            state.used_at = now
            if wrapper.connection is None:
                self._connect(state)
            elif state.sqlite_wal_pending:
                self._sqlite_setup_again(state)
        except BaseException:
            self._done_with(wrapper)
            raise
        return wrapper, wrapper.connection

    def _done_with(self, wrapper):
        """The end of a use that :meth:`_connection` began: closes the connection if
        close() was called meanwhile."""
        with self._wrappers_lock:
            depth = self._in_use.pop(wrapper) - 1
            if depth:
                self._in_use[wrapper] = depth
            elif wrapper in self._close_when_done:
                self._close_when_done.discard(wrapper)
                self._drop(wrapper)

    def _connect(self, state):
        wrapper = state.wrapper
        try:
            wrapper.ensure_connection()
            connection_class = type(wrapper.connection)
            if wrapper.vendor == "postgresql":
                _bound_waits(wrapper.connection, self.operation_timeout)
            if self._dialect is None:
                self._wrapper_class = connection_class
                self._channel = channel_name(_database_name(wrapper), LOCK_TABLE)
                dialect = Dialect(
                    wrapper.vendor,
                    wrapper.ops.quote_name,
                    getattr(wrapper, "mysql_is_mariadb", False),
                )
                prepared = _uses_prepared_statements(wrapper, self.options)
                if self.options.get("PREPARED_STATEMENTS") is True and not prepared:
                    # The system check (W020) cannot tell MySQL from MariaDB.
                    logger.warning(
                        "Lock backend %r: PREPARED_STATEMENTS is True, but %s cannot "
                        "prepare them (only PostgreSQL with psycopg 3 and MariaDB "
                        "can): its statements are sent as text",
                        self.alias,
                        wrapper.display_name,
                    )
                if wrapper.vendor == "postgresql":
                    self._prepared = prepared
                    if not prepared:
                        self._postgres_functions = PostgresFunctions(
                            dialect, wrapper.Database.Error
                        )
                elif prepared:
                    self._mariadb_prepared = MariaDBStatements(wrapper.Database.Error)
                if self.local_wakeups:
                    self._local_notifier = _local_notifier(wrapper)
                # Last: another thread that finds the dialect set skips this block,
                # so everything it decides must be in place by then.
                self._dialect = dialect
            if wrapper.vendor == "postgresql":
                if self._prepared and wrapper.connection.prepare_threshold is None:
                    # Django opens psycopg 3 connections with prepare_threshold=None,
                    # which makes psycopg ignore execute(prepare=True): without this,
                    # PREPARED_STATEMENTS would prepare nothing. (The hot statements
                    # are prepared at once; with this threshold the others of this
                    # connection are too, after 5 runs, as psycopg does by default.)
                    wrapper.connection.prepare_threshold = PREPARE_THRESHOLD
            state.prepared_session = PreparedSession()  # a new connection: none yet
            state.functions = None  # looked for at its first acquire or release
            state.functions_checked_at = None
            cursor = wrapper.connection.cursor()
            try:
                if wrapper.vendor == "mysql":
                    # Row locks (InnoDB) and table locks (metadata, e.g. a migration
                    # altering the table) are waited for OPERATION_TIMEOUT at most.
                    wait = _whole_seconds(self.operation_timeout)
                    setup = (
                        "SET SESSION innodb_lock_wait_timeout = %s, lock_wait_timeout = %s",
                        (wait, wait),
                    )
                    cursor.execute(*setup)
                    if self._mariadb_prepared is not None:
                        # The database the statements will be prepared in names them;
                        # a session reset (found when they are gone) undoes the SET.
                        cursor.execute("SELECT DATABASE()")
                        (database,) = cursor.fetchone()
                        state.prepared_session = PreparedSession(database, setup=[setup])
                elif wrapper.vendor == "sqlite" and self.sqlite_wal:
                    state.sqlite_wal_pending = not self._sqlite_setup(wrapper, cursor)
            finally:
                cursor.close()
        except Exception as exc:  # the driver's errors, wrapped by Django or not
            self._drop(wrapper)
            raise LockBackendError(
                self.alias, f"cannot connect to database {self.database!r}: {exc}"
            ) from exc

    def _sqlite_setup(self, wrapper, cursor):
        """Put our SQLite connection in WAL mode, with its ``synchronous``. Returns
        False if the database could not switch now (see _sqlite_wal): _connection
        tries again before each operation until it does, since in the rollback
        journal mode a reader blocks the writer."""
        mode = _sqlite_wal(wrapper, cursor)
        if mode is None:
            return False
        synchronous = _sqlite_synchronous(self.sqlite_synchronous, wrapper)
        if str(mode).lower() == "wal" and synchronous is not None:
            # Our connection only (see SQLITE_SYNCHRONOUS): in WAL mode, NORMAL never
            # corrupts, and loses commits only to a crash of the host, which also
            # ends every process that held a lock.
            cursor.execute(f"PRAGMA synchronous={synchronous}")
        return True

    def _sqlite_setup_again(self, state):
        """See _sqlite_setup. Never fails the operation it precedes: a failure other
        than a busy database is logged, and the connection stays as it is."""
        wrapper = state.wrapper
        try:
            cursor = wrapper.connection.cursor()
            try:
                state.sqlite_wal_pending = not self._sqlite_setup(wrapper, cursor)
            finally:
                cursor.close()
        except Exception:
            state.sqlite_wal_pending = False
            logger.warning("Could not switch %r to WAL mode", self.database, exc_info=True)

    def _drop(self, wrapper):
        """Close the wrapper's connection; the next use reconnects. Only by the thread
        using it (see :meth:`_connection`), or under ``_wrappers_lock`` when no
        thread does: a connection must never be closed under a statement in flight,
        nor by two threads at once."""
        raw, wrapper.connection = wrapper.connection, None
        if raw is not None:
            with contextlib.suppress(Exception):  # it is being discarded because it failed
                raw.close()

    def _run(self, action, work, *, retry=True, outraced=None):
        """Run ``work(cursor, dialect, raw_connection)`` on this thread's connection
        and return its result; driver errors become LockBackendError.

        Deadlocks and lock-wait timeouts (the server rolled the statement back) are
        retried, at most CONTENTION_RETRIES times and never past OPERATION_TIMEOUT:
        under contention they are an outcome, not an outage. If the retries run out
        on a deadlock or a serialization failure (concurrent writers of the row:
        other clients of the lock, not a stuck row lock), ``outraced()`` is returned
        when given (an acquire: refused), else LockBackendError is raised.

        A connection that turns out to be gone is replaced. The operation is then run
        once more only if that is safe, because the first attempt may or may not have
        reached the server: ``retry`` is True when ``work`` is idempotent, False when
        it must not be repeated (the error is raised), or another function to run
        instead on the new connection (one that knows it is a retry). Any other
        error drops the connection and is raised.
        """
        started = time.monotonic()
        contention_retries = 0
        reconnected = False
        while True:
            wrapper, raw = self._connection()
            # In use until _done_with, errors handled included: close() from another
            # thread must not close it before this thread is done with it.
            try:
                try:
                    cursor = self._cursor(raw)
                    try:
                        return work(cursor, self._dialect, raw)
                    finally:
                        cursor.close()
                except wrapper.Database.Error as exc:
                    failure = _classify(wrapper, raw, exc)
                    if failure is not None and (
                        _timed_out(wrapper, raw, exc)
                        or (
                            failure is _DISCONNECTED
                            and time.monotonic() - started >= self.operation_timeout
                        )
                    ):
                        # No answer in time: whether the statement ran is unknown, and a
                        # retry would double the wait. The caller hears of it now.
                        failure = None
                    if failure is _CONTENTION:
                        if (
                            contention_retries < CONTENTION_RETRIES
                            and time.monotonic() - started < self.operation_timeout
                        ):
                            ceiling = min(
                                CONTENTION_MAX_BACKOFF, CONTENTION_BACKOFF * 2**contention_retries
                            )
                            time.sleep(random.uniform(0, ceiling))
                            contention_retries += 1
                            continue
                        if outraced is not None and _outraced(wrapper, exc):
                            return outraced()
                        raise LockBackendError(
                            self.alias,
                            self._contention_message(
                                action,
                                wrapper,
                                exc,
                                contention_retries,
                                time.monotonic() - started,
                            ),
                        ) from exc
                    self._drop(wrapper)
                    if failure is _DISCONNECTED and retry is not False and not reconnected:
                        reconnected = True
                        if retry is not True:
                            work = retry
                        continue
                    raise LockBackendError(
                        self.alias, f"{action} failed on database {self.database!r}: {exc}"
                    ) from exc
            finally:
                self._done_with(wrapper)

    def writes_wait_for_transaction(self, using):
        """True on SQLite when ``using`` is this backend's own database: SQLite has one
        writer, and the caller's open transaction may be it."""
        from django.db import connections

        return using == self.database and connections[using].vendor == "sqlite"

    def reads_wait_for_transaction(self, using):
        """True on SQLite without WAL (``SQLITE_WAL: False``) when ``using`` is this
        backend's own database: a transaction that wrote may keep every reader out."""
        return not self.sqlite_wal and self.writes_wait_for_transaction(using)

    def _cursor(self, raw):
        """A cursor on our raw connection: with server-side binding on PostgreSQL when
        prepared statements are on (see ``_execute``), else the connection's own."""
        if self._prepared:
            import psycopg

            return psycopg.Cursor(raw)
        return raw.cursor()

    def _execute(self, cursor, statement, params):
        """Run one of the hot statements (acquire, release, extend, ...): prepared once
        per connection when ``PREPARED_STATEMENTS`` is on (PostgreSQL through psycopg,
        MariaDB through db_prepared), else on PostgreSQL through the function that
        runs it, if any (db_functions), so the server parses (and plans) it once
        instead of on every call."""
        if self._prepared:
            cursor.execute(statement, params, prepare=True)
        elif self._mariadb_prepared is not None:
            self._mariadb_prepared.execute(
                cursor, self._state().prepared_session, statement, params
            )
        elif self._postgres_functions is not None:
            self._postgres_functions.execute(cursor, self._state(), statement, params)
        else:
            cursor.execute(statement, params)

    def _contention_message(self, action, wrapper, exc, retries, elapsed):
        what = (
            f"{action} failed on database {self.database!r}: {exc} (gave up after "
            f"{retries} retries in {elapsed:.1f} s; OPERATION_TIMEOUT is "
            f"{self.operation_timeout:g} s)"
        )
        if wrapper.vendor != "sqlite":
            return what
        from django.db import connections

        own = connections[self.database]
        if own.in_atomic_block or getattr(own.connection, "in_transaction", False):
            # With AUTOCOMMIT off, Django's transaction is open outside atomic() too,
            # and @locked cannot wait for a commit it never sees (review r152).
            after_commit = (
                "@locked releases after the commit"
                if own.in_atomic_block
                else "with AUTOCOMMIT off, commit inside the guarded call, since @locked "
                "releases when the call returns"
            )
            return (
                f"{what}. SQLite has a single writer, and this thread's own connection to "
                f"{self.database!r} is inside a transaction: once that transaction has "
                f"written (or, while the database is not in WAL mode yet, read), nobody "
                f"else (this lock included) can write until it commits. "
                f"Take the lock before the transaction writes, or release it after the "
                f"commit (transaction.on_commit); {after_commit}. Or keep the lock table "
                f"in another database (OPTIONS['DATABASE']). A database not in WAL mode "
                f"yet is switched at the first lock operation outside any transaction."
            )
        return f"{what}. Another connection kept SQLite's single write lock for longer than that."

    def close(self):
        """Close this backend's connections, from any thread: a connection running a
        statement in another thread is closed by that thread once the statement is
        done. Each is opened again at its next use."""
        if self._pid != os.getpid():  # a child forked without a fork hook (uWSGI)
            self._forget_connections()  # the parent's: never closed from here
            return
        # Under the lock a waiter starts the listeners under (_listener_ready,
        # _start_local_listener): one started meanwhile is either taken here or
        # made after, and then stopped by its finalizer or the next close().
        with self._wrappers_lock:
            listener, self._listener = self._listener, None
            local_listener, self._local_listener = self._local_listener, None
            finalizer, self._local_finalizer = self._local_finalizer, None
        if listener is not None and listener.pid == os.getpid():
            listener.close()
        if local_listener is not None and local_listener.pid == os.getpid():
            local_listener.close()
        if finalizer is not None:
            finalizer.detach()
        if self._local_notifier is not None:
            self._local_notifier.close()
        with self._wrappers_lock:
            # A connection that another thread is using (connecting it included) is
            # closed by that thread when it is done: closing a driver's connection
            # under a statement in flight breaks its protocol (PyMySQL interleaves
            # its QUIT with the reply) or worse (SQLite's frees what is in use). The
            # idle ones are closed under the lock, so that no thread takes one into
            # use meanwhile.
            self._close_when_done.update(self._in_use)
            for wrapper in list(self._wrappers):
                if wrapper not in self._in_use:
                    self._drop(wrapper)

    # -- acquire ------------------------------------------------------------------

    def acquire(self, name, token, ttl, owner, wait=0.0):
        """Returns ``AcquireResult.won(fencing)`` or ``.lost(retry_after=seconds)``.

        A refused caller that will retry (``wait`` > 0 or None) also asks for the
        place next in line (see "Fairness" in the module docstring).

        Idempotent for the caller's ``token``: an attempt that finds the (unexpired)
        row already carrying it — an earlier attempt of this acquire wrote it but its
        answer was lost with the connection — returns ``won`` with the fencing token
        that attempt was given. That is what makes retrying an acquire safe.
        """
        ttl_ms = self.check_ttl(ttl)
        # Checked here too, for callers of the backend itself (review r152: an empty
        # token wrote a row nothing could see or release; a long one was an "outage").
        validate_record_name(name)
        validate_token(token)
        owner_json = encode_owner(owner)
        attempted_at = time.monotonic()  # a wake-up after this may concern us (see wait)

        def work(cursor, sql, raw):
            if sql.vendor == "mysql":
                self._execute(cursor, sql.acquire, (name, token, owner_json, ttl_ms))
                fencing = cursor.lastrowid  # see the statement
            elif sql.vendor == "postgresql" and token in self._waiting:
                self._execute(
                    cursor,
                    sql.acquire_queued,
                    (name, token, owner_json, ttl_ms, self._channel, name),
                )
                row = cursor.fetchone()
                fencing = row and row[0]
                if fencing:  # the statement woke the other processes' waiters
                    self._waiting.pop(token, None)
                    self._wakeups.wake_one(name)
            else:
                params = (name, token, owner_json, ttl_ms)
                if sql.vendor == "sqlite":
                    params += (_sqlite_now_us(),)
                self._execute(cursor, sql.acquire, params)
                row = cursor.fetchone()
                fencing = row and row[0]
            if fencing:
                result = AcquireResult.won(fencing)
            elif wait != 0 and sql.queue_and_holder is not None:
                # Refused, will retry (PostgreSQL): queue and read the holder at once.
                waiter = self._waiter(name, token, attempted_at)
                self._execute(
                    cursor,
                    sql.queue_and_holder,
                    (*self._queue_params(name, token, waiter), token, waiter.since_ms, name),
                )
                *holder, queued, place_was_free = cursor.fetchone()
                self._queued(waiter, queued == 1)
                result = self._refused(
                    token, holder if holder[1] is not None else None, queued == 1
                )
                if not result.acquired and queued != 1 and place_was_free:
                    result = AcquireResult.lost(retry_after=0.0)  # changed under us: look again
                self._purge_if_due(cursor, sql)
                return result
            else:
                # Refused (the rare path): who holds it, and for how long.
                self._execute(cursor, sql.holder, (name,))
                holder = cursor.fetchone()
                holder_live = bool(holder and holder[0])
                result = _holder_result(token, holder)
            if result.acquired and result.fencing_token > MAX_FENCING_TOKEN:
                self._give_back_exhausted(cursor, sql, name, token, result.fencing_token)
            if result.acquired:
                # Taking the row cleared the place next in line if it was ours. The
                # other waiters, if any, lost a race for that place to us: wake them
                # so that one takes it now, not at its next poll.
                if self._waiting.pop(token, None) is not None:
                    self._notify(cursor, sql, name)
            elif wait != 0:
                head = self._queue(cursor, sql, name, token, attempted_at)
                if head and not holder_live:
                    result = AcquireResult.lost(retry_after=0.0)  # see _refused
            self._purge_if_due(cursor, sql)
            return result

        # Other clients' writes of the row kept rolling ours back (a server whose
        # default isolation is SERIALIZABLE, say): nothing was written, which is a
        # refusal; a caller that waits tries again, as after any refusal.
        return self._run("acquire", work, outraced=lambda: AcquireResult.lost(retry_after=0.0))

    def _give_back_exhausted(self, cursor, sql, name, token, fencing):
        """A row just taken with a fencing token past 2**53 - 1 (the row's last one
        was written by hand, or by a server clock set centuries ahead): no caller may
        get it (review r158). Released again, keeping that token (a tombstone): a
        token issued before, below it, must stay below every later one; then
        LockBackendError says how to get out."""
        self._release_any(cursor, sql, name, token)
        raise LockBackendError(
            self.alias,
            f"fencing tokens of {name!r} are exhausted: the next one would be {fencing}, "
            f"and a token must stay below 2**53 (a token written by hand, or a database "
            f"clock set centuries ahead). Delete its row once nothing relies on its "
            f"tokens.",
        )

    def _purge_if_due(self, cursor, sql):
        """Delete the rows that expired ``STALE_RETENTION`` ago without a release, at
        most once per PURGE_EVERY seconds per backend: the database's state stays
        bounded (held locks, and stale ones until they are that old) without a cron
        job. One extra statement, rarely; a failure is only logged (the next purge
        catches up)."""
        now = time.monotonic()
        if now < self._next_purge:
            return
        self._next_purge = now + min(PURGE_EVERY, self.stale_retention)
        try:
            cursor.execute(sql.purge_stale, (int(self.stale_retention * 1000),))
            cursor.execute(sql.purge_placeholders)  # tombstones past FENCING_RETENTION_MS
        except Exception:
            logger.warning("Could not purge stale locks of %r", self.alias, exc_info=True)

    def _queue(self, cursor, sql, name, token, attempted_at):
        """Ask for (or renew) the place next in line; remember whether we have it.
        Returns True if the statement gave (or renewed) it."""
        waiter = self._waiter(name, token, attempted_at)
        if waiter.head and not waiter.woken and time.monotonic() - waiter.renewed < sql.next_renew:
            # Ours, and renewed recently enough not to lapse. (Not after a wake-up:
            # one that did not bring the lock says the place next in line changed
            # hands, maybe away from us, or is free: ask, so that it is taken now.)
            return False
        self._execute(cursor, sql.queue, self._queue_params(name, token, waiter))
        return self._queued(waiter, cursor.rowcount == 1)

    def _waiter(self, name, token, attempted_at):
        waiter = self._waiting.get(token)
        if waiter is None:
            waiter = self._waiting[token] = _Waiter(name, token)
        waiter.attempted_at = attempted_at
        return waiter

    @staticmethod
    def _queue_params(name, token, waiter):
        return (token, waiter.since_ms, name, token, token, waiter.since_ms)

    def _queued(self, waiter, head):
        if head and not waiter.head:
            waiter.polls = 0
            self._heads[waiter.name] = waiter
        waiter.head = head
        waiter.renewed = time.monotonic()
        return head

    def _local_head_until(self, waiter, lapse_ms):
        """If another waiter of this process, which began waiting before ``waiter``,
        has the place next in line for its lock (by its last queue statement, renewed
        less than ``lapse_ms`` ago), the monotonic time its place lapses unless it
        renews it; else None. While it waits, it renews that place, which no later
        waiter may take, and it takes the lock before anyone else may: ``waiter``
        need not poll before then (see LOCAL_HEAD_POLL). One that stopped renewing
        (its event loop blocked, say: review r130) is not waited for past that."""
        head = self._heads.get(waiter.name)
        if head is None or head is waiter or not head.head:
            return None
        if self._waiting.get(head.token) is not head:
            return None  # it left (the entry goes with it: a weak reference)
        if head.since_ms > waiter.since_ms:
            return None  # this one began waiting first: it takes the place over
        lapses_at = head.renewed + lapse_ms / 1000
        return lapses_at if lapses_at > time.monotonic() else None

    def _refused(self, token, holder, head):
        """The result of a refused attempt that queued (``head``: it is next in
        line), from the holder as :func:`_holder_result` reads it."""
        result = _holder_result(token, holder)
        if result.acquired:  # an earlier attempt of ours took it (see acquire)
            self._waiting.pop(token, None)
        elif holder is None or (head and not holder[0]):
            # Gone since the refused attempt, or next in line for a lock nobody
            # holds (released to a waiter whose place we just took, or expired):
            # ours at the next attempt.
            result = AcquireResult.lost(retry_after=0.0)
        return result

    def stop_waiting(self, name, token):
        """Give up the place next in line, if this caller had asked for it. Returns
        None: a database lock is never handed to a caller that is not retrying."""
        waiter = self._waiting.pop(token, None)
        if waiter is None:
            return None

        def work(cursor, sql, raw):
            self._execute(cursor, sql.unqueue, (name, token))
            if cursor.rowcount:
                # The place next in line is free (a row released to us is a tombstone
                # now, free to take): the other waiters (who may wait for a wake-up,
                # not a poll) compete for it now.
                self._notify(cursor, sql, name)
            else:
                # This process' other waiters may wait for this one (see
                # _local_head_until), or it was woken to take its turn and leaves
                # instead (cancelled, timed out): one of them takes it (review r130).
                self._wakeups.wake_one(name)

        self._run("stop waiting", work)
        return None

    def retry_delay(self, token, attempt, max_wait, retry_after):
        """Briefly (HEAD_POLL, doubling to HEAD_POLL_MAX) for the caller next in
        line; the usual capped, jittered backoff for the others. Never past the
        holder's expiry (``retry_after``)."""
        waiter = self._waiting.get(token)
        if waiter is None or not waiter.head:
            return self.backoff(attempt, max_wait, retry_after)
        delay = min(HEAD_POLL * (2 ** min(waiter.polls, 8)), HEAD_POLL_MAX)
        waiter.polls += 1
        if retry_after is not None:
            delay = min(delay, max(retry_after, 0) + 0.001)
        return max(delay if max_wait is None else min(delay, max_wait), 0)

    # -- waiting ------------------------------------------------------------------

    def wait(self, name, *, token, attempt, max_wait, retry_after):
        """Block until a wake-up for ``name`` (a release in this process; on
        PostgreSQL, a NOTIFY from any process: see db_wakeups), the next poll
        (:meth:`retry_delay`, or PG_SAFETY_POLL while the PostgreSQL listener is
        up), the holder's expiry or ``max_wait``. Returns None: the caller retries."""
        deadline = None if max_wait is None else time.monotonic() + max_wait
        while True:
            ready = self._listener_ready()
            since, delay = self._wait_plan(token, attempt, max_wait, retry_after, ready)
            if delay <= 0:
                return None
            self._listen_locally()
            woken = self._wakeups.wait(name, delay, since, self._rank(token), token)
            max_wait = self._wait_on(token, woken, deadline, ready)
            if max_wait is _RETRY:
                return None

    async def await_release(self, name, *, token, attempt, max_wait, retry_after):
        """Async twin of :meth:`wait`: the wait is an awaited future, no thread is
        held (starting the PostgreSQL listener, once per process, takes one)."""
        ready = self._listener_ready(start=False)
        if ready is None and self._listens():
            ready = await sync_to_async(self._listener_ready, thread_sensitive=False)()
        deadline = None if max_wait is None else time.monotonic() + max_wait
        while True:
            since, delay = self._wait_plan(token, attempt, max_wait, retry_after, ready)
            if delay <= 0:
                return None
            self._listen_locally()  # a bind and a thread start, once per process
            woken = await self._wakeups.await_wakeup(name, delay, since, self._rank(token), token)
            max_wait = self._wait_on(token, woken, deadline, ready)
            if max_wait is _RETRY:
                return None

    def _wait_on(self, token, woken, deadline, listener_ready_at):
        """After a wait that ended (``woken``: by a wake-up): the seconds left to wait
        on (None: no limit) if the caller was not woken and is still behind a live
        waiter of this process next in line (an attempt now would only be refused:
        review r130), else _RETRY (its wait is over: it retries). Not with the
        PostgreSQL listener up (``listener_ready_at``, see _wait_plan): its waiters'
        waits are safety polls, which must find a lock that head left free (its place
        outlives it by PG_NEXT_LAPSE_MS, 8 s: review r131)."""
        self._woken(token, woken)
        waiter = self._waiting.get(token)
        if (
            woken
            or waiter is None
            or waiter.head
            or self._dialect is None
            or listener_ready_at is not None
        ):
            return _RETRY
        if self._local_head_until(waiter, self._dialect.next_lapse_ms) is None:
            return _RETRY
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        return left if left > 0 else _RETRY

    def _woken(self, token, woken):
        """Note whether the wait of the caller with ``token`` ended by a wake-up."""
        waiter = self._waiting.get(token)
        if waiter is not None:
            waiter.woken = woken

    def _rank(self, token):
        """The order in which a release wakes this process' waiters (see
        Wakeups.wake_one): the one next in line first, then the longest waiting."""
        waiter = self._waiting.get(token)
        if waiter is None:
            return (2, 0)
        return (0 if waiter.head else 1, waiter.since_ms)

    def _wait_plan(self, token, attempt, max_wait, retry_after, listener_ready_at):
        """``(since, seconds)``: a wake-up after ``since`` (when the caller's refused
        attempt started) ends the wait, which lasts at most ``seconds``."""
        waiter = self._waiting.get(token)
        since = waiter.attempted_at if waiter is not None else time.monotonic()
        if listener_ready_at is None:
            head_until = None
            if waiter is not None and not waiter.head:
                head_until = self._local_head_until(waiter, self._dialect.next_lapse_ms)
            if head_until is not None:
                # Polling would only find what that waiter finds first; it wakes this
                # process' others when it takes the lock or leaves the line (review
                # r127: 300 coroutines on MariaDB sent 215 statements an acquisition,
                # and every async lock call of the process waited behind them).
                delay = min(
                    LOCAL_HEAD_POLL * random.uniform(5 / 6, 1.0),
                    head_until - time.monotonic() + HEAD_POLL_MAX,
                )
                return since, max(delay if max_wait is None else min(delay, max_wait), 0.0)
            return since, self.retry_delay(token, attempt, max_wait, retry_after)
        if listener_ready_at > since:
            # The LISTEN began after that attempt: a NOTIFY in between was missed.
            return since, 0.0
        delay = PG_SAFETY_POLL * random.uniform(5 / 6, 1.0)
        if retry_after is not None:
            delay = min(delay, max(retry_after, 0) + 0.001)
        if max_wait is not None:
            delay = min(delay, max_wait)
        return since, max(delay, 0.0)

    def _listener_ready(self, start=True):
        """The monotonic time since which this process LISTENs for this backend's
        NOTIFY (PostgreSQL with psycopg >= 3.2), else None: the waiters poll. With
        ``start=False``, returns None without starting a listener that is not up."""
        listener = self._listener
        if listener is None or listener.pid != os.getpid():
            if not start or not self._listens():
                return None
            with self._wrappers_lock:
                if self._listener is None or self._listener.pid != os.getpid():
                    # Its thread must not keep this backend alive (a waiter may start
                    # one on a backend that a reset dropped): a connect of its own,
                    # and stopped when the backend is garbage (_close_leftovers).
                    self._listener = PostgresListener(
                        self.alias,
                        self._channel,
                        self._wakeups,
                        functools.partial(
                            _listen_connection, self.alias, self.database, self.operation_timeout
                        ),
                        stand_in_after=STAND_IN_AFTER,
                    )
                listener = self._listener
        if start and listener.ready_at is None:
            listener.ensure_running(self.operation_timeout)
        return listener.ready_at

    def _listens(self):
        """Whether this backend's waiters are woken by NOTIFY (PostgreSQL, psycopg >=
        3.2): known once a connection was made."""
        return (
            self._dialect is not None
            and self._dialect.vendor == "postgresql"
            and _can_listen(self._wrapper_class)
        )

    def _notify(self, cursor, sql, name):
        """Wake the waiters of ``name``: this process' at once, and on PostgreSQL every
        process' (NOTIFY, delivered when the statement's transaction commits: at
        once, in autocommit); elsewhere those of this host's other processes
        (db_local_wakeups)."""
        if sql.vendor == "postgresql":
            cursor.execute("SELECT pg_notify(%s, %s)", (self._channel, name))
        else:
            self._wake_locally(name)
        self._wakeups.wake_one(name)

    def _listen_locally(self):
        """Start this process' listener for wake-ups from the other processes of this
        host (SQLite, MySQL; see db_local_wakeups), unless it runs. Never raises:
        without it the waiters poll."""
        try:
            self._start_local_listener()
        except Exception:  # an optimisation must never fail a lock
            logger.debug("Could not listen for lock wake-ups", exc_info=True)

    def _start_local_listener(self):
        notifier = self._local_notifier
        if notifier is None:
            return
        listener = self._local_listener
        if listener is None or listener.pid != os.getpid():
            with self._wrappers_lock:
                listener = self._local_listener
                if listener is None or listener.pid != os.getpid():
                    if listener is not None:  # a fork that ran no hook (uWSGI)
                        listener.abandon()
                    wakeups = self._wakeups
                    # A release leaves a lock to one waiter; our waiters poll anyway,
                    # so none stands in for another process' (see Wakeups.wake_token).
                    listener = self._local_listener = LocalListener(
                        self.alias,
                        notifier.directory,
                        lambda payload: deliver(wakeups, payload, stand_in=False),
                        notifier,
                    )
                    # Stopped with this backend if it is dropped unclosed (a
                    # settings change that makes a new one closes the old), and at
                    # interpreter exit (finalize's atexit); one finalizer at a time
                    # (close() detaches it).
                    if self._local_finalizer is not None:
                        self._local_finalizer.detach()
                    self._local_finalizer = weakref.finalize(self, listener.close)
                    # Once per process: the sockets of processes that ended
                    # without removing theirs (SIGKILL, os._exit) go.
                    notifier.prune()
        listener.ensure_running()

    def _wake_locally(self, name, token=None, head=False, since=None):
        """Wake the waiter of ``name`` that ``token`` names (else, with ``head``, the
        one next in line: the one that began waiting at ``since``, if given; else one
        waiter per process) in the other processes of this host (SQLite, MySQL)."""
        notifier = self._local_notifier
        if notifier is not None:
            listener = self._local_listener
            # A plain name asks the waiters to compete for the place next in line:
            # one process is enough (each woken one sends statements), and over the
            # handoffs each gets its turn.
            notifier.send(
                encode_wakeup(name, token, head, since),
                own=listener and listener.path,
                one=token is None and not head,
            )

    # -- token-checked single statements -------------------------------------------

    def release(self, name, token):
        """Returns True if the row carried ``token`` and was released: left as a
        tombstone (see FENCING_RETENTION_MS), or, with a waiter next in line, left to
        that waiter."""
        if not token:
            return False

        def work(cursor, sql, raw, retried=False):
            if name in self._handed_over:
                # A waiter took over at the last release here: likely another is next
                # in line now. One statement for either case, not two.
                if self._release_any(cursor, sql, name, token):
                    return True
            else:
                self._execute(cursor, sql.release, (name, token))
                if cursor.rowcount == 1:
                    if self._waiting:  # this process has waiters (maybe on their way)
                        self._wakeups.wake_one(name)
                    return True
                # Not ours, or a waiter is (or was, on PostgreSQL) next in line.
                if self._release_any(cursor, sql, name, token):
                    return True
            # Nothing of ours is left. On a retry that is no proof the lock was lost:
            # the first attempt may have deleted the row and lost only its answer
            # with the connection. Reporting "lost" then would tell a caller whose
            # release worked that its lock was taken over; and either way the lock is
            # no longer ours, which is all a release promises. So a retry cannot
            # report a lock lost before it either (review r152): no row says who
            # freed it (acquired_at is when the next holder's statement arrived,
            # which may precede our release: review r154).
            return retried

        return self._run("release", work, retry=functools.partial(work, retried=True))

    def _release_any(self, cursor, sql, name, token):
        """Release with ``release_any`` (see release). Returns True if released."""
        params = (name, token)
        if sql.vendor == "postgresql":
            params += (self._channel, self._channel)
        self._execute(cursor, sql.release_any, params)
        since = None
        if sql.vendor == "mysql":  # no RETURNING: the insert id says (see the statement)
            if cursor.rowcount != 1:
                return False
            since = cursor.lastrowid
            left_to = None if since else ""
        else:
            row = cursor.fetchone()
            if row is None:
                return False
            left_to = row[0]
        if left_to != "":  # a waiter's token, or None: its since (MySQL)
            self._left_to(name, left_to, since)
        else:
            self._handed_over.discard(name)
            if self._waiting:
                self._wakeups.wake_one(name)
        return True

    def _left_to(self, name, waiter, since=None):
        """A release left ``name`` to the waiter next in line (``waiter``: its token;
        else, on MySQL, ``since``: when it began waiting, see ``release_any``): wake
        it wherever it waits on this host, and remember the name (see release)."""
        if len(self._handed_over) >= HANDED_OVER_KEEP:
            self._handed_over.clear()  # many contended names: start over, not grow
        self._handed_over.add(name)
        if self._dialect.vendor != "postgresql":  # there the statement sent NOTIFY
            self._wake_locally(name, waiter, head=True, since=since)
        if waiter is None:
            self._wakeups.wake_head(name, since)  # that waiter, if ours
        else:
            self._wakeups.wake_token(name, waiter)

    def extend(self, name, token, ttl):
        """Returns True if the row still carried ``token`` (its expiry is now the
        database's now + ``ttl``). Retried after a lost connection: running it twice
        sets the same kind of expiry, and a lost lock is refused both times."""
        ttl_ms = self.check_ttl(ttl)
        if not token:  # a released row carries the empty token: it is nobody's
            return False

        def work(cursor, sql, raw):
            self._execute(cursor, sql.extend, (ttl_ms, name, token))
            return cursor.rowcount == 1

        return self._run("extend", work)

    def owns(self, name, token):
        if not token:
            return False

        def work(cursor, sql, raw):
            self._execute(cursor, sql.owns, (name, token))
            return cursor.fetchone() is not None

        return self._run("owns", work)

    # -- reading ------------------------------------------------------------------

    def _info(self, row):
        """The LockInfo of a row ``(name, owner, acquired_at, expires_at, fencing,
        now_ms, ...)``, tolerant of rows this backend never wrote."""
        name, owner, acquired, expires, fencing, now = row[:6]
        return LockInfo.from_record(
            name,
            self.alias,
            now,
            owner=owner,
            acquired=acquired,
            expires=expires,
            fencing=fencing,
            raw={
                "owner": owner,
                "acquired_at": acquired,
                "expires_at": expires,
                "fencing": fencing,
            },
        )

    def get(self, name):
        def work(cursor, sql, raw):
            self._execute(cursor, sql.get, (name,))
            row = cursor.fetchone()
            return None if row is None else self._info(row)

        return self._run("get", work)

    def get_many(self, names):
        """``{name: LockInfo or None}`` with one ``SELECT ... IN`` per GET_MANY_CHUNK
        names (see BaseLockBackend.get_many)."""
        names = list(dict.fromkeys(names))

        def work(cursor, sql, raw):
            found = {}
            for start in range(0, len(names), GET_MANY_CHUNK):
                chunk = names[start : start + GET_MANY_CHUNK]
                # Not _execute: a statement per chunk length is not worth preparing.
                cursor.execute(
                    f"{sql.info_select} WHERE l.name IN ({sql.placeholders(len(chunk))}) "
                    f"AND l.token <> ''",
                    chunk,
                )
                for row in cursor.fetchall():
                    found[row[0]] = self._info(row)
            return found

        found = self._run("get", work) if names else {}
        return {name: found.get(name) for name in names}

    @staticmethod
    def _where(sql, state, glob):
        """``(where, params)`` of the lock rows in ``state`` (None: any) whose name
        may match ``glob`` (a compiled Glob, or None): it narrows them to the names
        that start with its literal prefix (or to its one name), tested with SUBSTR
        and ``=``: exact on every database, where LIKE alone would be
        case-insensitive on SQLite. The caller still matches each name against the
        glob."""
        where, params = "l.token <> ''", []
        if state is not None:
            where += f" AND {'' if state == STALE else 'NOT '}{sql.stale.format(t='l')}"
        if glob is not None and glob.is_literal:
            where += f" AND l.name = {sql.placeholder}"
            params.append(glob.literal_prefix)
        elif glob is not None and glob.literal_prefix:
            prefix = glob.literal_prefix
            # LIKE only narrows (an index can serve it: Django's ``_like`` index on
            # PostgreSQL, the binary column on MySQL); SUBSTR decides, exactly.
            like = "".join("!" + ch if ch in "!%_" else ch for ch in prefix) + "%"
            where += (
                f" AND l.name LIKE {sql.placeholder} ESCAPE '!'"
                f" AND SUBSTR(l.name, 1, {len(prefix)}) = {sql.placeholder}"
            )
            params += [like, prefix]
        return where, params

    def _scan(self, *, state=None, glob=None, after=""):
        """Yield raw rows in name order, BATCH_SIZE per query (keyset pagination),
        of the rows ``_where(state, glob)`` selects."""
        while True:

            def work(cursor, sql, raw, after=after):
                where, params = self._where(sql, state, glob)
                cursor.execute(
                    f"{sql.info_select} WHERE l.name > {sql.placeholder} AND "
                    f"{where} ORDER BY l.name LIMIT {BATCH_SIZE}",
                    [after, *params],
                )
                return cursor.fetchall()

            rows = self._run("list", work)
            yield from rows
            if len(rows) < BATCH_SIZE:
                return
            after = rows[-1][0]

    def list(self, *, state=None, name_glob=None):
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        glob = compile_glob(name_glob) if name_glob else None
        infos = (self._info(row) for row in self._scan(state=state, glob=glob))
        return self.filter_infos(infos, state=state, name_glob=glob and glob.pattern)

    # -- removing -----------------------------------------------------------------

    def page(self, *, state=None, name_glob=None, ordering=(), offset=0, limit=100):
        """Sorted in SQL, counted with ``COUNT``, sliced with ``LIMIT/OFFSET``: never
        partial. The default order follows the name's index (on PostgreSQL, the
        database's collation); a page sorted by columns sorts names in code point
        order, as every backend does (``COLLATE "C"`` on PostgreSQL; the column's
        collation is binary on SQLite and MySQL/MariaDB). With a glob, the rows with
        its literal prefix are read in order and matched here."""
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        order = check_ordering(ordering)
        offset, limit = check_window(offset, limit)
        glob = compile_glob(name_glob) if name_glob else None

        def work(cursor, sql, raw):
            where, params = self._where(sql, state, glob)
            select = f"{sql.info_select} WHERE {where} ORDER BY {self._order_by(sql, order)}"
            if glob is None or glob.is_literal:
                cursor.execute(f"SELECT COUNT(*) FROM {sql.lock_table} l WHERE {where}", params)
                total = cursor.fetchone()[0]
                rows = []
                if limit and offset < total:
                    cursor.execute(f"{select} LIMIT {limit} OFFSET {offset}", params)
                    rows = cursor.fetchall()
                return rows, total
            cursor.execute(select, params)
            rows, total = [], 0
            while chunk := cursor.fetchmany(BATCH_SIZE):
                for row in chunk:
                    if glob.match(row[0]):
                        if offset <= total < offset + limit:
                            rows.append(row)
                        total += 1
            return rows, total

        rows, total = self._run("list", work)
        return LockPage([self._info(row) for row in rows], total, total)

    @staticmethod
    def _order_by(sql, ordering):
        """ORDER BY of ``complete_ordering(ordering)``, as paging.sort_key() sorts (the
        backend is the same for every row: left out)."""
        if not ordering:
            # The default order: by name in the database's own order, as the primary
            # key's index has it (COLLATE "C" would sort every matching row first).
            return "l.name ASC"
        name = 'l.name COLLATE "C"' if sql.vendor == "postgresql" else "l.name"
        columns = {
            "name": name,
            "state": f"CASE WHEN {sql.stale.format(t='l')} THEN 1 ELSE 0 END",
            "fencing_token": "l.fencing",
            "acquired_at": "l.acquired_at",
            "expires_at": "l.expires_at",
        }
        return ", ".join(
            f"{columns[field]} {'DESC' if descending else 'ASC'}"
            for field, descending in complete_ordering(ordering)
            if field != "backend"
        )

    def delete(self, name, fencing_token=None):
        """Force-release ``name`` (with ``fencing_token``: only if its row still
        carries it), as its holder's release would: a waiter next in line gets it."""

        def read(cursor, sql, raw):
            cursor.execute(sql.get, (name,))
            return cursor.fetchone()

        for _ in range(5):
            row = self._run("delete", read)
            if row is None:
                return None
            info = self._info(row)
            if fencing_token is not None and info.fencing_token != fencing_token:
                return None
            # Deletes only the row read (its owner token is never reused): False when
            # it changed hands in between; then look again.
            if self.release(name, row[7]):
                return info
        raise LockBackendError(
            self.alias, f"could not delete lock {name!r}: it keeps changing hands"
        )

    def clear(
        self, *, include_held=False, name_glob=None, older_than=None, dry_run=False, progress=None
    ):
        result = ClearResult(self.alias)
        glob = compile_glob(name_glob) if name_glob else None
        batch = []  # names

        def flush():
            removed = (
                list(batch)
                if dry_run
                else self._delete_batch(list(batch), include_held, older_than)
            )
            batch.clear()
            if removed:
                result.names.extend(removed)
                if progress is not None:
                    progress(removed)

        if not dry_run:
            self._run("clear", lambda cursor, sql, raw: cursor.execute(sql.purge_placeholders))
        for row in self._scan(state=None if include_held else STALE, glob=glob):
            info = self._info(row)
            if glob is not None and not glob.match(info.name):
                continue
            if older_than is not None and info.now_ms - info.acquired_at_ms < older_than * 1000:
                continue
            batch.append(info.name)
            if len(batch) >= BATCH_SIZE:
                flush()
        if batch:
            flush()
        return result

    def _delete_batch(self, names, include_held, older_than):
        """Remove the given rows, re-checking in the statements themselves that each
        is still stale (and old enough), so a lock re-acquired meanwhile is never
        removed. Returns the names actually removed. One transaction; not retried
        after a lost connection: a repeat could not tell whether the first attempt
        committed.

        A row acquired less than FENCING_RETENTION_MS ago is left as a tombstone,
        as a release leaves it, not deleted: an acquiring statement that read the
        clock before that holder acquired may still be on its way, and must get a
        larger token than the holder's (a deleted row would give it the clock's).
        Older rows are deleted, and so is a row whose token is past what a lock may
        be given (written by hand): kept, it would refuse every acquire."""

        def where(sql, names):
            condition = f"name IN ({sql.placeholders(len(names))}) AND token <> ''"
            params = list(names)
            if not include_held:
                condition += f" AND {sql.stale.format(t=sql.lock_table)}"
            if older_than is not None:
                condition += f" AND acquired_at <= {sql.now} - {sql.placeholder}"
                params.append(int(older_than * 1000))
            return condition, params

        def work(cursor, sql, raw):
            # Complements: each row is tombstoned or deleted, never both, so the
            # DELETE cannot remove a lock taken in between (review r162; the
            # transaction's row locks also keep it out).
            keep = (
                f"acquired_at > {sql.now} - {FENCING_RETENTION_MS} "
                f"AND fencing <= {MAX_FENCING_TOKEN}"
            )

            def tombstone_then_delete(condition, params, returning=""):
                cursor.execute(
                    f"UPDATE {sql.lock_table} SET {sql.tombstone} "
                    f"WHERE {condition} AND {keep}{returning}",
                    params,
                )
                tombstoned = [r[0] for r in cursor.fetchall()] if returning else []
                cursor.execute(
                    f"DELETE FROM {sql.lock_table} WHERE {condition} AND NOT ({keep}){returning}",
                    params,
                )
                return tombstoned + ([r[0] for r in cursor.fetchall()] if returning else [])

            cursor.execute(sql.begin())
            try:
                if sql.vendor == "mysql":
                    # No UPDATE ... RETURNING: lock the rows, then change only those
                    # (under READ COMMITTED a row inserted after this SELECT would
                    # match the statements below without being reported).
                    condition, params = where(sql, names)
                    cursor.execute(
                        f"SELECT name FROM {sql.lock_table} WHERE {condition} FOR UPDATE",
                        params,
                    )
                    removed = [r[0] for r in cursor.fetchall()]
                    if removed:
                        tombstone_then_delete(*where(sql, removed))
                else:  # PostgreSQL, SQLite
                    removed = tombstone_then_delete(*where(sql, names), " RETURNING name")
                cursor.execute("COMMIT")
            except BaseException:
                # The first error is the one to report: on a connection that a
                # timeout closed, the ROLLBACK fails too (review r163), and the
                # server rolls back a transaction whose connection is gone.
                with contextlib.suppress(Exception):
                    cursor.execute("ROLLBACK")
                raise
            return removed

        return self._run("clear", work, retry=False)


class _Waiter:
    """A refused caller of this process that will retry."""

    __slots__ = (
        "name",
        "token",
        "since_ms",
        "head",
        "renewed",
        "polls",
        "attempted_at",
        "woken",
        "__weakref__",
    )

    def __init__(self, name, token):
        self.name = name
        self.token = token
        # When it started waiting, by this app server's clock: only compared with
        # other waiters' to find the longest-waiting one (fairness, never safety).
        self.since_ms = int(time.time() * 1000)
        self.head = False  # it has the place next in line
        self.renewed = 0.0  # monotonic time of its last queue statement
        self.polls = 0  # retries since it became next in line
        self.attempted_at = time.monotonic()  # when its last refused attempt began
        self.woken = False  # its last wait ended by a wake-up, not a timeout


def _can_listen(connection_class):
    """Whether connections of ``connection_class`` can wait for notifications with a
    timeout: psycopg >= 3.2. With psycopg 2 (or an older psycopg 3) the waiters
    poll, at the same bounded rate as on the other databases."""
    notifies = getattr(connection_class, "notifies", None)
    return callable(notifies) and "timeout" in inspect.signature(notifies).parameters


def _remaining(ms):
    return None if ms is None else max(int(ms), 0) / 1000


def _holder_result(token, holder):
    """The result of an attempt that did not take the row, from its holder
    ``(remaining_ms, token, fencing, until_free_ms)`` (None: no row seen). ``won``
    with the recorded fencing token if the unexpired row already carries ``token``
    (an earlier attempt of this acquire took it), else ``lost``, to retry after
    ``until_free_ms``."""
    if holder is None:
        return AcquireResult.lost()
    remaining_ms, holder_token, fencing, until_free_ms = holder
    if holder_token == token and remaining_ms and fencing is not None:
        return AcquireResult.won(fencing)
    return AcquireResult.lost(retry_after=_remaining(until_free_ms))


# -- options --------------------------------------------------------------------------


def _option_problems(alias, options, databases):
    """``(check id, message)`` for each invalid value among the ``options``: the
    ``DATABASE`` (E020: see _database_problem; ``databases``: the configured
    aliases), ``OPERATION_TIMEOUT``, ``HEALTH_CHECK_AFTER``, ``STALE_RETENTION``,
    ``SQLITE_SYNCHRONOUS``, ``LOCAL_WAKEUPS``, ``SQLITE_WAL``, ``ASYNC_CONNECTIONS``
    and ``PREPARED_STATEMENTS`` (E022). The system check reports them, and the
    backend raises ImproperlyConfigured with the same messages at its first use."""
    database = _database_problem(alias, options.get("DATABASE", "default"), databases)
    return ([("django_setnx.E020", database)] if database else []) + [
        ("django_setnx.E022", problem) for problem in _value_problems(alias, options)
    ]


def _database_problem(alias, database, databases):
    """The message for an ``OPTIONS["DATABASE"]`` that is not the name of one of
    ``databases`` (the aliases of DATABASES), or None."""
    if isinstance(database, str) and _configured(databases.get(database)):
        return None
    where = f"SETNX_LOCKS[{alias!r}]['OPTIONS']['DATABASE']"
    configured = ", ".join(repr(a) for a in databases if _configured(databases[a])) or "none"
    # redacted: a settings dict or a database URL pasted here carries a password
    # (review r159).
    if not isinstance(database, str):
        return (
            f"{where} must be the name (a str) of a database in DATABASES "
            f"(configured: {configured}), got {redacted(database)}."
        )
    return (
        f"{where} is {redacted(database)}, which is not in DATABASES (configured: {configured})."
    )


def _configured(database_settings):
    """Whether a DATABASES entry is a database: Django fills in a dummy "default"
    (ENGINE django.db.backends.dummy) when DATABASES is empty, and every query on it
    fails, which would look like an outage (review r159)."""
    if not isinstance(database_settings, dict):
        return False
    return database_settings.get("ENGINE", "") not in ("", "django.db.backends.dummy")


def _value_problems(alias, options):
    problems = []
    where = f"SETNX_LOCKS[{alias!r}]['OPTIONS']"
    timeout = options.get("OPERATION_TIMEOUT", DEFAULT_OPERATION_TIMEOUT)
    if not _is_seconds(timeout) or not 0 < timeout <= MAX_OPERATION_TIMEOUT:
        problems.append(
            f"{where}['OPERATION_TIMEOUT'] must be a positive number of seconds, at most "
            f"{MAX_OPERATION_TIMEOUT:g} (a day), got {timeout!r}."
        )
    idle = options.get("HEALTH_CHECK_AFTER", DEFAULT_HEALTH_CHECK_AFTER)
    if idle is not None and (not _is_seconds(idle) or idle < 0):
        problems.append(
            f"{where}['HEALTH_CHECK_AFTER'] must be None (never check) or a number "
            f"of seconds >= 0, got {idle!r}."
        )
    retention = options.get("STALE_RETENTION", DEFAULT_STALE_RETENTION)
    if not _is_seconds(retention) or not 0 < retention <= MAX_STALE_RETENTION:
        problems.append(
            f"{where}['STALE_RETENTION'] must be a positive number of seconds, at most "
            f"{MAX_STALE_RETENTION:g} (10 years), got {retention!r}."
        )
    synchronous = options.get("SQLITE_SYNCHRONOUS", "NORMAL")
    if synchronous is not None and (
        not isinstance(synchronous, str) or synchronous.upper() not in SQLITE_SYNCHRONOUS
    ):
        problems.append(
            f"{where}['SQLITE_SYNCHRONOUS'] must be one of "
            f"{', '.join(map(repr, SQLITE_SYNCHRONOUS))}, got {synchronous!r}."
        )
    for flag in ("LOCAL_WAKEUPS", "SQLITE_WAL"):
        # Strictly a bool: the string "False" (a setting read from the environment)
        # would be true, and switch the database file to WAL for good.
        value = options.get(flag, True)
        if not isinstance(value, bool):
            problems.append(f"{where}[{flag!r}] must be True or False, got {value!r}.")
    shared = options.get("ASYNC_CONNECTIONS", DEFAULT_ASYNC_CONNECTIONS)
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
        problems.append(
            f"{where}['ASYNC_CONNECTIONS'] must be a whole number >= 1, got {shared!r}."
        )
    prepared = options.get("PREPARED_STATEMENTS")
    if prepared is not None and not isinstance(prepared, bool):
        problems.append(
            f"{where}['PREPARED_STATEMENTS'] must be None (the default of the database), "
            f"True or False, got {prepared!r}."
        )
    return problems


def _sqlite_wal(wrapper, cursor):
    """Switch the SQLite database to WAL mode (persistent: once per database file);
    returns the journal mode it is in. A database that is not in WAL mode yet while
    another connection reads or writes it (the caller's own open transaction, say)
    cannot switch now: None, and the connection is used as it is until it can (see
    _sqlite_setup); its statements meanwhile wait for the write lock like any, and
    report what holds it (see _contention_message), instead of failing to connect."""
    # Without waiting: the switch waits for every other connection to finish, a
    # reader included, and the operation it precedes waits OPERATION_TIMEOUT anyway.
    cursor.execute("PRAGMA busy_timeout")
    (busy_timeout,) = cursor.fetchone()
    cursor.execute("PRAGMA busy_timeout = 0")
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        (mode,) = cursor.fetchone()
    except wrapper.Database.OperationalError as exc:
        if _classify(wrapper, wrapper.connection, exc) is not _CONTENTION:
            raise
        return None
    finally:
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout)}")
    return mode


def _sqlite_synchronous(choice, wrapper):
    """The ``PRAGMA synchronous`` our SQLite connection sets in WAL mode: ``choice``
    (OPTIONS["SQLITE_SYNCHRONOUS"]) if given; else NORMAL, unless the database's
    ``init_command`` sets one already (the project chose: keep it), then None."""
    if choice is not None:
        return choice
    init_command = str((wrapper.settings_dict.get("OPTIONS") or {}).get("init_command") or "")
    return None if "synchronous" in init_command.lower() else "NORMAL"


def _local_notifier(wrapper):
    """The sender of wake-ups to this host's other processes for our table in
    ``wrapper``'s database (see db_local_wakeups), or None: PostgreSQL (NOTIFY
    instead), an in-memory SQLite database (one process), or no usable directory.
    Never raises: without wake-ups the waiters poll."""
    try:
        directory = _local_channel_directory(wrapper)
    except Exception:
        logger.warning("Lock wake-ups between processes are off", exc_info=True)
        return None
    return None if directory is None else LocalNotifier(directory)


def _local_channel_directory(wrapper):
    settings = wrapper.settings_dict
    if wrapper.vendor == "sqlite":
        name = str(settings.get("NAME") or "")
        if not name or wrapper.is_in_memory_db():
            return None
        key = f"sqlite:{os.path.realpath(name)}"
    elif wrapper.vendor == "mysql":
        options = settings.get("OPTIONS") or {}
        server = (
            options.get("unix_socket")
            or f"{settings.get('HOST') or 'localhost'}:{settings.get('PORT') or 3306}"
        )
        key = f"mysql:{server}/{settings.get('NAME') or options.get('db') or ''}"
    else:
        return None
    return channel_directory(f"{key}/{LOCK_TABLE}")


def _uses_prepared_statements(wrapper, options):
    """Whether the lock connection prepares its statements: PostgreSQL with psycopg
    3, or MariaDB (see db_prepared); never MySQL (its EXECUTE takes only user
    variables: a second statement per call) nor SQLite (nothing to gain in-process).

    ``OPTIONS["PREPARED_STATEMENTS"]`` decides when set. By default, MariaDB prepares
    (a session that loses its statements is detected, see db_prepared); PostgreSQL
    follows what the project told Django for that database: prepared statements are
    off unless its ``DATABASES[...]["OPTIONS"]`` turns on ``server_side_binding`` or
    sets a ``prepare_threshold``, as Django does, because a connection pooler in
    transaction mode that does not track them (PgBouncer before 1.21) would run one
    client's statement under another client's name.
    """
    choice = options.get("PREPARED_STATEMENTS")
    if wrapper.vendor == "mysql" and getattr(wrapper, "mysql_is_mariadb", False):
        return choice is not False
    if wrapper.vendor != "postgresql":
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        return False
    if choice is not None:
        return bool(choice)
    django_options = wrapper.settings_dict.get("OPTIONS") or {}
    return (
        django_options.get("server_side_binding") is True
        or django_options.get("prepare_threshold") is not None
    )


def _database_name(wrapper):
    """The name of the database ``wrapper``'s new connection reached, on PostgreSQL
    as the server names it (``current_database()``, once per backend): processes
    configured differently for one database must agree on its NOTIFY channel, and
    neither ``NAME`` (empty when ``OPTIONS`` names a ``service``) nor the name the
    client sent (a PgBouncer alias) is the database's own. Elsewhere ``NAME``."""
    if wrapper.vendor != "postgresql":
        return wrapper.settings_dict.get("NAME")
    with wrapper.connection.cursor() as cursor:
        cursor.execute("SELECT current_database()")
        (name,) = cursor.fetchone()
    return name


def _prepared_statements_unused(engine, options):
    """Why ``PREPARED_STATEMENTS: True`` cannot apply to a database with ``engine``,
    as far as the settings tell (MySQL and MariaDB share an engine: see
    ``_connect``), or None."""
    if options.get("PREPARED_STATEMENTS") is not True:
        return None
    if "sqlite" in engine or "spatialite" in engine:
        return "is SQLite, which runs in this process (nothing to save)"
    if "postgresql" in engine or "postgis" in engine:
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            return "is PostgreSQL through psycopg 2, which cannot prepare statements"
    return None


def _sqlite_now_us():
    """The µs clock of an SQLite fencing token: this machine's. SQLite's own clock has
    millisecond resolution, and a database file is only ever written by processes of
    one machine, which share this clock (the statement also takes SQLite's clock in
    ms, whichever is later)."""
    return time.time_ns() // 1000


def _is_seconds(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _whole_seconds(timeout):
    # Drivers and servers that take whole seconds: round up, never to 0 ("no limit").
    return max(1, math.ceil(timeout))


def _timeout_options(base, timeout):
    """Connection options that bound each wait of the lock connection by about
    ``timeout`` seconds (``OPERATION_TIMEOUT``); they replace the project's own.

    - PostgreSQL: ``connect_timeout``; on an established connection,
      ``tcp_user_timeout`` (libpq >= 12) and TCP keepalives, so a dead network or
      host breaks the connection instead of leaving a statement waiting forever.
      These are client-side settings on purpose: server settings in the startup
      packet (``options='-c lock_timeout=...'``) are refused by PgBouncer, and a
      session ``SET`` would leak into other clients' server connections under
      transaction pooling. For a server-side bound, add ``-c lock_timeout=...`` to
      ``DATABASES[...]['OPTIONS']['options']`` yourself: its 55P03 errors are retried.
    - MySQL/MariaDB: connect, read and write timeouts (the read timeout is twice the
      server's lock waits, set by ``_connect``, so that their error arrives first).
    - SQLite: the busy timeout (how long to wait for the single write lock).
    """
    whole = _whole_seconds(timeout)
    if base.vendor == "postgresql":
        options = {
            "connect_timeout": max(2, whole),  # libpq reads 1 as 2
            "keepalives": 1,
            # At most MAX_TCP_KEEPALIVE (Linux refuses more: "setsockopt failed");
            # tcp_user_timeout still breaks a silent connection after ``timeout``.
            "keepalives_idle": min(whole, MAX_TCP_KEEPALIVE),
            "keepalives_interval": min(max(1, math.ceil(whole / 3)), MAX_TCP_KEEPALIVE),
            "keepalives_count": 3,
        }
        if _libpq_version(base.Database) >= 120000:
            options["tcp_user_timeout"] = max(1, int(timeout * 1000))
        return options
    if base.vendor == "mysql":
        # The server's lock waits end after ``whole`` seconds; its error needs a
        # moment more to arrive, and nothing else should take longer.
        return {
            "connect_timeout": whole,
            "read_timeout": whole + MYSQL_READ_MARGIN,
            "write_timeout": whole + MYSQL_READ_MARGIN,
        }
    if base.vendor == "sqlite":
        return {"timeout": timeout}
    return {}


def _bound_waits(raw, timeout):
    """Make every wait for the server on the psycopg 3 connection ``raw`` give up
    after ``timeout`` seconds (OPERATION_TIMEOUT). libpq has no read timeout, and
    TCP settings do not help against a server that is up but does not answer (a
    stopped process, a row lock held by a transaction that never ends): the kernel
    still acknowledges everything. On expiry the statement is cancelled (so it does
    not run later, when the server gets to it) and the connection closed; the
    caller gets an OperationalError naming the timeout.

    psycopg 2 (and psycopg 3 before 3.2) have no hook for this: there, only the
    server-side ``lock_timeout``/``statement_timeout`` bound a wait."""
    bounded = _bounded_connection_class(type(raw))
    if bounded is None:
        return
    raw.__class__ = bounded
    raw.setnx_timeout = timeout


_BOUNDED_CLASSES: dict[type, type] = {}


def _bounded_connection_class(cls):
    """A subclass of the psycopg 3 connection class ``cls`` whose ``wait`` has a
    default timeout, or None when ``cls`` has no ``wait(timeout=...)``."""
    if cls in _BOUNDED_CLASSES:
        return _BOUNDED_CLASSES[cls]
    bounded = None
    wait = getattr(cls, "wait", None)
    if wait is not None and "timeout" in inspect.signature(wait).parameters:
        import psycopg

        def bounded_wait(self, gen, *args, **kwargs):
            if len(args) < 2 and kwargs.get("timeout") is None:
                kwargs["timeout"] = self.setnx_timeout
            try:
                return wait(self, gen, *args, **kwargs)
            except psycopg.errors._WaitTimeout:
                self.setnx_timed_out = True
                with contextlib.suppress(Exception):
                    # Asks the server (on a new connection) to stop the statement;
                    # gives up after a second when the server does not answer.
                    self.cancel_safe(timeout=1.0)
                self.close()
                raise psycopg.OperationalError(
                    f"no answer from the server within {self.setnx_timeout:g} s "
                    "(OPTIONS['OPERATION_TIMEOUT']); the statement was cancelled and "
                    "the connection closed"
                ) from None

        bounded = type(
            f"Bounded{cls.__name__}",
            (cls,),
            {
                "wait": bounded_wait,
                "__module__": __name__,
                "setnx_timeout": None,
                "setnx_timed_out": False,
            },
        )
    _BOUNDED_CLASSES[cls] = bounded
    return bounded


def _timed_out(wrapper, raw, exc):
    """Whether ``exc`` says the server did not answer within the operation timeout
    (then retrying on a new connection would only double the wait)."""
    if wrapper.vendor == "postgresql":
        return getattr(raw, "setnx_timed_out", False)
    if wrapper.vendor == "mysql":
        return "timed out" in str(exc)  # PyMySQL/mysqlclient: a read or write timeout
    return False


def _libpq_version(database_module):
    try:
        return database_module.pq.version()  # psycopg 3
    except AttributeError:
        return database_module.extensions.libpq_version()  # psycopg2


# -- errors and health -------------------------------------------------------------------


def _classify(wrapper, raw, exc):
    """``_CONTENTION`` (deadlock, lock-wait timeout, busy: the server rolled the
    statement back), ``_DISCONNECTED`` (the connection is gone), or None."""
    vendor = wrapper.vendor
    if vendor == "postgresql":
        if _sqlstate(exc) in POSTGRESQL_CONTENTION:
            return _CONTENTION
        if connection_lost(exc, raw):
            return _DISCONNECTED
    elif vendor == "mysql":
        code = exc.args[0] if exc.args else None
        if code in MYSQL_CONTENTION:
            return _CONTENTION
        if code in MYSQL_DISCONNECTED or isinstance(exc, wrapper.Database.InterfaceError):
            return _DISCONNECTED
    elif vendor == "sqlite":
        code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
        if (code & 0xFF in SQLITE_BUSY_CODES) if code is not None else "is locked" in str(exc):
            return _CONTENTION
    return None


#: Of the contention errors, those that mean a concurrent writer of the same rows won:
#: deadlock and serialization failure (PostgreSQL), deadlock (MySQL/MariaDB).
POSTGRESQL_OUTRACED = frozenset({"40P01", "40001"})
MYSQL_OUTRACED = frozenset({1213})


def _sqlstate(exc):
    """A PostgreSQL error's SQLSTATE (psycopg 3: ``sqlstate``, psycopg 2: ``pgcode``)."""
    return getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None) or ""


def _outraced(wrapper, exc):
    """True for a contention error that a concurrent writer of the same rows caused
    (see POSTGRESQL_OUTRACED), not a row lock held for long or a busy SQLite file."""
    if wrapper.vendor == "postgresql":
        return _sqlstate(exc) in POSTGRESQL_OUTRACED
    if wrapper.vendor == "mysql":
        return bool(exc.args) and exc.args[0] in MYSQL_OUTRACED
    return False


def _socket_of(wrapper):
    """The file descriptor of the socket of the wrapper's driver connection, or None
    where the driver does not say (psycopg 2 and 3 and mysqlclient: ``fileno()``;
    PyMySQL: ``_sock``)."""
    raw = wrapper.connection
    for get in (lambda: raw.fileno(), lambda: raw._sock.fileno()):
        try:
            fd = get()
        except (AttributeError, OSError, ValueError, wrapper.Database.Error):
            continue  # no such method, or a closed connection
        if isinstance(fd, int) and fd >= 0:
            return fd
    return None


def _hung_up(wrapper):
    """True if the server ended this idle connection: its socket has something to read
    (the end of the stream, or what a server says before it closes, such as
    PostgreSQL's 57P01 after ``pg_terminate_backend``) while no statement is in
    flight. A poll that does not wait, so the hot path pays no round trip. Found
    here, the loss is certain to precede the next statement; found by the
    statement, it might not be."""
    if wrapper.vendor == "sqlite":
        return False
    fd = _socket_of(wrapper)
    if fd is None:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # a descriptor closed under us
        return True


def _usable(wrapper):
    """Whether the server still answers on this connection: one round trip.
    (MySQL's ping is told not to reconnect: a new connection needs our session
    settings, so we reconnect ourselves.) An SQLite file does not hang up."""
    raw = wrapper.connection
    try:
        if wrapper.vendor == "mysql":
            raw.ping(False)
        elif wrapper.vendor == "postgresql":
            cursor = raw.cursor()
            try:
                cursor.execute("SELECT 1")
            finally:
                cursor.close()
    except wrapper.Database.Error:
        return False
    return True


# -- forks -------------------------------------------------------------------------------

#: Every DatabaseBackend of this process, for the one at-fork hook below (a weak set:
#: a backend that is no longer used, e.g. after override_settings, is not kept alive).
_BACKENDS: weakref.WeakSet[DatabaseBackend] = weakref.WeakSet()
#: In a forked child, the connections inherited from the parent: kept referenced and
#: never closed, so that no finalizer says goodbye to the server on their behalf.
_INHERITED: list[object] = []


_FORGET_GUARD = ForkSafeLock()


def _forget_connections_after_fork():
    # A forked child must not talk over its parent's sockets; it reconnects.
    for backend in list(_BACKENDS):
        backend._forget_connections()


os.register_at_fork(after_in_child=_forget_connections_after_fork)


def _private_wrapper(alias, database, operation_timeout):
    """A new Django connection (not connected yet) to ``database`` for the lock
    backend ``alias``: a private copy of the project's connection, with the same
    settings (including a test database's name) but its own socket and transaction
    state, and nothing that would make it not ours: see "Connections" above."""
    from django.db import connections
    from django.utils.connection import ConnectionDoesNotExist

    try:
        base = connections[database]
    except ConnectionDoesNotExist as exc:
        # Gone from DATABASES since the backend was made: a configuration error, as
        # at its start (see _option_problems), not an outage.
        problem = _database_problem(alias, database, connections.settings)
        raise ImproperlyConfigured(problem or str(exc)) from exc
    # Copied a level deep, not deeply: OPTIONS may hold what cannot be copied (an
    # ssl.SSLContext for PyMySQL: review r127), and nothing in it is changed here.
    settings_dict = {
        key: dict(value) if isinstance(value, dict) else value
        for key, value in base.settings_dict.items()
    }
    settings_dict.update(
        AUTOCOMMIT=True, ATOMIC_REQUESTS=False, CONN_MAX_AGE=0, CONN_HEALTH_CHECKS=False
    )
    options = settings_dict["OPTIONS"] = dict(settings_dict.get("OPTIONS") or {})
    options.pop("pool", None)
    options.update(_timeout_options(base, operation_timeout))
    if base.vendor == "mysql" and "client_flag" in options:
        # Django sets CLIENT.FOUND_ROWS, but a client_flag of the project replaces
        # it: rowcount would count changed rows, not matched ones, and an extend
        # that sets the same expiry (same ms, same ttl) would read as a lost lock.
        from django.db.backends.mysql.base import CLIENT

        options["client_flag"] = options["client_flag"] | CLIENT.FOUND_ROWS
    return base.__class__(settings_dict, alias=database)


def _listen_connection(alias, database, operation_timeout):
    """A new autocommit psycopg connection for a PostgreSQL listener, made like the
    lock connections. Not registered with them: the listener's thread alone closes
    it (see PostgresListener.close), and a fork abandons it through the listener."""
    wrapper = _private_wrapper(alias, database, operation_timeout)
    wrapper.ensure_connection()
    return wrapper.connection


class _Leftovers:
    """What a backend leaves behind when it is dropped: the process it is of, its
    registered connections (a WeakSet of wrappers) and its LISTEN thread."""

    __slots__ = ("pid", "wrappers", "listener")

    def __init__(self, pid):
        self.pid = pid
        self.wrappers = ()
        self.listener = None


def _close_leftovers(leftovers):
    """Run once a backend is garbage (a reset dropped it, and the last Lock object,
    waiter or renewal that still used it is done): stop its LISTEN thread, and close
    the connections it made, which would otherwise stay open until a garbage
    collection (Django's DatabaseWrapper refers to itself). Nothing uses them: a
    thread running a statement keeps the backend alive. In a forked child whose
    backend never noticed the fork they are the parent's: abandoned, never closed."""
    ours = leftovers.pid == os.getpid()
    listener, leftovers.listener = leftovers.listener, None
    if listener is not None:
        if listener.pid == os.getpid():
            listener.close(wait=False)  # its thread closes its connection itself
        else:
            listener.abandon(_abandon_inherited)
    for wrapper in list(leftovers.wrappers):
        raw, wrapper.connection = wrapper.connection, None
        if raw is None:
            continue
        if ours:
            with contextlib.suppress(Exception):
                raw.close()
        else:
            _abandon_inherited(raw)


def _close_thread_connection(wrapper, pid):
    """Run when a thread's own :class:`ConnectionState` is garbage: the thread ended
    (or, in a forked child, was one of the parent's). Nothing uses its connection
    any more; closed now, it does not stay open until a cyclic garbage collection
    (Django's DatabaseWrapper refers to itself), which threads that each serve a
    request (runserver, a threading WSGI server) would otherwise pile up until the
    server's ``max_connections``. In a forked child it is the parent's: abandoned,
    never closed."""
    raw, wrapper.connection = wrapper.connection, None
    if raw is None:
        return
    if pid == os.getpid():
        with contextlib.suppress(Exception):
            raw.close()
    else:
        _abandon_inherited(raw)


def _abandon_inherited(raw):
    """In a forked child: keep ``raw`` (the parent's connection) referenced, and point
    its socket's descriptor at /dev/null in this process only.

    Closing it here would send the server a goodbye (PostgreSQL Terminate, MySQL
    COM_QUIT) over the socket the parent still uses, ending the parent's session;
    some drivers also do that from their finalizer (mysqlclient, psycopg2), e.g. at
    this process' exit. With the descriptor on /dev/null, whatever they write goes
    nowhere, and the parent's socket is untouched. An SQLite connection is only kept:
    SQLite says never to use or close a connection across a fork.
    """
    _INHERITED.append(raw)
    try:
        sock = getattr(raw, "_sock", None)  # PyMySQL
        fd = sock.fileno() if sock is not None else raw.fileno()  # psycopg, mysqlclient
    except Exception:  # noqa: BLE001 - closed already, or no socket (SQLite)
        return
    if fd < 0:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(devnull, fd, inheritable=False)
    finally:
        os.close(devnull)
