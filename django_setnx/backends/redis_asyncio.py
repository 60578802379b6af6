"""The Redis backend's asyncio client: the same server and settings as its redis-py
client, through ``redis.asyncio``, so that coroutines acquire, release, extend and
wait without a thread each.

A ``redis.asyncio`` connection belongs to the event loop it was made in, so there
is one client per running loop (see ``RedisBackend._aconnection``). It is built
from the sync client's connection settings (``LOCATION`` and ``CONNECTION_KWARGS``,
or a django-redis cache's pool, ``OPTIONS["CACHE"]``), with the backend's own
policies: no retries, and every new connection checks its server's eviction policy
before any lock command runs on it (``AsyncEvictionCheck``). A shared django-redis
pool is never used from asyncio: the async client has a pool of its own.

Plain connections (TCP, TLS, Unix socket) are supported. For Sentinel, Cluster, a
custom ``CLIENT_CLASS``, or a TLS setting that ``redis.asyncio`` cannot honour (OCSP
validation), ``async_client_from`` returns None and the backend's async methods fall
back to running the sync ones in threads.
"""

import asyncio
import functools
import hashlib
import inspect
import select

import redis
from redis import asyncio as redis_asyncio
from redis.asyncio import connection as async_connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .aio import cancellations, mark_unsent, raise_lost_cancellation, wait_at_most
from .redis import _should_reconnect, get_connection_args

#: The connection settings carried over from the sync client's pool (what a user
#: sets through LOCATION and CONNECTION_KWARGS); redis-py's internal objects of the
#: sync pool (its retry policy, parser, maintenance handlers) are not.
USER_CONNECTION_KWARGS = frozenset(
    {
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "credential_provider",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "encoding",
        "encoding_errors",
        "decode_responses",
        "client_name",
        "health_check_interval",
        "protocol",
        "lib_name",
        "lib_version",
    }
)

#: "No limit" for redis.asyncio's ConnectionPool (it reads None as 100).
UNBOUNDED = 2**31
#: At most this many lock commands of one event loop are in flight at once, each on
#: a connection of its own; more wait for a slot. A burst of a thousand coroutines
#: acquiring at once then opens this many connections, not a thousand (Redis runs
#: commands one at a time: more in flight would only queue on the server).
IN_FLIGHT = 32

#: What ``ConnectionPool.get_connection`` is called with: redis-py < 5.3 requires a
#: command name, later versions deprecate it (with a warning on every call).
GET_CONNECTION_ARGS = get_connection_args(async_connection.ConnectionPool)

#: redis-py's sync connection classes and their asyncio twins.
ASYNC_CONNECTION_CLASSES = {
    redis.connection.Connection: async_connection.Connection,
    redis.connection.SSLConnection: async_connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection: async_connection.UnixDomainSocketConnection,
}


@functools.cache
def _accepted_kwargs(connection_class):
    """The keyword arguments ``connection_class`` (and the classes it passes its
    ``**kwargs`` on to) take by name."""
    names = set()
    for klass in connection_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(
                parameter.name
                for parameter in inspect.signature(init).parameters.values()
                if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            )
    return frozenset(names)


