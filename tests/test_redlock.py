"""Redlock-specific behaviour of RedlockBackend, against real redis-servers.

The contract every backend keeps runs on Redlock through ``tests/test_contract.py``
and ``tests/test_races.py`` (the ``redlock`` alias of ``tests/scaleout_plugin.py``).
This module covers what only Redlock has: quorums with 3 and 5 masters and killed
nodes, the parallel round, the validity window, fencing across diverging node
counters, the delayed-restart rule, the majority view of list/get, and the checks.
"""

import contextlib
import os
import shutil
import signal
import socket
import time
import uuid

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

if "redis" not in settings.TEST_BACKENDS:
    pytest.skip("redis is not in settings.TEST_BACKENDS", allow_module_level=True)

import redis

from django_setnx import lock, locks
from django_setnx.backends.redlock import RedlockBackend
from django_setnx.exceptions import LockBackendError, LockNotOwned
from tests.scaleout_plugin import redlock_settings
from tests.servers import DelayingProxy, RedisServer

PREFIX = "setnx-test"
OWNER = {"host": "test", "pid": 1, "thread": "t"}


def unique(label="rl"):
    return f"{label}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def alias_on(urls, alias="rl", ttl=None, **options):
    """Configure ``alias`` as a Redlock over ``urls`` for the duration."""
    params = redlock_settings(urls, **options)
    if ttl is not None:
        params["TTL"] = ttl
    configured = {**settings.SETNX_LOCKS, alias: params}
    with override_settings(SETNX_LOCKS=configured):
        try:
            yield alias
        finally:
            locks.close_all()


def clients(masters):
    return [redis.Redis.from_url(url, socket_timeout=5) for url in masters.urls]


def lock_key(name):
    return f"{PREFIX}:{{{name}}}:lock"


def fence_key(name):
    return f"{PREFIX}:{{{name}}}:fence"


MARKER = f"{PREFIX}:__node__"


# -- quorum ------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [3, 5])
def test_lock_is_written_on_every_master(count, request):
    masters = request.getfixturevalue(f"redlock_masters{count}")
    name = unique()
    with alias_on(masters.urls) as alias:
        with lock(name, ttl=10, backend=alias) as lk:
            tokens, minted = set(), []
            for client in clients(masters):
                fields = client.hgetall(lock_key(name))
                tokens.add(fields[b"token"])
                minted.append(int(fields[b"fencing"]))
            assert len(tokens) == 1, "the same token on every master"
            assert max(minted) == lk.fencing_token, "the largest token any master minted"
            assert lock(name, backend=alias).acquire(blocking=False) is False
        assert not any(c.exists(lock_key(name)) for c in clients(masters))


@pytest.mark.parametrize("count, survivable", [(3, 1), (5, 2)])
def test_minority_down_still_works_majority_down_fails_cleanly(count, survivable, make_masters):
    masters = make_masters(count)
    name = unique()
    with alias_on(masters.urls) as alias:
        # A minority killed: acquire, contention, extend and release all still work.
        for server in masters.servers[:survivable]:
            server.kill()
        lk = lock(name, ttl=10, backend=alias)
        assert lk.acquire(blocking=False)
        assert lock(name, backend=alias).acquire(blocking=False) is False
        lk.extend(20)
        assert lk.owned() and lk.info().expires_in > 10
        lk.release()
        assert not lk.locked()

        # One more: the majority is gone. The node that still answers cannot tell
        # anything: LockBackendError at once (not a contention), naming the nodes.
        masters.servers[survivable].kill()
        down = [f"127.0.0.1:{s.port}" for s in masters.servers[: survivable + 1]]
        with pytest.raises(
            LockBackendError, match=f"only {count - survivable - 1} of {count}"
        ) as refused:
            lock(name, ttl=10, backend=alias).acquire(timeout=5)
        assert all(label in str(refused.value) for label in down)
        # Nothing is left behind on the nodes that answered (the partial grants
        # were released).
        for server in masters.servers[survivable + 1 :]:
            assert not redis.Redis(port=server.port).exists(lock_key(name))

        # Every node down: the backend cannot be reached at all.
        for server in masters.servers:
            server.kill()
        with pytest.raises(LockBackendError, match=f"'{alias}'.*no Redis node answered"):
            lock(name, backend=alias).acquire(blocking=False)

        # Back (empty, so untrusted, see the delayed-restart tests): acquire resumes
        # once they are trusted again.
        for server in masters.servers:
            server.start()
        with pytest.raises(LockBackendError, match="trustlocknodes"):
            lock(name, backend=alias).acquire(blocking=False)
        locks[alias].trust_nodes()
        assert lock(name, backend=alias).acquire(blocking=False) is True


