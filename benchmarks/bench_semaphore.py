#!/usr/bin/env python3
"""Counting semaphores next to locks, on every engine reachable.

    python3 benchmarks/bench_semaphore.py            # full run, about two minutes
    python3 benchmarks/bench_semaphore.py --quick    # fewer iterations

Prints markdown tables, then the targets with PASS/MISS (a miss never fails the run):

1. uncontended acquire+release, µs per pair, per engine: a ``limit=5`` semaphore
   with 0 and with 3 of its slots held by others, next to a lock of the same
   backend, interleaved in one run; target: the semaphore (0 held) <= 1.3x the lock;
2. 8 processes x N acquisitions of a ``limit=3`` semaphore, each holding its slot
   for a 5 ms sleep (a sleep, not a busy loop: three holders must be able to
   progress at once on a 2-core machine): ideal wall time (N x 8 x 5 ms / 3) over
   the measured one; the most holders ever seen at once (a shared counter); target:
   >= 0.75 of ideal, never more than 3 inside. The same with ``limit=1`` (a mutex,
   a third of the acquisitions) shows what the engine's handoff alone costs. Where
   the time goes: per slot, the ms from a holder calling release() to the next
   holder's acquire() returning (p50/p90/p99), and the share of that time spent in
   gaps over 10 ms (a slot left free while others wait on other slots, rather than
   handed over).
"""

import argparse
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup
from bench_core import (
    check,
    fmt,
    gather,
    interleaved,
    load,
    median,
    out,
    pct,
    run_header,
    table,
    verdict,
)

TTL = 30
LIMIT = 5
HOLD_S = 0.005
PROCS, SEM_LIMIT = 8, 3
TARGETS = {"ratio": 1.3, "efficiency": 0.75}
#: A slot handoff longer than this (ms) is counted as the slot sitting free (nobody
#: queued on it was woken), not as the cost of a handoff.
IDLE_MS = 10


def backends(cfg):
    """(label, alias) of every engine of this run."""
    found = [(engine, engine) for engine in cfg["engines"]]
    if cfg.get("redis_url"):
        found.append(("redis", "redis"))
    return found


# -- 1. uncontended -------------------------------------------------------------------


def variants(cfg, alias):
    from django_setnx import lock, semaphore

    np = cfg["name_prefix"]
    full = semaphore(f"{np}:s:busy:{alias}", LIMIT, ttl=TTL * 10, backend=alias)
    others = [semaphore(full.name, LIMIT, ttl=TTL * 10, backend=alias) for _ in range(3)]
    for other in others:
        check(other.acquire(blocking=False), "semaphore acquire (the others' slots)")

    def a_lock():
        lk = lock(f"{np}:s:lock:{alias}", ttl=TTL, backend=alias)
        check(lk.acquire(blocking=False), "lock acquire")
        lk.release()

    def a_semaphore():
        sem = semaphore(f"{np}:s:free:{alias}", LIMIT, ttl=TTL, backend=alias)
        check(sem.acquire(blocking=False), "semaphore acquire")
        sem.release()

    def a_busy_semaphore():
        sem = semaphore(full.name, LIMIT, ttl=TTL, backend=alias)
        check(sem.acquire(blocking=False), "semaphore acquire (3 of 5 held)")
        sem.release()

    return {
        "lock": a_lock,
        f"semaphore limit={LIMIT}": a_semaphore,
        f"semaphore limit={LIMIT}, 3 held by others": a_busy_semaphore,
    }, others


def section_uncontended(cfg, p, results):
    out(f"## 1. Uncontended acquire+release: a lock and a limit={LIMIT} semaphore (µs per pair)")
    out()
    out(f"load average {load()}; {p['blocks']} blocks x {p['per_block']} rounds, interleaved")
    out()
    rows = []
    for label, alias in backends(cfg):
        fns, others = variants(cfg, alias)
        try:
            samples, _cpu = interleaved(fns, p["blocks"], p["per_block"], p["warmup"])
        finally:
            for other in others:
                other.release()
        lock_median = median(samples["lock"])
        for variant, values in samples.items():
            values.sort()
            ratio = median(values) / lock_median
            rows.append(
                [
                    label,
                    variant,
                    fmt(median(values) / 1000),
                    fmt(pct(values, 99) / 1000),
                    f"{ratio:.2f}x",
                ]
            )
        results.setdefault("ratio", {})[label] = (
            median(samples[f"semaphore limit={LIMIT}"]) / lock_median
        )
    table(["engine", "what", "p50 µs", "p99 µs", "÷ lock p50"], rows)
    out()


# -- 2. throughput ----------------------------------------------------------------------


def throughput_worker(cfg, alias, name, limit, n, inside, peak, guard, barrier, results, idx):
    try:
        _setup.configure(cfg)
        from django_setnx import semaphore

        warm = semaphore(f"{name}:warm{idx}", limit, ttl=TTL, backend=alias)
        check(warm.acquire(timeout=10), "warm-up")  # connect, load scripts
        warm.release()
        sem = semaphore(name, limit, ttl=TTL, backend=alias)
        barrier.wait(timeout=120)
        start = time.perf_counter()
        got = 0
        held = []  # (slot, acquire returned, release called), perf_counter_ns
        for _ in range(n):
            if not sem.acquire(timeout=60):
                continue
            acquired_at = time.perf_counter_ns()
            with guard:
                inside.value += 1
                peak.value = max(peak.value, inside.value)
            time.sleep(HOLD_S)
            with guard:
                inside.value -= 1
            released_at = time.perf_counter_ns()
            sem.release()
            held.append((sem.slot, acquired_at, released_at))
            got += 1
        results.put(("ok", idx, start, time.perf_counter(), got, held))
    except BaseException:  # noqa: BLE001
        results.put(("error", idx, traceback.format_exc()))


