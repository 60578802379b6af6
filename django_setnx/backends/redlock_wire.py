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

**Rounds that end early.** A round may stop waiting once the replies it has settle
its outcome (``round_trip``'s ``enough``: a majority granted, say), rather than wait
for the slowest server. Each server still owing replies is reported as
:class:`Pending`, and its connection is *parked* with the calls whose replies are
due and the round's deadline. :meth:`Server.take` reads a parked connection's late replies
before it is used again, and prefers one whose replies are already in; while a node
stays slow it opens other connections, up to ``MAX_PARKED`` parked per server and
process (one more per other thread in a round at the same time), then waits for the
oldest (until its deadline at most: one whose replies do not come in time is
disconnected). A node slower than the others costs nobody its pace; a node that
stalls costs at most ``MAX_PARKED`` parked connections, plus one per other thread in
a round at the same time (an ASGI worker's async callers run their rounds in the
event loop's default executor: up to min(32, CPUs + 4) threads), then sets
the pace again as it did before (a round may then first wait up to a round's timeout
for the oldest). A late reply is still looked at: a ``NOSCRIPT`` (the node lost its
script cache: ``SCRIPT FLUSH``, a restart) means the call did not run, so it is sent
again with ``EVAL`` on the same connection (a release at any time, another call
only before its round's deadline, else its script is loaded again); any other error
goes to the server's ``on_late_error`` (see :meth:`Server._late_error`).
"""

import bisect
import inspect
import operator
import os
import select
import time

import redis
from redis.exceptions import InvalidResponse, NoScriptError, ResponseError

try:
    import hiredis
except ImportError:
    hiredis = None  # type: ignore[assignment]

#: Shortest wait for a reply: one that has already arrived is still taken after the
#: deadline.
MIN_READ_TIMEOUT = 0.0001
#: Parked connections (late replies due) a server keeps per process before a round
#: waits for the oldest rather than open another. Threads whose rounds run at the
#: same time each check it when they start, so each may park one more: the bound is
#: MAX_PARKED plus one per other thread in a round (tests/test_redlock_edges.py).
MAX_PARKED = 4
#: Bytes read from a socket at once on the fast path.
READ_SIZE = 65536
#: Seconds for which no new connection to a server is tried once its TCP connect
#: timed out (a host that drops packets: a partition, a firewall): a round connects
#: to its servers one after another before it writes anything, and every round
#: would otherwise wait a whole timeout for each such server (review r143). Rounds
#: meanwhile count it as failed at once; a round whose replies came on an idle
#: connection to it ends the wait. A refused connection fails at once, and a server
#: that took the connection but did not answer its handshake in time (stalled: it
#: may go on at any moment) is tried again by the next round. Over TLS, redis-py
#: reports a handshake that timed out as a connect that did (review r145), so TLS
#: servers are never skipped.
SKIP_AFTER_CONNECT_TIMEOUT = 1.0
#: How redis-py words a connect that timed out: the TCP connect, or over TLS the
#: TCP connect or the TLS handshake.
_CONNECT_TIMEOUT_MESSAGE = "Timeout connecting to server"

#: What a failing server raises: redis-py's errors, and socket errors it lets through.
ERRORS = (redis.exceptions.RedisError, OSError)


def is_no_script(reply):
    """True for a NOSCRIPT error reply (redis-py's NoScriptError, or the raw error of
    the fast path): the script is not cached there, and nothing ran."""
    return isinstance(reply, NoScriptError) or (
        isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT")
    )


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


class Pending:
    """A server whose replies a round did not wait for: the replies it had were
    enough (see ``round_trip``). Whatever the server did is unknown to the caller."""

    __slots__ = ("label",)

    def __init__(self, label):
        self.label = label

    def __str__(self):
        return f"{self.label}: not awaited"


class _Parked:
    """A connection left with replies still due (see ``round_trip``'s ``enough``):
    the commands they answer, in order, the round's deadline (monotonic) by which
    they should all be in, and the round's timeout (for a call sent again)."""

    __slots__ = ("deadline", "link", "owed", "timeout")

    def __init__(self, link, owed, deadline, timeout):
        self.link = link
        self.owed = owed
        self.deadline = deadline
        self.timeout = timeout


#: The sort key of parked connections. attrgetter runs in C, so an insort is not
#: interrupted by another thread (a key written in Python could be, and index past
#: the end of a list another thread just shortened).
_deadline_of = operator.attrgetter("deadline")


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
    ``scripts`` (``{sha: (text, runs late)}``) are the scripts whose late
    ``NOSCRIPT`` replies are answered by sending the same call with EVAL, and
    ``on_late_error(reply)`` is told of any other late error reply (see
    :meth:`_late_error`).
    """

    def __init__(self, label, new_connection, *, tls, scripts=None, on_late_error=None):
        self.label = label
        self._new_connection = new_connection
        self.scripts = scripts or {}
        self.on_late_error = on_late_error
        self.tls = tls
        self.fast = hiredis is not None and not tls
        self._idle = []
        self._parked = []  # _Parked, oldest first: see park()
        self._skip_until = 0.0  # monotonic: see SKIP_AFTER_CONNECT_TIMEOUT

    def __repr__(self):
        return f"<Server {self.label}>"

    def take(self):
        """A connected link of this process: a parked one whose late replies are in,
        an idle one, a new one, or else (``MAX_PARKED`` parked) the oldest parked one
        once its replies came. Connecting may raise."""
        pid = os.getpid()  # not a fork hook's: uWSGI forks without running them
        link = self._unparked(pid, wait=False)
        if link is None and len(self._parked) >= MAX_PARKED:
            link = self._unparked(pid, wait=True)
        return link or self._idle_or_new(pid)

    def _unparked(self, pid, *, wait):
        """A parked link whose late replies were all read, or None. Without ``wait``
        each parked link is tried once, oldest first, reading only replies already
        received; with it, only the oldest is tried, waiting for its replies until
        its deadline."""
        for parked in self._parked[:1] if wait else list(self._parked):
            try:
                self._parked.remove(parked)  # ours now, unless another thread took it
            except ValueError:
                continue
            link = self._resume(parked, pid, wait)
            if link is not None:
                return link
        return None

    def _resume(self, parked, pid, wait):
        """``parked``'s link once its late replies are read, else None: then it is
        parked again, in deadline order, if its replies may still come in time, or
        closed (another process's, broken, or late past its deadline)."""
        link = parked.link
        if link.conn.pid != pid:
            link.conn.disconnect()  # inherited across a fork: closes only our copy
            return None
        done = self._drain(parked, wait)
        if done:
            return link
        if done is None or wait or time.monotonic() > parked.deadline:
            link.conn.disconnect()
            return None
        bisect.insort(self._parked, parked, key=_deadline_of)
        return None

    def _drain(self, parked, wait):
        """Read the late replies of a :class:`_Parked` fast-path link (see
        :meth:`_late_error` for an error reply), waiting for them until its deadline
        if ``wait``, else reading only what has arrived. True once every reply is in
        (the link is in step again), False if some are still due, None if the
        connection broke (the caller disconnects it). A wait ends at the deadline the
        link had when it began, even if a call sent again meanwhile owes a reply
        later: a round never waits more than one round's timeout for a parked link."""
        link = parked.link
        sock, reader, owed = link.sock, link.reader, parked.owed
        wait_until = parked.deadline
        try:
            while True:
                while owed:
                    reply = reader.gets()
                    if reply is False:
                        break
                    command = owed.pop(0)
                    if isinstance(reply, ResponseError):
                        self._late_error(parked, command, reply)
                if not owed:
                    return True
                remaining = max(wait_until - time.monotonic(), MIN_READ_TIMEOUT) if wait else 0
                if not _readable({sock.fileno(): sock}, remaining):
                    return False
                size = sock.recv_into(link.buffer)
                if not size:
                    return None  # the server closed the connection
                reader.feed(link.buffer, 0, size)
        except (*ERRORS, InvalidResponse, ValueError):  # ValueError: a closed socket
            return None

    def _late_error(self, parked, command, reply):
        """An error in reply to a call that its round did not wait for.

        A ``NOSCRIPT`` means the call did not run: the node lost its script cache
        (``SCRIPT FLUSH``, a restart). The call is sent again with EVAL, on the same
        connection, if it still may run: before its round's deadline, or at any time
        for a script marked so in ``scripts`` (a release: token-checked, and tokens
        are never reused). Otherwise (an extend long after its round could revive a
        record that has expired since) the script is only loaded again with
        ``SCRIPT LOAD``. Either way the node has the script again, and the new reply
        joins the replies owed, due within a round's timeout from now.

        Any other error goes to ``on_late_error``: nobody else sees it."""
        script = self.scripts.get(command[1]) if command[0] == "EVALSHA" else None
        if script is not None and is_no_script(reply):
            text, runs_late = script
            now = time.monotonic()
            if runs_late or now < parked.deadline:
                again = ("EVAL", text, *command[2:])
            else:
                again = ("SCRIPT", "LOAD", text)
            parked.deadline = max(parked.deadline, now + parked.timeout)
            _send_all(parked.link.sock, hiredis.pack_command(again), parked.deadline)
            parked.owed.append(again)
        elif self.on_late_error is not None:
            self.on_late_error(reply)

    def _idle_or_new(self, pid):
        while True:
            try:
                link = self._idle.pop()  # list.pop/append are atomic: thread-safe
            except IndexError:
                break
            if link.conn.pid == pid:
                return link
            link.conn.disconnect()  # inherited across a fork: closes only our copy
        skipped_for = self._skip_until - time.monotonic()
        if skipped_for > 0:
            raise redis.exceptions.TimeoutError(
                f"connecting timed out less than {SKIP_AFTER_CONNECT_TIMEOUT:g} s ago; "
                f"not tried again for {skipped_for:.2f} s"
            )
        conn = self._new_connection()
        try:
            conn.connect()
        except redis.exceptions.TimeoutError as exc:
            if not self.tls and str(exc) == _CONNECT_TIMEOUT_MESSAGE:
                self._skip_until = time.monotonic() + SKIP_AFTER_CONNECT_TIMEOUT
            raise
        return _Link(conn, self.fast)

    def give_back(self, link):
        """Keep ``link``, whose replies all came, for a later :meth:`take`."""
        self._skip_until = 0.0  # it answers: new connections may be tried again
        self._idle.append(link)

    def park(self, parked):
        """Keep a :class:`_Parked` link for a later :meth:`take` to drain."""
        bisect.insort(self._parked, parked, key=_deadline_of)

    def drop(self, link):
        link.conn.disconnect()

    def close(self):
        idle, self._idle = self._idle, []
        parked, self._parked = self._parked, []
        for link in idle + [entry.link for entry in parked]:
            link.conn.disconnect()


def round_trip(requests, timeout, enough=None, if_late=None):
    """Send each server its commands and read every reply, in parallel.

    ``requests`` is ``{key: (server, commands)}``, ``commands`` a list of command
    tuples; a list shared by several keys is packed once. Returns ``(results,
    started)``: ``results`` maps each key to the list of its replies (an error reply
    is a ``ResponseError`` in that list) or to a :class:`Failure`, and ``started`` is
    the monotonic time taken after connecting, before the first write. Replies are
    awaited until ``timeout`` seconds after the writes; a server that has not
    answered by then fails.

    ``enough(results)``, if given, is called with the results so far each time a
    server's replies are all in; once it returns True the round ends, and every
    server still owing replies is a :class:`Pending` in ``results`` (its connection
    is parked, see :meth:`Server.park`). Only the fast path ends early; the other
    (TLS, or no hiredis) reads every reply.

    ``if_late(key, results)``, if given, returns the commands (or None) to write,
    after its own, on the connection of a server whose replies did not all come by
    the deadline, once every other server's are in ``results``. A server runs one
    connection's commands in order, so if the late ones run at all (a server paused,
    not down), these run after them, however late: the undo of an acquire that lost
    (on another connection it could run first, and the acquire leave a record nobody
    holds). On the fast path they get one non-blocking write (a command cut short
    goes with the connection); on redis-py's, a blocking one. That server still
    fails the round: its connection is closed, and the server, reading the commands
    before the end of the connection, runs them all the same.
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
            if fast:
                _exchange_fast(out, results, timeout, enough, if_late)
            else:
                _exchange_redis_py(out, results, timeout, if_late)
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


def _exchange_fast(out, results, timeout, enough, if_late):
    """The round on non-blocking sockets: write every request, then one poll over
    all the sockets until every server's replies are in (or ``enough`` says the
    rest need not be awaited) or the deadline passed."""
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
                if pending and enough is not None and enough(results):
                    for late in pending.values():
                        server, link, commands = out.pop(late)
                        owed = list(commands[len(replies[late]) :])
                        server.park(_Parked(link, owed, deadline, timeout))
                        results[late] = Pending(server.label)
                    return
    if pending:  # the deadline passed
        late = {
            key: redis.exceptions.TimeoutError(f"no reply within {timeout:g} s")
            for key in pending.values()
        }
        _fail_late(out, results, late, if_late, _write_now)


def _exchange_redis_py(out, results, timeout, if_late):
    """The round through redis-py's connection methods (TLS, or no hiredis)."""
    cache = {}
    for key in list(out):
        _, link, commands = out[key]
        try:
            link.conn.send_packed_command(_packed(link.conn, commands, cache), check_health=False)
        except ERRORS as exc:
            _fail(out, results, key, exc)
    deadline = time.monotonic() + timeout
    late = {}  # key -> its TimeoutError: failed once every other server's are in
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
            if if_late is not None and isinstance(exc, redis.exceptions.TimeoutError):
                late[key] = exc  # its undo is decided on every other server's replies
            else:
                _fail(out, results, key, exc)
            continue
        del out[key]
        server.give_back(link)
        results[key] = got
    _fail_late(out, results, late, if_late, _write_if_connected)


def _fail_late(out, results, late, if_late, write):
    """Fail the servers ``late`` (``{key: its TimeoutError}``), first writing on
    each one's link, with ``write(link, commands)``, the commands ``if_late``
    returns for it: decided once every other server's replies are in ``results``
    (see round_trip)."""
    if if_late is not None:
        for key in late:
            then = if_late(key, results)
            if then:
                write(out[key][1], then)
    for key, timed_out in late.items():
        _fail(out, results, key, timed_out)


def _write_now(link, commands):
    """Write ``commands`` on a fast-path ``link`` (best effort: it is closed next
    anyway): one try, no wait; a command cut short goes with the connection."""
    try:
        _send_all(link.sock, _packed_fast(commands, {}), time.monotonic())
    except ERRORS:
        pass


def _write_if_connected(link, commands):
    """Write ``commands`` on a redis-py ``link`` (best effort: it is closed next
    anyway; a blocking write, up to the socket timeout if the server's buffer is
    full)."""
    conn = link.conn
    if getattr(conn, "_sock", None) is None:
        return
    try:
        conn.send_packed_command(conn.pack_commands(commands), check_health=False)
    except ERRORS:
        pass


def _read(conn, deadline):
    """The next reply on ``conn``, waiting until ``deadline`` (monotonic) at most. A
    read that times out leaves the connection open (see round_trip's ``if_late``)."""
    timeout = max(deadline - time.monotonic(), MIN_READ_TIMEOUT)
    if _READ_TIMEOUT:
        return conn.read_response(timeout=timeout, disconnect_on_error=False)
    if not conn.can_read(timeout=timeout):
        raise redis.exceptions.TimeoutError(f"no reply within {timeout:g} s")
    return conn.read_response()
