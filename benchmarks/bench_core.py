#!/usr/bin/env python3
"""Core benchmarks of django-setnx against the raw floor and peer libraries.

    python3 benchmarks/bench_core.py            # full run, a few minutes
    python3 benchmarks/bench_core.py --quick    # fewer iterations, about a minute

Prints markdown tables (paste them into notes):

1. uncontended acquire+release, µs per pair, ours next to the raw floor and peers;
2. handoff latency: release in one process -> acquire returns in another;
3. contended throughput and fairness: 4 processes x N acquisitions of one lock
   around a 1 ms busy-wait critical section;
4. the state left after 100,000 distinct names were each acquired and released:
   Redis keys without a TTL, database rows;

then the targets with PASS/MISS. A miss never fails the run: this is a measurement,
not a test. See benchmarks/README.md for what each number means.
"""

import argparse
import contextlib
import copy
import gc
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import platform
import queue
import random
import secrets
import socket
import subprocess
import sys
import time
import timeit
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup

pc = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux: comparable across processes

TTL = 30
CS_NS = 1_000_000  # the contended critical section: 1 ms busy-wait

TARGETS = {
    "redis_ratio": 1.10,  # Redis ours / floor, medians (LOCATION and CACHE)
    "db_ratio": {"postgresql": 1.15, "sqlite": 1.15, "mariadb": 1.20},  # ours / floor
    # handoff p50 / p99 (ms): release in one process -> acquire returns in another
    "handoff_ms": {"redis": (0.2, 1.0), "postgresql": (0.5, 2.0)},
    # ideal / wall under contention (4 processes, 1 ms critical sections)
    "efficiency": {"redis": 0.80, "postgresql": 0.60, "sqlite": 0.55, "mariadb": 0.55},
    "jain": 0.95,  # our reading of "Jain close to 1, no process starved"
    "redis_wait_p99_ms": 10.0,  # contended: time from acquire() to its return
    "repeat_share": 0.30,  # no process wins more than this share back to back
}

# Compare-and-delete, the canonical safe release of a SET NX lock.
CAD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# The same plus one wake-up for a blocked waiter (the floor of a wake-up lock).
CAD_WAKE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], 1)
  redis.call('PEXPIRE', KEYS[2], 1000)
  return 1
end
return 0
"""


# -- small helpers ---------------------------------------------------------------------


def out(line=""):
    print(line, flush=True)


def load():
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def pct(sorted_values, p):
    if not sorted_values:
        return float("nan")
    k = max(0, math.ceil(p / 100 * len(sorted_values)) - 1)
    return sorted_values[k]


def median(values):
    s = sorted(values)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def verdict(ok):
    return "PASS" if ok else "MISS"


def table(headers, rows):
    out("| " + " | ".join(headers) + " |")
    out("|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|")
    for row in rows:
        out("| " + " | ".join(str(c) for c in row) + " |")
    out()


def fmt(x, digits=1):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def have(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def jain(counts):
    s, sq = sum(counts), sum(c * c for c in counts)
    return (s * s) / (len(counts) * sq) if sq else float("nan")


def spawn_ctx():
    return multiprocessing.get_context("spawn")


# -- lock factories shared by the handoff and throughput processes ------------------------


def lock_factory(kind, cfg, alias, name, sleep=0.1):
    """Return ``make()`` -> (acquire(timeout) -> bool, release()) for a fresh lock object.

    kind: ``ours`` (django-setnx, lock alias ``alias``), ``redispy`` (redis-py's
    Lock, polling every ``sleep`` s), ``prl`` (python-redis-lock), ``floor`` (the
    least a safe wake-up lock does), ``raw`` (the machine's wake-up floor, not a lock).
    """
    if kind == "ours":
        from django_setnx import lock

        def make():
            lk = lock(name, ttl=TTL, backend=alias)
            return (lambda timeout: lk.acquire(timeout=timeout)), lk.release

        return make
    if kind == "pgfloor":
        return pg_notify_lock(name)
    import redis

    client = redis.Redis.from_url(cfg["redis_url"])
    if kind == "redispy":

        def make():
            lk = client.lock(name, timeout=TTL, sleep=sleep)
            return (
                lambda timeout: lk.acquire(blocking=True, blocking_timeout=timeout)
            ), lk.release

        return make
    if kind == "floor":
        # The least a wake-up lock must do: SET NX PX; on contention BLPOP a wake list;
        # release = one script (compare-and-delete + push one wake-up).
        release_script = client.register_script(CAD_WAKE)
        wake_key = name + ":wake"

        def make():
            token = secrets.token_hex(16)

            def acquire(timeout):
                deadline = time.monotonic() + timeout
                while True:
                    if client.set(name, token, nx=True, px=TTL * 1000):
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    client.blpop([wake_key], timeout=min(left, 4.0))

            def release():
                check(release_script(keys=[name, wake_key], args=[token]) == 1, "floor release")

            return acquire, release

        return make
    if kind == "raw":
        return raw_token_lock(client, cfg["redis_url"], name)
    if kind == "prl":
        import redis_lock

        def make():
            lk = redis_lock.Lock(client, name, expire=TTL)
            # It refuses a timeout longer than its expire.
            return (
                lambda timeout: lk.acquire(blocking=True, timeout=min(timeout, TTL))
            ), lk.release

        return make
    raise ValueError(kind)


def raw_token_lock(client, url, name):
    """The machine's floor for a Redis wake-up: one token passed through a Redis list.

    acquire = ``BLPOP`` the token, release = ``RPUSH`` it back, each a hand-written
    RESP command on a raw socket: no client library, no ttl, no owner check, no
    fencing. Not a usable lock (a holder that dies loses the token for good); it
    shows what a release-to-acquire wake-up costs on this machine before any lock
    logic or client library is added.
    """
    from urllib.parse import urlsplit

    if client.set(name + ":init", 1, nx=True, ex=3600):  # the first process seeds it
        client.rpush(name, 1)
        client.expire(name, 3600)
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = sock.makefile("rb")

    def command(*words):
        words = [str(w).encode() for w in words]
        sock.sendall(
            b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)
        )

    db = (parts.path or "/0").strip("/") or "0"
    command("SELECT", db)
    check(reader.readline() == b"+OK\r\n", "raw SELECT")
    key = name.encode()

    def make():
        def acquire(timeout):
            command("BLPOP", name, f"{timeout:.3f}")
            head = reader.readline()
            if head.startswith(b"*-1"):
                return False
            check(head == b"*2\r\n", f"raw BLPOP reply {head!r}")
            reader.readline()
            check(reader.readline().rstrip(b"\r\n") == key, "raw BLPOP key")
            reader.readline()
            reader.readline()
            return True

        def release():
            command("RPUSH", name, 1)
            check(reader.readline() == b":1\r\n", "raw RPUSH")

        return acquire, release

    return make


#: The PostgreSQL floor's table: the least a lock row needs (no ttl, owner, fencing).
PG_FLOOR_TABLE = "setnx_bench_floor_lock"


def pg_connect():
    """A new autocommit psycopg connection to the bench database (the settings of
    the ``postgresql`` alias), with LISTEN support."""
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["postgresql"]
    return psycopg.connect(
        dbname=db["NAME"], user=db["USER"], host=db["HOST"], port=db["PORT"], autocommit=True
    )


def pg_floor_table(conn):
    """Create the PostgreSQL floor's table on ``conn`` unless it exists."""
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {PG_FLOOR_TABLE} (name text PRIMARY KEY, token text NOT NULL)"
    )


