"""The database backend where Django apps really run: the project's DATABASES entry
configured with AUTOCOMMIT off or Django's connection pool, servers that drop idle
connections or lose an answer, contention that deadlocks, forks, bad input and
hostile globs. Every test runs against the real server (SQLite, PostgreSQL,
MariaDB); connections are ended with the server's own tools (pg_terminate_backend,
KILL) or cut by a small proxy on a Unix socket.

Extra DATABASES aliases exist only inside the tests that need them
(``temporary_database``): an alias in settings.DATABASES would be opened by every
other test of the suite.
"""

import asyncio
import concurrent.futures
import contextlib
import copy
import gc
import itertools
import logging
import os
import queue
import re
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
import types
import weakref

import django
import pytest
from django.conf import settings
from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_setnx import lock, locks
from django_setnx.backends import database
from django_setnx.backends.database import DatabaseBackend
from django_setnx.exceptions import LockBackendError
from django_setnx.models import LockRecord
from tests import workers
from tests.backend_sql import before_statements

OWNER = {"host": "test", "pid": 1, "thread": "MainThread"}
#: Long enough for any operation here to end; only a hang goes past it.
HANG = 60


def _aliases(*vendors):
    """The database lock aliases of this run whose ENGINE is one of ``vendors``."""
    return [
        alias
        for alias in settings.CONTRACT_ALIASES
        if alias in settings.DATABASES
        and any(v in settings.DATABASES[alias]["ENGINE"] for v in vendors)
    ]


#: Servers whose sessions can be ended (an SQLite connection is a file).
SERVER_ALIASES = _aliases("postgresql", "mysql")
POSTGRES = "postgres" in settings.CONTRACT_ALIASES


def needs(condition):
    """Define the test only when ``condition`` holds (a server of this run): a test
    that cannot apply does not exist, rather than being skipped (which CI counts
    as a failure: a missing server must not pass)."""
    return lambda test: test if condition else None


def _token():
    return secrets.token_hex(16)


@pytest.fixture
def make_backend():
    """Database backends that are not in SETNX_LOCKS, closed at the end."""
    made = []

    def make(database_alias, **options):
        backend = DatabaseBackend(
            f"edge-{len(made)}", {"OPTIONS": {"DATABASE": database_alias, **options}}
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def temporary_database(monkeypatch, django_db_blocker):
    """``temporary_database(primary, alias, **changes)``: a context manager for a
    DATABASES alias that exists only inside the block, a copy of ``primary``'s (test
    database) settings with ``changes`` (an ``OPTIONS`` change is merged)."""
    # Django's test case refuses connections to aliases it was not told about, and
    # these did not exist when it was set up: Django's own method, for this test.
    monkeypatch.setattr(
        BaseDatabaseWrapper, "ensure_connection", django_db_blocker._real_ensure_connection
    )

    @contextlib.contextmanager
    def temporary(primary, alias, **changes):
        settings_dict = copy.deepcopy(connections[primary].settings_dict)
        options = changes.pop("OPTIONS", {})
        settings_dict.update(changes)
        settings_dict["OPTIONS"] = {**settings_dict["OPTIONS"], **options}
        connections.settings[alias] = settings_dict
        try:
            yield alias
        finally:
            with contextlib.suppress(AttributeError):
                connections[alias].close()
                del connections[alias]
            del connections.settings[alias]

    return temporary


def _sql(backend, statement, params=()):
    """Run SQL on the backend's own autocommit connection (``{lock}``: its table,
    ``{p}``: its placeholder); returns the first row, if any."""

    def work(cursor, sql, raw):
        cursor.execute(statement.format(lock=sql.lock_table, p=sql.placeholder), params)
        return cursor.fetchone() if cursor.description else None

    return backend._run("test", work, retry=False)


def _raw_connection(backend):
    """The driver connection of the backend's connection for this thread, for a test
    to use directly (not counted as in use: see DatabaseBackend._connection)."""
    wrapper, raw = backend._connection()
    backend._done_with(wrapper)
    return raw


def _vendor(db_alias):
    return connections[db_alias].vendor


def _in_thread(fn):
    """Run ``fn`` in a thread; return what it returned or raise what it raised.
    Fails the test if it is still running after HANG seconds."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG)
    if thread.is_alive():
        pytest.fail(f"still running after {HANG} s: the operation hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# -- 1. the lock connection is ours: autocommit, never from Django's pool -----------------


def test_the_lock_connection_autocommits_when_the_database_does_not(
    db_alias, name, make_backend, temporary_database
):
    with temporary_database(db_alias, f"{db_alias}-manual", AUTOCOMMIT=False) as manual:
        backend, other = make_backend(manual), locks[db_alias]
        token = _token()
        won = backend.acquire(name, token, 30, OWNER)
        assert won.acquired
        # Visible to every other connection at once...
        seen = other.get(name)
        assert seen is not None and seen.fencing_token == won.fencing_token
        assert backend.release(name, token) is True
        assert other.get(name) is None
        # ...and nothing left in an open transaction for the next acquirer to wait for.
        newcomer = _token()
        assert _in_thread(lambda: other.acquire(name, newcomer, 30, OWNER)).acquired
        assert other.release(name, newcomer) is True


def test_a_decorated_call_in_atomic_with_autocommit_off_releases_at_once(
    db_alias, name, temporary_database
):
    """With AUTOCOMMIT: False Django's atomic() commits nothing and runs no on_commit
    callback after the caller's commit(): a release deferred to COMMIT would wait
    for the ttl. It is immediate instead."""
    from django.db import transaction

    from django_setnx import locked

    with temporary_database(db_alias, f"{db_alias}-manual-atomic", AUTOCOMMIT=False) as manual:

        @locked(name, ttl=30, backend=db_alias, using=manual)
        def guarded():
            return locks[db_alias].get(name) is not None

        try:
            with transaction.atomic(using=manual):
                assert guarded() is True
                assert locks[db_alias].get(name) is None, "released when the call returned"
            transaction.commit(using=manual)
            assert locks[db_alias].get(name) is None
        finally:
            transaction.rollback(using=manual)


@needs(POSTGRES and django.VERSION >= (5, 1))  # OPTIONS["pool"]: Django 5.1+
def test_lock_connections_never_come_from_djangos_pool(name, make_backend, temporary_database):
    threads = 4
    pool = {"min_size": 1, "max_size": threads, "timeout": 2}
    with temporary_database("postgres", "postgres-pool", OPTIONS={"pool": pool}) as pooled:
        backend = make_backend(pooled)
        together = threading.Barrier(threads)
        errors = []

        def worker(index):
            try:
                token = _token()
                # This thread's lock connection is open from here on...
                assert backend.acquire(f"{name}:{index}", token, 30, OWNER).acquired
                together.wait(timeout=HANG)
                # ...while every thread uses the ORM at once: all of the pool's
                # connections must still be there for it.
                with connections[pooled].cursor() as cursor:
                    cursor.execute("SELECT 1")
                    assert cursor.fetchone() == (1,)
                together.wait(timeout=HANG)
                assert backend.release(f"{name}:{index}", token) is True
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))
                together.abort()
            finally:
                connections[pooled].close()  # the ORM's connection back to the pool

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        try:
            for thread in workers:
                thread.start()
            for thread in workers:
                thread.join(HANG)
            assert errors == []
            with connections[pooled].cursor() as cursor:
                cursor.execute("SELECT 1")
        finally:
            backend.close()
            connections[pooled].close()
            connections[pooled].close_pool()


# -- 2. idle and dropped connections ------------------------------------------------------


def _session_id(backend):
    """The server's id of the backend's connection in this thread; not retried."""

    def work(cursor, sql, raw):
        cursor.execute(
            "SELECT pg_backend_pid()" if sql.vendor == "postgresql" else "SELECT CONNECTION_ID()"
        )
        return cursor.fetchone()[0]

    return backend._run("session id", work, retry=False)


def _kill(killer, session):
    """End a session on the server, from another connection, and wait until it is gone."""
    postgres = killer._dialect.vendor == "postgresql"
    _sql(killer, "SELECT pg_terminate_backend({p})" if postgres else "KILL {p}", (session,))
    alive = (
        "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = {p}"
        if postgres
        else "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {p}"
    )
    deadline = time.monotonic() + HANG
    while _sql(killer, alive, (session,))[0]:
        assert time.monotonic() < deadline, f"session {session} survived its kill"
        time.sleep(0.01)


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
def test_a_connection_dropped_while_idle_is_replaced_before_use(server_alias, name, make_backend):
    backend = make_backend(server_alias, HEALTH_CHECK_AFTER=0.2)
    killer = make_backend(server_alias)
    token = _token()
    assert backend.acquire(name, token, 30, OWNER).acquired
    assert backend.release(name, token)
    _session_id(killer)  # connects the killer
    session = _session_id(backend)

    _kill(killer, session)
    time.sleep(0.3)  # idle for longer than HEALTH_CHECK_AFTER
    token = _token()
    assert backend.acquire(name, token, 30, OWNER).acquired
    assert backend.release(name, token) is True
    assert _session_id(backend) != session

    # It was the check that replaced it, not a retry: an operation that is never
    # retried works too after the idle period.
    session = _session_id(backend)
    _kill(killer, session)
    time.sleep(0.3)
    assert _session_id(backend) != session


@pytest.mark.parametrize("database_alias", _aliases("sqlite", "postgresql", "mysql"))
def test_a_thread_s_own_connection_is_closed_when_the_thread_ends(
    database_alias, name, make_backend
):
    """Review r118: a thread per request (runserver, a threading WSGI server) left its
    lock connection open until a cyclic garbage collection, and with the collector
    off or rare (gc.freeze()), PostgreSQL ran out of connections."""
    backend = make_backend(database_alias)
    errors = []

    def request():
        try:
            token = _token()
            assert backend.acquire(name, token, 30, OWNER).acquired
            assert backend.release(name, token)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    gc.disable()
    try:
        for _ in range(5):
            thread = threading.Thread(target=request)
            thread.start()
            thread.join(HANG)
        assert errors == []
        wrappers = list(backend._wrappers)  # alive: their cycles are not collected
        assert len(wrappers) == 5
        assert [wrapper.connection for wrapper in wrappers] == [None] * 5
    finally:
        gc.enable()


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
def test_a_shared_connection_dropped_while_idle_is_replaced_before_an_async_call(
    server_alias, name, make_backend
):
    """The connections async callers share (ASYNC_CONNECTIONS) keep their own idle
    time: one the server dropped while idle is checked and replaced before the next
    async call, which succeeds."""
    backend = make_backend(server_alias, HEALTH_CHECK_AFTER=0.2, ASYNC_CONNECTIONS=1)
    killer = make_backend(server_alias)
    token = _token()
    assert asyncio.run(backend.aacquire(name, token, 30, OWNER)).acquired
    assert asyncio.run(backend.arelease(name, token))
    _session_id(killer)  # connects the killer
    with backend._borrowing_a_connection():
        session = _session_id(backend)

    _kill(killer, session)
    time.sleep(0.3)  # idle for longer than HEALTH_CHECK_AFTER
    # The check replaced it, not a retry: this query is never retried.
    with backend._borrowing_a_connection():
        assert _session_id(backend) != session
    token = _token()
    assert asyncio.run(backend.aacquire(name, token, 30, OWNER)).acquired
    assert asyncio.run(backend.arelease(name, token)) is True


def _until_hung_up(backend):
    """Wait until the backend's connection in this thread shows its end (the server's
    goodbye or EOF reached the socket), as it would before the next call."""
    from django_setnx.backends.database import _hung_up

    deadline = time.monotonic() + HANG
    while not _hung_up(backend._state().wrapper):
        assert time.monotonic() < deadline, "the ended connection never showed it"
        time.sleep(0.01)


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
def test_a_connection_the_server_ended_is_replaced_before_use_without_a_round_trip(
    server_alias, name, make_backend
):
    backend = make_backend(server_alias)  # HEALTH_CHECK_AFTER: the default, 10 s
    killer = make_backend(server_alias)
    _session_id(killer)
    session = _session_id(backend)
    _kill(killer, session)
    _until_hung_up(backend)
    # Not idle for HEALTH_CHECK_AFTER, so no check query: its socket told. Even an
    # operation that is never retried runs, once, on a new connection.
    assert _session_id(backend) != session

    # Each retry-safe operation, on a connection that died just before it, succeeds
    # (the connection is replaced before it, or, if the end had not reached the
    # socket yet, the operation is retried once).
    token = _token()
    operations = [
        ("acquire", lambda: backend.acquire(name, token, 30, OWNER).acquired, True),
        ("extend", lambda: backend.extend(name, token, 30), True),
        ("owns", lambda: backend.owns(name, token), True),
        ("get", lambda: backend.get(name).name, name),
        ("list", lambda: [i.name for i in backend.list(name_glob=name)], [name]),
        ("release", lambda: backend.release(name, token), True),
        ("acquire again", lambda: backend.acquire(name, _token(), 30, OWNER).acquired, True),
        ("clear", lambda: backend.clear(include_held=True, name_glob=name).names, [name]),
    ]
    for label, operation, expected in operations:
        _kill(killer, _session_id(backend))
        assert operation() == expected, label


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
def test_a_release_after_the_server_ended_the_connection_does_not_claim_a_lock_taken_over(
    server_alias, name, make_backend
):
    """Review r118: force-released, taken by another client, and then the holder's idle
    connection is ended by the server (a restart, wait_timeout, a DBA's kill). A
    release retried after a lost connection cannot tell "not ours" from "released,
    and only the answer was lost", so it says released; this one must not be a retry:
    it says the lock is not ours (LockNotOwned for the Lock)."""
    holder = make_backend(server_alias)
    other = make_backend(server_alias)
    killer = make_backend(server_alias)
    token = _token()
    assert holder.acquire(name, token, 30, OWNER).acquired
    other.delete(name)  # the admin's force-release
    newcomer = _token()
    assert other.acquire(name, newcomer, 30, OWNER).acquired
    _session_id(killer)
    _kill(killer, _session_id(holder))
    _until_hung_up(holder)
    assert holder.release(name, token) is False
    assert other.owns(name, newcomer)
    assert other.release(name, newcomer)


def test_acquire_is_idempotent_for_its_own_token(db_alias, name):
    """What a retried acquire finds when its first attempt did write: its own row."""
    backend = locks[db_alias]
    token = _token()
    first = backend.acquire(name, token, 30, OWNER)
    assert first.acquired
    again = backend.acquire(name, token, 30, OWNER, wait=5)
    assert again.acquired and again.fencing_token == first.fencing_token
    assert backend.get(name).fencing_token == first.fencing_token
    assert not backend.acquire(name, _token(), 30, OWNER).acquired
    assert backend.release(name, token) is True
    # The next acquisition mints a larger token.
    newcomer = _token()
    assert backend.acquire(name, newcomer, 30, OWNER).fencing_token > first.fencing_token
    backend.release(name, newcomer)


class _Proxy:
    """Forwards a Unix socket to a TCP server, one thread per connection.

    ``lose_answer_to(marker)``: the next client message that contains ``marker`` is
    forwarded; once the server's answer starts to arrive (the server did the work),
    the answer is thrown away and the connection cut, as a server restart or a
    network failure would at the worst moment. ``stall_path``: a second socket that
    accepts connections (the kernel does) and never answers.
    """

    def __init__(self, path, target, rename=None):
        self.path, self.target = path, target
        self.rename = rename  # (client's database name, server's): PgBouncer's aliases
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.marker = None
        self.answers_lost = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_answer_to(self, marker):
        self.marker = marker.encode()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client):
        upstream = socket.create_connection(self.target)
        cutting = False
        try:
            if self.rename is not None:
                self._start_renamed(client, upstream)
            while not self.closed:
                ready, _, _ = select.select([client, upstream], [], [], 0.2)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        if self.marker is not None and self.marker in data:
                            self.marker, cutting = None, True
                        upstream.sendall(data)
                    elif cutting:
                        self.answers_lost += 1
                        client.close()
                        upstream.settimeout(0.5)  # let the server finish its answer
                        with contextlib.suppress(OSError):
                            while upstream.recv(65536):
                                pass
                        return
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def _start_renamed(self, client, upstream):
        """Pass the client's startup message on with its ``database`` renamed, as
        PgBouncer passes a client's alias on as the server's database name."""
        while True:
            (length,) = struct.unpack("!i", _read_exactly(client, 4))
            body = _read_exactly(client, length - 4)
            if struct.unpack("!i", body[:4])[0] not in (80877103, 80877104):
                break
            client.sendall(b"N")  # no SSL or GSS encryption: ask for the startup
        fields = body[4:].split(b"\0")
        alias, real = (name.encode() for name in self.rename)
        for i in range(0, len(fields) - 1, 2):
            if fields[i] == b"database" and fields[i + 1] == alias:
                fields[i + 1] = real
        body = body[:4] + b"\0".join(fields)
        upstream.sendall(struct.pack("!i", len(body) + 4) + body)

    def close(self):
        self.closed = True
        self.listener.close()


def _read_exactly(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the client hung up during its startup")
        data += chunk
    return data


@pytest.fixture
def proxied_postgres(temporary_database):
    """A temporary alias of the PostgreSQL test database reached through a _Proxy."""
    settings_dict = connections["postgres"].settings_dict
    directory = tempfile.mkdtemp(prefix="setnx-")
    port = "5432"
    proxy = _Proxy(
        os.path.join(directory, f".s.PGSQL.{port}"),
        (settings_dict["HOST"] or "127.0.0.1", int(settings_dict["PORT"] or 5432)),
    )
    try:
        with temporary_database(
            "postgres", "postgres-proxied", HOST=directory, PORT=port
        ) as alias:
            yield alias, proxy
    finally:
        proxy.close()
        shutil.rmtree(directory, ignore_errors=True)


@needs(POSTGRES)
@pytest.mark.parametrize("named_by", ["a PgBouncer alias", "a service"])
def test_processes_that_name_one_database_differently_share_its_channel(
    named_by, name, tmp_path, monkeypatch, temporary_database, make_backend
):
    """One PostgreSQL database, reached by one process under its own name and by
    another under a name of the client's (a PgBouncer alias, which the server never
    sees; or an empty ``NAME`` and a ``service`` of a pg_service.conf): both NOTIFY
    and LISTEN on one channel, so each wakes the other's waiters at once."""
    direct = make_backend("postgres")
    token = _token()
    assert direct.acquire(name, token, 30, OWNER).acquired  # connects: names its channel
    assert direct.release(name, token)
    settings_dict = connections["postgres"].settings_dict
    real_name = settings_dict["NAME"]
    if named_by == "a service":
        service = tmp_path / "pg_service.conf"
        service.write_text(
            f"[setnx-test]\ndbname={real_name}\nhost={settings_dict['HOST'] or '127.0.0.1'}\n"
            f"port={settings_dict['PORT'] or 5432}\nuser={settings_dict['USER']}\n"
        )
        monkeypatch.setenv("PGSERVICEFILE", str(service))
        changes, proxy = {"NAME": "", "OPTIONS": {"service": "setnx-test"}}, None
    else:
        directory = str(tmp_path / "bouncer")
        proxy = _Proxy(
            os.path.join(directory, ".s.PGSQL.5432"),
            (settings_dict["HOST"] or "127.0.0.1", int(settings_dict["PORT"] or 5432)),
            rename=("app_alias", real_name),
        )
        changes = {"NAME": "app_alias", "HOST": directory, "PORT": "5432"}
    try:
        with temporary_database("postgres", "postgres-renamed", **changes) as alias:
            renamed = make_backend(alias)
            token = _token()
            assert renamed.acquire(name, token, 30, OWNER).acquired
            assert renamed.release(name, token)
            raw = _raw_connection(renamed)
            if proxy is not None:
                assert raw.info.dbname == "app_alias"  # what the client knows it by
            assert renamed._channel == direct._channel
    finally:
        if proxy is not None:
            proxy.close()


