"""Settings of the test suite: every backend against real servers.

Which servers take part is decided here, once, from the environment:

- ``SETNX_TEST_BACKENDS``: comma list among ``sqlite,postgres,mysql,redis,locmem``
  (default: all of them that are reachable; with ``CI=true``: all, reachable or not,
  so a missing server fails the run instead of skipping).
- ``SETNX_TEST_REDIS_URL``: the Redis to use; unset, the suite starts a throwaway
  ``redis-server`` of its own (see ``tests/servers.py``).
- ``SETNX_TEST_PG`` / ``SETNX_TEST_MYSQL``: ``host:port`` of PostgreSQL (user
  postgres) and MariaDB/MySQL (user root), default 127.0.0.1 and standard ports.
- ``SETNX_TEST_DB_NAMES``: JSON ``{alias: NAME}`` given to child processes so they
  open the test databases the parent created (set by ``tests/workers.py``).
"""

import json
import os
import socket
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

SECRET_KEY = "django-setnx-tests-only"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
# The gunicorn test serves tests/preload_app.py's URLs with these settings.
ROOT_URLCONF = os.environ.get("SETNX_TEST_URLCONF", "tests.urls")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_setnx",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def _reachable(hostport, default_port):
    host, _, port = hostport.partition(":")
    try:
        with socket.create_connection((host, int(port or default_port)), timeout=0.5):
            return True
    except OSError:
        return False


PG_HOST, _, PG_PORT = os.environ.get("SETNX_TEST_PG", "127.0.0.1:5432").partition(":")
MYSQL_HOST, _, MYSQL_PORT = os.environ.get("SETNX_TEST_MYSQL", "127.0.0.1:3306").partition(":")

_requested = os.environ.get("SETNX_TEST_BACKENDS")
if _requested:
    TEST_BACKENDS = [b.strip() for b in _requested.split(",") if b.strip()]
elif CI:
    TEST_BACKENDS = ["sqlite", "postgres", "mysql", "redis", "locmem"]
else:
    TEST_BACKENDS = ["sqlite", "redis", "locmem"]
    if _reachable(f"{PG_HOST}:{PG_PORT}", 5432):
        TEST_BACKENDS.insert(1, "postgres")
    if _reachable(f"{MYSQL_HOST}:{MYSQL_PORT}", 3306):
        TEST_BACKENDS.insert(2, "mysql")

# Child processes of the race tests must open the databases the parent created.
_db_names = json.loads(os.environ.get("SETNX_TEST_DB_NAMES", "{}"))
# Test databases are per test run, so two runs on one machine never collide.
_run_id = os.getpid()

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": _db_names.get("default", str(BASE_DIR / ".sqlite-dev.db")),
        # A file, not :memory:, so that other processes (and our own lock
        # connection) see the same database.
        "TEST": {"NAME": str(BASE_DIR / f".sqlite-test-{_run_id}.db")},
        "OPTIONS": {"timeout": 20},
    }
}
if "postgres" in TEST_BACKENDS:
    DATABASES["postgres"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db_names.get("postgres", "django_setnx"),
        "USER": "postgres",
        "HOST": PG_HOST,
        "PORT": PG_PORT or "5432",
        "TEST": {"NAME": f"test_django_setnx_{_run_id}"},
    }
if "mysql" in TEST_BACKENDS:
    try:  # PyMySQL needs no C compiler or client library; Django talks to it as MySQLdb.
        import MySQLdb  # noqa: F401
    except ImportError:
        import pymysql

        pymysql.install_as_MySQLdb()
    DATABASES["mysql"] = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": _db_names.get("mysql", "django_setnx"),
        "USER": "root",
        "HOST": MYSQL_HOST,
        "PORT": MYSQL_PORT or "3306",
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {
            "NAME": f"test_django_setnx_{_run_id}",
            "CHARSET": "utf8mb4",
            "COLLATION": "utf8mb4_unicode_ci",
        },
    }

REDIS_URL = os.environ.get("SETNX_TEST_REDIS_URL", "")

SETNX_LOCKS = {
    "default": {
        "BACKEND": "django_setnx.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "default"},
    },
    "locmem": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend"},
}
if "postgres" in TEST_BACKENDS:
    SETNX_LOCKS["postgres"] = {
        "BACKEND": "django_setnx.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "postgres"},
    }
if "mysql" in TEST_BACKENDS:
    SETNX_LOCKS["mysql"] = {
        "BACKEND": "django_setnx.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "mysql"},
    }
if "redis" in TEST_BACKENDS:
    SETNX_LOCKS["redis"] = {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        # Filled in by tests/conftest.py once the throwaway server is up.
        "LOCATION": REDIS_URL or "redis://127.0.0.1:0/0",
        "KEY_PREFIX": "setnx-test",
    }

# A backend that never answers (a TCP listener that never replies), listed first:
# tests/test_gunicorn.py checks that it holds nothing up in the arbiter's hook.
if os.environ.get("SETNX_TEST_HUNG_REDIS_URL"):
    SETNX_LOCKS = {
        "hung": {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": os.environ["SETNX_TEST_HUNG_REDIS_URL"],
            "KEY_PREFIX": "setnx-test",
        },
        **SETNX_LOCKS,
    }

#: Lock aliases the contract suite runs against, in order.
CONTRACT_ALIASES = [
    alias
    for backend, alias in [
        ("sqlite", "default"),
        ("postgres", "postgres"),
        ("mysql", "mysql"),
        ("redis", "redis"),
        ("locmem", "locmem"),
    ]
    if backend in TEST_BACKENDS
]
#: Aliases that can be shared between processes (the race and crash tests).
MULTIPROCESS_ALIASES = [a for a in CONTRACT_ALIASES if a != "locmem"]

# --- Redlock (issue 5; tests/scaleout_plugin.py) -----------------------------------
# The plugin starts three throwaway masters and exports their URLs in
# SETNX_TEST_REDLOCK_URLS; spawned child processes import these settings fresh and
# get the same "redlock" alias from here.
_redlock_urls = [u for u in os.environ.get("SETNX_TEST_REDLOCK_URLS", "").split(",") if u]
if _redlock_urls and "redis" in TEST_BACKENDS:
    SETNX_LOCKS["redlock"] = {
        "BACKEND": "django_setnx.backends.redlock.RedlockBackend",
        "LOCATION": _redlock_urls,
        "KEY_PREFIX": "setnx-test",
        "OPTIONS": {"NODE_TIMEOUT": 0.5},
    }
    CONTRACT_ALIASES.append("redlock")
    MULTIPROCESS_ALIASES.append("redlock")
# --- end Redlock --------------------------------------------------------------------