def pg_channel(name):
    return "setnx_bench_" + hashlib.sha1(name.encode()).hexdigest()[:16]


def pg_notify_lock(name):
    """The floor of a PostgreSQL lock that is woken rather than polled, with our
    durability: acquire = an INSERT of the row (flushed: a lock handed out must
    survive a crash), and on a conflict a wait for a NOTIFY, then again; release =
    a DELETE of our row that NOTIFYs in the same statement, unflushed (a lost
    release only costs liveness). No ttl, no fairness, no fencing: not a usable
    lock. Each process LISTENs on its own connection before its first attempt.

    Needs psycopg >= 3.2.4: older versions drop a notification that arrives while
    a statement runs on the listening connection, which would make it look slow."""
    import psycopg

    if tuple(int(p) for p in psycopg.__version__.split(".")[:3] if p.isdigit()) < (3, 2, 4):
        raise RuntimeError(
            f"the PostgreSQL floor needs psycopg >= 3.2.4, not {psycopg.__version__}"
        )
    # Commits without waiting for the WAL flush exactly as our releases do.
    from django_setnx.backends.db_sql import PG_NO_FLUSH

    conn = pg_connect()
    pg_floor_table(conn)
    channel = pg_channel(name)
    conn.execute(f"LISTEN {channel}")
    take = f"INSERT INTO {PG_FLOOR_TABLE} (name, token) VALUES (%s, %s) ON CONFLICT DO NOTHING"
    give = (
        f"WITH gone AS (DELETE FROM {PG_FLOOR_TABLE} WHERE name = %s AND token = %s "
        f"AND {PG_NO_FLUSH} RETURNING name) SELECT pg_notify(%s, name) FROM gone"
    )

    def make():
        token = secrets.token_hex(16)

        def acquire(timeout):
            deadline = time.monotonic() + timeout
            while True:
                if conn.execute(take, (name, token)).rowcount == 1:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # Wake-ups that came before this attempt are stale: the attempt saw
                # their release. Then wait for the next one.
                for _ in conn.notifies(timeout=0, stop_after=64):
                    pass
                if conn.execute(take, (name, token)).rowcount == 1:
                    return True
                for _ in conn.notifies(timeout=min(left, 4.0), stop_after=1):
                    pass

        def release():
            rows = conn.execute(give, (name, token, channel)).fetchall()
            check(len(rows) == 1, "pg floor release")

        return acquire, release

    make.close = conn.close  # the bench database is dropped at the end
    return make


def notify_waiter(cfg, n, conn):
    """The waiter side of run_notify_handoff: LISTEN, then stamp each NOTIFY."""
    try:
        _setup.configure(cfg)
        pg = pg_connect()
        channel = pg_channel(cfg["name_prefix"] + ":machine")
        pg.execute(f"LISTEN {channel}")
        conn.send("ready")
        for _ in range(n):
            if conn.recv() is None:
                break
            # A notification of an earlier round that came after its timeout is not
            # this round's hand-over.
            for _ in pg.notifies(timeout=0, stop_after=64):
                pass
            conn.send("waiting")
            got = False
            for _ in pg.notifies(timeout=10, stop_after=1):
                got = True
            conn.send((got, pc()))
    except BaseException:  # noqa: BLE001
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_notify_handoff(cfg, n):
    """The machine's floor for a PostgreSQL handoff: the holder commits an UPDATE,
    flushed (what hands a lock over must be durable), that NOTIFYs in the same
    statement; a spawned process blocked in LISTEN stamps its arrival. Not a lock:
    one write and one wake-up, what any durable handoff through PostgreSQL costs
    at least. Same protocol and timing as run_handoff; returns (latencies in ns,
    failures)."""
    pg = pg_connect()
    pg_floor_table(pg)
    row = cfg["name_prefix"] + ":machine"
    pg.execute(
        f"INSERT INTO {PG_FLOOR_TABLE} (name, token) VALUES (%s, '0') ON CONFLICT DO NOTHING",
        (row,),
    )
    hand_over = (
        f"WITH moved AS (UPDATE {PG_FLOOR_TABLE} SET token = %s WHERE name = %s "
        f"RETURNING name) SELECT pg_notify(%s, name) FROM moved"
    )
    channel = pg_channel(row)
    rounds = itertools.count()

    def hold():
        return lambda: pg.execute(hand_over, (str(next(rounds)), row, channel))

    try:
        return _time_handoffs(notify_waiter, (_setup.child_config(cfg), n), n, hold)
    finally:
        pg.close()


def _time_handoffs(waiter, args, n, hold):
    """Time ``n`` handoffs to ``waiter(*args, pipe_end)``, a spawned process: per
    round, ``hold()`` (it returns the hand-over), tell the waiter to wait, let it get
    into its wait (BLPOP, poll sleep, LISTEN: 5–25 ms, random), stamp, hand over,
    and read the waiter's stamp. Returns (latencies in ns, failures)."""
    ctx = spawn_ctx()
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=waiter, args=(*args, child_end), daemon=True)
    proc.start()
    child_end.close()
    rng = random.Random(1)
    latencies, failures = [], 0
    try:
        _recv(parent_end, 120)  # ready
        for _ in range(n):
            hand_over = hold()
            parent_end.send("go")
            _recv(parent_end, 30)  # the waiter is about to wait
            time.sleep(rng.uniform(0.005, 0.025))
            t0 = pc()
            hand_over()
            ok, t1 = _recv(parent_end, 30)
            if ok:
                latencies.append(t1 - t0)
            else:
                failures += 1
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return latencies, failures


def _recv(end, timeout):
    if not end.poll(timeout):
        raise RuntimeError(f"waiter silent for {timeout} s")
    msg = end.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(msg[1])
    return msg


# -- 1. uncontended ----------------------------------------------------------------------


def interleaved(variants, blocks, per_block, warmup):
    """Time ``fn()`` (one acquire+release pair) per variant, interleaved in blocks.

    Each block runs ``per_block`` rounds; a round times one pair of every variant,
    so drift and bursts of background load hit every variant alike, in an order
    shuffled per round (seeded: the same orders every run). Not a fixed or rotated
    order: what ran just before a pair changes its cost (on SQLite, any pair right
    after the floor's, whose fsync blocks the process, costs 30-40 µs more, and so
    does one after a bare 300 µs sleep), and a cyclic order always puts the same
    variant in the same place.
    Returns {label: [ns, ...]} and {label: client CPU ns per pair (mean)}.
    """
    labels = list(variants)
    for label in labels:
        fn = variants[label]
        for _ in range(warmup):
            fn()
    samples = {label: [] for label in labels}
    cpu = dict.fromkeys(labels, 0)
    cpu_clock = time.process_time_ns
    shuffler = random.Random(0)
    order = [(label, variants[label], samples[label]) for label in labels]
    for _ in range(blocks):
        gc.collect()
        for _ in range(per_block):
            shuffler.shuffle(order)
            for label, fn, s in order:
                c0 = cpu_clock()
                t0 = pc()
                fn()
                t1 = pc()
                cpu[label] += cpu_clock() - c0
                s.append(t1 - t0)
    return samples, {label: cpu[label] / len(samples[label]) for label in labels}