@needs(POSTGRES)
def test_an_answer_lost_with_the_connection_is_not_misread(proxied_postgres, name, make_backend):
    """The worst moment: the server did the work and only its answer was lost."""
    alias, proxy = proxied_postgres
    backend = make_backend(alias)
    token = _token()
    proxy.lose_answer_to(token)
    won = backend.acquire(name, token, 30, OWNER)
    assert proxy.answers_lost == 1
    # The retry found the row its first attempt wrote: won, with that fencing token.
    assert won.acquired and won.fencing_token == locks["postgres"].get(name).fencing_token

    proxy.lose_answer_to(token)
    # The first attempt deleted the row: the retry finds nothing, which is no loss.
    assert backend.release(name, token) is True
    assert proxy.answers_lost == 2
    assert locks["postgres"].get(name) is None

    # An operation that may not be repeated reports the loss, and the next one runs
    # on a new connection.
    session = _session_id(backend)
    proxy.lose_answer_to("pg_backend_pid")
    with pytest.raises(LockBackendError, match="session id failed"):
        _session_id(backend)
    assert proxy.answers_lost == 3
    assert _session_id(backend) != session


@pytest.mark.parametrize(
    "record, token, refused",
    [
        ("ok", "", "non-empty string"),
        ("ok", None, "non-empty string"),
        ("ok", "t" * 65, "at most 64 characters"),
        ("n" * 201, "t", "201 characters long"),
        ("", "t", "must not be empty"),
    ],
)
def test_the_backend_refuses_a_token_or_name_no_record_may_carry(db_alias, record, token, refused):
    """Review r152: backend.acquire() with the empty token (a released row's) wrote a
    row that get, list, clearlocks and delete all skip and nobody could release: the
    name blocked for the whole ttl. A long name or token failed as an "outage" on
    PostgreSQL and MariaDB, and was written on SQLite."""
    backend = locks[db_alias]
    before = {info.name for info in backend.list()}
    with pytest.raises((ValueError, TypeError), match=refused):
        backend.acquire(record, token, 30, OWNER)
    assert {info.name for info in backend.list()} == before
    if record:
        assert backend.acquire(record[:200], "t", 30, OWNER, 0).acquired
        assert backend.release(record[:200], "t")


# -- 3. contention is retried, not reported as an outage ------------------------------------


@needs(POSTGRES)
def test_an_acquire_outraced_past_its_retries_is_refused_not_an_outage(
    temporary_database, name, make_backend, monkeypatch
):
    """Review r118: on a server whose default isolation is SERIALIZABLE (the lock
    connection is in autocommit, so Django's isolation_level does not apply to it),
    another client's committed write of the row the acquire waited for fails it with
    a serialization failure. When the retries run out, that is a refusal (the wait
    goes on until its timeout), not a LockBackendError. One retry here, so that one
    failure runs them out."""
    monkeypatch.setattr(database, "CONTENTION_RETRIES", 0)
    serializable = {"options": "-c default_transaction_isolation=serializable"}
    with temporary_database("postgres", "postgres-serializable", OPTIONS=serializable) as alias:
        backend = make_backend(alias)
        writer = make_backend(alias)
        holder = _token()
        assert writer.acquire(name, holder, 30, OWNER).acquired
        assert _sql(backend, "SHOW transaction_isolation") == ("serializable",)
        raw = _raw_connection(writer)
        raw.execute("BEGIN")
        raw.execute(
            f"UPDATE {database.LOCK_TABLE} SET expires_at = expires_at WHERE name = %s", (name,)
        )
        outcome = {}

        def contender():
            try:
                outcome["result"] = backend.acquire(name, _token(), 30, OWNER)
            except Exception as exc:  # noqa: BLE001 - reported below
                outcome["result"] = exc

        thread = threading.Thread(target=contender)
        thread.start()
        time.sleep(0.3)  # the contender now waits for the row lock of our update
        raw.execute("COMMIT")
        thread.join(HANG)
        result = outcome["result"]
        assert not isinstance(result, Exception), result
        assert not result.acquired
        assert writer.owns(name, holder)
        assert writer.release(name, holder)


@pytest.mark.slow
def test_deadlocks_and_lock_waits_are_retried_not_reported(db_alias, name):
    """8 threads race for a few names that keep being released (deleted) and taken
    again (inserted): concurrent inserts of the same new key, which MariaDB answers
    with a deadlock now and then. Not one error may reach the caller."""
    backend, threads, attempts = locks[db_alias], 8, 1500
    names = [f"{name}:{i}" for i in range(4)]
    errors, wins = [], []

    def worker(index):
        won = 0
        for attempt in range(attempts):
            item, token = names[(index + attempt) % len(names)], _token()
            try:
                if backend.acquire(item, token, 30, OWNER).acquired:
                    won += 1
                    if not backend.release(item, token):
                        errors.append(f"{item}: release reported the lock lost")
            except LockBackendError as exc:
                errors.append(str(exc))
        wins.append(won)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert errors == []
    assert len(wins) == threads and sum(wins) > 0


STATEMENT_TIME_LIMITS = {
    # The database's own per-statement limit, set on every session as a project would.
    "postgresql": {"options": "-c statement_timeout=100"},
    "mysql": {"init_command": "SET SESSION max_statement_time = 0.1"},
}


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
def test_a_statement_time_limit_met_while_a_row_is_locked_is_contention(
    server_alias, name, temporary_database, make_backend
):
    """A project may bound every statement on its database (PostgreSQL's
    ``statement_timeout``, MariaDB's ``max_statement_time``). Ours run that long only
    while another transaction holds the lock's row: the statement was rolled back,
    and is retried within OPERATION_TIMEOUT like a lock-wait timeout, not reported as
    an outage that leaves the lock held until its ttl."""
    vendor = connections[server_alias].vendor
    if vendor == "mysql" and not connections[server_alias].mysql_is_mariadb:
        pytest.skip("max_statement_time is MariaDB's (MySQL's limit is for SELECTs only)")
    with temporary_database(
        server_alias, f"{server_alias}-limited", OPTIONS=STATEMENT_TIME_LIMITS[vendor]
    ) as alias:
        backend = make_backend(alias)
        token = _token()
        assert backend.acquire(name, token, 30, OWNER).acquired
        limit = "SELECT @@max_statement_time" if vendor == "mysql" else "SHOW statement_timeout"
        assert _sql(backend, limit)[0] in (0.1, "100ms")  # in force on our connection
        other = make_backend(server_alias)
        raw = _raw_connection(other)
        cursor = raw.cursor()
        cursor.execute("START TRANSACTION" if vendor == "mysql" else "BEGIN")
        cursor.execute(
            f"SELECT name FROM {database.LOCK_TABLE} WHERE name = %s FOR UPDATE", (name,)
        )
        ended = threading.Timer(0.4, raw.rollback)
        ended.start()
        try:
            assert backend.release(name, token)  # waited out the 0.4 s row lock
        finally:
            ended.join()
            cursor.close()
        assert backend.get(name) is None


# -- 4. forks -------------------------------------------------------------------------------


@pytest.mark.no_db
def test_backends_share_one_fork_hook_and_are_not_kept_alive(monkeypatch):
    registered = []
    monkeypatch.setattr(os, "register_at_fork", lambda **hooks: registered.append(hooks))
    backends = [
        DatabaseBackend(f"fork-{i}", {"OPTIONS": {"DATABASE": "default"}}) for i in range(100)
    ]
    assert registered == [], "a hook per instance"
    assert all(b in database._BACKENDS for b in backends)  # the one hook reaches them
    refs = [weakref.ref(b) for b in backends]
    del backends
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == [], "kept alive by a fork hook"


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
@pytest.mark.parametrize(
    "fork", [os.fork, workers.fork_without_hooks], ids=["os.fork", "no-fork-hooks"]
)
def test_a_forked_child_never_ends_the_parents_session(server_alias, name, fork):
    """Whatever the child does with the backend, close() first (uWSGI's child, with
    no fork hook, used to close the parent's connections and end its sessions)."""
    backend = locks[server_alias]
    token = _token()
    assert backend.acquire(name, token, 30, OWNER).acquired
    session = _session_id(backend)
    pid = fork()
    if pid == 0:  # the child: whatever it does with the backend, the parent's
        code = 1  # session must survive
        try:
            backend.close()
            gc.collect()
            with lock(f"{name}:child", ttl=10, backend=server_alias, timeout=5):
                pass
            backend.close()
            # Drop what the backend keeps of the parent's connections: their
            # finalizers run now, and must not reach the parent's sessions either.
            getattr(database, "_INHERITED", []).clear()
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _session_id(backend) == session  # not retried: the same session, alive
    assert backend.release(name, token) is True


# -- 5. timeouts ------------------------------------------------------------------------------


def test_the_lock_connection_carries_the_operation_timeout(db_alias, name, make_backend):
    backend = make_backend(db_alias, OPERATION_TIMEOUT=3)
    assert not backend.owns(name, _token())  # connects
    raw = backend._state().wrapper.connection
    vendor = _vendor(db_alias)
    if vendor == "postgresql":
        parameters = raw.info.get_parameters()
        assert parameters["connect_timeout"] == "3"
        assert parameters["tcp_user_timeout"] == "3000"
        assert parameters["keepalives_idle"] == "3"
    elif vendor == "mysql":
        assert _sql(
            backend, "SELECT @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout"
        ) == (3, 3)
    else:
        assert _sql(backend, "PRAGMA busy_timeout") == (3000,)


