"""Fork safety: a backend used before a fork (gunicorn ``--preload``, Celery prefork,
``multiprocessing`` with the fork start method) keeps its guarantees in the parent and
in the child. A child must never read or write a socket its parent opened: if it did,
the two would read each other's replies, and a reply meant for the other process
could report a lock as acquired that this one never wrote.

Each test runs on every backend that several processes can share (SQLite,
PostgreSQL, MariaDB, Redis and Redlock).
"""

import os
import signal
import threading
import time
import traceback

import pytest
import redis

from django_setnx import decorators, lock, locking, locks, semaphore
from django_setnx.backends import locmem as locmem_backend
from django_setnx.backends import redis_eviction
from django_setnx.exceptions import LockError
from django_setnx.handler import LockHandler
from tests import workers

pytestmark = pytest.mark.slow

ROUNDS = 150


def _race(alias, name, marker_dir, report_path):
    """Take the lock ``ROUNDS`` times; inside, hold an exclusive marker file.

    Returns a report: rounds won, overlaps seen (the marker already existed, i.e. two
    holders at once) and non-LockError exceptions (with tracebacks).
    """
    won = overlaps = 0
    foreign = []
    marker = os.path.join(marker_dir, "inside")
    for _ in range(ROUNDS):
        lk = lock(name, ttl=10, backend=alias)
        try:
            if not lk.acquire(timeout=10):
                continue
        except LockError:
            continue  # an outage is reported as LockBackendError: allowed, not a success
        except Exception:  # noqa: BLE001 - exactly what this test looks for
            foreign.append(traceback.format_exc())
            continue
        try:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                overlaps += 1
            else:
                os.close(fd)
                time.sleep(0.0005)
                os.unlink(marker)
            won += 1
        finally:
            try:
                lk.release()
            except LockError:
                pass
            except Exception:  # noqa: BLE001
                foreign.append(traceback.format_exc())
    with open(report_path, "w") as f:
        f.write(repr({"won": won, "overlaps": overlaps, "foreign": foreign}))


def _read_report(path):
    with open(path) as f:
        return eval(f.read())


def test_used_then_forked_parent_and_child_race(shared_alias, name, tmp_path):
    """The backend opens its connections in the parent, then the process forks and
    both race on one lock: never two holders, only LockError subclasses escape, and
    both make progress. Afterwards the parent's backend still works."""
    backend = locks[shared_alias]
    # Use every kind of operation first, so each connection the backend keeps is open.
    warm = lock(name, ttl=10, backend=shared_alias)
    assert warm.acquire(timeout=5)
    assert warm.owned() and warm.info() is not None
    list(backend.list(name_glob=name))
    warm.release()

    child_report = tmp_path / "child.txt"
    parent_report = tmp_path / "parent.txt"
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            _race(shared_alias, name, str(tmp_path), str(child_report))
        except BaseException:  # noqa: BLE001
            with open(child_report, "w") as f:
                f.write(repr({"won": 0, "overlaps": 0, "foreign": [traceback.format_exc()]}))
            code = 1
        finally:
            os._exit(code)
    try:
        _race(shared_alias, name, str(tmp_path), str(parent_report))
    finally:
        workers.reap(pid, 120, clean=False)  # its failures are in its report

    parent, child = _read_report(parent_report), _read_report(child_report)
    assert parent["foreign"] == [] and child["foreign"] == [], (parent, child)
    assert parent["overlaps"] == 0 and child["overlaps"] == 0, (parent, child)
    assert parent["won"] > 0 and child["won"] > 0, (parent, child)
    # The parent's connections survived the child (which exited, closing its copies).
    with lock(name, ttl=10, backend=shared_alias, timeout=5) as lk:
        assert lk.owned()


@pytest.mark.autocommit
def test_a_forked_child_never_releases_the_parents_streaming_lock(shared_alias, name):
    """The child inherits the parent's unsent streaming response and its finalizer:
    collecting that copy must not release the lock the parent still streams under."""
    import gc

    from django.http import StreamingHttpResponse
    from django.test import RequestFactory

    from django_setnx import locked

    @locked(name + "{request.path}", ttl=60, backend=shared_alias)
    def view(request):
        return StreamingHttpResponse(iter([b"a"]))

    response = view(RequestFactory().get("/parent/"))
    pid = os.fork()
    if pid == 0:
        try:
            del response
            gc.collect()
            own = view(RequestFactory().get("/child/"))  # starts the child's releaser
            del own
            gc.collect()
            time.sleep(0.5)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert lock(name + "/parent/", backend=shared_alias).locked(), (
        "the child released the parent's lock"
    )
    response.close()
    assert not lock(name + "/parent/", backend=shared_alias).locked()


