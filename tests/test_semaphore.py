"""Counting semaphores: the Lock's contract with ``limit`` holders, on every backend."""

import asyncio
import os
import signal
import sys
import threading
import time

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_setnx import lock, locked, locks, semaphore
from django_setnx.exceptions import LockError, LockNotAcquired, LockNotOwned
from django_setnx.semaphore import MAX_LIMIT, _checked_limits, slot_record, split_slot
from django_setnx.signals import lock_acquired, lock_contended, lock_released

from . import workers


@pytest.fixture
def env():
    return workers.child_environment()


def fill(name, alias, limit, ttl=10):
    """``limit`` Semaphore objects, each holding one slot."""
    sems = [semaphore(name, limit, ttl=ttl, backend=alias) for _ in range(limit)]
    assert [sem.acquire(blocking=False) for sem in sems] == [True] * limit
    return sems


# -- the contract, on every backend -------------------------------------------------


def test_at_most_limit_holders(alias, name):
    sems = fill(name, alias, 3)
    assert sorted(sem.slot for sem in sems) == [1, 2, 3]
    assert all(sem.owned() for sem in sems)
    extra = semaphore(name, 3, ttl=10, backend=alias)
    assert extra.acquire(blocking=False) is False
    assert extra.acquire(timeout=0.2) is False
    assert not extra.owned() and extra.fencing_token is None and extra.info() is None
    assert sems[0].locked() and extra.locked()
    holders = extra.holders()
    assert [split_slot(info.name) for info in holders] == [(name, 1), (name, 2), (name, 3)]
    assert {info.fencing_token for info in holders} == {sem.fencing_token for sem in sems}
    assert all(info.owner["limit"] == 3 and info.owner["pid"] == os.getpid() for info in holders)
    sems[1].release()
    assert not sems[1].owned() and not extra.locked()
    assert extra.acquire(blocking=False) is True
    assert extra.slot == sems[1].slot
    for sem in (sems[0], sems[2], extra):
        sem.release()
    assert extra.holders() == [] and not extra.locked()


def test_fencing_token_per_acquire_increases_per_slot(alias, name):
    sem = semaphore(name, 2, ttl=10, backend=alias)
    seen = {}
    for _ in range(6):
        assert sem.acquire(blocking=False)
        assert sem.fencing_token > seen.get(sem.slot, 0)
        seen[sem.slot] = sem.fencing_token
        info = sem.info()
        assert info.name == slot_record(name, sem.slot) and info.fencing_token == sem.fencing_token
        sem.release()


def test_limit_one_is_a_mutex(alias, name):
    first = semaphore(name, 1, ttl=10, backend=alias)
    second = semaphore(name, 1, ttl=10, backend=alias)
    assert first.acquire(blocking=False) and first.slot == 1
    assert second.acquire(timeout=0.1) is False
    with pytest.raises(LockNotAcquired, match=name):
        with semaphore(name, 1, backend=alias, timeout=0):
            pass
    first.release()
    assert second.acquire(blocking=False)
    second.release()


def test_release_extend_and_owned_check_the_token(alias, name):
    sem = semaphore(name, 2, ttl=0.3, backend=alias)
    with pytest.raises(LockNotOwned, match="not acquired"):
        sem.release()
    assert sem.acquire()
    sem.extend(10)
    assert sem.info().expires_in > 5
    sem.extend(0.2)
    deadline = time.monotonic() + 5
    while sem.info() is not None and sem.info().is_held and time.monotonic() < deadline:
        time.sleep(0.05)
    # Its slot expired: the others take both slots, and the old holder has neither.
    others = fill(name, alias, 2)
    assert not sem.owned()
    with pytest.raises(LockNotOwned):
        sem.extend()
    with pytest.raises(LockNotOwned):
        sem.release()
    assert all(other.owned() for other in others)
    for other in others:
        other.release()


def test_a_crashed_holder_frees_its_slot_after_its_ttl(alias, name):
    dead = semaphore(name, 2, ttl=0.3, backend=alias)
    assert dead.acquire()
    live = semaphore(name, 2, ttl=10, backend=alias)
    assert live.acquire(blocking=False)
    waiter = semaphore(name, 2, ttl=10, backend=alias)
    assert waiter.acquire(blocking=False) is False
    assert waiter.acquire(timeout=5) is True  # the dead one's slot, once expired
    assert waiter.slot == dead.slot
    waiter.release()
    live.release()


