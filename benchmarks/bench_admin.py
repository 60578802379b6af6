"""Render time of the admin's Locks page with 100,000 locks, on Redis and PostgreSQL.

    python3 benchmarks/bench_admin.py [--count 100000] [--runs 7] [--no-redis] [--no-postgres]

Configures Django itself (``settings.configure()``; the admin, auth, sessions and
messages apps, URLconf = this module). PostgreSQL: database ``setnx_bench_admin`` on
``SETNX_BENCH_PG`` (default 127.0.0.1:5432, user postgres), created and migrated
here and dropped at the end. Redis: ``SETNX_BENCH_REDIS_URL`` if set (under a
``KEY_PREFIX`` of this run, whose keys are deleted at the end), else a throwaway
``redis-server`` (``tests/servers.RedisServer``).

COUNT locks are seeded in bulk on each backend, bypassing the lock API: multi-row
INSERTs into ``django_setnx_lock`` with times from the
database's clock, and Redis pipelines writing the Redis backend's layout
(``P:{N}:lock`` hashes with ``token``, ``fencing``, ``owner``, ``acquired``,
``expires`` in ms by Redis' clock, plus ``P:{N}:fence``). One lock in three is stale.

Then a logged-in superuser GETs the page with the Django test client (the full
request: middleware, admin, backend reads, template rendering), RUNS times per case
after one warm-up; the table gives the median and the best run in milliseconds.
Target: under 300 ms per page.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PG_HOST, _, PG_PORT = os.environ.get("SETNX_BENCH_PG", "127.0.0.1:5432").partition(":")
PG_PORT = PG_PORT or "5432"
PG_DB = "setnx_bench_admin"
RUN = uuid.uuid4().hex[:8]
KEY_PREFIX = f"setnx-bench-admin-{RUN}"
INSERT_ROWS = 5_000
PIPELINE_KEYS = 5_000
TARGET_MS = 300
OWNER = json.dumps(
    {
        "host": "bench-host",
        "pid": 4242,
        "thread": "MainThread (4242)",
        "guards": "reports.tasks.nightly",
    },
    separators=(",", ":"),
    sort_keys=True,
)

# The URLconf of the benchmark (ROOT_URLCONF = this module).
urlpatterns = []


def lock_name(i):
    return f"bench:job:{i:07d}"


def is_stale(i):
    return i % 3 == 0


# -- setup ---------------------------------------------------------------------------


def pg_admin(sql):
    import psycopg

    with psycopg.connect(
        host=PG_HOST,
        port=PG_PORT,
        user="postgres",
        dbname="postgres",
        autocommit=True,
        connect_timeout=5,
    ) as conn:
        conn.execute(sql)


def configure(use_postgres, redis_url):
    import django
    from django.conf import settings

    databases = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    if use_postgres:
        databases["default"] = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": PG_DB,
            "USER": "postgres",
            "HOST": PG_HOST,
            "PORT": PG_PORT,
        }
    lock_settings = {}
    if use_postgres:
        lock_settings["postgres"] = {
            "BACKEND": "django_setnx.backends.database.DatabaseBackend",
            "OPTIONS": {"DATABASE": "default"},
        }
    if redis_url:
        lock_settings["redis"] = {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": redis_url,
            "KEY_PREFIX": KEY_PREFIX,
        }
    settings.configure(
        DEBUG=False,
        SECRET_KEY="django-setnx-bench-admin",
        ALLOWED_HOSTS=["testserver"],
        USE_TZ=True,
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django_setnx",
        ],
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        TEMPLATES=[
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
        ],
        DATABASES=databases,
        SETNX_LOCKS=lock_settings,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        LOGGING_CONFIG=None,
    )
    django.setup()
    from django.contrib import admin
    from django.urls import path

    urlpatterns.append(path("admin/", admin.site.urls))


def seed_postgres(count):
    from django.db import connection

    now = "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000)::bigint"
    with connection.cursor() as cursor:
        for start in range(0, count, INSERT_ROWS):
            idx = range(start, min(start + INSERT_ROWS, count))
            rows = ", ".join(
                [f"(%s, %s, %s, {now} - 120000, {now} + %s, %s, '', 0, 0)"] * len(idx)
            )
            params = []
            for i in idx:
                params += [
                    lock_name(i),
                    f"{i:032x}",
                    OWNER,
                    -60_000 if is_stale(i) else 3_600_000,
                    1 + i % 7,
                ]
            cursor.execute(
                "INSERT INTO django_setnx_lock (name, token, owner, acquired_at, "
                f"expires_at, fencing, next_token, next_since, next_seen) "
                f"VALUES {rows}",
                params,
            )
        cursor.execute("ANALYZE django_setnx_lock")


def seed_redis(url, count):
    import redis

    client = redis.Redis.from_url(url)
    try:
        seconds, micros = client.time()
        now = seconds * 1000 + micros // 1000
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            base = f"{KEY_PREFIX}:{{{lock_name(i)}}}"
            pipe.hset(
                f"{base}:lock",
                mapping={
                    "token": f"{i:032x}",
                    "fencing": 1 + i % 7,
                    "owner": OWNER,
                    "acquired": now - 120_000,
                    "expires": now - 60_000 if is_stale(i) else now + 3_600_000,
                },
            )
            pipe.pexpire(f"{base}:lock", 7_200_000)
            pipe.set(f"{base}:fence", 1 + i % 7)
            if (i + 1) % PIPELINE_KEYS == 0:
                pipe.execute()
        pipe.execute()
    finally:
        client.close()


def cleanup_redis(url):
    import redis

    client = redis.Redis.from_url(url)
    try:
        batch = []
        for key in client.scan_iter(match=f"{KEY_PREFIX}:*", count=5000):
            batch.append(key)
            if len(batch) >= PIPELINE_KEYS:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


# -- the measurements ----------------------------------------------------------------


def measure(client, query, runs):
    from django.urls import reverse

    url = reverse("admin:django_setnx_lockrecord_changelist") + query
    response = client.get(url)  # warm-up (and a check)
    assert response.status_code == 200, (url, response.status_code)
    content = response.content.decode()
    assert "backend-error-row" not in content, content
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200
    # Read from the HTML: response.context would need the test environment's
    # template instrumentation, which slows rendering down.
    total = re.search(r"(\d+) locks? &middot;", content)
    return {
        "rows": content.count('<th class="field-name"'),
        "total": int(total.group(1)) if total else None,
        "median": statistics.median(times),
        "best": min(times),
    }


def cases(alias, count):
    middle = max(1, count // 100 // 2)
    stale_middle = max(1, (count + 2) // 3 // 100 // 2)
    return [
        ("page 1", f"?backend={alias}"),
        (f"middle page (p={middle})", f"?backend={alias}&p={middle}"),
        ("state=stale, page 1", f"?backend={alias}&state=stale"),
        (
            f"state=stale, middle page (p={stale_middle})",
            f"?backend={alias}&state=stale&p={stale_middle}",
        ),
        ("search q=0042 (substring)", f"?backend={alias}&q=0042"),
        ("search q=bench:job:00123* (glob)", f"?backend={alias}&q=bench:job:00123*"),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    notes = []

    server = None
    redis_url = None
    if not args.no_redis:
        redis_url = os.environ.get("SETNX_BENCH_REDIS_URL")
        if not redis_url:
            from tests.servers import RedisServer

            server = RedisServer().start()
            redis_url = server.url
    use_postgres = not args.no_postgres
    if use_postgres:
        try:
            pg_admin(f'DROP DATABASE IF EXISTS "{PG_DB}"')
            pg_admin(f'CREATE DATABASE "{PG_DB}"')
        except Exception as exc:  # noqa: BLE001
            notes.append(f"postgresql skipped: {type(exc).__name__}: {exc}")
            use_postgres = False

    configure(use_postgres, redis_url)
    from django.core.management import call_command

    results = []
    try:
        call_command("migrate", verbosity=0, interactive=False)
        from django.contrib.auth.models import User
        from django.test import Client

        user = User.objects.create_superuser("bench", "bench@example.invalid", "bench")
        client = Client()
        client.force_login(user)

        aliases = []
        if use_postgres:
            t = time.perf_counter()
            seed_postgres(args.count)
            notes.append(
                f"seeded {args.count:,} locks on PostgreSQL in {time.perf_counter() - t:.1f} s"
            )
            aliases.append(("postgres", "PostgreSQL"))
        if redis_url:
            t = time.perf_counter()
            seed_redis(redis_url, args.count)
            notes.append(
                f"seeded {args.count:,} locks on Redis in {time.perf_counter() - t:.1f} s"
            )
            aliases.append(("redis", "Redis"))

        for alias, label in aliases:
            for case, query in cases(alias, args.count):
                results.append((label, case, measure(client, query, args.runs)))
        if len(aliases) > 1:
            results.append(("both", "page 1, every backend", measure(client, "", args.runs)))
    finally:
        from django.db import connections

        from django_setnx import locks

        locks.close_all()
        connections.close_all()
        if redis_url and server is None:
            cleanup_redis(redis_url)
        if server is not None:
            server.cleanup()
        if use_postgres:
            try:
                pg_admin(f'DROP DATABASE IF EXISTS "{PG_DB}"')
            except Exception as exc:  # noqa: BLE001
                notes.append(f"could not drop {PG_DB}: {exc}")

    print(
        f"Locks page render time, {args.count:,} locks per backend (1 in 3 stale), "
        f"median of {args.runs} runs after a warm-up; target < {TARGET_MS} ms.\n"
    )
    print("| Backend | Page | Rows | Total shown | Median (ms) | Best (ms) | < 300 ms |")
    print("|---|---|---:|---:|---:|---:|:---:|")
    for label, case, r in results:
        total = "—" if r["total"] is None else f"{r['total']:,}"
        ok = "yes" if r["median"] < TARGET_MS else "**no**"
        print(
            f"| {label} | {case} | {r['rows']} | {total} | {r['median']:.1f} | "
            f"{r['best']:.1f} | {ok} |"
        )
    for note in notes:
        print(f"\n- {note}", end="")
    print()


if __name__ == "__main__":
    main()
