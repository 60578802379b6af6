"""Every exception of the package survives the trips Django projects send it on:
``pickle`` (multiprocessing, Celery's pickle serializer) and Celery's JSON
serialization of a task's error, with the same class, message and attributes."""

import pickle

import pytest
from celery import Celery

from django_setnx.backends.base import LockInfo
from django_setnx.contrib.celery import AlreadyQueued
from django_setnx.exceptions import (
    InvalidLockBackendError,
    LockBackendError,
    LockError,
    LockNotAcquired,
    LockNotOwned,
)

pytestmark = pytest.mark.no_db

INFO = LockInfo(
    name="sync:7",
    backend="redis",
    fencing_token=12,
    owner={"host": "h", "pid": 1},
    acquired_at_ms=1_000,
    expires_at_ms=61_000,
    now_ms=2_000,
)

EXCEPTIONS = [
    LockError("plain"),
    LockNotAcquired("report:1"),
    LockNotAcquired("report:1", 5),
    LockNotAcquired("report:1", 5, "Task t[1]: lock 'report:1' is held by pid 3."),
    LockNotOwned("report:1"),
    LockNotOwned("report:1", "it was lost"),
    LockBackendError("redis", "acquire failed: ConnectionError: refused"),
    AlreadyQueued("celery-once:sync:7", "shop.sync", "abc-123", INFO),
    AlreadyQueued("celery-once:sync:7", "shop.sync"),
    InvalidLockBackendError("The lock backend 'x' is not configured."),
]


def same(a, b):
    return type(a) is type(b) and str(a) == str(b) and vars(a) == vars(b) and a.args == b.args


@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_pickle_round_trip(exc):
    assert same(pickle.loads(pickle.dumps(exc)), exc)


@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_celery_json_round_trip(exc):
    """What a JSON result backend stores for a failed task, and what result.get()
    raises from it."""
    app = Celery("setnx-exc", set_as_current=False)
    app.conf.result_serializer = "json"
    app.conf.accept_content = ["json"]
    backend = app.backend
    stored = backend.encode(backend.prepare_exception(exc, "json"))
    back = backend.exception_to_python(backend.decode(stored))
    assert type(back) is type(exc)
    assert str(back) == str(exc), "the message is not wrapped twice"
    for attribute in ("name", "timeout", "alias", "reason", "task_name", "task_id", "info"):
        if hasattr(exc, attribute):
            assert getattr(back, attribute) == getattr(exc, attribute), attribute


def test_messages_do_not_grow_when_rebuilt_from_args():
    exc = LockBackendError("redis", "down")
    assert str(type(exc)(*exc.args)) == "Lock backend 'redis': down"
