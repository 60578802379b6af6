"""Redlock: one lock over N independent Redis masters, granted by a majority.

Settings::

    "redlock": {
        "BACKEND": "django_setnx.backends.redlock.RedlockBackend",
        "LOCATION": [                       # N >= 3 independent masters; odd N recommended
            "redis://10.0.0.1:6379/0",
            "redis://10.0.0.2:6379/0",
            "redis://10.0.0.3:6379/0",
        ],
        "KEY_PREFIX": "setnx",
        "TTL": 60,
        "OPTIONS": {
            "NODE_TIMEOUT": 0.1,         # seconds one round waits for the nodes' replies
            "CLOCK_DRIFT_FACTOR": 0.01,  # drift allowance: ttl * factor + 2 ms
            "MAX_TTL": 3600,             # longest ttl; also how long a restarted node sits out
            "STALE_RETENTION": 86400,    # seconds an expired record stays visible as stale
            "CONNECTION_KWARGS": {},     # for every node's redis.Redis.from_url
        },
    }

The algorithm (antirez' Redlock, with the refinements below):

- **Acquire** mints one token and sends the Redis backend's own ``ACQUIRE`` script
  (same keys ``P:{N}:lock``/``P:{N}:fence``, same Lua, imported from
  :mod:`django_setnx.backends.redis`) to every node *in parallel*: one connection per
  node, every request written before any reply is read, so a round costs one network
  round trip however many nodes there are. A node that has not replied within
  ``NODE_TIMEOUT`` counts as a no. The lock is won only if a majority
  (``N // 2 + 1``) granted it **and** its validity ``ttl - elapsed - drift`` (drift =
  ``ttl * CLOCK_DRIFT_FACTOR + 2 ms``) is still positive; otherwise every node that
  may have granted it is asked to release it, and the attempt reports contention
  (``retry_after`` = the smallest remainder a holder's node reported). The
  :class:`~django_setnx.locking.Lock` object retries with jittered backoff.
- **Release** goes to every node in parallel; it succeeded when a majority deleted
  our token. **Extend** needs a majority within the validity too, else it returns
  False (the Lock raises ``LockNotOwned`` and marks the lock lost) after releasing
  what is left of it. ``owns`` needs a majority; ``get``/``list`` show the majority
  view; ``delete``/``clear`` act on every node.
- **Failure reporting**: when not one node answered, operations raise
  ``LockBackendError``. When some answered but no majority granted, ``acquire``
  reports contention (``acquire()`` returns False, ``with lock(...)`` raises
  ``LockNotAcquired`` once its timeout is spent).

**Fencing tokens** strictly increase as long as the nodes keep their data: each node ``INCR``\\ s its own counter and the token is the largest value among
the nodes that granted. If the granting nodes returned different values, a second
parallel round raises each granting node's counter (and record) to the token before
the acquire returns, and the lock is only won if a majority confirm it. So after
every acquire a majority of nodes count at least the token; any later majority
shares at least one node with it (two majorities of the same N always intersect),
and that node's ``INCR`` is larger than the token — hence the next token is too.
(A node restarted empty rejoins with its counters at zero; a token can then only go
backwards if the next majority holds no node that counted the latest one.)

**Delayed restarts.** A master that restarts without its data (no persistence, or
``appendfsync`` that lost the last writes) forgets the locks it granted, so the
holder's majority may shrink to a minority while another client gathers a new
majority with the amnesiac node's help: two holders. Hence every node carries a
marker key ``P:__node__`` holding ``trusted_after`` (ms, by that node's own clock).
The first client that finds it missing — a fresh or restarted-empty node — sets it
to ``node_now + MAX_TTL``; until then the node's grants count as a **no** (and are
released at once), though it still receives releases. Every lock it may have
forgotten had a ttl <= ``MAX_TTL`` (larger ttls raise ``ValueError``), so by then
they have all expired. The rule lives on the node and uses the node's clock, so
every client honours it, whichever client noticed the restart. A node that restarts
*with* its data (AOF with ``appendfsync always``) keeps its marker and is trusted at
once. A brand-new set has no markers either: after deploying fresh masters (when
no lock can be held yet), call :meth:`RedlockBackend.trust_nodes` once, or wait
``MAX_TTL``. ``list`` and ``clear`` never see the marker (it is not a lock key).

Limits (see the README, "Scaling out"): Redlock assumes bounded clock drift and
process pauses shorter than the validity; a holder paused past its ttl loses the
lock without knowing, which only fencing tokens checked by the protected resource
can catch.
"""

import hashlib
import inspect
import json
import logging
import math
import numbers
import select
import threading
import time
from dataclasses import replace

from django.core import checks

from ..exceptions import LockBackendError
from ..validation import ttl_to_ms
from .base import STATES, AcquireResult, BaseLockBackend, ClearResult, LockInfo
from .redis import (
    ACQUIRE,
    CLEAR,
    DEFAULT_KEY_PREFIX,
    DEFAULT_STALE_RETENTION,
    DELETE,
    EXTEND,
    GET,
    OWNS,
    RELEASE,
    SCAN_COUNT,
    _escape_glob,
    _owner_json,
    _text,
    lock_keys,
    name_from_lock_key,
    require_redis_py,
)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.exceptions import NoScriptError
    from redis.retry import Retry