def _close_in_a_loop(backend, work, threads, seconds):
    """Run ``work()`` over and over in ``threads`` threads for ``seconds`` while this
    thread calls ``backend.close()`` every 0.5 ms. Returns ``(the repr of every
    exception work raised, how many calls of work ended, how many closes)``."""
    failures, calls = [], []
    until = time.monotonic() + seconds

    def repeat():
        while time.monotonic() < until:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - what the tests count
                failures.append(repr(exc))
            calls.append(1)

    workers = [threading.Thread(target=repeat) for _ in range(threads)]
    for thread in workers:
        thread.start()
    closes = 0
    while any(thread.is_alive() for thread in workers):
        backend.close()
        closes += 1
        time.sleep(0.0005)
    for thread in workers:
        thread.join(HANG)
    return failures, len(calls), closes


def test_close_from_another_thread_never_breaks_a_statement_in_flight(
    db_alias, name, make_backend
):
    """close() (``locks.close_all()``, a settings change) while other threads run
    lock operations: a connection in use is closed by its own thread once its
    statement is done, so every operation succeeds. Closed under the statement, the
    drivers failed it ("connection pointer is NULL", "socket closed"), PyMySQL even
    with an AttributeError that was no LockBackendError."""
    backend = make_backend(db_alias)

    def cycle():
        lock_name, token = f"{name}-{secrets.token_hex(4)}", _token()
        assert backend.acquire(lock_name, token, 30, OWNER).acquired
        assert backend.release(lock_name, token) is True

    failures, cycles, closes = _close_in_a_loop(backend, cycle, threads=3, seconds=2)
    assert failures == [], f"{len(failures)} of {cycles} cycles failed: {failures[:5]}"
    assert cycles > 10 and closes > 10
    backend.close()
    assert [wrapper.connection for wrapper in backend._wrappers] == [None] * len(
        backend._wrappers
    ), "closed once idle"


@needs(POSTGRES)
def test_close_from_another_thread_while_the_listen_thread_waits(name):
    """Waiters keep PostgreSQL's LISTEN thread running while another thread calls
    close() every 0.5 ms: the listener's connection is closed by its own thread
    (closed from the other one under its wait, psycopg freed it in use and the
    process crashed), and every wait ends."""
    names = itertools.cycle([f"{name}-0", f"{name}-1"])

    def contend():
        with lock(next(names), ttl=5, backend="postgres", timeout=5):
            time.sleep(0.002)

    failures, rounds, _ = _close_in_a_loop(locks["postgres"], contend, threads=4, seconds=3)
    assert failures == [], f"{len(failures)} of {rounds} rounds failed: {failures[:5]}"
    assert rounds > 10


def _session_alive(db_alias, session):
    """Whether the server still has the session ``session`` (its id, as
    ``_session_id`` gives it)."""
    with connections[db_alias].cursor() as cursor:
        if connections[db_alias].vendor == "postgresql":
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # not an earlier snapshot
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [session])
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = %s", [session]
            )
        return cursor.fetchone()[0] > 0


def test_a_backend_dropped_by_a_reset_closes_its_connections_at_once(db_alias, name):
    """``locks.reset()`` (a settings change) drops a backend that other threads, async
    callers and a Lock held across the reset used. The reset closes its connections,
    and the Lock's release opens one again on the dropped backend; once that Lock is
    gone, the backend is garbage at once (the garbage collector is disabled here)
    and that connection is closed too. The backend referred to itself through the
    factory of its shared connections, and Django's connection objects refer to
    themselves: both stayed, with their sessions, until a collection (r103 N3,
    r109 F2)."""
    server = db_alias != "default"  # SQLite has no server to count sessions on
    backend = locks[db_alias]

    def cycle():
        with lock(name, ttl=5, backend=db_alias):
            pass

    async def acycle():
        async with lock(name, ttl=5, backend=db_alias):
            pass

    worker = threading.Thread(target=cycle)
    worker.start()
    worker.join(HANG)
    cycle()
    asyncio.run(acycle())
    held = lock(f"{name}:held", ttl=30, backend=db_alias)
    assert held.acquire(blocking=False)
    wrappers = backend._wrappers  # a WeakSet: it does not keep the backend
    dropped = weakref.ref(backend)
    del backend
    gc.disable()
    try:
        locks.reset()  # closes them all
        assert [wrapper.connection for wrapper in wrappers] == [None] * len(wrappers)
        held.release()  # on the dropped backend, over a connection opened again
        (reopened,) = [wrapper.connection for wrapper in wrappers if wrapper.connection]
        if server:
            session = _session_of_wrapper(db_alias, reopened)
            assert _session_alive(db_alias, session)
        del held, reopened
        assert dropped() is None, "the dropped backend outlived its last user"
        assert [wrapper.connection for wrapper in wrappers] == [None] * len(wrappers)
        if server:
            deadline = time.monotonic() + HANG
            while _session_alive(db_alias, session):
                assert time.monotonic() < deadline, f"session {session} was left open"
                time.sleep(0.01)
    finally:
        gc.enable()


def _session_of_wrapper(db_alias, raw):
    with raw.cursor() as cursor:
        postgres = connections[db_alias].vendor == "postgresql"
        cursor.execute("SELECT pg_backend_pid()" if postgres else "SELECT CONNECTION_ID()")
        return cursor.fetchone()[0]


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
def test_a_child_that_drops_a_backend_leaves_the_parents_connections_open(server_alias, name):
    """A child forked without fork hooks (uWSGI) drops the last Lock object of a
    backend that a reset dropped in the parent: the backend is garbage in the child,
    whose finalizer must leave the parent's connections alone (abandoned: kept, with
    their descriptor pointed at /dev/null; closing one would end the parent's session
    over the shared socket). The parent's session carries on, the same one, and its
    lock is released on it."""
    held = lock(name, ttl=30, backend=server_alias)
    assert held.acquire(blocking=False)
    wrappers = held.backend._wrappers
    dropped = weakref.ref(held.backend)
    gc.disable()
    read_end, write_end = os.pipe()
    try:
        locks.reset()
        held.extend(30)  # on the dropped backend, over a connection opened again
        (reopened,) = [wrapper.connection for wrapper in wrappers if wrapper.connection]
        session = _session_of_wrapper(server_alias, reopened)
        pid = workers.fork_without_hooks()
        if pid == 0:  # the child: never return into pytest
            outcome = b"E"
            try:
                del held  # the backend is garbage here: its finalizer runs
                sock = getattr(reopened, "_sock", None)  # PyMySQL; psycopg: fileno()
                fd = sock.fileno() if sock is not None else reopened.fileno()
                on_devnull = (
                    os.readlink(f"/proc/self/fd/{fd}") == os.devnull
                    if os.path.isdir("/proc/self/fd")  # Linux: where it points
                    else os.fstat(fd).st_rdev == os.stat(os.devnull).st_rdev
                )
                abandoned = (
                    dropped() is None
                    and any(raw is reopened for raw in database._INHERITED)
                    and on_devnull
                )
                outcome = b"1" if abandoned else b"0"
            finally:
                try:
                    os.write(write_end, outcome)
                finally:
                    os._exit(0)
        os.close(write_end)  # the child's end: a child that dies unheard reads as EOF
        write_end = None
        workers.reap(pid, HANG)
        assert os.read(read_end, 1) == b"1", "the child's finalizer did not abandon them"
        assert _session_alive(server_alias, session)
        held.release()
        assert _session_of_wrapper(server_alias, reopened) == session
    finally:
        gc.enable()
        os.close(read_end)
        if write_end is not None:
            os.close(write_end)


def _listener_threads(alias):
    return [t for t in threading.enumerate() if t.name == f"django-setnx listener {alias}"]


@needs(POSTGRES)
def test_a_waiter_across_a_reset_leaves_no_listen_thread_behind(name):
    """A PostgreSQL waiter still waiting when ``locks.reset()`` drops its backend
    starts the LISTEN thread again there (the reset stopped it); once the waiter is
    done, the backend is garbage at once and that thread stops and closes its
    connection. The thread referred to the backend, which it kept alive, listening,
    for the rest of the process (r109 F1)."""
    holder = lock(name, ttl=30, backend="postgres")
    assert holder.acquire(blocking=False)
    waiter = lock(name, ttl=30, backend="postgres")
    outcome = []
    thread = threading.Thread(target=lambda w=waiter: outcome.append(w.acquire(timeout=HANG)))
    thread.start()
    dropped = weakref.ref(locks["postgres"])
    deadline = time.monotonic() + HANG
    while not (dropped()._listener and dropped()._listener.ready_at):
        assert time.monotonic() < deadline, "the waiter never started the listener"
        time.sleep(0.01)
    gc.disable()
    try:
        locks.reset()
        while not (dropped()._listener and dropped()._listener.ready_at):
            assert time.monotonic() < deadline, "the waiter never started the listener again"
            time.sleep(0.01)
        session = dropped()._listener._connection.info.backend_pid
        holder.release()
        thread.join(HANG)
        assert outcome == [True]
        waiter.release()
        del holder, waiter, thread
        assert dropped() is None, "the dropped backend outlived its last user"
        while _listener_threads("postgres") or _session_alive("postgres", session):
            assert time.monotonic() < deadline, "the LISTEN thread or its session was left"
            time.sleep(0.01)
    finally:
        gc.enable()


@pytest.mark.parametrize("waiting_alias", _aliases("mysql", "sqlite"))
def test_a_lock_held_elsewhere_fails_within_the_timeout(waiting_alias, name, make_backend):
    """Another transaction keeps the lock row (MySQL: a row lock) or the database
    (SQLite: its write lock): the acquire gives up after OPERATION_TIMEOUT. (On
    PostgreSQL a lock wait is bounded by the server's own lock_timeout, if set: see
    database._timeout_options.)"""
    vendor = _vendor(waiting_alias)
    holder, backend = make_backend(waiting_alias), make_backend(waiting_alias, OPERATION_TIMEOUT=1)
    token = _token()
    assert holder.acquire(name, token, 30, OWNER).acquired
    if vendor == "mysql":
        _sql(holder, "START TRANSACTION")
        _sql(holder, "SELECT name FROM {lock} WHERE name = {p} FOR UPDATE", (name,))
        expected = r"Lock wait timeout"
    else:
        _sql(holder, "BEGIN IMMEDIATE")
        expected = r"database is locked"
    try:
        with pytest.raises(LockBackendError, match=expected):
            _in_thread(lambda: backend.acquire(name, _token(), 30, OWNER))
    finally:
        _sql(holder, "ROLLBACK")
    assert holder.release(name, token) is True


@needs(POSTGRES)
def test_a_silent_server_fails_the_connect_within_the_timeout(make_backend, temporary_database):
    directory = tempfile.mkdtemp(prefix="setnx-")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(os.path.join(directory, ".s.PGSQL.5432"))
    silent.listen(16)  # the kernel accepts; nobody ever answers
    try:
        with temporary_database(
            "postgres", "postgres-silent", HOST=directory, PORT="5432"
        ) as alias:
            backend = make_backend(alias, OPERATION_TIMEOUT=1)
            with pytest.raises(LockBackendError, match="cannot connect"):
                _in_thread(lambda: backend.acquire("silent", _token(), 30, OWNER))
    finally:
        silent.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("database_alias", _aliases("postgresql", "mysql", "sqlite"))
def test_async_callers_share_a_few_connections(make_backend, database_alias):
    """Async calls run their statements in the event loop's default executor (up to
    32 threads), each on one of the ASYNC_CONNECTIONS connections the process'
    async callers share: 60 concurrent acquires, reads and releases through 16
    executor threads open 2 lock connections, not one per thread (a server's
    max_connections is shared by every worker process). Sync callers keep their own."""
    backend = make_backend(database_alias, ASYNC_CONNECTIONS=2)
    names = [f"async-connections:{_token()}" for _ in range(60)]
    tokens = {name: _token() for name in names}
    threads_used = set()

    async def cycle(name):
        assert (await backend.aacquire(name, tokens[name], 30, OWNER)).acquired
        assert (await backend.aget(name)).is_held
        assert await backend.arelease(name, tokens[name])

    def note_thread():
        threads_used.add(threading.get_ident())
        time.sleep(0.01)  # so that the executor starts its threads, as under load

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(16))
        await asyncio.gather(*(loop.run_in_executor(None, note_thread) for _ in range(32)))
        await asyncio.gather(*(cycle(name) for name in names))

    asyncio.run(main())
    assert len(threads_used) > 2  # the executor had more threads than connections to share
    assert len(backend._wrappers) == 2
    assert backend.get_many(names) == dict.fromkeys(names)  # a sync call: this thread's own
    assert len(backend._wrappers) == 3


@contextlib.contextmanager
def _registered(lock_alias, database_alias, **options):
    """A database lock backend registered in SETNX_LOCKS as ``lock_alias`` (so that
    ``lock(..., backend=lock_alias)`` uses it) for the ``with`` block; yields it."""
    from django.test import override_settings

    configured = {
        **settings.SETNX_LOCKS,
        lock_alias: {
            "BACKEND": "django_setnx.backends.database.DatabaseBackend",
            "OPTIONS": {"DATABASE": database_alias, **options},
        },
    }
    with override_settings(SETNX_LOCKS=configured):
        yield locks[lock_alias]


@pytest.mark.parametrize("database_alias", _aliases("postgresql", "mysql", "sqlite"))
def test_renewal_threads_share_the_async_callers_connections(database_alias):
    """Each auto_renew lock has a thread that renews it: its extends borrow one of the
    ASYNC_CONNECTIONS shared connections, instead of a connection per renewed lock
    (kept until the garbage collector ran, review r92)."""
    with _registered("renew-shared", database_alias, ASYNC_CONNECTIONS=2) as backend:
        held = [
            lock(f"renew-shared:{_token()}", ttl=0.6, backend="renew-shared", auto_renew=True)
            for _ in range(12)
        ]
        for lk in held:
            assert lk.acquire(blocking=False)  # on this thread's own connection
        first = {lk.name: backend.get(lk.name).expires_at for lk in held}
        time.sleep(1.0)  # each is renewed every 0.2 s
        try:
            assert all(backend.get(lk.name).expires_at > first[lk.name] for lk in held)
            assert len(backend._wrappers) == 3  # this thread's, and the 2 shared
        finally:
            for lk in held:
                lk.release()


