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
            "FENCING_RETENTION": 60,     # seconds a released lock's fencing token is remembered
            "ALLOW_EVICTION": False,     # True: accept masters that may evict keys
            "CONNECTION_KWARGS": {},     # for every node's redis.Redis.from_url
        },
    }

The algorithm (antirez' Redlock, with the refinements below):

- **Acquire** mints one token and sends the Redis backend's own ``ACQUIRE`` script
  (same keys ``P:{N}:lock``/``P:{N}:fence``, same Lua, imported from
  :mod:`django_setnx.backends.redis`, wrapped with the node check described under
  "Delayed restarts") to every node *in parallel*: one connection per node, every
  request written before any reply is read, so a round costs one network round trip
  however many nodes there are. A node that has not replied within ``NODE_TIMEOUT``
  counts as not answering. The lock is won only if a majority (``N // 2 + 1``)
  granted it **and** its validity ``ttl - elapsed - drift`` (drift =
  ``ttl * CLOCK_DRIFT_FACTOR + 2 ms``) is still positive; otherwise every node that
  may have granted it is asked to release it, and the attempt reports contention
  (``retry_after`` = the smallest remainder a holder's node reported). The
  :class:`~django_setnx.locking.Lock` object retries with jittered backoff.
- **Release** goes to every node in parallel; it succeeded when a majority deleted
  our token. **Extend** needs a majority within the validity too, else it returns
  False (the Lock raises ``LockNotOwned`` and marks the lock lost) after releasing
  what is left of it. ``owns`` needs a majority; ``get``/``list`` show the majority
  view; ``delete``/``clear`` act on every node.
- **Quorum errors.** When fewer than a majority of the nodes answer, no operation
  can tell anything, so acquire, release, extend, owns, get, delete, list and clear
  raise ``LockBackendError`` at once, naming the alias and each node that failed
  and why (refused connection, timeout, an error reply, or the eviction refusal
  below). A contention is only ever reported by a majority that answered.

**Connections and forks.** Each node's connections are made by redis-py (a
``redis.Redis.from_url`` client's connection class and options: handshake, AUTH,
SELECT, TLS) and kept by :mod:`~django_setnx.backends.redlock_wire`, the socket
layer of the rounds: one connection per node per round, every request written
before any reply is read, all replies awaited against one deadline. A connection
whose round failed or ran out of time is disconnected, never kept with a reply
unread. Each connection carries the pid that opened it, and a process never uses
another's: after a fork (gunicorn ``--preload``, Celery prefork,
``multiprocessing``) the child drops the inherited connections unused and opens its
own, so a parent and its child never read each other's replies. (The module's
docstring says why it is not redis-py's ConnectionPool: the cost per round.)

**Timeouts.** ``NODE_TIMEOUT`` is the deadline of a lock round (acquire, release,
extend, owns, get, delete: every node's replies, counted from the writes), and the
connect and socket timeout of node connections (``socket_connect_timeout``,
``socket_timeout``: connecting, a new connection's handshake and checks, and the
writes over TLS). ``list`` and ``clear`` walk each node with ``SCAN`` calls of
``SCAN_COUNT`` keys that may take ``max(1 s, 4 * NODE_TIMEOUT)`` each, then read the
records found in batch rounds (one script per record on every node) that may take
``BATCH_TIMEOUT`` (10 s) each. ``CONNECTION_KWARGS`` may override ``socket_timeout``
and ``socket_connect_timeout``; the rounds' deadlines stay as they are. ``NODE_TIMEOUT``
is at most MAX_NODE_TIMEOUT (60 s).

**Eviction.** A master whose ``maxmemory-policy`` may evict keys could drop a held
lock and let a second holder in. Every new connection to a node (the first use
included) reads its ``maxmemory`` and policy before it is used, and a node that may
evict is refused: it counts as not answering, with the reason in the quorum error
and in an error logged by ``django_setnx``. ``OPTIONS["ALLOW_EVICTION"] = True``
accepts the risk.

**Fencing tokens** are the Redis backend's hybrid clock on each node (its clock in
µs, or its last token for the name plus one if that is larger), and a lock's token
is the largest that its granting majority minted. A release tells every node that
token, and each remembers it (``P:{N}:fence``, for ``FENCING_RETENTION``) if it is
larger than its own; so does a forced release or ``clear`` (with the majority
view's token). Any later majority shares a node with the majority that released
(two majorities of the same N always intersect), and that node mints above the
token — hence the next token is larger. A lock that is never released (its holder
died) is taken over after its ttl, by which time every node's clock has moved on by
the ttl: the next token is larger as long as the masters' clocks agree within the
lock's ttl (NTP does far better). Nothing per name is kept longer than
``FENCING_RETENTION`` after its last use.

**Delayed restarts.** A master that restarts without its data (no persistence)
forgets the locks it granted, so the holder's majority may shrink to a minority
while another client gathers a new majority with the amnesiac node's help: two
holders. Hence every node carries a
marker key ``P:__node__`` holding ``trusted_after`` (ms, by that node's own clock).
The acquire script of the first client that finds it missing — a fresh or
restarted-empty node — sets it to ``node_now + MAX_TTL``; until then the node grants
nothing (its vote is a no), though it still receives releases. Every lock it may
have forgotten had a ttl <= ``MAX_TTL`` (larger ttls raise ``ValueError``), so by
then they have all expired. The rule lives on the node and uses the node's clock, so
every client honours it, whichever client noticed the restart.

A node that restarts with only part of its data (an RDB snapshot, ``appendfsync
everysec`` after a crash of the machine, a backup restored, a replica promoted behind
the same address) keeps its marker, its oldest key, but may have lost recent locks.
So every new connection (and a restart drops them all) first reads the server's
``run_id`` (``INFO server``) and, if it is not the one the node's run key
``P:__node__:run`` recorded, runs RESTART_CHECK: the node is another run of
redis-server, and sits out ``MAX_TTL`` from then, whatever its persistence (even an
``appendfsync always`` AOF may be an older copy: review r138) and however long it
has run (a promoted replica may have run for months: review r140). A marker without
a run key (written by an older version) is credited with the time its server has
surely run, so that an upgrade does not make every master sit out. A server that
hides ``INFO`` cannot be checked (logged). The run key is not a lock key either.

When the trusted nodes that answered cannot form a majority because some of them
sit out, acquire raises ``LockBackendError`` naming those nodes and when each
votes again. A brand-new set has no markers either: after deploying fresh masters
(when no lock can be held yet), run ``manage.py trustlocknodes`` once (or call
:meth:`RedlockBackend.trust_nodes`), or wait ``MAX_TTL``. ``list`` and ``clear``
never see the marker (it is not a lock key).

Limits (see the README, "Scaling out"): Redlock assumes bounded clock drift and
process pauses shorter than the validity; a holder paused past its ttl loses the
lock without knowing, which only fencing tokens checked by the protected resource
can catch.
"""

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, replace

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from ..exceptions import LockBackendError
from ..forksafe import ForkSafeLock
from ..globs import compile_glob, escape, redis_match
from ..validation import redacted, ttl_to_ms
from .base import (
    STATES,
    AcquireResult,
    BaseLockBackend,
    ClearResult,
    LockInfo,
    built_once,
    encode_owner,
)
from .redis import (
    DEFAULT_FENCING_RETENTION,
    DEFAULT_KEY_PREFIX,
    DEFAULT_STALE_RETENTION,
    SCAN_COUNT,
    check_key_prefix,
    key_prefix_problem,
    lock_keys,
    name_from_lock_key,
    record_info,
    require_redis_py,
    scan_batches,
)
from .redis_eviction import (
    ALLOW_EVICTION_OPTION,
    config_reply,
    eviction_refusal,
    info_reply,
    reply_text,
    settings_from_config,
    settings_from_info,
)
from .redis_scripts import ACQUIRE, CLEAR, DELETE, EXTEND, GET, OWNS, RELEASE
from .redis_settings import (
    UNREADABLE_URL,
    check_client_options,
    check_connection_kwargs,
    connection_kwargs,
    is_number,
    is_readable_url,
    require_readable_url,
    script_seconds_problem,
)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.commands import CoreCommands
    from redis.exceptions import ResponseError
    from redis.retry import Retry

    from . import redlock_wire as wire
except ImportError:  # reported by check_params (E030) and on first use
    redis = None  # type: ignore[assignment]
    CoreCommands = object  # type: ignore[assignment,misc]

logger = logging.getLogger("django_setnx")

DEFAULT_NODE_TIMEOUT = 0.1
DEFAULT_CLOCK_DRIFT_FACTOR = 0.01
#: Default of OPTIONS["MAX_TTL"]: also how long a restarted node sits out, so far
#: shorter than the other backends' default.
DEFAULT_MAX_TTL = 3600.0
#: Fixed part of the drift allowance, in ms (Redis' PX resolution and TIME rounding).
DRIFT_MS = 2
#: Seconds a batch round of list/clear (up to SCAN_COUNT scripts per node) may take.
BATCH_TIMEOUT = 10.0
#: How many names get_many() asks every node for in one round.
GET_MANY_CHUNK = 500
#: Least time one SCAN call may take (it is max(this, 4 * NODE_TIMEOUT)).
MIN_SCAN_TIMEOUT = 1.0
MARKER_SUFFIX = "__node__"
OPTION_NAMES = {
    "NODE_TIMEOUT",
    "CLOCK_DRIFT_FACTOR",
    "STALE_RETENTION",
    "FENCING_RETENTION",
    "CONNECTION_KWARGS",
    ALLOW_EVICTION_OPTION,
}
#: How many granted fencing tokens this process remembers until their release (a
#: lock that is never released is forgotten first).
FENCING_MEMORY = 10_000
#: Seconds between two log messages about the same node and the same problem.
WARN_EVERY = 60.0
#: The command that marks a brand-new set of masters trusted.
TRUST_COMMAND = "trustlocknodes"

# KEYS: those of ACQUIRE, then the node's marker, last. ARGV: those of ACQUIRE, then
# max_ttl_ms, last (last, so ACQUIRE's own keys and arguments keep their positions).
# A node without a marker (fresh, or restarted empty) gets one saying "trusted after
# node_now + MAX_TTL"; a node not trusted yet grants nothing and returns
# {0, 0, ms until it votes}. Otherwise ACQUIRE runs: {won, fencing or ms until the
# holder's expiry, 0}, on the same reading of the clock (a second TIME costs a
# command per master and acquire, and the two readings would differ).
_READ_CLOCK = "local t = redis.call('TIME')\n"  # ACQUIRE's (a test checks it is there)
NODE_ACQUIRE = f"""
local marker = KEYS[#KEYS]
local t = redis.call('TIME')
local node_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local after = tonumber(redis.call('GET', marker))
if not after then
  after = node_now + tonumber(ARGV[#ARGV])
  redis.call('SET', marker, after)
end
if after > node_now then
  return {{0, 0, after - node_now}}
end
local function acquire()
{ACQUIRE.replace(_READ_CLOCK, "")}
end
local reply = acquire()
if reply.err then
  return reply
end
return {{reply[1], reply[2], 0}}
"""

# KEYS: marker, then the node's run key. ARGV: the server's run_id (INFO server: new
# at every start of redis-server; a replica promoted keeps its own, never the old
# master's), max_ttl_ms, and the ms the server has surely run (see below). Run on a
# new connection whose server's run_id is not the one the run key holds (see
# _Node._check_restart). Another run of redis-server than the one recorded (a
# restart, a restore from a backup, a replica promoted behind the same address) may
# hold only part of the data: its marker (its oldest key) says trusted, but it may
# have lost locks granted before. It sits out MAX_TTL from now, as when it restarted
# empty: how long it has run says nothing of how long it has had its data (a replica
# promoted after months). With no marker the acquire script's rule applies
# (restarted empty). A marker without a run key was written by a version that kept
# none (an upgrade): the node is credited with the time it has surely run, so one
# that started more than MAX_TTL ago keeps voting (else every master of a set would
# sit out at the upgrade). Records the run; returns ms until the node votes.
RESTART_CHECK = """
local run = redis.call('GET', KEYS[2])
if run == ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[1])
local after = tonumber(redis.call('GET', KEYS[1]))
if not after then
  return 0
end
local t = redis.call('TIME')
local node_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local votes_at = node_now + tonumber(ARGV[2])
if not run then
  votes_at = votes_at - tonumber(ARGV[3])
end
if after < votes_at then
  redis.call('SET', KEYS[1], votes_at)
  after = votes_at
end
return math.max(after - node_now, 0)
"""

# KEYS: marker. Marks the node trusted now (trust_nodes: a brand-new set). Returns 1.
TRUST = """
local t = redis.call('TIME')
redis.call('SET', KEYS[1], tonumber(t[1]) * 1000 - 1)
return 1
"""

# KEYS: marker. Returns {node_now_ms, trusted_after_ms or false}; writes nothing.
NODE_STATUS = """
local t = redis.call('TIME')
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
        redis.call('GET', KEYS[1])}
"""


class _Script:
    __slots__ = ("sha", "text")

    def __init__(self, text):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


_ACQUIRE, _RELEASE, _EXTEND, _OWNS, _GET, _DELETE, _CLEAR = (
    _Script(s) for s in (NODE_ACQUIRE, RELEASE, EXTEND, OWNS, GET, DELETE, CLEAR)
)
_TRUST, _STATUS = (_Script(s) for s in (TRUST, NODE_STATUS))
_ALL_SCRIPTS = (_ACQUIRE, _RELEASE, _EXTEND, _OWNS, _GET, _DELETE, _CLEAR, _TRUST, _STATUS)
#: ``{sha: (text, runs late)}``: a late NOSCRIPT reply is answered with EVAL (see
#: redlock_wire.Server._late_error). A release may run however late: it is
#: token-checked, and a token is never used twice (each acquire attempt has its own:
#: token_per_attempt). Any other call only within its round's deadline.
_SCRIPT_TEXTS = {script.sha: (script.text, script is _RELEASE) for script in _ALL_SCRIPTS}


#: What a master's script error says when a name's fencing tokens are exhausted
#: (redis_scripts.mint).
TOKENS_EXHAUSTED = "fencing tokens exhausted"


if redis is not None:

    class EvictionRefused(redis.exceptions.RedisError):
        """A node that may evict keys (not a ConnectionError: never retried)."""


def _surely_ran_ms(uptime, max_ttl_ms):
    """The ms a server whose ``uptime_in_seconds`` reads ``uptime`` has surely run,
    at most ``max_ttl_ms``. Redis subtracts two wall-clock readings rounded down to
    whole seconds, so the true time may be up to a second less; a reading that is
    missing or negative (the clock was set back) counts as none."""
    try:
        seconds = int(reply_text(uptime).strip())
    except ValueError:
        return 0
    return min(max(seconds - 1, 0) * 1000, max_ttl_ms)


def _pipelined(conn, commands):
    """Send ``commands`` on ``conn`` at once and read every reply: an error reply is
    returned as its ResponseError (the connection stays in step)."""
    conn.send_packed_command(conn.pack_commands(commands), check_health=False)
    replies = []
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except ResponseError as error:
            replies.append(error)
    return replies


def _as_eval(call):
    """A ``(script, keys, args)`` call sent with EVAL and the script's text: it never
    meets NOSCRIPT (and caches the script)."""
    script, keys, args = call
    return (None, ("EVAL", script.text, len(keys), *keys, *args), ())


def _commands(calls):
    """The commands of ``calls`` (``[(script, keys, args), ...]``; a plain command is
    ``(None, (command, *args), ())``), as redlock_wire sends them."""
    return [
        ("EVALSHA", script.sha, len(keys), *keys, *args) if script else keys
        for script, keys, args in calls
    ]


def _is_one(reply):
    """True for a script's reply 1 (released, extended); False for anything else, an
    error reply included."""
    return type(reply) is int and reply == 1


def _is_grant(reply):
    """True if a node's NODE_ACQUIRE ``reply`` (``{won, fencing or ms left, sits out
    ms}``) granted the lock: a node sitting out grants nothing."""
    return isinstance(reply, list) and reply[0] == 1 and reply[2] == 0


def _is_wrong_type(reply):
    """True for the error of a script that met a key of another type where a lock
    record should be (written by hand or by something else): a record of that node
    that cannot be read, rather than a node that cannot answer."""
    return isinstance(reply, ResponseError) and "WRONGTYPE" in str(reply)


class _Results(dict):
    """``{node index: replies or a wire.Failure}`` of one round, and when it started
    (monotonic seconds, taken just before the first request was written)."""

    started = None


class _OnConnection(CoreCommands):
    """redis-py's commands, sent on one given connection and parsed as ``client``
    parses them: for the checks that run on a connection while it is being set up."""

    def __init__(self, client, connection):
        self._client = client
        self._connection = connection

    def execute_command(self, *args, **options):
        self._connection.send_command(*args, check_health=False)
        return self._client.parse_response(self._connection, args[0], **options)


def _single_connection_refusal(alias):
    """What the checks (E037) and the backend say of ``single_connection_client``."""
    return (
        f"SETNX_LOCKS[{alias!r}]['OPTIONS']['CONNECTION_KWARGS']: single_connection_client "
        f"is not for Redlock, which keeps its own connections to each master; remove it."
    )


class _Node:
    """One master: its idle connections (a fork-safe :class:`wire.Server`), made by
    redis-py from the node's URL and options. Every new connection passes through
    :meth:`_on_connect` before it is used."""

    def __init__(self, url, kwargs, alias, allow_eviction, marker_key, max_ttl_ms, index):
        self.alias = alias
        self.allow_eviction = allow_eviction
        self.marker_key = marker_key
        self.run_key = f"{marker_key}:run"  # P:__node__:run: not a lock key either
        self.max_ttl_ms = max_ttl_ms
        if kwargs.get("single_connection_client"):
            # redis-py would connect in the constructor, through _on_connect, with
            # nothing of this node set up yet (review r145: an AttributeError).
            raise ImproperlyConfigured(_single_connection_refusal(alias))
        require_readable_url(url, f"SETNX_LOCKS[{alias!r}]['LOCATION'] master {index}")
        # The client parses the replies of _on_connect's checks; it never connects.
        try:
            self.client = redis.Redis.from_url(
                url, **{**kwargs, "redis_connect_func": self._on_connect}
            )
        except ValueError as exc:  # the URL was readable: the arguments are not
            raise ImproperlyConfigured(
                f"SETNX_LOCKS[{alias!r}]['OPTIONS']['CONNECTION_KWARGS']: redis-py refuses "
                f"it: {exc}"
            ) from exc
        pool = self.client.connection_pool
        check_connection_kwargs(alias, pool)
        ck = pool.connection_kwargs
        self.label = ck.get("path") or f"{ck.get('host', '?')}:{ck.get('port', '?')}"
        self.server = wire.Server(
            self.label,
            lambda: pool.connection_class(**ck),
            tls=issubclass(pool.connection_class, redis.connection.SSLConnection),
            scripts=_SCRIPT_TEXTS,
            on_late_error=self._late_error,
        )
        self._warned = {}  # problem -> monotonic time of its last log message

    def __repr__(self):
        return f"<node {self.label}>"

    def _on_connect(self, conn):
        """Set up a new connection, in one pipelined round trip after redis-py's
        handshake: read what the checks need, and cache every script (so no NOSCRIPT
        fallback lands inside a lock's validity window). Then refuse a server that
        may evict keys (unless ALLOW_EVICTION), and make one that restarted recently
        sit out (:meth:`_check_restart`). Raising here makes redis-py drop the
        connection."""
        conn.on_connect()
        config, info, recorded_run, *loaded = _pipelined(
            conn,
            [
                ("CONFIG", "GET", "maxmemory*"),
                ("INFO", "server"),
                ("GET", self.run_key),
                *(("SCRIPT", "LOAD", s.text) for s in _ALL_SCRIPTS),
            ],
        )
        for reply in loaded:
            if isinstance(reply, ResponseError):
                raise reply
        if not self.allow_eviction:
            if isinstance(config, ResponseError):  # CONFIG disabled (managed services)
                settings = settings_from_info(_OnConnection(self.client, conn).info("memory"))
            else:
                settings = settings_from_config(config_reply(config))
            refusal = eviction_refusal(self.alias, self.label, *settings)
            if refusal:
                self.log_once("eviction", logging.ERROR, "%s", refusal)
                raise EvictionRefused(refusal)
        server = {} if isinstance(info, ResponseError) else info_reply(info)
        self._check_restart(conn, server, recorded_run)

    def _check_restart(self, conn, server, recorded_run):
        """Run RESTART_CHECK unless ``recorded_run`` (the node's run key) is already
        this server's run_id (``server``: its ``INFO server``): another run of
        redis-server (a restart, a restore, a replica promoted behind the same
        address) sits out MAX_TTL. Every restart drops every connection, so no lock
        command reaches a restarted server before this ran on it. The script writes
        only when the run changed: a node whose writes stall still takes new
        connections."""
        run_id = server.get("run_id", "").strip()
        if not run_id:
            self.log_once(
                "no run_id",
                logging.WARNING,
                "Redlock %r: node %s does not report its run_id (INFO server), so a "
                "restart that kept only part of its data (an RDB snapshot, appendfsync "
                "everysec after a crash, a backup) cannot be told: such a node votes at "
                "once and may grant a lock it forgot. Allow INFO for this user.",
                self.alias,
                self.label,
            )
            return
        if recorded_run is not None and reply_text(recorded_run) == run_id:
            return
        conn.send_command(
            "EVAL",
            RESTART_CHECK,
            2,
            self.marker_key,
            self.run_key,
            run_id,
            self.max_ttl_ms,
            _surely_ran_ms(server.get("uptime_in_seconds", ""), self.max_ttl_ms),
            check_health=False,
        )
        sits_out_ms = conn.read_response()
        if sits_out_ms:
            self.log_once(
                "restarted",
                logging.WARNING,
                "Redlock %r: node %s is another run of redis-server than the one last "
                "seen (its run_id changed: a restart, a restore, a replica promoted) and "
                "may have lost locks granted before (RDB snapshots, appendfsync everysec "
                "after a crash, an older copy of the data): it does not vote for %.0f s "
                "(MAX_TTL = %g s, the delayed-restart rule).",
                self.alias,
                self.label,
                sits_out_ms / 1000,
                self.max_ttl_ms / 1000,
            )

    def log_once(self, problem, level, message, *args):
        """Log ``message`` unless this node logged the same problem in the last
        WARN_EVERY seconds."""
        now = time.monotonic()
        last = self._warned.get(problem)
        if last is None or now - last >= WARN_EVERY:
            self._warned[problem] = now
            logger.log(level, message, *args)

    def _late_error(self, reply):
        """An error from this node that no round waited for (see redlock_wire)."""
        self.log_once(
            ("late error", str(reply).split(" ", 1)[0]),
            logging.WARNING,
            "Redlock %r: node %s answered a call that was not awaited (its majority had "
            "answered in time) with an error: %s (the same error from this node is "
            "logged at most once every %g s)",
            self.alias,
            self.label,
            reply,
            WARN_EVERY,
        )

    def close(self):
        self.server.close()
        self.client.close()


#: The longest NODE_TIMEOUT (seconds): a node that has not answered in a minute is
#: down for any lock; longer values overflow the socket's timeout arithmetic.
MAX_NODE_TIMEOUT = 60.0


def _option_problems(where, options):
    """``[(check id, message)]`` for the options Redlock reads, for the system checks
    and for first use alike (so the two agree): NODE_TIMEOUT, MAX_TTL,
    STALE_RETENTION, FENCING_RETENTION and CLOCK_DRIFT_FACTOR (a negative one made
    a lock's validity longer than its key's life). ALLOW_EVICTION and
    CONNECTION_KWARGS are the Redis backend's too (redis_settings)."""
    problems = []
    for option in ("NODE_TIMEOUT", "MAX_TTL"):
        if option in options and not is_number(options[option]):
            problems.append(
                (
                    "E035",
                    f"{where}['OPTIONS']['{option}'] must be a positive number of "
                    f"seconds, got {options[option]!r}.",
                )
            )
    timeout = options.get("NODE_TIMEOUT")
    if is_number(timeout) and timeout > MAX_NODE_TIMEOUT:
        problems.append(
            (
                "E035",
                f"{where}['OPTIONS']['NODE_TIMEOUT'] is {timeout!r} s, above the "
                f"{MAX_NODE_TIMEOUT:g} s a node may take to answer.",
            )
        )
    for option in ("STALE_RETENTION", "FENCING_RETENTION"):
        problem = option in options and script_seconds_problem(options[option])
        if problem:
            problems.append(("E035", f"{where}['OPTIONS'][{option!r}] {problem}"))
    factor = options.get("CLOCK_DRIFT_FACTOR", DEFAULT_CLOCK_DRIFT_FACTOR)
    if not is_number(factor, inclusive=True) or factor >= 1:
        problems.append(
            (
                "E036",
                f"{where}['OPTIONS']['CLOCK_DRIFT_FACTOR'] must be a number in "
                f"[0, 1), got {factor!r}.",
            )
        )
    return problems


def _listed_twice_message(where, positions):
    """Names the masters by position only: a URL may hold a password."""
    listed = ", ".join(map(str, positions))
    return (
        f"{where}['LOCATION']: master(s) {listed} point to the same server (host and "
        f"port, or socket) as an earlier one; every entry must be a different, "
        f"independent master (not another db of the same server), or one server's vote "
        f"counts twice toward the majority."
    )


def _master_address(url):
    """The server a master URL points to, as redis-py reads it (host in lower case
    and port, 6379 when unset, or the socket's path; not the db: two dbs of one
    server are one vote), to find a master listed twice; None for a URL redis-py
    cannot read. Names are not resolved ("localhost" and "127.0.0.1" differ): one
    server listed under two names is not found (see the docs)."""
    from redis.connection import parse_url

    try:
        parsed = parse_url(url)
    except (TypeError, ValueError):
        return None
    if parsed.get("path"):
        return ("unix", parsed["path"])
    return (str(parsed.get("host") or "localhost").lower(), int(parsed.get("port") or 6379))


def _listed_twice(locations):
    """The positions (from 1) of the masters of ``locations`` that point where an
    earlier one does (see _master_address)."""
    seen = set()
    twice = []
    for index, url in enumerate(locations, 1):
        address = _master_address(url) if isinstance(url, str) else None
        if address is None:
            continue
        if address in seen:
            twice.append(index)
        seen.add(address)
    return twice


@dataclass(frozen=True)
class NodeStatus:
    """Whether one master votes (see :meth:`RedlockBackend.node_status`).

    ``votes_in`` is the seconds until it votes again by its own clock (0: it votes
    now); None when it has no marker yet (brand-new or restarted empty: the first
    acquire that reaches it makes it sit out ``MAX_TTL``) or when it did not answer,
    then ``error`` says why. (A node that restarted with part of its data is made to
    sit out when a client first connects to it after the restart.)
    """

    label: str
    votes_in: float | None = None
    error: str | None = None

    @property
    def trusted(self):
        return self.error is None and self.votes_in == 0


class RedlockBackend(BaseLockBackend):
    """Locks granted by a majority of N independent Redis masters (Redlock)."""

    option_names = BaseLockBackend.option_names | frozenset(OPTION_NAMES)
    default_max_ttl = DEFAULT_MAX_TTL

    wakes_waiters = False
    # An attempt's undo may run on a node after the next attempt was granted there
    # (review r139): the undo's token must not be the next attempt's.
    token_per_attempt = True

    def __init__(self, alias, params):
        super().__init__(alias, params)
        require_redis_py(alias, "Redlock")
        location = params.get("LOCATION")
        if (
            isinstance(location, str)
            or not isinstance(location, (list, tuple))
            or len(location) < 3
        ):
            raise ImproperlyConfigured(
                f"SETNX_LOCKS[{alias!r}]['LOCATION'] must be a list of at least 3 redis:// "
                f"URLs of independent masters, got {redacted(location)}."
            )
        self.locations = list(location)
        where = f"SETNX_LOCKS[{alias!r}]"
        twice = _listed_twice(self.locations)
        if twice:
            # One server counted twice toward the majority (review r156).
            raise ImproperlyConfigured(_listed_twice_message(where, twice))
        self.key_prefix = check_key_prefix(alias, params)
        opts = self.options
        problems = _option_problems(where, opts)
        if problems:
            raise ImproperlyConfigured(problems[0][1])
        self.node_timeout = float(opts.get("NODE_TIMEOUT", DEFAULT_NODE_TIMEOUT))
        self.drift_factor = float(opts.get("CLOCK_DRIFT_FACTOR", DEFAULT_CLOCK_DRIFT_FACTOR))
        self.allow_eviction = opts.get(ALLOW_EVICTION_OPTION, False)
        if not isinstance(self.allow_eviction, bool):
            raise ImproperlyConfigured(
                f"{where}['OPTIONS'][{ALLOW_EVICTION_OPTION!r}] must be True or False, "
                f"got {self.allow_eviction!r}."
            )
        self.max_ttl_ms = ttl_to_ms(self.max_ttl)
        self.retention_ms = ttl_to_ms(opts.get("STALE_RETENTION", DEFAULT_STALE_RETENTION))
        self.fence_ms = ttl_to_ms(opts.get("FENCING_RETENTION", DEFAULT_FENCING_RETENTION))
        # token -> the fencing token this process was granted for it, until released.
        self._fencing_of = _BoundedMap(FENCING_MEMORY)
        self.scan_timeout = max(MIN_SCAN_TIMEOUT, 4 * self.node_timeout)
        self.quorum = len(self.locations) // 2 + 1
        # When a round of release or extend may stop waiting (see _round).
        self._said_one_by_majority = self._majority_said(_is_one)
        self.marker_key = f"{self.key_prefix}:{MARKER_SUFFIX}"
        self._match_head = escape(self.key_prefix) + ":{"
        self._nodes = None
        self._nodes_lock = ForkSafeLock()  # a child may build its clients

    def __repr__(self):
        return f"<RedlockBackend alias={self.alias!r} nodes={len(self.locations)}>"

    # -- configuration ------------------------------------------------------------

    @classmethod
    def check_params(cls, alias, params):
        """Return ``checks`` messages (ids ``django_setnx.E030``-``E039``, ``W030``, ``W031``)
        for this alias' settings. Never connects. (Unknown OPTIONS keys are warned
        about by the common checks, from ``option_names``.)"""
        where = f"SETNX_LOCKS[{alias!r}]"
        errors = []

        def error(id_, msg, hint=None):
            errors.append(checks.Error(msg, hint=hint, id=f"django_setnx.{id_}"))

        def warn(id_, msg):
            errors.append(checks.Warning(msg, id=f"django_setnx.{id_}"))

        if redis is None:
            error(
                "E030",
                f"{where} uses the Redlock backend, but redis-py is not installed.",
                hint="pip install django-setnx[redis]",
            )
        location = params.get("LOCATION")
        if (
            isinstance(location, str)
            or not isinstance(location, (list, tuple))
            or not all(isinstance(url, str) and url for url in location)
        ):
            error(
                "E031",
                f"{where}['LOCATION'] must be a list of redis:// URLs (one per "
                f"independent master), got {redacted(location)}.",
                hint='Example: ["redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0", '
                '"redis://10.0.0.3:6379/0"]',
            )
        else:
            if len(location) < 3:
                error(
                    "E032",
                    f"{where}['LOCATION'] lists {len(location)} master(s); Redlock "
                    f"needs at least 3 (a majority of 1 or 2 tolerates no failure).",
                )
            twice = _listed_twice(location) if redis is not None else []
            if twice:
                error("E033", _listed_twice_message(where, twice))
            if redis is not None:
                # Each as redis-py will read it, without connecting (review r149: a
                # master with a bad URL passed, and its first lock's ValueError quoted
                # part of the password). The message never repeats a URL.
                for index, url in enumerate(location, 1):
                    if not is_readable_url(url):
                        error(
                            "E031",
                            f"{where}['LOCATION'] master {index} is not a Redis URL "
                            f"{UNREADABLE_URL}",
                        )
            if len(location) >= 3 and len(location) % 2 == 0:
                errors.append(
                    checks.Warning(
                        f"{where}['LOCATION'] lists an even number of masters ({len(location)}); "
                        f"an odd number tolerates as many failures with one node fewer.",
                        id="django_setnx.W030",
                    )
                )
        prefix_problem = key_prefix_problem(params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX))
        if prefix_problem is not None:
            error("E034", f"{where}['KEY_PREFIX'] {prefix_problem}.")
        options = params.get("OPTIONS")
        options = {} if options is None else options
        if not isinstance(options, dict):
            error("E039", f"{where}['OPTIONS'] must be a dict, got {redacted(options)}.")
            return errors
        for id_, problem in _option_problems(where, options):
            error(id_, problem)
        max_ttl = options.get("MAX_TTL", DEFAULT_MAX_TTL)
        ttl = params.get("TTL")
        if is_number(max_ttl) and is_number(ttl) and ttl > max_ttl:
            error(
                "E038",
                f"{where}['TTL'] = {ttl!r} s is above OPTIONS['MAX_TTL'] = {max_ttl!r} s.",
                hint="MAX_TTL bounds every ttl and is how long a restarted node sits out.",
            )
        kwargs = options.get("CONNECTION_KWARGS")
        if isinstance(kwargs, dict) and kwargs.get("single_connection_client"):
            error("E037", _single_connection_refusal(alias))
        urls = location if not any(e.id == "django_setnx.E031" for e in errors) else []
        check_client_options(
            options,
            where,
            error,
            warn,
            kwargs_id="E037",
            eviction_id="E039",
            tls_id="W031",
            alias=alias,
            urls=urls,
        )
        return errors

    # -- connections --------------------------------------------------------------

    @property
    def nodes(self):
        """The lazily created per-node clients, shared by every thread."""
        nodes = self._nodes
        if nodes is None:
            nodes = built_once(self, "_nodes", self._nodes_lock, self._build_nodes)
        return nodes

    def _build_nodes(self):
        kwargs = {
            # Connecting and a new connection's handshake wait NODE_TIMEOUT at most; a
            # round's replies are awaited until its deadline.
            "socket_timeout": self.node_timeout,
            "socket_connect_timeout": self.node_timeout,
            # A retried connect would hold a round up; a down node is a no.
            "retry": Retry(NoBackoff(), 0),
            **connection_kwargs(self.options, self.alias),
        }
        nodes = [
            _Node(
                url,
                kwargs,
                self.alias,
                self.allow_eviction,
                self.marker_key,
                self.max_ttl_ms,
                index=index,
            )
            for index, url in enumerate(self.locations, 1)
        ]
        if not all(node.server.fast for node in nodes):
            # A round takes one path for all its servers (review r140: some over TLS
            # and some not, the fast path wrote to a TLS link, which has no socket).
            for node in nodes:
                node.server.fast = False
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

    # -- the parallel round -------------------------------------------------------

    #: The transport of a round: ``(requests, timeout) -> (replies, started)`` (see
    #: redlock_wire.round_trip). benchmarks/redlock_on_redis_py.py swaps it for
    #: redis-py clients to measure what the raw sockets are worth.
    _round_trip = staticmethod(wire.round_trip)

    def _round(self, calls, timeout=None, wrong_type_is_a_reply=False, enough=None, if_late=None):
        """Run ``calls`` (``{node index: [(script, keys, args), ...]}``; a plain
        command is ``(None, (command, *args), ())``) on the nodes in parallel and
        return ``{node index: [reply, ...] or wire.Failure}``.

        Every node's commands are written (pipelined) before any reply is read, then
        the replies are awaited against one deadline, ``timeout`` (default
        ``NODE_TIMEOUT``) after the writes: one network round trip in all (see
        :mod:`~django_setnx.backends.redlock_wire`). A node that is down, too slow
        or replies with an error fails as a whole, except that with
        ``wrong_type_is_a_reply`` a WRONGTYPE error stays in its replies (a record
        that cannot be read). The result's ``started`` is taken after connecting,
        before the first write. A call list shared by several nodes is packed once.

        ``enough(results)`` ends the round early once it returns True for the replies
        in so far (see redlock_wire.round_trip): the nodes not awaited are
        ``wire.Pending`` in the result. Release and extend pass one that is True
        once a majority confirmed, so the slowest node of a healthy majority does
        not set their pace (the node still gets the call: its reply is read before
        its connection is used again, a NOSCRIPT answered with EVAL and any other
        error logged, see redlock_wire). Acquire waits for every node (or
        ``NODE_TIMEOUT``): the lock's fencing token is the largest that its nodes
        minted, and the slowest node, whose clock reads latest, usually mints the
        largest, which the majority view (``_merge``) and a fencing-checked delete
        then show. Ending early would tell the holder a smaller token than the
        one every later reader sees.

        ``if_late(index, replies)`` returns the calls (or None) to send after a
        node's own on the same connection if its replies are late, given the other
        nodes' raw ``replies`` (see redlock_wire.round_trip): the undo of an acquire
        that lost, which then runs after the acquire if that runs at all.
        """
        nodes = self.nodes
        commands = {}  # id(calls list) -> its commands
        requests = {}
        for index, node_calls in calls.items():
            node_commands = commands.get(id(node_calls))
            if node_commands is None:
                node_commands = commands[id(node_calls)] = _commands(node_calls)
            requests[index] = (nodes[index].server, node_commands)
        late_commands = None
        if if_late is not None:

            def late_commands(index, replies):
                late_calls = if_late(index, replies)
                return _commands(late_calls) if late_calls else None

        replies, started = self._round_trip(
            requests, self.node_timeout if timeout is None else timeout, enough, late_commands
        )
        results = _Results(replies)
        results.started = started
        missing = {}  # node index -> call numbers that got NOSCRIPT
        for index, node_replies in replies.items():
            if not isinstance(node_replies, list):  # a Failure, or Pending
                continue
            for call_no, reply in enumerate(node_replies):
                if not isinstance(reply, ResponseError):
                    continue
                if wire.is_no_script(reply):
                    # Not cached there (SCRIPT FLUSH): nothing ran; EVAL below.
                    missing.setdefault(index, []).append(call_no)
                elif not (wrong_type_is_a_reply and _is_wrong_type(reply)):
                    results[index] = wire.Failure(nodes[index].label, reply)
                    missing.pop(index, None)
                    break
        if missing:
            self._eval_missing(calls, missing, results, timeout, wrong_type_is_a_reply, if_late)
        return results

    def _eval_missing(self, calls, missing, results, timeout, wrong_type_is_a_reply, if_late):
        """Re-run the calls that got NOSCRIPT with EVAL (which also caches the
        scripts), in one more parallel round. Rare: after a SCRIPT FLUSH. A late
        node's ``if_late`` is decided on both rounds' replies (review r141)."""
        evals = {
            index: [_as_eval(calls[index][n]) for n in call_nos]
            for index, call_nos in missing.items()
        }
        late = None
        if if_late is not None:
            first = {i: r for i, r in results.items() if i not in missing}  # not sent again

            def late(index, replies):
                return if_late(index, {**first, **replies})

        again = self._round(evals, timeout, wrong_type_is_a_reply, if_late=late)
        for index, call_nos in missing.items():
            if isinstance(again[index], wire.Failure):
                results[index] = again[index]
            else:
                for call_no, reply in zip(call_nos, again[index]):
                    results[index][call_no] = reply

    def _all(self, script, keys, args=()):
        batch = [(script, keys, args)]
        return {index: batch for index in range(len(self.locations))}

    @staticmethod
    def _failures(results):
        return [r for r in results.values() if isinstance(r, wire.Failure)]

    @staticmethod
    def _answered(results):
        """How many nodes replied (neither failed nor left pending)."""
        return sum(1 for r in results.values() if isinstance(r, list))

    def _majority_said(self, yes):
        """An ``enough`` for :meth:`_round`: True once a majority of nodes gave a
        first reply for which ``yes(reply)`` is true."""
        quorum = self.quorum

        def enough(results):
            said = 0
            for replies in results.values():
                if isinstance(replies, list) and yes(replies[0]):
                    said += 1
            return said >= quorum

        return enough

    def _require_majority(self, action, results):
        """Raise LockBackendError naming every node that failed unless a majority of
        all the nodes answered ``results`` (a round on every node)."""
        failed = self._failures(results)
        answered = self._answered(results)
        if answered < self.quorum:
            raise LockBackendError(self.alias, self._quorum_message(action, answered, failed))

    def _quorum_message(self, action, answered, failed):
        count = (
            "no Redis node answered"
            if answered == 0
            else (f"only {answered} of {len(self.locations)} Redis nodes answered")
        )
        return (
            f"{action} failed: {count}, and a majority needs {self.quorum} "
            f"({'; '.join(map(str, failed))})"
        )

    # -- the atomic operations ----------------------------------------------------

    def acquire(self, name, token, ttl, owner, wait=0.0):
        """Returns ``AcquireResult.won(fencing)`` when a majority granted the lock
        within its validity, else ``.lost(retry_after)`` (a contention, as a majority
        of the trusted nodes reported it). Raises LockBackendError when fewer than a
        majority of the nodes answered, or than a majority of trusted nodes (some sit
        out after losing their data). ``wait`` is not used (no waiter queue)."""
        ttl_ms = self.check_ttl(ttl)
        results = self._round(
            self._all(
                _ACQUIRE,
                (*self._keys(name), self.marker_key),
                (token, ttl_ms, encode_owner(owner), self.retention_ms, 0, self.max_ttl_ms),
            ),
            # A node whose reply is late (paused, say) may still run the acquire: if
            # the others did not grant it (nor may yet: NOSCRIPT), its undo follows it
            # on the same connection, so it runs after, not before it (review r137).
            # A record there would be held by nobody until its ttl. If they did, the
            # late record is the holder's: an undo could delete it after an extend
            # counted it. By EVAL: the node may have lost its scripts (review r141).
            if_late=lambda index, replies: (
                None
                if self._may_have_won(replies)
                else [_as_eval(call) for call in self._undo_calls(name, token)]
            ),
        )
        started = results.started
        granted = {}  # node index -> fencing value
        maybe_ours = []  # nodes that granted or may have: released if we lose
        remainders = []  # ms until expiry, as the holders' nodes report it
        untrusted = {}  # node index -> ms until it votes
        for index, replies in results.items():
            if isinstance(replies, wire.Failure):
                maybe_ours.append(index)  # it may have granted before the reply was lost
                continue
            reply = replies[0]  # NODE_ACQUIRE's {won, fencing or ms left, sits out ms}
            if _is_grant(reply):
                granted[index] = int(reply[1])
                maybe_ours.append(index)
            elif reply[2] > 0:
                untrusted[index] = int(reply[2])
            else:
                remainders.append(int(reply[1]))
        failed = self._failures(results)
        exhausted = [
            f
            for f in results.values()
            if isinstance(f, wire.Failure) and TOKENS_EXHAUSTED in f.reason
        ]
        if exhausted:
            # A master has no larger token to give: the others' would be smaller than
            # the ones it gave (review r160), so nobody gets the lock.
            if maybe_ours:
                self._release_on(name, token, maybe_ours)
            raise LockBackendError(self.alias, f"acquire {name!r} refused: {exhausted[0]}")
        answered = self._answered(results)
        if answered < self.quorum or answered - len(untrusted) < self.quorum:
            if maybe_ours:
                self._release_on(name, token, maybe_ours)
            if answered < self.quorum:
                message = self._quorum_message(f"acquire {name!r}", answered, failed)
            else:
                message = self._untrusted_message(f"acquire {name!r}", answered, untrusted, failed)
            raise LockBackendError(self.alias, message)
        if untrusted:
            self._warn_untrusted(untrusted)
        if len(granted) >= self.quorum and self._valid(started, ttl_ms):
            fencing = max(granted.values())
            self._fencing_of.remember(token, fencing)
            return AcquireResult.won(fencing)
        if maybe_ours:
            self._release_on(name, token, maybe_ours)
        retry_after = min(remainders) / 1000 if remainders else None
        return AcquireResult.lost(retry_after=retry_after)

    def _untrusted_message(self, action, answered, untrusted, failed):
        sitting_out = ", ".join(
            f"{self.nodes[i].label} (votes in {ms / 1000:.0f} s)"
            for i, ms in sorted(untrusted.items())
        )
        down = f" Not answering: {'; '.join(map(str, failed))}." if failed else ""
        voters = answered - len(untrusted)
        return (
            f"{action} failed: of the {answered} Redis nodes that answered, "
            f"{f'only {voters}' if voters else 'none'} may vote, and a majority needs "
            f"{self.quorum}. "
            f"Not voting yet: {sitting_out}: each is brand-new or restarted (empty, or with "
            f"writes it may have lost) and sits out for MAX_TTL = {self.max_ttl:g} s, until "
            f"every lock it may have forgotten has expired.{down} For a brand-new set of "
            f"masters (no lock can "
            f"be held yet), run `python manage.py {TRUST_COMMAND} --backend {self.alias}` "
            f"once."
        )

    def validity(self, ttl):
        """A lock acquired with ``ttl`` is certainly held for its ttl minus the
        clock-drift allowance (the masters' clocks may run fast)."""
        return max(ttl - (ttl * self.drift_factor + DRIFT_MS / 1000), 0.0)

    def _valid(self, started, ttl_ms):
        """True if the lock has validity left: ttl - elapsed - drift > 0."""
        elapsed_ms = (time.monotonic() - started) * 1000
        return ttl_ms - elapsed_ms - (ttl_ms * self.drift_factor + DRIFT_MS) > 0

    def _may_have_won(self, replies):
        """True if a majority of nodes granted an acquire, or may yet, by its raw
        ``replies`` so far (``{index: [reply] or wire.Failure}``; NODE_ACQUIRE
        replies ``{won, fencing, sits out ms}``): a NOSCRIPT counts as a grant, its
        call being sent again with EVAL next (review r142)."""
        granted = 0
        for node_replies in replies.values():
            if isinstance(node_replies, list):
                reply = node_replies[0]
                granted += _is_grant(reply) or wire.is_no_script(reply)
        return granted >= self.quorum

    def _undo_calls(self, name, token):
        """The calls that release ``token``'s record of ``name`` on a node, if any."""
        return [(_RELEASE, self._keys(name), (token, self.retention_ms, 1000, self.fence_ms))]

    def _release_on(self, name, token, indexes):
        """Best-effort release of ``token`` on ``indexes`` (errors are ignored: the
        records expire with their ttl anyway)."""
        batch = self._undo_calls(name, token)
        self._round({i: batch for i in indexes})

    def _warn_untrusted(self, untrusted):
        for index, ms in untrusted.items():
            node = self.nodes[index]
            node.log_once(
                "untrusted",
                logging.WARNING,
                "Redlock %r: node %s is new or restarted (empty, or with writes it may have "
                "lost) and does not vote for %.0f s more (MAX_TTL = %g s, the "
                "delayed-restart rule). For a "
                "brand-new set of masters run `manage.py %s --backend %s` once.",
                self.alias,
                node.label,
                ms / 1000,
                self.max_ttl,
                TRUST_COMMAND,
                self.alias,
            )

    def _count(self, results):
        """The number of nodes whose single reply is 1."""
        return sum(
            1 for replies in results.values() if isinstance(replies, list) and replies[0] == 1
        )

    def _majority_confirmed(self, action, results, what):
        """Whether a majority of the nodes replied 1 to ``action``: True if they did,
        False if so many replied otherwise that no majority can have. Raises
        LockBackendError when fewer than a majority answered, or when the nodes
        that did not answer could have made a majority (``what`` names what is then
        unknown): a node that timed out may have run the script, so "no" would be a
        guess, and one that would destroy a lock that is still held."""
        self._require_majority(action, results)
        confirmed = self._count(results)
        if confirmed >= self.quorum:
            return True
        failed = self._failures(results)
        if confirmed + len(failed) >= self.quorum:
            raise LockBackendError(
                self.alias,
                f"{action} failed: only {confirmed} of {len(self.locations)} nodes "
                f"confirmed it and {len(failed)} did not answer; whether a majority "
                f"{what} is unknown ({'; '.join(map(str, failed))})",
            )
        return False

    def release(self, name, token):
        """Release on every node. True if a majority held our token and deleted it;
        False if too many nodes answered that it was not ours for a majority to have
        held it; LockBackendError if too few answered to tell."""
        action = f"release {name!r}"
        # Every master remembers the largest token of the majority, not only its own:
        # a later majority shares a master with the one that released, and mints
        # above it (see the module docstring, "Fencing tokens").
        fencing = self._fencing_of.pop(token)
        results = self._round(
            self._all(
                _RELEASE,
                self._keys(name),
                (
                    token,
                    self.retention_ms,
                    1000,
                    self.fence_ms,
                    "" if fencing is None else fencing,
                ),
            ),
            enough=self._said_one_by_majority,
        )
        return self._majority_confirmed(action, results, "held it")

    def extend(self, name, token, ttl):
        """Set the expiry to now + ttl on every node holding our token. True if a
        majority did within the validity; else what is left of the lock is released
        and False returned. LockBackendError, releasing nothing, if fewer than a
        majority answered or the nodes that did not could have made one."""
        ttl_ms = self.check_ttl(ttl)
        fencing = self._fencing_of.get(token)
        results = self._round(
            self._all(
                _EXTEND,
                (self._keys(name)[0],),
                (token, ttl_ms, self.retention_ms, "" if fencing is None else fencing),
            ),
            enough=self._said_one_by_majority,
        )
        extended = self._majority_confirmed(f"extend {name!r}", results, "extended it")
        if extended and self._valid(results.started, ttl_ms):
            return True
        self._release_on(name, token, range(len(self.locations)))
        return False

    def owns(self, name, token):
        """True if a majority of nodes hold ``name`` under ``token``, not expired.
        LockBackendError if fewer than a majority answered, or the nodes that did
        not could have made one."""
        results = self._round(self._all(_OWNS, (self._keys(name)[0],), (token,)))
        return self._majority_confirmed(f"check {name!r}", results, "holds it")

    # -- records: the majority view ------------------------------------------------

    def _merge(self, name, replies):
        """``(owner token, LockInfo)`` from the nodes' ``[now, fields]`` replies (or
        WRONGTYPE errors), or ``(None, None)``; the token is None for an unreadable
        record.

        The token recorded on most nodes wins. When a majority carry it, the lock is
        reported as its latest-expiring record (held until every one of them has
        expired: a conservative view for waiters). A token on a minority only is
        not a lock anyone holds by the majority rule: it is reported stale (a
        leftover of a failed attempt, or of a holder whose nodes were lost). Records
        that cannot be read group together, and show as one unreadable, stale
        record when they are the most common.
        """
        nows = [int(r[0]) for r in replies if not isinstance(r, ResponseError)]
        # A key of the wrong type comes with no clock reading of its node's: another
        # node's serves (the record is shown expired "now" in any case).
        fallback_now = max(nows) if nows else int(time.time() * 1000)
        by_token = {}
        for reply in replies:
            if isinstance(reply, ResponseError):
                token, info = None, LockInfo.unreadable(name, self.alias, fallback_now, reply)
            else:
                now, fields = reply
                if not fields:
                    continue
                token, info = record_info(name, self.alias, now, fields)
            by_token.setdefault(token, []).append(info)
        if not by_token:
            return None, None

        def remainder(info):
            return info.expires_at_ms - info.now_ms

        token, infos = max(
            by_token.items(), key=lambda item: (len(item[1]), max(map(remainder, item[1])))
        )
        if token is None:
            return None, infos[0]
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
        return token, best

    def _replies(self, results, position=0):
        """The ``position``-th reply of every node that answered."""
        return [r[position] for r in results.values() if not isinstance(r, wire.Failure)]

    def get(self, name):
        """The majority view of ``name`` (see _merge), or None. LockBackendError if
        fewer than a majority answered."""
        results = self._round(self._all(_GET, (self._keys(name)[0],)), wrong_type_is_a_reply=True)
        self._require_majority(f"get {name!r}", results)
        return self._merge(name, self._replies(results))[1]

    def get_many(self, names):
        """``{name: LockInfo or None}``, each the majority view as :meth:`get` gives
        it, with one round on the nodes per GET_MANY_CHUNK names (each round may take
        BATCH_TIMEOUT). LockBackendError if fewer than a majority answered."""
        names = list(dict.fromkeys(names))
        found = {}
        for start in range(0, len(names), GET_MANY_CHUNK):
            chunk = names[start : start + GET_MANY_CHUNK]
            calls = [(_GET, (self._keys(name)[0],), ()) for name in chunk]
            results = self._round(
                {i: calls for i in range(len(self.locations))},
                timeout=BATCH_TIMEOUT,
                wrong_type_is_a_reply=True,
            )
            self._require_majority(f"get {len(chunk)} locks", results)
            for position, name in enumerate(chunk):
                found[name] = self._merge(name, self._replies(results, position))[1]
        return found

    def delete(self, name, fencing_token=None):
        """Force-release ``name`` on every node that answers. Returns the majority view
        of what was removed, or None; LockBackendError if fewer than a majority
        answered (the lock may then still be held by the others).

        With ``fencing_token``: only if the majority view carries it; then only that
        acquisition's records go (released by its owner token, node by node, so a
        record of a later holder stays), or, for an unreadable record (``0``), the
        nodes' records that are unreadable too."""
        action = f"delete {name!r}"
        keys = self._keys(name)
        if fencing_token is not None:
            results = self._round(self._all(_GET, (keys[0],)), wrong_type_is_a_reply=True)
            self._require_majority(action, results)
            token, info = self._merge(name, self._replies(results))
            if info is None or info.fencing_token != fencing_token:
                return None
            if token is not None:
                results = self._round(
                    self._all(
                        _RELEASE,
                        keys,
                        (token, self.retention_ms, 1000, self.fence_ms, info.fencing_token),
                    )
                )
                self._require_majority(action, results)
                return info if self._count(results) else None
        results = self._round(
            self._all(
                _DELETE,
                keys,
                (
                    self.retention_ms,
                    1000,
                    self.fence_ms,
                    "",
                    "" if fencing_token is None else fencing_token,
                ),
            ),
            wrong_type_is_a_reply=True,
        )
        self._require_majority(action, results)
        return self._merge(name, self._replies(results))[1]

    # -- trusting new nodes -------------------------------------------------------

    def node_status(self):
        """Return a :class:`NodeStatus` per master, in ``LOCATION`` order: whether it
        votes, and if not, how long until it does. Writes nothing itself (a new
        connection records the server's run, see RESTART_CHECK)."""
        results = self._round(self._all(_STATUS, (self.marker_key,)))
        statuses = []
        for index, node in enumerate(self.nodes):
            replies = results[index]
            if isinstance(replies, wire.Failure):
                statuses.append(NodeStatus(node.label, error=replies.reason))
                continue
            now, after = replies[0]
            votes_in = None if after is None else max(int(after) - int(now), 0) / 1000
            statuses.append(NodeStatus(node.label, votes_in=votes_in))
        return statuses

    def trust_nodes(self):
        """Mark every reachable node trusted now, overriding the delayed-restart rule.

        Only for a brand-new set of masters (or one restarted while *certainly* no
        lock was held): it is how two holders would get in after a real restart.
        ``manage.py trustlocknodes`` calls it after a confirmation. Returns the
        labels of the nodes marked.
        """
        results = self._round(self._all(_TRUST, (self.marker_key,)))
        return [
            self.nodes[i].label
            for i, r in sorted(results.items())
            if not isinstance(r, wire.Failure)
        ]

    # -- listing and clearing -----------------------------------------------------

    def _scan(self, index, match):
        """Yield the lock keys matching ``match`` on node ``index``, one SCAN batch at
        a time (maybe none). Raises _ScanFailed naming the node if it fails."""

        def scan(cursor):
            results = self._round(
                {
                    index: [
                        (
                            None,
                            ("SCAN", cursor, "MATCH", match, "COUNT", SCAN_COUNT, "TYPE", "hash"),
                            (),
                        )
                    ]
                },
                timeout=self.scan_timeout,
            )
            if isinstance(results[index], wire.Failure):
                raise _ScanFailed(results[index])
            return results[index][0]

        return scan_batches(scan)

    def _batches(self, action, glob):
        """Yield ``(names, {node index: [[now, fields] or error per name] or
        wire.Failure})`` for every SCAN batch of every node, each name once: a name
        found on node i is skipped if a node scanned before i has it too. Only names
        that ``glob`` (a compiled glob, or None) matches. A node that fails is
        skipped; LockBackendError as soon as fewer than a majority can answer."""
        match = f"{self._match_head}{redis_match(glob) if glob else '*'}}}:lock"
        everyone = range(len(self.locations))
        scanned = []
        failed = []
        for index in everyone:
            try:
                for keys in self._scan(index, match):
                    names = [self._name_from_key(key) for key in keys]
                    if glob is not None:
                        # SCAN's MATCH was a superset: our own glob decides.
                        names = [n for n in names if glob.match(n)]
                    if not names:
                        continue
                    calls = [(_GET, (self._keys(n)[0],), ()) for n in names]
                    results = self._round(
                        {i: calls for i in everyone},
                        timeout=BATCH_TIMEOUT,
                        wrong_type_is_a_reply=True,
                    )
                    self._require_majority(action, results)
                    keep = [
                        j
                        for j in range(len(names))
                        if not any(self._has_record(results[k], j) for k in scanned)
                    ]
                    if keep:
                        yield (
                            [names[j] for j in keep],
                            {
                                i: r if isinstance(r, wire.Failure) else [r[j] for j in keep]
                                for i, r in results.items()
                            },
                        )
            except _ScanFailed as exc:
                failed.append(exc.failure)
                answered = len(self.locations) - len(failed)
                if answered < self.quorum:
                    raise LockBackendError(
                        self.alias, self._quorum_message(action, answered, failed)
                    ) from None
                continue
            scanned.append(index)

    @staticmethod
    def _has_record(replies, j):
        return (
            not isinstance(replies, wire.Failure)
            and not isinstance(replies[j], ResponseError)
            and bool(replies[j][1])
        )

    def _compile(self, name_glob):
        """The compiled glob (None for "every name"); ValueError/TypeError naming a
        malformed one, before anything is sent."""
        return compile_glob(name_glob) if name_glob else None

    def list(self, *, state=None, name_glob=None):
        """Yield the majority view of every lock found on any node, each name once,
        one SCAN batch at a time (unsorted). Raises ValueError for an unknown state
        or a malformed glob, LockBackendError when fewer than a majority of the nodes
        answer."""
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}.")
        return self._iter_infos(state, self._compile(name_glob))

    def _iter_infos(self, state, glob):
        for names, results in self._batches("list", glob):
            for j, name in enumerate(names):
                _token, info = self._merge(
                    name, [r[j] for r in results.values() if not isinstance(r, wire.Failure)]
                )
                if info is not None and (state is None or info.state == state):
                    yield info

    def clear(
        self, *, include_held=False, name_glob=None, older_than=None, dry_run=False, progress=None
    ):
        """Remove the locks that ``list`` shows as stale (held ones too with
        ``include_held``) from every node. Each node re-checks atomically, by its own
        clock, that its record is removable (a lock re-acquired meanwhile is kept);
        the node marker is never touched. LockBackendError
        when fewer than a majority of the nodes answer."""
        glob = self._compile(name_glob)
        result = ClearResult(self.alias)
        older_than_ms = "" if older_than is None else int(older_than * 1000)
        args = (
            int(bool(include_held)),
            self.retention_ms,
            1000,
            older_than_ms,
            int(bool(dry_run)),
            self.fence_ms,
        )
        for names, results in self._batches("clear", glob):
            chosen = []  # (name, the majority view's fencing token: every master keeps it)
            for j, name in enumerate(names):
                _token, info = self._merge(
                    name, [r[j] for r in results.values() if not isinstance(r, wire.Failure)]
                )
                if info is not None and (include_held or info.is_stale):
                    chosen.append((name, info.fencing_token))
            if not chosen:
                continue
            calls = [(_CLEAR, self._keys(n), (*args, fencing)) for n, fencing in chosen]
            chosen = [n for n, _ in chosen]
            done = self._round(
                {i: calls for i in range(len(self.locations))},
                timeout=BATCH_TIMEOUT,
                wrong_type_is_a_reply=True,
            )
            self._require_majority("clear", done)
            removed = [
                name
                for j, name in enumerate(chosen)
                if any(not isinstance(r, wire.Failure) and r[j] == 1 for r in done.values())
            ]
            if removed:
                result.names.extend(removed)
                if progress is not None:
                    progress(removed)
        return result


class _BoundedMap:
    """A thread-safe dict of at most ``size`` entries, the oldest dropped first."""

    def __init__(self, size):
        self.size = size
        self._items = {}
        self._guard = threading.Lock()

    def remember(self, key, value):
        with self._guard:
            self._items[key] = value
            if len(self._items) > self.size:
                del self._items[next(iter(self._items))]

    def get(self, key):
        return self._items.get(key)

    def pop(self, key):
        with self._guard:
            return self._items.pop(key, None)


class _ScanFailed(Exception):
    """A node's SCAN failed (carries its wire.Failure)."""

    def __init__(self, failure):
        super().__init__(str(failure))
        self.failure = failure
