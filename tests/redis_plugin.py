"""pytest plugin: a throwaway Redis for the suite, and private ones for crash tests.

Unless ``SETNX_TEST_REDIS_URL`` points at a Redis already, one session
:class:`~tests.servers.RedisServer` is started at configure time; its URL goes into
the environment (so child processes of the race tests use it too) and into the
``redis`` lock alias. Fixtures:

- ``redis_server``: a private server per test, for tests that stop or kill Redis;
- ``redis_client``: a ``redis.Redis`` on the session server.
"""

import os

import pytest

from tests.servers import RedisServer

URL_ENV = "SETNX_TEST_REDIS_URL"
_session_server = None


def _redis_enabled(settings):
    return "redis" in getattr(settings, "TEST_BACKENDS", ())


def pytest_configure(config):
    global _session_server
    from django.conf import settings

    if not settings.configured or not _redis_enabled(settings) or os.environ.get(URL_ENV):
        return
    _session_server = RedisServer().start()
    os.environ[URL_ENV] = _session_server.url
    settings.SETNX_LOCKS["redis"]["LOCATION"] = _session_server.url
    settings.REDIS_URL = _session_server.url

    from django_setnx.handler import locks

    locks.reset()


def pytest_unconfigure(config):
    global _session_server
    if _session_server is None:
        return
    from django_setnx.handler import locks

    locks.reset()
    _session_server.cleanup()
    _session_server = None
    os.environ.pop(URL_ENV, None)


@pytest.fixture
def redis_server():
    """A private, running RedisServer; stopped and removed after the test."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client():
    """A ``redis.Redis`` on the suite's Redis (the ``redis`` lock alias' server)."""
    import redis
    from django.conf import settings

    if not _redis_enabled(settings):
        pytest.skip("redis is not in settings.TEST_BACKENDS")
    client = redis.Redis.from_url(os.environ[URL_ENV])
    yield client
    client.close()