def run_throughput(cfg, alias, n, limit):
    ctx = multiprocessing.get_context("spawn")
    name = f"{cfg['name_prefix']}:s:t{limit}:{alias}"
    inside, peak, guard = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False), ctx.Lock()
    barrier, results = ctx.Barrier(PROCS), ctx.Queue()
    workers = [
        ctx.Process(
            target=throughput_worker,
            daemon=True,
            args=(
                _setup.child_config(cfg),
                alias,
                name,
                limit,
                n,
                inside,
                peak,
                guard,
                barrier,
                results,
                i,
            ),
        )
        for i in range(PROCS)
    ]
    for worker in workers:
        worker.start()
    got = gather(workers, results, barrier, time.monotonic() + 300)
    start = min(v[0] for v in got.values())
    end = max(v[1] for v in got.values())
    done = [v[2] for v in got.values()]
    ideal = sum(done) * HOLD_S / limit
    return {
        "wall": end - start,
        "eff": ideal / (end - start),
        "done": done,
        "peak": peak.value,
        "gaps": slot_gaps([h for v in got.values() for h in v[3]]),
    }


def slot_gaps(held):
    """Per slot, ms from a holder calling release() to the next holder's acquire()
    returning (CLOCK_MONOTONIC, shared by the processes): what a slot costs between
    two holders, the handoff and any time it sat free. Sorted."""
    by_slot = {}
    for slot, acquired_at, released_at in held:
        by_slot.setdefault(slot, []).append((acquired_at, released_at))
    gaps = []
    for spans in by_slot.values():
        spans.sort()
        gaps += [(nxt[0] - cur[1]) / 1e6 for cur, nxt in zip(spans, spans[1:])]
    return sorted(gaps)


def section_throughput(cfg, p, results):
    out(
        f"## 2. {PROCS} processes on a limit={SEM_LIMIT} semaphore, {p['n']} acquisitions "
        f"each, {HOLD_S * 1000:g} ms held"
    )
    out()
    out(f"load average {load()}")
    out()
    rows = []
    for label, alias in backends(cfg):
        for limit, n in ((SEM_LIMIT, p["n"]), (1, p["n"] // 3)):
            stats = run_throughput(cfg, alias, n, limit)
            gaps = stats["gaps"]
            rows.append(
                [
                    label,
                    limit,
                    f"{stats['wall']:.2f}",
                    f"{stats['eff']:.2f}",
                    f"{min(stats['done'])}-{max(stats['done'])}",
                    stats["peak"],
                    f"{pct(gaps, 50):.2f} / {pct(gaps, 90):.2f} / {pct(gaps, 99):.2f}",
                    f"{sum(g for g in gaps if g > IDLE_MS) / max(sum(gaps), 1e-9):.0%}",
                ]
            )
            if limit == SEM_LIMIT:
                results.setdefault("efficiency", {})[label] = stats["eff"]
                results.setdefault("peak", {})[label] = stats["peak"]
    table(
        [
            "engine",
            "limit",
            "wall s",
            "ideal / wall",
            "acquisitions per process",
            "most inside",
            "slot handoff p50 / p90 / p99 ms",
            f"of it in gaps > {IDLE_MS:g} ms",
        ],
        rows,
    )
    out()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--sections", default="1,2", help="comma list (default 1,2)")
    args = parser.parse_args()
    sections = {s.strip() for s in args.sections.split(",")}
    if args.quick:
        p = {"warmup": 50, "blocks": 6, "per_block": 50, "n": 40}
    else:
        p = {"warmup": 200, "blocks": 20, "per_block": 100, "n": 100}
    notes = []
    cfg = _setup.prepare(notes)
    results = {}
    try:
        _setup.configure(cfg)
        _setup.migrate(cfg, notes)
        run_header(
            "django-setnx: semaphores",
            f"engines: {', '.join(label for label, _ in backends(cfg))}",
            p,
        )
        if "1" in sections:
            section_uncontended(cfg, p, results)
        if "2" in sections:
            section_throughput(cfg, p, results)
        rows = []
        for label, ratio in results.get("ratio", {}).items():
            rows.append(
                [
                    f"{label}: semaphore limit={LIMIT} / lock, medians",
                    f"{ratio:.2f}x",
                    f"<= {TARGETS['ratio']}x",
                    verdict(ratio <= TARGETS["ratio"]),
                ]
            )
        for label, eff in results.get("efficiency", {}).items():
            peak = results["peak"][label]
            rows.append(
                [
                    f"{label}: {PROCS} processes on limit={SEM_LIMIT}, ideal / wall",
                    f"{eff:.2f}",
                    f">= {TARGETS['efficiency']}",
                    verdict(eff >= TARGETS["efficiency"] and peak <= SEM_LIMIT),
                ]
            )
        out("## Targets")
        out()
        table(["what", "measured", "target", ""], rows)
    finally:
        _setup.teardown(cfg, False, notes)
        for note in notes:
            out(f"- note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
