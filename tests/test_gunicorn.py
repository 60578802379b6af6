"""Real gunicorns serving ``@locked`` views (tests/preload_app.py).

First, ``--preload`` with 3 workers: the app uses the lock backend in gunicorn's master before it
forks, so every worker starts with a copy of the master's connections. The workers
must each talk over sockets of their own: 60 concurrent requests each do a
non-atomic read-modify-write of a counter file under the lock, and the counter must
end at exactly 60 (two holders at once lose an update), served by several workers.

Then ``--timeout 2`` with the ``child_exit`` hook of ``django_setnx.contrib.gunicorn``:
the lock of a worker the arbiter killed is free within 2 s, not after its ttl.
"""

import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import workers
from tests.orphans import dying_with_this_process
from tests.servers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 60


def get(url, timeout=60):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


def start_gunicorn(alias, tmp_path, *options, extra_env=None):
    """A gunicorn serving tests/preload_app.py on a free port, with ``options`` (and
    ``extra_env`` in its environment); yields ``(base url, counter file, log file)``,
    stopped afterwards."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    port = free_port()
    env = {
        **os.environ,
        **workers.child_environment(),
        "SETNX_TEST_URLCONF": "tests.preload_app",
        "SETNX_PRELOAD_ALIAS": alias,
        "SETNX_PRELOAD_COUNTER": str(counter),
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        **(extra_env or {}),
    }
    log_path = tmp_path / "gunicorn.log"
    log = open(log_path, "w+")
    # gunicorn >= 27 opens a control socket, by default at one path per user shared
    # by every gunicorn running at once: each of ours gets its own.
    control = []
    if int(importlib.metadata.version("gunicorn").split(".")[0]) >= 27:
        control = ["--control-socket", str(tmp_path / "gunicorn.ctl")]
    proc = subprocess.Popen(
        dying_with_this_process(
            [
                sys.executable,
                "-m",
                "gunicorn",
                *control,
                *options,
                "--bind",
                f"127.0.0.1:{port}",
                "tests.preload_app:application",
            ]
        ),
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"gunicorn exited with {proc.returncode}:\n{log.read()}")
        try:
            if get(f"{base}/ping/", timeout=2) == (200, "pong"):
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "gunicorn did not come up"
        time.sleep(0.1)
    try:
        yield base, counter, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def gunicorn(shared_alias, tmp_path):
    for base, counter, _log in start_gunicorn(
        shared_alias, tmp_path, "--preload", "--workers", "3", "--timeout", "60"
    ):
        yield base, counter


def test_preloaded_workers_never_hold_the_lock_together(gunicorn):
    base, counter = gunicorn
    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda _: get(f"{base}/increment/"), range(REQUESTS)))
    statuses = [status for status, _ in results]
    assert statuses == [200] * REQUESTS
    assert int(counter.read_text()) == REQUESTS
    served_by = {body for _, body in results}
    assert len(served_by) >= 2, f"only one worker served every request: {served_by}"


def test_a_worker_killed_for_its_timeout_frees_its_locks_at_once(shared_alias, tmp_path):
    """gunicorn --timeout 2 with the child_exit hook of django_setnx.contrib.gunicorn
    (one line of gunicorn.conf.py; no --preload, so the arbiter sets Django up
    itself): a view holding a lock with ttl=60 is stuck past the timeout; the arbiter
    kills its worker, and the lock is free within 2 s of the kill, not after 60 s."""
    _stuck_worker_is_freed_at_once(shared_alias, tmp_path)


def test_a_backend_that_hangs_holds_up_neither_the_arbiter_nor_the_others(tmp_path):
    """As above, with another lock backend listed first that never answers (a
    listener that accepts and never replies): the hook reads each backend in a
    thread of its own, so the stuck view's lock is still free within 2 s; and those
    threads run in a cleanup process, never in the arbiter, which forks the
    replacement worker meanwhile (a fork copies another thread's locks, an import's
    for one, locked for good into the new worker)."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # connections complete in the backlog; nothing ever answers
    try:
        url = f"redis://127.0.0.1:{hung.getsockname()[1]}/0"
        _stuck_worker_is_freed_at_once(
            "default", tmp_path, extra_env={"SETNX_TEST_HUNG_REDIS_URL": url}
        )
    finally:
        hung.close()


def test_a_preloaded_arbiter_frees_them_too(shared_alias, tmp_path):
    """As above with ``--preload``: the arbiter holds open connections of its own
    (tests/preload_app.py takes a lock at import); the cleanup process it forks
    talks over new ones, and a second kill is handled as well as the first."""
    _stuck_worker_is_freed_at_once(shared_alias, tmp_path, "--preload", kills=2)


def _stuck_worker_is_freed_at_once(alias, tmp_path, *options, extra_env=None, kills=1):
    config = tmp_path / "gunicorn.conf.py"
    # Our hook, called from a hook of the project's own (as the docs say), which
    # then notes the arbiter's Python threads: none may be ours.
    threads_seen = tmp_path / "arbiter-threads"
    config.write_text(
        "import threading\n"
        "from django_setnx.contrib.gunicorn import child_exit as free_locks_of_dead_worker\n"
        "def child_exit(server, worker):\n"
        "    free_locks_of_dead_worker(server, worker)\n"
        f"    with open({str(threads_seen)!r}, 'a') as seen:\n"
        "        seen.write(' '.join(t.name for t in threading.enumerate()) + '\\n')\n"
    )
    for base, _counter, log_path in start_gunicorn(
        alias,
        tmp_path,
        "-c",
        str(config),
        "--workers",
        "2",
        "--timeout",
        "2",
        *options,
        extra_env=extra_env,
    ):
        for _ in range(kills):
            _kill_a_stuck_worker(alias, base, log_path)
        # The hook ran in the arbiter and left no thread there: gunicorn forks the
        # replacement worker meanwhile, and a fork copies another thread's locks (an
        # import's, a connection pool's) locked for good into the new worker.
        seen = threads_seen.read_text()
        assert len(seen.splitlines()) >= kills
        assert "django-setnx" not in seen


