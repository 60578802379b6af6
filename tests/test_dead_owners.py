"""``django_setnx.dead_owners``: the locks of a process known to be dead, freed at
once, on every backend shared between processes. (The Celery and gunicorn hooks that
use it are tested with real workers in tests/test_celery.py and tests/test_gunicorn.py.)"""

import os
import signal
import time

import pytest

from django_setnx import lock, locks
from django_setnx.dead_owners import free_locks_of_pid, has_exited, owned_by, wait_for_exit
from django_setnx.signals import lock_force_released
from tests import workers


def test_only_the_dead_pids_own_locks_are_freed(shared_alias, name, spawn, monkeypatch):
    from django_setnx import dead_owners

    monkeypatch.setattr(dead_owners, "EXIT_WAIT", 0.3)
    backend = locks[shared_alias]
    acquired = spawn.ctx.Event()
    child = spawn(
        workers.crash_holder_of_two, workers.child_environment(), shared_alias, name, 60, acquired
    )
    assert acquired.wait(30)
    mine = lock(f"{name}:mine", ttl=60, backend=shared_alias)
    assert mine.acquire()
    held = backend.get(name)
    assert owned_by(held, child.pid) and held.expires_in > 50

    sent = []
    receiver = lambda **kwargs: sent.append(kwargs)  # noqa: E731
    lock_force_released.connect(receiver)
    # Alive: nothing is freed (the wait for its exit gives up).
    assert free_locks_of_pid(child.pid, "test", aliases=[shared_alias]) == []
    assert backend.get(name) is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert has_exited(child.pid)
    try:
        freed = free_locks_of_pid(child.pid, "killed by the test", aliases=[shared_alias])
    finally:
        lock_force_released.disconnect(receiver)
    assert [info.name for info in freed] == [name]
    assert backend.get(name) is None
    # The enqueue-once lock it sent belongs to the queued task; ours to us.
    assert backend.get(f"{name}:task") is not None
    assert mine.owned()
    assert [(s["name"], s["reason"], s["user"]) for s in sent] == [
        (name, "killed by the test", None)
    ]
    mine.release()
    backend.delete(f"{name}:task")


def test_a_process_that_does_not_exit_keeps_its_locks(shared_alias, name, monkeypatch):
    """The observer may hear of a death before it happens: it waits for the exit, and
    leaves the locks to their ttl if the process still runs."""
    from django_setnx import dead_owners

    monkeypatch.setattr(dead_owners, "EXIT_WAIT", 0.3)
    held = lock(name, ttl=60, backend=shared_alias)
    assert held.acquire()
    started = time.monotonic()
    assert free_locks_of_pid(os.getpid(), "not dead", aliases=[shared_alias]) == []
    assert time.monotonic() - started >= 0.3
    assert held.owned()
    assert not wait_for_exit(os.getpid(), timeout=0.05)
    held.release()


def test_a_lock_that_changed_hands_is_left_alone(shared_alias, name, spawn):
    """Listed as the dead pid's, then taken over before the release: the fencing
    check keeps the new holder's lock."""
    from django_setnx import dead_owners

    backend = locks[shared_alias]
    acquired = spawn.ctx.Event()
    child = spawn(
        workers.crash_holder, workers.child_environment(), shared_alias, name, 60, acquired
    )
    assert acquired.wait(30)
    stale = backend.get(name)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    backend.delete(name)
    successor = lock(name, ttl=60, backend=shared_alias)
    assert successor.acquire()
    assert dead_owners.free(shared_alias, stale, "too late") is None
    assert successor.owned()
    successor.release()


@pytest.mark.parametrize("handover", [True, False])
def test_a_lock_handed_over_stays_with_its_adopter(shared_alias, name, spawn, handover):
    """The acquirer dies hard while another process holds the lock it adopted: marked
    for handover, the lock stays with the adopter; unmarked, its record names only
    the dead acquirer and it is freed (the documented rule)."""
    tokens = spawn.ctx.Queue()
    child = spawn(
        workers.hand_over_then_hang,
        workers.child_environment(),
        shared_alias,
        name,
        60,
        handover,
        tokens,
    )
    adopter = lock(name, ttl=60, backend=shared_alias)
    assert adopter.adopt(tokens.get(timeout=30))
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    freed = free_locks_of_pid(child.pid, "killed by the test", aliases=[shared_alias])
    if handover:
        assert freed == [] and adopter.owned()
        adopter.release()
    else:
        assert [info.name for info in freed] == [name]


def test_the_cleanup_runs_in_a_process_of_its_own(tmp_path):
    """Never a thread of the observer (which forks its workers meanwhile): the work
    runs in another process, the observer starts no thread and keeps no child."""
    import threading

    from django_setnx.dead_owners import in_cleanup_process

    out = tmp_path / "pid"
    threads = threading.active_count()
    middle = in_cleanup_process(lambda: out.write_text(str(os.getpid())))
    assert middle is not None
    deadline = time.monotonic() + 10
    # Until the pid is written whole (the file exists, empty, while it is written).
    while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert int(out.read_text()) != os.getpid()
    assert threading.active_count() == threads
    with pytest.raises(ChildProcessError):
        os.waitpid(middle, os.WNOHANG)  # reaped already: no zombie left behind
    assert int(out.read_text()) != middle, "the middle process only forks"