def check(ok, what):
    if not ok:
        raise RuntimeError(f"{what} failed (uncontended: it should always succeed)")


def redis_variants(cfg):
    """The Redis rows of table 1: label -> fn() doing one acquire+release pair."""
    import redis

    from django_setnx import lock, locks
    from django_setnx.locking import current_owner

    np = cfg["name_prefix"]
    r = redis.Redis.from_url(cfg["redis_url"])  # the backend's settings: from_url(LOCATION)
    cad = r.register_script(CAD)
    token = secrets.token_hex(16)
    variants = {}

    floor_key = f"{np}:u:floor"

    def floor():
        check(r.set(floor_key, token, nx=True, px=TTL * 1000), "SET NX PX")
        check(cad(keys=[floor_key], args=[token]) == 1, "compare-and-delete")

    variants["floor: SET NX PX + EVALSHA compare-and-delete"] = floor

    name_new = f"{np}:u:ours"

    def ours():
        lk = lock(name_new, ttl=TTL, backend="redis")
        check(lk.acquire(blocking=False), "acquire")
        lk.release()

    variants["**ours**: lock() + acquire(blocking=False) + release()"] = ours

    name_cache = f"{np}:u:ours-cache"

    def ours_cache():
        lk = lock(name_cache, ttl=TTL, backend="redis-cache")
        check(lk.acquire(blocking=False), "acquire")
        lk.release()

    variants["**ours**, through OPTIONS['CACHE'] (django-redis' connection)"] = ours_cache

    reused = lock(f"{np}:u:reused", ttl=TTL, backend="redis")

    def ours_reused():
        check(reused.acquire(blocking=False), "acquire")
        reused.release()

    variants["ours, one Lock object reused"] = ours_reused

    backend = locks["redis"]
    owner = current_owner()
    b_name, b_token = f"{np}:u:backend", secrets.token_hex(16)

    def backend_only():
        check(backend.acquire(b_name, b_token, float(TTL), owner).acquired, "backend.acquire")
        check(backend.release(b_name, b_token), "backend.release")

    variants["ours, backend.acquire/release only (no Lock layer)"] = backend_only

    # Our two Lua scripts alone: record the keys and args the backend passes to its
    # registered scripts once, then replay them (no Python of ours around them).
    try:
        scripts_only = _replay_scripts(backend, f"{np}:u:scripts", owner)
        variants["ours, our Lua scripts only (EVALSHA replayed, args precomputed)"] = scripts_only
    except Exception as exc:  # noqa: BLE001 - internals moved: skip this row
        out(f"> note: scripts-only row skipped ({type(exc).__name__}: {exc})")

    p_name = f"{np}:u:redispy"

    def redispy():
        lk = r.lock(p_name, timeout=TTL)
        check(lk.acquire(blocking=False), "redis-py Lock.acquire")
        lk.release()

    variants["peer: redis-py `r.lock()` (Lock)"] = redispy

    if have("redis_lock"):
        import redis_lock

        q_name = f"{np}:u:prl"

        def prl():
            lk = redis_lock.Lock(r, q_name, expire=TTL)
            check(lk.acquire(blocking=False), "redis_lock.Lock.acquire")
            lk.release()

        variants["peer: python-redis-lock `redis_lock.Lock`"] = prl
    return variants


def _replay_scripts(backend, name, owner):
    """fn() that re-runs, with the same keys and args, the two scripts (``acquire``
    and ``release`` of ``backend.connection``) one backend acquire/release runs."""
    conn = backend.connection
    captured = {}
    originals = {attr: getattr(conn, attr) for attr in ("acquire", "release")}

    def recorder(attr):
        def record(keys=(), args=(), client=None):
            captured[attr] = (list(keys), list(args))
            return originals[attr](keys=keys, args=args, client=client)

        return record

    token = secrets.token_hex(16)
    try:
        for attr in originals:
            setattr(conn, attr, recorder(attr))
        check(backend.acquire(name, token, float(TTL), owner).acquired, "backend.acquire")
        check(backend.release(name, token), "backend.release")
    finally:
        for attr, script in originals.items():
            setattr(conn, attr, script)
    (acq_keys, acq_args), (rel_keys, rel_args) = captured["acquire"], captured["release"]
    acquire, release = originals["acquire"], originals["release"]

    def scripts_only():
        check(acquire(keys=acq_keys, args=acq_args)[0] == 1, "acquire script")
        check(release(keys=rel_keys, args=rel_args) == 1, "release script")

    scripts_only()
    return scripts_only


def db_variants(cfg, engine):
    """The rows of one database in table 1 (run in a child with ``engine`` as default)."""
    from django.db import connections

    from django_setnx import lock, locks
    from django_setnx.locking import current_owner

    np = cfg["name_prefix"]
    variants = {}

    name_new = f"{np}:u:ours"

    def ours():
        lk = lock(name_new, ttl=TTL, backend=engine)
        check(lk.acquire(blocking=False), "acquire")
        lk.release()

    ours()  # first: connects our backend (and switches SQLite to WAL, as in real use)

    # The floor: a dedicated autocommit raw DB-API connection, made the way the
    # backend makes its own (a private copy of Django's DatabaseWrapper).
    base = connections[engine]
    wrapper = base.__class__(copy.deepcopy(base.settings_dict), alias=engine)
    wrapper.ensure_connection()
    raw = wrapper.connection
    ph = "?" if wrapper.vendor == "sqlite" else "%s"
    table_name = wrapper.ops.quote_name("django_setnx_lock")
    insert = (
        f"INSERT INTO {table_name} (name, token, owner, acquired_at, expires_at, "
        f"fencing, next_token, next_since, next_seen) "
        f"VALUES ({ph}, {ph}, {ph}, {ph}, {ph}, {ph}, '', 0, 0)"
    )
    delete = f"DELETE FROM {table_name} WHERE name = {ph} AND token = {ph}"
    f_name, f_token = f"{np}:u:floor", secrets.token_hex(16)
    f_owner = json.dumps(current_owner(), sort_keys=True)
    now_ms = int(time.time() * 1000)
    f_row = (f_name, f_token, f_owner, now_ms, now_ms + TTL * 1000, now_ms * 1000)

    def floor():
        cur = raw.cursor()
        try:
            cur.execute(insert, f_row)
            cur.execute(delete, (f_name, f_token))
            check(cur.rowcount == 1, "DELETE")
        finally:
            cur.close()

    variants["floor: raw INSERT + DELETE (autocommit, same driver)"] = floor

    # The floor again, with the durability the backend chose (see the docs' "PostgreSQL
    # flushes only what gives or keeps a lock" and SQLite's synchronous=NORMAL):
    # the ratio to it is what our SQL and Python cost, the fsyncs left out.
    same_wrapper = None
    if wrapper.vendor in SAME_DURABILITY_FLOOR:
        same_wrapper = base.__class__(copy.deepcopy(base.settings_dict), alias=engine)
        same_wrapper.ensure_connection()
        variants[SAME_DURABILITY_FLOOR[wrapper.vendor]] = same_durability_floor(
            same_wrapper, insert, delete, f_row
        )
    variants["**ours**: lock() + acquire(blocking=False) + release()"] = ours
    if engine == "postgresql":
        name_prepared = f"{np}:u:prepared"

        def ours_prepared():
            lk = lock(name_prepared, ttl=TTL, backend=_setup.PG_PREPARED)
            check(lk.acquire(blocking=False), "acquire")
            lk.release()

        ours_prepared()  # connects, and prepares the statements on that connection
        variants["ours, OPTIONS['PREPARED_STATEMENTS'] (opt-in)"] = ours_prepared

    backend = locks[engine]
    owner = current_owner()
    b_name, b_token = f"{np}:u:backend", secrets.token_hex(16)

    def backend_only():
        check(backend.acquire(b_name, b_token, float(TTL), owner).acquired, "backend.acquire")
        check(backend.release(b_name, b_token), "backend.release")

    variants["ours, backend.acquire/release only (no Lock layer)"] = backend_only

    if _setup.have_db_mutex():
        from db_mutex.db_mutex import db_mutex

        m_name = f"{np}:u:dbmutex"

        def dbmutex():
            with db_mutex(m_name):
                pass

        variants["peer: django-db-mutex `with db_mutex(name)`"] = dbmutex
    return variants, [w for w in (wrapper, same_wrapper) if w is not None]