def _session_of(backend):
    """The server session of this thread's lock connection (SQLite: the connection
    object, which SQLite says never to use across a fork)."""
    wrapper, raw = backend._connection()
    backend._done_with(wrapper)  # used here directly, single-threaded
    if wrapper.vendor == "sqlite":
        return id(raw)
    query = (
        "SELECT pg_backend_pid()" if wrapper.vendor == "postgresql" else "SELECT CONNECTION_ID()"
    )
    cursor = raw.cursor()
    try:
        cursor.execute(query)
        return cursor.fetchone()[0]
    finally:
        cursor.close()


@pytest.mark.parametrize(
    "fork", [os.fork, workers.fork_without_hooks], ids=["os.fork", "no-fork-hooks"]
)
def test_a_database_backends_child_opens_its_own_connection(db_alias, name, fork):
    """After a fork, with or without fork hooks (uWSGI's default runs none), the
    child's lock operations run on a connection of its own, never on the session
    its parent opened; the parent's session carries on."""
    backend = locks[db_alias]
    with lock(name, ttl=10, backend=db_alias, timeout=5):
        pass
    parents = _session_of(backend)
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:  # the child: never return into pytest
        outcome = b"E"
        try:
            with lock(f"{name}:child", ttl=10, backend=db_alias, timeout=5):
                pass
            outcome = b"1" if _session_of(backend) != parents else b"0"
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read_end, 1) == b"1"
    assert _session_of(backend) == parents
    with lock(name, ttl=10, backend=db_alias, timeout=5) as lk:
        assert lk.owned()


#: The fork functions the tests run in a fresh process, by name (a spawned process
#: is given names, not functions).
_FORKS = {"os.fork": os.fork, "no-fork-hooks": workers.fork_without_hooks}


def _in_a_fresh_process(spawn, scenario, *args):
    """Run ``scenario(*args)`` (a function of this module) in a fresh spawned process
    and return what it returned; an exception there fails the test with its
    traceback.

    For the tests whose child forked without hooks starts threads. Such a fork never
    runs ``PyOS_AfterFork_Child``: the child keeps the thread states of the parent's
    threads, and on CPython 3.13 threads started in it crash now and then when
    another thread of the parent was running at the fork (a script with no library
    code: 9 children of 40 with one busy thread in the parent, none with five
    blocked ones). The pytest process runs the threads of earlier tests; a fresh
    process runs only what its scenario starts, as a uWSGI master runs no Python
    thread of its own."""
    receive, reply = spawn.ctx.Pipe(duplex=False)
    worker = spawn(
        workers.run_scenario,
        workers.child_environment(),
        scenario.__module__,
        scenario.__name__,
        args,
        reply,
    )
    reply.close()
    if not receive.poll(120):
        pytest.fail(f"{scenario.__name__} reported nothing in 120 s")
    try:
        outcome, detail = receive.recv()
    except EOFError:
        worker.join(10)
        pytest.fail(f"{scenario.__name__} ended without a report (exit code {worker.exitcode})")
    worker.join(10)
    if outcome != "ok":
        pytest.fail(f"{scenario.__name__}, in a fresh process:\n{detail}")
    assert worker.exitcode == 0, f"{scenario.__name__}'s process ended with {worker.exitcode}"
    return detail


def _report_of(pid, read_end, write_end):
    """What the forked child ``pid`` wrote to the pipe (``read_end``, ``write_end``),
    once it exited cleanly (a crash or a hang fails the test)."""
    os.close(write_end)  # ours: a child that dies unheard ends the read
    workers.reap(pid)
    with os.fdopen(read_end, "rb") as reported:
        return reported.read()


