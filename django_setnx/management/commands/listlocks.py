"""``manage.py listlocks``: held and stale locks of every backend, as a table or JSON.

The table escapes control characters in names and owners (a lock name is user data:
it must not forge output lines or send terminal escapes) and truncates very long
values; ``--json`` prints every value in full as NDJSON (one JSON object per line,
streamed as the backends yield them: constant memory, and ``| head``, ``| jq -c`` or
``| grep`` work on a listing of any size), the format for scripts.

A reader that stops early (``listlocks | head``) ends the command quietly, as any
Unix filter does.
"""

import json
import os
import sys

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_setnx.backends.base import STALE, STATES
from django_setnx.display import json_line
from django_setnx.exceptions import LockBackendError

from ._common import (
    add_backend_arguments,
    backend_failure,
    display_width,
    escape,
    select_backends,
    truncate,
    validate_glob,
)

#: The table is printed in chunks of this many rows: column widths are computed
#: per chunk (and never shrink), so listings up to this size line up exactly.
TABLE_CHUNK = 10_000
#: Widest name and owner cell, in terminal columns (the table only; --json is in full).
MAX_NAME_WIDTH = 60
MAX_OWNER_WIDTH = 80

COLUMNS = ("NAME", "BACKEND", "STATE", "OWNER", "FENCING TOKEN", "ACQUIRED (UTC)", "EXPIRES IN")
RIGHT_ALIGNED = {"FENCING TOKEN", "EXPIRES IN"}


class Command(BaseCommand):
    help = (
        "List the held and stale locks of every lock backend (or those named with "
        "--backend) as a table, or as JSON with --json."
    )

    def add_arguments(self, parser):
        parser.add_argument("--state", choices=STATES, help="Only held or only stale locks.")
        add_backend_arguments(parser, "List")
        parser.add_argument(
            "--json",
            action="store_true",
            dest="as_json",
            help="Print one JSON object per lock and line (NDJSON), every value in full, "
            "streamed: for scripts and large listings.",
        )

    def handle(self, *args, **options):
        state = options["state"]
        if state is not None and state not in STATES:
            raise CommandError(f"--state must be one of {', '.join(STATES)}, got {state!r}.")
        name_glob = validate_glob(options["name_glob"])
        selected = select_backends(options["backends"])
        self._failures = []
        infos = self._infos(selected, state, name_glob)
        try:
            if options["as_json"]:
                self._write_json(infos)
            else:
                self._write_table(infos)
            self.stdout.flush()
        except BrokenPipeError:
            # The reader went away (``| head``): stop quietly. Point stdout at devnull
            # so that the interpreter's final flush does not fail again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return
        if self._failures:
            raise CommandError("; ".join(self._failures))

    def _infos(self, selected, state, name_glob):
        """Yield ``LockInfo``s backend after backend; an unreachable backend is
        remembered (the command fails at the end) and the others are still listed."""
        for alias, backend in selected:
            try:
                yield from backend.list(state=state, name_glob=name_glob)
            except (LockBackendError, ImproperlyConfigured) as exc:
                self._failures.append(backend_failure(alias, exc))

    # -- JSON ---------------------------------------------------------------------

    def _write_json(self, infos):
        # NDJSON, record by record as the backends yield them: constant memory for
        # any number of locks, and every line is a complete document.
        write = self.stdout.write
        for info in infos:
            write(json_line(info.as_dict()))

    # -- table --------------------------------------------------------------------

    def _write_table(self, infos):
        widths = [display_width(c) for c in COLUMNS]
        chunk = []
        printed_header = False
        for info in infos:
            chunk.append(info)
            if len(chunk) >= TABLE_CHUNK:
                self._write_rows(chunk, widths, header=not printed_header)
                printed_header = True
                chunk = []
        if chunk:
            self._write_rows(chunk, widths, header=not printed_header)
            printed_header = True
        if not printed_header:
            self.stdout.write("No locks.")

    def _write_rows(self, chunk, widths, header):
        # Backends in the order selected (that is the order ``_infos`` yields them);
        # within one, by name (Redis' SCAN is unordered, the database pages by id).
        order = {}
        for info in chunk:
            order.setdefault(info.backend, len(order))
        chunk.sort(key=lambda info: (order[info.backend], info.name))
        rows = [_cells(info) for info in chunk]
        for cells in rows:
            for i, (_, width) in enumerate(cells):
                widths[i] = max(widths[i], width)
        write = self.stdout.write
        if header:
            labels = [(c, display_width(c)) for c in COLUMNS]
            write(self.style.MIGRATE_HEADING(_line(labels, widths)))
        for cells, info in zip(rows, chunk):
            line = _line(cells, widths)
            write(self.style.WARNING(line) if info.state == STALE else line)


def _cells(info):
    """The table cells of one record as ``(text, display width)`` pairs."""
    texts = (
        truncate(escape(info.display_name), MAX_NAME_WIDTH),
        escape(info.backend),
        info.state,
        truncate(escape(format_owner(info.owner)), MAX_OWNER_WIDTH),
        str(info.fencing_token),
        info.acquired_at.isoformat(timespec="seconds"),
        format_expires_in(info),
    )
    return [(text, display_width(text)) for text in texts]


def _line(cells, widths):
    parts = []
    for column, (text, width), target in zip(COLUMNS, cells, widths):
        pad = " " * (target - width)
        parts.append(pad + text if column in RIGHT_ALIGNED else text + pad)
    return "  ".join(parts).rstrip()


def format_expires_in(info):
    """``12.3s``; always negative for a stale lock, even one that just expired."""
    return f"{'-' if info.is_stale else ''}{abs(info.expires_in):.1f}s"


def format_owner(owner):
    """``host:pid thread``, then ``guards=...`` when the lock says what it protects."""
    if not isinstance(owner, dict) or not {"host", "pid"} <= owner.keys():
        return json.dumps(owner, sort_keys=True, ensure_ascii=False)
    text = f"{owner['host']}:{owner['pid']}"
    if owner.get("thread"):
        text += f" {owner['thread']}"
    if owner.get("guards"):
        text += f" guards={owner['guards']}"
    return text