#: The label of the floor row with our durability choices, per vendor.
SAME_DURABILITY_FLOOR = {
    "sqlite": "floor, same durability: raw INSERT + DELETE, synchronous=NORMAL",
    "postgresql": "floor, same durability: raw INSERT + DELETE, the DELETE unflushed",
}


def same_durability_floor(wrapper, insert, delete, row):
    """The floor's pair on ``wrapper``'s connection (its own) with the durability
    the backend gives its statements."""
    if wrapper.vendor == "sqlite":
        wrapper.connection.execute("PRAGMA synchronous=NORMAL")  # this connection's own
    else:
        delete += " AND set_config('synchronous_commit', 'off', true) IS NOT NULL"
    raw = wrapper.connection
    row = (row[0] + ":same",) + row[1:]

    def floor_same():
        cur = raw.cursor()
        try:
            cur.execute(insert, row)
            cur.execute(delete, (row[0], row[1]))
            check(cur.rowcount == 1, "DELETE")
        finally:
            cur.close()

    return floor_same


def db_uncontended_child(cfg, engine, params, conn):
    try:
        _setup.configure(cfg, default=engine)
        variants, wrappers = db_variants(cfg, engine)
        samples, cpu = interleaved(variants, **params)
        for wrapper in wrappers:
            wrapper.close()
        conn.send(("ok", (samples, cpu)))
    except BaseException:  # noqa: BLE001 - report, never hang the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_db_uncontended(cfg, engine, params):
    ctx = spawn_ctx()
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(
        target=db_uncontended_child,
        args=(_setup.child_config(cfg), engine, params, child_end),
        daemon=True,
    )
    proc.start()
    child_end.close()
    try:
        if not parent_end.poll(600):
            raise RuntimeError("no answer from the child in 600 s")
        status, payload = parent_end.recv()
    except EOFError:
        status, payload = "error", f"child died (exit code {proc.exitcode})"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def uncontended_table(title, samples, cpu, floor_label, ratio_target, results_key, results):
    floor_med = median(samples[floor_label]) / 1000
    rows = []
    for label, s in samples.items():
        s = sorted(s)
        med = median(s) / 1000
        ratio = med / floor_med
        target = ""
        if label.startswith("**ours**"):
            target = f"≤ {ratio_target:.2f}× {verdict(ratio <= ratio_target)}"
            key = results_key + ("-cache" if "CACHE" in label else "")
            results[key] = ratio
        rows.append(
            [
                label,
                fmt(med),
                fmt(pct(s, 99) / 1000),
                f"{ratio:.2f}×",
                target,
                fmt(cpu[label] / 1000),
            ]
        )
    out(f"**{title}** ({len(samples[floor_label])} pairs per row)")
    out()
    table(
        [
            "variant",
            "median µs",
            "p99 µs",
            "÷ floor median",
            "target",
            "client CPU µs/pair (user+sys)",
        ],
        rows,
    )


def _server_us_per_pair(client, fn, sent, pairs=2000):
    """Redis-side µs per call of ``fn``: ``(commands, cpu)``. ``commands``: the time
    of the commands ``fn`` sends (``sent``, e.g. ``("set", "evalsha")``; INFO
    commandstats, which resets), a script's counting what it calls. Commands a
    script calls have lines of their own too: summing every line counted them twice
    (notes of 12-07 and before: 52.9 µs for ours, 45 without). ``cpu``: the server
    process' CPU (INFO cpu, user + sys), which adds reading, parsing and replying."""

    def cpu():
        info = client.info("cpu")
        return info["used_cpu_user"] + info["used_cpu_sys"]

    for _ in range(100):
        fn()
    client.config_resetstat()
    before = cpu()
    for _ in range(pairs):
        fn()
    spent = cpu() - before
    stats = client.info("commandstats")
    commands = sum(stats.get(f"cmdstat_{name}", {}).get("usec", 0) for name in sent)
    return commands / pairs, spent * 1e6 / pairs


