"""The example project's Celery app (optional: ``pip install django-setnx[celery]``).

With ``SETNX_REDIS_URL`` set, that Redis is the broker too; start a worker with

    cd example_project && celery -A example_project worker -l info

Without it, tasks run eagerly, in the web request that enqueues them
(``task_always_eager``), so the demo needs no broker and no worker.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

BROKER_URL = os.environ.get("SETNX_REDIS_URL", "").strip()
EAGER = not BROKER_URL

app = Celery("example_project")
if EAGER:
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        broker_url="memory://",
        result_backend=None,
    )
else:
    app.conf.update(broker_url=BROKER_URL, broker_connection_retry_on_startup=True)
app.autodiscover_tasks(["demo"])
