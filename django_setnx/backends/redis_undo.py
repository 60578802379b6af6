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
#: The wait before sending the undos again after one went unanswered (seconds),
#: doubled after each unanswered attempt up to MAX_DELAY, and back to FIRST_DELAY once
#: one is answered. One undo is sent at a time: while the server is silent, each
#: process sends it one command every MAX_DELAY seconds at most (plus the attempt's
#: own socket timeout), however many undos are pending; once it answers, the others
#: follow back to back.
FIRST_DELAY = 0.1
MAX_DELAY = 2.0
#: Unanswered undos kept per backend and process; beyond that the oldest is dropped,
#: with a warning (its lock, if the acquire runs, is held until its ttl).
MAX_PENDING = 10_000


class _Pending:
    """One unanswered undo: the lock's record name, and when it was handed over and
    when to give up (monotonic)."""

    __slots__ = ("give_up_at", "name", "since")

    def __init__(self, name: str, since: float, give_up_at: float) -> None:
        self.name = name
        self.since = since
        self.give_up_at = give_up_at


class _State:
    """This process' undos (a forked child starts with none: its parent sends
    them)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.pending: dict[str, _Pending] = {}  # token -> undo, next to send first
        self.thread: threading.Thread | None = None
        self.in_flight: str | None = None  # the token being sent now
        self.withdrawn_in_flight = False
        self.silent_until = 0.0  # no undo is sent before (monotonic)
        self.delay = FIRST_DELAY  # the next silence's
        self.dropped = 0  # undos dropped past MAX_PENDING


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
                dropped = pending.pop(next(iter(pending)))  # the oldest
                state.dropped += 1
                if state.dropped % 1000 == 1:  # the first, then one in a thousand
                    logger.warning(
                        "Lock backend %r: more than %d undos unanswered; gave up %d, "
                        "the last of lock %r (if its acquire ran, the lock is held by "
                        "nobody until its ttl)",
                        self.alias,
                        MAX_PENDING,
                        state.dropped,
                        dropped.name,
                    )
            pending[token] = _Pending(name, now, now + max(RETRY_FOR, ttl))
            if state.thread is None:
                # Its first undo just went unanswered: the server is silent.
                state.silent_until = now + state.delay
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
                    state.delay = FIRST_DELAY
                    return
                wait = state.silent_until - time.monotonic()
                if wait > 0:
                    condition.wait(wait)
                    continue
                token = next(iter(state.pending))
                undo = state.pending.pop(token)
                state.in_flight = token
                state.withdrawn_in_flight = False
            answered = self._send(undo.name, token)
            with condition:
                state.in_flight = None
                withdrawn = state.withdrawn_in_flight
                condition.notify_all()
                if answered:
                    state.delay = FIRST_DELAY  # the others are sent right away
                    continue
                now = time.monotonic()
                state.silent_until = now + state.delay
                state.delay = min(state.delay * 2, MAX_DELAY)
                if not withdrawn:
                    state.pending[token] = undo  # behind the others
                self._give_up_expired(state, now)

    def _give_up_expired(self, state: _State, now: float) -> None:
        """Drop the undos sent in vain for their whole time (under the condition)."""
        expired = [token for token, undo in state.pending.items() if now >= undo.give_up_at]
        for token in expired:
            undo = state.pending.pop(token)
            logger.warning(
                "Lock backend %r: the server did not answer the undo of a failed acquire "
                "of lock %r in %.0f s; gave up (if the acquire ran, the lock is held by "
                "nobody until its ttl)",
                self.alias,
                undo.name,
                now - undo.since,
            )

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
