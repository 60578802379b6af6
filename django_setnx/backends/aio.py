"""Waiting in asyncio without losing a cancellation, and undoing a failed or
cancelled call without making its caller wait it out (:func:`undo`).

Before Python 3.12, ``asyncio.wait_for`` returns the awaited result, and drops the
``CancelledError``, when the task is cancelled in the very step in which what it
waits for completes. redis.asyncio sends every command through ``wait_for`` when a
``socket_timeout`` is set, as ours always is: a coroutine cancelled just as its
lock command was sent would carry on as if nothing happened (an ``aacquire``
cancelled at once waited out its whole timeout instead). Our own waits use
:func:`wait_at_most`, and the calls into redis.asyncio end with
:func:`raise_lost_cancellation`.

Telling a dropped cancellation takes ``Task.cancelling()``, new in Python 3.11. The
lock scripts are therefore written to the connection without ``wait_for`` (see
redis_asyncio._send_packed), so on Python 3.10 too a cancellation reaches them; it
can still be lost there in the other commands sent through redis.asyncio's own
``send_command``: a health-check PING, the nudge to a loop's waiting connection
(InboxWaits), a new connection's setup, the reload of a script the server lost.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..forksafe import ForkSafeLock

logger = logging.getLogger("django_setnx")


async def wait_at_most(future: asyncio.Future[Any], timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds (None: no limit) for ``future``, which is left
    as it is (never cancelled). Returns whether it is done. A cancellation of the
    caller always propagates."""
    if not future.done():
        await asyncio.wait((future,), timeout=timeout)
    return future.done()


