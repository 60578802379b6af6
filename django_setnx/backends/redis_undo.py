"""Undos that the server did not answer, sent again until it does.

An acquire that got no reply (the socket timed out: the server stalled on a long
script, a fork for a snapshot, a frozen VM; or the connection broke) may have been
written, or may still be: a stalled server runs the commands it had read once it
resumes, even those of a connection the client has since closed. The backend
undoes such an acquire at once (it withdraws from the queue and releases under the
caller's token, see ``RedisBackend._abandon_quietly``). Against a server that is
still stalled, that undo gets no answer either, and the acquire then runs when the
server resumes: its lock was held by nobody for its whole ttl (reviews r121, r123).

So an undo that got no answer is handed to :class:`UndoRetries`: a thread of the
process sends it again, with backoff, until the server answers it, whatever the
answer (the commands are token-checked: they never touch another caller's lock). An
answered undo comes after the acquire it undoes. Redis runs each connection's
commands in order and, on resuming, serves the connections that have something to
read in the order their data arrived, and connections made during the stall after
those (it accepts them first); the acquire was sent before its undo, on another
connection (a connection is dropped when its reply times out).

A caller that tries again with the same token (the acquire is idempotent for it)
takes its undo back first (:meth:`UndoRetries.withdraw`): the lock it wins must not be
released behind it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..forksafe import PerProcess

logger = logging.getLogger("django_setnx")

#: Seconds an unanswered undo is sent again for, at least: a lock with a longer ttl,
#: for its ttl. A server that answers none of them in that time and then runs the
#: acquire leaves its lock held by nobody until its ttl, as before.
RETRY_FOR = 300.0
#: The first wait before sending an undo again (seconds), doubled after each
#: unanswered attempt up to MAX_DELAY: a stalled server gets a command every
#: MAX_DELAY seconds from each process at most, plus the attempt's own socket timeout.
FIRST_DELAY = 0.1
MAX_DELAY = 2.0
#: Unanswered undos kept per backend and process; beyond that the oldest is dropped,
#: with a warning (its lock, if the acquire runs, is held until its ttl).
MAX_PENDING = 10_000


class _Pending:
    """One unanswered undo: the lock's record name, when it was handed over and when
    to give up (monotonic), when to send it next, and the wait after that."""

    __slots__ = ("delay", "due", "give_up_at", "name", "since")

    def __init__(self, name: str, since: float, give_up_at: float) -> None:
        self.name = name
        self.since = since
        self.give_up_at = give_up_at
        self.due = since + FIRST_DELAY
        self.delay = FIRST_DELAY


class _State:
    """This process' undos (a forked child starts with none: its parent retries
    them)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.pending: dict[str, _Pending] = {}  # token -> undo, oldest first
        self.thread: threading.Thread | None = None
        self.in_flight: str | None = None  # the token being sent now
        self.withdrawn_in_flight = False


class UndoRetries:
    """The unanswered undos of one backend, sent again by a thread of their own.

    ``undo_once(name, token)`` sends the undo once: it returns True if the server
    answered it, False if it did not (a timeout, a broken connection, a server
    loading or busy with a script), and raises for an answer that is an error (the
    undo is then given up, logged). The thread exists only while undos are
    pending.
    """

    def __init__(self, alias: str, undo_once: Callable[[str, str], bool]) -> None:
        self.alias = alias
        self._undo_once = undo_once
        self._states: PerProcess[_State] = PerProcess(_State)

    def add(self, name: str, token: str, ttl: float) -> None:
        """Send the undo of ``token``'s acquire of ``name`` (a lock of ``ttl``
        seconds) again until the server answers it."""
        state = self._states.get()
        now = time.monotonic()
        with state.condition:
            pending = state.pending
            pending.pop(token, None)
            if len(pending) >= MAX_PENDING:
                oldest = next(iter(pending))
                dropped = pending.pop(oldest)
                logger.warning(
                    "Lock backend %r: more than %d undos unanswered; gave up the undo of "
                    "lock %r (if its acquire ran, the lock is held by nobody until its ttl)",
                    self.alias,
                    MAX_PENDING,
                    dropped.name,
                )
            pending[token] = _Pending(name, now, now + max(RETRY_FOR, ttl))
            if state.thread is None:
                state.thread = threading.Thread(
                    target=self._run, args=(state,), name="django-setnx-undo-retry", daemon=True
                )
                state.thread.start()
            state.condition.notify_all()

    def has(self, token: str) -> bool:
        """True if an undo of ``token`` is pending or being sent (read without the
        lock: a hint for the hot path, confirmed by :meth:`withdraw`)."""
        state = self._states.get()
        return token in state.pending or state.in_flight == token

    def withdraw(self, token: str) -> None:
        """Forget the undo of ``token``, waiting for an attempt being sent now to
        end (a socket timeout at most): its caller is about to try the acquire
        again with that token."""
        state = self._states.get()
        with state.condition:
            state.pending.pop(token, None)
            if state.in_flight == token:
                state.withdrawn_in_flight = True
                while state.in_flight == token:
                    state.condition.wait()

    def __len__(self) -> int:
        state = self._states.get()
        return len(state.pending) + (state.in_flight is not None)

    def _run(self, state: _State) -> None:
        condition = state.condition
        while True:
            with condition:
                if not state.pending:
                    state.thread = None
                    return
                token, undo = min(state.pending.items(), key=lambda item: item[1].due)
                wait = undo.due - time.monotonic()
                if wait > 0:
                    condition.wait(wait)
                    continue
                del state.pending[token]
                state.in_flight = token
                state.withdrawn_in_flight = False
            answered = self._send(undo.name, token)
            with condition:
                state.in_flight = None
                withdrawn = state.withdrawn_in_flight
                condition.notify_all()
                if answered or withdrawn:
                    continue
                now = time.monotonic()
                if now >= undo.give_up_at:
                    logger.warning(
                        "Lock backend %r: the server did not answer the undo of a failed "
                        "acquire of lock %r in %.0f s; gave up (if the acquire ran, the "
                        "lock is held by nobody until its ttl)",
                        self.alias,
                        undo.name,
                        now - undo.since,
                    )
                    continue
                undo.due = now + undo.delay
                undo.delay = min(undo.delay * 2, MAX_DELAY)
                state.pending.setdefault(token, undo)

    def _send(self, name: str, token: str) -> bool:
        """One attempt; True if it is over (answered, or answered with an error)."""
        try:
            return self._undo_once(name, token)
        except Exception:  # answered, with an error (logged): nothing to retry
            logger.warning(
                "Lock backend %r: the undo of a failed acquire of lock %r failed",
                self.alias,
                name,
                exc_info=True,
            )
            return True
