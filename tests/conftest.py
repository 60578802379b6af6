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
    # Every configured alias: "default" (the database backend on SQLite) and
    # "locmem" are always configured, and tests use them by name even when
    # SETNX_TEST_BACKENDS leaves them out.
    return list(settings.SETNX_LOCKS)


@pytest.fixture(scope="session", autouse=True)
def _close_lock_connections(django_db_setup, django_db_blocker):
    """Close our own lock connections before the test databases are dropped."""
    yield
    from django_setnx import locks

    with django_db_blocker.unblock():
        locks.close_all()


@pytest.fixture(autouse=True)
def _django_db_marker(request):
    """pytest-django's own fixture of this name, except for ``autocommit`` tests.

    An ``autocommit`` test keeps its ``django_db`` marker (so that pytest-django
    creates the test databases it uses) but does not get the per-test transaction
    that the marker would start; ``_autocommit_database_access`` opens the
    databases to it instead.
    """
    if request.node.get_closest_marker("django_db") and "autocommit" not in request.keywords:
        request.getfixturevalue("_django_db_helper")


@pytest.fixture(autouse=True)
def _autocommit_database_access(request):
    """Tests marked ``autocommit`` use the test databases without pytest-django's
    per-test transaction: every statement commits at once, as in production. Tests
    of behaviour that depends on transactions (a lock released after COMMIT) need
    that; they clean up what they write themselves."""
    if "autocommit" not in request.keywords:
        yield
        return
    request.getfixturevalue("django_db_setup")
    with request.getfixturevalue("django_db_blocker").unblock():
        yield


@pytest.fixture(autouse=True)
def _clean_locks(request, _autocommit_database_access):
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


#: The parameters that name the lock backend a test runs on.
BACKEND_PARAMS = ("alias", "shared_alias", "db_alias", "worker_alias")
#: nodeid -> backend alias, and alias -> {outcome: count}, for the summary.
_backend_of = {}
_backend_outcomes = {}


def pytest_collection_modifyitems(config, items):
    # Every test touches a backend through our own connections, so every test may
    # use every test database.
    marker = pytest.mark.django_db(databases="__all__")
    for item in items:
        if "no_db" not in item.keywords:
            item.add_marker(marker)
        params = getattr(getattr(item, "callspec", None), "params", {})
        for key in BACKEND_PARAMS:
            if key in params:
                _backend_of[item.nodeid] = params[key]


def pytest_runtest_logreport(report):
    alias = _backend_of.get(report.nodeid)
    if alias is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
        counts = _backend_outcomes.setdefault(alias, {})
        counts[outcome] = counts.get(outcome, 0) + 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say which backends the run covered, and against which servers."""
    if not _backend_outcomes:
        return
    write = terminalreporter.write_line
    terminalreporter.section("backends covered")
    engines = {
        alias: params.get("ENGINE", "").rsplit(".", 1)[-1]
        for alias, params in settings.DATABASES.items()
    }
    for alias, lock_params in settings.SETNX_LOCKS.items():
        counts = _backend_outcomes.get(alias)
        if not counts:
            continue
        backend = lock_params["BACKEND"].rsplit(".", 1)[-1]
        database = (lock_params.get("OPTIONS") or {}).get("DATABASE")
        location = lock_params.get("LOCATION", "")
        if isinstance(location, (list, tuple)):
            location = f"{len(location)} masters"
        where = engines.get(database, "") if database else str(location)
        tally = ", ".join(
            f"{counts[k]} {k}" for k in ("passed", "failed", "skipped") if counts.get(k)
        )
        write(f"{alias:<10} {backend:<16} {where:<50} {tally}")
    missing = sorted(set(settings.TEST_BACKENDS) - {"sqlite"} - set(_backend_outcomes))
    if missing:
        write(f"not covered: {', '.join(missing)}", yellow=True)


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
