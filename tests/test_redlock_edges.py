"""Redlock where Django apps really run: quorum errors, brand-new masters and the
``trustlocknodes`` command, masters that may evict keys, bad input, records that
cannot be read, and name globs. Real throwaway masters (tests/scaleout_plugin.py);
fork safety is in tests/test_forks.py.
"""

import builtins
import contextlib
import hashlib
import logging
import math
import os
import random
import signal
import socket
import threading
import time
from io import StringIO

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.test import override_settings

if "redis" not in settings.TEST_BACKENDS:
    pytest.skip("redis is not in settings.TEST_BACKENDS", allow_module_level=True)

import hiredis
import redis

from django_setnx import lock, locks
from django_setnx.backends import redlock_wire as wire
from django_setnx.backends.base import encode_owner
from django_setnx.backends.redis_scripts import ACQUIRE
from django_setnx.backends.redlock import (
    _ACQUIRE,
    _EXTEND,
    _READ_CLOCK,
    _RELEASE,
    NODE_ACQUIRE,
    RedlockBackend,
)
from django_setnx.exceptions import LockBackendError
from tests.servers import DelayingProxy
from tests.test_redlock import MARKER, OWNER, alias_on, clients, fence_key, lock_key, unique

EVICTING = ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]


def label(server):
    return f"127.0.0.1:{server.port}"


# -- fewer than a majority answering ----------------------------------------------------


def test_no_majority_is_an_error_at_once_naming_each_node_and_why(make_masters):
    """One master down, one not answering (SIGSTOP): the remaining one cannot tell
    anything. Every operation raises LockBackendError at once, naming the alias and
    both nodes with their reasons, instead of reporting a contention (acquire used
    to return False, and wait its whole timeout) or a false "not owned"."""
    masters = make_masters(3)
    name = unique()
    with alias_on(masters.urls, NODE_TIMEOUT=0.2) as alias:
        held = lock(name, ttl=30, backend=alias)
        assert held.acquire(blocking=False)
        down, stopped, _ = masters.servers
        down.kill()
        os.kill(stopped.process.pid, signal.SIGSTOP)
        try:
            operations = {
                "acquire": lambda: lock(unique(), ttl=10, backend=alias).acquire(timeout=5),
                "check": held.owned,
                "extend": held.extend,
                "get": held.info,
                "release": held.release,
                "delete": lambda: locks[alias].delete(unique()),
                "list": lambda: list(locks[alias].list()),
                "clear": lambda: locks[alias].clear(include_held=True),
            }
            for action, operation in operations.items():
                with pytest.raises(LockBackendError) as raised:
                    operation()
                message = str(raised.value)
                assert raised.value.alias == alias and f"'{alias}'" in message
                assert action in message, message
                assert "only 1 of 3 Redis nodes answered" in message, message
                assert f"{label(down)}: ConnectionError" in message, message
                assert f"{label(stopped)}: TimeoutError" in message, message
        finally:
            os.kill(stopped.process.pid, signal.SIGCONT)


def test_an_answer_a_silent_node_could_tip_is_an_error_not_a_no(make_masters):
    """One master lost the record (it answers 0), one does not answer (SIGSTOP): a
    majority answered, but the silent one may hold the lock, so whether a majority
    holds it is unknown. Checking, extending and releasing raise LockBackendError
    naming the silent node. The extend releases nothing (it used to report the lock
    lost, and delete it on the master that still held it)."""
    masters = make_masters(3)
    silent = masters.servers[1]
    forgot, _, kept = clients(masters)
    name = unique()

    def unknown(operation, action, what):
        with pytest.raises(LockBackendError) as raised:
            operation()
        message = str(raised.value)
        assert action in message, message
        assert "only 1 of 3 nodes confirmed it and 1 did not answer" in message, message
        assert f"whether a majority {what} is unknown" in message, message
        assert f"{label(silent)}: TimeoutError" in message, message

    with alias_on(masters.urls, NODE_TIMEOUT=0.2) as alias:
        held = lock(name, ttl=30, backend=alias)
        assert held.acquire(blocking=False)
        forgot.delete(lock_key(name))
        os.kill(silent.process.pid, signal.SIGSTOP)
        try:
            unknown(held.owned, "check", "holds it")
            unknown(lambda: held.extend(60), "extend", "extended it")
            assert kept.exists(lock_key(name)) == 1, "released what may still be a lock"
        finally:
            os.kill(silent.process.pid, signal.SIGCONT)
        assert not held.lost, "an unknown answer is not news that the lock was lost"
        assert held.owned(), "the silent node held it: with the kept one, a majority"

        os.kill(silent.process.pid, signal.SIGSTOP)
        try:
            unknown(held.release, "release", "held it")
        finally:
            os.kill(silent.process.pid, signal.SIGCONT)
        # The silent node runs the release it was sent once it goes on.
        gone_by = time.monotonic() + 5
        while any(client.exists(lock_key(name)) for client in clients(masters)):
            assert time.monotonic() < gone_by, "the release never reached the silent node"
            time.sleep(0.01)


def test_a_node_acquire_reads_the_clock_once():
    """NODE_ACQUIRE wraps ACQUIRE after its own reading of TIME, and strips
    ACQUIRE's: a change to that line of ACQUIRE would leave a second TIME per master
    and acquire, and two readings that differ."""
    assert ACQUIRE.count(_READ_CLOCK) == 1
    assert NODE_ACQUIRE.count("redis.call('TIME')") == 1


