#!/usr/bin/env python3
"""Waiting on Redis: asyncio without threads, and waiters that died; async on databases.

    python3 benchmarks/bench_async.py            # full run, about two minutes
    python3 benchmarks/bench_async.py --quick    # fewer iterations

Prints markdown tables, then the targets with PASS/MISS (a miss never fails the run):

1. uncontended acquire+release, µs per pair: the async API (``aacquire`` +
   ``arelease``) next to the sync one, each next to its raw floor (``SET NX PX`` +
   ``EVALSHA`` compare-and-delete, sync redis-py and ``redis.asyncio``) and to
   redis-py's asyncio ``Lock``; target: async ours <= 1.2x sync ours;
2. 1,000 coroutines wait on one held lock in one event loop: an unrelated lock's
   acquire+release, back to back for a few seconds (several of the waiters' renewal
   cycles), p50/p99 next to the same measured before they queued up; the threads
   and Redis connections the waiters use; then the time to hand the lock down the
   whole queue; target: p99 <= 2x uncontended;
3. a waiter SIGKILLed while queued (ttl 30 s): the delay between the holder's
   release and the next live caller's acquire; target: <= 1 s (before the handoff
   claims: the dead waiter's whole ttl);
4. databases: 64 coroutines acquire and release names of their own through one
   database backend, which lends each call one of ``OPTIONS["ASYNC_CONNECTIONS"]``
   shared connections: pairs per second and the lock connections opened, for 1, 2
   and 4 (the default) shared connections, next to one per thread of the event
   loop's default executor (what the backend opened before the option existed).
"""

import argparse
import asyncio
import gc
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup
from bench_core import CAD, check, fmt, load, median, out, pct, run_header, table, verdict

pc = time.perf_counter_ns
TTL = 30
TARGETS = {"async_ratio": 1.2, "waiters_p99_ratio": 2.0, "dead_waiter_s": 1.0}


# -- 1. uncontended ---------------------------------------------------------------------


def sync_variants(cfg):
    import redis

    from django_setnx import lock

    np = cfg["name_prefix"]
    r = redis.Redis.from_url(cfg["redis_url"])
    cad = r.register_script(CAD)
    token = secrets.token_hex(16)

    def floor():
        check(r.set(f"{np}:a:floor", token, nx=True, px=TTL * 1000), "SET NX PX")
        check(cad(keys=[f"{np}:a:floor"], args=[token]) == 1, "compare-and-delete")

    def ours():
        lk = lock(f"{np}:a:ours", ttl=TTL, backend="redis")
        check(lk.acquire(blocking=False), "acquire")
        lk.release()

    return {"sync floor: SET NX PX + EVALSHA": floor, "sync **ours**: acquire + release": ours}


def async_variants(cfg):
    import redis.asyncio

    from django_setnx import lock

    np = cfg["name_prefix"]
    r = redis.asyncio.Redis.from_url(cfg["redis_url"])
    cad = r.register_script(CAD)
    token = secrets.token_hex(16)

    async def floor():
        check(await r.set(f"{np}:a:afloor", token, nx=True, px=TTL * 1000), "SET NX PX")
        check(await cad(keys=[f"{np}:a:afloor"], args=[token]) == 1, "compare-and-delete")

    async def ours():
        lk = lock(f"{np}:a:aours", ttl=TTL, backend="redis")
        check(await lk.aacquire(blocking=False), "aacquire")
        await lk.arelease()

    async def redispy():
        lk = r.lock(f"{np}:a:redispy", timeout=TTL)
        check(await lk.acquire(blocking=False), "redis.asyncio Lock.acquire")
        await lk.release()

    return {
        "async floor: SET NX PX + EVALSHA (redis.asyncio)": floor,
        "async **ours**: aacquire + arelease": ours,
        "peer: redis.asyncio `r.lock()` (Lock)": redispy,
    }


async def _time_async(fn, n):
    samples = []
    for _ in range(n):
        t0 = pc()
        await fn()
        samples.append(pc() - t0)
    return samples


