"""Waking the database backend's waiters in the other processes of this host, on
databases that cannot notify (SQLite, MySQL/MariaDB).

PostgreSQL wakes every process' waiters with ``NOTIFY`` (see db_wakeups). SQLite and
MySQL have nothing like it, so their waiters poll, and a lock released between two
polls stays free until the next one: most of a handoff's cost under contention. Yet
the processes that share an SQLite file all run on one host, and so, often, do the
workers that contend for a MySQL lock. They can tell each other directly.

Each process that has a waiter binds one Unix datagram socket in a directory of
its own user (``<tempdir>/django-setnx-<uid>/<digest of the database and table>``,
mode 0700) and reads it in a daemon thread (:class:`LocalListener`). A release that
leaves a lock to a waiter, or after which the waiters should compete for the place
next in line, sends one datagram to every socket in that directory
(:class:`LocalNotifier`): the payload of PostgreSQL's ``NOTIFY``, the lock's name
and, when known, the token of the waiter the lock was left to. The reader wakes
that waiter if it waits in this process; a plain name wakes one waiter of the
process (:meth:`db_wakeups.Wakeups.wake_one`).

A wake-up is only a hint, as on PostgreSQL: the waiter retries and the database
decides. The waiters keep polling as before, so nothing depends on a datagram
arriving: a process of another user (another directory), on another host, of an
older version, or whose socket buffer is full is simply not woken, and finds out at
its next poll. A socket whose process died refuses datagrams (``ECONNREFUSED``) and
is removed by the first sender that finds it so. After a fork the child never reads
or removes its parent's socket; it binds its own when one of its callers waits.
"""

import contextlib
import errno
import hashlib
import logging
import os
import random
import secrets
import socket
import stat
import tempfile
import threading
import time

from ..forksafe import PerProcess
from .db_wakeups import HEAD_MARK, PLAIN_MARK, TOKEN_MARK

logger = logging.getLogger("django_setnx")

#: How long the reader blocks before it looks whether it should stop (seconds): the
#: delay of ``close()``, never of a wake-up.
READ_BLOCK = 1.0
#: The largest datagram read; longer ones (a name of kilobytes) are cut, and the
#: cut wake-up then wakes nobody: the waiter's poll catches up.
MAX_DATAGRAM = 65536
#: The longest temporary directory used as is: a socket's path, ``<base>/django-
#: setnx-<uid>/<16 hex>/<pid>-<8 hex>``, must fit in 104 bytes (macOS; Linux: 108).
MAX_BASE = 50
#: A directory listing taken this soon (seconds) after the directory changed is taken
#: again at the next send (see LocalNotifier._paths).
RELIST_WINDOW = 2.0
#: After the directory could not be made private, a listener tries again this much
#: later (seconds), not at every wait.
RETRY_AFTER = 60.0
#: A wake-up for any waiter goes to one process (see LocalNotifier.send); one that
#: has no waiter for the name passes it on to another, at most this many times.
PASS_ON = 3
#: Whether this platform has Unix datagram sockets (not Windows).
AVAILABLE = hasattr(socket, "AF_UNIX")


def channel_directory(key, base=None):
    """The path of the directory of the sockets of one lock table (``key``: what
    names it, for example the database file's real path and the table), for the
    current user; None without Unix sockets. Nothing is made here: the first
    listener makes it (see _make_private), and senders use it only while it is
    private (see _is_private). ``base``: the temporary directory to use (default:
    ``tempfile.gettempdir()``)."""
    if not AVAILABLE:
        return None
    base = base or tempfile.gettempdir()
    if len(base) > MAX_BASE and os.path.isdir("/tmp"):
        base = "/tmp"  # a long TMPDIR (macOS): the socket paths would not fit
    parent = os.path.join(base, f"django-setnx-{os.geteuid()}")
    digest = hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return os.path.join(parent, digest)


def _make_private(directory):
    """Make ``directory`` and its parent (0700) unless they exist; returns whether
    both are directories of this user that nobody else can enter (else logs why),
    so that no other user can list, plant or remove our sockets, nor read the lock
    names we send."""
    for path in (os.path.dirname(directory), directory):
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        except OSError as exc:
            logger.warning(
                "Lock wake-ups between processes are off: cannot make %s (%s); waiters "
                "poll instead",
                path,
                exc,
            )
            return False
        if not _is_private(path, warn=True):
            return False
    return True


