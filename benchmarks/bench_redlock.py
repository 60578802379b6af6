"""Uncontended acquire + release on Redlock with 3 masters, next to the floor and pottery.

    python3 benchmarks/bench_redlock.py [--ops 2000] [--rounds 10] [--compare-backend PATH ...]

Starts three throwaway ``redis-server`` masters on 127.0.0.1 (``tests/servers.py``),
stopped again at the end, and times, in one run and interleaved round by round (so
a noisy machine hurts every contestant alike):

- **floor**: raw redis-py on *one* of those servers: ``SET key token NX PX ttl`` +
  an ``EVALSHA`` compare-and-delete (the classic single-instance lock, two round
  trips);
- **reference**: the floor's two commands sent to all three servers in parallel over
  raw sockets (hiredis): the least any 3-master lock costs on this machine. On one
  small host this is CPU-bound (each write wakes a server process that competes
  for the same cores), not latency-bound as across a network;
- **reference, our scripts**: the same raw sockets sending our own two scripts
  (the node's ``ACQUIRE`` and ``RELEASE``, with the backend's keys and arguments,
  precomputed): what our Lua costs the servers over the floor's two commands. The
  rest of the gap, up to "backend alone", is our Python and socket handling;
- **django-setnx Redlock (Lock API)**: ``lock(name, backend="redlock")`` then
  ``.acquire()`` and ``.release()`` — what an application calls (token, owner
  record, signals included);
- **django-setnx Redlock (backend)**: ``RedlockBackend.acquire`` / ``.release``;
- **pottery Redlock**: ``pottery.Redlock(key=..., masters={3 clients},
  auto_release_time=...)`` ``.acquire()`` / ``.release()`` (skipped if pottery is not
  installed: ``pip install pottery``);
- with ``--compare-backend dotted.path.Class`` (repeatable): that backend class on the
  same three masters, through the Lock API and alone (to compare other
  implementations of Redlock, e.g. an older one copied into an importable module,
  in the same run).

Every Redlock contestant talks to all three masters per operation. Prints a
markdown table of median and p99 microseconds per acquire+release and the ratio
to the floor. Targets: django-setnx Redlock <= 1.5x the floor, faster than pottery.
"""

import argparse
import os
import secrets
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TTL = 10  # seconds; never reached: every lock is released at once
TARGET_RATIO = 1.5

COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def configure(urls, key_prefix, compare_backends=()):
    import django
    from django.conf import settings

    aliases = {
        "default": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend"},
        "redlock": {
            "BACKEND": "django_setnx.backends.redlock.RedlockBackend",
            "LOCATION": list(urls),
            "KEY_PREFIX": key_prefix,
            "TTL": TTL,
        },
    }
    for number, path in enumerate(compare_backends, 1):
        aliases[f"compare{number}"] = {**aliases["redlock"], "BACKEND": path}
    settings.configure(
        DEBUG=False,
        SECRET_KEY="django-setnx-benchmarks",
        USE_TZ=True,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_setnx"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        SETNX_LOCKS=aliases,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        LOGGING_CONFIG=None,
    )
    django.setup()


def _lock_api_op(alias, name):
    from django_setnx import lock

    def op():
        lk = lock(name, backend=alias)
        ok = lk.acquire(blocking=False)
        lk.release()
        return ok

    return op


def _backend_op(backend, name, owner):
    def op():
        token = secrets.token_hex(16)
        ok = backend.acquire(name, token, TTL, owner).acquired
        backend.release(name, token)
        return ok

    return op