except ImportError:  # reported by check_params (E030) and on first use
    redis = None

logger = logging.getLogger("django_setnx")

DEFAULT_NODE_TIMEOUT = 0.1
DEFAULT_CLOCK_DRIFT_FACTOR = 0.01
DEFAULT_MAX_TTL = 3600
#: Fixed part of the drift allowance, in ms (Redis' PX resolution and TIME rounding).
DRIFT_MS = 2
#: Seconds a batch round of list/clear may take (many scripts per node).
BATCH_TIMEOUT = 10.0
MARKER_SUFFIX = "__node__"
OPTION_NAMES = {"NODE_TIMEOUT", "CLOCK_DRIFT_FACTOR", "MAX_TTL", "STALE_RETENTION",
                "CONNECTION_KWARGS"}
#: Seconds between two warnings about the same untrusted node.
WARN_EVERY = 60.0

# KEYS: marker. ARGV: max_ttl_ms. Creates a missing marker (a fresh or restarted-empty
# node) as "trusted after node_now + max_ttl". Returns the ms until the node is
# trusted (<= 0: trusted now).
NODE_CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local after = tonumber(redis.call('GET', KEYS[1]))
if not after then
  after = now + tonumber(ARGV[1])
  redis.call('SET', KEYS[1], after)
end
return after - now
"""

# KEYS: marker. Marks the node trusted now (trust_nodes: a brand-new set). Returns 1.
TRUST = """
local t = redis.call('TIME')
redis.call('SET', KEYS[1], tonumber(t[1]) * 1000 - 1)
return 1
"""

# KEYS: lock, fence. ARGV: token, fencing. Raises the fence counter to at least
# ``fencing`` and, if the record is still ours, sets its fencing field to it.
# Returns 1 if the record still carries our token, else 0.
RAISE_FENCE = """
local fencing = tonumber(ARGV[2])
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current < fencing then
  redis.call('SET', KEYS[2], fencing)
end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'fencing', fencing)
return 1
"""


class _Script:
    __slots__ = ("sha", "text")

    def __init__(self, text):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


_ACQUIRE, _RELEASE, _EXTEND, _OWNS, _GET, _DELETE, _CLEAR = (
    _Script(s) for s in (ACQUIRE, RELEASE, EXTEND, OWNS, GET, DELETE, CLEAR)
)
_NODE_CHECK, _TRUST, _RAISE_FENCE = (_Script(s) for s in (NODE_CHECK, TRUST, RAISE_FENCE))
_ALL_SCRIPTS = (_ACQUIRE, _RELEASE, _EXTEND, _OWNS, _GET, _DELETE, _CLEAR, _NODE_CHECK,
                _TRUST, _RAISE_FENCE)


if redis is not None:
    try:
        import hiredis
    except ImportError:
        hiredis = None
    #: redis-py >= 5.1 reads a reply with a per-call timeout.
    _READ_TIMEOUT = "timeout" in inspect.signature(
        redis.connection.Connection.read_response).parameters


def _read(conn, deadline):
    """One reply from ``conn`` through redis-py, waiting until ``deadline``
    (monotonic) at most (the path without hiredis, or over TLS)."""
    timeout = max(deadline - time.monotonic(), 0.0001)
    if _READ_TIMEOUT:
        return conn.read_response(timeout=timeout)
    if not conn.can_read(timeout=timeout):
        raise redis.exceptions.TimeoutError(f"no reply within {timeout:g} s")
    return conn.read_response()


def _readable_fds(fds, timeout):
    """The subset of ``fds`` with data (or EOF) to read, waiting ``timeout`` s at most."""
    if hasattr(select, "poll"):
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        return {fd for fd, _ in poller.poll(max(timeout, 0) * 1000)}
    return set(select.select(list(fds), [], [], max(timeout, 0))[0])


def _send_all(sock, data, deadline):
    """Write ``data`` to a non-blocking socket by ``deadline`` (one ``send`` usually)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            pass
        if view:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [sock], [], remaining)[1]:
                raise redis.exceptions.TimeoutError("could not write the request in time")


def _preload(conn):
    """Cache every script on a freshly connected server (one pipelined round trip),
    so no NOSCRIPT fallback lands inside a lock's validity window."""
    conn.send_packed_command(conn.pack_commands([("SCRIPT", "LOAD", s.text)
                                                 for s in _ALL_SCRIPTS]), check_health=False)
    for _ in _ALL_SCRIPTS:
        conn.read_response()


def _ready(conn, fast):
    """Connect ``conn`` if it is not (caching the scripts). On the fast path its
    socket then turns non-blocking and gets a hiredis reader of our own: the
    rounds run on the socket that redis-py connected and authenticated."""
    if getattr(conn, "_sock", None) is not None:
        return
    conn.connect()
    _preload(conn)
    if fast:
        conn._sock.setblocking(False)
        conn.__dict__["_setnx_wire"] = (conn._sock, hiredis.Reader(), bytearray(65536))