def redis_breakdown(cfg, samples, variants):
    """Where Redis ours - floor goes: differences of medians, direct measurements."""
    import redis

    from django_setnx import lock, locks, signals
    from django_setnx.locking import Lock, current_owner

    meds = {label: median(s) / 1000 for label, s in samples.items()}

    def find(prefix):
        return next((meds[k] for k in meds if k.startswith(prefix)), None)

    parts = [
        ("constructing the Lock (`lock(...)` per pair)", "**ours**", "ours, one Lock"),
        (
            "Lock layer: token, owner, deadline, signals, bookkeeping",
            "ours, one Lock",
            "ours, backend",
        ),
        (
            "backend Python: json.dumps(owner), keys, ttl, error wrapping",
            "ours, backend",
            "ours, our Lua",
        ),
        ("our two Lua scripts vs SET NX + CAD script (Redis + wire)", "ours, our Lua", "floor"),
        ("**total ours − floor**", "**ours**", "floor"),
    ]
    rows = []
    for what, a, b in parts:
        ma, mb = find(a), find(b)
        if None not in (ma, mb):
            rows.append([what, fmt(ma - mb)])
    out(
        "**Where Redis ours − floor goes: differences between the medians above** (µs per pair; "
        "differences of medians of noisy distributions: ± several µs on a quiet machine, "
        "tens under load; the direct measurements below are steadier)"
    )
    out()
    table(["part", "Δ median µs"], rows)

    def per_call_us(fn, number=5000):
        best = min(timeit.repeat(fn, number=number, repeat=5))
        return best / number * 1e6

    direct = []
    # Our Python alone: the two script calls stubbed out, everything else real.
    backend = locks["redis"]
    conn = backend.connection
    name = f"{cfg['name_prefix']}:u:stub"
    originals = conn.acquire, conn.release
    try:
        conn.acquire = lambda keys=(), args=(), client=None: [1, 1]
        conn.release = lambda keys=(), args=(), client=None: 1

        def stubbed():
            lk = lock(name, ttl=TTL, backend="redis")
            lk.acquire(blocking=False)
            lk.release()

        direct.append(
            [
                "our Python per pair with the two script calls stubbed out "
                "(lock() + Lock + backend; no redis-py, no I/O)",
                fmt(per_call_us(stubbed), 1),
            ]
        )
    except Exception as exc:  # noqa: BLE001
        direct.append(["our Python per pair (stubbed)", f"error: {exc}"])
    finally:
        conn.acquire, conn.release = originals
    if cfg.get("redis_owned"):
        client = redis.Redis.from_url(cfg["redis_url"])
        for label, key, sent in (
            ("floor (SET + CAD script)", "floor", ("set", "evalsha")),
            ("ours (ACQUIRE + RELEASE scripts)", "**ours**", ("evalsha",)),
            ("redis-py Lock (SET + its release script)", "peer: redis-py", ("set", "evalsha")),
        ):
            fn = next((v for k, v in variants.items() if k.startswith(key)), None)
            if fn is not None:
                commands, cpu = _server_us_per_pair(client, fn, sent)
                direct.append(
                    [
                        f"Redis server per pair, {label}: its commands (INFO commandstats) / "
                        f"the server's CPU (INFO cpu)",
                        f"{fmt(commands, 1)} / {fmt(cpu, 1)}",
                    ]
                )
    owner = current_owner()
    lk = lock("bench-micro", ttl=TTL, backend="redis")
    direct += [
        [
            "`lock(name, ttl=30, backend=...)` (validation + locks[alias])",
            fmt(per_call_us(lambda: lock("bench-micro", ttl=TTL, backend="redis")), 2),
        ],
        ["`secrets.token_hex(16)`", fmt(per_call_us(lambda: secrets.token_hex(16)), 2)],
        [
            "`current_owner()` (cached gethostname, getpid, current_thread)",
            fmt(per_call_us(current_owner), 2),
        ],
        ["`socket.gethostname()` (were it not cached)", fmt(per_call_us(socket.gethostname), 2)],
        [
            "`json.dumps(owner, sort_keys=True)`",
            fmt(per_call_us(lambda: json.dumps(owner, separators=(",", ":"), sort_keys=True)), 2),
        ],
        [
            "signals: lock_acquired + lock_released `.send()` (no receivers)",
            fmt(
                per_call_us(
                    lambda: (
                        signals.lock_acquired.send(sender=Lock, lock=lk),
                        signals.lock_released.send(sender=Lock, lock=lk),
                    )
                ),
                2,
            ),
        ],
    ]
    out("**Direct measurements** (µs; Python pieces: best of 5 timeit runs in this process)")
    out()
    table(["what", "µs"], direct)


def section_uncontended(cfg, p, results):
    out(f"## 1. Uncontended acquire + release (load {load()})")
    out()
    out(
        f"Warm-up {p['warmup']} pairs per variant, then {p['blocks']} blocks × {p['per_block']} "
        f"pairs per variant, interleaved pair by pair (one pair of each variant in turn, "
        f"in an order shuffled per round); each pair timed with perf_counter_ns. ttl={TTL} s; "
        f"same lock name every pair."
    )
    out()
    if cfg.get("redis_url"):
        try:
            variants = redis_variants(cfg)
            samples, cpu = interleaved(variants, **p)
            uncontended_table(
                "Redis",
                samples,
                cpu,
                next(iter(samples)),
                TARGETS["redis_ratio"],
                "ratio:redis",
                results,
            )
            ours = median(samples["**ours**: lock() + acquire(blocking=False) + release()"])
            peer = median(samples["peer: redis-py `r.lock()` (Lock)"])
            results["redis:below-peer"] = ours < peer
            redis_breakdown(cfg, samples, variants)
        except Exception:  # noqa: BLE001
            out(f"Redis: error\n```\n{traceback.format_exc()}```\n")
    for engine in cfg["engines"]:
        try:
            samples, cpu = run_db_uncontended(cfg, engine, p)
            title = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "mariadb": "MariaDB"}[engine]
            uncontended_table(
                f"{title} (measured in a child process whose Django default "
                f"database is {engine}, for django-db-mutex)",
                samples,
                cpu,
                next(iter(samples)),
                TARGETS["db_ratio"][engine],
                f"ratio:{engine}",
                results,
            )
            same = next((s for s in samples if s.startswith("floor, same durability")), None)
            if same is not None:
                ours = median(samples["**ours**: lock() + acquire(blocking=False) + release()"])
                out(
                    f"{title}: ours ÷ the same-durability floor = "
                    f"{ours / median(samples[same]):.2f}× (what our SQL and Python add, "
                    f"the fsyncs we leave out not counted as a gain)"
                )
                out()
        except Exception as exc:  # noqa: BLE001
            out(f"{engine}: error\n```\n{exc}\n```\n")


# -- 2. handoff latency ----------------------------------------------------------------


def warm_up(kind, cfg, alias, name, sleep=0.1):
    """One acquire + release on a name of our own before the clock starts: connects
    (a backend's connection is per process and thread) and loads the scripts. The
    PostgreSQL floor connects and LISTENs when its factory is made: there it only
    runs the code once; its connection is closed again."""
    make = lock_factory(kind, cfg, alias, name, sleep=sleep)
    acquire, release = make()
    acquire(10)
    release()
    getattr(make, "close", lambda: None)()


def handoff_waiter(cfg, kind, alias, name, n, conn):
    try:
        _setup.configure(cfg)
        make = lock_factory(kind, cfg, alias, name)
        warm_up(kind, cfg, alias, name + ":warm")
        conn.send("ready")
        for _ in range(n):
            if conn.recv() is None:
                break
            acquire, release = make()
            conn.send("waiting")
            ok = acquire(10)
            t1 = pc()
            if ok:
                release()
            conn.send((ok, t1))
    except BaseException:  # noqa: BLE001
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


def run_handoff(cfg, kind, alias, n):
    """Parent holds, a spawned child waits; returns (latencies in ns, failures)."""
    name = f"{cfg['name_prefix']}:h:{kind}:{alias}"
    make = lock_factory(kind, cfg, alias, name)

    def hold():
        acquire, release = make()
        if not acquire(10):
            raise RuntimeError("holder could not acquire the lock")
        return release

    args = (_setup.child_config(cfg), kind, alias, name, n)
    try:
        return _time_handoffs(handoff_waiter, args, n, hold)
    finally:
        getattr(make, "close", lambda: None)()