def test_a_release_wakes_a_waiter(alias, name):
    holders = fill(name, alias, 2, ttl=30)
    timer = threading.Timer(0.3, holders[0].release)
    timer.start()
    waiter = semaphore(name, 2, ttl=10, backend=alias)
    try:
        # Far sooner than the holders' ttl of 30 s: woken by the release.
        assert waiter.acquire(timeout=10) is True
    finally:
        timer.join()
    assert waiter.slot == holders[0].slot
    waiter.release()
    holders[1].release()


def test_context_managers_and_async_twins(alias, name):
    with semaphore(name, 2, ttl=10, backend=alias) as sem:
        assert sem.owned() and len(sem.holders()) == 1
    assert not sem.owned() and sem.holders() == []

    async def main():
        async with semaphore(name, 2, ttl=10, backend=alias) as first:
            async with semaphore(name, 2, ttl=10, backend=alias) as second:
                assert await first.aowned() and await second.aowned()
                assert await first.alocked()
                assert len(await first.aholders()) == 2
                third = semaphore(name, 2, ttl=10, backend=alias)
                assert await third.aacquire(timeout=0.1) is False
                await second.aextend(20)
                assert (await second.ainfo()).expires_in > 15
            assert not await first.alocked()
            third = semaphore(name, 2, ttl=10, backend=alias)
            assert await third.aacquire(blocking=False)
            await third.arelease()

    asyncio.run(main())
    assert semaphore(name, 2, backend=alias).holders() == []


def test_many_async_waiters_all_get_a_slot(alias, name):
    async def user(results):
        sem = semaphore(name, 3, ttl=10, backend=alias)
        assert await sem.aacquire(timeout=60)
        results.append(sem.slot)
        await asyncio.sleep(0.005)
        await sem.arelease()

    async def main():
        results = []
        await asyncio.gather(*(user(results) for _ in range(20)))
        return results

    assert sorted(set(asyncio.run(main()))) <= [1, 2, 3]
    assert semaphore(name, 3, backend=alias).holders() == []


def test_auto_renew_keeps_the_slot(alias, name):
    sem = semaphore(name, 2, ttl=0.3, backend=alias, auto_renew=True)
    assert sem.acquire()
    time.sleep(1.0)
    assert sem.owned() and not sem.lost
    sem.release()


def test_signals_are_those_of_a_lock(alias, name):
    events = []

    def receiver(signal, lock, **kwargs):
        events.append((signal, lock))

    for sig in (lock_acquired, lock_contended, lock_released):
        sig.connect(receiver)
    try:
        holders = fill(name, alias, 2)
        extra = semaphore(name, 2, backend=alias)
        events.clear()
        assert extra.acquire(timeout=0.3) is False
        assert [sig for sig, _ in events] == [lock_contended]  # once per acquire
        # Its first use in this process, non-blocking: the read of the slots finds
        # them all held and no attempt is made; it is refused all the same.
        _checked_limits.clear()
        events.clear()
        assert semaphore(name, 2, backend=alias).acquire(blocking=False) is False
        assert [sig for sig, _ in events] == [lock_contended]
        holders[0].release()
        assert events[-1] == (lock_released, holders[0])
    finally:
        for sig in (lock_acquired, lock_contended, lock_released):
            sig.disconnect(receiver)
    holders[1].release()


def test_a_second_limit_is_refused_and_writes_nothing(alias, name):
    held = semaphore(name, 3, ttl=10, backend=alias)
    assert held.acquire()
    for other in (2, 5):
        sem = semaphore(name, other, ttl=10, backend=alias)
        with pytest.raises(
            ValueError,
            match=rf"held with limit=3; it cannot also be used with "
            rf"limit={other}",
        ):
            sem.acquire()
        assert not sem.owned()
    assert [info.fencing_token for info in held.holders()] == [held.fencing_token]
    held.release()
    # Nobody holds it now: another limit may take over the name.
    with semaphore(name, 5, ttl=10, backend=alias) as sem:
        assert sem.owned()