def contestants(urls, run_id):
    """``{label: op}``; ``op()`` does one acquire + release and returns True if the
    acquire succeeded."""
    import redis
    from django.conf import settings

    from django_setnx import locks

    backend_paths = {alias: params["BACKEND"] for alias, params in settings.SETNX_LOCKS.items()}

    out = {}

    # floor: one server, SET NX PX + EVALSHA compare-and-delete.
    floor_client = redis.Redis.from_url(urls[0])
    cad = floor_client.register_script(COMPARE_AND_DELETE)
    floor_key = f"bench-floor-{run_id}"
    ttl_ms = TTL * 1000

    def floor():
        token = secrets.token_hex(16)
        ok = floor_client.set(floor_key, token, nx=True, px=ttl_ms)
        cad(keys=[floor_key], args=[token])
        return bool(ok)

    out["floor: redis-py SET NX PX + EVALSHA delete (1 server)"] = floor

    # Reference: the least any 3-master lock can cost on this machine, the floor's
    # two commands sent to the three servers in parallel over raw sockets (hiredis).
    raw = _raw_parallel(urls, run_id)
    if raw is not None:
        out["reference: floor's 2 commands on 3 servers in parallel (raw sockets)"] = raw
        ours = _raw_parallel_our_scripts(urls, run_id, locks["redlock"])
        out["reference: our 2 scripts on 3 servers in parallel (raw sockets)"] = ours

    owner = {"host": "bench", "pid": os.getpid(), "thread": "main"}
    for alias, path in backend_paths.items():
        if alias == "default":
            continue
        label = "django-setnx Redlock" if alias == "redlock" else f"compare: {path}"
        out[f"{label}, Lock API (3 masters)"] = _lock_api_op(alias, f"bench-api-{alias}-{run_id}")
        out[f"{label}, backend alone (3 masters)"] = _backend_op(
            locks[alias], f"bench-backend-{alias}-{run_id}", owner
        )

    try:
        import pottery
    except ImportError:
        pottery = None
    if pottery is not None:
        masters = {redis.Redis.from_url(url) for url in urls}
        pottery_key = f"bench-pottery-{run_id}"

        def pottery_op():
            rl = pottery.Redlock(key=pottery_key, masters=masters, auto_release_time=TTL)
            ok = rl.acquire(blocking=False)
            rl.release()
            return ok

        from importlib.metadata import version

        out[f"pottery {version('pottery')} Redlock (3 masters)"] = pottery_op
    return out