def test_release_and_extend_need_a_majority(make_masters):
    masters = make_masters(3)
    a, b, c = clients(masters)
    name = unique()
    with alias_on(masters.urls) as alias:
        lk = lock(name, ttl=10, backend=alias)
        lk.acquire()
        # Two of the three records are gone (a forced release on those masters):
        # the lock no longer has a majority, so extend reports it lost...
        a.delete(lock_key(name))
        b.delete(lock_key(name))
        assert not lk.owned()
        with pytest.raises(LockNotOwned):
            lk.extend()
        # ...and what was left of it was released, so it blocks nobody.
        assert not c.exists(lock_key(name))

        lk2 = lock(name, ttl=10, backend=alias)
        lk2.acquire()
        a.delete(lock_key(name))
        b.delete(lock_key(name))
        with pytest.raises(LockNotOwned):
            lk2.release()


def test_slow_nodes_are_waited_for_in_parallel(make_masters):
    """Two stopped (SIGSTOP) masters of five cost one NODE_TIMEOUT, not two.

    Judged by Redlock's own validity rule rather than a stopwatch: the ttl outlives
    one NODE_TIMEOUT but not two, so the acquire is valid only if the two silent
    masters were waited for at the same time.
    """
    masters = make_masters(5)
    timeout = 0.5
    name = unique()
    with alias_on(masters.urls, NODE_TIMEOUT=timeout) as alias:
        with lock(unique(), backend=alias):  # connect to every node first
            pass
        stopped = masters.servers[:2]
        for server in stopped:
            os.kill(server.process.pid, signal.SIGSTOP)
        try:
            lk = lock(name, ttl=timeout * 1.8, backend=alias)
            assert lk.acquire(blocking=False), "3 of 5 answered within one NODE_TIMEOUT"
            lk.release()
        finally:
            for server in stopped:
                os.kill(server.process.pid, signal.SIGCONT)


def test_without_hiredis_through_redis_py(make_masters, monkeypatch):
    """The rounds also run through redis-py's own connection methods (the path
    taken without hiredis, or over TLS)."""
    from django_setnx.backends import redlock_wire

    monkeypatch.setattr(redlock_wire, "hiredis", None)
    masters = make_masters(3)
    name = unique()
    with alias_on(masters.urls) as alias:
        lk = lock(name, ttl=10, backend=alias)
        assert lk.acquire(blocking=False)
        assert not any(node.server.fast for node in locks[alias].nodes)
        assert lock(name, backend=alias).acquire(blocking=False) is False
        masters.servers[1].kill()
        lk.extend(20)
        assert lk.owned() and lk.info().fencing_token == lk.fencing_token
        lk.release()
        with lock(name, backend=alias) as again:
            assert again.fencing_token > lk.fencing_token


def test_validity_window(redlock_masters3):
    """A lock whose ttl is spent before the majority answered is not reported won."""
    name = unique()
    with alias_on(redlock_masters3.urls, NODE_TIMEOUT=0.5) as alias:
        backend = locks[alias]
        # ttl - drift (1 ms * 0.01 + 2 ms) < 0: no validity left, whatever the latency.
        assert backend.acquire(name, "t1", 0.001, OWNER).acquired is False
        assert not any(c.exists(lock_key(name)) for c in clients(redlock_masters3)), (
            "the grants of an invalid acquire are released"
        )
        assert backend.acquire(name, "t2", 1, OWNER).acquired is True
        backend.release(name, "t2")


