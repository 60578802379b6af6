import multiprocessing
import uuid

import pytest
from django.conf import settings

pytest_plugins = ["tests.redis_plugin", "tests.scaleout_plugin"]


def pytest_generate_tests(metafunc):
    # ``alias`` runs a test on every backend of the contract suite; ``shared_alias``
    # only on backends that several processes can share (not locmem);
    # ``db_alias`` only on the database backends.
    if "alias" in metafunc.fixturenames:
        metafunc.parametrize("alias", settings.CONTRACT_ALIASES)
    if "shared_alias" in metafunc.fixturenames:
        metafunc.parametrize("shared_alias", settings.MULTIPROCESS_ALIASES)
    if "db_alias" in metafunc.fixturenames:
        metafunc.parametrize(
            "db_alias", [a for a in settings.CONTRACT_ALIASES if a in settings.DATABASES]
        )


def _all_aliases():
    # "default" (the database backend on SQLite) is always configured and some
    # tests use it by name, even when SETNX_TEST_BACKENDS leaves SQLite out.
    return list(dict.fromkeys([*settings.CONTRACT_ALIASES, "default"]))


@pytest.fixture(scope="session", autouse=True)
def _close_lock_connections(django_db_setup, django_db_blocker):
    """Close our own lock connections before the test databases are dropped."""
    yield
    from django_setnx import locks

    with django_db_blocker.unblock():
        locks.close_all()


@pytest.fixture(autouse=True)
def _clean_locks(request):
    """Start and end every test with no lock records (fencing counters are kept)."""
    from django_setnx import locks

    yield
    if "django_db" in request.keywords or "db" in request.fixturenames:
        for alias in _all_aliases():
            locks[alias].clear(include_held=True)


@pytest.fixture
def name():
    """A lock name no other test uses."""
    return f"test:{uuid.uuid4().hex}"


@pytest.fixture
def spawn():
    """Start child processes with the ``spawn`` method; kill leftovers at the end."""
    ctx = multiprocessing.get_context("spawn")
    started = []

    def start(target, *args):
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    start.ctx = ctx
    yield start
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)


def pytest_collection_modifyitems(config, items):
    # Every test touches a backend through our own connections, so every test may
    # use every test database.
    marker = pytest.mark.django_db(databases="__all__")
    for item in items:
        if "no_db" not in item.keywords:
            item.add_marker(marker)


def pytest_sessionfinish(session, exitstatus):
    # In CI a skipped backend test is a failure: a missing server must not pass
    # for a green run.
    if not settings.CI:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(
            f"CI=true: {len(skipped)} test(s) were skipped; every backend must run in CI.",
            red=True,
        )
        session.exitstatus = 1
