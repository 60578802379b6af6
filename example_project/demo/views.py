"""The demo: views guarded by locks, a Celery task, and a page listing the locks.

- ``/report/``: a 5-second job under ``@locked("demo:slow-report", ttl=30)``. Open it
  in two tabs (or ``curl`` it twice at once): the first request takes the lock and
  works; the second finds it held and answers at once with HTTP 409 "busy, try
  again" and a ``Retry-After`` header: the time the job still needs (the lock's ttl
  is a safety bound, not the job's length).
- ``/async-report/``: the same with an ``async def`` view (run it under ASGI, or
  ``runserver``, which adapts it).
- ``/export/``: a 5-second export under ``@locked("demo:exports", limit=3)``: a
  semaphore, so three requests run at once and the fourth answers 409.
- ``/task/``: a Celery task that is run-exclusive and enqueue-once
  (``demo/tasks.py``); a second click while it runs is refused as a duplicate.
- ``/locks/``: every lock of every backend; ``/admin/``: the admin's Locks page.
"""

import asyncio
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from django_setnx import Semaphore, locked, locks
from django_setnx.decorators import retry_after_seconds
from django_setnx.exceptions import LockBackendError

LOCK_NAME = "demo:slow-report"
ASYNC_LOCK_NAME = "demo:async-report"
EXPORTS_NAME = "demo:exports"
EXPORTS_LIMIT = 3
LOCK_TTL = 30  # seconds: longer than the job, so the lock never expires mid-job
JOB_SECONDS = 5


def _backend_name():
    return settings.SETNX_LOCKS["default"]["BACKEND"].rsplit(".", 1)[-1]


def job_time_left(lock, request=None):
    """Seconds until the holder's job should be done: JOB_SECONDS after it took the
    lock, by the backend's clock (the ``retry_after`` of the demo views)."""
    try:
        # A semaphore's first slot to free is its oldest holder's.
        holders = lock.holders() if isinstance(lock, Semaphore) else [lock.info()]
    except LockBackendError:
        return 1
    held = [info for info in holders if info is not None and info.is_held]
    if not held:
        return 1
    return min(JOB_SECONDS - (info.now_ms - info.acquired_at_ms) / 1000 for info in held)


def busy_page(lock, request, *args, **kwargs):
    """``on_contention`` of the demo views: the busy page, HTTP 409 with Retry-After."""
    try:
        # None if it was released in the meantime; a semaphore's: its first holder.
        holders = lock.holders() if isinstance(lock, Semaphore) else [lock.info()]
    except LockBackendError:
        holders = []
    holder = holders[0] if holders else None
    retry_after = retry_after_seconds(lock, job_time_left, request)
    response = render(
        request,
        "demo/busy.html",
        {"lock_name": lock.name, "holder": holder, "retry_after": retry_after},
        status=409,
    )
    response["Retry-After"] = str(retry_after)
    return response


#: The same page for async views: a coroutine, which ``@locked`` awaits.
async_busy_page = sync_to_async(busy_page)


def _fencing_token(name):
    """The fencing token of the lock this request holds (for the page)."""
    info = locks["default"].get(name)
    return info.fencing_token if info is not None else None


def index(request):
    """Links to every part of the demo."""
    return render(
        request,
        "demo/index.html",
        {
            "backend": _backend_name(),
            "redis_url": settings.SETNX_REDIS_URL,
            "aliases": list(locks),
        },
    )


@locked(LOCK_NAME, ttl=LOCK_TTL, on_contention=busy_page)
def slow_report(request):
    """Run the 5-second "report" unless another request is running it right now."""
    started = time.monotonic()
    time.sleep(JOB_SECONDS)  # the slow job
    return render(
        request,
        "demo/report.html",
        {
            "lock_name": LOCK_NAME,
            "fencing_token": _fencing_token(LOCK_NAME),
            "seconds": time.monotonic() - started,
            "backend": _backend_name(),
            "is_async": False,
        },
    )


@locked(ASYNC_LOCK_NAME, ttl=LOCK_TTL, on_contention=async_busy_page)
async def async_report(request):
    """The same job as an ``async def`` view: the lock is taken with ``aacquire()``."""
    started = time.monotonic()
    await asyncio.sleep(JOB_SECONDS)  # the slow job, without blocking the event loop
    return render(
        request,
        "demo/report.html",
        {
            "lock_name": ASYNC_LOCK_NAME,
            "fencing_token": await sync_to_async(_fencing_token)(ASYNC_LOCK_NAME),
            "seconds": time.monotonic() - started,
            "backend": _backend_name(),
            "is_async": True,
        },
    )


@locked(EXPORTS_NAME, ttl=LOCK_TTL, limit=EXPORTS_LIMIT, on_contention=busy_page)
def export(request):
    """At most three exports at once, across every process serving the site: each
    request holds one of the three slots of the semaphore ``demo:exports``."""
    started = time.monotonic()
    time.sleep(JOB_SECONDS)
    return render(
        request,
        "demo/report.html",
        {
            "lock_name": EXPORTS_NAME,
            "limit": EXPORTS_LIMIT,
            "seconds": time.monotonic() - started,
            "backend": _backend_name(),
            "is_async": False,
        },
    )


@require_http_methods(["GET", "POST"])
def task(request):
    """A button that enqueues the demo Celery task; says whether it was refused."""
    try:
        from demo import tasks
    except (ImportError, ImproperlyConfigured) as exc:  # celery is optional
        return render(request, "demo/task.html", {"celery_missing": str(exc)})
    context = {
        "broker": tasks.app.conf.broker_url if not tasks.EAGER else None,
        "eager": tasks.EAGER,
        "task_seconds": tasks.TASK_SECONDS,
    }
    if request.method == "POST":
        try:
            result = tasks.rebuild_search_index.delay("shop-1")
        except tasks.AlreadyQueued as exc:
            context.update(outcome="refused", task_id=exc.task_id, lock_name=exc.name)
        else:
            context.update(outcome="queued", task_id=result.id)
            if tasks.EAGER:
                context["result"] = result.result
    return render(request, "demo/task.html", context)


def lock_list(request):
    """Every lock of every configured backend: name, state, fencing token, owner, expiry."""
    backends = []
    for alias in locks:
        try:
            infos = sorted(locks[alias].list(), key=lambda info: info.name)
            error = None
        except LockBackendError as exc:
            infos, error = [], str(exc)
        backends.append({"alias": alias, "locks": infos, "error": error})
    return render(request, "demo/locks.html", {"backends": backends})
