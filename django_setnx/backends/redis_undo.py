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
takes the undo back first (:meth:`UndoRetries.withdraw`), waiting for an attempt
being sent, the caller's own first one included (an async caller gets its error
before its undo's first attempt ends, see aio.UNDO_PATIENCE): the lock it wins must
not be released behind it (review r125).

At interpreter exit the undos still pending are sent once more, for AT_EXIT seconds
at most; what is left then is logged (a short-lived process, a management command
or a worker recycled by ``max_requests``, would otherwise leave them).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

from ..forksafe import ForkSafeLock, PerProcess

logger = logging.getLogger("django_setnx")

#: Seconds an unanswered undo is sent again for, at least: a lock with a longer ttl,
#: for its ttl. A server that answers none of them in that time and then runs the
#: acquire leaves its lock held by nobody until its ttl, as before.
RETRY_FOR = 300.0
#: The wait before sending the undos again after one went unanswered (seconds),
#: doubled after each unanswered attempt up to MAX_DELAY, and back to FIRST_DELAY once
#: one is answered. One undo is sent at a time: while the server is silent (stalled,
#: or refusing connections), each process sends one undo every MAX_DELAY seconds at
#: most (plus the attempt's own timeouts), however many are pending; once it
#: answers, the others follow back to back.
FIRST_DELAY = 0.1
MAX_DELAY = 2.0
#: Unanswered undos kept per backend and process; beyond that the oldest is dropped
#: (its lock, if its acquire runs, is held until its ttl), logged once in a thousand.
MAX_PENDING = 10_000
#: The longest a caller trying an acquire again with the token of a pending undo
#: waits for an attempt of that undo being sent (seconds): two commands, each a
#: socket timeout at most, are far less; an undo whose first attempt never ended (its
#: thread died with the interpreter) is not waited for past this.
WITHDRAW_PATIENCE = 30.0
#: At interpreter exit, the longest the pending undos of all backends are sent for.
AT_EXIT = 5.0

_Key = tuple[str, str]  # (record name, token)


class _Pending:
    """One unanswered undo: when it was handed over and when to give up
    (monotonic)."""

    __slots__ = ("give_up_at", "since")

    def __init__(self, since: float, give_up_at: float) -> None:
        self.since = since
        self.give_up_at = give_up_at