def _is_private(path, warn=False):
    """Whether ``path`` is a directory of this user that nobody else can enter (a
    symlink is not). False if it does not exist."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        if warn:
            logger.warning(
                "Lock wake-ups between processes are off: %s is not a directory private "
                "to this user (waiters poll instead)",
                path,
            )
        return False
    return True


def encode(name, token=None, head=False, since=None):
    """The datagram of a wake-up (``NOTIFY``'s payload, see db_wakeups.deliver): for
    the waiter whose token is ``token``; else, with ``head``, for the waiter next in
    line (the one that began waiting at ``since``, when given); else for one waiter
    per process."""
    if token is not None:
        payload = f"{TOKEN_MARK}{token}{TOKEN_MARK}{name}"
    elif head:
        payload = f"{HEAD_MARK}{name}" if since is None else f"{HEAD_MARK}{since}{HEAD_MARK}{name}"
    else:
        # Marked (a name may start with a mark), with how often it may be passed on.
        payload = f"{PLAIN_MARK}{PASS_ON}{name}"
    return payload.encode("utf-8", "surrogatepass")


class LocalNotifier:
    """Sends wake-ups to the sockets of one directory (any thread)."""

    def __init__(self, directory):
        self.directory = directory
        self._socket = None
        self._pid = None
        #: (the directory's mtime when listed, the socket paths then): one tuple, so
        #: that threads sending at once never see a listing with another's mtime.
        self._listing = (None, ())
        # Held while the socket is used, made or closed: close() from another thread
        # must not close it under a sendto, whose descriptor number a file opened
        # meanwhile could take (the datagram would go there). A sendto on this
        # non-blocking socket takes microseconds. Per process: a child forked while
        # a parent thread sent (uWSGI runs no fork hook) would find it held.
        # Reentrant: a release run by the garbage collector (a finalizer) in the
        # middle of a send may send too.
        self._lock = PerProcess(threading.RLock)

    def send(self, payload, own=None, one=False):
        """Send ``payload`` to every socket in the directory but ``own`` (this
        process' listener's path); with ``one``, to one of them, chosen at random.
        Best effort: never raises."""
        try:
            paths = [path for path in self._paths() if path != own]
            if one and len(paths) > 1:
                paths = [random.choice(paths)]
            if not paths:
                return
            with self._lock.get():
                sock = self._sender()
                for path in paths:
                    try:
                        sock.sendto(payload, path)
                    except (ConnectionRefusedError, FileNotFoundError):
                        # Its process is gone (a socket nobody reads refuses): remove it.
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                    except OSError as exc:
                        if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                            raise
                        # Its buffer is full: that process is busy waking up already.
        except Exception as exc:  # noqa: BLE001 - a hint that failed: the waiters poll
            logger.debug("Could not send a lock wake-up in %s: %s", self.directory, exc)

    def pass_on(self, payload, own):
        """A wake-up for any waiter (PLAIN_MARK) that found none here: to one other
        process, unless it was passed on PASS_ON times already."""
        hops = payload[1:2]
        if hops.isdigit() and int(hops) > 0:
            text = f"{PLAIN_MARK}{int(hops) - 1}{payload[2:]}"
            self.send(text.encode("utf-8", "surrogatepass"), own=own, one=True)

    def prune(self):
        """Remove the sockets of processes that ended without removing theirs (they
        refuse an empty datagram, which the live ones ignore)."""
        self.send(b"")

    def _sender(self):
        """The sending socket of this process, made if needed (``_lock`` held)."""
        pid = os.getpid()
        if self._socket is None or self._pid != pid:
            if self._socket is not None:  # the parent's, inherited by a fork
                with contextlib.suppress(OSError):
                    self._socket.close()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            self._socket, self._pid = sock, pid
        return self._socket

    def _paths(self):
        """The sockets of the directory, listed again when it changed. A listing
        taken within RELIST_WINDOW of the directory's last change is not trusted
        (git's "racy" rule): a directory's mtime has a granularity of up to a few
        milliseconds (a second on some filesystems), so a socket bound in the same
        tick would leave it as it was, and never be sent to. No sockets while the
        directory does not exist or is not private (a lock name is not sent where
        another user could read it)."""
        directory = self.directory
        try:
            mtime = os.stat(directory).st_mtime_ns
        except FileNotFoundError:
            return ()
        listed_at, paths = self._listing
        if mtime != listed_at:
            if not (_is_private(os.path.dirname(directory)) and _is_private(directory)):
                return ()
            racy = time.time_ns() - mtime < RELIST_WINDOW * 1e9
            paths = tuple(os.path.join(directory, entry) for entry in os.listdir(directory))
            self._listing = (None if racy else mtime, paths)
        return paths

    def close(self):
        """Close the sending socket (made again by the next send), once no thread
        of this process is sending on it."""
        with self._lock.get():
            sock, self._socket = self._socket, None
            if sock is not None and self._pid == os.getpid():
                sock.close()


class LocalListener:
    """This process' socket in a channel directory, read in a daemon thread that
    calls ``deliver(payload)`` for every datagram.

    :meth:`ensure_running` binds the socket and starts the thread; ``path`` is the
    socket's path while it runs (else None)."""

    def __init__(self, alias, directory, deliver, notifier=None):
        self.alias = alias
        self.directory = directory
        self.deliver = deliver
        self.notifier = notifier  # passes on what found no waiter here (see pass_on)
        self.pid = os.getpid()
        self.path = None
        self.failed = False
        self._retry_at = 0.0  # the directory could not be made private: not before this
        self._warned = False  # about a shortage of descriptors or threads
        self._socket = None
        self._thread = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False  # for good: a closed listener never starts again

    def ensure_running(self):
        """Make the directory, bind and start unless running; returns whether it
        runs. A directory that cannot be made private is tried again RETRY_AFTER
        later (logged each time); a socket that cannot be bound (a path too long for
        a Unix socket) is logged once and not tried again: the waiters poll."""
        if self._thread is not None and self._thread.is_alive():
            return True
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return True
            if self._closed or self.failed or time.monotonic() < self._retry_at:
                return False
            try:
                sock = self._bind()
            except Exception as exc:  # noqa: BLE001 - out of descriptors, say: poll
                self._give_up_for_now(exc)
                return False
            if sock is None:
                return False
            path = sock.getsockname()
            sock.settimeout(READ_BLOCK)
            self._socket, self.path = sock, path
            self._stop.clear()
            thread = threading.Thread(
                target=self._run,
                args=(sock, path),
                name=f"django-setnx wake-ups {self.alias}",
                daemon=True,
            )
            try:
                thread.start()
            except Exception as exc:  # noqa: BLE001 - no thread to be had: poll
                self._socket = self.path = None
                with contextlib.suppress(OSError):
                    os.unlink(path)
                sock.close()
                self._give_up_for_now(exc)
                return False
            self._thread = thread
        return True

    def _give_up_for_now(self, exc):
        """The listener cannot start (no file descriptor, no thread): say so once,
        and try again RETRY_AFTER later; the waiters poll meanwhile."""
        if not self._warned:
            self._warned = True
            logger.warning(
                "Lock backend %r: no wake-ups from other processes for now (%s: %s); "
                "waiters poll instead",
                self.alias,
                type(exc).__name__,
                exc,
            )
        self._retry_at = time.monotonic() + RETRY_AFTER

    def _bind(self):
        """A socket bound in the directory (made if need be: again after a cleaner
        of /tmp removed it), or None."""
        for _ in range(2):
            if not _make_private(self.directory):
                self._retry_at = time.monotonic() + RETRY_AFTER
                return None
            path = os.path.join(self.directory, f"{os.getpid()}-{secrets.token_hex(4)}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # may raise: the caller
            try:
                sock.bind(path)
            except FileNotFoundError:
                sock.close()  # the last listener out removed the directory: again
                continue
            except OSError as exc:
                sock.close()
                self.failed = True
                logger.warning(
                    "Lock backend %r: no wake-ups from other processes (%s: %s); "
                    "waiters poll instead",
                    self.alias,
                    type(exc).__name__,
                    exc,
                )
                return None
            return sock
        return None  # removed under us twice: the next wait tries again

    def _run(self, sock, path):
        try:
            while not self._stop.is_set():
                try:
                    payload = sock.recv(MAX_DATAGRAM)
                except TimeoutError:
                    if not os.path.exists(path):
                        # Removed under us (a cleaner of old temporary files): end, so
                        # that the next waiter binds a socket again.
                        break
                    continue
                if not payload:  # a probe (see LocalNotifier.prune): no wake-up
                    continue
                try:
                    text = payload.decode("utf-8", "surrogatepass")
                    if self.deliver(text) is False and self.notifier is not None:
                        self.notifier.pass_on(text, own=path)
                except Exception:
                    logger.debug("Ignored a malformed lock wake-up", exc_info=True)
        except OSError:
            pass  # the socket failed: the waiters poll (and the next wait binds again)
        finally:
            with self._lock:
                if self._socket is sock:
                    self._socket = self.path = None
            with contextlib.suppress(OSError):
                os.unlink(path)
            sock.close()  # here, not from another thread: its number could be reused

    def close(self):
        """Stop reading, for good: the socket is removed at once (nobody sends to it
        any more) and closed by the reader within READ_BLOCK. Only in the process that
        bound it: a forked child's copy of this object (a finalizer, atexit) never
        removes its parent's socket."""
        if self.pid != os.getpid():
            return
        with self._lock:  # an ensure_running() after it finds it closed, before it
            self._closed = True  # has stopped nothing: it clears the stop under the lock
            self._stop.set()
            path, self.path = self.path, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)  # the last one out (fails while others are in)

    def abandon(self):
        """In a forked child: close the inherited socket, leaving the parent's path
        (and the parent's reader, which the child does not have) alone."""
        sock, self._socket, self.path = self._socket, None, None
        self._thread = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