def test_the_limits_checked_are_bounded_and_checked_again(alias, name, monkeypatch):
    # A process remembers which (alias, name, limit) it checked, a bounded number:
    # one forgotten is checked again at its next acquire, before anything is written.
    # The package's ``semaphore`` is the function; the module is in sys.modules.
    semaphore_module = sys.modules["django_setnx.semaphore"]
    monkeypatch.setattr(semaphore_module, "_checked_limits", set())
    monkeypatch.setattr(semaphore_module, "CHECKED_LIMITS_KEEP", 2)
    held = semaphore(name, 3, ttl=10, backend=alias)
    assert held.acquire()
    for other in range(3):
        with semaphore(f"{name}:{other}", 2, ttl=10, backend=alias):
            pass
        assert len(semaphore_module._checked_limits) <= 2
    assert (alias, name, 3) not in semaphore_module._checked_limits
    with pytest.raises(ValueError, match="held with limit=3"):
        semaphore(name, 2, ttl=10, backend=alias).acquire(blocking=False)
    assert [info.fencing_token for info in held.holders()] == [held.fencing_token]
    held.release()


def test_a_semaphore_is_not_a_lock_of_the_same_name(alias, name):
    with lock(name, ttl=10, backend=alias):
        with semaphore(name, 2, ttl=10, backend=alias, timeout=0) as sem:
            assert sem.owned()


def test_admin_listing_sees_each_slot(alias, name):
    sems = fill(name, alias, 2)
    page = locks[alias].page(name_glob=f"{name}*")
    assert sorted(info.name for info in page.infos) == [slot_record(name, 1), slot_record(name, 2)]
    removed = locks[alias].delete(
        slot_record(name, sems[0].slot), fencing_token=sems[0].fencing_token
    )
    assert removed is not None and not sems[0].owned() and sems[1].owned()
    sems[1].release()


# -- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "limit, error, message",
    [
        (0, ValueError, "from 1 to 1000, got 0"),
        (-2, ValueError, "got -2"),
        (MAX_LIMIT + 1, ValueError, "got 1001"),
        (2.0, TypeError, "must be an int, not float: 2.0"),
        ("3", TypeError, "not str: '3'"),
        (True, TypeError, "not bool: True"),
        (None, TypeError, "not NoneType"),
    ],
)
def test_bad_limits_are_refused(alias, name, limit, error, message):
    with pytest.raises(error, match=message):
        semaphore(name, limit, backend=alias)
    assert locks[alias].page(name_glob=f"{name}*").infos == []


def test_names_that_leave_no_room_for_the_slot_number_are_refused(alias):
    # The slots' record names are at most 200 characters: "<name>\x1f<slot>".
    with pytest.raises(ValueError, match="the limit is 197 with limit=10"):
        semaphore("x" * 198, 10, backend=alias)
    with semaphore("x" * 197, 10, ttl=10, backend=alias) as sem:
        assert sem.info().name == "x" * 197 + "\x1f" + str(sem.slot)


def test_lock_names_may_not_contain_the_slot_separator(alias):
    with pytest.raises(ValueError, match=r"must not contain \\x1f"):
        lock("a\x1f1", backend=alias)
    with pytest.raises(ValueError, match=r"must not contain \\x1f"):
        semaphore("a\x1fb", 2, backend=alias)


def test_bad_limits_in_the_decorator_and_the_task_option():
    with pytest.raises(ImproperlyConfigured, match="got 0"):
        locked("x", limit=0)
    with pytest.raises(ImproperlyConfigured, match="not str"):
        locked("x", limit="2")


# -- the decorator ------------------------------------------------------------------