@pytest.mark.parametrize("namespace", ["another", "none"])
def test_a_pid_of_another_pid_namespace_is_not_ours(name, spawn, monkeypatch, namespace):
    """Containers that share a host name (a Kubernetes pod, host networking) reuse
    the same small pids: a dead pid's locks are freed only if their record names
    this process' PID namespace; a record of another namespace, or of none (an older
    version), is left to its ttl."""
    from django.conf import settings

    from django_setnx import dead_owners
    from django_setnx.locking import pid_namespace

    if "redis" not in settings.SETNX_LOCKS:
        pytest.skip("Redis is not among SETNX_TEST_BACKENDS")
    assert pid_namespace() is not None  # Linux: the test means something here
    monkeypatch.setattr(dead_owners, "EXIT_WAIT", 0.3)
    other = {"pidns": pid_namespace() + 1} if namespace == "another" else {"pidns": None}
    acquired = spawn.ctx.Event()
    child = spawn(
        workers.crash_holder_as, workers.child_environment(), "redis", name, 60, other, acquired
    )
    assert acquired.wait(30)
    held = locks["redis"].get(name)
    assert held.owner["pid"] == child.pid and held.owner["pidns"] == other["pidns"]
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert not owned_by(held, child.pid)
    assert free_locks_of_pid(child.pid, "killed by the test", aliases=["redis"]) == []
    assert locks["redis"].get(name).fencing_token == held.fencing_token
    locks["redis"].delete(name)


def test_owner_records_name_the_pid_namespace(name):
    from django_setnx.locking import pid_namespace

    with lock(name, ttl=10, backend="locmem") as lk:
        assert lk.info().owner["pidns"] == pid_namespace() == os.stat("/proc/self/ns/pid").st_ino


def test_owner_records_name_their_process_start_time(name):
    from django_setnx.locking import process_started

    with open("/proc/self/stat", "rb") as stat:
        started = int(stat.read().rsplit(b")", 1)[1].split()[19])
    with lock(name, ttl=10, backend="locmem") as lk:
        assert lk.info().owner["started"] == process_started() == started


def test_the_live_locks_of_a_process_that_got_a_dead_pid_are_left_alone(
    shared_alias, name, spawn, monkeypatch
):
    """Review r133: a pid is reused once the kernel's counter wraps (32768 in many
    containers). A new process that got the dead one's pid between the observer's
    exit check and its read of the locks lost its live locks, and with Celery its
    task's run and enqueue-once locks. A record names its process' start time: only
    the dead process' are freed."""
    from django_setnx import dead_owners
    from django_setnx.locking import process_started

    backend = locks[shared_alias]
    # The new process with the reused pid: alive, holding a lock of its own.
    reused, live = _live_holder(spawn, shared_alias, f"{name}:new", {})
    assert live.owner["pid"] == reused.pid
    assert live.owner["started"] == process_started(reused.pid)
    # What the dead process with that pid left: the same pid, an earlier start.
    dead = lock(name, ttl=60, backend=shared_alias)
    dead.owner_extra.update(pid=reused.pid, started=live.owner["started"] - 1)
    assert dead.acquire()
    # The observer's exit check passed before the pid was given again.
    monkeypatch.setattr(dead_owners, "wait_for_exit", lambda pid, timeout=None: True)
    try:
        freed = free_locks_of_pid(reused.pid, "killed by the test", aliases=[shared_alias])
        assert [info.name for info in freed] == [name]
        assert backend.get(f"{name}:new").fencing_token == live.fencing_token
    finally:
        os.kill(reused.pid, signal.SIGKILL)
        reused.join(10)
        backend.delete(f"{name}:new")
        backend.delete(name)


def test_the_celery_pool_watch_leaves_the_run_of_a_child_that_got_a_dead_pid(
    shared_alias, name, spawn
):
    """Review r133: the pool watch frees the run locks whose record names a dead
    child's pid and a task; a replacement child that got that pid lost its own run
    lock (and that run's enqueue-once lock). Only the dead child's run is freed."""
    pytest.importorskip("celery")
    from django_setnx.contrib import celery as celery_hooks
    from django_setnx.locking import process_started

    backend = locks[shared_alias]
    child, live = _live_holder(
        spawn, shared_alias, f"{name}:live-run", {"celery_task_id": "a-live-task"}
    )
    dead = lock(f"{name}:dead-run", ttl=60, backend=shared_alias)
    dead.owner_extra.update(
        pid=child.pid, started=process_started(child.pid) - 1, celery_task_id="a-lost-task"
    )
    assert dead.acquire()
    try:
        celery_hooks._free_runs_of_dead_child(child.pid)
        assert backend.get(f"{name}:dead-run") is None
        assert backend.get(f"{name}:live-run").fencing_token == live.fencing_token
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        backend.delete(f"{name}:live-run")
        backend.delete(f"{name}:dead-run")


def _live_holder(spawn, alias, name, owner_extra):
    """A spawned process holding ``name`` (its owner record with ``owner_extra``)
    until killed: ``(process, the lock's LockInfo)``."""
    acquired = spawn.ctx.Event()
    holder = spawn(
        workers.crash_holder_as,
        workers.child_environment(),
        alias,
        name,
        60,
        owner_extra,
        acquired,
    )
    assert acquired.wait(30)
    return holder, locks[alias].get(name)