@pytest.mark.parametrize("database_alias", _aliases("postgresql", "mysql", "sqlite"))
def test_a_renewal_never_waits_behind_busy_shared_connections(database_alias):
    """A renewal that finds every shared connection busy (async calls stuck behind a
    row lock, say) runs on its thread's own connection at once, and the lock is not
    lost for calls it has nothing to do with (review r93); that connection is
    closed after the call, not kept idle for the rest of the ttl (review r94)."""
    with _registered("renew-busy", database_alias, ASYNC_CONNECTIONS=1) as backend:
        renewed = lock(f"renew-busy:{_token()}", ttl=0.6, backend="renew-busy", auto_renew=True)
        with backend._shared.get().borrowed(5):  # the one shared connection, stuck
            gc.disable()
            assert renewed.acquire(blocking=False)
            first = backend.get(renewed.name).expires_at
            time.sleep(1.2)  # two ttls: lost unless renewed
            assert renewed.owned() and not renewed.lost
            assert backend.get(renewed.name).expires_at > first
            # Only this thread's, but for the instants of a renewal: the renewal's
            # own connection is closed after each use (by it, not by a collection).
            counts = []
            for _ in range(50):
                counts.append(len(backend._wrappers))
                time.sleep(0.01)
            assert min(counts) == 1 and max(counts) <= 2, counts
            gc.enable()
            renewed.release()


@pytest.mark.parametrize("database_alias", _aliases("postgresql", "sqlite"))
def test_an_async_release_never_waits_for_the_renewal_in_the_event_loop(database_alias):
    """arelease() of an auto_renew lock stops its renewal thread without joining it:
    a renewal waiting for a shared connection (or a slow extend) would stall every
    coroutine of the loop meanwhile (review r93: 3 s)."""

    def hold_the_shared_connection(pool, taken, seconds):
        state = pool.take(5)
        taken.set()
        time.sleep(seconds)
        pool.give_back(state)

    async def main(backend):
        renewed = lock(f"renew-loop:{_token()}", ttl=6, backend="renew-loop", auto_renew=True)
        assert await renewed.aacquire(blocking=False)
        loop = asyncio.get_running_loop()
        await asyncio.sleep(1.8)  # the renewal comes at 2 s, and may wait 1 s for a connection
        taken = threading.Event()
        holder = threading.Thread(
            target=hold_the_shared_connection, args=(backend._shared.get(), taken, 1.0)
        )
        holder.start()
        await loop.run_in_executor(None, taken.wait)
        await asyncio.sleep(0.4)  # the renewal is waiting for the connection now
        gaps, ticking = [], True

        async def tick():
            last = loop.time()
            while ticking:
                await asyncio.sleep(0.01)
                gaps.append(loop.time() - last)
                last = loop.time()

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        await renewed.arelease()  # its own statement waits for the connection, in a thread
        ticking = False
        await ticker
        await loop.run_in_executor(None, holder.join)
        return max(gaps)

    with _registered("renew-loop", database_alias, ASYNC_CONNECTIONS=1) as backend:
        assert asyncio.run(main(backend)) < 0.3


@pytest.mark.parametrize("database_alias", _aliases("postgresql", "sqlite"))
def test_an_async_call_that_finds_every_shared_connection_busy_fails_clearly(
    make_backend, database_alias
):
    """A statement that waits OPERATION_TIMEOUT for one of the ASYNC_CONNECTIONS
    shared connections fails with LockBackendError naming the option, and writes
    nothing; the connections serve again once one is free."""
    backend = make_backend(database_alias, ASYNC_CONNECTIONS=1, OPERATION_TIMEOUT=0.3)
    name = f"async-busy:{_token()}"
    token = _token()
    with backend._shared.get().borrowed(5):  # the one connection, lent to another call
        with pytest.raises(LockBackendError, match=r"ASYNC_CONNECTIONS.*0\.3 s"):
            asyncio.run(backend.aacquire(name, token, 30, OWNER))
    assert backend.get(name) is None
    assert asyncio.run(backend.aacquire(name, token, 30, OWNER)).acquired
    assert asyncio.run(backend.arelease(name, token))


@pytest.mark.no_db
@pytest.mark.parametrize(
    "options, named",
    [
        ({"ASYNC_CONNECTIONS": 0}, "ASYNC_CONNECTIONS"),
        ({"ASYNC_CONNECTIONS": "4"}, "ASYNC_CONNECTIONS"),
        ({"ASYNC_CONNECTIONS": True}, "ASYNC_CONNECTIONS"),
        ({"ASYNC_CONNECTIONS": 2.0}, "ASYNC_CONNECTIONS"),
        ({"OPERATION_TIMEOUT": 0}, "OPERATION_TIMEOUT"),
        ({"OPERATION_TIMEOUT": "5"}, "OPERATION_TIMEOUT"),
        ({"OPERATION_TIMEOUT": float("inf")}, "OPERATION_TIMEOUT"),
        ({"HEALTH_CHECK_AFTER": -1}, "HEALTH_CHECK_AFTER"),
        ({"HEALTH_CHECK_AFTER": True}, "HEALTH_CHECK_AFTER"),
        ({"LOCAL_WAKEUPS": "no"}, "LOCAL_WAKEUPS"),
        ({"SQLITE_WAL": "False"}, "SQLITE_WAL"),  # review r126: switched to WAL for good
        ({"SQLITE_WAL": 0}, "SQLITE_WAL"),
        ({"PREPARED_STATEMENTS": "yes"}, "PREPARED_STATEMENTS"),
        ({"PREPARED_STATEMENTS": 1}, "PREPARED_STATEMENTS"),
        ({"SQLITE_SYNCHRONOUS": "OFF"}, "SQLITE_SYNCHRONOUS"),
        ({"SQLITE_SYNCHRONOUS": 1}, "SQLITE_SYNCHRONOUS"),
    ],
)
def test_bad_connection_options_are_named(options, named):
    from django.core.exceptions import ImproperlyConfigured

    params = {"OPTIONS": {"DATABASE": "default", **options}}
    with pytest.raises(ImproperlyConfigured, match=named):
        DatabaseBackend("bad", params)
    errors = DatabaseBackend.check_params("bad", params)
    assert [e.id for e in errors] == ["django_setnx.E022"] and named in errors[0].msg


#: The largest OPERATION_TIMEOUT (a day) and STALE_RETENTION (10 years) accepted.
LONGEST_OPERATION_TIMEOUT = 86400.0
LONGEST_STALE_RETENTION = 10 * 365 * 86400.0


def _refused_alike(params):
    """``params`` as lock alias "bad": the system check's one error about it, and the
    start of the backend, which must raise ImproperlyConfigured (a configuration
    error, not a LockBackendError: an outage) with the same message. Returns the
    check's error."""
    from django.core import checks
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    bad = {"BACKEND": "django_setnx.backends.database.DatabaseBackend", **params}
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "bad": bad}):
        errors = [
            e
            for e in checks.run_checks(tags=["django_setnx"])
            if e.level >= checks.ERROR and "['bad']" in e.msg
        ]
        with pytest.raises(ImproperlyConfigured) as started:
            locks["bad"]
    assert len(errors) == 1, errors
    assert str(started.value) == errors[0].msg
    return errors[0]


@pytest.mark.no_db
@pytest.mark.parametrize("database_alias", _aliases("postgresql", "mysql", "sqlite"))
@pytest.mark.parametrize("timeout", [LONGEST_OPERATION_TIMEOUT + 0.5, 40000000, 1e10])
def test_an_operation_timeout_past_a_day_is_a_configuration_error(database_alias, timeout):
    """Review D6: an OPERATION_TIMEOUT past what the drivers take (32767 s of TCP
    keepalive on PostgreSQL, 31536000 s of connect_timeout on MySQL) passed the
    check, then every connection failed, as an outage. Now refused by both."""
    error = _refused_alike({"OPTIONS": {"DATABASE": database_alias, "OPERATION_TIMEOUT": timeout}})
    assert error.id == "django_setnx.E022"
    assert "['OPERATION_TIMEOUT']" in error.msg and f"got {timeout!r}" in error.msg
    assert "at most 86400" in error.msg


def test_the_longest_operation_timeout_connects_acquires_and_releases(
    db_alias, name, make_backend
):
    """Review D6: every connection option derived from the largest OPERATION_TIMEOUT
    is within its driver's limits (PostgreSQL's keepalives are capped)."""
    backend = make_backend(db_alias, OPERATION_TIMEOUT=LONGEST_OPERATION_TIMEOUT)
    token = _token()
    assert backend.acquire(name, token, 30, OWNER).acquired
    raw = backend._state().wrapper.connection
    vendor = _vendor(db_alias)
    if vendor == "postgresql":
        parameters = raw.info.get_parameters()
        assert parameters["keepalives_idle"] == "32767"  # Linux's maximum
        assert parameters["keepalives_interval"] == "28800"
        assert parameters["tcp_user_timeout"] == "86400000"
        assert parameters["connect_timeout"] == "86400"
    elif vendor == "mysql":
        assert _sql(
            backend, "SELECT @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout"
        ) == (86400, 86400)
    else:
        assert _sql(backend, "PRAGMA busy_timeout") == (86400000,)
    assert backend.release(name, token) is True


@pytest.mark.no_db
@pytest.mark.parametrize("database", [["default"], ("default",), None, 0, "nope"])
def test_a_database_option_naming_no_database_is_a_configuration_error(database):
    """Review D7: ``["default"]`` crashed the system check (unhashable), None failed
    the first use with a TypeError, and an unknown alias with a LockBackendError."""
    error = _refused_alike({"OPTIONS": {"DATABASE": database}})
    assert error.id == "django_setnx.E020"
    assert "['DATABASE']" in error.msg and repr(database) in error.msg
    assert "'default'" in error.msg  # the configured ones


@pytest.mark.no_db
@pytest.mark.parametrize(
    "database",
    [
        {"ENGINE": "django.db.backends.postgresql", "NAME": "x", "PASSWORD": "hunter2"},
        "postgres://app:hunter2@db.internal/app",
        "host=db password=hunter2 dbname=app",  # a libpq connection string (r161)
    ],
)
def test_a_database_option_pasted_with_a_password_does_not_show_it(database):
    """Review r159: a settings dict or a database URL given as OPTIONS['DATABASE']
    was printed whole, password included, by the check and at first use."""
    error = _refused_alike({"OPTIONS": {"DATABASE": database}})
    assert error.id == "django_setnx.E020"
    assert "hunter2" not in error.msg and "***" in error.msg


def test_the_dummy_database_django_fills_in_is_not_a_database():
    """Review r159: with DATABASES empty, Django fills in a dummy "default", every
    query on which fails: the database backend said "cannot connect" (an outage) on
    every call. It is a configuration error, as for an alias not configured."""
    from django_setnx.backends.database import _database_problem

    dummy = {"default": {"ENGINE": "django.db.backends.dummy"}}
    message = _database_problem("x", "default", dummy)
    assert message is not None and "not in DATABASES (configured: none)" in message


def test_a_database_gone_before_the_first_connection_is_a_configuration_error(
    make_backend, temporary_database, name
):
    """Review D7: the alias left DATABASES after the backend was made: its first
    connection raises ImproperlyConfigured, as the backend's start would have."""
    from django.core.exceptions import ImproperlyConfigured

    with temporary_database("default", "default-gone") as alias:
        backend = make_backend(alias)
    with pytest.raises(
        ImproperlyConfigured, match=r"\['DATABASE'\] is 'default-gone', which is not in DATABASES"
    ):
        backend.owns(name, _token())


@pytest.mark.no_db
@pytest.mark.parametrize("database_alias", _aliases("postgresql", "mysql", "sqlite"))
@pytest.mark.parametrize("retention", [1e300, LONGEST_STALE_RETENTION + 1, 10**20])
def test_a_stale_retention_past_ten_years_is_a_configuration_error(database_alias, retention):
    """Review D8: STALE_RETENTION=1e300 passed the check, then no purge ever ran
    (its milliseconds overflow a 64-bit parameter), with a warning each time."""
    error = _refused_alike({"OPTIONS": {"DATABASE": database_alias, "STALE_RETENTION": retention}})
    assert error.id == "django_setnx.E022"
    assert "['STALE_RETENTION']" in error.msg and f"got {retention!r}" in error.msg


def test_the_longest_stale_retention_purges(db_alias, name, make_backend, caplog):
    """Review D8: with the largest STALE_RETENTION (10 years) the purge runs: a row
    that expired 11 years ago goes, one that expired 9 years ago stays."""
    backend = make_backend(db_alias, STALE_RETENTION=LONGEST_STALE_RETENTION)
    now = int(time.time() * 1000)
    year = 365 * 86400 * 1000
    _insert_row(backend, f"{name}:older", "{}", now - 12 * year, now - 11 * year)
    _insert_row(backend, f"{name}:newer", "{}", now - 10 * year, now - 9 * year)
    token = _token()
    with caplog.at_level(logging.WARNING, logger="django_setnx"):
        assert backend.acquire(name, token, 30, OWNER).acquired  # purges, once due
    assert "Could not purge" not in caplog.text
    assert sorted(i.name for i in backend.list(name_glob=f"{name}:*")) == [f"{name}:newer"]
    assert backend.release(name, token) is True
    _sql(backend, "DELETE FROM {lock} WHERE name = {p}", (f"{name}:newer",))


@pytest.mark.no_db
@pytest.mark.parametrize("key", ["KEY_PREFIX", "LOCATION"])
def test_redis_only_settings_on_a_database_alias_are_reported_as_ignored(key):
    """Review r126: an alias moved from Redis kept KEY_PREFIX, which the database
    backend ignores (two projects sharing a database would share their locks)."""
    params = {key: "project-a", "OPTIONS": {"DATABASE": "default"}}
    errors = DatabaseBackend.check_params("moved", params)
    assert [e.id for e in errors] == ["django_setnx.W022"]
    assert f"'moved'][{key!r}] is ignored" in errors[0].msg
    assert DatabaseBackend.check_params("moved", {"OPTIONS": {"DATABASE": "default"}}) == []


@pytest.mark.no_db
@pytest.mark.parametrize("choice", [True, False, None])
def test_prepared_statements_asked_of_sqlite_are_reported_as_unused(choice):
    """``PREPARED_STATEMENTS: True`` on a database that cannot prepare (SQLite here;
    PostgreSQL through psycopg 2) is a warning of the system check, not silence."""
    options = {"DATABASE": "default"}
    if choice is not None:
        options["PREPARED_STATEMENTS"] = choice
    assert "sqlite" in settings.DATABASES["default"]["ENGINE"]  # always, in tests.settings
    errors = DatabaseBackend.check_params("sqlite-prepared", {"OPTIONS": options})
    if choice is True:
        assert [e.id for e in errors] == ["django_setnx.W020"]
        assert "'sqlite-prepared'" in errors[0].msg and "SQLite" in errors[0].msg
    else:
        assert errors == []