class _Results(dict):
    """``{node index: replies or _NodeFailed}`` of one round, and when it started
    (monotonic seconds, taken just before the first request was written)."""

    started = None


class _NodeFailed(Exception):
    """A node did not answer (down, timed out, or replied with an error)."""


def _is_number(value, *, minimum=0.0, inclusive=False):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value >= minimum if inclusive else value > minimum


class _Node:
    """One master: a client (SCAN, pipelines, EVAL fallbacks) and a stack of idle
    connections for the parallel rounds (checked out one per round, without the
    pool's per-checkout health probe: a broken one fails the round for its node
    and is dropped)."""

    def __init__(self, url, kwargs, node_timeout):
        self.url = url
        self.client = redis.Redis.from_url(url, **kwargs)
        self.pool = self.client.connection_pool
        ck = self.pool.connection_kwargs
        self.label = ck.get("path") or f"{ck.get('host', '?')}:{ck.get('port', '?')}"
        # A node that accepts connections but does not answer must not hold a round
        # up for longer than NODE_TIMEOUT per new connection either.
        self._round_kwargs = {**ck, "socket_timeout": node_timeout,
                              "socket_connect_timeout": node_timeout}
        self.warned_at = None
        self._idle = []

    def __repr__(self):
        return f"<node {self.label}>"

    def take(self):
        try:
            return self._idle.pop()  # list.pop/append are atomic: thread-safe
        except IndexError:
            return self.pool.connection_class(**self._round_kwargs)

    def give_back(self, conn):
        self._idle.append(conn)

    def close(self):
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()
        self.client.close()