def test_locked_with_a_limit_runs_at_most_limit_calls(alias, name):
    inside, peak, guard = [0], [0], threading.Lock()
    start = threading.Barrier(6)

    @locked(name, ttl=10, backend=alias, limit=2, timeout=30)
    def export():
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.05)
        with guard:
            inside[0] -= 1
        return "done"

    def call(results):
        start.wait()
        results.append(export())

    results = []
    threads = [threading.Thread(target=call, args=(results,)) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["done"] * 6
    assert peak[0] == 2


def test_locked_with_a_limit_refuses_when_full(alias, name):
    @locked(name, ttl=10, backend=alias, limit=2)
    def export():
        return "ran"

    holders = fill(name, alias, 2)
    with pytest.raises(LockNotAcquired, match=name):
        export()
    holders[0].release()
    assert export() == "ran"
    holders[1].release()


def test_a_contended_view_with_a_limit_answers_409_with_the_soonest_expiry(rf, name):
    @locked(name, ttl=10, backend="locmem", limit=2)
    def view(request):
        from django.http import HttpResponse

        return HttpResponse("ok")

    holders = [semaphore(name, 2, ttl=ttl, backend="locmem") for ttl in (50, 7)]
    assert all(sem.acquire() for sem in holders)
    response = view(rf.get("/export"))
    assert response.status_code == 409 and response["Retry-After"] == "7"
    for sem in holders:
        sem.release()
    assert view(rf.get("/export")).status_code == 200


# -- real processes -----------------------------------------------------------------


def test_eight_processes_never_exceed_the_limit(shared_alias, name, spawn, env):
    """8 processes x 100 acquisitions of a limit=3 semaphore: never more than 3
    inside at once (a shared counter says so), and every process gets all of its."""
    processes, iterations, limit = 8, 100, 3
    ctx = spawn.ctx
    inside, peak, guard = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False), ctx.Lock()
    results = ctx.Queue()
    procs = [
        spawn(
            workers.semaphore_user,
            env,
            shared_alias,
            name,
            limit,
            iterations,
            inside,
            peak,
            guard,
            results,
        )
        for _ in range(processes)
    ]
    reports = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert sorted(got for _, got, _ in reports) == [iterations] * processes
    assert peak.value == limit
    assert inside.value == 0
    # Fencing tokens strictly increase per slot, in the order the slots were taken.
    per_slot = {}
    for _, _, tokens in reports:
        for slot, token in tokens:
            per_slot.setdefault(slot, []).append(token)
    assert set(per_slot) == {1, 2, 3}
    for tokens in per_slot.values():
        assert len(set(tokens)) == len(tokens)


def test_a_killed_holder_frees_its_slot_after_its_ttl(shared_alias, name, spawn, env):
    ttl, margin = 1.0, 1.5
    acquired = spawn.ctx.Event()
    holder = spawn(workers.semaphore_crash_holder, env, shared_alias, name, 2, ttl, acquired)
    assert acquired.wait(timeout=60)
    mine = semaphore(name, 2, ttl=10, backend=shared_alias)
    assert mine.acquire(blocking=False)
    waiter = semaphore(name, 2, ttl=10, backend=shared_alias)
    assert waiter.acquire(blocking=False) is False
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(timeout=10)
    assert holder.exitcode == -signal.SIGKILL
    assert waiter.acquire(timeout=ttl + margin), "the dead holder's slot never expired"
    assert waiter.info().owner["pid"] == os.getpid()
    waiter.release()
    mine.release()


def test_adopt_and_take_token_are_for_locks_only(alias, name):
    sem = semaphore(name, 2, backend=alias)
    with pytest.raises(LockError, match="for locks only"):
        sem.adopt("0" * 32)
    with pytest.raises(LockError, match="for locks only"):
        sem.take_token("0" * 32)


def test_a_limit_an_owner_record_cannot_have_is_not_believed(alias, name):
    """The admin reads as many slots as a holder's record says: a record written by
    hand with an absurd limit must not make it read a billion."""
    sem = semaphore(name, 2, ttl=10, backend=alias)
    sem.owner_extra["limit"] = 10**9
    assert sem.acquire()
    info = sem.info()
    assert info.semaphore == (name, sem.slot, None)
    assert info.display_name == f"{name} [slot {sem.slot}/?]"
    assert info.as_dict()["semaphore"] == {"name": name, "slot": sem.slot, "limit": None}
    sem.release()


@pytest.fixture
def attempts(monkeypatch):
    """``attempts(alias)``: start recording the ``(record, max_wait)`` of every
    acquire attempt made on that backend; returns the list they go to."""
    made = []

    def record_on(alias):
        backend = locks[alias]
        real_acquire = backend.acquire

        def recording_acquire(record, token, ttl, owner, max_wait=None):
            made.append((record, max_wait))
            return real_acquire(record, token, ttl, owner, max_wait)

        monkeypatch.setattr(backend, "acquire", recording_acquire)
        return made

    return record_on


def test_a_free_slot_costs_one_attempt_and_a_refused_one_queues_nowhere(alias, name, attempts):
    # The common case costs one round trip, as a lock's: one attempt on a random
    # slot. Refused there, an acquire tries the other slots, none of them queued
    # (max_wait 0), before it waits on the last one.
    with semaphore(name, 4, ttl=10, backend=alias):  # its limit is checked once
        pass
    made = attempts(alias)
    free = semaphore(name, 4, ttl=10, backend=alias)
    assert free.acquire(timeout=5)
    assert made == [(slot_record(name, free.slot), 0)]
    free.release()
    held = fill(name, alias, 4)
    held[2].release()
    made.clear()
    last = semaphore(name, 4, ttl=10, backend=alias)
    assert last.acquire(timeout=5)
    assert last.slot == held[2].slot
    records = [record for record, _ in made]
    assert len(set(records)) == len(records) <= 4, made
    assert records[-1] == slot_record(name, last.slot)
    assert all(max_wait == 0 for _, max_wait in made[:-1]), made
    for sem in [*held[:2], held[3], last]:
        sem.release()