class _State:
    """This process' undos of one backend (a forked child starts with none: its
    parent sends them). Every field is read and written under ``condition``."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.pending: dict[_Key, _Pending] = {}  # next to send first
        #: First attempts being made by their callers (a sync acquire's thread, an
        #: async acquire's undo task), and the key the thread is sending now.
        self.undoing: set[_Key] = set()
        self.in_flight: _Key | None = None
        #: Keys taken back while being sent: not to be pending again.
        self.withdrawn: set[_Key] = set()
        self.thread: threading.Thread | None = None
        self.silent_until = 0.0  # no undo is sent before (monotonic)
        self.delay = FIRST_DELAY  # the next silence's
        self.dropped = 0  # undos dropped past MAX_PENDING


#: Every UndoRetries of the process, for the exit hook.
_ALL: weakref.WeakSet[UndoRetries] = weakref.WeakSet()
_exit_hook = ForkSafeLock()
_exit_hook_registered = False
#: The process whose exit hook already ran (see send_at_exit), and the process
#: whose multiprocessing finalizer is registered (see _register_child_exit_hook).
_sent_at_exit_in: int | None = None
_child_hook_in: int | None = None


class UndoRetries:
    """The unanswered undos of one backend, sent again by a thread of their own.

    ``undo_once(name, token)`` sends the undo once: it returns True if the server
    answered it, False if it did not (a timeout, a broken or refused connection, a
    server loading or busy with a script), and raises for an answer that is an error
    (the undo is then given up, logged). The thread exists only while undos are
    pending.
    """

    def __init__(self, alias: str, undo_once: Callable[[str, str], bool]) -> None:
        self.alias = alias
        self._undo_once = undo_once
        self._states: PerProcess[_State] = PerProcess(_State)
        _ALL.add(self)
        _register_exit_hook()

    # -- what the backend calls ----------------------------------------------------

    def begin(self, name: str, token: str) -> None:
        """A caller is about to send the first undo of ``token``'s acquire of
        ``name`` (it calls :meth:`end` when that attempt is over)."""
        _register_child_exit_hook()  # (an attempt may outlive a child's run: r132)
        state = self._states.get()
        key = (name, token)
        with state.condition:
            state.undoing.add(key)
            # A withdraw that stopped waiting for an earlier attempt (see
            # WITHDRAW_PATIENCE) left its mark: it is not about this one.
            state.withdrawn.discard(key)

    def end(self, name: str, token: str, answered: bool, ttl: float) -> None:
        """The caller's first attempt is over: if the server did not answer it, the
        undo is sent again until it does (unless taken back meanwhile)."""
        state = self._states.get()
        key = (name, token)
        with state.condition:
            state.undoing.discard(key)
            withdrawn = key in state.withdrawn
            state.withdrawn.discard(key)
            if not answered and not withdrawn:
                self._add(state, key, ttl)
            state.condition.notify_all()

    def pend(self, name: str, token: str, ttl: float) -> None:
        """Leave the undo of ``token``'s acquire of ``name`` to the retries, as after
        a first attempt that got no answer: sent from their thread until the server
        answers it."""
        self.begin(name, token)
        self.end(name, token, False, ttl)

    def has(self, name: str, token: str) -> bool:
        """True if an undo of ``token``'s acquire of ``name`` is pending or being
        sent."""
        state = self._states.get()
        key = (name, token)
        with state.condition:
            return key in state.pending or key in state.undoing or state.in_flight == key

    def withdraw(self, name: str, token: str) -> None:
        """Forget the undo of ``token``'s acquire of ``name``, waiting for an attempt
        being sent now to end (WITHDRAW_PATIENCE at most): its caller is about to
        try the acquire again with that token."""
        state = self._states.get()
        key = (name, token)
        deadline = time.monotonic() + WITHDRAW_PATIENCE
        with state.condition:
            state.pending.pop(key, None)
            while key in state.undoing or state.in_flight == key:
                state.withdrawn.add(key)
                left = deadline - time.monotonic()
                if left <= 0:
                    state.undoing.discard(key)
                    break
                state.condition.wait(left)
            state.pending.pop(key, None)

    def __len__(self) -> int:
        """Undos pending or being sent by the thread."""
        state = self._states.get()
        with state.condition:
            return len(state.pending) + (state.in_flight is not None)

    # -- the thread ------------------------------------------------------------------

    def _add(self, state: _State, key: _Key, ttl: float) -> None:
        """Make ``key`` pending (under the condition), starting the thread."""
        now = time.monotonic()
        pending = state.pending
        pending.pop(key, None)
        if len(pending) >= MAX_PENDING:
            oldest = next(iter(pending))
            del pending[oldest]
            state.dropped += 1
            if state.dropped % 1000 == 1:  # the first, then one in a thousand
                logger.warning(
                    "Lock backend %r: more than %d undos unanswered; gave up %d so far, "
                    "the last of lock %r (if its acquire ran, the lock is held by "
                    "nobody until its ttl)",
                    self.alias,
                    MAX_PENDING,
                    state.dropped,
                    oldest[0],
                )
        pending[key] = _Pending(now, now + max(RETRY_FOR, ttl))
        if state.thread is None:
            # Its first attempt just went unanswered: the server is silent.
            state.silent_until = now + state.delay
            state.thread = threading.Thread(
                target=self._run, args=(state,), name="django-setnx-undo-retry", daemon=True
            )
            state.thread.start()

    def _run(self, state: _State) -> None:
        condition = state.condition
        while True:
            with condition:
                if not state.pending:
                    state.thread = None
                    state.delay = FIRST_DELAY
                    condition.notify_all()
                    return
                wait = state.silent_until - time.monotonic()
                if wait > 0:
                    condition.wait(wait)
                    continue
                # Marked in flight before it leaves ``pending``, and pending again
                # before the mark goes: has() never misses it (review r125).
                key = next(iter(state.pending))
                state.in_flight = key
                undo = state.pending.pop(key)
            answered = self._send(*key)
            with condition:
                if answered:
                    state.delay = FIRST_DELAY  # the others are sent right away
                else:
                    now = time.monotonic()
                    state.silent_until = now + state.delay
                    state.delay = min(state.delay * 2, MAX_DELAY)
                    if key not in state.withdrawn:
                        state.pending[key] = undo  # behind the others
                    self._give_up_expired(state, now)
                state.withdrawn.discard(key)
                state.in_flight = None
                condition.notify_all()

    def _give_up_expired(self, state: _State, now: float) -> None:
        """Drop the undos sent in vain for their whole time (under the condition),
        with one warning for all."""
        expired = [key for key, undo in state.pending.items() if now >= undo.give_up_at]
        if not expired:
            return
        for key in expired:
            del state.pending[key]
        logger.warning(
            "Lock backend %r: the server answered none of the undos of %d failed "
            "acquires in %.0f s or more (lock %r among them); gave them up (a lock whose "
            "acquire ran is held by nobody until its ttl)",
            self.alias,
            len(expired),
            RETRY_FOR,
            expired[0][0],
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

    def _flush(self, deadline: float) -> int:
        """At exit: send what is pending now, until ``deadline``. Returns how many
        undos are left."""
        state = self._states.get()
        with state.condition:
            state.silent_until = 0.0
            state.delay = FIRST_DELAY
            state.condition.notify_all()
            while state.undoing or ((state.pending or state.in_flight) and state.thread):
                # (A first attempt still being made, a sync twin's, ends in pending.)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                state.condition.wait(min(left, 0.05))
            return len(state.pending) + len(state.undoing) + (state.in_flight is not None)


def _register_exit_hook() -> None:
    """Register :func:`send_at_exit` once per process, when the first UndoRetries
    is made: before the sync twins of async undos register theirs (aio), so that it
    runs after them (atexit runs the last registered first), and they hand it what
    they could not send (review r128). One registered while the hooks run is never
    called."""
    global _exit_hook_registered
    with _exit_hook:
        if not _exit_hook_registered:
            _exit_hook_registered = True
            atexit.register(send_at_exit)


def _register_child_exit_hook() -> None:
    """In a multiprocessing child (``Process``, ``Pool``), also run
    :func:`send_at_exit` as one of its finalizers: a forked child ends with
    ``os._exit``, which skips atexit (review r128). Registered when the process'
    first undo begins (its first attempt may still be under way when the child's
    work returns: review r132), since a child starts with its parent's finalizers
    cleared. (A Celery prefork child ends with ``os._exit`` too, before billiard's
    finalizers: contrib.celery calls send_at_exit on ``worker_process_shutdown``.)"""
    global _child_hook_in
    if _child_hook_in == os.getpid():
        return
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is None or multiprocessing.parent_process() is None:
        return
    pid = os.getpid()
    with _exit_hook:
        if _child_hook_in == pid:
            return
        _child_hook_in = pid
    from multiprocessing import util

    util.Finalize(None, send_at_exit, exitpriority=0)


def send_at_exit() -> None:
    """The exit hook: the pending undos of every backend, sent for AT_EXIT seconds at
    most in all, and what is left logged. Runs once per process (a spawned
    multiprocessing child runs its finalizers, then atexit)."""
    global _sent_at_exit_in
    pid = os.getpid()
    with _exit_hook:
        if _sent_at_exit_in == pid:
            return
        _sent_at_exit_in = pid
    deadline = time.monotonic() + AT_EXIT
    for retries in list(_ALL):
        left = retries._flush(deadline)
        if left:
            logger.warning(
                "Lock backend %r: %d undos of failed acquires were still unanswered at "
                "exit (a lock whose acquire ran is held by nobody until its ttl)",
                retries.alias,
                left,
            )
