"""Waiting in asyncio without losing a cancellation.

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
from typing import Any


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
