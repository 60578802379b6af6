"""Wake-ups between the processes of one host (db_local_wakeups): a directory only
its user can enter, datagrams on real Unix sockets, the sockets of ended processes
removed, and a socket that cannot be bound leaving the waiters to poll."""

import logging
import os
import pathlib
import queue
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest

from django_setnx.backends import db_local_wakeups
from django_setnx.backends.db_local_wakeups import (
    PASS_ON,
    LocalListener,
    LocalNotifier,
    channel_directory,
    encode,
)
from django_setnx.backends.db_wakeups import PLAIN_MARK, Wakeups, deliver


@pytest.fixture
def tempdir():
    """A fresh temporary directory short enough for the socket paths (pytest's own
    are not), the ``base`` of channel_directory in these tests."""
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def listening(directory):
    """A started listener on ``directory`` and the queue of what it delivers."""
    got = queue.Queue()
    listener = LocalListener("test", directory, got.put)
    assert listener.ensure_running()
    return listener, got


def test_the_directory_is_made_private_by_the_first_listener(tempdir):
    directory = channel_directory("sqlite:/srv/app.db/django_setnx_lock", str(tempdir))
    assert directory == channel_directory("sqlite:/srv/app.db/django_setnx_lock", str(tempdir))
    assert directory != channel_directory("sqlite:/srv/other.db/django_setnx_lock", str(tempdir))
    assert not os.path.exists(os.path.dirname(directory)), "made before anyone waits"
    listener, _ = listening(directory)
    for path in (directory, os.path.dirname(directory)):
        info = os.lstat(path)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == 0o700
    listener.close()
    assert not os.path.exists(directory), "the last listener out leaves no directory"


@pytest.mark.parametrize("planted", ["open to others", "a symlink", "a file"])
def test_a_directory_others_could_enter_or_plant_is_refused(tempdir, planted, caplog):
    """Nobody else may list, plant or remove our sockets, nor read the lock names
    we send: a parent that is not a private directory of ours turns the wake-ups
    off (the waiters poll), once per RETRY_AFTER, and nothing is sent there."""
    parent = tempdir / f"django-setnx-{os.geteuid()}"
    if planted == "open to others":
        parent.mkdir(mode=0o755)
        parent.chmod(0o755)
        (parent / "0123456789abcdef").mkdir(mode=0o700)
    elif planted == "a symlink":
        (tempdir / "elsewhere").mkdir(mode=0o700)
        parent.symlink_to(tempdir / "elsewhere")
        (tempdir / "elsewhere" / "0123456789abcdef").mkdir(mode=0o700)
    else:
        parent.write_text("")
    directory = str(parent / "0123456789abcdef")
    listener = LocalListener("test", directory, lambda payload: None)
    with caplog.at_level(logging.WARNING, logger="django_setnx"):
        for _ in range(3):
            assert listener.ensure_running() is False
    assert caplog.text.count(str(parent)) == 1, "warned more than once"
    if planted != "a file":  # a socket planted there never gets a lock name
        planted_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        planted_socket.bind(os.path.join(directory, "1-planted"))
        planted_socket.setblocking(False)
        LocalNotifier(directory).send(encode("secret:name"))
        with pytest.raises(BlockingIOError):
            planted_socket.recv(100)
        planted_socket.close()


def test_a_wakeup_reaches_every_other_socket_of_the_directory(tempdir):
    directory = channel_directory("k", str(tempdir))
    first, first_got = listening(directory)
    second, second_got = listening(directory)
    try:
        LocalNotifier(directory).send(encode("job:1", "tok"), own=first.path)
        assert second_got.get(timeout=5) == "\x1etok\x1ejob:1"
        LocalNotifier(directory).send(encode("job:2"))
        assert first_got.get(timeout=5) == PLAIN_MARK + "3job:2"
        assert second_got.get(timeout=5) == PLAIN_MARK + "3job:2"
        assert first_got.empty(), "a sender must skip its own process' socket"
    finally:
        first.close()
        second.close()