def section_uncontended(cfg, p, results):
    out("## 1. Uncontended acquire+release, sync and async (µs per pair)")
    out()
    sync = sync_variants(cfg)
    samples = {label: [] for label in sync}
    loop = asyncio.new_event_loop()
    try:
        avariants = loop.run_until_complete(_build(async_variants, cfg))
        samples.update({label: [] for label in avariants})
        for fn in sync.values():
            for _ in range(p["warmup"]):
                fn()
        for fn in avariants.values():
            loop.run_until_complete(_time_async(fn, p["warmup"]))
        # Interleaved blocks: drift and background load hit every variant alike.
        for _ in range(p["blocks"]):
            gc.collect()
            for label, fn in sync.items():
                for _ in range(p["per_block"]):
                    t0 = pc()
                    fn()
                    samples[label].append(pc() - t0)
            for label, fn in avariants.items():
                samples[label] += loop.run_until_complete(_time_async(fn, p["per_block"]))
    finally:
        loop.close()
    med = {label: median(s) / 1000 for label, s in samples.items()}
    sync_floor, sync_ours = (
        med["sync floor: SET NX PX + EVALSHA"],
        med["sync **ours**: acquire + release"],
    )
    async_floor = med["async floor: SET NX PX + EVALSHA (redis.asyncio)"]
    rows = []
    for label, value in med.items():
        floor = async_floor if label.startswith(("async", "peer")) else sync_floor
        p99 = pct(sorted(samples[label]), 99) / 1000
        rows.append(
            [label, fmt(value), fmt(p99), f"{value / floor:.2f}x", f"{value / sync_ours:.2f}x"]
        )
    table(["variant", "median µs", "p99 µs", "vs its floor", "vs sync ours"], rows)
    results["async_ratio"] = med["async **ours**: aacquire + arelease"] / sync_ours
    results["raw_async_ratio"] = async_floor / sync_floor


async def _build(factory, cfg):
    return factory(cfg)


# -- 2. 1,000 waiting coroutines ----------------------------------------------------------


async def _pairs_for(seconds, name):
    """Back-to-back acquire+release of ``name`` for ``seconds``: the samples (ns)."""
    from django_setnx import lock

    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        lk = lock(name, ttl=TTL, backend="redis")
        t0 = pc()
        check(await lk.aacquire(blocking=False), "aacquire")
        await lk.arelease()
        samples.append(pc() - t0)
        # Let the waiters' machinery run between pairs, as a busy loop would.
        await asyncio.sleep(0)
    return samples


async def _waiters_run(cfg, p, results):
    import redis

    from django_setnx import lock, locks

    np = cfg["name_prefix"]
    busy, unrelated = f"{np}:w:busy", f"{np}:w:unrelated"
    admin = redis.Redis.from_url(cfg["redis_url"])
    n = p["waiters"]
    await _pairs_for(0.5, unrelated)  # warm the loop's client
    before = await _pairs_for(p["window"], unrelated)
    threads_before, conns_before = threading.active_count(), len(admin.client_list())

    holder = lock(busy, ttl=600, backend="redis")
    check(await holder.aacquire(blocking=False), "holder")
    got = []

    async def waiter(i):
        lk = lock(busy, ttl=TTL, backend="redis")
        await lk.aacquire(timeout=None)
        got.append(pc())
        await lk.arelease()

    tasks = [asyncio.create_task(waiter(i)) for i in range(n)]
    waiters_key = locks["redis"]._keys(busy)[2]
    deadline = time.monotonic() + 60
    while admin.zcard(waiters_key) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {admin.zcard(waiters_key)} of {n} waiters queued")
        await asyncio.sleep(0.05)
    threads_waiting = threading.active_count()
    conns_waiting = len(admin.client_list())
    during = await _pairs_for(p["window"], unrelated)
    queued_after = admin.zcard(waiters_key)

    t0 = pc()
    await holder.arelease()
    await asyncio.gather(*tasks)
    drain_s = (pc() - t0) / 1e9

    b, d = sorted(before), sorted(during)
    rows = [
        ["no waiters", len(b), fmt(pct(b, 50) / 1000), fmt(pct(b, 99) / 1000), "-"],
        [
            f"{n} coroutines waiting on another lock",
            len(d),
            fmt(pct(d, 50) / 1000),
            fmt(pct(d, 99) / 1000),
            f"{pct(d, 99) / pct(b, 99):.2f}x",
        ],
    ]
    table(["unrelated aacquire+arelease", "pairs", "p50 µs", "p99 µs", "p99 vs none"], rows)
    table(
        ["while they wait", "value"],
        [
            [
                "threads in the process (before -> waiting)",
                f"{threads_before} -> {threads_waiting}",
            ],
            ["Redis client connections (before -> waiting)", f"{conns_before} -> {conns_waiting}"],
            ["waiters still queued after the window", queued_after],
            [f"{n} handoffs down the queue, total", f"{drain_s:.2f} s"],
            ["per handoff", f"{drain_s / n * 1e6:,.0f} µs"],
        ],
    )
    results["waiters_p99_ratio"] = pct(d, 99) / pct(b, 99)
    results["waiter_threads"] = threads_waiting - threads_before


