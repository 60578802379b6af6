"""Database backend specifics: the place next in line (fairness), on every database.

Driven through the backend's own calls with explicit tokens, so each step is
deterministic; the shared contract is in test_contract.py, the multi-process
races in test_races.py.
"""

import secrets
import threading
import time

from django_setnx import lock, locks
from django_setnx.backends import database
from tests.backend_sql import run_sql as _sql

OWNER = {"host": "test", "pid": 1, "thread": "MainThread"}


def _token():
    return secrets.token_hex(16)


class _Row:
    def __init__(self, token, next_token, next_since, next_seen):
        self.token, self.next_token = token, next_token
        self.next_since, self.next_seen = next_since, next_seen


def _row(alias, name):
    row = _sql(
        alias,
        "SELECT token, next_token, next_since, next_seen FROM {table} WHERE name = {p}",
        (name,),
    )
    return None if row is None else _Row(*row)


def _is_tombstone(row):
    """A released row: no lock and nobody next in line (it keeps the fencing token
    for FENCING_RETENTION_MS, see db_sql)."""
    return row is not None and row.token == "" and row.next_token == ""


def _lapse(alias, name):
    """Make the waiter next in line look as if it stopped asking long ago."""
    _sql(alias, "UPDATE {table} SET next_seen = 1 WHERE name = {p}", (name,))


def _record_statements(backend, monkeypatch):
    """The list that every hot statement ``backend`` sends from now on is appended to
    (their text), as the statement runs."""
    sent = []
    execute = backend._execute
    monkeypatch.setattr(
        backend,
        "_execute",
        lambda cursor, sql, params: (sent.append(sql), execute(cursor, sql, params))[1],
    )
    return sent


def test_release_leaves_the_lock_to_the_waiter_next_in_line(db_alias, name):
    backend = locks[db_alias]
    holder, waiter, newcomer = _token(), _token(), _token()
    assert backend.acquire(name, holder, 30, OWNER).acquired
    assert not backend.acquire(name, waiter, 30, OWNER, wait=10).acquired  # queues
    assert _row(db_alias, name).next_token == waiter

    assert backend.release(name, holder) is True
    # The row stays for the waiter, with no token: it is no lock to anyone else...
    row = _row(db_alias, name)
    assert (row.token, row.next_token) == ("", waiter)
    assert backend.get(name) is None
    assert [i.name for i in backend.list() if i.name == name] == []
    # ...and a caller that did not wait (the releaser coming straight back, say)
    # cannot take it ahead of the waiter.
    assert not backend.acquire(name, newcomer, 30, OWNER).acquired
    assert not backend.acquire(name, holder, 30, OWNER).acquired

    won = backend.acquire(name, waiter, 30, OWNER, wait=10)
    assert won.acquired
    row = _row(db_alias, name)
    assert (row.token, row.next_token, row.next_since, row.next_seen) == (waiter, "", 0, 0)
    assert backend.get(name).fencing_token == won.fencing_token
    assert backend.release(name, waiter) is True
    assert _is_tombstone(_row(db_alias, name)), "no waiter left: the row is free"


