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
    """Two processes race 200 times to take over one expired lock: one wins each time,
    unless the loser was so late that the winner's lock had expired again (ttl
    0.1 s); two holders whose acquisitions could overlap is the failure."""
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
        # (round, pid, won, token, started, finished), in the order they took it.
        winners = sorted((o for o in outcomes if o[2]), key=lambda o: o[3])
        winners_per_round.append(len(winners))
        assert winners, f"round {round_no}: nobody took the expired lock"
        for earlier, later in zip(winners, winners[1:]):
            # The later one may only have taken it over once the earlier one's had
            # expired: it cannot have finished before the earlier one started + ttl.
            assert later[5] >= earlier[4] + ttl, (
                f"round {round_no}: two holders at once: {earlier} and {later}"
            )
        for winner in winners:
            assert winner[3] > last_token, f"round {round_no}: fencing {winner} after {last_token}"
            last_token = winner[3]
        # Let the winner's lock expire (by the backend's clock) before the next round.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            info = locks[shared_alias].get(name)
            if info is None or info.is_stale:
                break
            time.sleep(0.005)
        barrier.wait(timeout=120)
    # Almost every round was a real race with one winner (a late loser is a stall of
    # the machine, not the common case).
    assert winners_per_round.count(1) >= 0.95 * rounds, winners_per_round


def test_mutual_exclusion_counter(shared_alias, name, spawn, env, tmp_path):
    """4 processes x 200 non-atomic read-modify-writes under the lock: none is lost."""
    processes, iterations = 4, 200
    counter = tmp_path / "counter"
    counter.write_text("0")
    results = spawn.ctx.Queue()
    procs = [
        spawn(
            workers.counter_incrementer, env, shared_alias, name, str(counter), iterations, results
        )
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


def _queue_a_waiter_and_kill_it(spawn, env, name, ttl):
    """A process that waits for ``name`` (queued on Redis, asking for ``ttl``),
    SIGKILLed while blocked."""
    queued = spawn.ctx.Event()
    waiter = spawn(workers.crash_waiter, env, "redis", name, ttl, queued)
    assert queued.wait(timeout=60)
    time.sleep(0.2)  # into its BLPOP
    os.kill(waiter.pid, signal.SIGKILL)
    waiter.join(timeout=10)
    assert waiter.exitcode == -signal.SIGKILL
    return waiter


@pytest.mark.skipif(
    "redis" not in settings.TEST_BACKENDS, reason="redis is not in settings.TEST_BACKENDS"
)
@pytest.mark.parametrize("next_caller", ["queued behind it", "arriving after the release"])
def test_a_killed_waiter_holds_the_next_caller_up_for_a_claim_not_its_ttl(
    name, spawn, env, next_caller
):
    """A waiter asking for ttl=30 is SIGKILLed while queued (as a gunicorn worker
    timeout does); the holder releases while its place is live, so the lock is
    handed to the dead waiter. It only gets a claim (CLAIM_MS) that it never
    confirms: the next caller gets the lock about CLAIM_MS later, not 30 s later."""
    from django_setnx.backends.redis_scripts import CLAIM_MS

    holder = lock(name, ttl=60, backend="redis")
    assert holder.acquire(blocking=False)
    dead = _queue_a_waiter_and_kill_it(spawn, env, name, ttl=30)
    outcome = {}
    if next_caller == "queued behind it":
        import threading

        def live_waiter():
            lk = lock(name, ttl=10, backend="redis")
            outcome["acquired"] = lk.acquire(timeout=8)
            outcome["at"] = time.monotonic()
            outcome["lock"] = lk

        thread = threading.Thread(target=live_waiter)
        thread.start()
        time.sleep(0.3)  # queued behind the dead one
        released_at = time.monotonic()
        holder.release()
        thread.join(15)
    else:
        released_at = time.monotonic()
        holder.release()
        info = locks["redis"].get(name)
        assert info.owner["pid"] == dead.pid and info.expires_in <= CLAIM_MS / 1000
        lk = lock(name, ttl=10, backend="redis")
        outcome = {"acquired": lk.acquire(timeout=8), "at": time.monotonic(), "lock": lk}
    assert outcome["acquired"], "the dead waiter's handoff blocked the next caller"
    assert outcome["at"] - released_at < CLAIM_MS / 1000 + 0.5
    assert outcome["lock"].info().owner["pid"] == os.getpid()
    outcome["lock"].release()


@pytest.mark.skipif(
    "redis" not in settings.TEST_BACKENDS, reason="redis is not in settings.TEST_BACKENDS"
)
def test_waiters_killed_together_hold_the_live_ones_up_for_a_bounded_time(name, spawn, env):
    """Two waiters SIGKILLed while queued, two live ones behind them; each live one
    holds the lock briefly. The lock passes down the queue (a dead waiter handed
    it only gets a claim) and both live waiters have had it within about
    WAITER_MS + WAIT_BLOCK (2.4 s) of the release, not after a dead one's ttl."""
    import threading

    from django_setnx.backends.redis import WAIT_BLOCK
    from django_setnx.backends.redis_scripts import WAITER_MS

    holder = lock(name, ttl=60, backend="redis")
    assert holder.acquire(blocking=False)
    for _ in range(2):
        _queue_a_waiter_and_kill_it(spawn, env, name, ttl=30)
    got = []

    def live_waiter():
        lk = lock(name, ttl=10, backend="redis")
        if lk.acquire(timeout=15):
            got.append(time.monotonic())
            time.sleep(0.05)
            lk.release()

    threads = [threading.Thread(target=live_waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)  # queued in this order, behind the dead ones
    released_at = time.monotonic()
    holder.release()
    for thread in threads:
        thread.join(20)
    assert len(got) == 2, "a live waiter never got the lock"
    assert max(got) - released_at < WAITER_MS / 1000 + WAIT_BLOCK + 0.5


@pytest.mark.skipif(
    "redis" not in settings.TEST_BACKENDS, reason="redis is not in settings.TEST_BACKENDS"
)
def test_a_killed_waiter_whose_place_lapsed_is_skipped(name, spawn, env):
    """Once the dead waiter's place lapsed (WAITER_MS after its last attempt), a
    release skips it: the lock is free at once."""
    from django_setnx.backends.redis_scripts import WAITER_MS

    holder = lock(name, ttl=60, backend="redis")
    assert holder.acquire(blocking=False)
    _queue_a_waiter_and_kill_it(spawn, env, name, ttl=30)
    time.sleep(WAITER_MS / 1000 + 0.5)
    holder.release()
    newcomer = lock(name, ttl=10, backend="redis")
    assert newcomer.acquire(blocking=False), "a lapsed dead waiter was handed the lock"
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
