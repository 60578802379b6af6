"""A gunicorn server hook that frees, at once, the locks of a worker that died.

gunicorn's arbiter kills a worker that passed ``--timeout`` (SIGABRT, then SIGKILL),
and reaps any worker that crashed or was killed by the OOM killer. Its ``@locked``
views' locks would block everyone until their ttl. In ``gunicorn.conf.py``::

    from django_setnx.contrib.gunicorn import child_exit  # noqa: F401

``child_exit(server, worker)`` runs in the arbiter right after it reaped the
worker, so the death is certain. It frees the locks, on every backend of
``SETNX_LOCKS``, whose owner record names this host and the worker's pid, each
fencing-checked (a lock that passed to another holder stays), except the
enqueue-once locks of Celery tasks the worker sent (they belong to the task). Each
is logged with the reason and sends ``lock_force_released`` (see
:mod:`django_setnx.dead_owners`). It reads every lock of each backend, which only
happens when a worker exits.

Only a worker that died without running its exit handlers counts: one killed with
SIGKILL (after ``--timeout``, by the OOM killer) or crashed in C. A worker that
exits normally — recycled by ``--max-requests``, stopped by a reload or a shutdown,
or aborted for its timeout and unwound — has released what its ``with`` blocks and
``@locked`` calls held, and a lock it left held on purpose (a cooldown, a lock
handed to another process with ``Lock.adopt``) stays. Each worker marks its orderly
exit (an ``atexit`` handler, armed at fork, touches a file named after its parent's
pid and its own in a directory the arbiter made); the hook skips a worker that left
that mark. Marks of processes that are not the arbiter's children (a process a
worker forked) are never taken for a worker's, and are removed as workers exit.

The arbiter must never wait for that, and must never run a thread: it forks its
replacement workers, and a fork copies a lock held by another thread (an import in
progress, a connection pool's lock) locked forever into the child, which then hangs
on it. So the hook forks one short-lived cleanup process and returns at once; there
each backend is read in a thread of its own, so a backend that hangs (a Redis
failover, a database at ``max_connections``) holds up neither the arbiter (its
replacement worker, its timeouts, its signals) nor the other backends' locks. The
cleanup process inherits no connection of the arbiter's (each backend reconnects
after a fork), exits with status 0 once every backend is done or after
``CLEANUP_DEADLINE`` seconds, and is reaped by the arbiter like any other child.

The arbiter needs Django's settings: with ``--preload`` they are loaded already;
otherwise the hook calls ``django.setup()`` (``DJANGO_SETTINGS_MODULE`` must be set
in the arbiter's environment, as it is for ``manage.py``). If you have a
``child_exit`` hook of your own, call this one from it, and still import it at the
top of ``gunicorn.conf.py``: the import arms, in the arbiter before it forks its
workers, the marks of their orderly exits. Imported later (inside your hook, or in
the workers only), no worker marks its exit, and each exit counts as a hard death.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import Any

logger = logging.getLogger("django_setnx")

#: Where workers mark their orderly exits: made by the process that imports this
#: module (gunicorn's arbiter, reading gunicorn.conf.py), inherited by its workers.
_EXIT_MARKS = tempfile.mkdtemp(prefix="django-setnx-gunicorn-")
_ARBITER_PID = os.getpid()
#: How long a cleanup process may take (seconds): a backend that has not answered by
#: then is left to its locks' ttl, and the process exits.
CLEANUP_DEADLINE = 60.0


def _mark_orderly_exit(pid: int, parent: int) -> None:
    if os.getpid() == pid:  # not in a process forked from the worker
        try:
            open(os.path.join(_EXIT_MARKS, _mark_name(parent, pid)), "w").close()
        except OSError:  # the arbiter is gone, or the directory with it
            pass


def _mark_name(parent: int, pid: int) -> str:
    """A mark names the process' parent at fork too: only one forked by the arbiter
    is a worker's (a process a worker forked with ``os.fork`` arms the handler as
    well, and its pid may later be a worker's: review r133). Its parent when it was
    forked, not when it exits: one that outlives its worker is the arbiter's child
    by then if the arbiter is PID 1 (a container) or a subreaper (review r135)."""
    return f"{parent}-{pid}"


def _note_forking_parent() -> None:
    global _forking_parent
    _forking_parent = os.getpid()


def _arm_in_worker() -> None:
    # The parent as noted before the fork: os.getppid() in the child may already
    # name a subreaper, the parent having exited meanwhile.
    atexit.register(_mark_orderly_exit, os.getpid(), _forking_parent)


def _remove_marks() -> None:
    if os.getpid() in (_ARBITER_PID, _arbiter_seen):  # (``--daemon`` forks the arbiter)
        shutil.rmtree(_EXIT_MARKS, ignore_errors=True)


#: The arbiter's pid, as child_exit sees it: not the importer's under ``--daemon``,
#: which forks after reading gunicorn.conf.py.
_arbiter_seen: int | None = None


_forking_parent = os.getpid()
os.register_at_fork(before=_note_forking_parent, after_in_child=_arm_in_worker)
atexit.register(_remove_marks)


def exited_in_order(pid: int) -> bool:
    """Whether worker ``pid``, a child of this process (the arbiter), ran its exit
    handlers (and so is no dead owner); the mark is consumed, with every mark of a
    process that is not a child of this one (they would only pile up)."""
    arbiter = os.getpid()
    prefix = f"{arbiter}-"
    try:
        names = os.listdir(_EXIT_MARKS)
    except OSError:
        return False
    for stray in names:
        if not stray.startswith(prefix):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(_EXIT_MARKS, stray))
    try:
        os.remove(os.path.join(_EXIT_MARKS, _mark_name(arbiter, pid)))
    except FileNotFoundError:
        return False
    return True


def child_exit(server: Any, worker: Any) -> int | None:
    """gunicorn's ``child_exit`` server hook (see the module documentation).

    Returns the pid of the cleanup process freeing the worker's locks, or None when
    there is nothing to free (the worker exited in order) or the hook failed (it logs
    why). The arbiter does not wait for that process; it reaps it when it exits."""
    global _arbiter_seen
    try:
        _arbiter_seen = os.getpid()
        if exited_in_order(worker.pid):
            logger.debug("gunicorn worker %s exited in order: its locks stay", worker.pid)
            return None
        # Set Django up here, once, rather than in every cleanup process: it only
        # imports and reads settings (no connection is opened).
        _ensure_django()
        cleaner = os.fork()
    except Exception:  # a server hook must never take the arbiter down
        logger.warning("Could not free the locks of gunicorn worker %s", worker.pid, exc_info=True)
        return None
    if cleaner:
        return cleaner
    # The cleanup process: it must never return into gunicorn's arbiter loop.
    try:
        _detach_from_arbiter(server)
        _free_locks_of_dead_worker(worker.pid)
    except Exception:
        logger.warning("Could not free the locks of gunicorn worker %s", worker.pid, exc_info=True)
    finally:
        logging.shutdown()  # flush what the threads logged
        os._exit(0)  # 0: gunicorn halts on a child's boot/load error codes


def _detach_from_arbiter(server: Any) -> None:
    """In the cleanup process: drop what was the arbiter's, so that a signal sent to
    the process group ends this process instead of running the arbiter's handlers
    (which write to the arbiter's wake-up pipe), and the listening sockets are not
    kept open by it."""
    for signum in (
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGWINCH,
        signal.SIGTTIN,
        signal.SIGTTOU,
        signal.SIGCHLD,
    ):
        signal.signal(signum, signal.SIG_DFL)
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread (cannot happen in a fresh fork)
        pass
    for listener in getattr(server, "LISTENERS", None) or ():
        try:
            listener.close()
        except OSError:  # best effort: the process is short-lived anyway
            pass
    for fd in getattr(server, "PIPE", None) or ():
        try:
            os.close(fd)
        except OSError:
            pass


def _free_locks_of_dead_worker(pid: int) -> None:
    """In the cleanup process: free ``pid``'s locks, one thread per backend, waiting
    for all of them up to CLEANUP_DEADLINE."""
    from .. import dead_owners
    from ..handler import locks

    reason = (
        f"gunicorn worker {pid} died without exiting (SIGKILL after its "
        f"timeout, the OOM killer, or a crash)"
    )
    threads = [
        dead_owners.in_background(dead_owners.free_locks_of_pid, pid, reason, aliases=[alias])
        for alias in list(locks)
    ]
    deadline = time.monotonic() + CLEANUP_DEADLINE
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        logger.warning(
            "Freeing the locks of gunicorn worker %s took longer than %s s on some "
            "backend: its locks there are left to their ttl",
            pid,
            CLEANUP_DEADLINE,
        )


def _ensure_django() -> None:
    from django.apps import apps

    if not apps.ready:
        import django

        django.setup()
