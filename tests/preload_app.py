"""A WSGI app for the gunicorn ``--preload`` test (tests/test_gunicorn.py).

Loaded once in gunicorn's master, which then forks its workers. At import it uses
the lock backend named by ``SETNX_PRELOAD_ALIAS``, so the backend's connections are
open *before* the fork, as they are when a project's import-time code (an app's
``ready()``, a module-level warm-up) touches a lock. ``increment/`` increments a
counter file with a non-atomic read-modify-write under ``@locked``; ``stuck/`` holds
a lock past gunicorn's timeout, and ``try-stuck/`` says whether that lock is free.
"""

import os
import time

import django
from django.core.wsgi import get_wsgi_application
from django.http import HttpResponse
from django.urls import path

django.setup()

from django_setnx import lock, locked  # noqa: E402 - after django.setup()

ALIAS = os.environ["SETNX_PRELOAD_ALIAS"]
COUNTER = os.environ["SETNX_PRELOAD_COUNTER"]

# Open the backend's connections in the master, before gunicorn forks.
with lock("preload:warm-up", ttl=10, backend=ALIAS, timeout=10) as _warm:
    assert _warm.owned()


@locked("preload:counter", ttl=30, timeout=30, backend=ALIAS, release_on_commit=False)
def increment(request):
    with open(COUNTER) as f:
        value = int(f.read() or 0)
    time.sleep(0.002)  # widen the window in which a second holder would lose an update
    with open(COUNTER, "w") as f:
        f.write(str(value + 1))
    return HttpResponse(f"{os.getpid()}")


@locked("preload:stuck", ttl=60, timeout=0, backend=ALIAS, release_on_commit=False)
def stuck(request):
    """Sleeps past gunicorn's --timeout, like a handler stuck in a C call that nothing
    interrupts: the SystemExit of gunicorn's SIGABRT is swallowed (otherwise it would
    unwind through @locked, which releases), so the arbiter SIGKILLs the worker with
    the lock held (tests/test_gunicorn.py, the child_exit hook)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            time.sleep(deadline - time.monotonic())
        except SystemExit:
            pass
    return HttpResponse("woke up")


def keep(request):
    """Takes ``preload:kept`` (ttl 60) and leaves it held on purpose, as a cooldown
    does: a worker recycled afterwards must not have it freed."""
    kept = lock("preload:kept", ttl=60, backend=ALIAS)
    return HttpResponse(f"{os.getpid()} {kept.acquire(blocking=False)}")


def try_stuck(request):
    attempt = lock("preload:stuck", ttl=5, backend=ALIAS)
    if not attempt.acquire(blocking=False):
        return HttpResponse("held", status=409)
    attempt.release()
    return HttpResponse("free")


urlpatterns = [
    path("increment/", increment),
    path("stuck/", stuck),
    path("try-stuck/", try_stuck),
    path("keep/", keep),
    path("ping/", lambda request: HttpResponse("pong")),
]
application = get_wsgi_application()
