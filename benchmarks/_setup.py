"""Shared bootstrap of the benchmarks: servers, databases and Django settings.

The parent process calls :func:`prepare` (creates the bench databases and starts a
throwaway Redis), :func:`configure` and :func:`migrate`; spawned child processes get
the resulting ``config`` dict and only call :func:`configure`. :func:`teardown`
removes what :func:`prepare` created.

Engines, by name (used as Django database alias *and* lock alias):

- ``sqlite``: a file in a fresh temporary directory (a file, not ``:memory:``, so
  other processes and our own lock connection see it);
- ``postgresql``: database ``setnx_bench`` on ``SETNX_BENCH_PG`` (default
  ``127.0.0.1:5432``, user postgres, trust);
- ``mariadb``: database ``setnx_bench`` (utf8mb4) on ``SETNX_BENCH_MYSQL`` (default
  ``127.0.0.1:3306``, user root, no password), through mysqlclient or PyMySQL;
- ``redis``: ``SETNX_BENCH_REDIS_URL`` if set, else a private ``redis-server``
  (``tests/servers.RedisServer``) that lives for the run.

An engine that cannot be reached is skipped with a note; the run goes on.
"""

import os
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    # Benchmark the working tree, not whatever copy might be installed.
    sys.path.insert(0, str(REPO))

BENCH_DB = "setnx_bench"
DB_ENGINES = ("sqlite", "postgresql", "mariadb")


def _hostport(var, default_port):
    host, _, port = os.environ.get(var, f"127.0.0.1:{default_port}").partition(":")
    return host or "127.0.0.1", int(port or default_port)


PG_HOST, PG_PORT = _hostport("SETNX_BENCH_PG", 5432)
MY_HOST, MY_PORT = _hostport("SETNX_BENCH_MYSQL", 3306)


def mysql_driver():
    """Make ``import MySQLdb`` work (mysqlclient, else PyMySQL posing as it)."""
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        import pymysql

        pymysql.install_as_MySQLdb()


def _reachable(host, port):
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def database_settings(engine, config):
    if engine == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": config["sqlite_path"],
            "OPTIONS": {"timeout": 20},
        }
    if engine == "postgresql":
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": BENCH_DB,
            "USER": "postgres",
            "HOST": PG_HOST,
            "PORT": str(PG_PORT),
        }
    if engine == "mariadb":
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": BENCH_DB,
            "USER": "root",
            "HOST": MY_HOST,
            "PORT": str(MY_PORT),
            "OPTIONS": {"charset": "utf8mb4"},
        }
    raise ValueError(engine)


# -- parent: create and remove -------------------------------------------------------