def test_slots_are_read_at_once_not_tried_one_by_one(alias, name, attempts, monkeypatch):
    """Review r144: the first use of a semaphore read each slot in turn to check its
    limit, and a refused acquire tried every other slot in turn: a round trip each
    (with Redlock and a silent master, NODE_TIMEOUT each: a non-blocking acquire of
    a full limit=10 took 10 s). Each reads all the slots at once, and only the free
    ones are tried: on a full semaphore, a non-blocking acquire makes its first
    attempt only (review r146: and one on the slot it would have queued on)."""
    backend = locks[alias]
    reads = []
    real_get_many = backend.get_many
    monkeypatch.setattr(
        backend, "get_many", lambda names: reads.append(names) or real_get_many(names)
    )
    made = attempts(alias)
    first = semaphore(name, 6, ttl=10, backend=alias)
    assert first.acquire(blocking=False)
    assert len(reads[0]) == 7, reads  # the limit's check: the 6 slots and one more
    assert len(reads) == 2 and len(made) == 1, (reads, made)  # then the first look
    held = [first, *(semaphore(name, 6, ttl=10, backend=alias) for _ in range(5))]
    assert all(sem.acquire(blocking=False) for sem in held[1:])
    reads.clear()
    made.clear()
    extra = semaphore(name, 6, ttl=10, backend=alias)
    assert extra.acquire(blocking=False) is False
    assert len(made) == 1, made  # the first; the read then showed the others all held
    assert len(reads) == 1 and len(reads[0]) == 5, reads  # all but the first
    for sem in held:
        sem.release()


def test_limit_one_queues_at_its_first_attempt_like_a_lock(alias, name, attempts):
    with semaphore(name, 1, ttl=10, backend=alias):
        pass
    holder = semaphore(name, 1, ttl=10, backend=alias)
    assert holder.acquire()
    made = attempts(alias)
    threading.Timer(0.2, holder.release).start()
    waiter = semaphore(name, 1, ttl=10, backend=alias)
    assert waiter.acquire(timeout=10)
    assert made[0][0] == slot_record(name, 1)
    assert made[0][1] > 9  # the lock's first attempt, queued where the backend queues
    waiter.release()


def test_a_long_wait_looks_at_the_slots_less_and_less_often(alias, name, monkeypatch):
    # A waiter re-reads every slot after each slice; the slices double (up to
    # SLOT_WAIT_MAX), so a thousand waiters do not flood the server and their event
    # loop.
    holders = fill(name, alias, 2, ttl=30)
    backend = locks[alias]
    attempts = []
    real_acquire = backend.acquire

    def counting_acquire(record, *args, **kwargs):
        attempts.append(record)
        return real_acquire(record, *args, **kwargs)

    monkeypatch.setattr(backend, "acquire", counting_acquire)
    waiter = semaphore(name, 2, ttl=10, backend=alias)
    assert waiter.acquire(timeout=3) is False
    assert set(attempts) == set(waiter.slots)
    # Each look at the slots moves to another one; 0.1 s slices made about 60 moves
    # in 3 s, doubling slices (0.1, 0.2, 0.4, 0.8, 0.8, ...) about a dozen.
    moves = sum(1 for before, after in zip(attempts, attempts[1:]) if before != after)
    assert moves <= 20, attempts
    for holder in holders:
        holder.release()


def test_errors_call_a_semaphore_a_semaphore(alias, name):
    """Review r157 nit: a semaphore's errors said "Cannot release lock ...", and
    "already acquired by this Lock object"."""
    sem = semaphore(name, limit=2, ttl=30, backend=alias)
    with pytest.raises(LockNotOwned, match=f"Cannot release semaphore '{name}'"):
        sem.release()
    assert sem.acquire(blocking=False)
    with pytest.raises(
        LockError, match=f"Semaphore '{name}' is already acquired by this Semaphore"
    ):
        sem.acquire(blocking=False)
    sem.release()
    with pytest.raises(LockNotOwned, match="Cannot extend semaphore"):
        sem.extend()