def test_the_sockets_of_ended_processes_are_removed_and_probes_wake_nobody(tempdir):
    directory = channel_directory("k", str(tempdir))
    live, got = listening(directory)  # makes the directory
    dead = os.path.join(directory, "99999999-dead")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(dead)
    sock.close()  # as a process killed with its socket bound leaves it
    try:
        LocalNotifier(directory).prune()
        assert not os.path.exists(dead)
        assert os.path.exists(live.path)
        time.sleep(0.2)
        assert got.empty(), "a probe woke a listener"
    finally:
        live.close()


def test_close_removes_the_socket_at_once(tempdir):
    listener, _ = listening(channel_directory("k", str(tempdir)))
    path = listener.path
    listener.close()
    assert not os.path.exists(path)
    assert listener.path is None


def test_a_closed_listener_never_starts_again(tempdir):
    """A waiter that took the listener just before the backend's close() (a reset)
    must not start it again once its thread has ended: nothing would stop it then,
    and its thread and socket would stay for the rest of the process (r111)."""
    listener, _ = listening(channel_directory("k", str(tempdir)))
    thread = listener._thread
    listener.close()
    thread.join(5)
    assert not thread.is_alive()
    assert listener.ensure_running() is False
    assert listener.path is None and listener._thread is thread


def test_a_long_temporary_directory_is_replaced_by_tmp(tmp_path):
    """macOS' TMPDIR is long: the sockets go under /tmp instead, where they fit."""
    directory = channel_directory("k", str(tmp_path / ("d" * 60)))
    assert directory.startswith("/tmp/django-setnx-")
    listener, _ = listening(directory)
    listener.close()


def test_a_socket_that_cannot_be_bound_leaves_the_waiters_polling(tempdir, caplog):
    """A directory whose path is too long for a Unix socket (108 bytes on Linux):
    the listener does not start, says so once, and does not try again."""
    directory = tempdir / ("d" * 110)
    directory.mkdir(mode=0o700)
    listener = LocalListener("test", str(directory), lambda payload: None)
    with caplog.at_level(logging.WARNING, logger="django_setnx"):
        assert listener.ensure_running() is False
        assert listener.ensure_running() is False
    assert caplog.text.count("no wake-ups from other processes") == 1
    LocalNotifier(str(directory)).send(encode("n"))  # and sending never raises


def test_unix_sockets_are_available_here():
    """The wake-ups are not skipped silently on this platform."""
    assert db_local_wakeups.AVAILABLE


def _waiting(wakeups, ranks):
    """Threads waiting on ``wakeups`` for "n", one per role of ``ranks`` (role: rank),
    each with its role as token; returned once all wait, with the dict into which
    each puts what its wait returned."""
    since = time.monotonic()
    woken = {}

    def wait(role, rank):
        woken[role] = wakeups.wait("n", 10, since, rank=rank, token=role)

    threads = [threading.Thread(target=wait, args=item) for item in ranks.items()]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while len(wakeups._waiters.get("n", ())) < len(ranks):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return threads, woken


def test_a_wakeup_for_the_waiter_next_in_line_wakes_only_that_one():
    """MySQL's release cannot tell the token of the waiter it left the lock to: its
    datagram names the waiter next in line, which alone is woken (the others would
    only be refused)."""
    wakeups = Wakeups()
    threads, woken = _waiting(wakeups, {"behind": (1, 1), "next": (0, 2)})
    deliver(wakeups, encode("n", head=True).decode(), stand_in=False)
    threads[1].join(5)
    assert woken == {"next": True}
    time.sleep(0.2)
    assert "behind" not in woken
    wakeups.wake_one("n")
    threads[0].join(5)
    assert woken == {"next": True, "behind": True}