def prepare(notes):
    """Create the bench databases and Redis; return the ``config`` for configure().

    ``notes`` (a list) receives a line per skipped engine.
    """
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmpdir = tempfile.mkdtemp(prefix="setnx-bench-")
    config = {
        "run_id": run_id,
        "tmpdir": tmpdir,
        "sqlite_path": os.path.join(tmpdir, "bench.sqlite3"),
        "engines": ["sqlite"],
        "created": [],  # databases we created (and may drop)
        "redis_url": None,
        "redis_owned": False,
        # Every key and row name of this run starts with this, so cleanup can find them.
        "name_prefix": f"bench-{run_id}",
        "key_prefix": f"setnx-bench-{run_id}",
    }

    # PostgreSQL
    if not _reachable(PG_HOST, PG_PORT):
        notes.append(f"postgresql skipped: nothing listens on {PG_HOST}:{PG_PORT}")
    else:
        try:
            import psycopg

            with psycopg.connect(
                host=PG_HOST,
                port=PG_PORT,
                user="postgres",
                dbname="postgres",
                autocommit=True,
                connect_timeout=5,
            ) as conn:
                exists = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (BENCH_DB,)
                ).fetchone()
                if not exists:
                    conn.execute(f'CREATE DATABASE "{BENCH_DB}"')
                    config["created"].append("postgresql")
            config["engines"].append("postgresql")
        except Exception as exc:  # noqa: BLE001 - any failure means: skip the engine
            notes.append(f"postgresql skipped: {type(exc).__name__}: {exc}")

    # MariaDB / MySQL
    if not _reachable(MY_HOST, MY_PORT):
        notes.append(f"mariadb skipped: nothing listens on {MY_HOST}:{MY_PORT}")
    else:
        try:
            mysql_driver()
            import MySQLdb

            conn = MySQLdb.connect(host=MY_HOST, port=MY_PORT, user="root", connect_timeout=5)
            try:
                cur = conn.cursor()
                cur.execute(
                    "SELECT 1 FROM information_schema.schemata WHERE schema_name = %s", (BENCH_DB,)
                )
                if cur.fetchone() is None:
                    cur.execute(
                        f"CREATE DATABASE `{BENCH_DB}` CHARACTER SET utf8mb4 "
                        f"COLLATE utf8mb4_unicode_ci"
                    )
                    config["created"].append("mariadb")
            finally:
                conn.close()
            config["engines"].append("mariadb")
        except Exception as exc:  # noqa: BLE001
            notes.append(f"mariadb skipped: {type(exc).__name__}: {exc}")

    # Redis
    url = os.environ.get("SETNX_BENCH_REDIS_URL")
    if url:
        config["redis_url"] = url
    else:
        try:
            from tests.servers import RedisServer

            server = RedisServer().start()
            config["redis_url"] = server.url
            config["redis_owned"] = True
            config["_redis_server"] = server  # not picklable-relevant: dropped for children
        except Exception as exc:  # noqa: BLE001
            notes.append(f"redis skipped: {type(exc).__name__}: {exc}")
    if config["redis_url"]:
        try:
            import redis

            redis.Redis.from_url(config["redis_url"], socket_connect_timeout=2).ping()
        except Exception as exc:  # noqa: BLE001
            notes.append(f"redis skipped: {config['redis_url']}: {type(exc).__name__}: {exc}")
            config["redis_url"] = None
    return config


def child_config(config):
    """The part of ``config`` a spawned child needs (picklable)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def teardown(config, keep, notes):
    """Remove rows, keys, databases and files of this run (databases kept with keep)."""
    _delete_rows(config, notes)
    _delete_keys(config, notes)
    server = config.get("_redis_server")
    if server is not None:
        server.cleanup()
    try:
        from django.db import connections

        connections.close_all()
        from django_setnx import locks

        locks.close_all()
    except Exception:  # noqa: BLE001 - Django may not be configured
        pass
    if keep:
        notes.append(
            f"--keep: kept database {BENCH_DB!r} on {', '.join(config['engines'][1:]) or '-'}"
            f" and {config['sqlite_path']}"
        )
        return
    shutil.rmtree(config["tmpdir"], ignore_errors=True)
    if "postgresql" in config["engines"]:
        try:
            import psycopg

            with psycopg.connect(
                host=PG_HOST,
                port=PG_PORT,
                user="postgres",
                dbname="postgres",
                autocommit=True,
                connect_timeout=5,
            ) as conn:
                # Plain DROP: refuses (and we say so) if another run is connected to it.
                conn.execute(f'DROP DATABASE IF EXISTS "{BENCH_DB}"')
        except Exception as exc:  # noqa: BLE001
            notes.append(f"could not drop postgresql database {BENCH_DB}: {exc}")
    if "mariadb" in config["engines"]:
        try:
            import MySQLdb

            conn = MySQLdb.connect(host=MY_HOST, port=MY_PORT, user="root", connect_timeout=5)
            try:
                cur = conn.cursor()
                cur.execute(
                    "SELECT COUNT(*) FROM information_schema.processlist WHERE db = %s "
                    "AND id <> CONNECTION_ID()",
                    (BENCH_DB,),
                )
                if cur.fetchone()[0]:
                    notes.append(
                        f"mariadb database {BENCH_DB} left in place: another session is using it"
                    )
                else:
                    cur.execute(f"DROP DATABASE IF EXISTS `{BENCH_DB}`")
            finally:
                conn.close()
        except Exception as exc:  # noqa: BLE001
            notes.append(f"could not drop mariadb database {BENCH_DB}: {exc}")


def _delete_rows(config, notes):
    """Delete this run's rows (locks, db_mutex rows)."""
    try:
        from django.db import connections
    except Exception:  # noqa: BLE001
        return
    like = config["name_prefix"] + "%"
    for engine in config["engines"]:
        try:
            with connections[engine].cursor() as cur:
                for table, column in (
                    ("django_setnx_lock", "name"),
                    ("db_mutex_dbmutex", "lock_id"),
                    ("setnx_bench_floor_lock", "name"),  # bench_core's PostgreSQL floor
                ):
                    try:
                        cur.execute(f"DELETE FROM {table} WHERE {column} LIKE %s", [like])
                    except Exception:  # noqa: BLE001 - no such table (no db_mutex); autocommit
                        pass
        except Exception as exc:  # noqa: BLE001
            notes.append(f"could not delete rows on {engine}: {exc}")