def _grant_on(backend, index, name, token, ttl_ms):
    """Another client's record of ``name`` on node ``index`` only."""
    args = (token, ttl_ms, encode_owner(OWNER), 1000, 0, 10_000)
    keys = (*backend._keys(name), backend.marker_key)
    assert backend._round({index: [(_ACQUIRE, keys, args)]})[index][0][0] == 1


@pytest.mark.parametrize("path", ["hiredis", "redis-py", "tls"])
def test_an_acquire_that_lost_and_a_paused_node_runs_late_is_undone_after_it(
    make_masters, monkeypatch, path
):
    """Review r137 D2: a node paused while an acquire round waited for it runs the
    acquire when it goes on. The undo of an acquire that lost went on another
    connection (or none: a paused node takes no new connection in time), so the
    acquire left a record there that nobody held, taking that node's vote from every
    other client for the lock's ttl. The undo now follows the acquire on the same
    connection, and runs after it. (An acquire that won gets none: the late record
    is the holder's, which a later extend may count.) Over TLS (redis-py's path),
    the paused node's read times out and the undo is written on its TLS connection."""
    if path == "redis-py":
        monkeypatch.setattr(wire, "hiredis", None)
    masters = make_masters(3, tls=range(3) if path == "tls" else ())
    paused, slow = masters.servers[2], clients(masters)[2]
    name = unique()
    with alias_on(masters.urls, NODE_TIMEOUT=0.2) as alias:
        backend = locks[alias]
        assert all(status.trusted for status in backend.node_status())  # connected
        _grant_on(backend, 0, name, "another", 60_000)  # A refuses
        os.kill(paused.process.pid, signal.SIGSTOP)
        try:
            assert lock(name, ttl=60, backend=alias).acquire(blocking=False) is False
        finally:
            os.kill(paused.process.pid, signal.SIGCONT)
        slow.ping()  # C goes on: it runs what it had read
        time.sleep(0.2)
        assert not slow.exists(lock_key(name)), "C kept a record of the acquire that lost"


def test_an_acquire_sent_again_with_eval_that_comes_late_is_undone_after_it(make_masters):
    """Review r141: after a SCRIPT FLUSH the acquire is sent again with EVAL, in a
    round of its own, which had no undo for a late node: the undo of the acquire that
    lost went on another connection, ran first, and the late EVAL left a record nobody
    held for the lock's ttl. That round's late nodes get the undo too (by EVAL: the
    node may lack every script)."""
    masters = make_masters(3)
    name = unique()
    flushed = clients(masters)[2]
    with DelayingProxy(masters.servers[2].port) as proxy:
        urls = [*masters.urls[:2], proxy.url]
        with alias_on(urls, NODE_TIMEOUT=0.1) as alias:
            backend = locks[alias]
            assert all(status.trusted for status in backend.node_status())  # connected
            _grant_on(backend, 0, name, "another", 30_000)  # A refuses: the acquire loses
            flushed.script_flush()
            proxy.delay_connection_with(b"local marker = KEYS[#KEYS]", 1.0)  # the EVAL
            assert lock(name, ttl=60, backend=alias).acquire(blocking=False) is False
            assert proxy.delayed == 1
            time.sleep(1.5)  # the EVAL reached C, and what came after it
            assert not flushed.exists(lock_key(name)), "C kept a record of the acquire that lost"


@pytest.mark.parametrize("path", ["hiredis", "redis-py"])
def test_an_acquire_that_won_after_a_noscript_leaves_the_late_record_to_its_holder(
    make_masters, monkeypatch, path
):
    """Review r142: B lost its scripts (NOSCRIPT, the acquire sent again with EVAL),
    and C's reply is late. The undo for C was decided on the first round's replies,
    where only A had granted, and deleted the record on C of an acquire that then won
    with A and B: the holder's, which a later extend may count. A NOSCRIPT now counts
    as a grant to come."""
    if path == "redis-py":
        monkeypatch.setattr(wire, "hiredis", None)
    masters = make_masters(3)
    name = unique()
    flushed, late = clients(masters)[1:]
    with DelayingProxy(masters.servers[2].port) as proxy:
        urls = [*masters.urls[:2], proxy.url]
        with alias_on(urls, NODE_TIMEOUT=0.1) as alias:
            assert all(status.trusted for status in locks[alias].node_status())  # connected
            flushed.script_flush()
            proxy.delay_connection_with(_ACQUIRE.sha.encode(), 0.5)
            holder = lock(name, ttl=60, backend=alias)
            assert holder.acquire(blocking=False)
            assert proxy.delayed == 1
            time.sleep(1.0)  # C ran the late acquire, and what came after it
            assert late.hget(lock_key(name), "token"), "the holder's record on C was deleted"
            holder.release()