@pytest.mark.no_db
@pytest.mark.parametrize("atomic_requests", [True, False])
def test_an_sqlite_lock_database_with_atomic_requests_is_warned_about(
    monkeypatch, atomic_requests
):
    """Every request's write transaction holds SQLite's one write lock to its commit,
    so with ATOMIC_REQUESTS on the lock database every lock operation of the other
    requests waits for it (W021, with the remedy: a file of its own)."""
    database = {**settings.DATABASES["default"], "ATOMIC_REQUESTS": atomic_requests}
    monkeypatch.setitem(settings.DATABASES, "shared-sqlite", database)
    errors = DatabaseBackend.check_params("app", {"OPTIONS": {"DATABASE": "shared-sqlite"}})
    if atomic_requests:
        assert [e.id for e in errors] == ["django_setnx.W021"]
        assert "'app'" in errors[0].msg and "'shared-sqlite'" in errors[0].msg
        assert "migrate django_setnx --database" in errors[0].hint
    else:
        assert errors == []


@pytest.mark.no_db
def test_a_spatialite_database_is_accepted_by_the_check(monkeypatch):
    """GeoDjango's SpatiaLite engine is SQLite (its wrapper's vendor is "sqlite")."""
    engine = "django.contrib.gis.db.backends.spatialite"
    monkeypatch.setitem(settings.DATABASES, "spatial", {"ENGINE": engine, "NAME": "geo.db"})
    params = {"OPTIONS": {"DATABASE": "spatial"}}
    assert DatabaseBackend.check_params("geo", params) == []
    params["OPTIONS"]["PREPARED_STATEMENTS"] = True
    assert [e.id for e in DatabaseBackend.check_params("geo", params)] == ["django_setnx.W020"]


@needs("default" in _aliases("sqlite"))
def test_prepared_statements_that_the_database_cannot_run_are_logged_once(
    make_backend, name, caplog
):
    """The check cannot tell MySQL from MariaDB (one ENGINE), so the first connection
    says it too, once per backend; the lock works with statements sent as text."""
    backend = make_backend("default", PREPARED_STATEMENTS=True)
    with caplog.at_level(logging.WARNING, logger="django_setnx"):
        for _ in range(2):
            token = _token()
            assert backend.acquire(name, token, 30, OWNER).acquired
            assert backend.release(name, token)
    said = [r.getMessage() for r in caplog.records if "PREPARED_STATEMENTS" in r.getMessage()]
    assert len(said) == 1 and backend.alias in said[0] and "sqlite" in said[0].lower(), said


# -- 6. bad input, unreadable rows --------------------------------------------------------------


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), "5", True, 10**12])
def test_a_bad_ttl_writes_nothing(db_alias, name, ttl):
    backend = locks[db_alias]
    with pytest.raises((TypeError, ValueError)):
        backend.acquire(name, _token(), ttl, OWNER)
    assert backend.get(name) is None
    assert _sql(
        backend, f"SELECT COUNT(*) FROM {database.LOCK_TABLE} WHERE name = {{p}}", (name,)
    ) == (0,)
    token = _token()
    assert backend.acquire(name, token, 30, OWNER).acquired
    expires = backend.get(name).expires_at_ms
    with pytest.raises((TypeError, ValueError)):
        backend.extend(name, token, ttl)
    assert backend.get(name).expires_at_ms == expires
    backend.release(name, token)


def _insert_row(backend, name, owner, acquired_at, expires_at):
    _sql(
        backend,
        "INSERT INTO {lock} (name, token, owner, acquired_at, expires_at, fencing, "
        "next_token, next_since, next_seen) VALUES ({p}, {p}, {p}, {p}, {p}, 0, '', 0, 0)",
        (name, _token(), owner, acquired_at, expires_at),
    )


def test_unreadable_rows_are_listed_and_cleared(db_alias, name):
    backend = locks[db_alias]
    now = int(time.time() * 1000)
    hour = 3600 * 1000
    _insert_row(backend, f"{name}:text-owner", "not json", now, now + hour)
    _insert_row(backend, f"{name}:list-owner", "[1, 2]", now, now + hour)
    _insert_row(backend, f"{name}:far-future", "{}", now, 10**17)
    _insert_row(backend, f"{name}:far-past", "{}", now, -(2**62))
    unreadable = [f"{name}:far-future", f"{name}:far-past"]
    if _vendor(db_alias) == "sqlite":  # columns are not typed: anything can be stored
        _insert_row(backend, f"{name}:text-expiry", "{}", now, "soon")
        unreadable.append(f"{name}:text-expiry")

    infos = {i.name: i for i in backend.list(name_glob=f"{name}:*")}
    assert sorted(infos) == sorted([f"{name}:text-owner", f"{name}:list-owner", *unreadable])
    for info in infos.values():
        info.as_dict()  # what listlocks --json prints
        again = backend.get(info.name)
        assert (again.state, again.owner, again.fencing_token) == (
            info.state,
            info.owner,
            info.fencing_token,
        )
    # A bad owner is kept as text; the times still say the lock is held.
    assert infos[f"{name}:text-owner"].owner == {"unreadable": repr("not json")}
    assert infos[f"{name}:list-owner"].is_held
    # Absurd times: listed as stale, and removed by a plain clear (no --all).
    assert all(infos[n].is_stale for n in unreadable)
    assert sorted(i.name for i in backend.list(state="stale", name_glob=f"{name}:*")) == sorted(
        unreadable
    )
    assert sorted(backend.clear(name_glob=f"{name}:*").names) == sorted(unreadable)
    assert sorted(backend.clear(name_glob=f"{name}:*", include_held=True).names) == sorted(
        [f"{name}:text-owner", f"{name}:list-owner"]
    )
    assert list(backend.list(name_glob=f"{name}:*")) == []


# -- 7. globs -----------------------------------------------------------------------------------


def test_hostile_globs_match_in_linear_time(db_alias, name):
    backend = locks[db_alias]
    heads = [f"{name}:" + "ab" * 70 + f"{i:03d}" for i in range(20)]
    names = [head + "x" * (200 - len(head)) for head in heads]
    tokens = {n: _token() for n in names}
    for n in names:
        assert backend.acquire(n, tokens[n], 30, OWNER).acquired
    assert all(len(n) == 200 for n in names)
    for pattern in ["*?*?*?*?*?*?*?*?#", "*a*a*a*a*a*a*a*a*a*a*a*c", f"{name}*?*?*?*?*?*?*?*?#"]:
        assert list(backend.list(name_glob=pattern)) == []
        assert backend.clear(include_held=True, name_glob=pattern).names == []
    everything = f"{name}*?*?*?*?*?*?*?*?x"
    assert sorted(i.name for i in backend.list(name_glob=everything)) == sorted(names)
    assert sorted(backend.clear(include_held=True, name_glob=everything).names) == sorted(names)


def test_the_glob_prefix_is_matched_exactly(db_alias, name):
    """The SQL prefilter by literal prefix may never drop or add a name: not by case
    (MySQL's and SQLite's LIKE ignore it), trailing spaces, or LIKE's own wildcards."""
    backend = locks[db_alias]
    suffixes = [
        "Report:1",
        "report:1",
        "REPORT:1",
        "Report:1 ",
        "Rep%rt:1",
        "Rep_rt:1",
        "Rep\\rt:1",
        "Repo",
    ]
    names = [f"{name}:{s}" for s in suffixes]
    for n in names:
        assert backend.acquire(n, _token(), 30, OWNER).acquired

    def listed(pattern):
        return sorted(i.name[len(name) + 1 :] for i in backend.list(name_glob=f"{name}:{pattern}"))

    assert listed("Report*") == ["Report:1", "Report:1 "]
    assert listed("Report:1") == ["Report:1"]
    assert listed("Rep%rt*") == ["Rep%rt:1"]
    assert listed("Rep_rt:?") == ["Rep_rt:1"]
    assert listed("Rep\\\\rt*") == ["Rep\\rt:1"]
    assert listed("report:?") == ["report:1"]
    assert listed("Rep?rt:1") == ["Rep%rt:1", "Rep\\rt:1", "Rep_rt:1", "Report:1"]
    assert listed("Repo") == ["Repo"]
    removed = backend.clear(include_held=True, name_glob=f"{name}:Report*").names
    assert sorted(removed) == [f"{name}:Report:1", f"{name}:Report:1 "]
    assert len(list(backend.list(name_glob=f"{name}:*"))) == len(names) - 2


# -- 8. SQLite inside the caller's write transaction ------------------------------------------


def test_sqlite_inside_a_write_transaction_says_what_to_do(name, make_backend):
    backend = make_backend("default", OPERATION_TIMEOUT=0.5)

    def write_then_lock():
        try:
            with transaction.atomic(using="default"):
                LockRecord.objects.using("default").create(
                    name=f"{name}:row", token="t", acquired_at=0, expires_at=0
                )
                backend.acquire(name, _token(), 30, OWNER)
        finally:
            connections["default"].close()

    with pytest.raises(LockBackendError) as caught:
        _in_thread(write_then_lock)
    message = str(caught.value)
    assert "database is locked" in message
    assert "inside a transaction" in message
    assert "Take the lock before the transaction writes" in message
    assert "release it after the commit" in message


@needs("default" in _aliases("sqlite"))
@pytest.mark.parametrize("choice, expected", [(None, 1), ("FULL", 2), ("extra", 3)])
def test_sqlite_lock_connection_commits_without_an_fsync_unless_told(
    make_backend, name, choice, expected
):
    """In WAL mode our own connection commits with ``synchronous=NORMAL`` (1) unless
    ``OPTIONS["SQLITE_SYNCHRONOUS"]`` says otherwise; Django's connections keep
    their own setting (FULL, 2, by default)."""
    options = {} if choice is None else {"SQLITE_SYNCHRONOUS": choice}
    backend = make_backend("default", **options)
    assert backend.acquire(name, "tok", 30, OWNER).acquired
    raw = _raw_connection(backend)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA synchronous").fetchone()[0] == expected
    with connections["default"].cursor() as cursor:
        cursor.execute("PRAGMA synchronous")
        assert cursor.fetchone()[0] == 2
    assert backend.release(name, "tok")


@needs("default" in _aliases("sqlite"))
@pytest.mark.autocommit
def test_a_new_sqlite_database_written_by_the_callers_transaction_says_why(
    name, tmp_path, temporary_database, make_backend
):
    """A database file not yet in WAL mode cannot switch while another connection
    writes (here the caller's own open transaction). The lock connection then waits
    for the write lock like any statement and names the single writer that holds
    it, instead of failing at once with "cannot connect ... database is locked"."""
    with temporary_database("default", "sqlite-fresh", NAME=str(tmp_path / "fresh.db")) as alias:
        with connections[alias].schema_editor() as editor:
            editor.create_model(LockRecord)
        with connections[alias].cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            assert cursor.fetchone()[0] != "wal"  # as Django leaves a new database
        backend = make_backend(alias, OPERATION_TIMEOUT=1)
        with transaction.atomic(using=alias):
            LockRecord.objects.using(alias).create(
                name=f"{name}:other", token="t", acquired_at=0, expires_at=0
            )
            with pytest.raises(LockBackendError, match="single writer") as raised:
                backend.acquire(name, _token(), 30, OWNER)
        assert "cannot connect" not in str(raised.value)
        with transaction.atomic(using=alias):
            # Until the switch, a transaction that has read blocks the writer too;
            # the switch, tried again first, must not add its own wait to
            # OPERATION_TIMEOUT (the statement waits that long already).
            list(LockRecord.objects.using(alias).all())
            started = time.monotonic()
            with pytest.raises(LockBackendError, match="single writer"):
                backend.acquire(name, _token(), 30, OWNER)
            assert time.monotonic() - started < 1.8, "waited twice OPERATION_TIMEOUT"
        # Committed: the same lock connection switches the database now. (Left in the
        # rollback journal mode, a transaction that only reads would block it.)
        token = _token()
        assert backend.acquire(name, token, 30, OWNER).acquired
        assert backend.release(name, token)
        raw = _raw_connection(backend)
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        with transaction.atomic(using=alias):
            list(LockRecord.objects.using(alias).all())  # a read: SQLite's shared lock
            token = _token()
            assert backend.acquire(name, token, 30, OWNER).acquired
            assert backend.release(name, token)


@pytest.mark.no_db
@pytest.mark.parametrize(
    "choice, init_command, expected",
    [
        (None, "", "NORMAL"),
        (None, "PRAGMA synchronous=EXTRA", None),  # the project chose: kept
        (None, "PRAGMA foreign_keys=ON; pragma SYNCHRONOUS = full", None),
        ("FULL", "PRAGMA synchronous=EXTRA", "FULL"),  # ours, asked for explicitly
    ],
)
def test_a_synchronous_set_by_the_databases_init_command_is_kept(choice, init_command, expected):
    wrapper = types.SimpleNamespace(settings_dict={"OPTIONS": {"init_command": init_command}})
    assert database._sqlite_synchronous(choice, wrapper) == expected


def test_a_deeply_nested_owner_is_unreadable_not_a_crash(db_alias, name):
    backend = locks[db_alias]
    now = int(time.time() * 1000)
    _insert_row(backend, name, "[" * 100_000 + "]" * 100_000, now, now + 3_600_000)
    info = backend.get(name)
    assert info.is_held and "unreadable" in info.owner
    assert [i.name for i in backend.list(name_glob=name)] == [name]
    assert backend.clear(name_glob=name, include_held=True).names == [name]


@pytest.mark.parametrize(
    "acquired_at, expires_at",
    [
        ("now", 10**17),  # an expiry in the year 3 170 000
        (-5, "hour"),  # acquired before 1970
        (10**17, "hour"),  # acquired in the far future
    ],
    ids=["expires-far-future", "acquired-before-1970", "acquired-far-future"],
)
def test_an_implausible_row_never_blocks_an_acquire(db_alias, name, acquired_at, expires_at):
    """Rows no backend could have written are listed as stale: an acquire takes them
    over as it takes a stale row (it used to wait for the year 3 170 000)."""
    backend = locks[db_alias]
    now = int(time.time() * 1000)
    values = {"now": now, "hour": now + 3_600_000}
    _insert_row(
        backend,
        name,
        "{}",
        values.get(acquired_at, acquired_at),
        values.get(expires_at, expires_at),
    )
    assert backend.get(name).is_stale
    token = _token()
    result = backend.acquire(name, token, 30, OWNER)
    assert result.acquired
    assert backend.get(name).owner == OWNER
    assert backend.release(name, token)


def _flushed(backend, operation):
    """Run ``operation`` (calls on ``backend``) inside a transaction of the backend's
    own connection; returns what it returned, and whether its statements left the
    transaction to wait for the WAL flush at its commit (``synchronous_commit`` as
    they left it: PG_NO_FLUSH sets it to off for the transaction)."""
    _sql(backend, "BEGIN")
    try:
        result = operation()
        (setting,) = _sql(backend, "SELECT current_setting('synchronous_commit')")
    finally:
        _sql(backend, "COMMIT")
    return result, setting == "on"


