"""Start, wait for, kill and stop real ``celery worker`` processes for the tests.

A worker is ``python -m celery -A tests.celery_app worker --pool=solo`` (or
``--pool=prefork``, one child) with the
environment of :func:`tests.workers.child_environment`, so Django in the worker
opens the test databases this pytest run created (their names travel in
``SETNX_TEST_DB_NAMES``) and the throwaway Redis (``SETNX_TEST_REDIS_URL``). Each
worker consumes a queue of its own, so a test decides which worker runs what.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.orphans import dying_with_this_process

ROOT = Path(__file__).resolve().parents[2]


class CeleryWorker:
    """One ``celery worker`` subprocess consuming the queue :attr:`queue`."""

    def __init__(self, label, env, log_dir, run_id=None, pool="solo"):
        run_id = run_id or uuid.uuid4().hex[:8]
        self.label = label
        #: "solo" (the task runs in the worker process) or "prefork" (in one pool
        #: child, which the main process watches).
        self.pool = pool
        self.nodename = f"{label}-{run_id}@%h"
        self.queue = f"setnx-tests-{label}-{run_id}"
        self.env = env
        self.log_path = Path(log_dir) / f"celery-{label}-{run_id}.log"
        self.process = None
        self.starts = 0

    def __repr__(self):
        return f"<CeleryWorker {self.label} pid={self.pid} alive={self.alive}>"

    @property
    def pid(self):
        return self.process.pid if self.process else None

    @property
    def alive(self):
        return self.process is not None and self.process.poll() is None

    def command(self):
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery_app",
            "worker",
            f"--pool={self.pool}",
            "--concurrency=1",
            "-n",
            self.nodename,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-Q",
            self.queue,
            "--loglevel=INFO",
        ]

    def start(self):
        """Start the process (do not wait for it: see :meth:`wait_ready`)."""
        if self.alive:
            return self
        env = {
            **os.environ,
            **self.env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "CELERY_SKIP_CHECKS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start #{self.starts} =====\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                dying_with_this_process(self.command()),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, app, timeout=60):
        """Block until the worker has run a ping task from its queue."""
        deadline = time.monotonic() + timeout
        result = app.tasks["setnx_tests.ping"].apply_async(queue=self.queue)
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self} exited during startup:\n{self.log_tail()}")
            if result.ready():
                if self.pool == "solo" and result.get(timeout=1) != self.pid:
                    raise RuntimeError(f"{self}: the ping was answered by another process")
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self} was not ready after {timeout} s:\n{self.log_tail()}")

    def kill(self):
        """SIGKILL: the worker dies mid-task, with no chance to release anything."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)

    def stop(self, timeout=15):
        """SIGTERM (warm shutdown: the current task finishes), then SIGKILL."""
        if not self.alive:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, chars=4000):
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class CeleryBeat:
    """A ``celery beat`` subprocess of tests.celery_app, with its schedule file and log
    in ``log_dir``; the schedule comes from ``SETNX_TEST_BEAT_*`` in ``env``."""

    def __init__(self, env, log_dir):
        self.env = env
        self.log_path = Path(log_dir) / f"beat-{uuid.uuid4().hex[:8]}.log"
        self.schedule = Path(log_dir) / f"beat-{uuid.uuid4().hex[:8]}.schedule"
        self.process = None

    def start(self):
        env = {
            **os.environ,
            **self.env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                dying_with_this_process(
                    [
                        sys.executable,
                        "-m",
                        "celery",
                        "-A",
                        "tests.celery_app",
                        "beat",
                        "-s",
                        str(self.schedule),
                        "--max-interval",
                        "1",
                        "--loglevel=INFO",
                    ]
                ),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def stop(self, timeout=15):
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""