def test_a_lock_handed_on_and_on_takes_one_statement_a_release(db_alias, name, monkeypatch):
    """After a release left a lock to a waiter, the next release of it sends the
    statement that handles both cases at once (where the database can return which
    one it was): one statement a handoff, not two. A release that finds only a
    lapsed waiter still leaves a free tombstone (on PostgreSQL with the dead waiter's
    token, so that the statement NOTIFYs the others), and elsewhere the name is
    forgotten."""
    backend = locks[db_alias]
    sent = _record_statements(backend, monkeypatch)
    tokens = [_token() for _ in range(4)]
    assert backend.acquire(name, tokens[0], 30, OWNER).acquired
    statements, fencing = [], [backend.get(name).fencing_token]
    for holder, waiter in zip(tokens, tokens[1:]):
        assert not backend.acquire(name, waiter, 30, OWNER, wait=10).acquired  # next in line
        sent.clear()
        assert backend.release(name, holder) is True
        statements.append(len(sent))
        row = _row(db_alias, name)
        assert (row.token, row.next_token) == ("", waiter)  # left to the waiter...
        assert not backend.acquire(name, _token(), 30, OWNER).acquired  # ...alone
        won = backend.acquire(name, waiter, 30, OWNER, wait=10)
        assert won.acquired
        fencing.append(won.fencing_token)
    one_statement = backend._dialect.release_any is not None
    assert statements == ([2, 1, 1] if one_statement else [2, 2, 2])
    assert fencing == sorted(set(fencing))

    # The last holder's waiter died: its place lapsed, so the lock is free to anyone.
    ghost = _token()
    assert not backend.acquire(name, ghost, 30, OWNER, wait=10).acquired
    _lapse(db_alias, name)
    sent.clear()
    assert backend.release(name, tokens[-1]) is True
    assert len(sent) == 1
    row = _row(db_alias, name)
    if backend._dialect.vendor == "postgresql":
        # The statement returned the dead waiter's token (and NOTIFYed the others,
        # see test_database_waiting); its place stays lapsed: free to anyone.
        assert (row.token, row.next_token, row.next_seen) == ("", ghost, 0)
    else:
        assert _is_tombstone(row)
        assert name not in backend._handed_over
    newcomer = backend.acquire(name, _token(), 30, OWNER)
    assert newcomer.acquired and newcomer.fencing_token > fencing[-1]
    backend._waiting.pop(ghost, None)
    # Released by someone else meanwhile: not ours, and nothing changes.
    assert backend.release(name, tokens[-1]) is False
    assert backend.get(name).fencing_token == newcomer.fencing_token


def test_the_longest_waiting_caller_takes_the_place(db_alias, name):
    backend = locks[db_alias]
    holder, early, late = _token(), _token(), _token()
    assert backend.acquire(name, holder, 30, OWNER).acquired
    # The late caller asks first; the early one (refused before it) takes the
    # place over at its next attempt; the late one cannot take it back.
    assert not backend.acquire(name, late, 30, OWNER, wait=10).acquired
    assert _row(db_alias, name).next_token == late
    backend._waiting[early] = database._Waiter(name, early)
    backend._waiting[early].since_ms = backend._waiting[late].since_ms - 1000
    assert not backend.acquire(name, early, 30, OWNER, wait=10).acquired
    assert _row(db_alias, name).next_token == early
    backend._waiting[late].head = False
    assert not backend.acquire(name, late, 30, OWNER, wait=10).acquired
    assert _row(db_alias, name).next_token == early
    backend.release(name, holder)
    assert not backend.acquire(name, late, 30, OWNER, wait=10).acquired
    assert backend.acquire(name, early, 30, OWNER, wait=10).acquired
    # The late caller asks again and is next.
    assert not backend.acquire(name, late, 30, OWNER, wait=10).acquired
    backend.release(name, early)
    assert backend.acquire(name, late, 30, OWNER, wait=10).acquired
    backend.release(name, late)


def test_a_waiter_woken_for_a_freed_place_asks_for_it(db_alias, name):
    """A waiter that was next in line lost the place to one that waited longer, which
    then gave up (its place is free, and the others are woken to take it). The
    woken waiter still believes the place is its own and renewed it lately, so it
    would skip asking: after a wake-up it asks all the same, and takes it. (Without
    that, a freed place stayed empty until a renewal was due, and a releaser that
    looped back took the lock again, ahead of the waiters.)"""
    backend = locks[db_alias]
    holder, waiter, early = _token(), _token(), _token()
    assert backend.acquire(name, holder, 30, OWNER).acquired
    assert not backend.acquire(name, waiter, 30, OWNER, wait=10).acquired
    backend._waiting[early] = database._Waiter(name, early)
    backend._waiting[early].since_ms = backend._waiting[waiter].since_ms - 1000
    assert not backend.acquire(name, early, 30, OWNER, wait=10).acquired
    assert _row(db_alias, name).next_token == early
    assert backend._waiting[waiter].head, "it has not asked since: it believes so"
    backend.stop_waiting(name, early)  # frees the place, and wakes the others
    assert _row(db_alias, name).next_token == ""
    backend.wait(name, token=waiter, attempt=1, max_wait=5, retry_after=None)  # woken
    assert not backend.acquire(name, waiter, 30, OWNER, wait=10).acquired
    assert _row(db_alias, name).next_token == waiter
    backend.release(name, holder)
    assert backend.acquire(name, waiter, 30, OWNER, wait=10).acquired
    backend.release(name, waiter)


