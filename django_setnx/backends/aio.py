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


class CancelledAfter(asyncio.CancelledError):
    """A cancellation that ``wait_for`` dropped, raised again once the call it
    interrupted had completed: ``result`` is what that call returned (the script
    ran), for a caller that must finish its bookkeeping before it ends cancelled."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result


def raise_lost_cancellation(before: int, result: Any = None) -> None:
    """Raise :class:`CancelledAfter` (carrying ``result``) if the current task was
    cancelled since :func:`cancellations` returned ``before`` and the error never
    reached it (a cancellation that was delivered and handled was uncancelled)."""
    if cancellations() > before:
        raise CancelledAfter(result)