def _threads_of_a_hookless_child(db_alias, name):
    """Use the backend, fork without hooks, and have 4 threads of the child make their
    first lock operations at once. Returns their outcomes."""
    with lock(name, ttl=10, backend=db_alias, timeout=5):
        pass
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert not others, f"threads running before the fork: {others}"
    read_end, write_end = os.pipe()
    pid = workers.fork_without_hooks()
    if pid == 0:  # the child: never return into the worker
        try:
            signal.alarm(20)
            outcomes = []
            start = threading.Barrier(4)

            def first_use(i):
                try:
                    start.wait()
                    with lock(f"{name}:child:{i}", ttl=10, backend=db_alias, timeout=5):
                        pass
                    outcomes.append("ok")
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    outcomes.append(repr(exc)[:300])

            threads = [threading.Thread(target=first_use, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            os.write(write_end, "\n".join(outcomes).encode())
        finally:
            os._exit(0)
    return _report_of(pid, read_end, write_end).decode().splitlines()


def test_threads_of_a_child_forked_without_hooks_start_together(db_alias, name, spawn):
    """Forked without hooks (uWSGI), the child's first lock operations come from 4
    threads at once: one of them forgets the parent's connections while the others
    wait, and none goes on with the parent's state (they raised KeyError when the
    pid changed before the state did). The parent is a fresh process running no
    other thread, as a uWSGI master (see _in_a_fresh_process)."""
    outcomes = _in_a_fresh_process(spawn, _threads_of_a_hookless_child, db_alias, name)
    assert outcomes == ["ok"] * 4


def _shared_session_of(backend):
    """The server session of the connection this process' async callers share."""
    with backend._borrowing_a_connection():
        return _session_of(backend)


def _async_callers_of_a_child(db_alias, name, fork):
    """The scenario of the test below, in a fresh process: its children's async
    lock operations run in executor threads."""
    import asyncio

    fork = _FORKS[fork]
    backend = locks[db_alias]

    async def use(suffix):
        async with lock(f"{name}:{suffix}", ttl=10, backend=db_alias, timeout=5):
            pass

    asyncio.run(use("parent"))
    parents = _shared_session_of(backend)
    pool_lock = backend._shared.get()._condition
    read_end, write_end = os.pipe()
    pool_lock.acquire()  # as another thread of the parent, mid-checkout at the fork
    try:
        pid = fork()
        if pid == 0:  # the child: never return into the worker
            outcome = b"E"
            try:
                asyncio.run(asyncio.wait_for(use("child"), 20))
                outcome = b"1" if _shared_session_of(backend) != parents else b"0"
            finally:
                os.write(write_end, outcome)
                os._exit(0)
    finally:
        pool_lock.release()
    assert _report_of(pid, read_end, write_end) == b"1"
    assert _shared_session_of(backend) == parents
    asyncio.run(use("parent-again"))


@pytest.mark.parametrize("fork", list(_FORKS))
def test_a_database_backends_child_shares_connections_of_its_own_with_async_callers(
    db_alias, name, fork, spawn
):
    """The connections async callers share (ASYNC_CONNECTIONS) are the parent's: a
    child forked while another thread of the parent was taking one (it held the
    pool's lock at the fork), with or without fork hooks, runs its async lock
    operations on a connection of its own at once; the parent's carries on. Run in
    a fresh process (see _in_a_fresh_process): the child's async callers run in
    executor threads."""
    _in_a_fresh_process(spawn, _async_callers_of_a_child, db_alias, name, fork)


@pytest.mark.parametrize(
    "fork", [os.fork, workers.fork_without_hooks], ids=["os.fork", "no-fork-hooks"]
)
def test_a_child_forked_while_a_backend_was_being_created_creates_its_own(fork):
    """The handler creates a backend under a lock: a fork while another thread of
    the parent holds it (creating a backend) must not leave the child waiting for a
    lock nobody in it will release."""
    handler = LockHandler({"later": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend"}})
    read_end, write_end = os.pipe()
    with handler._creating:  # as another thread creating a backend at the fork
        pid = fork()
        if pid == 0:  # the child: never return into pytest
            outcome = b"E"
            try:
                signal.alarm(10)  # a hang ends the child, not the test run
                outcome = b"1" if handler["later"].alias == "later" else b"0"
            finally:
                os.write(write_end, outcome)
                os._exit(0)
    os.close(write_end)  # a child ended by the alarm: the read below gets b""
    os.waitpid(pid, 0)
    assert os.read(read_end, 1) == b"1"
    assert handler["later"].alias == "later"


def _forked_child_outcome(fork, hold, run):
    """Fork while another thread of this process is inside ``hold`` (a context
    manager), and run ``run()`` in the child. Returns what the child reported: b"1"
    if ``run()`` returned, its traceback if it raised; a child that hung (ended by
    its alarm) or crashed fails the test (see _report_of)."""
    inside, leave = threading.Event(), threading.Event()

    def holder():
        with hold:
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    inside.wait(10)
    # Fork once the holder sleeps in leave.wait(), with the GIL released: a thread
    # forked while taking the GIL back leaves the GIL's own mutex held in a child
    # that Python's fork hooks did not reinitialise.
    settled_by = time.monotonic() + 10
    while not (leave._cond._waiters and not leave._cond._lock.locked()):
        assert time.monotonic() < settled_by, "the holder never reached leave.wait()"
        time.sleep(0.001)
    time.sleep(0.01)
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:  # the child: never return into pytest
        try:
            signal.alarm(10)  # a hang ends the child, not the test run
            run()
            os.write(write_end, b"1")
        except Exception:  # noqa: BLE001 - reported to the parent, which fails
            os.write(write_end, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(0)
    leave.set()
    thread.join()
    return _report_of(pid, read_end, write_end)


def _mark_lost():
    held = lock(f"fork-mark-lost-{os.getpid()}", ttl=5, backend="locmem")
    assert held.acquire()
    held._mark_lost()


#: The library's process-wide locks another thread may hold at a fork: ``{case:
#: (the lock, what the child then runs)}``.
_LIBRARY_LOCKS = {
    "locmem-stores": (
        lambda: locmem_backend._stores_lock,
        lambda: LockHandler(
            {"x": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend", "LOCATION": "y"}}
        )["x"],
    ),
    "releaser": (lambda: decorators._releaser_guard, decorators._start_releaser),
    "mark-lost": (lambda: locking._MARK_LOST_GUARD, _mark_lost),
    "locmem-records": (
        lambda: locks["locmem"]._store.condition,
        lambda: lock(f"fork-locmem-{os.getpid()}", ttl=5, backend="locmem").acquire(),
    ),
    "eviction-watches": (
        lambda: redis_eviction._WATCHES_LOCK,
        # Installing the watch of a django-redis pool does no I/O.
        lambda: redis_eviction._watch_shared_pool(
            redis.ConnectionPool.from_url("redis://127.0.0.1:1/0")
        ),
    ),
    "watchdog": (
        lambda: locking._watchdog.condition(),
        lambda: lock("fork-watchdog", ttl=5, backend="locmem", auto_renew=True).acquire(),
    ),
}


def _child_of_a_parent_holding(case, fork):
    """The scenario of the test below, in a fresh process: some children start a
    thread (the releaser's, the watchdog's)."""
    held, run = _LIBRARY_LOCKS[case]
    return _forked_child_outcome(_FORKS[fork], held(), run)


@pytest.mark.parametrize("fork", list(_FORKS))
@pytest.mark.parametrize("case", list(_LIBRARY_LOCKS))
def test_a_child_forked_while_a_parent_thread_holds_a_library_lock_goes_on(case, fork, spawn):
    """A fork copies a lock another thread holds as held, and that thread is not in
    the child: the library's process-wide locks are ForkSafeLocks (or, the
    watchdog's, replaced when the pid changes), so the child never waits for them,
    with or without fork hooks (uWSGI runs none). Run in a fresh process (see
    _in_a_fresh_process), whose only other thread is the one holding the lock."""
    assert _in_a_fresh_process(spawn, _child_of_a_parent_holding, case, fork) == b"1"


@pytest.mark.parametrize(
    "fork", [os.fork, workers.fork_without_hooks], ids=["os.fork", "no-fork-hooks"]
)
def test_a_child_forked_while_a_parent_thread_builds_a_client_goes_on(shared_alias, name, fork):
    """The lock a backend builds its clients or connections under (a Redis
    Cluster client's takes round trips to every primary) may be held at the fork."""
    backend = locks[shared_alias]
    backend.close()  # the next use builds the client, under the backend's lock
    guard = next(
        getattr(backend, attribute)
        for attribute in ("_nodes_lock", "_conn_lock", "_wrappers_lock")
        if hasattr(backend, attribute)
    )

    def child():
        with lock(name, ttl=5, backend=shared_alias, timeout=5):
            pass

    assert _forked_child_outcome(fork, guard, child) == b"1"


def _watchdog_of_a_child(fork):
    """The scenario of the test below, in a fresh process: the child starts a
    watchdog thread. Returns what the child reported."""
    fork = _FORKS[fork]
    with lock(f"fork-watchdog-{os.getpid()}", ttl=1, backend="locmem", auto_renew=True):
        pass  # the parent's watchdog thread is running
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:  # the child: never return into the worker
        try:
            signal.alarm(20)
            backend = locks["locmem"]
            backend.extend = lambda *args, **kwargs: time.sleep(60)  # a hung extend
            held = lock(f"fork-watchdog-child-{os.getpid()}", ttl=1, backend="locmem")
            held.auto_renew = True
            assert held.acquire()
            deadline = time.monotonic() + 5
            while not held.lost and time.monotonic() < deadline:
                time.sleep(0.05)
            os.write(write_end, b"1" if held.lost else b"0")
        finally:
            os._exit(0)
    return _report_of(pid, read_end, write_end)


@pytest.mark.parametrize("fork", list(_FORKS))
def test_a_forked_childs_watchdog_marks_a_hung_renewal_lost(fork, spawn):
    """The watchdog thread is not in a child; one forked without hooks starts its
    own at its first auto-renewed lock, so a renewal stuck in ``extend`` still ends
    in ``lock_lost`` (and ``lost``) when the lock's validity ends. Run in a fresh
    process (see _in_a_fresh_process): the child starts a thread."""
    assert _in_a_fresh_process(spawn, _watchdog_of_a_child, fork) == b"1"


@pytest.mark.parametrize(
    "fork", [os.fork, workers.fork_without_hooks], ids=["os.fork", "no-fork-hooks"]
)
def test_a_forked_childs_owner_records_name_the_child(shared_alias, name, fork):
    """Owner records are built once per thread and kept: a child forked with or
    without fork hooks (uWSGI) must still write its own pid, never its parent's
    (the dead-owner cleanup frees the locks of a pid that died), and a renamed
    thread its new name."""
    kinds = {
        "plain": lambda: lock(f"{name}:plain", ttl=10, backend=shared_alias),
        "guarded": lambda: lock(f"{name}:guarded", ttl=10, backend=shared_alias, guards="x"),
        "semaphore": lambda: semaphore(f"{name}:sem", 2, ttl=10, backend=shared_alias),
    }

    def owners():
        found = {}
        for kind, make in kinds.items():
            with make() as held:
                found[kind] = held.info().owner
        return found

    assert {owner["pid"] for owner in owners().values()} == {os.getpid()}
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:  # the child: never return into pytest
        outcome = b"E"
        try:
            pids = {owner["pid"] for owner in owners().values()}
            outcome = b"1" if pids == {os.getpid()} else repr(pids).encode()
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read_end, 100) == b"1"
    thread = threading.current_thread()
    old_name = thread.name
    try:
        thread.name = "renamed-after-use"
        threads = {owner["thread"] for owner in owners().values()}
    finally:
        thread.name = old_name
    assert threads == {f"renamed-after-use ({thread.ident})"}


def test_a_forked_childs_asyncio_use_leaves_the_parents_event_loop_alone(shared_alias, name):
    """A process whose event loop runs for good (an ASGI server, a Celery worker with
    async code) locks asynchronously, then forks; the child locks under an event
    loop of its own and collects its garbage. The parent's loop must still get its
    replies: the child must not close the inherited asyncio connections, whose
    sockets sit in an epoll set that parent and child share."""
    import asyncio
    import gc

    async def lock_once(suffix):
        lk = lock(f"{name}:{suffix}", ttl=10, backend=shared_alias)
        assert await lk.aacquire(blocking=False)
        await lk.arelease()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(lock_once("parent"))
        for round_ in range(3):
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never return into pytest
                outcome = b"E"
                try:

                    async def child(suffix):
                        await lock_once(suffix)
                        gc.collect()  # while the child's own loop runs

                    asyncio.run(child(f"child{round_}"))
                    outcome = b"1"
                finally:
                    os.write(write_end, outcome)
                    os._exit(0)
            os.waitpid(pid, 0)
            assert os.read(read_end, 1) == b"1"
            os.close(read_end)
            os.close(write_end)
            loop.run_until_complete(lock_once(f"parent{round_}"))
    finally:
        loop.close()