def section_waiters(cfg, p, results):
    out(f"## 2. {p['waiters']:,} coroutines waiting in one event loop")
    out()
    asyncio.run(_waiters_run(cfg, p, results))


# -- 3. a waiter SIGKILLed while queued ---------------------------------------------------


def _dead_waiter_child(cfg, name, ready):
    _setup.configure(cfg)
    from django_setnx import lock

    lk = lock(name, ttl=TTL, backend="redis")
    ready.set()
    lk.acquire(timeout=120)  # queued until it is killed
    os._exit(3)  # handed the lock before the kill: the run reports it


def section_dead_waiter(cfg, p, results):
    out("## 3. A waiter SIGKILLed while queued (its ttl: 30 s)")
    out()
    import redis

    from django_setnx import lock, locks

    admin = redis.Redis.from_url(cfg["redis_url"])
    ctx = multiprocessing.get_context("spawn")
    child_cfg = _setup.child_config(cfg)
    delays = []
    for i in range(p["dead_rounds"]):
        name = f"{cfg['name_prefix']}:d:{i}"
        waiters_key = locks["redis"]._keys(name)[2]
        holder = lock(name, ttl=TTL, backend="redis")
        check(holder.acquire(blocking=False), "holder")
        ready = ctx.Event()
        child = ctx.Process(target=_dead_waiter_child, args=(child_cfg, name, ready))
        child.start()
        ready.wait(60)
        deadline = time.monotonic() + 30
        while admin.zcard(waiters_key) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        # A live caller queues behind the dead one.
        acquired_at = []
        live = lock(name, ttl=TTL, backend="redis")

        def live_waiter(live=live, acquired_at=acquired_at):
            if live.acquire(timeout=40):
                acquired_at.append(time.monotonic())

        thread = threading.Thread(target=live_waiter)
        thread.start()
        while admin.zcard(waiters_key) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        released_at = time.monotonic()
        holder.release()
        thread.join()
        check(bool(acquired_at), "the live waiter's acquire")
        delays.append(acquired_at[0] - released_at)
        live.release()
    rows = [[i + 1, f"{d * 1000:,.0f} ms"] for i, d in enumerate(delays)]
    table(["round", "release -> next live caller holds it"], rows)
    results["dead_waiter_s"] = max(delays)


# -- 4. async callers on a database ------------------------------------------------------

DB_COROUTINES = 64


def _executor_threads():
    """How many threads the event loop's default executor may start on this machine."""
    return min(32, (os.cpu_count() or 1) + 4)


def _db_pairs(engine, cfg, connections, pairs_each):
    """Pairs per second of DB_COROUTINES coroutines, each acquiring and releasing
    names of its own through a new backend on ``engine`` with ``connections`` shared
    connections, and how many lock connections that backend opened."""
    from django_setnx.backends.database import DatabaseBackend

    backend = DatabaseBackend(
        f"bench-async-{engine}",
        {"OPTIONS": {"DATABASE": engine, "ASYNC_CONNECTIONS": connections}},
    )
    prefix = f"{cfg['name_prefix']}:adb:{connections}"
    owner = {"host": "bench", "pid": os.getpid(), "thread": "bench"}

    async def pairs(i):
        for k in range(pairs_each):
            name, token = f"{prefix}:{i}:{k}", secrets.token_hex(16)
            check((await backend.aacquire(name, token, TTL, owner)).acquired, "aacquire")
            check(await backend.arelease(name, token), "arelease")

    async def run():
        await backend.aget(f"{prefix}:warm-up")
        t0 = pc()
        await asyncio.gather(*(pairs(i) for i in range(DB_COROUTINES)))
        return pc() - t0

    try:
        elapsed_ns = asyncio.run(run())
        return DB_COROUTINES * pairs_each / (elapsed_ns / 1e9), len(backend._wrappers)
    finally:
        backend.close()


