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
  the kill lands);
- each with ``delete(name, fencing_token=...)``: the very acquisition that was read,
  so a lock that meanwhile passed to someone else stays with them.

Every lock freed so is logged (``django_setnx`` logger, WARNING, with the reason)
and sends ``lock_force_released`` with ``user=None`` and ``reason``.
"""

import logging
import os
import threading
import time

from .exceptions import LockBackendError
from .handler import locks
from .locking import _hostname, pid_namespace
from .signals import lock_force_released

logger = logging.getLogger("django_setnx")

#: How long an observer waits for a dying process to exit before it gives up and
#: leaves its locks to their ttl (seconds).
EXIT_WAIT = 30.0
_POLL = 0.02


def this_host():
    """The host name owner records carry for this machine."""
    return _hostname()


def has_exited(pid):
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


def wait_for_exit(pid, timeout=None):
    """Wait until ``pid`` has exited; False if it still runs after ``timeout``
    (default: EXIT_WAIT)."""
    deadline = time.monotonic() + (EXIT_WAIT if timeout is None else timeout)
    while not has_exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)
    return True


def owned_by(info, pid, host=None, **fields):
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


def free(alias, info, reason):
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


def free_locks_of_pid(pid, reason, *, host=None, aliases=None):
    """Free every lock of every backend (or of ``aliases``) held by process ``pid``
    of this host, once it has exited, except the enqueue-once locks of the Celery
    tasks it sent (they belong to the task). Returns the removed LockInfos. A backend that
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
    freed = []
    for alias in aliases or list(locks):
        try:
            for info in list(locks[alias].list()):
                # A Celery enqueue-once lock is the queued task's, whichever process
                # sent it: it outlives its sender by design.
                if owned_by(info, pid, host) and "celery_task_id" not in info.owner:
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


def in_background(function, *args, **kwargs):
    """Run ``function`` in a daemon thread: an observer (a worker's main loop,
    gunicorn's arbiter) must not wait for a process to exit. Returns the thread."""

    def run():
        try:
            function(*args, **kwargs)
        except Exception:  # a background cleanup must never take its host down
            logger.warning("Freeing the locks of a dead owner failed", exc_info=True)

    thread = threading.Thread(target=run, name="django-setnx-dead-owner", daemon=True)
    thread.start()
    return thread


def _describe(owner):
    if not isinstance(owner, dict):
        return repr(owner)
    return f"pid {owner.get('pid')} on {owner.get('host')}" + (
        f" ({owner['guards']})" if owner.get("guards") else ""
    )
