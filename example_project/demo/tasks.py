"""A Celery task that is both run-exclusive and enqueue-once.

- enqueue-once (``once_policy="raise"``): while one ``rebuild_search_index("shop-1")``
  is queued or running, a second ``.delay("shop-1")`` raises ``AlreadyQueued`` and
  sends nothing;
- run-exclusive (``lock_name``): on the worker, the body runs under the lock
  ``demo:search-index:shop-1``, so two copies never run at once, whoever sent them
  (``on_contention="skip"``: a copy that meets the lock does nothing).

Needs Celery (``pip install django-setnx[celery]``); the views import this module
lazily and explain how to install it when it is missing.
"""

import time

from example_project.celery import EAGER, app

from django_setnx.contrib.celery import AlreadyQueued, ExclusiveTask

__all__ = ["EAGER", "TASK_SECONDS", "AlreadyQueued", "app", "rebuild_search_index"]

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
