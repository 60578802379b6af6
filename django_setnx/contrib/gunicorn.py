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
exit (an ``atexit`` handler, armed at fork, touches a file named after its pid in a
directory the arbiter made); the hook skips a worker that left that mark.

The arbiter must never wait for that: the hook returns at once, and each backend is
read in a daemon thread of its own, so a backend that hangs (a Redis failover, a
database at ``max_connections``) holds up neither the arbiter (its replacement
worker, its timeouts, its signals) nor the other backends' locks.

The arbiter needs Django's settings: with ``--preload`` they are loaded already;
otherwise the hook calls ``django.setup()`` (``DJANGO_SETTINGS_MODULE`` must be set
in the arbiter's environment, as it is for ``manage.py``). If you have a
``child_exit`` hook of your own, call this one from it.
"""

import atexit
import logging
import os
import shutil
import tempfile

logger = logging.getLogger("django_setnx")

#: Where workers mark their orderly exits: made by the process that imports this
#: module (gunicorn's arbiter, reading gunicorn.conf.py), inherited by its workers.
_EXIT_MARKS = tempfile.mkdtemp(prefix="django-setnx-gunicorn-")
_ARBITER_PID = os.getpid()


def _mark_orderly_exit(pid):
    if os.getpid() == pid:  # not in a process forked from the worker
        try:
            open(os.path.join(_EXIT_MARKS, str(pid)), "w").close()
        except OSError:  # the arbiter is gone, or the directory with it
            pass


def _arm_in_worker():
    atexit.register(_mark_orderly_exit, os.getpid())


def _remove_marks():
    if os.getpid() == _ARBITER_PID:
        shutil.rmtree(_EXIT_MARKS, ignore_errors=True)


os.register_at_fork(after_in_child=_arm_in_worker)
atexit.register(_remove_marks)


def exited_in_order(pid):
    """Whether worker ``pid`` ran its exit handlers (and so is no dead owner); the
    mark is consumed."""
    mark = os.path.join(_EXIT_MARKS, str(pid))
    try:
        os.remove(mark)
    except FileNotFoundError:
        return False
    return True


def child_exit(server, worker):
    """gunicorn's ``child_exit`` server hook (see the module documentation).

    Returns the threads freeing the worker's locks, one per backend (joining them is
    only for tests: the arbiter does not wait)."""
    try:
        if exited_in_order(worker.pid):
            logger.debug("gunicorn worker %s exited in order: its locks stay", worker.pid)
            return []
        _ensure_django()
        from .. import dead_owners
        from ..handler import locks

        reason = (
            f"gunicorn worker {worker.pid} died without exiting (SIGKILL after its "
            f"timeout, the OOM killer, or a crash)"
        )
        return [
            dead_owners.in_background(
                dead_owners.free_locks_of_pid, worker.pid, reason, aliases=[alias]
            )
            for alias in list(locks)
        ]
    except Exception:  # a server hook must never take the arbiter down
        logger.warning("Could not free the locks of gunicorn worker %s", worker.pid, exc_info=True)
        return []


def _ensure_django():
    from django.apps import apps

    if not apps.ready:
        import django

        django.setup()