def test_a_lapsed_place_holds_nothing_back(db_alias, name):
    backend = locks[db_alias]
    holder, ghost, newcomer = _token(), _token(), _token()
    assert backend.acquire(name, holder, 30, OWNER).acquired
    assert not backend.acquire(name, ghost, 30, OWNER, wait=10).acquired
    backend.release(name, holder)
    assert _row(db_alias, name).token == ""
    # The waiter died without a word: once it has not asked for NEXT_LAPSE_MS,
    # anyone may take the lock.
    _lapse(db_alias, name)
    assert backend.acquire(name, newcomer, 30, OWNER).acquired
    assert _row(db_alias, name).next_token == ""
    backend.release(name, newcomer)
    backend._waiting.pop(ghost, None)


def test_a_waiter_that_gives_up_leaves_no_place_behind(db_alias, name):
    backend = locks[db_alias]
    holder, quitter, newcomer = _token(), _token(), _token()
    assert backend.acquire(name, holder, 30, OWNER).acquired
    assert not backend.acquire(name, quitter, 30, OWNER, wait=10).acquired
    backend.release(name, holder)
    assert backend.stop_waiting(name, quitter) is None
    assert _is_tombstone(_row(db_alias, name)), "the row kept for the quitter is free"
    assert quitter not in backend._waiting
    assert backend.acquire(name, newcomer, 30, OWNER).acquired
    backend.release(name, newcomer)


def test_timed_out_lock_gives_up_its_place(db_alias, name):
    holder = lock(name, backend=db_alias)
    holder.acquire()
    assert lock(name, backend=db_alias).acquire(timeout=0.05) is False
    assert _row(db_alias, name).next_token == ""
    holder.release()
    assert _is_tombstone(_row(db_alias, name))
    assert locks[db_alias]._waiting == {}


def test_blocking_waiter_gets_the_lock_before_a_looping_releaser(db_alias, name):
    """The releaser loops straight back to acquire; the blocked waiter still wins."""
    backend = locks[db_alias]
    holder = lock(name, backend=db_alias)
    holder.acquire()
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(lock(name, backend=db_alias).acquire(timeout=10))
    )
    waiter.start()
    deadline = time.monotonic() + 10
    while not (_row(db_alias, name).next_token or time.monotonic() > deadline):
        time.sleep(0.002)
    holder.release()
    assert lock(name, backend=db_alias).acquire(blocking=False) is False
    waiter.join(timeout=10)
    assert got == [True]
    locks[db_alias].clear(include_held=True)
    assert backend._waiting == {}


def test_clear_purges_lapsed_places_and_never_reports_them(db_alias, name):
    backend = locks[db_alias]
    holder, ghost = _token(), _token()
    backend.acquire(name, holder, 30, OWNER)
    backend.acquire(name, ghost, 30, OWNER, wait=10)
    backend.release(name, holder)
    assert name not in backend.clear(include_held=True).names
    assert _row(db_alias, name) is not None, "a live waiter's place is kept"
    _lapse(db_alias, name)
    _sql(db_alias, "UPDATE {table} SET acquired_at = 1 WHERE name = {p}", (name,))  # old
    assert name not in backend.clear().names
    assert _row(db_alias, name) is None
    backend._waiting.pop(ghost, None)


def test_migrations_match_the_models():
    """A model change without its migration would break every fresh install."""
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("makemigrations", "django_setnx", check=True, dry_run=True, stdout=out)
    assert "No changes detected" in out.getvalue()