def test_ttl_above_max_ttl_is_refused(redlock_masters3):
    with alias_on(redlock_masters3.urls, ttl=5, MAX_TTL=5) as alias:
        with pytest.raises(ValueError, match=r"ttl 6 s is above the maximum of 5 s .*MAX_TTL"):
            lock(unique(), ttl=6, backend=alias).acquire()
        lk = lock(unique(), ttl=5, backend=alias)
        lk.acquire()
        with pytest.raises(ValueError, match=r"ttl 10 s is above the maximum of 5 s .*MAX_TTL"):
            lk.extend(10)
        lk.release()


# -- fencing -----------------------------------------------------------------------------


def test_fencing_token_is_the_largest_and_remembered_by_every_master(make_masters):
    """A lock's token is the largest its majority minted, and its release makes every
    master remember that one: a later majority without the master that minted it
    still mints above it. (The masters here share one clock; a master whose
    remembered token is ahead of the clocks stands for one whose clock is ahead.)"""
    masters = make_masters(3)
    a, b, c = clients(masters)
    name = unique()
    ahead = int(a.time()[0]) * 1_000_000 + 10**12  # a token "from the future" on A only
    a.set(fence_key(name), ahead, px=60_000)
    with alias_on(masters.urls) as alias:
        with lock(name, backend=alias) as lk:
            assert lk.fencing_token == ahead + 1
            assert lk.info().fencing_token == ahead + 1
        # Released: every master remembers the largest token, not only A.
        assert [int(x.get(fence_key(name))) for x in (a, b, c)] == [ahead + 1] * 3
        assert all(0 < x.pttl(fence_key(name)) <= 60_000 for x in (a, b, c))
        masters.servers[0].kill()
        with lock(name, backend=alias) as lk2:
            assert lk2.fencing_token == ahead + 2, "B and C alone mint above it"


# -- the delayed-restart rule -----------------------------------------------------------