def async_client_from(sync_client, connect_check):
    """A ``redis.asyncio.Redis`` reaching the server ``sync_client`` reaches, with
    the same user settings, no retries, and ``connect_check`` (an AsyncEvictionCheck,
    or None) run on every new connection. Returns None if ``sync_client`` is not a plain
    ``redis.Redis`` on a plain connection pool (Sentinel, Cluster, a custom class), or
    if its pool sets a TLS option that only redis-py's sync connection has (OCSP
    validation, ``ssl_validate_ocsp`` and its kin): the async calls then go through
    the sync client, which honours it (review r143: they all failed with a
    TypeError)."""
    pool = getattr(sync_client, "connection_pool", None)
    if (
        type(sync_client) is not redis.Redis
        or pool is None
        or type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool)
    ):
        return None
    connection_class = ASYNC_CONNECTION_CLASSES.get(pool.connection_class)
    if connection_class is None:
        return None
    accepted = _accepted_kwargs(connection_class)
    kwargs = {}
    for key, value in pool.connection_kwargs.items():
        if key.startswith("ssl_"):
            if key not in accepted:
                if value is None or value is False:
                    continue  # the sync default: nothing asked for
                return None
            kwargs[key] = value
        elif key in USER_CONNECTION_KWARGS:
            kwargs[key] = value
    kwargs["retry"] = Retry(NoBackoff(), 0)
    if connect_check is not None:
        kwargs["redis_connect_func"] = connect_check.on_connect
    # The pool itself is unbounded and the commands are bounded instead (IN_FLIGHT,
    # see BoundedScript): a burst never fails with "Too many connections" and never
    # opens a connection per coroutine. (A BlockingConnectionPool would bound it too,
    # at ~20% of the cost of every command.) Waiting coroutines share one connection
    # (InboxWaits).
    async_pool = redis_asyncio.ConnectionPool(
        connection_class=connection_class, max_connections=UNBOUNDED, **kwargs
    )
    return redis_asyncio.Redis(connection_pool=async_pool)


class BoundedScript:
    """A script of an event loop's client, called with ``EVALSHA`` on a connection of
    the client's pool, taking one of ``slots`` (an ``asyncio.Semaphore`` of IN_FLIGHT
    shared by the loop's scripts) while it runs.

    The command goes straight to the connection (written as ``send_command`` would,
    see _send_packed, and its reply read as ``read_response`` would, with one timer
    per loop instead of one per command, see ReadDeadlines: what
    ``Redis.execute_command`` does underneath, without its retry wrapper, which our
    client disables anyway, and its per-command hooks): a round trip through
    ``redis.asyncio`` costs more than one through the sync client, and this keeps
    the difference to the event loop's own share. A connection the server dropped while it was idle is replaced before
    anything is sent on it (``_closed_by_server``). A script missing on the server
    (a restart, ``SCRIPT FLUSH``) is loaded and run again, as redis-py's
    ``Script`` does. A connection whose reply was not read in full (an error other
    than Redis' own, a cancellation) is disconnected before it goes back to the pool,
    so no reply can reach the next command.
    """

    def __init__(self, client, source, slots, deadlines=None):
        self.pool = client.connection_pool
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.slots = slots
        self.deadlines = deadlines
        self.direct = _can_take_directly(self.pool)

    async def __call__(self, keys, args=()):
        before = cancellations()
        try:
            result = await self._call(keys, args)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if cancellations() > before:  # dropped (see aio), then the call failed
                raise asyncio.CancelledError from exc
            raise
        # See aio: the script ran; the caller learns its result from the exception.
        raise_lost_cancellation(before, result)
        return result

    async def _call(self, keys, args):
        async with self.slots:
            try:
                connection = await self._take()  # connects (ensure_connection)
            except Exception as error:
                mark_unsent(error)  # the command never left: nothing to undo
                raise
            try:
                if _closed_by_server(connection):
                    await connection.disconnect()
                    try:
                        await connection.connect()
                    except Exception as error:
                        mark_unsent(error)
                        raise
                try:
                    return await self._run(connection, keys, args)
                except redis.exceptions.NoScriptError:
                    await connection.send_command("SCRIPT", "LOAD", self.source)
                    await connection.read_response()
                    return await self._run(connection, keys, args)
            except redis.exceptions.ResponseError:
                raise  # Redis answered: the connection is in step
            except BaseException:
                await connection.disconnect()
                raise
            finally:
                await self._give_back(connection)

    async def _take(self):
        """A connection of the pool, ready to send. Taken from the pool's idle list
        directly where we can (see _can_take_directly): ``get_connection`` and
        ``release`` take the pool's asyncio lock and update its metrics, about 13 µs
        of CPU per command with redis-py 8. The pool's own readiness check
        (``ensure_connection``: connect, and reconnect one with something to read)
        still runs."""
        pool = self.pool
        if not self.direct:
            return await pool.get_connection(*GET_CONNECTION_ARGS)
        idle = pool._available_connections
        connection = idle.pop() if idle else pool.make_connection()
        # In use, as the pool counts it: its disconnect() (aclose) and its handling
        # of a maintenance notice (MOVING: a new host) reach the connection too.
        pool._in_use_connections.add(connection)
        try:
            await pool.ensure_connection(connection)
        except BaseException:
            self._give_back_now(connection)  # as the pool's get_connection releases it
            raise
        return connection

    async def _give_back(self, connection):
        if not self.direct:
            await self.pool.release(connection)
            return
        if _should_reconnect(connection) or is_closed(self.pool):
            # A server maintenance notice, or aclose() ran while this command was
            # in flight (the connection may have been connecting then, out of the
            # disconnect's reach).
            await connection.disconnect()
        self._give_back_now(connection)

    def _give_back_now(self, connection):
        self.pool._in_use_connections.discard(connection)
        self.pool._available_connections.append(connection)

    async def _run(self, connection, keys, args):
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        writer = getattr(connection, "_writer", None)
        if writer is None:  # not the stream connection we know: redis.asyncio's send
            await connection.send_command(*command)
        else:
            if _SYNC_PACKING == HIREDIS_UTF8:
                packed = [_pack(command)]
            elif _SYNC_PACKING == HIREDIS_ENCODED:
                encode = connection.encoder.encode
                packed = [_pack(tuple(encode(arg) for arg in command))]
            else:
                packed = connection.pack_command(*command)
            await _send_packed(connection, writer, packed)
        if self.deadlines is None:
            return await connection.read_response()
        return await self.deadlines.read_reply(connection)