def test_a_wakeup_naming_when_the_waiter_began_passes_over_an_out_of_date_one():
    """A waiter that believes it is next in line may have lost the place to one that
    waited longer (it learns that at its next attempt): a MySQL release names the
    waiter it left the lock to by when it began waiting (the row's ``next_since``,
    which its insert id returns), so only that one is woken, whatever it believes."""
    wakeups = Wakeups()
    threads, woken = _waiting(
        wakeups, {"out of date": (0, 1_700_000_000_200), "next": (1, 1_700_000_000_100)}
    )
    deliver(wakeups, encode("n", head=True, since=1_700_000_000_100).decode(), stand_in=False)
    threads[1].join(5)
    assert woken == {"next": True}
    time.sleep(0.2)
    assert "out of date" not in woken
    # An earlier version's datagram (no time) wakes the one that believes it is next.
    deliver(wakeups, encode("n", head=True).decode(), stand_in=False)
    threads[0].join(5)
    assert woken == {"next": True, "out of date": True}


def test_a_stand_in_is_woken_only_if_the_other_waiter_never_takes_the_lock():
    """A PostgreSQL release that leaves the lock to another process' waiter makes one
    of ours its stand-in (in case it died): woken when its claim has lapsed, not at
    once (it would only be refused), and not at all if that waiter takes the lock
    (its NOTIFY, the plain name, comes first). Without a listener to wake it later,
    at once."""
    wakeups = Wakeups()
    wakeups.stand_in_after = 0.3
    threads, woken = _waiting(wakeups, {"ours": (1, 1)})
    deliver(wakeups, encode("n", token="theirs").decode())  # left to another process
    assert wakeups.wake_due_stand_ins() == pytest.approx(0.3, abs=0.1)
    time.sleep(0.15)
    assert woken == {}
    assert 0 < wakeups.wake_due_stand_ins() < 0.3
    time.sleep(0.2)
    assert wakeups.wake_due_stand_ins() is None  # due: woken
    threads[0].join(5)
    assert woken == {"ours": True}

    # The other waiter takes the lock (the plain name): nobody stands in for it.
    threads, woken = _waiting(wakeups, {"ours": (1, 1)})
    deliver(wakeups, encode("n", token="theirs").decode())
    deliver(wakeups, "n")  # its NOTIFY: ours competes for the place next in line
    threads[0].join(5)
    assert woken == {"ours": True}
    assert wakeups.wake_due_stand_ins() is None

    wakeups.stand_in_after = None  # no listener: at once
    threads, woken = _waiting(wakeups, {"ours": (1, 1)})
    deliver(wakeups, encode("n", token="theirs").decode())
    threads[0].join(5)
    assert woken == {"ours": True}


def test_a_directory_removed_by_a_temporary_files_cleaner_comes_back(tempdir, monkeypatch):
    """systemd-tmpfiles and tmpreaper remove old entries of /tmp: a listener whose
    socket went ends, and the next wait makes the directory and binds again."""
    monkeypatch.setattr(db_local_wakeups, "READ_BLOCK", 0.05)
    directory = channel_directory("k", str(tempdir))
    listener, got = listening(directory)
    shutil.rmtree(os.path.dirname(directory))
    deadline = time.monotonic() + 5
    while listener.path is not None:
        assert time.monotonic() < deadline, "the listener did not notice"
        time.sleep(0.02)
    assert listener.ensure_running()
    assert os.path.exists(listener.path)
    LocalNotifier(directory).send(encode("back"))
    assert got.get(timeout=5) == PLAIN_MARK + "3back"
    listener.close()


def test_a_socket_bound_just_after_a_listing_is_sent_to(tempdir):
    """A directory's mtime may not change when a socket is bound in the same tick
    as the sender's last listing (coarse timestamps): a listing that recent is
    taken again at the next send."""
    directory = channel_directory("k", str(tempdir))
    first, first_got = listening(directory)
    notifier = LocalNotifier(directory)
    notifier.send(encode("one"))
    assert first_got.get(timeout=5) == PLAIN_MARK + "3one"
    second, second_got = listening(directory)
    mtime = os.stat(directory).st_mtime_ns
    os.utime(directory, ns=(mtime, notifier._listing[0] or mtime))  # as if in one tick
    notifier.send(encode("two"))
    assert second_got.get(timeout=5) == PLAIN_MARK + "3two"
    first.close()
    second.close()