def _kill_a_stuck_worker(alias, base, log_path):
    """Has a worker hold ``preload:stuck`` past its timeout; checks that once the
    arbiter killed it, the lock is free within 2 s and the hook logged why."""
    from django_setnx import locks
    from django_setnx.dead_owners import has_exited

    pool = ThreadPoolExecutor(max_workers=1)
    stuck = pool.submit(get, f"{base}/stuck/", 30)
    deadline = time.monotonic() + 20
    while (info := locks[alias].get("preload:stuck")) is None or not info.is_held:
        assert time.monotonic() < deadline, "the stuck view never took its lock"
        time.sleep(0.02)
    holder = info.owner["pid"]
    assert info.expires_in > 50
    while not has_exited(holder):
        assert time.monotonic() < deadline + 30, "the arbiter never killed the worker"
        time.sleep(0.01)
    killed = time.monotonic()
    while True:
        try:
            if get(f"{base}/try-stuck/", timeout=5) == (200, "free"):
                break
        except urllib.error.HTTPError as exc:
            assert exc.code == 409
        assert time.monotonic() - killed <= 2.0, "the lock was not freed within 2 s"
        time.sleep(0.05)
    with pytest.raises(OSError):
        stuck.result(timeout=30)  # the killed worker never answered
    pool.shutdown()
    # The cleanup process logs right after its delete: give the line a moment. On
    # Redlock the record read above may predate the last master's vote (get() shows
    # the highest fencing token of the masters that hold it so far): the token freed
    # is that one or a later master's, never a smaller one.
    log_deadline = time.monotonic() + 10
    freed = re.compile(
        rf"Freed lock 'preload:stuck' on '{alias}' \(fencing token (\d+)\) of pid {holder} "
    )
    while (found := freed.search(log := log_path.read_text())) is None:
        assert time.monotonic() < log_deadline, log[-3000:]
        time.sleep(0.05)
    assert int(found.group(1)) >= info.fencing_token
    if alias != "redlock":
        assert int(found.group(1)) == info.fencing_token
    assert f"gunicorn worker {holder} died without exiting" in log


def test_a_worker_that_exits_in_order_keeps_what_it_left_held(tmp_path):
    """``--max-requests`` recycles a worker, which exits in order: a lock it left held
    on purpose (a cooldown; or one handed to another process with ``adopt``) is not
    freed by the child_exit hook; only a worker that died without exiting counts."""
    from django_setnx import locks

    config = tmp_path / "gunicorn.conf.py"
    config.write_text("from django_setnx.contrib.gunicorn import child_exit  # noqa: F401\n")
    for base, _counter, log_path in start_gunicorn(
        "default", tmp_path, "-c", str(config), "--workers", "1", "--max-requests", "3"
    ):
        status, body = get(f"{base}/keep/", 10)
        first_pid, kept = body.split()
        assert (status, kept) == (200, "True")
        held = locks["default"].get("preload:kept")
        # Requests until the worker has been recycled (a new pid answers).
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "the worker was never recycled"
            status, body = get(f"{base}/keep/", 10)
            if body.split()[0] != first_pid:
                break
        time.sleep(1)  # well past the moment the hook would have freed it
        still = locks["default"].get("preload:kept")
        assert still is not None and still.fencing_token == held.fencing_token
        assert body.split()[1] == "False"  # the new worker finds it held
        assert "Freed lock" not in log_path.read_text()
        locks["default"].delete("preload:kept")


def test_only_the_marks_of_the_arbiters_children_count_and_the_others_go():
    """Review r133: the exit-mark handler is armed in every process forked below the
    arbiter. A process a worker forked, exiting in order, left a mark named after
    its pid alone: if a later worker got that pid and was SIGKILLed, the hook took
    the stale mark for that worker's and left its locks to their ttl; and such marks
    piled up for the arbiter's lifetime. A mark names the parent too: only one whose
    parent is the arbiter counts, and the others are removed."""
    from django_setnx.contrib import gunicorn as hook

    arbiter, worker, helper = os.getpid(), 4_000_001, 4_000_002
    marks = hook._EXIT_MARKS
    open(os.path.join(marks, hook._mark_name(worker, helper)), "w").close()  # the helper's
    open(os.path.join(marks, hook._mark_name(arbiter, worker)), "w").close()  # the worker's
    assert not hook.exited_in_order(helper), "a helper's mark taken for a worker's"
    assert not os.path.exists(os.path.join(marks, hook._mark_name(worker, helper)))
    assert hook.exited_in_order(worker)
    assert not hook.exited_in_order(worker), "a mark counts once"
    assert os.listdir(marks) == []


def test_a_helper_that_outlives_its_worker_is_not_taken_for_a_worker(spawn):
    """Review r135: a mark named the parent at exit, and a helper that outlived the
    worker that forked it has the arbiter for parent by then when the arbiter is
    PID 1 (a container's CMD) or a subreaper: its mark was taken for a worker's, and
    a later worker with its pid, SIGKILLed, kept its locks until their ttl. The
    mark names the parent at fork."""
    result = spawn.ctx.Queue()
    arbiter = spawn(workers.orphaned_helper_of_a_worker, workers.child_environment(), result)
    assert result.get(timeout=60) is False, "the orphaned helper's exit counted as a worker's"
    arbiter.join(30)
    assert arbiter.exitcode == 0