def cancellations() -> int:
    """How many cancellations of the current task are pending (``Task.cancelling``,
    Python 3.11+; 0 before, where a lost one cannot be told)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 0


#: The attribute of a CancelledError raised by :func:`raise_lost_cancellation`:
#: ``(result,)`` of the call that completed before the cancellation came through.
_COMPLETED = "django_setnx_completed"


def raise_lost_cancellation(before: int, result: Any = None) -> None:
    """Raise ``asyncio.CancelledError`` if the current task was cancelled since
    :func:`cancellations` returned ``before`` and the error never reached it (a
    cancellation that was delivered and handled was uncancelled). The error carries
    ``result``, what the interrupted call returned (it ran), for a caller that must
    finish its bookkeeping before it ends cancelled (:func:`completed_call`). It is
    a plain ``CancelledError``, not a subclass: ``asyncio.timeout()`` of Python
    3.11 turns only that exact class into ``TimeoutError``."""
    if cancellations() > before:
        error = asyncio.CancelledError()
        setattr(error, _COMPLETED, (result,))
        raise error


def completed_call(error: BaseException) -> tuple[Any] | None:
    """``(result,)`` if ``error`` was raised by :func:`raise_lost_cancellation`
    after the call it interrupted had completed, else None (whether it ran is
    unknown)."""
    completed = getattr(error, _COMPLETED, None)
    return completed if isinstance(completed, tuple) else None


#: Seconds a caller whose call failed or was cancelled waits for the undo of that call
#: (withdraw from a queue, release what it may have written) before it gets control
#: back: on a server that answers, an undo takes a millisecond or so and is done by
#: then; on one that stopped answering, each of its commands would take a whole
#: socket timeout, and the caller's ``timeout`` or cancellation would be overrun by
#: that much (review r116). The undo goes on in its own task to its end.
UNDO_PATIENCE = 0.5

#: The undo tasks that outlived their caller (the event loop keeps only weak
#: references to tasks).
_undoing: set[asyncio.Task[Any]] = set()


def _done(task: asyncio.Task[Any], if_cancelled: Callable[[], Any] | None) -> None:
    _undoing.discard(task)
    if not task.cancelled():
        task.exception()  # an undo reports its own errors: never "never retrieved"
        return
    # Cancelled by the loop's shutdown (asyncio.run and async_to_sync cancel every
    # task left once their coroutine returns), which may come before the undo is
    # done: a lock handed to a waiter that gave up would stay held for its ttl. The
    # sync twin finishes it in a thread of its own, independent of the loop.
    if if_cancelled is None:
        logger.warning("An undo of django-setnx was cancelled before its end")
        return
    logger.info("An undo of django-setnx was cancelled; finishing it in a thread")
    _start_twin(if_cancelled)


#: At interpreter exit, the sync twins still running are waited for this long in all
#: (seconds), then left: a daemon thread each, so that a server that stopped
#: answering to a client with no socket timeout cannot keep the process from
#: exiting (review r120).
TWINS_AT_EXIT = 5.0
_twins: set[threading.Thread] = set()
_twins_guard = ForkSafeLock()  # a forked child never waits on its parent's
_twins_joined_at_exit = False


def _start_twin(if_cancelled: Callable[[], Any]) -> None:
    global _twins_joined_at_exit
    thread = threading.Thread(
        target=_run_twin, args=(if_cancelled,), name="django-setnx-undo", daemon=True
    )
    with _twins_guard:
        if not _twins_joined_at_exit:
            _twins_joined_at_exit = True
            atexit.register(_join_twins)
        _twins.add(thread)
    thread.start()


def _run_twin(if_cancelled: Callable[[], Any]) -> None:
    try:
        if_cancelled()
    finally:
        with _twins_guard:
            _twins.discard(threading.current_thread())


def _join_twins() -> None:
    deadline = time.monotonic() + TWINS_AT_EXIT
    with _twins_guard:
        running = list(_twins)
    for thread in running:
        thread.join(max(deadline - time.monotonic(), 0.0))


async def undo(
    work: Coroutine[Any, Any, Any],
    if_cancelled: Callable[[], Any] | None = None,
    patience: float = UNDO_PATIENCE,
) -> None:
    """Run ``work`` (an undo, which handles its own errors) to its end in a task of
    its own, waiting for it up to ``patience`` seconds. A cancellation of the caller
    during that wait propagates at once; ``work`` is not cancelled by it, nor by the
    caller's earlier cancellation that this undo follows. If ``work`` is cancelled
    anyway (the event loop shuts down: its task is cancelled with every other),
    ``if_cancelled()``, the same undo with sync calls, runs in a thread (it must
    handle its own errors, and be harmless if ``work`` had done part of it)."""
    task = asyncio.ensure_future(work)
    _undoing.add(task)
    task.add_done_callback(functools.partial(_done, if_cancelled=if_cancelled))
    await wait_at_most(task, patience)


#: The attribute of an error raised by a backend call that already undid itself
#: (see :func:`mark_undone`).
_UNDONE = "django_setnx_undone"


def mark_undone(error: BaseException) -> None:
    """Mark ``error``, about to be raised by a backend's acquire that already undid
    its attempt (withdrew from the queue, released what it may have written): the
    Lock need not undo it again, which on a server that stopped answering would cost
    one more socket timeout per command (review r116)."""
    setattr(error, _UNDONE, True)


def was_undone(error: BaseException) -> bool:
    """True if ``error``, or an error it was raised from, is marked by
    :func:`mark_undone`."""
    return _marked(error, _UNDONE)


#: The attribute of an error raised before a command was sent (see
#: :func:`mark_unsent`).
_UNSENT = "django_setnx_unsent"


def mark_unsent(error: BaseException) -> None:
    """Mark ``error``, raised before any byte of a command left for the server (the
    connection was refused, or failed in its handshake): the command did not run, so
    there is nothing to undo. Its undo would have nothing to undo either, and on a
    server that is down it would only wait: retried in the background, then at
    interpreter exit (see redis_undo)."""
    setattr(error, _UNSENT, True)


def was_unsent(error: BaseException) -> bool:
    """True if ``error``, or an error it was raised from, is marked by
    :func:`mark_unsent`."""
    return _marked(error, _UNSENT)


def _marked(error: BaseException, attribute: str) -> bool:
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 5:
        if getattr(current, attribute, False):
            return True
        current, seen = current.__cause__, seen + 1
    return False