@needs(POSTGRES)
def test_postgres_flushes_only_the_commits_that_give_or_keep_a_lock(name, make_backend):
    """A winning acquire, an extend, and an attempt that finds its own token (an
    earlier attempt took the lock and lost its answer: this one reports the win)
    must survive a database crash, else the lock, or its fencing token, could go to
    a second client; a release, a refused attempt (it locks the row, so it commits)
    and a place in line cost only liveness if lost, and do not wait for an fsync."""
    backend, other = make_backend("postgres"), make_backend("postgres")
    for each in (backend, other):
        # Not now: the purge is a statement (a transaction, in autocommit) of its own
        # that does not flush; inside the test's transaction it would look like ours.
        each._next_purge = float("inf")
    token, waiter = _token(), _token()
    flushed = {}
    won, flushed["won"] = _flushed(backend, lambda: backend.acquire(name, token, 30, OWNER))
    assert won.acquired
    again, flushed["own token"] = _flushed(
        backend, lambda: backend.acquire(name, token, 30, OWNER)
    )
    assert again.acquired and again.fencing_token == won.fencing_token
    refused, flushed["refused"] = _flushed(other, lambda: other.acquire(name, _token(), 30, OWNER))
    assert not refused.acquired
    assert _flushed(backend, lambda: backend.extend(name, token, 30)) == (True, True)
    queued, flushed["queued"] = _flushed(
        other, lambda: other.acquire(name, waiter, 30, OWNER, wait=None)
    )
    assert not queued.acquired and other._waiting[waiter].head
    assert _flushed(backend, lambda: backend.release(name, token)) == (True, False)
    taken, flushed["taken over"] = _flushed(
        other, lambda: other.acquire(name, waiter, 30, OWNER, wait=None)
    )
    assert taken.acquired and taken.fencing_token > won.fencing_token
    assert _flushed(other, lambda: other.release(name, waiter)) == (True, False)
    assert flushed == {
        "won": True,
        "own token": True,
        "refused": False,
        "queued": False,
        "taken over": True,
    }
    # The choice ends with each statement's transaction: the sessions still flush.
    assert _sql(backend, "SHOW synchronous_commit") == ("on",)
    assert _sql(other, "SHOW synchronous_commit") == ("on",)


@needs(POSTGRES)
@pytest.mark.parametrize("choice, prepared", [(True, True), (False, False), (None, False)])
def test_prepared_statements_are_prepared_when_asked(choice, prepared, name, make_backend):
    """``PREPARED_STATEMENTS=True`` prepares the lock statements on the server (Django
    opens psycopg 3 connections with ``prepare_threshold=None``, which made psycopg
    ignore the request); off, or unset with Django's default, nothing is."""
    options = {} if choice is None else {"PREPARED_STATEMENTS": choice}
    backend = make_backend("postgres", **options)
    for _ in range(3):
        token = _token()
        assert backend.acquire(name, token, 30, OWNER).acquired
        assert backend.extend(name, token, 30)
        assert backend.release(name, token)
    (count,) = _sql(backend, "SELECT count(*) FROM pg_prepared_statements")
    assert (count >= 3) is prepared, count


# -- PostgreSQL: the hot statements through the migrations' functions ------------------


def _functions_of():
    """This version's functions on PostgreSQL (acquire and release first)."""
    from django_setnx.backends.db_functions import functions
    from django_setnx.backends.db_sql import Dialect

    return functions(Dialect("postgresql", connections["postgres"].ops.quote_name, False))


def _admin_wrapper(make_backend):
    """A Django connection in autocommit (a lock backend's own) on the PostgreSQL test
    database, for DDL the backends see at once."""
    admin = make_backend("postgres", PREPARED_STATEMENTS=False)
    _sql(admin, "SELECT 1")
    return admin._state().wrapper


@needs(POSTGRES)
def test_the_latest_functions_migration_lists_this_versions_functions():
    """The functions are named after their SQL: a change to the acquire or release
    statement needs a migration that makes the new ones (and lists them), or every
    database migrated before would keep sending the statements as text."""
    import sys

    from django.db.migrations.loader import MigrationLoader

    from django_setnx.backends.db_functions import installed_names

    loader = MigrationLoader(None, ignore_no_migrations=True)
    listed = [
        sys.modules[type(migration).__module__].FUNCTIONS
        for (app, _), migration in sorted(loader.disk_migrations.items())
        if app == "django_setnx" and hasattr(sys.modules[type(migration).__module__], "FUNCTIONS")
    ]
    connection = connections["postgres"]
    current = [f.name for f in _functions_of()]
    assert listed and list(listed[-1]) == current, (
        f"the functions' SQL changed: add a migration that runs create_functions and "
        f"lists FUNCTIONS = {tuple(current)}"
    )
    # Migration 0004 is never edited (databases migrated to it would keep its
    # functions): a change of SQL is a new migration.
    assert listed[0] == (
        "django_setnx_acquire_5317debb154b",
        "django_setnx_release_0081650d1a1f",
        "django_setnx_acquire_queued_3f11ff319314",
        "django_setnx_release_any_fee765d7ae5f",
        "django_setnx_queue_and_holder_b2a7481ea7c7",
    )
    assert installed_names(connection) == sorted(current)


@needs(POSTGRES)
def test_postgres_runs_acquire_and_release_through_the_functions(name, make_backend):
    """Without prepared statements, a connection that finds the functions calls them
    (the server then plans the statements once per session): with a function that
    refuses to run in its place, its operation fails."""
    acquire, release = _functions_of()[:2]
    backend = make_backend("postgres")
    first = _acquire_extend_release(backend, name, times=2)
    assert backend._state().functions is not None
    wrapper = _admin_wrapper(make_backend)
    token = _token()
    with _refusing(wrapper, acquire):
        with pytest.raises(LockBackendError, match=f"{acquire.name} called"):
            backend.acquire(name, token, 30, OWNER)
    assert backend.acquire(name, token, 30, OWNER).fencing_token > first[-1]
    with _refusing(wrapper, release):
        with pytest.raises(LockBackendError, match=f"{release.name} called"):
            backend.release(name, token)
    assert backend.release(name, token)
    assert backend._state().functions is not None


@contextlib.contextmanager
def _refusing(wrapper, function):
    """``function`` replaced by one that raises "<its name> called", while inside."""
    from django_setnx.backends.db_functions import create_functions

    with wrapper.cursor() as cursor:
        cursor.execute(
            f"CREATE OR REPLACE FUNCTION {function.signature} RETURNS {function.returns} "
            f"LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION '{function.name} called'; END $$"
        )
    try:
        yield
    finally:
        create_functions(wrapper)


@needs(POSTGRES)
def test_postgres_queues_and_hands_over_through_the_functions(name, make_backend):
    """The statements of a contended acquire and release go through their functions
    too: a refused caller queues, takes the lock when it is left to it, and the
    holder's release leaves it to that waiter."""
    _, _, acquire_queued, release_any, queue_and_holder = _functions_of()
    wrapper = _admin_wrapper(make_backend)
    holder, waiter = make_backend("postgres"), make_backend("postgres")
    for backend in (holder, waiter):  # connected, and found the functions
        _acquire_extend_release(backend, f"{name}:warm", times=1)
        assert backend._state().functions is not None
    held = _token()
    assert holder.acquire(name, held, 30, OWNER).acquired
    with _refusing(wrapper, queue_and_holder):
        with pytest.raises(LockBackendError, match=f"{queue_and_holder.name} called"):
            waiter.acquire(name, _token(), 30, OWNER, wait=5)
    waiting = _token()
    assert not waiter.acquire(name, waiting, 30, OWNER, wait=5).acquired  # queued
    with _refusing(wrapper, release_any):
        with pytest.raises(LockBackendError, match=f"{release_any.name} called"):
            holder.release(name, held)
    assert holder.release(name, held)  # left to the waiter
    with _refusing(wrapper, acquire_queued):
        with pytest.raises(LockBackendError, match=f"{acquire_queued.name} called"):
            waiter.acquire(name, waiting, 30, OWNER, wait=5)
    won = waiter.acquire(name, waiting, 30, OWNER, wait=5)
    assert won.acquired
    assert waiter.release(name, waiting)


@needs(POSTGRES)
def test_async_callers_run_through_the_functions_on_their_shared_connections(name, make_backend):
    """The connections async callers share (ASYNC_CONNECTIONS) each look for the
    functions as a thread's own does, and call them: with the acquire's replaced by
    one that refuses to run, an ``aacquire`` fails."""
    acquire = _functions_of()[0]
    backend = make_backend("postgres")

    async def cycle(token):
        assert (await backend.aacquire(name, token, 30, OWNER)).acquired
        assert await backend.arelease(name, token)

    asyncio.run(cycle(_token()))
    shared = backend._shared.get()._idle
    assert len(shared) == 1 and shared[0].functions is not None
    with _refusing(_admin_wrapper(make_backend), acquire):
        with pytest.raises(LockBackendError, match=f"{acquire.name} called"):
            asyncio.run(cycle(_token()))
    asyncio.run(cycle(_token()))


@needs(POSTGRES)
@pytest.mark.parametrize(
    "fork", [os.fork, workers.fork_without_hooks], ids=["os.fork", "no-fork-hooks"]
)
def test_a_forked_child_finds_the_functions_on_connections_of_its_own(name, make_backend, fork):
    """A child forked after its parent found the functions (gunicorn ``--preload``,
    Celery prefork), with or without fork hooks, looks for them again on a
    connection of its own, finds them and calls them; the parent carries on with
    its own."""
    backend = make_backend("postgres")
    _acquire_extend_release(backend, name, times=1)
    parents = backend._state()
    assert parents.functions is not None
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:  # the child: never return into pytest
        outcome = b"E"
        try:
            _acquire_extend_release(backend, f"{name}:child", times=1)
            state = backend._state()
            outcome = b"1" if state is not parents and state.functions is not None else b"0"
            backend.close()  # the child's own connection: the parent's stays open
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.close(write_end)
    workers.reap(pid, HANG)
    assert os.read(read_end, 1) == b"1"
    os.close(read_end)
    assert backend._state() is parents
    _acquire_extend_release(backend, name, times=1)


@needs(POSTGRES)
@pytest.mark.parametrize("mode", ["functions", "text", "prepared"])
def test_postgres_hands_over_alike_through_functions_text_and_prepared_statements(
    mode, name, make_backend
):
    """The functions run the statements the backend otherwise sends as text (or
    prepared): a holder, a queued waiter, a release that leaves it the lock, a
    takeover by the waiter, each with the same outcome and a larger fencing token."""
    options = {"PREPARED_STATEMENTS": True} if mode == "prepared" else {}
    holder, waiter = make_backend("postgres", **options), make_backend("postgres", **options)
    for backend in (holder, waiter):
        _sql(backend, "SELECT 1")
        if mode == "text":  # as a connection that found none a moment ago
            backend._state().functions_checked_at = time.monotonic()
    held, waiting = _token(), _token()
    first = holder.acquire(name, held, 30, OWNER)
    refused = waiter.acquire(name, waiting, 30, OWNER, wait=5)
    assert not refused.acquired and 29 < refused.retry_after <= 30
    assert _sql(holder, "SELECT next_token FROM {lock} WHERE name = %s", (name,)) == (waiting,)
    assert holder.release(name, held)
    assert not holder.acquire(name, _token(), 30, OWNER).acquired  # left to the waiter
    won = waiter.acquire(name, waiting, 30, OWNER, wait=5)
    assert won.acquired and won.fencing_token > first.fencing_token
    assert waiter.release(name, waiting)
    assert not waiter.release(name, waiting)
    assert (waiter._state().functions is not None) is (mode == "functions")


@needs(POSTGRES)
def test_a_connection_whose_functions_were_dropped_sends_the_statements_as_text(
    name, make_backend, caplog
):
    """Another version's migration (a rolling deploy) or a reversed one may drop the
    functions under a running process: its next call fails before anything ran, and
    the connection goes back to the statements, with one warning. A connection made
    while they are missing sends text from the start; one made after migrate calls
    them again."""
    from django_setnx.backends.db_functions import create_functions, drop_functions

    backend = make_backend("postgres")
    first = _acquire_extend_release(backend, name, times=1)
    assert backend._state().functions is not None
    wrapper = _admin_wrapper(make_backend)
    try:
        drop_functions(wrapper)
        with caplog.at_level(logging.WARNING, logger="django_setnx"):
            tokens = _acquire_extend_release(backend, name, times=2)
        assert tokens[0] > first[-1]
        assert backend._state().functions is None
        warned = [r.getMessage() for r in caplog.records if "cannot be called" in r.getMessage()]
        assert len(warned) == 1, warned
        fresh = make_backend("postgres")
        _acquire_extend_release(fresh, name, times=1)
        assert fresh._state().functions is None
    finally:
        create_functions(wrapper)
    again = make_backend("postgres")
    _acquire_extend_release(again, name, times=1)
    assert again._state().functions is not None


@needs(POSTGRES)
def test_another_versions_functions_are_never_called_and_migrating_replaces_them(
    name, make_backend
):
    """A database migrated by another version has functions of other SQL under other
    names: this version sends text there, and its migration drops them."""
    from django_setnx.backends.db_functions import (
        create_functions,
        drop_functions,
        installed_names,
    )

    wrapper = _admin_wrapper(make_backend)
    other = "django_setnx_acquire_000000000000"
    try:
        drop_functions(wrapper)
        with wrapper.cursor() as cursor:
            cursor.execute(
                f"CREATE FUNCTION {other}(text, text, text, bigint) RETURNS SETOF bigint "
                "LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'another version'; END $$"
            )
        backend = make_backend("postgres")
        _acquire_extend_release(backend, name, times=2)
        assert backend._state().functions is None
        create_functions(wrapper)
        assert installed_names(wrapper) == sorted(f.name for f in _functions_of())
    finally:
        create_functions(wrapper)


@contextlib.contextmanager
def _throwaway_role(wrapper, privileges):
    """A login role, granted ``privileges`` on the lock table, dropped at the end."""
    role = f"setnx_role_{secrets.token_hex(4)}"
    table = LockRecord._meta.db_table
    with wrapper.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role} LOGIN")
        cursor.execute(f"GRANT {privileges} ON {table} TO {role}")
    try:
        yield role
    finally:
        with wrapper.cursor() as cursor:
            cursor.execute(f"REVOKE ALL ON {table} FROM {role}")
            cursor.execute(f"DROP ROLE {role}")