def test_a_wakeup_for_any_waiter_goes_to_one_process(tempdir):
    """A plain name (the waiters may compete for the place next in line) goes to one
    other process, not all: each woken one sends statements."""
    directory = channel_directory("k", str(tempdir))
    listeners = [listening(directory) for _ in range(4)]
    LocalNotifier(directory).send(encode("n"), own=listeners[0][0].path, one=True)
    time.sleep(0.3)
    received = [got.qsize() for _, got in listeners]
    assert received[0] == 0 and sum(received) == 1, received
    for listener, _ in listeners:
        listener.close()


def test_a_wakeup_for_any_waiter_that_finds_none_is_passed_on(tempdir):
    """The one process a wake-up for any waiter went to has no waiter for that name
    (it waited for another lock once): it passes the wake-up on to another process,
    PASS_ON times at most."""
    directory = channel_directory("k", str(tempdir))
    notifier = LocalNotifier(directory)
    idle_got, waiting_got = queue.Queue(), queue.Queue()

    def idle(payload):
        idle_got.put(payload)
        return False  # no waiter here

    idle_listener = LocalListener("idle", directory, idle, notifier)
    assert idle_listener.ensure_running()
    waiting_listener, waiting_got = listening(directory)
    LocalNotifier(directory).send(encode("n"), own=waiting_listener.path, one=True)
    assert idle_got.get(timeout=5) == PLAIN_MARK + f"{PASS_ON}n"
    assert waiting_got.get(timeout=5) == PLAIN_MARK + f"{PASS_ON - 1}n"
    idle_listener.close()
    waiting_listener.close()


def test_close_waits_for_a_send_in_flight_in_another_thread(tempdir):
    """close() from another thread (the backend's) must not close the sending socket
    under a sendto: a descriptor opened meanwhile could take its number, and the
    datagram go there (review r103). A send in flight holds the notifier's lock;
    close() waits for it."""
    directory = channel_directory("k", str(tempdir))
    listener, got = listening(directory)
    notifier = LocalNotifier(directory)
    try:
        notifier.send(encode("job:1"))
        assert got.get(timeout=5) == PLAIN_MARK + "3job:1"
        sock = notifier._socket
        closed = threading.Event()
        with notifier._lock.get():  # as a sendto of another thread would
            closer = threading.Thread(target=lambda: (notifier.close(), closed.set()))
            closer.start()
            assert not closed.wait(0.3), "closed under a send in flight"
            assert sock.fileno() != -1
        assert closed.wait(5)
        closer.join(5)
        assert sock.fileno() == -1
        notifier.send(encode("job:2"))  # a new socket
        assert got.get(timeout=5) == PLAIN_MARK + "3job:2"
    finally:
        notifier.close()
        listener.close()


def test_a_send_within_a_send_of_the_same_thread_goes_out(tempdir):
    """A release run by the garbage collector (a finalizer) in the middle of a send
    sends too, on the same thread: the notifier's lock is reentrant (a plain one
    would deadlock that thread)."""
    directory = channel_directory("k", str(tempdir))
    listener, got = listening(directory)
    notifier = LocalNotifier(directory)

    def nested():
        with notifier._lock.get():  # as an outer send holds it
            notifier.send(encode("job:inner"))

    try:
        sender = threading.Thread(target=nested, daemon=True)
        sender.start()
        sender.join(5)
        assert not sender.is_alive(), "a send within a send deadlocked"
        assert got.get(timeout=5) == PLAIN_MARK + "3job:inner"
    finally:
        notifier.close()
        listener.close()
