"""Parallel request rounds over several Redis servers, on connections that a forked
process never shares: the socket layer of the Redlock backend.

A round writes every server's requests before it reads any reply, then reads them all
against one deadline, so it costs one network round trip however many servers there
are. redis-py makes every connection (``Connection``: handshake, AUTH, SELECT, TLS,
unix sockets, and the ``redis_connect_func`` hook); this module only keeps them and
moves bytes.

Why not redis-py's ``ConnectionPool`` with ``send_packed_command``/``read_response``:
its per-round cost. A checkout (``get_connection``: a health poll and metrics hooks)
and its release cost about 6 µs per server, and a socket with a timeout pays a
``poll`` before every send and receive plus two ``settimeout`` calls per read. In
the same runs of ``benchmarks/bench_redlock.py`` (3 masters), an uncontended
acquire + release through the pool took 25-45% longer than here. On the fast path
(hiredis, no TLS) each idle connection's socket is non-blocking with a hiredis
reader of its own, and a round waits for all the servers with one ``poll``. Over
TLS (whose sockets buffer decrypted data that ``poll`` cannot see) or without
hiredis, the same rounds run through redis-py's ``send_packed_command`` and
``read_response``.

**Forks.** Each connection carries the pid of the process that opened it (redis-py's
``Connection.pid``). :meth:`Server.take` never hands out a connection of another
process: after a fork (gunicorn ``--preload``, Celery prefork, ``multiprocessing``)
the child drops each inherited connection as it meets it, closing only its own copy
of the file descriptor (redis-py shuts a socket down only in the process that opened
it), and opens its own. A parent and its child therefore never read each other's
replies.

**Unread replies.** A connection goes back to its server's stack only after every
reply of its round was read; one that failed, ran out of time or was interrupted is
disconnected, so no reply can reach the next round.
"""

import inspect
import os
import select
import time

import redis
from redis.exceptions import InvalidResponse, ResponseError

try:
    import hiredis
except ImportError:
    hiredis = None  # type: ignore[assignment]

#: Shortest wait for a reply: one that has already arrived is still taken after the
#: deadline.
MIN_READ_TIMEOUT = 0.0001
#: Bytes read from a socket at once on the fast path.
READ_SIZE = 65536

#: What a failing server raises: redis-py's errors, and socket errors it lets through.
ERRORS = (redis.exceptions.RedisError, OSError)

#: redis-py >= 5.1 reads a reply with a per-call timeout.
_READ_TIMEOUT = (
    "timeout" in inspect.signature(redis.connection.Connection.read_response).parameters
)


class Failure:
    """A server that did not answer a round: down, too slow, or it failed while
    connecting (see the ``reason``)."""

    __slots__ = ("label", "reason")

    def __init__(self, label, exc):
        self.label = label
        self.reason = f"{type(exc).__name__}: {exc}"

    def __str__(self):
        return f"{self.label}: {self.reason}"


class _Link:
    """A connected redis-py connection and, on the fast path, its non-blocking
    socket, our own hiredis reader of it and a buffer to receive into."""

    __slots__ = ("buffer", "conn", "reader", "sock")

    def __init__(self, conn, fast):
        self.conn = conn
        if fast:
            self.sock = conn._sock
            self.sock.setblocking(False)
            # Error replies are returned (as ResponseError), not raised, as redis-py
            # does in read_response; every reply is then read off the connection.
            self.reader = hiredis.Reader(protocolError=InvalidResponse, replyError=ResponseError)
            self.buffer = bytearray(READ_SIZE)
        else:
            self.sock = self.reader = self.buffer = None


class Server:
    """The idle connections to one Redis server.

    ``new_connection()`` returns an unconnected redis-py connection (whose connect
    runs its ``redis_connect_func``). ``label`` names the server in errors.
    """

    def __init__(self, label, new_connection, *, tls):
        self.label = label
        self._new_connection = new_connection
        self.fast = hiredis is not None and not tls
        self._idle = []

    def __repr__(self):
        return f"<Server {self.label}>"

    def take(self):
        """A connected link of this process, idle or new (connecting may raise)."""
        pid = os.getpid()  # not a fork hook's: uWSGI forks without running them
        while True:
            try:
                link = self._idle.pop()  # list.pop/append are atomic: thread-safe
            except IndexError:
                break
            if link.conn.pid == pid:
                return link
            link.conn.disconnect()  # inherited across a fork: closes only our copy
        conn = self._new_connection()
        conn.connect()
        return _Link(conn, self.fast)

    def give_back(self, link):
        self._idle.append(link)

    def drop(self, link):
        link.conn.disconnect()

    def close(self):
        idle, self._idle = self._idle, []
        for link in idle:
            link.conn.disconnect()


def round_trip(requests, timeout):
    """Send each server its commands and read every reply, in parallel.

    ``requests`` is ``{key: (server, commands)}``, ``commands`` a list of command
    tuples; a list shared by several keys is packed once. Returns ``(results,
    started)``: ``results`` maps each key to the list of its replies (an error reply
    is a ``ResponseError`` in that list) or to a :class:`Failure`, and ``started`` is
    the monotonic time taken after connecting, before the first write. Replies are
    awaited until ``timeout`` seconds after the writes; a server that has not
    answered by then fails.
    """
    results = {}
    out = {}  # key -> (server, link, commands): checked out, not given back yet
    try:
        for key, (server, commands) in requests.items():
            try:
                out[key] = (server, server.take(), commands)
            except ERRORS as exc:
                results[key] = Failure(server.label, exc)
        _renew_closed(out, results)
        started = time.monotonic()
        if out:
            fast = next(iter(out.values()))[0].fast
            (_exchange_fast if fast else _exchange_redis_py)(out, results, timeout)
    finally:
        for server, link, _ in out.values():  # interrupted: replies may be unread
            server.drop(link)
    return results, started