def section_handoff(cfg, p, results):
    n = p["handoffs"]
    out(f"## 2. Handoff latency (load {load()})")
    out()
    out(
        f"{n} handoffs per row. The holder (this process) acquires, lets the waiter (a spawned "
        f"process) enter `acquire(timeout=10)`, holds 5–25 ms more (random), stamps "
        f"perf_counter_ns right before `release()`; the waiter stamps right after its acquire "
        f"returns. Latency = waiter stamp − holder stamp (CLOCK_MONOTONIC, shared by processes)."
    )
    out()
    rows = []
    plan = []
    if cfg.get("redis_url"):
        plan.append(
            (
                "machine: a token through a Redis list, raw sockets (RPUSH → BLPOP; "
                "not a lock, no client library)",
                "raw",
                None,
                False,
            )
        )
        plan.append(
            (
                "floor: minimal wake-up lock (CAD+RPUSH script → BLPOP → SET NX PX)",
                "floor",
                None,
                False,
            )
        )
        plan.append(
            (
                "**ours: Redis** (direct handoff to the first waiter, BLPOP)",
                "ours",
                "redis",
                "redis",
            )
        )
        plan.append(
            ("peer: redis-py Lock (`blocking_timeout`, default sleep=0.1)", "redispy", None, False)
        )
        if have("redis_lock"):
            plan.append(("peer: python-redis-lock (BLPOP signal)", "prl", None, False))
    for engine in cfg["engines"]:
        if engine == "postgresql":
            plan.append(
                (
                    "machine: one flushed UPDATE that NOTIFYs a process blocked in LISTEN "
                    "(psycopg; not a lock)",
                    "notify",
                    None,
                    False,
                )
            )
            plan.append(
                (
                    "floor: minimal NOTIFY lock on postgresql (INSERT, flushed; on conflict "
                    "wait for NOTIFY; DELETE + NOTIFY, unflushed)",
                    "pgfloor",
                    None,
                    False,
                )
            )
        if engine == "postgresql":
            plan.append(("**ours: postgresql** (NOTIFY)", "ours", engine, engine))
        else:
            label = f"ours: {engine} (polling, and wake-ups on this host; for information)"
            plan.append((label, "ours", engine, False))
        if engine == "postgresql":
            plan.append(
                (
                    "ours: postgresql, PREPARED_STATEMENTS (opt-in; for information)",
                    "ours",
                    _setup.PG_PREPARED,
                    False,
                )
            )
    for label, kind, alias, targeted in plan:
        try:
            if kind == "notify":
                lat, failures = run_notify_handoff(cfg, n)
            else:
                lat, failures = run_handoff(cfg, kind, alias, n)
            s = sorted(lat)
            p50, p99 = pct(s, 50) / 1e6, pct(s, 99) / 1e6
            t50 = t99 = ""
            if targeted:  # the alias whose targets these are
                results[f"handoff:p50:{targeted}"] = p50
                results[f"handoff:p99:{targeted}"] = p99
                max50, max99 = TARGETS["handoff_ms"][targeted]
                t50, t99 = (
                    f"≤ {max50} {verdict(p50 <= max50)}",
                    f"≤ {max99} {verdict(p99 <= max99)}",
                )
            rows.append(
                [
                    label,
                    fmt(p50, 3),
                    t50,
                    fmt(p99, 3),
                    t99,
                    fmt(s[-1] / 1e6, 3) if s else "-",
                    failures,
                ]
            )
        except Exception as exc:  # noqa: BLE001
            rows.append(
                [label, f"error: {str(exc).strip().splitlines()[-1][:120]}", "", "", "", "", ""]
            )
    table(["variant", "p50 ms", "target", "p99 ms", "target", "max ms", "timeouts"], rows)


# -- 3. contended throughput -------------------------------------------------------------


def throughput_worker(cfg, kind, alias, name, n, sleep, barrier, results, idx):
    try:
        _setup.configure(cfg)
        make = lock_factory(kind, cfg, alias, name, sleep=sleep)
        warm_up(kind, cfg, alias, f"{name}:warm{idx}", sleep=sleep)
        records = []
        barrier.wait(timeout=120)
        t_start = pc()
        for _ in range(n):
            acquire, release = make()
            t_req = pc()
            ok = acquire(60)
            t_acq = pc()
            if not ok:
                records.append((t_req, t_acq, None))
                continue
            end = t_acq + CS_NS
            while pc() < end:
                pass
            t_rel = pc()
            release()
            records.append((t_req, t_acq, t_rel))
        results.put(("ok", idx, t_start, pc(), records))
    except BaseException:  # noqa: BLE001
        results.put(("error", idx, traceback.format_exc()))


def run_throughput(cfg, kind, alias, n, procs=4, sleep=0.1):
    name = f"{cfg['name_prefix']}:t:{kind}:{alias}"
    ctx = spawn_ctx()
    barrier = ctx.Barrier(procs)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=throughput_worker,
            args=(_setup.child_config(cfg), kind, alias, name, n, sleep, barrier, results, i),
            daemon=True,
        )
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    return gather(workers, results, barrier, time.monotonic() + 120 + n * procs * 0.5)


