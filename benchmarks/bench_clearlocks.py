"""How long ``manage.py clearlocks`` takes to remove many stale locks, per backend.

    python3 benchmarks/bench_clearlocks.py [--count 100000] [--no-redis] [--no-postgres]

Configures Django itself: the PostgreSQL database ``setnx_bench`` on 127.0.0.1:5432
(user postgres; created and migrated if missing, dropped again at the end if this
script created it) and Redis at ``$SETNX_BENCH_REDIS_URL`` (default
``redis://127.0.0.1:6379/15``) under ``KEY_PREFIX`` ``setnx-bench``.

COUNT stale locks are seeded in bulk on each backend, bypassing the lock API:
multi-row INSERTs into ``django_setnx_lock`` with
``expires_at`` in the past by the database's clock, and one Redis pipeline writing
the Redis backend's layout (``P:{N}:lock`` hashes with ``token``, ``fencing``,
``owner``, ``acquired``, ``expires`` in ms by Redis' clock, plus ``P:{N}:fence``).
Then ``call_command("clearlocks", "--noinput", "--backend", alias)`` is timed, the
removed count is checked to be exactly COUNT with nothing of ours left, and the
seeded keys/rows (fencing counters included) are removed. The target is < 5 s per
backend for 100,000 locks.

The script refuses to run against a Redis prefix or a lock table that already holds
records, so it never removes (or miscounts) anything it did not write.
"""

import argparse
import json
import os
import re
import sys
import time
from io import StringIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PG = {"HOST": "127.0.0.1", "PORT": "5432", "USER": "postgres", "NAME": "setnx_bench"}
REDIS_URL = os.environ.get("SETNX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
KEY_PREFIX = "setnx-bench"
NAME_PREFIX = "bench:"
OWNER = json.dumps(
    {"host": "bench", "pid": 0, "thread": "MainThread (0)"}, separators=(",", ":"), sort_keys=True
)
INSERT_ROWS = 5_000
PIPELINE_KEYS = 5_000
TARGET_SECONDS = 5.0


def lock_name(i):
    return f"{NAME_PREFIX}{i:07d}"


# -- setup ---------------------------------------------------------------------------


def ensure_database():
    """Create the benchmark database if missing. Returns True if created here."""
    import psycopg

    with psycopg.connect(
        host=PG["HOST"], port=PG["PORT"], user=PG["USER"], dbname="postgres", autocommit=True
    ) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (PG["NAME"],)
        ).fetchone()
        if exists:
            return False
        conn.execute(f'CREATE DATABASE "{PG["NAME"]}"')
        return True