def test_master_restarted_empty_does_not_let_a_second_holder_in(make_masters):
    masters = make_masters(3)
    a, _, c = clients(masters)
    name = unique()
    max_ttl = 2.0
    with alias_on(masters.urls, ttl=max_ttl, MAX_TTL=max_ttl) as alias:
        holder = lock(name, ttl=max_ttl, backend=alias)
        assert holder.acquire(blocking=False)
        acquired_at = time.monotonic()
        # The holder's majority is {A, B}: C lost its record (as if its reply had
        # timed out). Then A crashes and comes back empty, at once.
        c.delete(lock_key(name))
        masters.servers[0].kill()
        masters.servers[0].start()

        second = lock(name, ttl=max_ttl, backend=alias)
        assert second.acquire(blocking=False) is False, (
            "A forgot the holder, but is untrusted: only C votes for the second client"
        )
        seconds, microseconds = a.time()  # one TIME: two could straddle a second
        remaining = int(a.get(MARKER)) - (seconds * 1000 + microseconds // 1000)
        assert 0 < remaining <= max_ttl * 1000, "A's marker: trusted after node_now + MAX_TTL"
        assert not a.exists(lock_key(name)), "an untrusted node grants nothing"

        # Prove the test can fail: without the rule (A's marker says trusted), A and
        # C form a majority and a second holder gets in while the first still holds.
        a.set(MARKER, 0)
        thief = lock(name, ttl=max_ttl, backend=alias)
        assert thief.acquire(blocking=False) is True
        assert time.monotonic() - acquired_at < max_ttl, "within the first holder's ttl"
        thief.release()


def test_restarted_master_votes_again_after_max_ttl(make_masters):
    masters = make_masters(3)
    a, _, _ = clients(masters)
    max_ttl = 1.0
    with alias_on(masters.urls, ttl=max_ttl, MAX_TTL=max_ttl) as alias:
        backend = locks[alias]
        masters.servers[0].kill()
        masters.servers[0].start()
        masters.servers[1].kill()  # B down: A's vote is needed for a majority
        name = unique()
        started = time.monotonic()
        with pytest.raises(
            LockBackendError,
            match=f"127.0.0.1:{masters.servers[0].port} "
            r"\(votes in \d+ s\)",
        ):
            backend.acquire(name, "t", 1, OWNER)  # creates A's marker
        while True:
            try:
                assert backend.acquire(name, "t", 1, OWNER).acquired
                break
            except LockBackendError:
                assert time.monotonic() - started < max_ttl + 5, "A never voted again"
                time.sleep(0.05)
        waited = time.monotonic() - started
        assert waited >= max_ttl * 0.9, f"A voted {waited:.3f} s after its restart"
        assert a.exists(lock_key(name))
        backend.release(name, "t")


def _saved_copy(server, client, persistence):
    """Keep a copy of ``server``'s data as it is now; returns the function that puts
    it back (with the server stopped): an RDB snapshot, or a backup of an AOF."""
    if persistence == "rdb":
        client.save()  # dump.rdb, loaded at the next start
        return lambda: None
    aof = os.path.join(server.dir, "appendonlydir")
    backup = shutil.copytree(aof, f"{aof}.backup")

    def restore():
        shutil.rmtree(aof)
        shutil.copytree(backup, aof)

    return restore


@pytest.mark.parametrize("persistence", ["rdb", "aof-always-backup"])
def test_master_restarted_with_part_of_its_data_does_not_let_a_second_holder_in(
    make_masters, caplog, persistence
):
    """Review r137: a master that restarts from an RDB snapshot (or an everysec AOF
    after a crash, or a backup, even of an appendfsync always AOF: review r138) keeps
    its marker but not the locks granted since: it voted at once and granted the
    holder's lock to a second client. Its run_id changed, so it now sits out until
    MAX_TTL after it started, like one that restarted empty."""
    always = ["--appendonly", "yes", "--appendfsync", "always"]
    masters = make_masters(3, server_args={0: always} if persistence != "rdb" else None)
    a, _, c = clients(masters)
    name = unique()
    max_ttl = 5.0
    with alias_on(masters.urls, ttl=max_ttl, MAX_TTL=max_ttl) as alias:
        assert all(s.trusted for s in locks[alias].node_status())
        restore = _saved_copy(masters.servers[0], a, persistence)  # no lock in it yet
        holder = lock(name, ttl=max_ttl, backend=alias)
        assert holder.acquire(blocking=False)
        c.delete(lock_key(name))  # the holder's majority is {A, B}
        masters.servers[0].kill()
        restore()
        masters.servers[0].start()  # A comes back with its older data
        assert a.exists(MARKER) and not a.exists(lock_key(name)), "part of A's data"

        second = lock(name, ttl=max_ttl, backend=alias)
        assert second.acquire(blocking=False) is False, (
            "A forgot the holder but sits out: only C votes for the second client"
        )
        assert not a.exists(lock_key(name)), "A granted nothing"
        seconds, microseconds = a.time()
        remaining = int(a.get(MARKER)) - (seconds * 1000 + microseconds // 1000)
        assert max_ttl * 1000 - 2000 < remaining <= max_ttl * 1000, "MAX_TTL after its start"
        assert "is another run of redis-server" in caplog.text
        with pytest.raises(LockNotOwned):
            holder.release()  # only B still has it: no majority confirms the release


def test_a_replica_promoted_behind_the_master_s_address_sits_out(make_masters):
    """Review r140: a replica promoted in the place of a master (a virtual IP moved to
    it) may lack the last locks (replication is asynchronous), and its run_id is its
    own: it sits out MAX_TTL, however long it has run (crediting its uptime let one
    that had run longer than MAX_TTL vote at once)."""
    masters = make_masters(3)
    first = masters.servers[0]
    max_ttl = 1.0
    with DelayingProxy(first.port) as address:  # A's address, moved later
        urls = [address.url, *masters.urls[1:]]
        with RedisServer("--replicaof", "127.0.0.1", first.port) as replica:
            promoted = redis.Redis(port=replica.port, socket_timeout=5)
            with alias_on(urls, MAX_TTL=max_ttl) as alias:
                backend = locks[alias]
                assert all(s.trusted for s in backend.node_status())  # A's run recorded
                deadline = time.monotonic() + 10
                while promoted.get(f"{MARKER}:run") is None:  # replicated
                    assert time.monotonic() < deadline, "the replica never synced"
                    time.sleep(0.05)
                time.sleep(max_ttl + 2.2)  # the replica has run longer than MAX_TTL
                first.kill()
                promoted.replicaof("NO", "ONE")
                address.target_port = replica.port
                status = backend.node_status()[0]  # reconnects through the address
                assert status.votes_in is not None and status.votes_in > max_ttl - 0.5, status
                assert promoted.get(f"{MARKER}:run") == promoted.info("server")["run_id"].encode()


@pytest.mark.parametrize("started_long_ago", [True, False])
def test_a_marker_without_a_run_key_is_adopted_unless_its_master_just_started(
    make_masters, started_long_ago
):
    """A marker written by a version that kept no run key (a rolling upgrade) is
    taken as it is on a master that started more than MAX_TTL ago. One that just
    started (from a snapshot taken before the upgrade, say: review r138) may have
    lost locks: it sits out until MAX_TTL after it started."""
    masters = make_masters(3)
    a, _, _ = clients(masters)
    max_ttl = 1.0 if started_long_ago else 30.0
    if started_long_ago:
        time.sleep(max_ttl + 2.2)  # uptime_in_seconds may read a second too much
    for client in clients(masters):
        client.delete(f"{MARKER}:run")
    with alias_on(masters.urls, MAX_TTL=max_ttl) as alias:
        statuses = locks[alias].node_status()
        assert all(client.exists(f"{MARKER}:run") for client in clients(masters))
    if started_long_ago:
        assert all(s.trusted for s in statuses)
    else:
        assert all(max_ttl - 5 < s.votes_in <= max_ttl for s in statuses), statuses
        assert int(a.get(MARKER)) > 0


def test_trust_nodes_and_marker_is_not_a_lock(redlock_masters3):
    with alias_on(redlock_masters3.urls) as alias:
        backend = locks[alias]
        assert backend.trust_nodes() == [f"127.0.0.1:{s.port}" for s in redlock_masters3.servers]
        assert all(c.exists(MARKER) for c in clients(redlock_masters3))
        assert all(not info.name.startswith("__node__") for info in backend.list())
        backend.clear(include_held=True)
        assert all(c.exists(MARKER) for c in clients(redlock_masters3)), (
            "clear never removes the marker"
        )


# -- the majority view ----------------------------------------------------------------------


def test_list_get_and_clear_union_of_nodes(make_masters):
    masters = make_masters(3)
    a, b, _ = clients(masters)
    with alias_on(masters.urls) as alias:
        backend = locks[alias]
        held, minority, gone = unique("held"), unique("minority"), unique("gone")
        lk = lock(held, ttl=30, backend=alias)
        lk.acquire()
        lk2 = lock(minority, ttl=30, backend=alias)
        lk2.acquire()
        # Only C still has `minority`: no majority holds it, so it is not held.
        a.delete(lock_key(minority))
        b.delete(lock_key(minority))
        infos = {i.name: i for i in backend.list()}
        assert set(infos) == {held, minority}, "each name once, whichever nodes have it"
        assert infos[held].state == "held" and infos[minority].state == "stale"
        assert backend.get(minority).state == "stale"
        assert not lk2.locked()
        assert lock(minority, ttl=30, backend=alias).acquire(blocking=False), (
            "A and B are free: a majority"
        )
        assert backend.get(gone) is None

        # A node that is down is left out of list, the others still answer.
        masters.servers[2].kill()
        assert {i.name for i in backend.list()} == {held, minority}
        assert backend.clear(include_held=True).names and list(backend.list()) == []


def test_clearlocks_command_on_redlock(redlock_masters3, capsys):
    names = [unique("cmd") for _ in range(30)]
    with alias_on(redlock_masters3.urls, alias="rlcmd") as alias:
        for name in names:
            assert lock(name, ttl=30, backend=alias).acquire(blocking=False)
        assert {i.name for i in locks[alias].list(name_glob="cmd-*")} == set(names)
        call_command("clearlocks", "--all", "--noinput", "--backend", alias)
        assert list(locks[alias].list(name_glob="cmd-*")) == []
        for client in clients(redlock_masters3):
            assert not any(client.exists(lock_key(n)) for n in names)


# -- checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, error_id, message",
    [
        ({"LOCATION": "redis://h1:6379/0"}, "E031", "must be a list of redis:// URLs"),
        ({"LOCATION": None}, "E031", "got None"),
        ({"LOCATION": ["redis://h1/0", 7, "redis://h3/0"]}, "E031", "got"),
        ({"LOCATION": ["redis://h1/0", "redis://h2/0"]}, "E032", "lists 2 master"),
        (
            {"LOCATION": ["redis://h1/0", "redis://h1/0", "redis://h3/0"]},
            "E033",
            "master(s) 2 point to the same server",
        ),
        (  # the same server written two ways (review r156 D12)
            {"LOCATION": ["redis://h1/0", "redis://H1:6379", "redis://h3/0"]},
            "E033",
            "master(s) 2 point to the same server",
        ),
        ({"OPTIONS": {"FENCING_RETENTION": 2e9}}, "E035", "above the 1e+09 s"),
        ({"OPTIONS": {"STALE_RETENTION": 2e9}}, "E035", "above the 1e+09 s"),
        ({"OPTIONS": {"FENCING_RETENTION": "x"}}, "E035", "must be a positive"),
        ({"OPTIONS": {"NODE_TIMEOUT": 1e300}}, "E035", "above the 60 s"),
        ({"OPTIONS": {"CLOCK_DRIFT_FACTOR": -5}}, "E036", "CLOCK_DRIFT_FACTOR"),
        ({"KEY_PREFIX": ""}, "E034", "KEY_PREFIX"),
        ({"KEY_PREFIX": "app:{t}"}, "E034", "must not contain '{' or '}'"),
        ({"OPTIONS": {"NODE_TIMEOUT": 0}}, "E035", "NODE_TIMEOUT'] must be a positive"),
        ({"OPTIONS": {"MAX_TTL": "1h"}}, "E035", "MAX_TTL'] must be a positive"),
        ({"OPTIONS": {"CLOCK_DRIFT_FACTOR": 1.5}}, "E036", "CLOCK_DRIFT_FACTOR"),
        ({"OPTIONS": {"CONNECTION_KWARGS": []}}, "E037", "CONNECTION_KWARGS"),
        ({"TTL": 120, "OPTIONS": {"MAX_TTL": 60}}, "E038", "'TTL'] = 120 s is above"),
        ({"OPTIONS": {"ALLOW_EVICTION": "yes"}}, "E039", "must be True or False"),
        ({"OPTIONS": []}, "E039", "must be a dict"),
    ],
)
def test_check_params(params, error_id, message):
    # Masters that are listening sockets of ours: the checks must never connect.
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    try:
        base = {
            "BACKEND": "django_setnx.backends.redlock.RedlockBackend",
            "LOCATION": [f"redis://127.0.0.1:{s.getsockname()[1]}/0" for s in listeners],
        }
        messages = RedlockBackend.check_params("rl", {**base, **params})
        for listener in listeners:
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
    finally:
        for listener in listeners:
            listener.close()
    ids = [m.id for m in messages]
    assert f"django_setnx.{error_id}" in ids, messages
    assert any(message in m.msg for m in messages if m.id == f"django_setnx.{error_id}")


def test_check_params_accepts_a_good_alias_and_warns_on_even_n():
    good = {
        "BACKEND": "django_setnx.backends.redlock.RedlockBackend",
        "LOCATION": [f"redis://192.0.2.{i}:6379/0" for i in range(1, 4)],
        "TTL": 30,
        "OPTIONS": {
            "NODE_TIMEOUT": 0.05,
            "MAX_TTL": 600,
            "CLOCK_DRIFT_FACTOR": 0.01,
            "CONNECTION_KWARGS": {},
        },
    }
    assert RedlockBackend.check_params("rl", good) == []
    even = {**good, "LOCATION": [f"redis://192.0.2.{i}:6379/0" for i in range(1, 5)]}
    assert [m.id for m in RedlockBackend.check_params("rl", even)] == ["django_setnx.W030"]
