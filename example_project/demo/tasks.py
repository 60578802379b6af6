"""A Celery task that is both run-exclusive and enqueue-once.

- enqueue-once (``once_policy="raise"``): while one ``rebuild_search_index("shop-1")``
  is queued or running, a second ``.delay("shop-1")`` raises ``AlreadyQueued`` and
  sends nothing;
- run-exclusive (``lock_name``): on the worker, the body runs under the lock
  ``demo:search-index:shop-1``, so two copies never run at once, whoever sent them
  (``on_contention="skip"``: a copy that meets the lock does nothing).

``export_invoices`` shows ``lock_limit``: its run lock is a semaphore, so at most two
exports run at once across every worker; a third waits for a slot, retrying every
5 s (``on_contention="retry"``).

Needs Celery (``pip install django-setnx[celery]``); the views import this module
lazily and explain how to install it when it is missing.
"""

import time

from example_project.celery import EAGER, app

from django_setnx.contrib.celery import AlreadyQueued, ExclusiveTask

__all__ = [
    "EAGER",
    "TASK_SECONDS",
    "AlreadyQueued",
    "app",
    "export_invoices",
    "rebuild_search_index",
]

TASK_SECONDS = 5


@app.task(
    base=ExclusiveTask,
    lock_name="demo:search-index:{shop}",
    lock_ttl=60,
    on_contention="skip",
    once_policy="raise",
    once_ttl=600,
)
def rebuild_search_index(shop):
    """The slow job: pretend to rebuild a shop's search index."""
    started = time.monotonic()
    time.sleep(TASK_SECONDS)
    return f"rebuilt the search index of {shop} in {time.monotonic() - started:.1f} s"


@app.task(
    base=ExclusiveTask,
    bind=True,
    lock_name="demo:invoice-exports",
    lock_limit=2,
    lock_ttl=60,
    on_contention="retry",
    lock_retry_countdown=5,
)
def export_invoices(self, month):
    """At most two of these run at once, whatever the number of workers."""
    time.sleep(TASK_SECONDS)
    return f"exported the invoices of {month}"