@pytest.mark.parametrize("late", ["acquire", "release"])
def test_an_undo_that_comes_late_never_deletes_a_later_attempt_s_record(make_masters, late):
    """Review r139: every retry of one blocking acquire() used the same token, and an
    attempt's undo (its release) is only token-checked. One that reached a node late
    (its acquire's connection held up, with the undo behind it; or the undo's own
    connection) deleted the record the next attempt had been granted and counted
    there: the holder's majority shrank, and a second client got the lock. Each
    attempt now has a token of its own.

    A: another client's record for 0.6 s; B: another one's for 3 s. Attempt 1 loses
    (A and B refuse) and its bytes of the ``late`` kind to C are held up 1.5 s;
    a later attempt wins with A and C (at 0.6 s; with the release held up, once it
    has freed C, at about 1.6 s: attempt 1's record refuses the others until then).
    At 3.3 s B is free: with C's record deleted, B and C would grant the lock
    again."""
    masters = make_masters(3)
    name = unique()
    with DelayingProxy(masters.servers[2].port) as proxy:
        urls = [*masters.urls[:2], proxy.url]
        with alias_on(urls, NODE_TIMEOUT=0.1) as alias:
            backend = locks[alias]
            assert all(status.trusted for status in backend.node_status())  # connected
            for index, ttl_ms in ((0, 600), (1, 3000)):  # another client's, on one node
                _grant_on(backend, index, name, f"other{index}", ttl_ms)
            t0 = time.monotonic()
            sha = (_ACQUIRE if late == "acquire" else _RELEASE).sha.encode()
            proxy.delay_connection_with(sha, 1.5)
            holder = lock(name, ttl=60, backend=alias)
            assert holder.acquire(timeout=2.5)
            assert proxy.delayed == 1
            time.sleep(max(t0 + 3.3 - time.monotonic(), 0))  # the late bytes ran on C
            assert lock(name, ttl=10, backend=alias).acquire(blocking=False) is False, (
                "a second holder"
            )
            assert holder.owned()
            holder.release()


# -- a slow node does not set the pace of release and extend -----------------------------


@contextlib.contextmanager
def writes_paused(client):
    """The node answers reads but holds every write (scripts included) until the end
    of the block, as a node stalled by a slow disk or a long command would."""
    client.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        yield
    finally:
        client.execute_command("CLIENT", "UNPAUSE")


def test_release_and_extend_end_once_a_majority_confirmed(make_masters):
    """With one node stalled, release and extend return once the other two confirmed
    (not after NODE_TIMEOUT): the stalled node had not run either when they returned.
    Its late replies are read and dropped before its connections are used again, so
    later rounds read their own replies there, and the node catches up."""
    masters = make_masters(3)
    name = unique()
    slow = clients(masters)[2]
    with alias_on(masters.urls, NODE_TIMEOUT=30) as alias:
        backend = locks[alias]
        held = lock(name, ttl=30, backend=alias)
        assert held.acquire(blocking=False)
        before = slow.hget(lock_key(name), "expires")
        with writes_paused(slow):
            held.extend(60)
            assert slow.hget(lock_key(name), "expires") == before, "extended before it ran"
            held.release()
            assert slow.exists(lock_key(name)) == 1, "released before it ran"
            owed = [parked.owed for parked in backend.nodes[2].server._parked]
            assert [[command[1] for command in commands] for commands in owed] == [
                [_EXTEND.sha],
                [_RELEASE.sha],
            ]
        for _ in range(3):
            again = lock(name, ttl=30, backend=alias)
            assert again.acquire(blocking=False)
            records = [client.hgetall(lock_key(name)) for client in clients(masters)]
            assert [r[b"token"] for r in records] == [again._token.encode()] * 3
            again.release()
        assert len(backend.nodes[2].server._parked) <= wire.MAX_PARKED


def test_a_stalled_node_costs_at_most_max_parked_connections(make_masters):
    """A node that stays stalled: each release parks one more connection until
    MAX_PARKED, then a round waits for the oldest, which is closed once its deadline
    passed (its replies could otherwise reach a later round). The other nodes still
    decide every operation."""
    masters = make_masters(3)
    slow = clients(masters)[2]
    with alias_on(masters.urls, NODE_TIMEOUT=0.3) as alias:
        server = locks[alias].nodes[2].server
        with writes_paused(slow):
            for _ in range(wire.MAX_PARKED + 2):
                held = lock(unique(), ttl=30, backend=alias)
                assert held.acquire(blocking=False)  # the stalled node: a failed "no"
                held.release()
                assert len(server._parked) <= wire.MAX_PARKED
            oldest = server._parked[0].link
            time.sleep(0.4)  # every parked connection's deadline passes
            held = lock(unique(), ttl=30, backend=alias)
            assert held.acquire(blocking=False)
            assert oldest.conn._sock is None, "a connection late past its deadline is closed"
            assert server._parked == []
        held.release()


