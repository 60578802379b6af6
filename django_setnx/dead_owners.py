"""Freeing the locks of an owner that is certainly dead, at once instead of after
their ttl.

The ttl is the safety net for an owner that vanished without a word. Some deaths
are *certain*, and the process that observes them runs on the same host as the
dead one: a Celery worker's main process sees a pool child lost (hard time limit,
SIGKILL, the OOM killer) or terminated by a revoke; gunicorn's arbiter reaps a
worker it killed for a timeout. That process frees the dead one's locks here:

- only locks whose owner record names this host and the dead pid (and, for Celery,
  the task id), so nothing of another process or host is touched;
- only once that pid has exited (the observer may hear of the death a moment before
  the kill lands), and never a record of a process that runs now: a pid is reused,
  and a new process may have the dead one's by the time its locks are read, so a
  record carries its process' start time too (``started``), and one whose pid and
  start time are those of a running process is left alone;
- each with ``delete(name, fencing_token=...)``: the very acquisition that was read,
  so a lock that meanwhile passed to someone else stays with them.

Every lock freed so is logged (``django_setnx`` logger, WARNING, with the reason)
and sends ``lock_force_released`` with ``user=None`` and ``reason``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .backends.base import LockInfo
from .exceptions import LockBackendError
from .handler import locks
from .locking import _hostname, pid_namespace, process_started
from .signals import lock_force_released

logger = logging.getLogger("django_setnx")

#: Owner field of a lock acquired to be handed over (:meth:`Lock.adopt
#: <django_setnx.Lock.adopt>`): set ``lk.owner_extra[HANDOVER] = True`` before the
#: acquire. Its record keeps naming the acquiring process, which may die while the
#: adopter holds on: the dead-owner cleanup leaves such a lock to its ttl. (A Celery
#: enqueue-once lock, whose owner names a task, is one.)
HANDOVER = "handover"

#: How long an observer waits for a dying process to exit before it gives up and
#: leaves its locks to their ttl (seconds).
EXIT_WAIT = 30.0
_POLL = 0.02


def this_host() -> str:
    """The host name owner records carry for this machine."""
    return _hostname()


def has_exited(pid: int) -> bool:
    """True if no process ``pid`` runs on this host (a zombie, exited but not yet
    reaped by its parent, counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: alive
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def wait_for_exit(pid: int, timeout: float | None = None) -> bool:
    """Wait until ``pid`` has exited; False if it still runs after ``timeout``
    (default: EXIT_WAIT)."""
    deadline = time.monotonic() + (EXIT_WAIT if timeout is None else timeout)
    while not has_exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)
    return True


def owned_by(info: LockInfo, pid: int, host: str | None = None, **fields: Any) -> bool:
    """Whether the lock ``info`` was taken by process ``pid`` of ``host`` (default:
    this host) in this process' PID namespace, with every owner field of ``fields``
    equal.

    A pid is only a process within its PID namespace: containers that share a host
    name (a pod's containers, host networking) reuse the same small pids. So where
    this process knows its namespace, a record must name the same one; one that
    names none (written where there is none, or by an older version) is not taken
    for ours, and is left to its ttl."""
    owner = info.owner if isinstance(info.owner, dict) else {}
    namespace = pid_namespace()
    return (
        owner.get("host") == (host or this_host())
        and owner.get("pid") == pid
        and (namespace is None or owner.get("pidns") == namespace)
        and all(owner.get(key) == value for key, value in fields.items())
    )


def free(alias: str, info: LockInfo, reason: str) -> LockInfo | None:
    """Force-release the acquisition ``info`` of backend ``alias`` (fencing-checked),
    log it and send ``lock_force_released``. Returns the removed LockInfo, or None
    when the lock had changed hands or was gone. Raises LockBackendError."""
    backend = locks[alias]
    removed = backend.delete(info.name, fencing_token=info.fencing_token)
    if removed is None:
        return None
    logger.warning(
        "Freed lock %r on %r (fencing token %s) of %s: %s",
        info.name,
        alias,
        info.fencing_token,
        _describe(info.owner),
        reason,
    )
    lock_force_released.send(
        sender=type(backend), backend=alias, name=info.name, info=removed, user=None, reason=reason
    )
    return removed


def runs_now(owner: object) -> bool:
    """Whether the process named by owner record ``owner`` runs now on this host:
    a process with its pid and its start time (``started``, see
    :func:`~django_setnx.locking.process_started`). A pid that was reused is another
    process, started later (review r133: the dead worker's pid, given to a new
    process before its locks were read, had that process' live locks freed). A
    record without a start time (another OS, an older version) is never taken for
    a running process's. The cleanups that pick locks by pid skip such records."""
    if not isinstance(owner, dict):
        return False
    pid, started = owner.get("pid"), owner.get("started")
    if type(pid) is not int or type(started) is not int:
        return False
    return process_started(pid) == started