def _raw_sockets(urls, scripts):
    """``(round_trip, shas)`` over one raw hiredis socket per server (None without
    hiredis): ``round_trip(packed)`` writes ``packed`` to every server, then reads one
    reply from each. ``scripts`` are loaded on every server first."""
    try:
        import hiredis
    except ImportError:
        return None
    import socket
    from urllib.parse import urlsplit

    import redis

    pairs = []
    shas = []
    for url in urls:
        parts = urlsplit(url)
        client = redis.Redis(host=parts.hostname, port=parts.port)
        shas = [client.script_load(script) for script in scripts]
        sock = socket.create_connection((parts.hostname, parts.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pairs.append((sock, hiredis.Reader()))

    def round_trip(command):
        for sock, _ in pairs:
            sock.sendall(command)
        replies = []
        for sock, reader in pairs:
            reply = reader.gets()
            while reply is False:
                reader.feed(sock.recv(65536))
                reply = reader.gets()
            replies.append(reply)
        return replies

    return round_trip, shas


def _raw_parallel(urls, run_id):
    sockets = _raw_sockets(urls, [COMPARE_AND_DELETE])
    if sockets is None:
        return None
    import hiredis

    round_trip, (sha,) = sockets
    key = f"bench-raw-{run_id}"
    ttl_ms = TTL * 1000

    def op():
        token = secrets.token_hex(16)
        ok = round_trip(hiredis.pack_command(("SET", key, token, "NX", "PX", ttl_ms)))
        round_trip(hiredis.pack_command(("EVALSHA", sha, 1, key, token)))
        return all(r == b"OK" for r in ok)

    return op


def _raw_parallel_our_scripts(urls, run_id, backend):
    """Our node scripts, with the keys and arguments ``backend`` would send."""
    import hiredis

    from django_setnx.backends.base import encode_owner
    from django_setnx.backends.redis_scripts import RELEASE
    from django_setnx.backends.redlock import NODE_ACQUIRE

    round_trip, (acquire_sha, release_sha) = _raw_sockets(urls, [NODE_ACQUIRE, RELEASE])
    keys = backend._keys(f"bench-raw-ours-{run_id}")
    owner = encode_owner({"host": "bench", "pid": os.getpid(), "thread": "main"})
    ttl_ms = TTL * 1000

    def op():
        token = secrets.token_hex(16)
        acquire = (token, ttl_ms, owner, backend.retention_ms, 0, backend.max_ttl_ms)
        won = round_trip(
            hiredis.pack_command(
                ("EVALSHA", acquire_sha, len(keys) + 1, *keys, backend.marker_key, *acquire)
            )
        )
        release = (token, backend.retention_ms, 1000, backend.fence_ms, "")
        round_trip(hiredis.pack_command(("EVALSHA", release_sha, len(keys), *keys, *release)))
        return all(reply[0] == 1 for reply in won)

    return op


def measure(ops, rounds, urls, run_id, warmup=200):
    funcs = contestants(urls, run_id)
    samples = {label: [] for label in funcs}
    for label, fn in funcs.items():
        for _ in range(warmup):
            if not fn():
                raise RuntimeError(f"{label}: an uncontended acquire failed")
    perf = time.perf_counter_ns
    for _ in range(rounds):
        for label, fn in funcs.items():
            bucket = samples[label]
            for _ in range(ops):
                t0 = perf()
                ok = fn()
                bucket.append(perf() - t0)
                if not ok:
                    raise RuntimeError(f"{label}: an uncontended acquire failed")
    return samples


def p99(values):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def table(samples):
    labels = list(samples)
    floor_median = statistics.median(samples[labels[0]])
    lines = [
        "| contestant | median µs | p99 µs | median × floor |",
        "|---|---:|---:|---:|",
    ]
    for label in labels:
        median = statistics.median(samples[label])
        lines.append(
            f"| {label} | {median / 1000:.1f} | {p99(samples[label]) / 1000:.1f} | "
            f"{median / floor_median:.2f}× |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="acquire+release per round")
    parser.add_argument(
        "--rounds", type=int, default=10, help="rounds; the contestants take turns every round"
    )
    parser.add_argument(
        "--compare-backend",
        metavar="PATH",
        action="append",
        default=[],
        dest="compare_backends",
        help="also time this Redlock backend class (dotted path) on the same masters (repeatable)",
    )
    args = parser.parse_args(argv)

    from tests.servers import RedisMasterSet

    run_id = uuid.uuid4().hex[:8]
    key_prefix = f"setnx-bench-{run_id}"
    with RedisMasterSet(3) as masters:
        configure(masters.urls, key_prefix, args.compare_backends)
        from django_setnx import locks

        locks["redlock"].trust_nodes()  # brand-new masters: no lock can be held yet
        started = time.monotonic()
        samples = measure(args.ops, args.rounds, masters.urls, run_id)
        elapsed = time.monotonic() - started
        locks.close_all()

    print(
        f"Uncontended acquire + release, {args.rounds} rounds x {args.ops} ops per "
        f"contestant, interleaved ({elapsed:.1f} s; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs).\n"
    )
    print(table(samples))
    labels = list(samples)
    floor = statistics.median(samples[labels[0]])
    ours = statistics.median(samples["django-setnx Redlock, Lock API (3 masters)"])
    met = "OK" if ours / floor <= TARGET_RATIO else "MISSED"
    verdicts = [
        (
            f"\ndjango-setnx Redlock (Lock API) / floor = {ours / floor:.2f}× "
            f"(target <= {TARGET_RATIO}×): {met}"
        )
    ]
    peer = [label for label in labels if label.startswith("pottery")]
    if peer:
        theirs = statistics.median(samples[peer[0]])
        verdicts.append(
            f"pottery / django-setnx Redlock = {theirs / ours:.2f}× "
            f"({'faster than pottery' if ours < theirs else 'NOT faster than pottery'})"
        )
    else:
        verdicts.append("pottery not installed: pip install pottery")
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