@contextlib.contextmanager
def unreachable_address():
    """A 127.0.0.1 address whose TCP connects time out, as a host behind a partition
    that drops packets: a listener that never accepts, its queue full (Linux drops
    the SYNs that find it so)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    queued = []
    try:
        while True:
            sock = socket.socket()
            sock.settimeout(0.3)
            try:
                sock.connect(("127.0.0.1", port))
            except TimeoutError:
                sock.close()
                break
            queued.append(sock)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for sock in [*queued, listener]:
            sock.close()


def test_a_master_whose_connect_timed_out_is_skipped_for_a_while(make_masters, monkeypatch):
    """Review r143: a round connects to its masters one after another, so a master
    whose TCP connects time out cost every round (acquire, release) its whole
    NODE_TIMEOUT, one such master after another. Once its connect timed out, no new
    connection to it is tried for SKIP_AFTER_CONNECT_TIMEOUT: rounds count it as
    failed at once, and the other two decide."""
    monkeypatch.setattr(wire, "SKIP_AFTER_CONNECT_TIMEOUT", 30.0)
    masters = make_masters(3)
    with unreachable_address() as url:
        with alias_on([*masters.urls[:2], url], NODE_TIMEOUT=0.2) as alias:
            server = locks[alias].nodes[2].server
            connects = []
            new_connection = server._new_connection
            server._new_connection = lambda: connects.append(1) or new_connection()
            for _ in range(10):
                with lock(unique(), ttl=30, backend=alias) as held:
                    assert held.owned()
            assert len(connects) == 1, "every round waited to connect again"
            server._skip_until = 0.0  # as if the 30 s were over
            with lock(unique(), ttl=30, backend=alias) as held:
                assert held.owned()
            assert len(connects) == 2, "not tried again once the time was over"
            masters.servers[0].kill()  # no majority now: the error says why
            with pytest.raises(LockBackendError, match="connecting timed out less than 30 s"):
                lock(unique(), ttl=30, backend=alias).acquire(blocking=False)


def test_a_stalled_tls_master_is_tried_again_by_the_next_round(make_masters):
    """Review r145: redis-py reports a TLS handshake that timed out (a stalled
    master: the kernel took the connection) as a connect that did, and such a master
    was skipped for SKIP_AFTER_CONNECT_TIMEOUT after it went on: with another master
    down, every lock failed for that second. TLS masters are never skipped."""
    masters = make_masters(3, tls=range(3))
    down, _, stalled = masters.servers
    with alias_on(masters.urls, NODE_TIMEOUT=0.2) as alias:
        with lock(unique(), ttl=30, backend=alias) as held:  # connected to all three
            assert held.owned()
        down.kill()
        os.kill(stalled.process.pid, signal.SIGSTOP)
        try:
            for _ in range(2):  # its idle connection's read, then a new one's handshake
                with pytest.raises(LockBackendError, match="TimeoutError"):
                    lock(unique(), ttl=30, backend=alias).acquire(blocking=False)
        finally:
            os.kill(stalled.process.pid, signal.SIGCONT)
        with lock(unique(), ttl=30, backend=alias) as held:
            assert held.owned()


def test_an_error_reply_is_not_a_confirmation(make_masters):
    """One node refuses writes (NOREPLICAS) while another is slow: the error is not
    counted among the confirmations, so release waits for the slow node's 1 and
    returns normally, as when every node was awaited (review r97: an error reply
    once counted as a 1, ended the round at two answers and raised "only 1 of 3")."""
    masters = make_masters(3)
    failing, _, slow = clients(masters)
    with alias_on(masters.urls, NODE_TIMEOUT=10) as alias:
        for operation in ("extend", "release"):
            held = lock(unique(), ttl=30, backend=alias)
            assert held.acquire(blocking=False)
            failing.config_set("min-replicas-to-write", 1)
            try:
                slow.execute_command("CLIENT", "PAUSE", 300, "WRITE")  # ends by itself
                getattr(held, operation)()
            finally:
                failing.config_set("min-replicas-to-write", 0)
            if operation == "extend":
                held.release()


def test_a_late_noscript_is_run_again_with_eval(make_masters):
    """The slow node lost its script cache (SCRIPT FLUSH) before a release that did
    not wait for it: its late NOSCRIPT means the release did not run there, so it is
    sent again with EVAL when the connection is drained, and the record goes (review
    r97: it stayed until its ttl, and so did every later one)."""
    masters = make_masters(3)
    name = unique()
    slow = clients(masters)[2]
    with alias_on(masters.urls, NODE_TIMEOUT=30) as alias:
        server = locks[alias].nodes[2].server
        held = lock(name, ttl=30, backend=alias)
        assert held.acquire(blocking=False)
        slow.script_flush()
        with writes_paused(slow):
            held.release()
            assert [p.owed[0][1] for p in server._parked] == [_RELEASE.sha]
        assert locks[alias].get(unique()) is None  # a round that drains the node first
        # Sent before that round's own call, on another connection: run first.
        assert slow.exists(lock_key(name)) == 0, "the release ran with EVAL"
        again = lock(name, ttl=30, backend=alias)
        assert again.acquire(blocking=False)
        again.release()


def test_a_late_error_reply_is_logged(make_masters, caplog):
    """An error that a round did not wait for is nobody's return value: it is
    logged with the node, once a minute at most (review r98: once per call)."""
    masters = make_masters(3)
    slow = clients(masters)[2]
    with alias_on(masters.urls, NODE_TIMEOUT=30) as alias:
        held = [lock(unique(), ttl=30, backend=alias) for _ in range(3)]
        for each in held:
            assert each.acquire(blocking=False)
        with writes_paused(slow):
            for each in held:
                each.release()
            slow.config_set("min-replicas-to-write", 1)  # the late releases will fail
        try:
            with caplog.at_level(logging.WARNING, logger="django_setnx"):
                for _ in held:
                    assert locks[alias].get(unique()) is None
        finally:
            slow.config_set("min-replicas-to-write", 0)
    [message] = [r.getMessage() for r in caplog.records if "not awaited" in r.getMessage()]
    assert label(masters.servers[2]) in message and "NOREPLICAS" in message, message


def test_a_late_noscript_past_its_rounds_deadline_reruns_a_release_only(make_masters):
    """A late NOSCRIPT read after its round's deadline: an extend is not run again
    (it could revive a record that expired since, review r98) but its script is
    loaded again; a release is run again however late (token-checked, review r99:
    left undone, it stayed until its ttl there, and so did every later one)."""
    masters = make_masters(3)
    name = unique()
    first, _, slow = clients(masters)
    with alias_on(masters.urls, NODE_TIMEOUT=0.3) as alias:
        held = lock(name, ttl=30, backend=alias)
        assert held.acquire(blocking=False)
        before = slow.hget(lock_key(name), "expires")
        slow.script_flush()
        with writes_paused(slow):
            held.extend(60)
        time.sleep(0.5)  # the NOSCRIPT is in; the extend's round deadline has passed
        assert locks[alias].get(unique()) is None  # drains the node
        assert slow.hget(lock_key(name), "expires") == before, "extended past its round"
        assert first.hget(lock_key(name), "expires") != before
        assert slow.script_exists(_EXTEND.sha) == [True], "loaded again"

        slow.script_flush()
        with writes_paused(slow):
            held.release()
        time.sleep(0.5)
        assert locks[alias].get(unique()) is None  # drains the node: EVAL sent first
        assert [c.exists(lock_key(name)) for c in clients(masters)] == [0, 0, 0]


def test_a_forked_child_never_reads_the_parents_late_replies(make_masters, tmp_path):
    """Connections parked in the parent (a slow master's late replies due) are
    closed in a forked child, never drained there: the child's rounds get their own
    replies, and the late replies stay for the parent, which drains its connections
    and uses them again."""
    masters = make_masters(3)
    slow = clients(masters)[2]
    names = [unique() for _ in range(2)]
    with alias_on(masters.urls, NODE_TIMEOUT=30) as alias:
        server = locks[alias].nodes[2].server
        held = [lock(name, ttl=30, backend=alias) for name in names]
        for each in held:
            assert each.acquire(blocking=False)
        with writes_paused(slow):
            for each in held:
                each.release()
            assert len(server._parked) == 2
        report = tmp_path / "child.txt"
        pid = os.fork()  # the late replies are on their way to the shared sockets
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                for _ in range(5):
                    mine = lock(unique(), ttl=30, backend=alias)
                    assert mine.acquire(blocking=False) and mine.owned()
                    mine.release()
                report.write_text("ok")
                code = 0
            except BaseException as exc:  # noqa: BLE001
                report.write_text(repr(exc))
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            assert time.monotonic() < deadline, "the child hangs"
            time.sleep(0.05)
        assert report.read_text() == "ok"
        for _ in names:
            link = server._unparked(os.getpid(), wait=True)
            assert link is not None, "the parent's late replies were read elsewhere"
            server.give_back(link)
        assert server._parked == []
        for client in clients(masters):
            assert [client.exists(lock_key(name)) for name in names] == [0, 0]


def test_a_wait_for_a_parked_link_ends_at_its_deadline_even_after_a_resend(make_masters):
    """A round waiting for a parked link (at MAX_PARKED) waits until the deadline the
    link had, not for the reply to a call sent again meanwhile (review r100: after
    a script flush it waited twice NODE_TIMEOUT)."""
    masters = make_masters(3)
    client = clients(masters)[0]
    with alias_on(masters.urls) as alias:
        server = locks[alias].nodes[0].server
        link = server.take()
        script = "return 1"  # not cached: its EVALSHA gets NOSCRIPT at once
        sha = hashlib.sha1(script.encode()).hexdigest()
        link.sock.send(hiredis.pack_command(("EVALSHA", sha, 0)))
        time.sleep(0.2)  # the NOSCRIPT is in
        server.scripts = {**server.scripts, sha: (script, True)}
        parked = wire._Parked(link, [("EVALSHA", sha, 0)], time.monotonic() + 0.3, 30)
        client.execute_command("CLIENT", "PAUSE", 5000, "WRITE")  # holds the EVAL
        try:
            assert server._drain(parked, wait=True) is False
            assert [command[0] for command in parked.owed] == ["EVAL"]
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
        link.conn.disconnect()


def test_parked_connections_are_drained_oldest_first(monkeypatch):
    """A pass over the parked connections that finds a newer one ready leaves the
    others in deadline order, and a round that must wait waits for the oldest
    (review r98: the pass rotated the list)."""
    ready = set()
    monkeypatch.setattr(
        wire.Server, "_drain", lambda self, parked, wait: parked.link.name in ready or wait
    )

    class Conn:
        pid = os.getpid()

        def disconnect(self):
            pass

    class Link:
        conn = Conn()

        def __init__(self, name):
            self.name = name

    server = wire.Server("node", None, tls=False)
    for age, name in enumerate("ABCD"):
        server.park(wire._Parked(Link(name), [], time.monotonic() + 100 - age, 1.0))
    assert [p.link.name for p in server._parked] == ["D", "C", "B", "A"]
    ready.add("B")
    assert server._unparked(os.getpid(), wait=False) is not None
    assert [p.link.name for p in server._parked] == ["D", "C", "A"]
    assert server._unparked(os.getpid(), wait=True) is not None
    assert [p.link.name for p in server._parked] == ["C", "A"]


# -- brand-new masters and trustlocknodes -------------------------------------------------


def test_untrusted_masters_are_an_error_naming_them_and_the_command(make_masters):
    masters = make_masters(3, trusted=False)
    name = unique()
    with alias_on(masters.urls, alias="fresh") as alias:
        with pytest.raises(LockBackendError) as raised:
            lock(name, backend=alias).acquire(timeout=5)
        message = str(raised.value)
        for server in masters.servers:
            assert f"{label(server)} (votes in 3600 s)" in message, message
        assert "none may vote" in message and "MAX_TTL = 3600 s" in message, message
        assert "manage.py trustlocknodes --backend fresh" in message, message
        assert not any(c.exists(lock_key(name)) for c in clients(masters)), (
            "untrusted masters grant nothing"
        )

        # One master trusted: still no trusted majority; the other two are named.
        first, second, _ = clients(masters)
        first.set(MARKER, 0)  # "trusted after" the epoch
        with pytest.raises(LockBackendError, match="only 1 may vote") as raised:
            lock(name, backend=alias).acquire(blocking=False)
        assert label(masters.servers[0]) not in str(raised.value)
        assert all(label(s) in str(raised.value) for s in masters.servers[1:])

        # Two of three trusted: a trusted majority, the lock works (the third is only
        # logged about).
        second.set(MARKER, 0)
        with lock(name, backend=alias, timeout=5) as lk:
            assert lk.owned()


def command(*args, answer=None, monkeypatch=None, **options):
    """Run trustlocknodes; returns its stdout. ``answer`` is typed at the prompt."""
    if monkeypatch is not None:

        def fake_input(prompt):
            if answer is None:
                raise AssertionError(f"unexpected prompt: {prompt}")
            return answer

        monkeypatch.setattr(builtins, "input", fake_input)
    out = StringIO()
    call_command("trustlocknodes", *args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


def test_trustlocknodes_dry_run_then_confirmed(make_masters, monkeypatch):
    masters = make_masters(3, trusted=False)
    first, second, third = masters.servers
    with alias_on(masters.urls, alias="fresh") as alias:
        # A client met the first master only, 100 s ago (its marker, by its clock).
        client = redis.Redis(port=first.port)
        seconds, micros = client.time()
        client.set(MARKER, seconds * 1000 + micros // 1000 + 3500 * 1000)
        client.set(f"{MARKER}:run", client.info("server")["run_id"])  # that client's check

        out = command("--backend", alias, "--dry-run", monkeypatch=monkeypatch)
        assert f"{label(first)}  untrusted: votes in 3500 s" in out, out
        for server in (second, third):
            assert (
                f"{label(server)}  no marker (brand-new, or restarted empty): sits out "
                f"for 3600 s from the first acquire that reaches it" in out
            ), out
        assert "trusted now" not in out
        with pytest.raises(LockBackendError):  # a dry run changes nothing
            lock(unique(), backend=alias).acquire(blocking=False)

        # Declined at the prompt: nothing is trusted.
        with pytest.raises(CommandError, match="cancelled: no master was marked trusted"):
            command("--backend", alias, answer="no", monkeypatch=monkeypatch)
        with pytest.raises(LockBackendError):
            lock(unique(), backend=alias).acquire(blocking=False)

        out = command("--backend", alias, answer="yes", monkeypatch=monkeypatch, force_color=True)
        assert "\x1b[" in out and "3 masters trusted now" in out, out
        assert all(label(s) in out for s in (first, second, third))
        with lock(unique(), backend=alias, timeout=5) as lk:
            assert lk.owned()
        out = command("--backend", alias, monkeypatch=monkeypatch)
        assert "every master votes already; nothing to do" in out, out


def test_trustlocknodes_brand_new_set_noinput_and_a_master_down(make_masters, monkeypatch):
    masters = make_masters(3, trusted=False)
    with alias_on(masters.urls, alias="fresh") as alias:
        out = command("--dry-run", monkeypatch=monkeypatch)  # every Redlock alias
        assert out.count("no marker (brand-new, or restarted empty)") == 3, out

        masters.servers[2].kill()
        with pytest.raises(CommandError, match=f"{label(masters.servers[2])} did not answer"):
            command("--backend", alias, "--noinput", monkeypatch=monkeypatch)
        # The two that answered were trusted: a majority, the lock works.
        with lock(unique(), backend=alias, timeout=5) as lk:
            assert lk.owned()


def test_trustlocknodes_refuses_unknown_and_other_aliases(redlock_masters3):
    with pytest.raises(CommandError, match="Unknown lock backend 'nope'"):
        call_command("trustlocknodes", "--backend", "nope", "--noinput")
    with pytest.raises(CommandError, match="'locmem' is a LocMemBackend, not a RedlockBackend"):
        call_command("trustlocknodes", "--backend", "locmem", "--noinput")
    only_locmem = {"locmem": settings.SETNX_LOCKS["locmem"]}
    with (
        override_settings(SETNX_LOCKS=only_locmem),
        pytest.raises(CommandError, match="No Redlock backend is configured"),
    ):
        call_command("trustlocknodes", "--noinput")
    locks.close_all()


# -- masters that may evict keys ---------------------------------------------------------


def test_a_master_that_may_evict_is_refused(make_masters, caplog):
    masters = make_masters(3, server_args={2: EVICTING})
    evicting = masters.servers[2]
    name = unique()
    with alias_on(masters.urls) as alias, caplog.at_level(logging.ERROR, "django_setnx"):
        with lock(name, ttl=10, backend=alias, timeout=5):
            written = [c.exists(lock_key(name)) for c in clients(masters)]
        assert written == [1, 1, 0], "nothing is written to the master that may evict"
        assert any(
            label(evicting) in r.getMessage()
            and "'allkeys-lru'" in r.getMessage()
            and "ALLOW_EVICTION" in r.getMessage()
            for r in caplog.records
        ), caplog.text

    with (
        alias_on(masters.urls, ALLOW_EVICTION=True) as alias,
        lock(name, ttl=10, backend=alias, timeout=5),
    ):
        assert all(c.exists(lock_key(name)) for c in clients(masters)), (
            "ALLOW_EVICTION accepts the risk"
        )


def test_two_masters_that_may_evict_are_a_quorum_error(make_masters):
    masters = make_masters(3, server_args={0: EVICTING, 2: EVICTING})
    with alias_on(masters.urls) as alias, pytest.raises(LockBackendError) as raised:
        lock(unique(), backend=alias).acquire(timeout=5)
    message = str(raised.value)
    assert "only 1 of 3 Redis nodes answered" in message, message
    for server in (masters.servers[0], masters.servers[2]):
        assert f"Redis {label(server)} has maxmemory-policy 'allkeys-lru'" in message, message


def test_each_new_connection_is_checked(make_masters):
    """A master reconfigured to evict is refused from its next connection on, and
    accepted again once it no longer may evict."""
    masters = make_masters(3)
    first = clients(masters)[0]
    name = unique()
    with alias_on(masters.urls) as alias:
        with lock(name, ttl=10, backend=alias, timeout=5):
            assert first.exists(lock_key(name))
        first.config_set("maxmemory", "64mb")
        first.config_set("maxmemory-policy", "volatile-lru")
        first.client_kill_filter(_type="normal", skipme=True)  # our connections drop
        with lock(name, ttl=10, backend=alias, timeout=5):
            assert not first.exists(lock_key(name)), "refused on its new connection"
        first.config_set("maxmemory-policy", "noeviction")
        first.client_kill_filter(_type="normal", skipme=True)
        with lock(name, ttl=10, backend=alias, timeout=5):
            assert first.exists(lock_key(name)), "accepted again"


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl",
    [0, -1, math.nan, True, "10", 10**400],
    ids=["zero", "negative", "nan", "bool", "str", "huge-int"],
)
def test_bad_ttl_is_refused_before_anything_is_written(redlock_masters3, ttl):
    name = unique()
    with alias_on(redlock_masters3.urls) as alias:
        backend = locks[alias]
        with pytest.raises((TypeError, ValueError), match=r"ttl .*(number|finite)"):
            backend.acquire(name, "t1", ttl, OWNER)
        for client in clients(redlock_masters3):
            assert not client.exists(lock_key(name)) and not client.exists(fence_key(name))

        assert backend.acquire(name, "t2", 10, OWNER).acquired
        expires = backend.get(name).expires_at_ms
        with pytest.raises((TypeError, ValueError)):
            backend.extend(name, "t2", ttl)
        assert backend.get(name).expires_at_ms == expires, "extend wrote nothing"
        backend.release(name, "t2")


def test_max_ttl_option_and_unknown_options_are_warned_about(redlock_masters3):
    params = {
        "BACKEND": "django_setnx.backends.redlock.RedlockBackend",
        "LOCATION": redlock_masters3.urls,
        "KEY_PREFIX": "setnx-test",
        "OPTIONS": {"MAX_TTL": 7200, "NODE_TIMEOUTS": 1},
    }
    assert not [m for m in RedlockBackend.check_params("rl", params) if m.id.endswith("E039")]
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "rl": params}):
        messages = {(m.id, m.msg) for m in run_checks(tags=["django_setnx"])}
        assert (
            "django_setnx.W002",
            ("SETNX_LOCKS['rl']['OPTIONS'] has an unknown key 'NODE_TIMEOUTS'; it is ignored."),
        ) in messages
        assert not [m for m in messages if m[0].startswith("django_setnx.E")], messages
        backend = locks["rl"]
        assert backend.max_ttl == 7200
        name = unique()
        assert backend.acquire(name, "t", 3601, OWNER).acquired
        backend.release(name, "t")
        locks.close_all()
    with alias_on(redlock_masters3.urls) as alias:
        assert locks[alias].max_ttl == 3600, "Redlock's default MAX_TTL"
        with pytest.raises(
            ValueError,
            match=rf"3601 s is above the maximum of 3600 s "
            rf"\(SETNX_LOCKS\['{alias}'\]",
        ):
            locks[alias].acquire(unique(), "t", 3601, OWNER)


def test_records_that_cannot_be_read_never_crash_get_or_list(redlock_masters3):
    garbled, not_json, wrong_type = unique("bad"), unique("bad"), unique("bad")
    for client in clients(redlock_masters3):
        client.hset(lock_key(garbled), mapping={"token": "x", "fencing": "abc"})
        client.hset(
            lock_key(not_json),
            mapping={
                "token": "x",
                "fencing": 1,
                "owner": "{not json",
                "acquired": 1,
                "expires": 2,
            },
        )
        client.set(lock_key(wrong_type), "a string, not a hash")
    with alias_on(redlock_masters3.urls) as alias:
        backend = locks[alias]
        for name in (garbled, not_json, wrong_type):
            info = backend.get(name)
            assert info.state == "stale" and info.fencing_token == 0, info
            assert "unreadable" in info.owner
        listed = {i.name: i for i in backend.list(name_glob="bad-*")}
        assert set(listed) == {garbled, not_json}, "SCAN lists lock hashes only"
        assert all(i.is_stale and "unreadable" in i.owner for i in listed.values())
        out = StringIO()
        call_command("listlocks", "--backend", alias, "--name", "bad-*", stdout=out)
        assert garbled in out.getvalue() and not_json in out.getvalue()
    for client in clients(redlock_masters3):
        client.delete(lock_key(garbled), lock_key(not_json), lock_key(wrong_type))


# -- globs ---------------------------------------------------------------------------------


def test_name_globs_follow_django_setnx_globs_not_redis(redlock_masters3):
    """``[!a]`` is "any character but a" in django_setnx.globs; Redis' own MATCH reads
    it as "! or a". SCAN only narrows by the literal prefix; the glob decides."""
    prefix = unique("glob")
    names = {c: f"{prefix}-{c}" for c in "ab!"}
    with alias_on(redlock_masters3.urls) as alias:
        backend = locks[alias]
        for name in names.values():
            assert backend.acquire(name, "t", 30, OWNER).acquired
        pattern = f"{prefix}-[!a]"
        assert {i.name for i in backend.list(name_glob=pattern)} == {names["b"], names["!"]}
        with pytest.raises(ValueError, match="without a closing"):
            backend.list(name_glob=f"{prefix}-[a")
        with pytest.raises(ValueError, match="without a closing"):
            backend.clear(include_held=True, name_glob=f"{prefix}-[a")
        removed = backend.clear(include_held=True, name_glob=pattern).names
        assert sorted(removed) == sorted([names["b"], names["!"]])
        assert {i.name for i in backend.list(name_glob=f"{prefix}-*")} == {names["a"]}
        backend.release(names["a"], "t")


def test_threads_share_a_stalling_nodes_parked_connections(make_masters, monkeypatch):
    """Sixteen threads lock, extend and release names of their own while one node
    stalls again and again (its writes paused for 20–80 ms at a time, well within
    NODE_TIMEOUT, so its late replies all come in time; a round does not wait for
    them once the other two confirmed). The threads share that node's parked
    connections, each taking one only once its late replies were read: every
    operation gets its own answer (an acquire wins, an extend and a release find
    the lock theirs; a reply read by the wrong round would say otherwise), and
    every call reaches the node (no parked connection is closed with a call
    unanswered: once the node answers again, no released record is left on it).
    No more are parked at once than MAX_PARKED, plus one per other thread."""
    masters = make_masters(3)
    slow = clients(masters)[2]
    failures, names, peak = [], [], [0]
    stop = threading.Event()
    park = wire.Server.park

    def counted_park(server, parked):
        park(server, parked)
        peak[0] = max(peak[0], len(server._parked))

    monkeypatch.setattr(wire.Server, "park", counted_park)

    def stall():
        # UNPAUSE, not a pause's own timeout: Redis notices that late (a postponed
        # client could wait over a second), and the stall must stay short.
        pauses = random.Random(7)
        while not stop.is_set():
            slow.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
            try:
                time.sleep(pauses.uniform(0.02, 0.08))
            finally:
                slow.execute_command("CLIENT", "UNPAUSE")
            time.sleep(pauses.uniform(0.01, 0.05))

    def work(seed):
        for _ in range(15):
            name = unique(f"thread{seed}")
            names.append(name)
            try:
                held = lock(name, ttl=30, backend=alias)
                assert held.acquire(blocking=False), "acquire lost"
                held.extend(30)
                held.release()
            except Exception as exc:  # noqa: BLE001 -- collected for the assertion
                failures.append(repr(exc))

    with alias_on(masters.urls, NODE_TIMEOUT=1) as alias:
        staller = threading.Thread(target=stall)
        staller.start()
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(16)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        finally:
            stop.set()
            staller.join(10)
        assert failures == [], failures[:5]
        assert peak[0] > 0, "the node never fell behind: nothing was shared"
        assert peak[0] <= wire.MAX_PARKED + len(threads) - 1, peak[0]
        deadline = time.monotonic() + 5
        while left := [name for name in names if slow.exists(lock_key(name))]:
            assert time.monotonic() < deadline, f"{len(left)} released records left on the node"
            time.sleep(0.05)


def test_one_master_out_of_tokens_refuses_the_lock_not_a_smaller_token(redlock_masters3):
    """Review r160: with one master's remembered token at 2**53 - 1, its error was
    counted as a node that did not answer, and the other two granted the lock with
    tokens from their clocks: seven quadrillion below the last one given."""
    name = unique()
    with alias_on(redlock_masters3.urls) as alias:
        with lock(name, ttl=10, backend=alias):
            pass
        first = redis.Redis.from_url(redlock_masters3.urls[0])
        assert first.set(f"setnx-test:{{{name}}}:fence", 2**53 - 2, px=60_000, xx=True)
        first.close()
        crashed = lock(name, ttl=0.3, backend=alias)  # never released: its holder died
        assert crashed.acquire(blocking=False)
        assert crashed.fencing_token == 2**53 - 1  # the largest of the masters' tokens
        time.sleep(0.5)  # expired: only the first master's record knows that token
        for _ in range(2):
            with pytest.raises(LockBackendError, match="fencing tokens exhausted"):
                lock(name, ttl=10, backend=alias).acquire(blocking=False)
        assert locks[alias].get(name) is None or not locks[alias].get(name).is_held
