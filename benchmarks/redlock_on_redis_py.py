"""Redlock with redis-py clients instead of django-setnx's raw-socket rounds, for
``bench_redlock.py --compare-backend``: what issue 12 asked to measure before keeping
the socket layer (``django_setnx/backends/redlock_wire.py``).

Both classes are the real RedlockBackend (same scripts, same keys, same majority
logic); only the transport of a round differs:

- :class:`InTurnRedlock`: one redis-py client per master, the masters one after the
  other (each a pipelined request and its replies): what "built on redis-py
  connections" gives without threads;
- :class:`ThreadedRedlock`: the same clients, the masters in parallel from a thread
  pool (redis-py has no way to wait on several connections at once).
"""

import time
from concurrent.futures import ThreadPoolExecutor

import redis

from django_setnx.backends import redlock_wire as wire
from django_setnx.backends.redlock import RedlockBackend


class InTurnRedlock(RedlockBackend):
    def __init__(self, alias, params):
        super().__init__(alias, params)
        self._clients = {}

    def _client(self, index):
        client = self._clients.get(index)
        if client is None:
            client = self._clients[index] = redis.Redis.from_url(
                self.locations[index], socket_timeout=self.node_timeout
            )
        return client

    def _one(self, index, server, commands):
        try:
            pipe = self._client(index).pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as exc:
            return wire.Failure(server.label, exc)

    def _round_trip(self, requests, timeout, enough=None, if_late=None):  # every reply, no undo
        started = time.monotonic()
        return {
            index: self._one(index, server, commands)
            for index, (server, commands) in requests.items()
        }, started


class ThreadedRedlock(InTurnRedlock):
    def __init__(self, alias, params):
        super().__init__(alias, params)
        self._pool = ThreadPoolExecutor(max_workers=len(self.locations))

    def _round_trip(self, requests, timeout, enough=None, if_late=None):  # every reply, no undo
        started = time.monotonic()
        futures = {
            index: self._pool.submit(self._one, index, server, commands)
            for index, (server, commands) in requests.items()
        }
        return {index: future.result() for index, future in futures.items()}, started