@needs(POSTGRES)
def test_execute_revoked_under_a_connection_sends_the_statements_as_text(
    name, make_backend, temporary_database, caplog
):
    """Functions are executable by anyone unless the schema's default privileges say
    otherwise. EXECUTE revoked from the lock role while it runs: its next call is
    refused before anything ran, and it is sent as text (no operation fails); a
    connection made then finds them unexecutable and sends text from the start."""
    wrapper = _admin_wrapper(make_backend)
    every = _functions_of()
    try:
        with (
            _throwaway_role(wrapper, "ALL") as role,
            temporary_database("postgres", "limited", USER=role),
        ):
            backend = make_backend("limited")
            first = _acquire_extend_release(backend, name, times=1)
            assert backend._state().functions is not None
            token = _token()
            assert backend.acquire(name, token, 30, OWNER).acquired
            with wrapper.cursor() as cursor:
                for function in every:
                    cursor.execute(f"REVOKE EXECUTE ON FUNCTION {function.signature} FROM PUBLIC")
            with caplog.at_level(logging.WARNING, logger="django_setnx"):
                assert backend.release(name, token)
            assert "permission denied" in caplog.text
            assert backend._state().functions is None
            assert _acquire_extend_release(backend, name, times=1)[0] > first[0]
            fresh = make_backend("limited")
            _acquire_extend_release(fresh, name, times=1)
            assert fresh._state().functions is None
            for made in (backend, fresh):
                made.close()
    finally:
        with wrapper.cursor() as cursor:
            for function in every:
                cursor.execute(f"GRANT EXECUTE ON FUNCTION {function.signature} TO PUBLIC")


@needs(POSTGRES)
def test_the_statements_own_errors_are_raised_and_a_failed_look_sends_text(
    name, make_backend, temporary_database, caplog, monkeypatch
):
    """A permission error of the statement inside a function (the role may read the
    lock table but not write it) is the operation's error, as it would be as text:
    not taken for a function that cannot be called. And a look for the functions
    that the server refuses (the catalog unreadable to the role) leaves the
    connection on text, with one warning, instead of failing its operation."""
    from django_setnx.backends import db_functions

    wrapper = _admin_wrapper(make_backend)
    with _throwaway_role(wrapper, "SELECT") as role:
        with temporary_database("postgres", "readonly", USER=role):
            backend = make_backend("readonly")
            with caplog.at_level(logging.INFO, logger="django_setnx"):
                with pytest.raises(LockBackendError, match="permission denied for table"):
                    backend.acquire(name, _token(), 30, OWNER)
                assert "cannot be called" not in caplog.text
                assert backend.owns(name, _token()) is False  # reconnected
                with pytest.raises(LockBackendError, match="permission denied for table"):
                    backend.acquire(name, _token(), 30, OWNER)
                assert backend._state().functions is not None
                assert "cannot be called" not in caplog.text
                with wrapper.cursor() as cursor:
                    cursor.execute(f"GRANT ALL ON {LockRecord._meta.db_table} TO {role}")
                    cursor.execute("REVOKE SELECT ON pg_catalog.pg_proc FROM PUBLIC")
                try:
                    refused = make_backend("readonly")
                    _acquire_extend_release(refused, name, times=2)
                    assert refused._state().functions is None
                    monkeypatch.setattr(db_functions, "RECHECK_EVERY", 0)
                    _acquire_extend_release(refused, name, times=2)  # looks each time
                    assert caplog.text.count("Could not look for") == 1, "warned again"
                finally:
                    with wrapper.cursor() as cursor:
                        cursor.execute("GRANT SELECT ON pg_catalog.pg_proc TO PUBLIC")
            for made in (backend, refused):
                made.close()


@needs(POSTGRES)
def test_an_overload_or_a_replaced_body_is_never_called(name, make_backend, temporary_database):
    """A function that a call could resolve to instead of ours is never called: an
    overload beside ours (an int4 ttl, what a Python int is sent as) makes the
    connection send text; one with an extra defaulted parameter in a schema earlier
    on the search_path is passed by (the calls name the schema of ours); and a
    function of this version's name with another body (by hand) is not used."""
    acquire = _functions_of()[0]
    wrapper = _admin_wrapper(make_backend)
    schema = f"setnx_early_{secrets.token_hex(4)}"
    beside = f"{acquire.name}(text, text, text, integer)"
    earlier = f"{schema}.{acquire.name}(text, text, text, bigint, extra integer DEFAULT 0)"
    with wrapper.cursor() as cursor:
        cursor.execute(f"CREATE SCHEMA {schema}")
        for overload in (beside, earlier):
            cursor.execute(
                f"CREATE FUNCTION {overload} RETURNS SETOF bigint LANGUAGE plpgsql "
                "AS $$ BEGIN RETURN NEXT 42; END $$"
            )
    try:
        backend = make_backend("postgres")
        tokens = _acquire_extend_release(backend, name, times=2)
        assert backend._state().functions is None
        assert 42 not in tokens
        with wrapper.cursor() as cursor:
            cursor.execute(f"DROP FUNCTION {beside}")
        with temporary_database(
            "postgres", "early", OPTIONS={"options": f"-c search_path={schema},public"}
        ):
            searching = make_backend("early")
            tokens = _acquire_extend_release(searching, name, times=2)
            assert searching._state().functions is not None
            assert 42 not in tokens
            searching.close()
    finally:
        with wrapper.cursor() as cursor:
            cursor.execute(f"DROP FUNCTION IF EXISTS {beside}")
            cursor.execute(f"DROP SCHEMA {schema} CASCADE")
    with _refusing(wrapper, acquire):
        replaced = make_backend("postgres")
        _acquire_extend_release(replaced, name, times=2)  # as text: never raised
        assert replaced._state().functions is None


@needs(POSTGRES)
def test_a_connection_that_found_no_functions_looks_again_later(name, make_backend, monkeypatch):
    """A process started before ``migrate`` made the functions picks them up at its
    next check (every RECHECK_EVERY seconds while it finds none); a connection that
    only extends (a renewal's) never looks."""
    from django_setnx.backends import db_functions

    wrapper = _admin_wrapper(make_backend)
    try:
        db_functions.drop_functions(wrapper)
        backend = make_backend("postgres")
        _acquire_extend_release(backend, name, times=1)
        assert backend._state().functions is None
        db_functions.create_functions(wrapper)
        _acquire_extend_release(backend, name, times=1)
        assert backend._state().functions is None, "looked again before RECHECK_EVERY"
        monkeypatch.setattr(db_functions, "RECHECK_EVERY", 0)
        _acquire_extend_release(backend, name, times=1)
        assert backend._state().functions is not None
    finally:
        db_functions.create_functions(wrapper)
    renewer = make_backend("postgres")
    assert renewer.extend(name, _token(), 30) is False
    assert renewer._state().functions_checked_at is None


@needs(SERVER_ALIASES)
@pytest.mark.parametrize("server_alias", SERVER_ALIASES)
def test_a_clear_stuck_behind_a_row_lock_says_so(server_alias, name, make_backend):
    """Review r163: a clear batch that waits on another session's row lock past
    OPERATION_TIMEOUT reports that wait, not the ROLLBACK's failure on the
    connection the timeout closed ("the connection is closed", on PostgreSQL),
    changes nothing, and the next clear works."""
    backend = make_backend(server_alias, OPERATION_TIMEOUT=1)
    blocker = make_backend(server_alias)
    assert backend.acquire(name, _token(), 30, OWNER).acquired
    _sql(blocker, "START TRANSACTION")
    _sql(blocker, "SELECT name FROM {lock} WHERE name = {p} FOR UPDATE", (name,))
    try:
        with pytest.raises(LockBackendError) as raised:
            backend.clear(include_held=True, name_glob=name)
    finally:
        _sql(blocker, "COMMIT")
    assert "connection is closed" not in str(raised.value)
    assert re.search(r"no answer from the server|[Ll]ock wait timeout", str(raised.value))
    assert backend.get(name) is not None, "nothing changed"
    assert backend.clear(include_held=True, name_glob=name).names == [name]


MYSQL_ALIASES = _aliases("mysql")


@needs(MYSQL_ALIASES)
def test_mysql_clear_changes_only_the_rows_it_locked_and_reports(name, make_backend, monkeypatch):
    """Review r162: on MySQL/MariaDB clear locks its rows (SELECT ... FOR UPDATE),
    then tombstones or deletes them. Under READ COMMITTED a row inserted after that
    SELECT (its name's row was gone: purged, or deleted by another clear) is not
    locked; the statements must leave it alone, not tombstone a lock that clear
    never reported."""
    backend, other = make_backend(MYSQL_ALIASES[0]), make_backend(MYSQL_ALIASES[0])
    assert backend.acquire(name, _token(), 30, OWNER).acquired
    late = _token()

    def a_new_lock_right_after_the_select(statement):
        if statement.endswith("FOR UPDATE"):
            # Gone before clear's SELECT (purged), taken again after it.
            _sql(other, "DELETE FROM {lock} WHERE name = {p}", (name,))
            seen_by_the_select.append(True)
        elif seen_by_the_select and not taken:
            taken.append(other.acquire(name, late, 30, OWNER).acquired)

    seen_by_the_select, taken = [], []
    before_statements(monkeypatch, backend, "clear", a_new_lock_right_after_the_select)
    assert backend.clear(include_held=True, name_glob=name).names == []
    monkeypatch.undo()
    assert taken == [True]
    assert other.owns(name, late), "a lock clear did not report was tombstoned"


def _executed_prepared(backend):
    """How many statements the backend's MariaDB connection ran through EXECUTE."""
    (_, count) = _sql(backend, "SHOW SESSION STATUS LIKE 'Com_execute_sql'")
    return int(count)


def _acquire_extend_release(backend, name, times=3):
    """Lock, extend and release ``name`` ``times`` times; the fencing tokens given."""
    tokens = []
    for _ in range(times):
        token = _token()
        won = backend.acquire(name, token, 30, OWNER)
        assert won.acquired
        tokens.append(won.fencing_token)
        assert backend.extend(name, token, 30)
        assert backend.owns(name, token)
        assert backend.release(name, token)
    assert tokens == sorted(set(tokens)), tokens  # strictly increasing
    return tokens


@needs(MYSQL_ALIASES)
@pytest.mark.parametrize("choice, prepared", [(None, True), (True, True), (False, False)])
def test_mariadb_runs_the_lock_statements_prepared_unless_told_not_to(
    choice, prepared, name, make_backend
):
    """MariaDB parses the acquire's upsert on every call unless it is prepared (its
    parse costs about as much as the floor's INSERT): by default the lock connection
    PREPAREs its hot statements once and EXECUTEs them; PREPARED_STATEMENTS=False
    sends them as text."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("MySQL's EXECUTE takes only user variables: never prepared there")
    options = {} if choice is None else {"PREPARED_STATEMENTS": choice}
    backend = make_backend(MYSQL_ALIASES[0], **options)
    before = _executed_prepared(backend)
    _acquire_extend_release(backend, name)
    executed = _executed_prepared(backend) - before
    # Each round: acquire, extend, owns, release.
    assert executed == (12 if prepared else 0), executed
    if prepared:
        # Named after the database the connection really uses (OPTIONS or an
        # option file may choose another than NAME) and the statement.
        from django_setnx.backends.db_prepared import MariaDBStatements

        session = backend._state().prepared_session
        (database,) = _sql(backend, "SELECT DATABASE()")
        assert session.database == database
        dialect = backend._dialect
        hot = [dialect.acquire, dialect.extend, dialect.owns, dialect.release]
        assert session.names == {MariaDBStatements(Exception)._form(s, database)[0] for s in hot}


@needs(MYSQL_ALIASES)
def test_a_mariadb_session_that_lost_its_prepared_statements_prepares_them_again(
    name, make_backend
):
    """A pooler or proxy that resets the session (COM_RESET_CONNECTION, a move to
    another server connection) drops its prepared statements: EXECUTE then fails
    before anything runs, and the statement is prepared and run again, not failed."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    backend = make_backend(MYSQL_ALIASES[0])
    first = _acquire_extend_release(backend, name, times=1)
    for statement_name in list(backend._state().prepared_session.names):
        _sql(backend, f"DEALLOCATE PREPARE {statement_name}")
    later = _acquire_extend_release(backend, name, times=2)
    assert later[0] > first[-1]
    assert not backend._state().prepared_session.plain
    before = _executed_prepared(backend)
    _acquire_extend_release(backend, name, times=1)
    assert _executed_prepared(backend) - before == 4


@needs(MYSQL_ALIASES)
def test_a_mariadb_session_reset_gets_its_lock_wait_timeouts_back(name, make_backend):
    """Review r127: a session reset (COM_RESET_CONNECTION, from a proxy or pooler)
    also puts the lock wait timeouts back to the server's defaults (50 s, a day): a
    blocked acquire then outlived its read timeout and ran after the caller had
    given up. The reset is found when the prepared statements are gone, and the
    timeouts are set again with them."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    if connections[MYSQL_ALIASES[0]].Database.__name__ != "pymysql":
        # mysqlclient does not expose mysql_reset_connection(); CI runs PyMySQL.
        pytest.skip("sends COM_RESET_CONNECTION through PyMySQL's internals")
    backend = make_backend(MYSQL_ALIASES[0])
    _acquire_extend_release(backend, name, times=1)
    wanted = _sql(
        backend, "SELECT @@session.innodb_lock_wait_timeout, @@session.lock_wait_timeout"
    )
    assert wanted[0] < 50

    def reset(cursor, sql, raw):
        raw._execute_command(0x1F, b"")  # COM_RESET_CONNECTION
        raw._read_ok_packet()

    backend._run("test", reset, retry=False)
    assert _sql(backend, "SELECT @@session.innodb_lock_wait_timeout")[0] == 50
    _acquire_extend_release(backend, name, times=1)
    assert (
        _sql(backend, "SELECT @@session.innodb_lock_wait_timeout, @@session.lock_wait_timeout")
        == wanted
    )


@needs(MYSQL_ALIASES)
def test_a_statement_interrupted_by_kill_query_is_retried(name, make_backend):
    """Review r127: ``KILL QUERY`` (a DBA, pt-kill) of a lock statement is error 1317,
    which failed the operation (a killed release left the lock held until its ttl);
    the statement was rolled back, and is retried as a PostgreSQL cancel is."""
    backend = make_backend(MYSQL_ALIASES[0], OPERATION_TIMEOUT=10)
    blocker = make_backend(MYSQL_ALIASES[0])
    assert backend.acquire(name, "holder", 30, {}).acquired
    _sql(blocker, "START TRANSACTION")
    _sql(blocker, "SELECT name FROM {lock} WHERE name = {p} FOR UPDATE", (name,))
    session, released = queue.Queue(), []

    def release():
        session.put(_sql(backend, "SELECT CONNECTION_ID()")[0])  # this thread's
        released.append(backend.release(name, "holder"))

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        lock_session = session.get(timeout=10)
        time.sleep(0.5)  # the release waits for the row lock
        _sql(make_backend(MYSQL_ALIASES[0]), f"KILL QUERY {int(lock_session)}")
        time.sleep(0.3)  # its retry waits for the row lock again
    finally:
        _sql(blocker, "COMMIT")
    releaser.join(15)
    assert released == [True]
    assert backend.get(name) is None


@needs(MYSQL_ALIASES)
def test_an_ssl_context_in_the_database_options_is_not_copied(name, make_backend):
    """Review r127: the lock connection deep-copied the database's settings, and an
    ``ssl.SSLContext`` in OPTIONS (which PyMySQL takes) cannot be copied: every
    lock call raised TypeError. The settings are copied a level deep; the context is
    the project's own, passed on as it is."""
    import ssl

    from django_setnx.backends.database import _private_wrapper

    alias = MYSQL_ALIASES[0]
    options = connections[alias].settings_dict.setdefault("OPTIONS", {})
    options["ssl"] = context = ssl.create_default_context()
    try:
        wrapper = _private_wrapper("ssl", alias, 5.0)
    finally:
        del options["ssl"]
    assert wrapper.settings_dict["OPTIONS"]["ssl"] is context
    assert "ssl" not in connections[alias].settings_dict["OPTIONS"]  # a copy was changed