class RedlockBackend(BaseLockBackend):
    """Locks granted by a majority of N independent Redis masters (Redlock)."""

    wakes_waiters = False

    def __init__(self, alias, params):
        super().__init__(alias, params)
        require_redis_py(alias, "Redlock")
        location = params.get("LOCATION")
        if isinstance(location, str) or not isinstance(location, (list, tuple)) \
                or len(location) < 3:
            from django.core.exceptions import ImproperlyConfigured

            raise ImproperlyConfigured(
                f"SETNX_LOCKS[{alias!r}]['LOCATION'] must be a list of at least 3 redis:// "
                f"URLs of independent masters, got {location!r}."
            )
        self.locations = list(location)
        self.key_prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        opts = self.options
        self.node_timeout = float(opts.get("NODE_TIMEOUT", DEFAULT_NODE_TIMEOUT))
        self.drift_factor = float(opts.get("CLOCK_DRIFT_FACTOR", DEFAULT_CLOCK_DRIFT_FACTOR))
        self.max_ttl = float(opts.get("MAX_TTL", DEFAULT_MAX_TTL))
        self.max_ttl_ms = ttl_to_ms(self.max_ttl)
        self.retention_ms = ttl_to_ms(opts.get("STALE_RETENTION", DEFAULT_STALE_RETENTION))
        if self.default_ttl > self.max_ttl:
            from django.core.exceptions import ImproperlyConfigured

            raise ImproperlyConfigured(
                f"SETNX_LOCKS[{alias!r}]['TTL'] = {self.default_ttl:g} s is above "
                f"OPTIONS['MAX_TTL'] = {self.max_ttl:g} s."
            )
        self.quorum = len(self.locations) // 2 + 1
        self.marker_key = f"{self.key_prefix}:{MARKER_SUFFIX}"
        self._match_head = _escape_glob(self.key_prefix) + ":{"
        self._errors = (redis.exceptions.RedisError, OSError)
        self._nodes = None
        self._fast = False
        self._nodes_lock = threading.Lock()

    def __repr__(self):
        return f"<RedlockBackend alias={self.alias!r} nodes={len(self.locations)}>"

    # -- configuration ------------------------------------------------------------

    @classmethod
    def check_params(cls, alias, params):
        """Return ``checks`` messages (ids ``django_setnx.E030``-``E039``, ``W030``)
        for this alias' settings. Never connects."""
        where = f"SETNX_LOCKS[{alias!r}]"
        errors = []

        def error(id_, msg, hint=None):
            errors.append(checks.Error(msg, hint=hint, id=f"django_setnx.{id_}"))

        if redis is None:
            error("E030", f"{where} uses the Redlock backend, but redis-py is not installed.",
                  hint="pip install django-setnx[redis]")
        location = params.get("LOCATION")
        if isinstance(location, str) or not isinstance(location, (list, tuple)) or not all(
                isinstance(url, str) and url for url in location):
            error("E031", f"{where}['LOCATION'] must be a list of redis:// URLs (one per "
                          f"independent master), got {location!r}.",
                  hint='Example: ["redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0", '
                       '"redis://10.0.0.3:6379/0"]')
        else:
            if len(location) < 3:
                error("E032", f"{where}['LOCATION'] lists {len(location)} master(s); Redlock "
                              f"needs at least 3 (a majority of 1 or 2 tolerates no failure).")
            duplicates = sorted({url for url in location if list(location).count(url) > 1})
            if duplicates:
                error("E033", f"{where}['LOCATION'] lists {duplicates} more than once; every "
                              f"entry must be a different, independent master.")
            if len(location) >= 3 and len(location) % 2 == 0:
                errors.append(checks.Warning(
                    f"{where}['LOCATION'] lists an even number of masters ({len(location)}); "
                    f"an odd number tolerates as many failures with one node fewer.",
                    id="django_setnx.W030"))
        prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        if not isinstance(prefix, str) or not prefix:
            error("E034", f"{where}['KEY_PREFIX'] must be a non-empty str, got {prefix!r}.")
        options = params.get("OPTIONS")
        options = {} if options is None else options
        if not isinstance(options, dict):
            error("E039", f"{where}['OPTIONS'] must be a dict, got {options!r}.")
            return errors
        for option in ("NODE_TIMEOUT", "MAX_TTL", "STALE_RETENTION"):
            if option in options and not _is_number(options[option]):
                error("E035", f"{where}['OPTIONS']['{option}'] must be a positive number of "
                              f"seconds, got {options[option]!r}.")
        factor = options.get("CLOCK_DRIFT_FACTOR", DEFAULT_CLOCK_DRIFT_FACTOR)
        if not _is_number(factor, inclusive=True) or factor >= 1:
            error("E036", f"{where}['OPTIONS']['CLOCK_DRIFT_FACTOR'] must be a number in "
                          f"[0, 1), got {factor!r}.")
        kwargs = options.get("CONNECTION_KWARGS")
        if kwargs is not None and not isinstance(kwargs, dict):
            error("E037", f"{where}['OPTIONS']['CONNECTION_KWARGS'] must be a dict, got "
                          f"{kwargs!r}.")
        max_ttl = options.get("MAX_TTL", DEFAULT_MAX_TTL)
        ttl = params.get("TTL")
        if _is_number(max_ttl) and _is_number(ttl) and ttl > max_ttl:
            error("E038", f"{where}['TTL'] = {ttl!r} s is above OPTIONS['MAX_TTL'] = "
                          f"{max_ttl!r} s.",
                  hint="MAX_TTL bounds every ttl and is how long a restarted node sits out.")
        unknown = sorted(set(options) - OPTION_NAMES)
        if unknown:
            error("E039", f"{where}['OPTIONS'] has unknown keys {unknown}.",
                  hint=f"Known options: {sorted(OPTION_NAMES)}.")
        return errors

    # -- connections --------------------------------------------------------------

    @property
    def nodes(self):
        """The lazily created per-node clients, shared by every thread."""
        nodes = self._nodes
        if nodes is None:
            with self._nodes_lock:
                nodes = self._nodes
                if nodes is None:
                    kwargs = {
                        # For SCAN batches and EVAL fallbacks; the rounds' connections
                        # wait NODE_TIMEOUT at most (see _Node and _round).
                        "socket_timeout": max(1.0, self.node_timeout * 4),
                        "socket_connect_timeout": max(1.0, self.node_timeout * 4),
                        # A retried command would be invisible to the quorum logic.
                        "retry": Retry(NoBackoff(), 0),
                        **self.options.get("CONNECTION_KWARGS", {}),
                    }
                    nodes = [_Node(url, kwargs, self.node_timeout) for url in self.locations]
                    # The fast path needs hiredis and plain sockets (TLS sockets
                    # buffer decrypted data that poll() cannot see).
                    self._fast = hiredis is not None and not any(
                        issubclass(node.pool.connection_class, redis.connection.SSLConnection)
                        for node in nodes)
                    self._nodes = nodes
        return nodes

    def close(self):
        with self._nodes_lock:
            nodes, self._nodes = self._nodes, None
        for node in nodes or ():
            node.close()

    def _keys(self, name):
        """The single Redis backend's keys: the scripts are shared. Redlock never
        queues waiters, so the waiters and requests keys stay empty on its nodes."""
        return lock_keys(self.key_prefix, name)

    def _name_from_key(self, key):
        return name_from_lock_key(self.key_prefix, key)

    def _check_ttl(self, ttl, action):
        if ttl > self.max_ttl:
            raise ValueError(
                f"Cannot {action} with ttl {ttl:g} s on SETNX_LOCKS[{self.alias!r}]: it is "
                f"above OPTIONS['MAX_TTL'] = {self.max_ttl:g} s."
            )
        return ttl_to_ms(ttl)

    # -- the parallel round -------------------------------------------------------

    def _round(self, calls, timeout=None):
        """Run ``calls`` (``{node index: [(script, keys, args), ...]}``; a plain
        command is ``(None, (command, *args), ())``) on the nodes in parallel and
        return ``{node index: [reply, ...] or _NodeFailed}``.

        Every node's commands are written (pipelined) before any reply is read, then
        the replies are awaited against one deadline, ``timeout`` (default
        ``NODE_TIMEOUT``) after the writes: one network round trip in all. A node
        that is down, too slow or replies with an error fails as a whole; its
        connection is dropped (an unread reply must never reach the next caller).
        The result's ``started`` is taken after connecting, before the first write.
        """
        nodes = self.nodes
        fast = self._fast
        results = _Results()
        taken = []
        for index, node_calls in calls.items():
            node = nodes[index]
            conn = node.take()
            try:
                # Connect (and cache the scripts) before the clock starts: only the
                # requests themselves count against a lock's validity.
                _ready(conn, fast)
            except self._errors as exc:
                self._failed(results, index, node, conn, exc)
                continue
            taken.append((index, node, conn, node_calls))
        # An idle connection has nothing to read: if it has (EOF: the server restarted
        # or closed it), reconnect it now rather than fail the round. One poll for all.
        try:
            stale = _readable_fds([conn._sock.fileno() for _, _, conn, _ in taken], 0)
        except (OSError, ValueError):
            stale = {None}
        if stale:
            for entry in list(taken):
                index, node, conn, _ = entry
                try:
                    if stale == {None} or conn._sock.fileno() in stale:
                        conn.disconnect()
                        _ready(conn, fast)
                except self._errors as exc:
                    taken.remove(entry)
                    self._failed(results, index, node, conn, exc)
        results.started = time.monotonic()
        wait = self.node_timeout if timeout is None else timeout
        if fast:
            retry = self._exchange(taken, results, wait)
        else:
            retry = self._exchange_redis_py(taken, results, wait)
        for index, call_nos in retry.items():
            results[index] = self._eval_on(index, calls[index], call_nos, results[index])
        return results

    def _failed(self, results, index, node, conn, exc):
        conn.disconnect()
        node.give_back(conn)
        results[index] = _NodeFailed(f"{node.label}: {type(exc).__name__}: {exc}")

    def _exchange(self, taken, results, wait):
        """The fast path of _round: hiredis-packed requests written straight to the
        non-blocking sockets, then one poll over all of them until every node's
        replies are in or the deadline passed. Returns ``{node index: [call numbers
        that got NOSCRIPT]}``."""
        pending = {}
        write_deadline = time.monotonic() + wait
        for index, node, conn, node_calls in taken:
            sock, reader, buffer = conn.__dict__["_setnx_wire"]
            data = b"".join(hiredis.pack_command(
                ("EVALSHA", script.sha, len(keys), *keys, *args) if script else keys)
                for script, keys, args in node_calls)
            try:
                _send_all(sock, data, write_deadline)
            except (OSError, redis.exceptions.RedisError) as exc:
                self._failed(results, index, node, conn, exc)
                continue
            pending[sock.fileno()] = (index, node, conn, len(node_calls), sock, reader, buffer,
                                      [])
        deadline = time.monotonic() + wait
        retry = {}
        while pending:
            try:
                ready = _readable_fds(pending, deadline - time.monotonic())
            except (OSError, ValueError) as exc:
                for fd in list(pending):
                    index, node, conn = pending.pop(fd)[:3]
                    self._failed(results, index, node, conn, exc)
                break
            if not ready:
                break  # the deadline passed: whoever has not answered fails below
            for fd in ready:
                index, node, conn, count, sock, reader, buffer, replies = pending[fd]
                try:
                    size = sock.recv_into(buffer)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    del pending[fd]
                    self._failed(results, index, node, conn, exc)
                    continue
                if not size:
                    del pending[fd]
                    self._failed(results, index, node, conn, redis.exceptions.ConnectionError(
                        "the server closed the connection"))
                    continue
                reader.feed(buffer, 0, size)
                while len(replies) < count:
                    reply = reader.gets()
                    if reply is False:
                        break
                    replies.append(reply)
                if len(replies) < count:
                    continue
                del pending[fd]
                node.give_back(conn)
                results[index] = replies
                for call_no, reply in enumerate(replies):
                    if isinstance(reply, hiredis.ReplyError):
                        if str(reply).startswith("NOSCRIPT"):
                            # Not cached there (SCRIPT FLUSH): nothing ran; EVAL below.
                            retry.setdefault(index, []).append(call_no)
                        else:
                            retry.pop(index, None)
                            results[index] = _NodeFailed(f"{node.label}: {reply}")
                            break
        for index, node, conn, *_ in pending.values():
            self._failed(results, index, node, conn, redis.exceptions.TimeoutError(
                f"no reply within {wait:g} s"))
        return retry

    def _exchange_redis_py(self, taken, results, wait):
        """_round through redis-py's connection methods (no hiredis, or TLS)."""
        sent = []
        for index, node, conn, node_calls in taken:
            try:
                conn.send_packed_command(conn.pack_commands([
                    ("EVALSHA", script.sha, len(keys), *keys, *args) if script else keys
                    for script, keys, args in node_calls]), check_health=False)
            except self._errors as exc:
                self._failed(results, index, node, conn, exc)
                continue
            sent.append((index, node, conn, node_calls))
        deadline = time.monotonic() + wait
        retry = {}
        for index, node, conn, node_calls in sent:
            replies = []
            try:
                for call_no in range(len(node_calls)):
                    try:
                        # A reply already received is taken even past the deadline.
                        replies.append(_read(conn, deadline))
                    except NoScriptError:
                        replies.append(None)
                        retry.setdefault(index, []).append(call_no)
            except self._errors as exc:
                retry.pop(index, None)
                self._failed(results, index, node, conn, exc)
            else:
                results[index] = replies
                node.give_back(conn)
        return retry

    def _eval_on(self, index, node_calls, call_nos, replies):
        """Re-run the NOSCRIPT calls ``call_nos`` of one node with EVAL (which also
        caches the scripts there). Rare: once per script per server start."""
        node = self.nodes[index]
        try:
            for call_no in call_nos:
                script, keys, args = node_calls[call_no]
                replies[call_no] = node.client.eval(script.text, len(keys), *keys, *args)
        except self._errors as exc:
            return _NodeFailed(f"{node.label}: {type(exc).__name__}: {exc}")
        return replies

    def _all(self, script, keys, args=()):
        return {index: [(script, keys, args)] for index in range(len(self.locations))}

    def _fail(self, action, results):
        reasons = "; ".join(str(r) for r in results.values() if isinstance(r, _NodeFailed))
        return LockBackendError(self.alias, f"{action} failed: no Redis node answered ({reasons})")

    # -- the atomic operations ----------------------------------------------------

    def acquire(self, name, token, ttl, owner, wait=0.0):
        """Returns ``AcquireResult.won(fencing)`` when a majority granted the lock
        within its validity, else ``.lost(retry_after)``; raises LockBackendError when
        no node answered. ``wait`` is not used (no waiter queue on Redlock)."""
        ttl_ms = self._check_ttl(ttl, "acquire")
        acquire_call = (_ACQUIRE, self._keys(name),
                        (token, ttl_ms, _owner_json(owner), self.retention_ms, 0))
        # The node's marker and clock ride along in the same round (plain commands:
        # cheaper than a script); a node without a marker is created one after.
        batch = [(None, ("GET", self.marker_key), ()), (None, ("TIME",), ()), acquire_call]
        results = self._round({i: batch for i in range(len(self.locations))})
        started = results.started
        granted = {}          # node index -> fencing value
        maybe_ours = []       # nodes that granted or may have: released if we lose
        remainders = []       # ms until expiry, as the holders' nodes report it
        untrusted = {}        # node index -> ms until it votes again
        unmarked = []         # fresh or restarted-empty nodes: given a marker below
        answered = 0
        for index, replies in results.items():
            if isinstance(replies, _NodeFailed):
                maybe_ours.append(index)
                continue
            answered += 1
            marker, (seconds, micros), (won, value) = replies
            if marker is None:
                unmarked.append(index)
                untrusted[index] = self.max_ttl_ms
            else:
                ms = int(marker) - (int(seconds) * 1000 + int(micros) // 1000)
                if ms > 0:
                    untrusted[index] = ms
            if not won:
                remainders.append(int(value))
            elif index in untrusted:
                # Restarted (or new) and within MAX_TTL of it: its grant is a no,
                # and is released below.
                maybe_ours.append(index)
            else:
                granted[index] = int(value)
                maybe_ours.append(index)
        if answered == 0:
            raise self._fail(f"acquire {name!r}", results)
        if unmarked:
            # NODE_CHECK sets "trusted after node_now + MAX_TTL" unless another
            # client just did; either way the node did not vote in this round.
            marked = self._round({i: [(_NODE_CHECK, (self.marker_key,), (self.max_ttl_ms,))]
                                  for i in unmarked})
            for index in unmarked:
                if not isinstance(marked[index], _NodeFailed):
                    untrusted[index] = int(marked[index][0])
        if untrusted:
            self._warn_untrusted(untrusted.items())
            ghosts = [i for i in untrusted if i in maybe_ours]
            if ghosts and len(granted) >= self.quorum:
                self._release_on(name, token, ghosts)
        fencing = max(granted.values()) if granted else None
        if len(granted) >= self.quorum and self._valid(started, ttl_ms) and (
                len(set(granted.values())) == 1
                or self._raise_fence(name, token, fencing, granted, started, ttl_ms)):
            return AcquireResult.won(fencing)
        if maybe_ours:
            self._release_on(name, token, maybe_ours)
        retry_after = min(remainders) / 1000 if remainders else None
        return AcquireResult.lost(retry_after=retry_after)

    def _valid(self, started, ttl_ms):
        """True if the lock has validity left: ttl - elapsed - drift > 0."""
        elapsed_ms = (time.monotonic() - started) * 1000
        return ttl_ms - elapsed_ms - (ttl_ms * self.drift_factor + DRIFT_MS) > 0

    def _raise_fence(self, name, token, fencing, granted, started, ttl_ms):
        """Second round when the granting nodes' counters differ: raise each of them
        to ``fencing`` (the largest), so that a majority counts at least the token
        we return and every later majority, which shares a node with this one, mints
        a larger token. True if a majority confirmed within the validity."""
        lock_key, fence_key = self._keys(name)[:2]
        results = self._round({i: [(_RAISE_FENCE, (lock_key, fence_key), (token, fencing))]
                               for i in granted})
        confirmed = sum(1 for r in results.values()
                        if not isinstance(r, _NodeFailed) and r[0] == 1)
        return confirmed >= self.quorum and self._valid(started, ttl_ms)

    def _release_on(self, name, token, indexes):
        """Best-effort release of ``token`` on ``indexes`` (errors are ignored: the
        records expire with their ttl anyway)."""
        self._round({i: [(_RELEASE, self._keys(name), (token, self.retention_ms, 1000))]
                     for i in indexes})

    def _warn_untrusted(self, untrusted):
        now = time.monotonic()
        for index, ms in untrusted:
            node = self.nodes[index]
            if node.warned_at is None or now - node.warned_at >= WARN_EVERY:
                node.warned_at = now
                logger.warning(
                    "Redlock %r: node %s lost its data (restarted empty, or new) and does "
                    "not vote for %.0f s more (MAX_TTL = %g s, the delayed-restart rule). "
                    "For a brand-new set of masters call locks[%r].trust_nodes() once.",
                    self.alias, node.label, ms / 1000, self.max_ttl, self.alias)

    def _count(self, results):
        """(number of nodes whose single reply is 1, number of nodes that answered)."""
        ok = answered = 0
        for replies in results.values():
            if isinstance(replies, _NodeFailed):
                continue
            answered += 1
            ok += replies[0] == 1
        return ok, answered

    def release(self, name, token):
        """Release on every node. True if a majority held our token and deleted it;
        False if too many nodes answered that it was not ours for a majority to have
        held it; LockBackendError if too few answered to tell."""
        results = self._round(self._all(_RELEASE, self._keys(name),
                                        (token, self.retention_ms, 1000)))
        released, answered = self._count(results)
        if released >= self.quorum:
            return True
        if released + (len(self.locations) - answered) >= self.quorum:
            raise LockBackendError(
                self.alias, f"release {name!r}: only {released} of {len(self.locations)} nodes "
                            f"confirmed it and {len(self.locations) - answered} did not answer; "
                            f"whether a majority held it is unknown ({self._reasons(results)})")
        return False

    def _reasons(self, results):
        return "; ".join(str(r) for r in results.values() if isinstance(r, _NodeFailed)) or "-"

    def extend(self, name, token, ttl):
        """Set the expiry to now + ttl on every node holding our token. True if a
        majority did within the validity; else what is left of the lock is released
        and False returned. LockBackendError if no node answered."""
        ttl_ms = self._check_ttl(ttl, "extend")
        lock_key = self._keys(name)[0]
        results = self._round(self._all(_EXTEND, (lock_key,), (token, ttl_ms, self.retention_ms)))
        started = results.started
        extended, answered = self._count(results)
        if answered == 0:
            raise self._fail(f"extend {name!r}", results)
        if extended >= self.quorum and self._valid(started, ttl_ms):
            return True
        self._release_on(name, token, range(len(self.locations)))
        return False

    def owns(self, name, token):
        """True if a majority of nodes hold ``name`` under ``token``, not expired."""
        results = self._round(self._all(_OWNS, (self._keys(name)[0],), (token,)))
        owned, answered = self._count(results)
        if answered == 0:
            raise self._fail(f"check {name!r}", results)
        return owned >= self.quorum

    # -- records: the majority view ------------------------------------------------

    def _node_info(self, name, now, fields):
        fields = dict(zip(fields[::2], fields[1::2]))
        fields = {_text(k): v for k, v in fields.items()}
        info = LockInfo(
            name=name, backend=self.alias, fencing_token=int(fields["fencing"]),
            owner=json.loads(fields["owner"]), acquired_at_ms=int(fields["acquired"]),
            expires_at_ms=int(fields["expires"]), now_ms=int(now),
        )
        return _text(fields["token"]), info

    def _merge(self, name, replies):
        """One LockInfo from the nodes' ``[now, fields]`` replies, or None.

        The token recorded on most nodes wins. When a majority carry it, the lock is
        reported as its latest-expiring record (held until every one of them has
        expired: a conservative view for waiters). A token on a minority only is
        not a lock anyone holds by the majority rule: it is reported stale (a
        leftover of a failed attempt, or of a holder whose nodes were lost).
        """
        by_token = {}
        for now, fields in replies:
            if fields:
                token, info = self._node_info(name, now, fields)
                by_token.setdefault(token, []).append(info)
        if not by_token:
            return None

        def remainder(info):
            return info.expires_at_ms - info.now_ms

        infos = max(by_token.values(), key=lambda infos: (len(infos), max(map(remainder, infos))))
        best = max(infos, key=remainder)
        # Stable across calls even though the nodes' clocks differ by a few ms: the
        # earliest acquisition, the latest expiry and the highest fencing token.
        latest = max(infos, key=lambda i: i.expires_at_ms)
        best = replace(
            best,
            fencing_token=max(i.fencing_token for i in infos),
            acquired_at_ms=min(i.acquired_at_ms for i in infos),
            expires_at_ms=latest.expires_at_ms,
            now_ms=latest.now_ms,
        )
        if len(infos) < self.quorum and best.is_held:
            best = replace(best, expires_at_ms=best.now_ms)
        return best

    def _replies(self, results, position=0):
        """The ``position``-th reply of every node that answered."""
        return [r[position] for r in results.values() if not isinstance(r, _NodeFailed)]

    def get(self, name):
        """The majority view of ``name`` (see _merge), or None."""
        results = self._round(self._all(_GET, (self._keys(name)[0],)))
        replies = self._replies(results)
        if not replies:
            raise self._fail(f"get {name!r}", results)
        return self._merge(name, replies)

    def delete(self, name):
        """Force-release ``name`` on every node. Returns the majority view of what was
        removed, or None."""
        results = self._round(self._all(_DELETE, self._keys(name), (self.retention_ms, 1000)))
        replies = self._replies(results)
        if not replies:
            raise self._fail(f"delete {name!r}", results)
        return self._merge(name, replies)

    def trust_nodes(self):
        """Mark every reachable node trusted now, overriding the delayed-restart rule.

        Only for a brand-new set of masters (or one restarted while *certainly* no
        lock was held): it is how two holders would get in after a real restart.
        Returns the labels of the nodes marked.
        """
        results = self._round(self._all(_TRUST, (self.marker_key,)))
        return [self.nodes[i].label for i, r in sorted(results.items())
                if not isinstance(r, _NodeFailed)]

    # -- listing and clearing -----------------------------------------------------

    def _scan(self, node, name_glob):
        match = f"{self._match_head}{name_glob or '*'}}}:lock"
        cursor = 0
        while True:
            cursor, keys = node.client.scan(cursor, match=match, count=SCAN_COUNT, _type="hash")
            if keys:
                yield keys
            if int(cursor) == 0:
                return

    def _batches(self, name_glob):
        """Yield ``(names, {node index: [[now, fields] per name] or _NodeFailed})``
        for every SCAN batch of every node, each name once: a name found
        on node i is skipped if a node before i (that was scanned) has it too.
        Down nodes are skipped; LockBackendError if no node could be scanned."""
        scanned = []
        failures = []
        for index, node in enumerate(self.nodes):
            try:
                for keys in self._scan(node, name_glob):
                    names = [self._name_from_key(key) for key in keys]
                    calls = [(_GET, (self._keys(n)[0],), ()) for n in names]
                    results = self._round({i: calls for i in range(len(self.locations))},
                                          timeout=BATCH_TIMEOUT)
                    keep = [j for j in range(len(names))
                            if not any(not isinstance(results[k], _NodeFailed)
                                       and results[k][j][1] for k in scanned)]
                    if keep:
                        yield ([names[j] for j in keep],
                               {i: r if isinstance(r, _NodeFailed) else [r[j] for j in keep]
                                for i, r in results.items()})
            except self._errors as exc:
                failures.append(f"{node.label}: {type(exc).__name__}: {exc}")
                continue
            scanned.append(index)
        if not scanned:
            raise LockBackendError(self.alias, f"list failed: no Redis node answered "
                                               f"({'; '.join(failures)})")

    def list(self, *, state=None, name_glob=None):
        """Yield the majority view of every lock found on any node, each name once,
        one SCAN batch at a time (unsorted). Raises ValueError for an unknown state."""
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        return self._iter_infos(state, name_glob)

    def _iter_infos(self, state, name_glob):
        for names, results in self._batches(name_glob):
            for j, name in enumerate(names):
                info = self._merge(name, [r[j] for r in results.values()
                                          if not isinstance(r, _NodeFailed)])
                if info is not None and (state is None or info.state == state):
                    yield info

    def clear(self, *, include_held=False, name_glob=None, older_than=None, dry_run=False,
              progress=None):
        """Remove the locks that ``list`` shows as stale (held ones too with
        ``include_held``) from every node. Each node re-checks atomically, by its own
        clock, that its record is removable (a lock re-acquired meanwhile is kept);
        ``:fence`` counters and the node marker are never touched."""
        result = ClearResult(self.alias)
        older_than_ms = "" if older_than is None else int(older_than * 1000)
        args = (int(bool(include_held)), self.retention_ms, 1000, older_than_ms,
                int(bool(dry_run)))
        for names, results in self._batches(name_glob):
            chosen = []
            for j, name in enumerate(names):
                info = self._merge(name, [r[j] for r in results.values()
                                          if not isinstance(r, _NodeFailed)])
                if info is not None and (include_held or info.is_stale):
                    chosen.append(name)
            if not chosen:
                continue
            calls = [(_CLEAR, self._keys(n), args) for n in chosen]
            done = self._round({i: calls for i in range(len(self.locations))},
                               timeout=BATCH_TIMEOUT)
            removed = [name for j, name in enumerate(chosen)
                       if any(not isinstance(r, _NodeFailed) and r[j] == 1
                              for r in done.values())]
            if removed:
                result.names.extend(removed)
                if progress is not None:
                    progress(removed)
        return result