def gather(workers, results, barrier, deadline):
    """Collect one ``("ok", idx, *report)`` per worker process from ``results``:
    ``{idx: report}``. A worker's ``("error", idx, traceback)``, a dead worker or
    the ``deadline`` (monotonic) raises RuntimeError; the workers are joined (killed
    if they linger) either way."""
    got = {}
    try:
        while len(got) < len(workers):
            try:
                msg = results.get(timeout=1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError("timed out waiting for the workers") from None
                if any(not w.is_alive() for w in workers) and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        dead = [w.exitcode for w in workers if not w.is_alive()]
                        raise RuntimeError(f"a worker died (exit codes {dead})") from None
                continue
            if msg[0] == "error":
                barrier.abort()
                raise RuntimeError(msg[2])
            got[msg[1]] = msg[2:]
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
                w.join()
    return got


def run_header(title, detail, p):
    """The first lines of a benchmark's output: title, date, machine, load, ``detail``
    and the parameters ``p``."""
    out(f"# {title}")
    out()
    out(
        f"- {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {os.cpu_count()} CPUs, "
        f"load average at start **{load()}**; {detail}"
    )
    out(f"- parameters: {p}")
    out()


def throughput_stats(got):
    starts = [v[0] for v in got.values()]
    dones = [v[1] for v in got.values()]
    records = {i: v[2] for i, v in got.items()}
    start, end = min(starts), max(dones)
    wall = (end - start) / 1e9
    acquired = [(a, r) for recs in records.values() for (_, a, r) in recs if r is not None]
    timeouts = sum(1 for recs in records.values() for (_, _, r) in recs if r is None)
    ideal = len(acquired) * CS_NS / 1e9
    window_end = min(dones)  # the first process to finish all of its acquisitions
    counts = [
        sum(1 for (_, a, r) in records[i] if r is not None and a <= window_end)
        for i in sorted(records)
    ]
    waits = [a - q for recs in records.values() for (q, a, r) in recs]
    # Mutual exclusion: each acquisition starts after the previous one's release stamp.
    acquired.sort()
    overlaps = sum(1 for (_, r0), (a1, _) in zip(acquired, acquired[1:]) if a1 < r0)
    # Barging: the share of each process' acquisitions that directly followed one of
    # its own (it released and won again while others waited); the largest share.
    by_time = sorted((a, i) for i, recs in records.items() for (_, a, r) in recs if r is not None)
    repeats = dict.fromkeys(records, 0)
    for (_, previous), (_, current) in zip(by_time, by_time[1:]):
        if previous == current:
            repeats[current] += 1
    wins = {i: sum(1 for (_, _, r) in recs if r is not None) for i, recs in records.items()}
    repeat_share = max(repeats[i] / wins[i] for i in records if wins[i])
    waits.sort()
    return {
        "wall": wall,
        "eff": ideal / wall if wall else float("nan"),
        "jain": jain(counts),
        "counts": counts,
        "max_wait_ms": max(waits) / 1e6,
        "p50_wait_ms": median(waits) / 1e6,
        "p99_wait_ms": pct(waits, 99) / 1e6,
        "repeat_share": repeat_share,
        "overlaps": overlaps,
        "timeouts": timeouts,
    }


def section_throughput(cfg, p, results):
    n = p["per_proc"]
    out(f"## 3. Contended throughput and fairness (load {load()})")
    out()
    out(
        f"4 spawned processes × {n} acquisitions of ONE lock, each around a 1 ms busy-wait "
        f"critical section, all started on a barrier; a fresh lock object per acquisition, "
        f"acquire(timeout=60). ideal = {4 * n} × 1 ms. Jain's index is over the per-process "
        f"acquisition counts up to the moment the first process finished all {n} "
        f"(1.0 = perfectly even, 0.25 = one process got everything). "
        f"Max/median wait = time from calling acquire to its return."
    )
    out()
    plan = []
    if cfg.get("redis_url"):
        plan.append(
            (
                "machine: a token through a Redis list, raw sockets (not a lock)",
                "raw",
                None,
                0.1,
                False,
            )
        )
        plan.append(
            (
                "floor: minimal wake-up lock (SET NX PX, BLPOP, CAD+RPUSH)",
                "floor",
                None,
                0.1,
                False,
            )
        )
        plan.append(("**ours: Redis**", "ours", "redis", 0.1, True))
        plan.append(("peer: redis-py Lock (sleep=0.001)", "redispy", None, 0.001, False))
        if have("redis_lock"):
            plan.append(("peer: python-redis-lock", "prl", None, 0.1, False))
    for engine in cfg["engines"]:
        if engine == "postgresql":
            label = "floor: minimal NOTIFY lock on postgresql (as in table 2; not fair)"
            plan.append((label, "pgfloor", None, 0.1, False))
        plan.append((f"**ours: {engine}**", "ours", engine, 0.1, True))
        if engine == "postgresql":
            label = "ours: postgresql, PREPARED_STATEMENTS (opt-in)"
            plan.append((label, "ours", _setup.PG_PREPARED, 0.1, False))
    rows = []
    for label, kind, alias, sleep, targeted in plan:
        try:
            st = throughput_stats(run_throughput(cfg, kind, alias, n, sleep=sleep))
            t_eff = t_jain = ""
            if targeted:
                results[f"eff:{alias}"], results[f"jain:{alias}"] = st["eff"], st["jain"]
                t_eff = verdict(st["eff"] >= TARGETS["efficiency"][alias])
                t_jain = verdict(st["jain"] >= TARGETS["jain"])
                results[f"p99_wait:{alias}"] = st["p99_wait_ms"]
                results[f"repeat_share:{alias}"] = st["repeat_share"]
            rows.append(
                [
                    label,
                    fmt(st["wall"], 2),
                    f"{st['eff']:.2f}",
                    t_eff,
                    f"{st['jain']:.3f}",
                    t_jain,
                    "/".join(map(str, st["counts"])),
                    fmt(st["p50_wait_ms"], 2),
                    fmt(st["p99_wait_ms"], 1),
                    fmt(st["max_wait_ms"], 1),
                    f"{st['repeat_share']:.0%}",
                    st["overlaps"],
                    st["timeouts"],
                ]
            )
        except Exception as exc:  # noqa: BLE001
            rows.append([label, f"error: {str(exc).strip().splitlines()[-1][:120]}"] + [""] * 11)
    table(
        [
            "variant",
            "wall s",
            "ideal÷wall",
            "target",
            "Jain",
            f"≥ {TARGETS['jain']}",
            "acquisitions per process in window",
            "median wait ms",
            "p99 wait ms",
            "max wait ms",
            "most back-to-back wins (share of a process' wins)",
            "overlaps",
            "timeouts",
        ],
        rows,
    )


# -- 4. state left behind by many distinct names ------------------------------------------


def section_state(cfg, p, results):
    """Acquire and release ``state_names`` distinct names on every backend, then count
    what stays: Redis keys without a TTL under the prefix, database rows of those
    names (there used to be a fence key or row per name, forever)."""
    from django.db import connections

    from django_setnx import locks
    from django_setnx.locking import current_owner

    n = p["state_names"]
    cfg["state_names"] = n
    out(f"## 4. State left after {n:,} distinct names, each acquired and released (load {load()})")
    out()
    owner = current_owner()
    rows = []
    aliases = (["redis"] if cfg.get("redis_url") else []) + cfg["engines"]
    for alias in aliases:
        backend = locks[alias]
        prefix = f"{cfg['name_prefix']}:state:{alias}"
        started = time.monotonic()
        for i in range(n):
            name, token = f"{prefix}:{i}", f"{i:032x}"
            check(backend.acquire(name, token, float(TTL), owner).acquired, "acquire")
            check(backend.release(name, token), "release")
        seconds = time.monotonic() - started
        if alias == "redis":
            import redis

            client = redis.Redis.from_url(cfg["redis_url"])
            keys = list(client.scan_iter(match=f"{cfg['key_prefix']}:*", count=5000))
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.pttl(key)
            left = sum(1 for ttl in pipe.execute() if ttl == -1)
            what = f"{len(keys):,} keys under the prefix, all expiring"
        else:
            with connections[alias].cursor() as cursor:
                cursor.execute(
                    "SELECT COUNT(*) FROM django_setnx_lock WHERE name LIKE %s AND token <> ''",
                    [prefix + ":%"],
                )
                left = cursor.fetchone()[0]
                cursor.execute(
                    "SELECT COUNT(*) FROM django_setnx_lock WHERE name LIKE %s AND token = ''",
                    [prefix + ":%"],
                )
                tombstones = cursor.fetchone()[0]
            what = (
                f"lock rows of those names; {tombstones:,} released rows (tombstones "
                f"keeping the fencing token) go after 60 s"
            )
        results[f"state:{alias}"] = left
        rows.append([alias, f"{n:,}", f"{seconds:.1f}", f"{left:,}", what])
    table(["backend", "names", "seconds", "keys without a TTL / rows left", "note"], rows)


# -- summary -----------------------------------------------------------------------------


def section_summary(cfg, results):
    out(f"## Targets (load {load()})")
    out()
    rows = []

    def row(what, key, target, fmt_value, ok):
        if key not in results:
            rows.append([what, "not measured", ""])
            return
        v = results[key]
        rows.append([what, fmt_value(v), verdict(ok(v, target))])

    times = lambda v: f"{v:.2f}×"  # noqa: E731
    ms = lambda v: f"{v:.3f} ms"  # noqa: E731
    plain = lambda v: f"{v:.3f}"  # noqa: E731
    le = lambda v, t: v <= t  # noqa: E731
    ge = lambda v, t: v >= t  # noqa: E731
    if cfg.get("redis_url"):
        row(
            f"Redis: ours ≤ {TARGETS['redis_ratio']}× floor (median)",
            "ratio:redis",
            TARGETS["redis_ratio"],
            times,
            le,
        )
        row(
            f"Redis through django-redis (OPTIONS['CACHE']): ours ≤ "
            f"{TARGETS['redis_ratio']}× floor (median)",
            "ratio:redis-cache",
            TARGETS["redis_ratio"],
            times,
            le,
        )
        row(
            "Redis: ours below redis-py's Lock (median)",
            "redis:below-peer",
            True,
            lambda v: "yes" if v else "no",
            lambda v, t: v is t,
        )
    for engine in cfg["engines"]:
        target = TARGETS["db_ratio"][engine]
        row(f"{engine}: ours ≤ {target}× floor (median)", f"ratio:{engine}", target, times, le)
    for alias in (["redis"] if cfg.get("redis_url") else []) + cfg["engines"]:
        row(
            f"{alias}: after {cfg.get('state_names', 0):,} distinct names, keys without a "
            f"TTL / rows left",
            f"state:{alias}",
            0,
            lambda v: f"{v:,}",
            le,
        )
    handoff_aliases = ["redis"] if cfg.get("redis_url") else []
    if "postgresql" in cfg["engines"]:
        handoff_aliases.append("postgresql")
    for alias in handoff_aliases:
        for i, p in enumerate(("p50", "p99")):
            target = TARGETS["handoff_ms"][alias][i]
            row(f"{alias}: handoff {p} ≤ {target} ms", f"handoff:{p}:{alias}", target, ms, le)
    for alias in (["redis"] if cfg.get("redis_url") else []) + cfg["engines"]:
        target = TARGETS["efficiency"][alias]
        row(f"{alias}: contended ideal÷wall ≥ {target}", f"eff:{alias}", target, plain, ge)
        row(
            f"{alias}: contended Jain ≥ {TARGETS['jain']} (no process starved)",
            f"jain:{alias}",
            TARGETS["jain"],
            plain,
            ge,
        )
        row(
            f"{alias}: no process wins more than {TARGETS['repeat_share']:.0%} of its "
            f"acquisitions back to back",
            f"repeat_share:{alias}",
            TARGETS["repeat_share"],
            lambda v: f"{v:.0%}",
            le,
        )
    if cfg.get("redis_url"):
        row(
            f"redis: contended wait p99 ≤ {TARGETS['redis_wait_p99_ms']} ms",
            "p99_wait:redis",
            TARGETS["redis_wait_p99_ms"],
            ms,
            le,
        )
    table(["target", "measured", "verdict"], rows)
    out("A MISS is reported, never an error: the exit status is 0 either way.")


# -- header ------------------------------------------------------------------------------


def versions(cfg):
    import django
    import redis

    parts = [
        f"Python {platform.python_version()}",
        f"Django {django.__version__}",
        f"redis-py {redis.__version__}" + (" + hiredis" if have("hiredis") else ""),
    ]
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    for dist in ("psycopg", "mysqlclient", "PyMySQL", "django-db-mutex", "python-redis-lock"):
        try:
            parts.append(f"{dist} {dist_version(dist)}")
        except PackageNotFoundError:
            pass
    import sqlite3

    servers = [f"SQLite {sqlite3.sqlite_version}"]
    if cfg.get("redis_url"):
        try:
            info = redis.Redis.from_url(cfg["redis_url"]).info("server")
            where = "throwaway" if cfg.get("redis_owned") else cfg["redis_url"]
            servers.append(f"Redis {info['redis_version']} ({where})")
        except Exception:  # noqa: BLE001
            pass
    from django.db import connections

    for engine, sql in (("postgresql", "SHOW server_version"), ("mariadb", "SELECT VERSION()")):
        if engine in cfg["engines"]:
            try:
                with connections[engine].cursor() as cur:
                    cur.execute(sql)
                    servers.append(f"{engine} {cur.fetchone()[0]}")
            except Exception:  # noqa: BLE001
                pass
    return ", ".join(parts), ", ".join(servers)


def code_state():
    repo = _setup.REPO
    digest = hashlib.sha1()
    for path in sorted((repo / "django_setnx").rglob("*.py")):
        digest.update(path.read_bytes())
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "django_setnx"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()
    except Exception:  # noqa: BLE001
        head, dirty = "?", []
    return (
        f"git {head}"
        + (f" + {len(dirty)} uncommitted file(s) in django_setnx/" if dirty else "")
        + f", django_setnx/*.py sha1 {digest.hexdigest()[:12]}"
    )


# -- main --------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (about a minute)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the bench databases and SQLite file at the end"
    )
    parser.add_argument(
        "--sections", default="1,2,3,4", help="comma list of sections to run (default 1,2,3,4)"
    )
    args = parser.parse_args()
    sections = {s.strip() for s in args.sections.split(",")}

    if args.quick:
        params = {
            "warmup": 50,
            "blocks": 6,
            "per_block": 40,
            "handoffs": 50,
            "per_proc": 50,
            "state_names": 5_000,
        }
    else:
        params = {
            "warmup": 200,
            "blocks": 20,
            "per_block": 100,
            "handoffs": 200,
            "per_proc": 200,
            "state_names": 100_000,
        }
    unc = {k: params[k] for k in ("warmup", "blocks", "per_block")}

    t_begin = time.monotonic()
    load_start = load()
    notes = []
    cfg = _setup.prepare(notes)
    results = {}
    try:
        _setup.configure(cfg)
        _setup.migrate(cfg, notes)
        lib, servers = versions(cfg)
        out("# django-setnx core benchmarks")
        out()
        out(
            f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC on {socket.gethostname()}, "
            f"{os.cpu_count()} CPUs, load average (1/5/15 min) at start **{load_start}** "
            f"(other processes may be running)"
        )
        out(f"- mode: {'--quick' if args.quick else 'full'} ({json.dumps(params)})")
        out(f"- code: {code_state()}")
        out(f"- libraries: {lib}")
        out(f"- servers: {servers}, all on this machine (127.0.0.1)")
        for note in notes:
            out(f"- note: {note}")
        notes.clear()
        out()
        if "1" in sections:
            section_uncontended(cfg, unc, results)
        if "2" in sections:
            section_handoff(cfg, params, results)
        if "3" in sections:
            section_throughput(cfg, params, results)
        if "4" in sections:
            section_state(cfg, params, results)
        section_summary(cfg, results)
    finally:
        _setup.teardown(cfg, args.keep, notes)
        for note in notes:
            out(f"- note: {note}")
        out(f"\nTotal time {time.monotonic() - t_begin:.0f} s, load at end {load()}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