try:
    from hiredis import pack_command as _pack
except ImportError:  # redis.asyncio's own packer, through send_command
    _pack = None  # type: ignore[assignment]


#: How redis-py's sync connections pack a command, which the asyncio client must
#: match byte for byte (a lock name must be the same key to both clients):
#: hiredis on the arguments as given, which writes str as UTF-8 whatever the
#: ``encoding`` option (redis-py before 8.2); hiredis on the arguments encoded by
#: the connection's encoder, which follows ``encoding`` (redis-py 8.2 and later);
#: or redis-py's pure-Python packer (no hiredis), which follows it too.
HIREDIS_UTF8, HIREDIS_ENCODED, PYTHON_PACKER = "hiredis", "hiredis-encoded", "python"


def _sync_packing():
    """Which of the above redis-py's sync connections do. The asyncio client packs
    with hiredis where they do (redis.asyncio's own packer is pure Python, about 7
    µs a command)."""
    if _pack is None:
        return PYTHON_PACKER
    try:
        packer = redis.connection.Connection()._command_packer
    except Exception:  # noqa: BLE001 - an unknown redis-py: its own packer then
        return PYTHON_PACKER
    if type(packer).__name__ != "HiredisRespSerializer":
        return PYTHON_PACKER
    return HIREDIS_ENCODED if getattr(packer, "_encode", None) is not None else HIREDIS_UTF8


_SYNC_PACKING = _sync_packing()


async def _send_packed(connection, writer, packed):
    """``connection.send_packed_command(packed)`` (a list of bytes), without its
    ``asyncio.wait_for`` around every write. That costs a Task per command before
    Python 3.12 (about 11 µs), and before 3.12 it drops a cancellation that arrives
    in the step the write completes (see aio; on 3.10 nothing can tell it was
    dropped). A lock command is a few hundred bytes written on a connection with
    nothing else in flight (each command's reply is read before the next is sent):
    the kernel takes it whole at once, and there is nothing to wait for. Only when
    it did not (an owner record of megabytes, a server that stopped reading) is the
    rest drained as redis-py does it, for ``socket_timeout`` at most. Otherwise as
    redis-py does it too: the health check first, and a connection on which the
    write failed is dropped."""
    await connection.check_health()
    try:
        writer.writelines(packed)
        if writer.transport.get_write_buffer_size():
            await asyncio.wait_for(writer.drain(), connection.socket_timeout)
    except asyncio.TimeoutError:
        await connection.disconnect(nowait=True)
        raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        await connection.disconnect(nowait=True)
        raise redis.exceptions.ConnectionError(f"Error while writing to socket: {exc}") from exc
    except BaseException:
        await connection.disconnect(nowait=True)
        raise


