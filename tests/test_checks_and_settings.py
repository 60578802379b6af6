"""System checks for SETNX_LOCKS, and the lazily read, resettable settings."""

import threading

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_setnx import lock, locks
from django_setnx.backends.database import DatabaseBackend
from django_setnx.backends.locmem import LocMemBackend
from django_setnx.conf import DEFAULT_SETNX_LOCKS
from django_setnx.handler import LockHandler

pytestmark = pytest.mark.no_db


def setnx_errors(**overrides):
    with override_settings(**overrides):
        return {(e.id, e.msg) for e in run_checks(tags=["django_setnx"])}


def ids(errors):
    return sorted(i for i, _ in errors)


def test_valid_settings_pass():
    assert setnx_errors() == set()


@pytest.mark.parametrize(
    "value, expected_id, fragment",
    [
        (["default"], "django_setnx.E001", "must be a dict of aliases, not list"),
        (
            {"other": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend"}},
            "django_setnx.E002",
            "does not define the 'default' alias (defined: 'other')",
        ),
        (
            {"default": "django_setnx.backends.locmem.LocMemBackend"},
            "django_setnx.E003",
            "must be a dict with a 'BACKEND' dotted path",
        ),
        (
            {"default": {"BACKEND": "django_setnx.backends.nope.Backend"}},
            "django_setnx.E004",
            "'django_setnx.backends.nope.Backend' cannot be imported",
        ),
        (
            {"default": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend", "TTL": 0}},
            "django_setnx.E005",
            "SETNX_LOCKS['default']['TTL'] must be a positive",
        ),
        (
            {"default": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend", "OPTIONS": []}},
            "django_setnx.E006",
            "['OPTIONS'] must be a dict, got []",
        ),
        (
            {"default": {"BACKEND": "collections.OrderedDict"}},
            "django_setnx.E007",
            "is not a lock backend",
        ),
        (
            {
                "default": {
                    "BACKEND": "django_setnx.backends.database.DatabaseBackend",
                    "OPTIONS": {"DATABASE": "missing"},
                }
            },
            "django_setnx.E020",
            "['DATABASE'] is 'missing', which is not in DATABASES",
        ),
    ],
)
def test_malformed_settings_are_reported(value, expected_id, fragment):
    errors = setnx_errors(SETNX_LOCKS=value)
    assert expected_id in ids(errors)
    assert any(fragment in msg for _, msg in errors), errors


def test_absent_setting_means_database_on_default(settings):
    del settings.SETNX_LOCKS
    assert setnx_errors() == set()
    backend = locks["default"]
    assert isinstance(backend, DatabaseBackend) and backend.database == "default"
    assert DEFAULT_SETNX_LOCKS["default"]["OPTIONS"] == {"DATABASE": "default"}


def test_settings_are_reread_after_override():
    before = locks["default"]
    with override_settings(
        SETNX_LOCKS={
            "default": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend", "TTL": 5},
        }
    ):
        assert isinstance(locks["default"], LocMemBackend)
        assert lock("x").ttl == 5
    assert isinstance(locks["default"], type(before)) and locks["default"] is not before


def test_a_backend_created_across_a_reset_is_not_kept_after_it():
    # override_settings(SETNX_LOCKS=...) resets the handler; a thread that was still
    # creating the alias from the old settings gets its backend (closed by the
    # reset, which waits for it), but the callers after the reset get one made
    # from the new settings.
    started, proceed = threading.Event(), threading.Event()

    class SlowHandler(LockHandler):
        def create_connection(self, alias):
            backend = super().create_connection(alias)
            started.set()
            proceed.wait(10)
            return backend

    handler = SlowHandler({"x": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend"}})
    created_before = []
    creator = threading.Thread(target=lambda: created_before.append(handler["x"]))
    creator.start()
    assert started.wait(10)
    resetter = threading.Thread(target=handler.reset)
    resetter.start()
    proceed.set()
    creator.join(10)
    resetter.join(10)
    assert handler["x"] is not created_before[0]
    assert handler["x"] is handler["x"]


def test_settings_read_across_a_reset_are_read_again_after_it():
    # A thread reads SETNX_LOCKS (the handler's settings) just before
    # override_settings changes them and resets the handler, and finishes reading
    # after the reset: what it read is the old settings, and must not stay cached
    # as the handler's settings once the reset is over.
    read_old, proceed = threading.Event(), threading.Event()
    old = {"x": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend", "TTL": 5}}
    new = {"x": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend", "TTL": 7}}

    class SlowReadingHandler(LockHandler):
        def configure_settings(self, given):
            configured = super().configure_settings(given)
            if configured is old:
                read_old.set()
                proceed.wait(10)
            return configured

    handler = SlowReadingHandler()
    with override_settings(SETNX_LOCKS=old):
        reader = threading.Thread(target=lambda: handler.settings)
        reader.start()
        assert read_old.wait(10)
    with override_settings(SETNX_LOCKS=new):
        handler.reset()  # what the setting_changed receiver does for `locks`
        proceed.set()
        reader.join(10)
        assert handler.settings is new
        assert handler["x"].default_ttl == 7


class SettingChangingBackend(LocMemBackend):
    """A backend whose constructor changes a setting the handler watches."""

    def __init__(self, alias, params):
        with override_settings(CACHES=dict(settings.CACHES)):  # resets the handler
            pass
        super().__init__(alias, params)


def test_a_setting_changed_while_a_backend_is_created_does_not_hang_the_creator():
    # The reset a setting change makes waits for backends being created, except in
    # the thread that creates one: it holds the creation lock itself.
    backend_path = f"{__name__}.SettingChangingBackend"
    with override_settings(SETNX_LOCKS={"changing": {"BACKEND": backend_path}}):
        created = []
        creator = threading.Thread(target=lambda: created.append(locks["changing"]), daemon=True)
        creator.start()
        creator.join(10)
        assert not creator.is_alive(), "the creating thread waits for itself"
        assert isinstance(created[0], SettingChangingBackend)


class SettingKeepingBackend(LocMemBackend):
    """A backend whose first constructor changes a setting and leaves it changed."""

    overrides = []

    def __init__(self, alias, params):
        self.marker = settings.CACHES.get("marker")
        if not self.overrides:
            override = override_settings(CACHES={**settings.CACHES, "marker": "new"})
            override.enable()  # resets the handler, from the creating thread
            self.overrides.append(override)
        super().__init__(alias, params)


def test_a_backend_whose_constructor_changes_the_settings_is_made_from_the_new_ones():
    backend_path = f"{__name__}.SettingKeepingBackend"
    with override_settings(SETNX_LOCKS={"keeping": {"BACKEND": backend_path}}):
        try:
            assert locks["keeping"].marker == "new"
            assert locks["keeping"] is locks["keeping"]
        finally:
            while SettingKeepingBackend.overrides:
                SettingKeepingBackend.overrides.pop().disable()


class NestingBackend(LocMemBackend):
    def __init__(self, alias, params):
        locks["inner"]
        super().__init__(alias, params)


class AsyncNestingBackend(LocMemBackend):
    def __init__(self, alias, params):
        async def inner():
            return locks["inner"]

        async_to_sync(inner)()  # runs it in another thread
        super().__init__(alias, params)


@pytest.mark.parametrize("backend", ["NestingBackend", "AsyncNestingBackend"])
def test_a_backend_constructor_using_the_handler_gets_an_error_not_a_hang(backend):
    nesting = {"BACKEND": f"{__name__}.{backend}"}
    inner = {"BACKEND": "django_setnx.backends.locmem.LocMemBackend"}
    outcome = []

    def create():
        try:
            locks["outer"]
        except ImproperlyConfigured as exc:
            outcome.append(exc)

    with override_settings(SETNX_LOCKS={"outer": nesting, "inner": inner}):
        creator = threading.Thread(target=create, daemon=True)  # a hang fails, not hangs
        creator.start()
        creator.join(10)
        assert not creator.is_alive(), "the creation waits for itself"
    assert "while another lock backend was being created" in str(outcome[0])


def test_handler_returns_one_instance_per_alias():
    assert locks["locmem"] is locks["locmem"]
    assert "locmem" in list(locks)


def test_broken_backend_path_raises_improperly_configured():
    with override_settings(SETNX_LOCKS={"default": {"BACKEND": "nowhere.Backend"}}):
        with pytest.raises(
            ImproperlyConfigured, match="Could not load lock backend 'nowhere.Backend'"
        ):
            lock("x")


def test_importing_reads_no_settings():
    import subprocess
    import sys

    # With no settings configured at all, importing the package must not fail.
    code = "import django_setnx, django_setnx.locking, django_setnx.handler; print('ok')"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        cwd=".",
    )
    assert out.stdout.strip() == "ok", out.stderr


LOCMEM = "django_setnx.backends.locmem.LocMemBackend"


@pytest.mark.parametrize("max_ttl", [10 * 365 * 86400 + 1, 1e15])
def test_a_max_ttl_above_ten_years_is_refused_by_checks_and_backends(max_ttl):
    value = {"default": {"BACKEND": LOCMEM, "OPTIONS": {"MAX_TTL": max_ttl}}}
    errors = setnx_errors(SETNX_LOCKS=value)
    assert ids(errors) == ["django_setnx.E008"]
    [(_, message)] = errors
    assert "MAX_TTL" in message and "10 years" in message
    with pytest.raises(ImproperlyConfigured, match="10 years"):
        LocMemBackend("default", value["default"])


@pytest.mark.parametrize(
    "ttl, shown", [(3601, "3601 s"), (2592000.25, "2592000.25 s"), (3600.5, "3600.5 s")]
)
def test_a_ttl_above_max_ttl_is_named_exactly(ttl, shown):
    backend = LocMemBackend("capped", {"BACKEND": LOCMEM, "OPTIONS": {"MAX_TTL": 3600}})
    with pytest.raises(ValueError) as caught:
        backend.check_ttl(ttl)
    assert str(caught.value) == (
        f"ttl {shown} is above the maximum of 3600 s "
        "(SETNX_LOCKS['capped']['OPTIONS']['MAX_TTL'])."
    )


@pytest.mark.parametrize("name", ["\udcff", "a\ud800b"])
def test_a_name_utf8_cannot_encode_is_refused(name):
    with pytest.raises(ValueError, match="UTF-8"):
        lock(name)


_REDIS = "django_setnx.backends.redis.RedisBackend"
_REDLOCK = "django_setnx.backends.redlock.RedlockBackend"
_LOCMEM = "django_setnx.backends.locmem.LocMemBackend"
_MASTERS = ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"]


def _redis(**options):
    return {"BACKEND": _REDIS, "LOCATION": "redis://127.0.0.1:1/0", "OPTIONS": options}


def _redlock(location=_MASTERS, **options):
    return {"BACKEND": _REDLOCK, "LOCATION": location, "OPTIONS": options}


@pytest.mark.parametrize(
    "params, error_id, message",
    [
        # A value the Lua scripts refuse made every release fail, the lock held for
        # its ttl (D1, D9, D10); the others were taken at first use, some unsafely.
        (_redis(FENCING_RETENTION=2e9), "E015", "above the 1e+09 s the Redis scripts take"),
        (_redis(STALE_RETENTION=1e300), "E014", "above the 1e+09 s"),
        (_redis(STALE_RETENTION=-5), "E014", "must be a positive number"),
        (_redis(STALE_RETENTION=True), "E014", "must be a positive number"),
        (_redis(STALE_RETENTION=float("nan")), "E014", "must be a positive number"),
        (_redis(WAKE_TTL=1e300), "E015", "above the 1e+09 s"),
        (_redis(CONNECTION_KWARGS={1: 2}), "E018", "must have str keys"),
        # Read by redis-py only when it connects (review r159).
        (_redis(CONNECTION_KWARGS={"health_check_interval": "abc"}), "E018", "health_check"),
        (_redis(CONNECTION_KWARGS={"socket_keepalive_options": [1]}), "E018", "keepalive"),
        (_redis(CONNECTION_KWARGS={"encoding": "nope-enc"}), "E018", "not a codec"),
        (_redlock(CONNECTION_KWARGS={"encoding": "nope-enc"}), "E037", "not a codec"),
        (_redlock(FENCING_RETENTION=2e9), "E035", "above the 1e+09 s"),
        (_redlock(FENCING_RETENTION="x"), "E035", "must be a positive number"),
        (_redlock(FENCING_RETENTION=-1), "E035", "must be a positive number"),
        (_redlock(STALE_RETENTION=2e9), "E035", "above the 1e+09 s"),
        (_redlock(CLOCK_DRIFT_FACTOR=-5), "E036", "in [0, 1)"),
        (_redlock(CLOCK_DRIFT_FACTOR="0.01"), "E036", "in [0, 1)"),
        (_redlock(NODE_TIMEOUT="1"), "E035", "must be a positive number"),
        (_redlock(NODE_TIMEOUT=True), "E035", "must be a positive number"),
        (_redlock(NODE_TIMEOUT=0), "E035", "NODE_TIMEOUT'] must be a positive number"),
        (_redlock(NODE_TIMEOUT=1e300), "E035", "above the 60 s"),
        (_redlock(ALLOW_EVICTION="True"), "E039", "must be True or False"),
        (_redlock(ALLOW_EVICTION=1), "E039", "must be True or False"),
        (_redlock(CONNECTION_KWARGS={1: 2}), "E037", "must have str keys"),
        # One server counted twice toward the majority (D12), also as two of its dbs
        # (review r159).
        (
            _redlock([_MASTERS[0], "redis://127.0.0.1:1", _MASTERS[2]]),
            "E033",
            "master(s) 2 point to the same server",
        ),
        (
            _redlock(["redis://127.0.0.1:1/0", "redis://127.0.0.1:1/1", "redis://127.0.0.1:1/2"]),
            "E033",
            "master(s) 2, 3 point to the same server",
        ),
        ({"BACKEND": _LOCMEM, "LOCATION": ["a"]}, "E040", "must be a str, got ['a']"),
        ({"BACKEND": _LOCMEM, "OPTIONS": [("MAX_TTL", 1)]}, "E006", "must be a dict"),
        ({**_redis(), "OPTIONS": [("MAX_TTL", 1)]}, "E006", "must be a dict"),
    ],
)
def test_first_use_refuses_what_the_check_refuses(params, error_id, message):
    """Review r156: values that ``manage.py check`` refused were taken at first use
    (a negative CLOCK_DRIFT_FACTOR made a Redlock lock's validity outlive its keys),
    or passed both and failed every release; some crashed with a bare TypeError.
    Now both say the same, before any connection (the servers here do not exist)."""
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "parity": params}):
        errors = [e for e in run_checks() if e.id.startswith("django_setnx.")]
        assert f"django_setnx.{error_id}" in [e.id for e in errors], errors
        assert any(message in e.msg for e in errors if e.id == f"django_setnx.{error_id}"), errors
        try:
            with pytest.raises(ImproperlyConfigured) as refused:
                locks["parity"].get("anything")
        finally:
            locks.close_all()
    assert message in str(refused.value)


@pytest.mark.parametrize("cache", [["default"], {"default": 1}, 7])
def test_a_cache_alias_that_is_not_a_str_is_refused_not_a_crash(cache):
    """Review r156 D2: a list or dict as OPTIONS['CACHE'] crashed manage.py check
    itself (unhashable type), and first use raised a bare TypeError."""
    params = {"BACKEND": _REDIS, "OPTIONS": {"CACHE": cache}}
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "parity": params}):
        errors = [e for e in run_checks() if e.id == "django_setnx.E016"]
        assert errors and "must be the alias (a str)" in errors[0].msg
        try:
            with pytest.raises(ImproperlyConfigured, match=r"must be the alias \(a str\)"):
                locks["parity"].get("anything")
        finally:
            locks.close_all()


def test_a_sentinel_url_query_wins_and_a_misspelt_argument_is_a_settings_error():
    """Review r156 D13/D14: a Sentinel URL's ``?socket_timeout=`` was overridden by
    the backend's default, and a misspelt CONNECTION_KWARGS raised redis-py's
    TypeError at first use. Nothing here connects (the sentinels do not exist)."""
    from django_setnx.backends.clients import sentinel as make_sentinel
    from django_setnx.backends.redis import RedisBackend

    sentinel = "django_setnx.backends.clients.sentinel"
    url = "redis+sentinel://127.0.0.1:1/mymaster/0?socket_timeout=0.5"
    backend = RedisBackend("s", {"LOCATION": url, "OPTIONS": {"CLIENT_CLASS": sentinel}})
    # The arguments the backend gives its CLIENT_CLASS (its defaults among them).
    made = make_sentinel(url, **backend._client_kwargs(None))
    assert made.connection_pool.connection_kwargs["socket_timeout"] == 0.5
    misspelt = RedisBackend(
        "s",
        {
            "LOCATION": "redis+sentinel://127.0.0.1:1/mymaster/0",
            "OPTIONS": {"CLIENT_CLASS": sentinel, "CONNECTION_KWARGS": {"socket_timout": 1}},
        },
    )
    with pytest.raises(ImproperlyConfigured, match="refuses its arguments.*socket_timout"):
        misspelt.get("anything")
    for kwargs in ({"sentinel_kwargs": "pw-secret"}, {"min_other_sentinels": "abc"}):
        wrong = RedisBackend(
            "s",
            {
                "LOCATION": "redis+sentinel://127.0.0.1:1/mymaster/0",
                "OPTIONS": {"CLIENT_CLASS": sentinel, "CONNECTION_KWARGS": kwargs},
            },
        )
        with pytest.raises(ImproperlyConfigured, match="CONNECTION_KWARGS.*got a str") as refused:
            wrong.get("anything")
        assert "pw-secret" not in str(refused.value)
