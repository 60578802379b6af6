"""A few daemon threads of a backend's own, for the statements of its async callers.

Not ``concurrent.futures.ThreadPoolExecutor``: its workers outlive ``asyncio.run``
(unlike the loop's default executor, which ``asyncio.run`` shuts down) and are
joined at the interpreter's exit. A process forked without at-fork hooks (uWSGI
forks its workers in C) inherits those thread objects with their "running" locks
held, and its exit would wait for them for ever. Daemon threads are never joined.

What a join gave is kept where it matters: at exit, the process waits (at most
``exit_wait`` seconds) for the work still running in its own pools, a cancelled
acquire's undo among them (see ``BaseLockBackend._undone_if_cancelled``); pools of
another process id (inherited across a fork) are skipped.
"""

import atexit
import concurrent.futures
import os
import queue
import threading
import time
import weakref

#: Seconds a thread waits for work before it ends (a busy pool keeps its threads; an
#: idle one, or one whose backend was replaced, gives them and their connections up).
IDLE_EXIT = 60.0

#: Every pool, for the wait at exit.
_ALL: "weakref.WeakSet[DaemonThreads]" = weakref.WeakSet()


class DaemonThreads(concurrent.futures.Executor):
    """An executor of at most ``size`` daemon threads named ``<name>_<n>``, started
    as work arrives and ended after IDLE_EXIT seconds without any (use one per
    process id: ``forksafe.PerProcess``)."""

    def __init__(self, size: int, name: str, exit_wait: float) -> None:
        self._size = size
        self._name = name
        self.exit_wait = exit_wait
        self._pid = os.getpid()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._threads = 0
        self._idle = 0  # threads waiting for work
        self._backlog = 0  # items queued, not taken yet
        self._running = 0  # items submitted, not finished
        _ALL.add(self)

    @property
    def threads(self) -> int:
        """How many threads this pool has now."""
        return self._threads

    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._running += 1
            self._backlog += 1
            start = self._backlog > self._idle and self._threads < self._size
            if start:
                self._threads += 1
                number = self._threads
        self._queue.put((future, fn, args, kwargs))
        if start:
            threading.Thread(
                target=self._work, name=f"{self._name}_{number - 1}", daemon=True
            ).start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                future, fn, args, kwargs = self._queue.get(timeout=IDLE_EXIT)
            except queue.Empty:
                with self._lock:
                    if not self._backlog:  # else an item is on its way: take it
                        self._idle -= 1
                        self._threads -= 1
                        return
                    self._idle -= 1
                continue
            with self._lock:
                self._idle -= 1
                self._backlog -= 1
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args, **kwargs)
                    except BaseException as exc:  # noqa: BLE001 - the future carries it
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                del future, fn, args, kwargs  # nothing kept alive while idle
                with self._lock:
                    self._running -= 1
                    if not self._running:
                        self._finished.notify_all()

    def wait_until_idle(self, timeout: float) -> bool:
        """Wait until no work runs or is queued; False if some still did after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._finished:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._finished.wait(left)
        return True


def _wait_at_exit() -> None:
    pid = os.getpid()
    for pool in list(_ALL):
        if pool._pid == pid:  # an inherited pool's lock may be held by a thread gone
            pool.wait_until_idle(pool.exit_wait)


atexit.register(_wait_at_exit)