def section_database(cfg, p, results):
    threads = _executor_threads()
    out(f"## 4. {DB_COROUTINES} coroutines on a database (acquire+release pairs per second)")
    out()
    variants = [(1, "1 shared connection"), (2, "2 shared connections")]
    variants.append((4, "4 shared connections (**default**)"))
    variants.append((threads, f"one per executor thread ({threads}), as before the option"))
    rows = []
    for engine in cfg["engines"]:
        rates = {n: [] for n, _label in variants}
        opened = {}
        # Interleaved rounds: drift and background load hit every variant alike.
        for _ in range(p["db_rounds"]):
            for n, _label in variants:
                rate, opened[n] = _db_pairs(engine, cfg, n, p["db_pairs"])
                rates[n].append(rate)
        baseline = median(rates[threads])
        for n, label in variants:
            rate = median(rates[n])
            rows.append([engine, label, f"{rate:,.0f}", f"{rate / baseline:.2f}x", opened[n]])
    table(
        ["database", "async callers' connections", "pairs/s", "vs one per thread", "opened"], rows
    )


# -- main -----------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--sections", default="1,2,3,4", help="comma list (default 1,2,3,4)")
    args = parser.parse_args()
    sections = {s.strip() for s in args.sections.split(",")}
    if args.quick:
        p = {
            "warmup": 50,
            "blocks": 6,
            "per_block": 100,
            "waiters": 1000,
            "window": 4.0,
            "dead_rounds": 2,
            "db_rounds": 3,
            "db_pairs": 10,
        }
    else:
        p = {
            "warmup": 200,
            "blocks": 20,
            "per_block": 200,
            "waiters": 1000,
            "window": 8.0,
            "dead_rounds": 5,
            "db_rounds": 5,
            "db_pairs": 20,
        }
    notes = []
    cfg = _setup.prepare(notes)
    if not cfg.get("redis_url"):
        out("Redis is not reachable: " + "; ".join(notes))
        return 1
    results = {}
    t_begin = time.monotonic()
    try:
        _setup.configure(cfg)
        import redis

        server = redis.Redis.from_url(cfg["redis_url"]).info("server")["redis_version"]
        run_header(
            "django-setnx: waiting on Redis, async and dead waiters",
            f"redis-py {redis.__version__}; Redis {server}",
            p,
        )
        if "1" in sections:
            section_uncontended(cfg, p, results)
        if "2" in sections:
            section_waiters(cfg, p, results)
        if "3" in sections:
            section_dead_waiter(cfg, p, results)
        if "4" in sections:
            _setup.migrate(cfg, notes)
            section_database(cfg, p, results)
        rows = []
        if "async_ratio" in results:
            rows.append(
                [
                    "async ours / sync ours, medians",
                    f"{results['async_ratio']:.2f}x",
                    f"<= {TARGETS['async_ratio']}x",
                    verdict(results["async_ratio"] <= TARGETS["async_ratio"]),
                ]
            )
            rows.append(
                [
                    "(raw redis.asyncio floor / sync floor, for reference)",
                    f"{results['raw_async_ratio']:.2f}x",
                    "-",
                    "-",
                ]
            )
        if "waiters_p99_ratio" in results:
            ratio = results["waiters_p99_ratio"]
            rows.append(
                [
                    "unrelated pair p99 with 1,000 waiters / without",
                    f"{ratio:.2f}x",
                    f"<= {TARGETS['waiters_p99_ratio']}x",
                    verdict(ratio <= TARGETS["waiters_p99_ratio"]),
                ]
            )
            rows.append(
                [
                    "threads added by the waiters",
                    results["waiter_threads"],
                    "0",
                    verdict(results["waiter_threads"] <= 0),
                ]
            )
        if "dead_waiter_s" in results:
            rows.append(
                [
                    "delay caused by a SIGKILLed waiter (worst round)",
                    f"{results['dead_waiter_s']:.2f} s",
                    f"<= {TARGETS['dead_waiter_s']} s",
                    verdict(results["dead_waiter_s"] <= TARGETS["dead_waiter_s"]),
                ]
            )
        if rows:  # section 4 has no target of its own
            out("## Targets")
            out()
            table(["what", "measured", "target", ""], rows)
    finally:
        _setup.teardown(cfg, False, notes)
        for note in notes:
            out(f"- note: {note}")
        out(f"\nTotal time {time.monotonic() - t_begin:.0f} s, load at end {load()}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