def drop_database():
    import psycopg

    with psycopg.connect(
        host=PG["HOST"], port=PG["PORT"], user=PG["USER"], dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{PG["NAME"]}"')


def configure(use_postgres, use_redis):
    import django
    from django.conf import settings

    databases = {}
    locks = {}
    if use_postgres:
        databases["default"] = {"ENGINE": "django.db.backends.postgresql", **PG}
        locks["postgres"] = {
            "BACKEND": "django_setnx.backends.database.DatabaseBackend",
            "OPTIONS": {"DATABASE": "default"},
        }
    if use_redis:
        locks["redis"] = {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": KEY_PREFIX,
        }
    settings.configure(
        INSTALLED_APPS=["django_setnx"],
        DATABASES=databases,
        SETNX_LOCKS=locks,
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()


# -- PostgreSQL ----------------------------------------------------------------------


def seed_postgres(count):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_setnx_lock")
        if cursor.fetchone()[0]:
            raise SystemExit(f"{PG['NAME']}.django_setnx_lock is not empty; refusing to run.")
        now = "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000)::bigint"
        for start in range(0, count, INSERT_ROWS):
            names = [lock_name(i) for i in range(start, min(start + INSERT_ROWS, count))]
            rows = ", ".join(
                [f"(%s, %s, %s, {now} - 120000, {now} - 60000, 1, '', 0, 0)"] * len(names)
            )
            params = []
            for i, name in enumerate(names, start):
                params += [name, f"{i:032x}", OWNER]
            cursor.execute(
                "INSERT INTO django_setnx_lock (name, token, owner, acquired_at, expires_at, "
                f"fencing, next_token, next_since, next_seen) VALUES {rows}",
                params,
            )
        cursor.execute("ANALYZE django_setnx_lock")


def postgres_left():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM django_setnx_lock WHERE name LIKE %s", [NAME_PREFIX + "%"]
        )
        return cursor.fetchone()[0]


def cleanup_postgres():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_setnx_lock WHERE name LIKE %s", [NAME_PREFIX + "%"])
    connection.close()


# -- Redis ---------------------------------------------------------------------------


def redis_client():
    import redis

    return redis.Redis.from_url(REDIS_URL)


def redis_keys(client, suffix):
    """Our keys (``bench:*`` names under the prefix), by SCAN, never KEYS."""
    pattern = f"{KEY_PREFIX}:{{{NAME_PREFIX}*}}:{suffix}"
    return list(client.scan_iter(match=pattern, count=5000))


def seed_redis(count):
    client = redis_client()
    try:
        if next(client.scan_iter(match=f"{KEY_PREFIX}:*", count=1000), None) is not None:
            raise SystemExit(
                f"{REDIS_URL} already has keys under {KEY_PREFIX!r}; refusing to run."
            )
        seconds, micros = client.time()
        now = seconds * 1000 + micros // 1000
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            base = f"{KEY_PREFIX}:{{{lock_name(i)}}}"
            pipe.hset(
                f"{base}:lock",
                mapping={
                    "token": f"{i:032x}",
                    "fencing": 1,
                    "owner": OWNER,
                    "acquired": now - 120_000,
                    "expires": now - 60_000,
                },
            )
            # What the backend does: the record outlives its expiry by STALE_RETENTION.
            pipe.pexpire(f"{base}:lock", 3_600_000)
            pipe.set(f"{base}:fence", 1)
            if (i + 1) % PIPELINE_KEYS == 0:
                pipe.execute()
        pipe.execute()
    finally:
        client.close()


def redis_left():
    client = redis_client()
    try:
        return len(redis_keys(client, "lock"))
    finally:
        client.close()


def cleanup_redis():
    client = redis_client()
    try:
        keys = redis_keys(client, "lock") + redis_keys(client, "fence")
        for start in range(0, len(keys), PIPELINE_KEYS):
            client.unlink(*keys[start : start + PIPELINE_KEYS])
    finally:
        client.close()


# -- the run -------------------------------------------------------------------------


def time_clearlocks(alias, count):
    from django.core.management import call_command

    out, err = StringIO(), StringIO()
    started = time.perf_counter()
    call_command("clearlocks", "--noinput", "--backend", alias, stdout=out, stderr=err)
    elapsed = time.perf_counter() - started
    pattern = rf"^{re.escape(alias)}: removed (\d+) stale locks?$"
    match = re.search(pattern, out.getvalue(), re.MULTILINE)
    removed = int(match.group(1)) if match else None
    return elapsed, removed, err.getvalue()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="stale locks per backend")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--no-redis", action="store_true")
    args = parser.parse_args()
    if args.count < 1:
        parser.error("--count must be >= 1")

    use_redis = not args.no_redis
    if use_redis:
        try:
            import redis  # noqa: F401

            import django_setnx.backends.redis  # noqa: F401
        except ImportError as exc:
            print(f"Redis skipped: {exc}", file=sys.stderr)
            use_redis = False
    use_postgres = not args.no_postgres
    created = ensure_database() if use_postgres else False
    configure(use_postgres, use_redis)

    from django.core.management import call_command

    results = []
    failed = False
    try:
        if use_postgres:
            call_command("migrate", "django_setnx", verbosity=0)
        backends = [("postgres", seed_postgres, postgres_left, cleanup_postgres)] * use_postgres
        backends += [("redis", seed_redis, redis_left, cleanup_redis)] * use_redis
        for alias, seed, left, cleanup in backends:
            try:
                started = time.perf_counter()
                seed(args.count)
                seeded = time.perf_counter() - started
                print(
                    f"{alias}: seeded {args.count} stale locks in {seeded:.1f} s", file=sys.stderr
                )
                elapsed, removed, err = time_clearlocks(alias, args.count)
                remaining = left()
                ok = removed == args.count and remaining == 0
                if not ok:
                    failed = True
                    print(
                        f"{alias}: MISMATCH: clearlocks reported {removed} removed, "
                        f"{remaining} of ours left (expected {args.count}, 0)\n{err}",
                        file=sys.stderr,
                    )
                results.append((alias, args.count, elapsed, ok))
            finally:
                cleanup()
    finally:
        from django_setnx import locks

        locks.close_all()
        if created:
            from django.db import connections

            connections.close_all()
            drop_database()

    rows = [("backend", "locks", "seconds", "locks/s", "")]
    for alias, count, elapsed, ok in results:
        verdict = "ok" if elapsed < TARGET_SECONDS else f"SLOW (> {TARGET_SECONDS:g} s)"
        rows.append(
            (
                alias,
                f"{count:,}",
                f"{elapsed:.2f}",
                f"{count / elapsed:,.0f}",
                verdict if ok else "WRONG COUNT",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print(
            "  ".join(
                c.rjust(w) if i in (1, 2, 3) else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