class _Read:
    """A reply awaited by ``task`` until ``deadline`` (loop time; None: no limit)."""

    __slots__ = ("deadlines", "deadline", "task", "expired")

    def __init__(self, deadlines, deadline, task):
        self.deadlines = deadlines
        self.deadline = deadline
        self.task = task
        self.expired = False

    def reschedule(self, deadline):
        """Move the deadline (``asyncio.Timeout``'s method, which redis-py calls on
        the read in flight when a maintenance notice relaxes or restores the
        connection's timeout)."""
        self.deadline = deadline
        if deadline is not None:
            self.deadlines.arm(deadline)


class ReadDeadlines:
    """``socket_timeout`` on the replies to one event loop's lock scripts, kept by
    one timer for all of them.

    redis.asyncio's ``read_response`` enters an ``asyncio.timeout`` for every reply:
    a timer scheduled and cancelled per command, a good part of what an
    uncontended ``aacquire`` + ``arelease`` costs more than the sync pair. A lock
    command's reply takes well under a millisecond and the timeout is seconds, so
    instead the reads in flight are noted (:meth:`read_reply`) and one timer, set
    for the earliest deadline, looks at them when it fires: a read past its deadline
    has its task cancelled, and that cancellation becomes redis-py's
    ``TimeoutError``, when the per-command timer would have fired. The timer then
    sets itself for the next deadline, if a read is in flight: it fires about once
    per ``socket_timeout`` while commands keep coming, never while idle. A read in
    flight is the connection's ``_active_read_timeout``, as redis-py's timeout is,
    so that a maintenance notice (RESP3) still relaxes it.

    Telling our cancellation from the caller's takes ``Task.uncancel`` (Python
    3.11+); without it, replies are read through ``read_response``.
    """

    def __init__(self, loop):
        self.loop = loop
        self.reads = set()
        self.timer = None

    async def read_reply(self, connection):
        """The reply to the command just sent on ``connection`` (an error reply is
        raised, as ``read_response`` does). Raises redis-py's ``TimeoutError`` when
        none came within the connection's ``socket_timeout`` and ``ConnectionError``
        when the connection broke; either way, and on a cancellation, the connection
        is disconnected (a reply may still be on its way)."""
        timeout = connection.socket_timeout
        if timeout is None or not _CAN_UNCANCEL:
            return await connection.read_response()
        loop = self.loop
        task = asyncio.current_task()
        cancelling = task.cancelling()
        read = _Read(self, loop.time() + timeout, task)
        self.reads.add(read)
        self.arm(read.deadline)
        if _RELAXES_READS:
            connection._active_read_timeout = read
        try:
            if connection.protocol in (3, "3"):
                response = await connection._parser.read_response(
                    disable_decoding=False, push_request=False
                )
            else:
                response = await connection._parser.read_response(disable_decoding=False)
        except BaseException as exc:
            # Out of the timer's reach before anything else is awaited, so that it
            # cannot cancel us again while we clean up.
            self._done(connection, read)
            await connection.disconnect(nowait=True)
            if isinstance(exc, asyncio.CancelledError):
                if read.expired and task.uncancel() <= cancelling:
                    raise redis.exceptions.TimeoutError(
                        f"Timeout reading from {_host_of(connection)}"
                    ) from None
                raise
            if isinstance(exc, OSError):
                raise redis.exceptions.ConnectionError(
                    f"Error while reading from {_host_of(connection)} : {exc.args}"
                ) from exc
            raise
        self._done(connection, read)
        if connection.health_check_interval:
            connection.next_health_check = loop.time() + connection.health_check_interval
        if isinstance(response, redis.exceptions.ResponseError):
            raise response from None
        return response

    def _done(self, connection, read):
        if _RELAXES_READS:
            connection._active_read_timeout = None
        self.reads.discard(read)

    def arm(self, deadline):
        """Make sure the timer fires by ``deadline``."""
        timer = self.timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self.timer = self.loop.call_at(deadline, self._expire)

    def _expire(self):
        """The timer: cancel the reads past their deadline, and set the timer for
        the earliest of the others."""
        self.timer = None
        now = self.loop.time()
        earliest = None
        for read in self.reads:
            deadline = read.deadline
            if deadline is None:
                continue
            if deadline <= now:
                if not read.expired:
                    read.expired = True
                    read.task.cancel()
            elif earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None:
            self.timer = self.loop.call_at(earliest, self._expire)