def test_a_row_is_taken_whole_or_left_alone_in_every_assignment_mode(db_alias, name):
    """MySQL/MariaDB decide a takeover once, in the statement's first assignment, and
    the others read that decision back (see db_sql): a refused attempt changes no
    column and a takeover every one, whether the assignments see each other (the
    default) or all read the old row (MariaDB's SIMULTANEOUS_ASSIGNMENT)."""
    backend = locks[db_alias]
    _sql(db_alias, "SELECT 1", ())  # connected: the dialect is known
    modes = [None]
    if backend._dialect.vendor == "mysql" and backend._dialect.is_mariadb:
        modes.append("SIMULTANEOUS_ASSIGNMENT")
    columns = "token, owner, acquired_at, expires_at, fencing, next_token, next_since, next_seen"

    def row():
        return _sql(db_alias, f"SELECT {columns} FROM {{table}} WHERE name = {{p}}", (name,))

    for mode in modes:
        if mode is not None:
            # The backend's connection of this thread, which the calls below use.
            _sql(db_alias, f"SET SESSION sql_mode = CONCAT(@@sql_mode, ',{mode}')", ())
        try:
            holder, other, waiter = _token(), _token(), _token()
            first = backend.acquire(name, holder, 30, OWNER)
            assert first.acquired
            held = row()
            assert held[0] == holder and held[4] == first.fencing_token
            assert not backend.acquire(name, other, 30, {"host": "x", "pid": 2}).acquired
            assert row() == held, "a refused attempt changed the row"
            assert not backend.acquire(name, waiter, 30, OWNER, wait=10).acquired
            queued = row()
            assert queued[5] == waiter and queued[:5] == held[:5]
            assert backend.release(name, holder)
            left = row()
            assert left[0] == "" and left[5] == waiter, "left to the waiter next in line"
            assert left[3] == left[2] and left[6] == queued[6], "expired, the claim kept"
            assert not backend.acquire(name, other, 30, {"host": "x", "pid": 2}).acquired
            assert row() == left, "a refused attempt changed the row left to a waiter"
            taken = backend.acquire(name, waiter, 45, OWNER)
            assert taken.acquired and taken.fencing_token > first.fencing_token
            token, owner, acquired_at, expires_at, fencing, *next_in_line = row()
            assert (token, fencing, next_in_line) == (waiter, taken.fencing_token, ["", 0, 0])
            assert expires_at - acquired_at == 45_000 and acquired_at >= left[2]
            assert backend.release(name, waiter)
            token, owner, acquired_at, expires_at, fencing, *next_in_line = row()
            assert (token, expires_at, fencing, next_in_line) == (
                "",
                0,
                taken.fencing_token,
                ["", 0, 0],
            ), "a tombstone, nobody next in line"
            backend._waiting.clear()
            backend._handed_over.clear()
        finally:
            if mode is not None:
                _sql(db_alias, f"SET SESSION sql_mode = REPLACE(@@sql_mode, '{mode}', '')", ())


def test_a_hand_written_row_is_refused_or_taken_whole(db_alias, name):
    """Rows this backend never writes: a held one with a negative fencing token is
    refused (on MySQL the refused branch once overflowed an unsigned sum), and one
    whose times are implausible (listed as stale) is taken whole, every column."""
    backend = locks[db_alias]
    insert = (
        "INSERT INTO {table} (name, token, owner, acquired_at, expires_at, fencing, "
        "next_token, next_since, next_seen) VALUES ({p}, {p}, '{{}}', {p}, {p}, {p}, {p}, 0, {p})"
    )
    now_ms = int(time.time() * 1000)
    _sql(db_alias, insert, (name, "by-hand", now_ms, now_ms + 60_000, -1, "", 0))
    assert not backend.acquire(name, _token(), 30, OWNER).acquired
    assert _row(db_alias, name).token == "by-hand"
    _sql(db_alias, "DELETE FROM {table} WHERE name = {p}", (name,))

    absurd = 10**15
    lapsed = now_ms - 60_000
    _sql(db_alias, insert, (name, "by-hand", absurd, absurd + 60_000, 5, "ghost", lapsed))
    mine = _token()
    taken = backend.acquire(name, mine, 30, OWNER)
    assert taken.acquired and taken.fencing_token > 5
    token, acquired_at, expires_at, next_token, next_seen = _sql(
        db_alias,
        "SELECT token, acquired_at, expires_at, next_token, next_seen FROM {table} "
        "WHERE name = {p}",
        (name,),
    )
    assert (token, next_token, next_seen) == (mine, "", 0)
    assert abs(acquired_at - now_ms) < 60_000 and expires_at - acquired_at == 30_000
    assert backend.release(name, mine)
