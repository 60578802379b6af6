"""Local-memory backend: locks shared by the threads of one process.

For tests and single-process development only: another process (a second runserver
worker, a Celery worker) has its own memory and does not see these locks. Backends
with the same ``LOCATION`` share their store, as Django's locmem cache does.
Waiters are woken by a release: threads through a condition variable, coroutines
through a future of their event loop (no thread per waiting coroutine), the one that
has waited longest on that name, which passes the wake-up on if it is cancelled.
"""

import asyncio
import collections
import threading
import time

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from ..forksafe import ForkSafeLock, PerProcess
from ..validation import redacted
from .base import STATES, AcquireResult, BaseLockBackend, ClearResult, LockInfo, encode_owner

# LOCATION -> _Store; module-level so that two aliases naming one LOCATION share it.
_stores: dict[str, "_Store"] = {}
_stores_lock = ForkSafeLock()


class _Store:
    def __init__(self):
        self.records = {}  # name -> dict(token, owner JSON, acquired, expires, fencing)
        self._condition = PerProcess(threading.Condition)
        # name -> deque of (event loop, future), one per waiting coroutine of this
        # process, oldest first: a forked child must not wake its parent's loops
        # (their self-pipe is shared).
        self._async_waiters = PerProcess(dict)
        # The last fencing token minted: tokens are a hybrid clock (this process'
        # clock in µs, or the last token plus one if larger), so nothing per name
        # outlives its record and tokens still increase after a release.
        self.last_fencing = 0

    @property
    def condition(self):
        """This process' condition: a forked child gets its own (a parent thread
        may have held the parent's at the fork, and is not in the child)."""
        return self._condition.get()

    @property
    def async_waiters(self):
        return self._async_waiters.get()

    def mint(self):
        self.last_fencing = max(self.last_fencing + 1, time.time_ns() // 1000)
        return self.last_fencing

    def wake(self, name):
        """``name`` is free: wake its waiters (called holding the condition). Every
        waiting thread retries its acquire, and the coroutine that has waited longest
        on ``name``: waking them all would have each retry on every release, and a
        thousand waiters cost a million attempts (review r146)."""
        self.condition.notify_all()
        self.wake_coroutine(name)

    def wake_coroutine(self, name):
        """Wake the coroutine that has waited longest on ``name``, if any (called
        holding the condition)."""
        waiters = self.async_waiters
        queue = waiters.get(name)
        while queue:
            loop, future = queue.popleft()
            try:
                loop.call_soon_threadsafe(_resolve, future)
                break
            except RuntimeError:  # its loop is closed: nobody waits there any more
                continue
        if queue is not None and not queue:
            del waiters[name]

    def stop_waiting(self, name, entry):
        """Take ``entry`` (a coroutine's ``(loop, future)``) out of ``name``'s queue
        (called holding the condition). Returns False if it was not there any more:
        a wake-up came for it, or is on its way."""
        waiters = self.async_waiters
        queue = waiters.get(name)
        try:
            queue.remove(entry)
        except (AttributeError, ValueError):  # no queue; not in it
            return False
        if not queue:
            del waiters[name]
        return True


def _resolve(future):
    if not future.done():
        future.set_result(None)


def _now_ms():
    return time.time_ns() // 1_000_000


def _location_problem(alias, params):
    """The message for a LOCATION that cannot name a store (not a str: a list was
    a TypeError at first use, and 1 and "1" named two stores), else None."""
    location = params.get("LOCATION")
    if location is None or isinstance(location, str):
        return None
    return (
        f"SETNX_LOCKS[{alias!r}]['LOCATION'] names the local-memory store and must be "
        f"a str, got {redacted(location)}."
    )


class LocMemBackend(BaseLockBackend):
    wakes_waiters = True

    @classmethod
    def check_params(cls, alias, params):
        """``django_setnx.E040`` for a LOCATION that is not a str, as first use says."""
        problem = _location_problem(alias, params)
        return [] if problem is None else [checks.Error(problem, id="django_setnx.E040")]

    def __init__(self, alias, params):
        super().__init__(alias, params)
        problem = _location_problem(alias, params)
        if problem is not None:
            raise ImproperlyConfigured(problem)
        location = params.get("LOCATION") or ""
        with _stores_lock:
            self._store = _stores.setdefault(location, _Store())

    def _info(self, name, record, now):
        return LockInfo.from_record(
            name,
            self.alias,
            now,
            owner=record["owner"],
            acquired=record["acquired"],
            expires=record["expires"],
            fencing=record["fencing"],
            raw=record,
        )

    def acquire(self, name, token, ttl, owner, wait=0.0):
        ttl_ms = self.check_ttl(ttl)
        store = self._store
        with store.condition:
            now = _now_ms()
            record = store.records.get(name)
            if record is not None and record["expires"] > now:
                return AcquireResult.lost(retry_after=(record["expires"] - now) / 1000)
            fencing = store.mint()
            store.records[name] = {
                "token": token,
                # Stored as JSON, as every other backend stores it: a value the
                # caller changes after the acquire is not changed here.
                "owner": encode_owner(owner),
                "acquired": now,
                "expires": now + ttl_ms,
                "fencing": fencing,
            }
            return AcquireResult.won(fencing)

    def release(self, name, token):
        store = self._store
        with store.condition:
            record = store.records.get(name)
            if record is None or record["token"] != token:
                return False
            del store.records[name]
            store.wake(name)
            return True

    def extend(self, name, token, ttl):
        ttl_ms = self.check_ttl(ttl)
        with self._store.condition:
            record = self._store.records.get(name)
            if record is None or record["token"] != token:
                return False
            record["expires"] = _now_ms() + ttl_ms
            return True

    def owns(self, name, token):
        with self._store.condition:
            record = self._store.records.get(name)
            return (
                record is not None and record["token"] == token and record["expires"] > _now_ms()
            )

    def get(self, name):
        with self._store.condition:
            record = self._store.records.get(name)
            return None if record is None else self._info(name, record, _now_ms())

    def list(self, *, state=None, name_glob=None):
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        with self._store.condition:
            now = _now_ms()
            infos = [self._info(n, r, now) for n, r in sorted(self._store.records.items())]
        return self.filter_infos(infos, state=state, name_glob=name_glob)

    def delete(self, name, fencing_token=None):
        with self._store.condition:
            record = self._store.records.get(name)
            if record is None:
                return None
            info = self._info(name, record, _now_ms())
            if fencing_token is not None and info.fencing_token != fencing_token:
                return None
            del self._store.records[name]
            self._store.wake(name)
            return info

    def clear(
        self, *, include_held=False, name_glob=None, older_than=None, dry_run=False, progress=None
    ):
        result = ClearResult(self.alias)
        with self._store.condition:
            now = _now_ms()
            candidates = self.filter_infos(
                [self._info(n, r, now) for n, r in sorted(self._store.records.items())],
                name_glob=name_glob,
            )
            for info in candidates:
                if info.is_held and not include_held:
                    continue
                if older_than is not None and now - info.acquired_at_ms < older_than * 1000:
                    continue
                if not dry_run:
                    del self._store.records[info.name]
                    self._store.wake(info.name)
                result.names.append(info.name)
        if progress is not None and result.names:
            progress(list(result.names))
        return result

    @staticmethod
    def _wait_timeout(max_wait, retry_after):
        timeout = retry_after + 0.001 if retry_after is not None else 1.0
        if max_wait is not None:
            timeout = min(timeout, max_wait)
        return max(timeout, 0)

    def _is_held(self, name):
        record = self._store.records.get(name)
        return record is not None and record["expires"] > _now_ms()

    def wait(self, name, *, token, attempt, max_wait, retry_after):
        """Sleep until a release in this process (or the holder's expiry); returns
        None: the caller retries (no queue: the first retry wins)."""
        with self._store.condition:
            if self._is_held(name):
                self._store.condition.wait(self._wait_timeout(max_wait, retry_after))
        return None

    async def aacquire(self, name, token, ttl, owner, wait=0.0):
        """Async twin of :meth:`acquire`, in the event loop: a dict operation under a
        lock. Not in an executor thread: a woken waiter's retry cancelled before a
        thread took it up never ran, and the wake-up it had been given was lost
        (review r147). The price: while another thread holds the store's lock for a
        ``list()`` or ``clear()`` of a very large store (0.6 s for 100,000 records),
        the event loop waits for it too (review r148)."""
        return self.acquire(name, token, ttl, owner, wait)

    async def await_release(self, name, *, token, attempt, max_wait, retry_after):
        """Async twin of :meth:`wait`, in the event loop: a future that a release of
        ``name`` resolves, the longest-waiting coroutine's first (review r144: the
        wait ran in the loop's default executor, whose few threads the waiters then
        filled, and the holders' releases queued behind them). Returns None: the
        caller retries, and its release wakes the next; cancelled once woken, it
        wakes the next itself."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        store = self._store
        with store.condition:
            if not self._is_held(name):
                return None
            store.async_waiters.setdefault(name, collections.deque()).append(entry)
        try:
            await asyncio.wait((entry[1],), timeout=self._wait_timeout(max_wait, retry_after))
        except BaseException:  # cancelled: the wake-up it took is not lost
            with store.condition:
                if not store.stop_waiting(name, entry):
                    store.wake_coroutine(name)
            raise
        with store.condition:
            store.stop_waiting(name, entry)
        return None