#: Whether a task can tell our cancellation from its caller's (Python 3.11+).
_CAN_UNCANCEL = hasattr(asyncio.Task, "uncancel")
#: Whether redis-py's maintenance notices relax the timeout of a read in flight (its
#: ``_active_read_timeout``, redis-py 7+).
_RELAXES_READS = hasattr(async_connection.AbstractConnection, "_reschedule_active_read_timeout")


def _host_of(connection):
    host_error = getattr(connection, "_host_error", None)
    return host_error() if host_error is not None else "the Redis server"


def _can_take_directly(pool):
    """Whether BoundedScript may take connections of ``pool`` (one our client made:
    a plain ``redis.asyncio.ConnectionPool``, unbounded) from its idle list and give
    them back without the pool's lock and metrics: False on a redis-py whose pool
    has no such list, no in-use set or no ``ensure_connection``. The connections
    stay the pool's own: ``get_connection`` (the loop's waits) uses them too, and a
    taken one is in the in-use set, so the pool's ``disconnect`` (``aclose()``) and
    maintenance notices reach every one of them."""
    return (
        type(pool) is async_connection.ConnectionPool
        and isinstance(getattr(pool, "_available_connections", None), list)
        and isinstance(getattr(pool, "_in_use_connections", None), set)
        and hasattr(pool, "ensure_connection")
    )


#: The attribute marking a loop's pool that RedisBackend.aclose() closed.
_CLOSED = "django_setnx_closed"


async def close_pool(pool):
    """Disconnect ``pool`` (a loop's, built by async_client_from) for good: its
    connections, and those of lock commands still in flight when they end."""
    setattr(pool, _CLOSED, True)
    await pool.disconnect()


def is_closed(pool):
    return getattr(pool, _CLOSED, False)


def _closed_by_server(connection):
    """Whether the server closed (or wrote to) this idle connection since it was last
    used, by the kernel's account. The pool checks that too, through the asyncio
    stream, but the stream learns of it only when the event loop next polls: a
    connection that the server dropped a moment ago (``CLIENT KILL``, its
    ``timeout``, a restart) would be handed out, and the command sent on it would
    fail. One ``select`` with no timeout (the sync client's pool does the same)."""
    writer = getattr(connection, "_writer", None)
    sock = writer.transport.get_extra_info("socket") if writer is not None else None
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):  # closed under us: let the command find out
        return False
    return bool(readable)


class AsyncEvictionCheck:
    """The async ``redis_connect_func`` (:meth:`on_connect`): after the handshake, read the server's
    eviction policy on the new connection and raise what ``refusal_error`` makes of
    a refusal (see ``redis.eviction_refusal``), so no lock command runs on a server
    that may evict lock keys. ``refusal_for(maxmemory, policy, server)`` returns the
    message or None; ``unknown_policy(error, server)`` the message when neither
    command answers."""

    def __init__(self, refusal_for, unknown_policy, refusal_error):
        self.refusal_for = refusal_for
        self.unknown_policy = unknown_policy
        self.refusal_error = refusal_error

    async def on_connect(self, connection):
        """redis.asyncio's ``redis_connect_func`` contract (it must be a coroutine
        function: a callable object is not awaited)."""
        await connection.on_connect()
        server = getattr(connection, "path", None) or f"{connection.host}:{connection.port}"
        try:
            maxmemory, policy = await _eviction_settings(connection)
        except redis.exceptions.ResponseError as exc:
            refusal = self.unknown_policy(exc, server)
        else:
            refusal = self.refusal_for(maxmemory, policy, server)
        if refusal is not None:
            raise self.refusal_error(refusal)


