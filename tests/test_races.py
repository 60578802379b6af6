"""Races and crashes with real processes (spawned, killed with SIGKILL).

Run on every backend several processes can share: SQLite, PostgreSQL,
MariaDB/MySQL and Redis.
"""

import os
import signal
import time

import pytest
from django.conf import settings
from django.db import transaction

from django_setnx import lock, locks
from tests import workers

pytestmark = pytest.mark.slow


@pytest.fixture
def env():
    return workers.child_environment()


def test_takeover_race_has_exactly_one_winner(shared_alias, name, spawn, env):
    """Two processes race 200 times to take over one expired lock: one wins each time."""
    # The ttl must outlast a scheduling stall between the barrier and the attempt:
    # a racer delayed past it would legitimately take over the expired lock.
    rounds, racers, ttl = 200, 2, 0.1
    ctx = spawn.ctx
    barrier = ctx.Barrier(racers + 1)
    results = ctx.Queue()
    for _ in range(racers):
        spawn(workers.takeover_racer, env, shared_alias, name, rounds, barrier, results, ttl)

    winners_per_round = []
    last_token = 0
    for round_no in range(rounds):
        barrier.wait(timeout=120)  # go
        outcomes = [results.get(timeout=60) for _ in range(racers)]
        winners = [o for o in outcomes if o[2]]
        winners_per_round.append(len(winners))
        if len(winners) == 1:
            token = winners[0][3]
            assert token > last_token, f"round {round_no}: fencing {token} after {last_token}"
            last_token = token
        # Let the winner's lock expire (by the backend's clock) before the next round.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            info = locks[shared_alias].get(name)
            if info is None or info.is_stale:
                break
            time.sleep(0.005)
        barrier.wait(timeout=120)
    assert winners_per_round == [1] * rounds


def test_mutual_exclusion_counter(shared_alias, name, spawn, env, tmp_path):
    """4 processes x 200 non-atomic read-modify-writes under the lock: none is lost."""
    processes, iterations = 4, 200
    counter = tmp_path / "counter"
    counter.write_text("0")
    results = spawn.ctx.Queue()
    procs = [
        spawn(workers.counter_incrementer, env, shared_alias, name, str(counter), iterations,
              results)
        for _ in range(processes)
    ]
    reports = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert sorted(got for _, got in reports) == [iterations] * processes
    assert int(counter.read_text()) == processes * iterations


def test_killed_holder_does_not_deadlock(shared_alias, name, spawn, env):
    """A holder killed with SIGKILL blocks others for at most its ttl (plus a margin)."""
    ttl, margin = 1.0, 1.5
    acquired = spawn.ctx.Event()
    holder = spawn(workers.crash_holder, env, shared_alias, name, ttl, acquired)
    assert acquired.wait(timeout=60)
    assert lock(name, backend=shared_alias).acquire(blocking=False) is False
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(timeout=10)
    assert holder.exitcode == -signal.SIGKILL

    waiter = lock(name, ttl=10, backend=shared_alias)
    assert waiter.acquire(timeout=ttl + margin), "the dead holder's lock never expired"
    info = waiter.info()
    assert info.owner["pid"] == os.getpid()
    waiter.release()


@pytest.mark.skipif("redis" not in settings.TEST_BACKENDS,
                    reason="redis is not in settings.TEST_BACKENDS")
def test_killed_waiter_does_not_deadlock(name, spawn, env):
    """A waiter killed with SIGKILL while queued on Redis: a release that comes while
    its place is still live hands it the lock, which then blocks others for at most
    the ttl it asked for (as a crashed holder would); once its place lapsed
    (WAITER_MS after its last attempt), releases skip it."""
    from django_setnx.backends.redis import WAITER_MS

    ghost_ttl, margin = 1.0, 1.5
    for released_after in (0.0, WAITER_MS / 1000 + 0.5):
        holder = lock(name, ttl=60, backend="redis")
        assert holder.acquire(blocking=False)
        queued = spawn.ctx.Event()
        waiter = spawn(workers.crash_waiter, env, "redis", name, ghost_ttl, queued)
        assert queued.wait(timeout=60)
        time.sleep(0.2)  # into its BLPOP
        os.kill(waiter.pid, signal.SIGKILL)
        waiter.join(timeout=10)
        assert waiter.exitcode == -signal.SIGKILL
        time.sleep(released_after)
        holder.release()
        newcomer = lock(name, ttl=10, backend="redis")
        if released_after:
            assert newcomer.acquire(blocking=False), "a lapsed dead waiter was handed the lock"
        else:
            info = newcomer.info()
            assert info is not None and info.is_held and info.owner["pid"] == waiter.pid
            assert newcomer.acquire(timeout=ghost_ttl + margin), "the dead waiter's lock never expired"
        newcomer.release()


def test_lock_inside_atomic_is_visible_before_commit(db_alias, name, spawn, env):
    """Lock rows go through our own autocommit connection, not the caller's transaction."""
    database = locks[db_alias].database
    answer = spawn.ctx.Queue()
    with transaction.atomic(using=database):
        lk = lock(name, backend=db_alias)
        lk.acquire()
        probe = spawn(workers.probe_locked, env, db_alias, name, answer)
        seen_from_other_process = answer.get(timeout=60)
        probe.join(timeout=10)
        lk.release()
    assert seen_from_other_process is True