@pytest.mark.no_db
def test_a_prepared_statement_is_named_after_its_database_and_text():
    """MariaDB binds a prepared statement to the table of the database it was
    prepared in: behind a proxy that hands server sessions from one project's
    database to another's, the same text in another database must have another
    name (else its EXECUTE would run on the first database's table)."""
    from django_setnx.backends.db_prepared import MariaDBStatements

    statement = "UPDATE t SET a = %s WHERE b = %s"
    statements = MariaDBStatements(Exception)
    name_a, prepare, execute = statements._form(statement, "app_a")
    name_b = statements._form(statement, "app_b")[0]
    assert name_a != name_b
    assert name_a == MariaDBStatements(Exception)._form(statement, "app_a")[0]
    assert statements._form(statement + " ", "app_a")[0] != name_a
    assert (prepare, execute) == (f"PREPARE {name_a} FROM %s", f"EXECUTE {name_a} USING %s, %s")
    with pytest.raises(ValueError, match="cannot prepare"):
        statements._form("SELECT '%%'", "app_a")


def _wrap_cursors(backend, run):
    """Send every statement of the backend's lock connection through
    ``run(execute, raw, statement, params)``: a stand-in for a proxy, or for one
    answer of the server, in front of the real server."""
    make = backend._cursor

    def wrapped(raw):
        cursor = make(raw)
        execute = cursor.execute
        cursor.execute = lambda statement, params=None: run(execute, raw, statement, params)
        return cursor

    backend._cursor = wrapped


def _cursor_refusing_prepare_after(backend, allowed):
    """Make the backend's cursors refuse every PREPARE after the first ``allowed``
    with MariaDB's own error for a server at ``max_prepared_stmt_count`` (1461), as
    the server would, without lowering that limit for every session of the shared
    test server. Returns the PREPAREs let through."""
    prepared = []

    def run(execute, raw, statement, params):
        if statement.startswith("PREPARE "):
            if len(prepared) >= allowed:
                raise raw.OperationalError(
                    1461, "Can't create more than max_prepared_stmt_count statements"
                )
            prepared.append(statement)
        return execute(statement, params)

    _wrap_cursors(backend, run)
    return prepared


def _proxy_forgetting_after(backend, kept):
    """A proxy that keeps the first ``kept`` statements the backend prepares, then
    loses each one before its EXECUTE arrives (it moves the session): played by
    deallocating it on the real server. Returns the statements the backend sent."""
    sent, prepared = [], []

    def run(execute, raw, statement, params):
        sent.append(statement)
        result = execute(statement, params)
        if statement.startswith("PREPARE "):
            prepared.append(statement)
            if len(prepared) > kept:
                execute(f"DEALLOCATE {statement.split(' FROM ')[0]}")
        return result

    _wrap_cursors(backend, run)
    return sent


@needs(MYSQL_ALIASES)
def test_a_mariadb_server_that_refuses_prepare_gets_plain_statements(name, make_backend, caplog):
    """A server at its max_prepared_stmt_count refuses PREPARE: the connection goes
    on with plain statements (a warning logged), deallocates the statements it had
    prepared (the server may need them back), and every operation is still right."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    backend = make_backend(MYSQL_ALIASES[0])
    prepared = _cursor_refusing_prepare_after(backend, allowed=2)
    with caplog.at_level(logging.WARNING, logger="django_setnx"):
        first = _acquire_extend_release(backend, name, times=2)
    assert backend._state().prepared_session.plain
    assert "refused PREPARE" in caplog.text
    session = backend._state().prepared_session
    before = _executed_prepared(backend)
    assert _acquire_extend_release(backend, name, times=1)[0] > first[-1]
    assert _executed_prepared(backend) == before  # plain for this connection's life
    assert backend._state().prepared_session is session  # the same connection
    assert len(prepared) == 2
    for statement in prepared:  # deallocated already: unknown to the session
        with pytest.raises(LockBackendError, match="nknown prepared statement"):
            _sql(backend, f"DEALLOCATE {statement.split(' FROM ')[0]}")


@needs(MYSQL_ALIASES)
def test_mariadb_statements_are_named_after_the_database_the_connection_uses(
    name, make_backend, temporary_database
):
    """Django passes OPTIONS after NAME, so OPTIONS['database'] (or an option file)
    chooses the database: the statements are named after that one, as the server
    reports it, not after NAME."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    primary = MYSQL_ALIASES[0]
    real = connections[primary].settings_dict["NAME"]
    reference = make_backend(primary)
    _acquire_extend_release(reference, name, times=1)
    with temporary_database(
        primary, f"{primary}-optdb", NAME="setnx_not_this_one", OPTIONS={"database": real}
    ) as alias:
        backend = make_backend(alias)
        _acquire_extend_release(backend, name, times=1)
        assert backend._state().prepared_session.database == real
        assert backend._state().prepared_session.names == reference._state().prepared_session.names


@needs(MYSQL_ALIASES)
def test_a_refused_prepare_is_not_tried_again_on_the_same_connection(name, make_backend, caplog):
    """Once the server refused, the connection stays plain: no PREPARE (and no
    warning) at every later statement."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    backend = make_backend(MYSQL_ALIASES[0])
    _cursor_refusing_prepare_after(backend, allowed=2)
    with caplog.at_level(logging.WARNING, logger="django_setnx"):
        _acquire_extend_release(backend, name, times=3)
    assert caplog.text.count("refused PREPARE") == 1


@needs(MYSQL_ALIASES)
def test_a_proxy_that_starts_moving_the_session_later_gets_nothing_deallocated(name, make_backend):
    """Statements kept at first, then lost at every use (a proxy began moving the
    session): the connection goes plain and deallocates none of the names it had,
    which other clients of the database may be using where they went."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    backend = make_backend(MYSQL_ALIASES[0])
    sent = _proxy_forgetting_after(backend, kept=2)
    _acquire_extend_release(backend, name, times=2)
    assert backend._state().prepared_session.plain
    assert not [s for s in sent if s.startswith("DEALLOCATE")]


@needs(MYSQL_ALIASES)
def test_a_deallocate_error_after_a_refusal_fails_the_operation_not_the_next(name, make_backend):
    """A DEALLOCATE that fails after a refusal (its query killed) fails that
    operation with the server's error, not a later one with a confusing one; the
    next operation runs on a new connection, which prepares again."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    backend = make_backend(MYSQL_ALIASES[0])
    prepared = _cursor_refusing_prepare_after(backend, allowed=2)
    failed = []

    def kill_the_first_deallocate(execute, raw, statement, params):
        if statement.startswith("DEALLOCATE") and not failed:
            failed.append(statement)
            # (Not 1317, a KILL QUERY: a contention error now, retried.)
            raise raw.OperationalError(1105, "Unknown error")
        return execute(statement, params)

    _wrap_cursors(backend, kill_the_first_deallocate)
    token = _token()
    assert backend.acquire(name, token, 30, OWNER).acquired
    assert backend.extend(name, token, 30)
    with pytest.raises(LockBackendError, match="1105"):
        backend.owns(name, token)
    prepared.clear()  # the server takes PREPAREs again
    before = backend._state().prepared_session
    assert backend.owns(name, token)
    assert backend._state().prepared_session is not before
    assert not backend._state().prepared_session.plain and prepared
    assert backend.release(name, token)


@needs(MYSQL_ALIASES)
def test_a_prepare_behind_a_migration_is_contention_not_a_refusal(name, make_backend):
    """PREPARE opens the table: behind an ALTER TABLE that waits for a transaction
    reading it (a migration), it waits for the metadata lock and times out. That is
    contention, bounded by OPERATION_TIMEOUT as the plain statement's wait would be;
    the connection keeps preparing once the migration is done."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    alias = MYSQL_ALIASES[0]
    reader = make_backend(alias, PREPARED_STATEMENTS=False)
    migrator = make_backend(alias, PREPARED_STATEMENTS=False)
    backend = make_backend(alias, OPERATION_TIMEOUT=1)
    _sql(backend, "SELECT 1")  # connected, nothing prepared yet
    _sql(reader, "BEGIN")
    _sql(reader, "SELECT COUNT(*) FROM {lock}")

    def migrate():
        _sql(migrator, "SET SESSION lock_wait_timeout = 30")
        _sql(migrator, "ALTER TABLE {lock} COMMENT = 'test'")

    alter = threading.Thread(target=migrate)
    alter.start()
    try:
        time.sleep(0.5)  # the ALTER now waits, and so does anyone opening the table
        started = time.monotonic()
        with pytest.raises(LockBackendError, match="Lock wait timeout"):
            backend.acquire(name, _token(), 30, OWNER)
        # One wait of lock_wait_timeout (1 s), not a second one in plain text.
        assert time.monotonic() - started < 1.8
    finally:
        _sql(reader, "ROLLBACK")
        alter.join(HANG)
        _sql(migrator, "ALTER TABLE {lock} COMMENT = ''")
    assert not backend._state().prepared_session.plain
    before = _executed_prepared(backend)
    _acquire_extend_release(backend, name, times=1)
    assert _executed_prepared(backend) - before == 4


@needs(MYSQL_ALIASES)
def test_a_mariadb_proxy_that_never_keeps_prepared_statements_gets_plain_ones(name, make_backend):
    """Behind a proxy that runs each statement on whichever server connection is
    free, a statement prepared on one is unknown on the next: after one more try the
    connection sends plain statements, and no operation fails. The proxy is
    played by the lock connection's cursor deallocating each statement it prepared
    (on the real server) before the EXECUTE reaches it."""
    if not connections[MYSQL_ALIASES[0]].mysql_is_mariadb:
        pytest.skip("prepared statements are MariaDB's only")
    backend = make_backend(MYSQL_ALIASES[0])
    sent = _proxy_forgetting_after(backend, kept=0)
    tokens = _acquire_extend_release(backend, name, times=3)
    assert backend._state().prepared_session.plain
    assert len(tokens) == 3
    # Where the statements went, other clients of the database may use the same
    # names: going plain deallocates nothing there.
    assert not [s for s in sent if s.startswith("DEALLOCATE")]


@needs(MYSQL_ALIASES)
@pytest.mark.parametrize("mysql_alias", MYSQL_ALIASES)
def test_a_client_flag_of_the_project_keeps_rowcount_counting_matched_rows(
    mysql_alias, name, make_backend, temporary_database
):
    """A ``client_flag`` in DATABASES replaces the FOUND_ROWS flag Django sets: the
    lock connection adds it back. Without it, an extend that writes the expiry the
    row already has (the same ttl within one ms) changed no row and read as a lost
    lock."""
    with temporary_database(mysql_alias, "flagged", OPTIONS={"client_flag": 0}):
        backend = make_backend("flagged")
        token = _token()
        assert backend.acquire(name, token, 30, OWNER).acquired
        assert all([backend.extend(name, token, 30) for _ in range(200)])
        assert backend.release(name, token)


@needs(POSTGRES)
def test_a_postgres_row_lock_held_elsewhere_fails_within_the_timeout(name, make_backend):
    """libpq has no read timeout: the wait is bounded client-side, the statement
    cancelled (it must not take the lock later, when the row lock is gone), and the
    connection closed."""
    holder, backend = make_backend("postgres"), make_backend("postgres", OPERATION_TIMEOUT=1)
    token = _token()
    # A stale row: the acquire below would take it over, if it ever ran.
    assert holder.acquire(name, token, 0.05, OWNER).acquired
    time.sleep(0.1)
    _sql(holder, "BEGIN")
    _sql(holder, "SELECT name FROM {lock} WHERE name = {p} FOR UPDATE", (name,))
    started = time.monotonic()
    try:
        with pytest.raises(LockBackendError, match=r"no answer .* within 1 s"):
            _in_thread(lambda: backend.acquire(name, _token(), 30, OWNER))
        assert time.monotonic() - started < 4  # 1 s, a cancel, no retry
    finally:
        _sql(holder, "ROLLBACK")
    time.sleep(0.2)
    # Cancelled: it did not run after the ROLLBACK (the stale row is still there).
    assert backend.get(name).is_stale
    assert backend.acquire(name, token, 30, OWNER).acquired  # a new connection works
    assert backend.release(name, token)


@needs(POSTGRES)
def test_a_stopped_postgres_server_process_fails_within_the_timeout(name, make_backend):
    """The server process serving our connection is stopped (SIGSTOP): the kernel
    still acknowledges every packet, so no TCP setting notices. The client-side
    bound does."""
    import signal

    backend = make_backend("postgres", OPERATION_TIMEOUT=1)
    stopped = []

    def stop_own_server_process_then_acquire():
        # On this thread's connection: the one the acquire below uses.
        (pid,) = _sql(backend, "SELECT pg_backend_pid()")
        os.kill(pid, signal.SIGSTOP)
        stopped.append((pid, time.monotonic()))
        return backend.acquire(name, _token(), 1, OWNER)

    try:
        with pytest.raises(LockBackendError, match=r"no answer"):
            _in_thread(stop_own_server_process_then_acquire)
        assert time.monotonic() - stopped[0][1] < 4
    finally:
        for pid, _ in stopped:
            os.kill(pid, signal.SIGCONT)
    # Resumed, the server may still run the statement it had received before the
    # cancel (a stopped process cannot be cancelled): the outcome was unknown, and
    # the lock may be held under a token nobody has, for its ttl at most.
    time.sleep(1.2)
    token = _token()
    assert backend.acquire(name, token, 30, OWNER).acquired
    assert backend.release(name, token)