async def _eviction_settings(connection):
    """``(maxmemory, policy)`` read on one asyncio connection, as
    ``read_eviction_settings`` reads them on a sync one."""
    from .redis_eviction import config_reply, info_reply, settings_from_config, settings_from_info

    try:
        await connection.send_command("CONFIG", "GET", "maxmemory*")
        return settings_from_config(config_reply(await connection.read_response()))
    except redis.exceptions.ResponseError:
        await connection.send_command("INFO", "memory")
        return settings_from_info(info_reply(await connection.read_response()))


class InboxWaits:
    """The inbox waits of one event loop's coroutines, on one connection.

    Each waiting coroutine would otherwise hold a connection of its own in a BLPOP
    (a thousand waiters: a thousand connections). Instead one task, started when the
    first coroutine waits and ending once none has for ``GRACE`` seconds, BLPOPs on
    every waiter's inbox at once and completes the future of the one whose inbox got a
    message. A coroutine that starts waiting on an inbox the BLPOP in flight does not
    cover pushes to ``control`` (a key of this object's own, expiring) so that the
    BLPOP is sent again with it. Inboxes stay covered for ``GRACE`` after their waiter
    left, so that a waiter retrying its acquire in between changes nothing.

    An inbox message is only a wake-up (the truth is in the lock record). One that
    arrives while its waiter is between two waits (retrying its acquire) is kept for
    that inbox's next wait, which returns it at once: dropped, it cost the waiter a
    whole wait period while a lock handed to it stayed unconfirmed (review r116).
    Kept messages go with their inbox, ``GRACE`` after its last wait. If the
    connection breaks, every waiter is woken: its next acquire finds out what
    happened.
    """

    GRACE = 5.0

    def __init__(self, client, control, max_block):
        self.client = client
        self.control = control
        self.max_block = max_block
        self.futures = {}  # inbox key (bytes) -> the future of its waiter, or None
        self.last_used = {}  # inbox key -> loop time of its last wait
        self.kept = {}  # inbox key -> a message that came between its waits
        self.covered = None  # the inbox keys of the BLPOP in flight, None when idle
        self.poked = False  # a poke was sent since that BLPOP was
        self.task = None

    async def wait(self, inbox, timeout):
        """Wait up to ``timeout`` seconds for a message in ``inbox``. Returns the
        message, True when the connection broke (the caller should look), or None."""
        key = inbox.encode() if isinstance(inbox, str) else inbox
        loop = asyncio.get_running_loop()
        if key in self.kept:
            self.last_used[key] = loop.time()
            return self.kept.pop(key)
        future = loop.create_future()
        self.futures[key] = future
        self.last_used[key] = loop.time()
        try:
            if self.task is None or self.task.done():
                self.task = loop.create_task(self._run())
            elif self.covered is not None and key not in self.covered and not self.poked:
                self.poked = True
                before = cancellations()
                await self._poke()
                raise_lost_cancellation(before)
            if await wait_at_most(future, timeout):
                return future.result()
            return None
        finally:
            if self.futures.get(key) is future:
                self.futures[key] = None

    async def _poke(self):
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.rpush(self.control, 1)
            pipe.pexpire(self.control, int(self.GRACE * 1000))
            await pipe.execute()

    async def _run(self):
        loop = asyncio.get_running_loop()
        try:
            while True:
                now = loop.time()
                for key in [
                    key
                    for key, future in self.futures.items()
                    if future is None and now - self.last_used[key] > self.GRACE
                ]:
                    del self.futures[key], self.last_used[key]
                    self.kept.pop(key, None)
                if not self.futures:
                    return
                keys = list(self.futures)
                self.covered, self.poked = frozenset(keys), False
                try:
                    reply = await self.client.blpop([*keys, self.control], timeout=self.max_block)
                except (redis.exceptions.RedisError, OSError):
                    self._wake_all(True)
                    return
                finally:
                    self.covered = None
                if reply is not None:
                    key, message = reply
                    future = self.futures.get(key)
                    if future is not None and not future.done():
                        future.set_result(message)
                    elif key in self.futures:  # its waiter is between two waits
                        self.kept[key] = message
        finally:
            self.covered = None

    def _wake_all(self, value):
        for future in self.futures.values():
            if future is not None and not future.done():
                future.set_result(value)