def _renew_closed(out, results):
    """An idle connection has nothing to read: one that has (EOF: the server restarted
    or closed it) is reconnected now rather than failing the round. One poll for all."""
    try:
        readable = _readable(
            {link.conn._sock.fileno(): key for key, (_, link, _) in out.items()}, 0
        )
    except (OSError, ValueError):  # a socket already closed
        readable = set(out)
    for key in [key for key, (_, link, _) in out.items() if key in readable]:
        server, link, commands = out.pop(key)
        server.drop(link)
        try:
            out[key] = (server, server.take(), commands)
        except ERRORS as exc:
            results[key] = Failure(server.label, exc)


def _readable(fds, timeout):
    """The values of ``fds`` (``{fd: value}``) whose fd has data or EOF to read,
    waiting ``timeout`` seconds at most."""
    if not fds:
        return set()
    if hasattr(select, "poll"):
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        return {fds[fd] for fd, _ in poller.poll(max(timeout, 0) * 1000)}
    return {fds[fd] for fd in select.select(list(fds), [], [], max(timeout, 0))[0]}


def _packed(conn, commands, cache):
    """``commands`` as redis-py packs them for ``conn`` (a list of chunks), once per
    round for a list that several servers share."""
    request = cache.get(id(commands))
    if request is None:
        request = cache[id(commands)] = conn.pack_commands(commands)
    return request


def _packed_fast(commands, cache):
    """``commands`` packed by hiredis into one bytes object, once per round for a
    list that several servers share."""
    request = cache.get(id(commands))
    if request is None:
        request = cache[id(commands)] = b"".join(map(hiredis.pack_command, commands))
    return request


def _fail(out, results, key, exc):
    server, link, _ = out.pop(key)
    server.drop(link)
    results[key] = Failure(server.label, exc)


def _send_all(sock, data, deadline):
    """Write ``data`` to a non-blocking socket by ``deadline`` (one send usually)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            pass
        if view:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [sock], [], remaining)[1]:
                raise redis.exceptions.TimeoutError("could not write the request in time")


def _exchange_fast(out, results, timeout):
    """The round on non-blocking sockets: write every request, then one poll over
    all the sockets until every server's replies are in or the deadline passed."""
    cache = {}
    write_deadline = time.monotonic() + timeout
    for key in list(out):
        _, link, commands = out[key]
        try:
            _send_all(link.sock, _packed_fast(commands, cache), write_deadline)
        except ERRORS as exc:
            _fail(out, results, key, exc)
    deadline = time.monotonic() + timeout
    pending = {link.sock.fileno(): key for key, (_, link, _) in out.items()}
    replies = {key: [] for key in pending.values()}
    while pending:
        try:
            ready = _readable(pending, deadline - time.monotonic())
        except (OSError, ValueError) as exc:
            for key in list(pending.values()):
                _fail(out, results, key, exc)
            return
        if not ready:
            break  # the deadline passed: whoever has not answered fails below
        for key in ready:
            server, link, commands = out[key]
            try:
                size = link.sock.recv_into(link.buffer)
            except BlockingIOError:
                continue
            except OSError as exc:
                del pending[link.sock.fileno()]
                _fail(out, results, key, exc)
                continue
            if not size:
                del pending[link.sock.fileno()]
                _fail(
                    out,
                    results,
                    key,
                    redis.exceptions.ConnectionError("the server closed the connection"),
                )
                continue
            link.reader.feed(link.buffer, 0, size)
            got = replies[key]
            try:
                while len(got) < len(commands):
                    reply = link.reader.gets()
                    if reply is False:
                        break
                    got.append(reply)
            except InvalidResponse as exc:  # not Redis' protocol: the stream is lost
                del pending[link.sock.fileno()]
                _fail(out, results, key, exc)
                continue
            if len(got) == len(commands):
                del pending[link.sock.fileno()]
                del out[key]
                server.give_back(link)
                results[key] = got
    for key in list(pending.values()):
        _fail(out, results, key, redis.exceptions.TimeoutError(f"no reply within {timeout:g} s"))


def _exchange_redis_py(out, results, timeout):
    """The round through redis-py's connection methods (TLS, or no hiredis)."""
    cache = {}
    for key in list(out):
        _, link, commands = out[key]
        try:
            link.conn.send_packed_command(_packed(link.conn, commands, cache), check_health=False)
        except ERRORS as exc:
            _fail(out, results, key, exc)
    deadline = time.monotonic() + timeout
    for key in list(out):
        server, link, commands = out[key]
        got = []
        try:
            for _ in commands:
                try:
                    got.append(_read(link.conn, deadline))
                except ResponseError as exc:  # a reply: the connection is in step
                    got.append(exc)
        except ERRORS as exc:
            _fail(out, results, key, exc)
            continue
        del out[key]
        server.give_back(link)
        results[key] = got


def _read(conn, deadline):
    """The next reply on ``conn``, waiting until ``deadline`` (monotonic) at most."""
    timeout = max(deadline - time.monotonic(), MIN_READ_TIMEOUT)
    if _READ_TIMEOUT:
        return conn.read_response(timeout=timeout)
    if not conn.can_read(timeout=timeout):
        raise redis.exceptions.TimeoutError(f"no reply within {timeout:g} s")
    return conn.read_response()
