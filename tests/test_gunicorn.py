"""A real gunicorn with ``--preload`` and 3 workers serving a ``@locked`` view.

The app (tests/preload_app.py) uses the lock backend in gunicorn's master before it
forks, so every worker starts with a copy of the master's connections. The workers
must each talk over sockets of their own: 60 concurrent requests each do a
non-atomic read-modify-write of a counter file under the lock, and the counter must
end at exactly 60 (two holders at once lose an update), served by several workers.
"""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import workers
from tests.servers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 60


def get(url, timeout=60):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


@pytest.fixture
def gunicorn(shared_alias, tmp_path):
    counter = tmp_path / "counter"
    counter.write_text("0")
    port = free_port()
    env = {
        **os.environ,
        **workers.child_environment(),
        "SETNX_TEST_URLCONF": "tests.preload_app",
        "SETNX_PRELOAD_ALIAS": shared_alias,
        "SETNX_PRELOAD_COUNTER": str(counter),
        "PYTHONPATH": str(ROOT),
    }
    log = open(tmp_path / "gunicorn.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "--preload", "--workers", "3",
         "--bind", f"127.0.0.1:{port}", "--timeout", "60", "tests.preload_app:application"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
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
    yield base, counter
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def test_preloaded_workers_never_hold_the_lock_together(gunicorn):
    base, counter = gunicorn
    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda _: get(f"{base}/increment/"), range(REQUESTS)))
    statuses = [status for status, _ in results]
    assert statuses == [200] * REQUESTS
    assert int(counter.read_text()) == REQUESTS
    served_by = {body for _, body in results}
    assert len(served_by) >= 2, f"only one worker served every request: {served_by}"