def free_locks_of_pid(
    pid: int, reason: str, *, host: str | None = None, aliases: Iterable[str] | None = None
) -> list[LockInfo]:
    """Free every lock of every backend (or of ``aliases``) held by process ``pid``
    of this host, once it has exited, except the enqueue-once locks of the Celery
    tasks it sent (they belong to the task) and the locks it acquired to hand over
    (owner field :data:`HANDOVER`). Returns the removed LockInfos. A backend that
    cannot be read is logged and skipped (its locks expire with their ttl).

    Reads every lock of each backend (``list()``): meant for the rare death of a
    worker, not for a hot path."""
    if not wait_for_exit(pid):
        logger.warning(
            "Process %s did not exit within %s s: its locks are left to their ttl (%s)",
            pid,
            EXIT_WAIT,
            reason,
        )
        return []
    freed: list[LockInfo] = []
    for alias in aliases or list(locks):
        try:
            for info in list(locks[alias].list()):
                # A record of a process that runs now is a new one's that got the
                # dead pid (review r133).
                ours = owned_by(info, pid, host) and not runs_now(info.owner)
                # A lock to be handed over (a Celery enqueue-once lock is the queued
                # task's) outlives its acquirer by design.
                if ours and not _handed_over(info.owner):
                    removed = free(alias, info, reason)
                    if removed is not None:
                        freed.append(removed)
        except LockBackendError:
            logger.warning(
                "Could not free the locks of process %s on %r (%s)",
                pid,
                alias,
                reason,
                exc_info=True,
            )
    return freed


#: A cleanup process that has not finished after this long (seconds: hung on a lock
#: another thread held when it was forked, or on a backend that does not answer) is
#: ended by SIGALRM; the locks it had not freed are left to their ttl.
CLEANUP_DEADLINE = 60

#: Signals whose handlers the observer installed (Celery's, gunicorn's): a cleanup
#: process takes the default action instead of running them.
_OBSERVER_SIGNALS = (
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGTERM",
    "SIGUSR1",
    "SIGUSR2",
    "SIGCHLD",
    "SIGALRM",
)


def in_cleanup_process(function: Callable[..., object], *args: Any, **kwargs: Any) -> int | None:
    """Run ``function(*args, **kwargs)`` in a short-lived process forked from this
    one, never in a thread of it: the observer (a Celery worker's main process) forks
    its pool children at any moment, and a child forked while one of our threads held
    a lock (SQLite's global mutex, a connection pool's, an import lock) would inherit
    it held, for good. Returns the cleanup process' pid, or None if it could not be
    forked (logged; the locks are then left to their ttl).

    The process is forked twice, the middle one exiting at once, so the observer has
    no child of ours to reap and never waits for the cleanup: only for that middle
    process, which does nothing but fork."""
    import signal

    try:
        middle = os.fork()
    except OSError:
        logger.warning("Could not fork a process to free the locks of a dead owner", exc_info=True)
        return None
    if middle == 0:
        code = 0
        try:
            if os.fork() == 0:
                try:
                    for name in _OBSERVER_SIGNALS:
                        if hasattr(signal, name):
                            signal.signal(getattr(signal, name), signal.SIG_DFL)
                    try:
                        signal.set_wakeup_fd(-1)
                    except ValueError:
                        pass
                    signal.alarm(CLEANUP_DEADLINE)
                    function(*args, **kwargs)
                except BaseException:
                    logger.warning("Freeing the locks of a dead owner failed", exc_info=True)
                finally:
                    logging.shutdown()
                    os._exit(0)
        except BaseException:  # noqa: BLE001 - the second fork failed
            code = 1
        finally:
            os._exit(code)
    try:
        os.waitpid(middle, 0)
    except ChildProcessError:  # reaped by the observer's own waitpid(-1)
        pass
    return middle


def in_background(function: Callable[..., object], *args: Any, **kwargs: Any) -> threading.Thread:
    """Run ``function`` in a daemon thread: an observer (a worker's main loop,
    gunicorn's arbiter) must not wait for a process to exit. Returns the thread."""

    def run() -> None:
        try:
            function(*args, **kwargs)
        except Exception:  # a background cleanup must never take its host down
            logger.warning("Freeing the locks of a dead owner failed", exc_info=True)
        finally:
            # The connections this thread opened: closed now, not at some garbage
            # collection (one thread per dead worker, in a long-lived arbiter).
            for backend in locks.all(initialized_only=True):
                backend._background_thread_done()

    thread = threading.Thread(target=run, name="django-setnx-dead-owner", daemon=True)
    thread.start()
    return thread


def _handed_over(owner: object) -> bool:
    return isinstance(owner, dict) and bool(owner.get(HANDOVER) or "celery_task_id" in owner)


def _describe(owner: object) -> str:
    if not isinstance(owner, dict):
        return repr(owner)
    return f"pid {owner.get('pid')} on {owner.get('host')}" + (
        f" ({owner['guards']})" if owner.get("guards") else ""
    )