def _delete_keys(config, notes):
    """Delete this run's Redis keys (only needed on a server we do not own)."""
    if not config.get("redis_url") or config.get("redis_owned"):
        return
    try:
        import redis

        r = redis.Redis.from_url(config["redis_url"])
        # Our backend's keys are under key_prefix; floor and peer keys embed name_prefix
        # (python-redis-lock prepends "lock:" / "lock-signal:").
        for pattern in (f"{config['key_prefix']}:*", f"*{config['name_prefix']}*"):
            batch = []
            for key in r.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    r.delete(*batch)
                    batch = []
            if batch:
                r.delete(*batch)
    except Exception as exc:  # noqa: BLE001
        notes.append(f"could not delete redis keys: {exc}")


# -- every process: Django settings --------------------------------------------------


def have_db_mutex():
    try:
        import db_mutex  # noqa: F401
    except ImportError:
        return False
    return True


#: The lock alias of PostgreSQL with OPTIONS["PREPARED_STATEMENTS"] on.
PG_PREPARED = "postgresql-prepared"


def configure(config, default="sqlite"):
    """settings.configure() + django.setup(), with ``default`` as Django's default
    database (django-db-mutex only uses the default one)."""
    import django
    from django.conf import settings

    if "mariadb" in config["engines"]:
        mysql_driver()
    databases = {engine: database_settings(engine, config) for engine in config["engines"]}
    databases["default"] = dict(databases[default])
    locks = {
        engine: {
            "BACKEND": "django_setnx.backends.database.DatabaseBackend",
            "OPTIONS": {"DATABASE": engine},
        }
        for engine in config["engines"]
    }
    locks["default"] = {
        "BACKEND": "django_setnx.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "default"},
    }
    if "postgresql" in config["engines"]:
        # The opt-in that prepares the lock statements (off by default: PgBouncer).
        locks[PG_PREPARED] = {
            "BACKEND": "django_setnx.backends.database.DatabaseBackend",
            "OPTIONS": {"DATABASE": "postgresql", "PREPARED_STATEMENTS": True},
        }
    caches = {}
    if config.get("redis_url"):
        locks["redis"] = {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": config["redis_url"],
            "KEY_PREFIX": config["key_prefix"],
        }
        # The same server through a django-redis cache's connection (OPTIONS["CACHE"]).
        caches["bench"] = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": config["redis_url"],
        }
        locks["redis-cache"] = {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "KEY_PREFIX": config["key_prefix"] + "-cache",
            "OPTIONS": {"CACHE": "bench"},
        }
    apps = ["django.contrib.contenttypes", "django.contrib.auth", "django_setnx"]
    if have_db_mutex():
        apps.append("db_mutex")
    settings.configure(
        DEBUG=False,
        SECRET_KEY="django-setnx-benchmarks",
        USE_TZ=True,
        INSTALLED_APPS=apps,
        DATABASES=databases,
        CACHES=caches or {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}},
        SETNX_LOCKS=locks,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        LOGGING_CONFIG=None,
    )
    django.setup()


def migrate(config, notes):
    """Migrate every engine; an engine whose migration fails is dropped from the run."""
    from django.core.management import call_command

    for engine in list(config["engines"]):
        try:
            call_command("migrate", database=engine, verbosity=0, interactive=False)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"{engine} skipped: migrate failed: {type(exc).__name__}: {exc}")
            config["engines"].remove(engine)
