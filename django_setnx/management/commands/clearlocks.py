"""``manage.py clearlocks``: remove stale locks (and, with ``--all``, held ones).

The work is done by each backend's :meth:`~django_setnx.backends.base.BaseLockBackend.clear`
in batches (SCAN + pipelined scripts on Redis, one DELETE per batch on a database),
each record re-checked at removal time so a lock re-acquired meanwhile is kept.

No ``lock_force_released`` signal is sent from here: a ``ClearResult`` does not
say which removed records were still held. The admin's force-release action,
which removes locks one by one, sends it.
"""

import argparse
import math

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_setnx.display import record_display_name
from django_setnx.exceptions import LockBackendError

from ._common import (
    add_backend_arguments,
    backend_failure,
    confirm_or_cancel,
    escape,
    plural,
    select_backends,
    validate_glob,
)

#: A running count is written to stderr each time this many more locks are removed
#: (only at verbosity >= 1, so only runs that large ever show it).
PROGRESS_EVERY = 10_000


class Command(BaseCommand):
    help = (
        "Remove stale locks (expired without a release) of every lock backend, or of "
        "those named with --backend. --all removes held locks too, after a confirmation. "
        "Prints a count per backend (and the names at verbosity 2). Signals are not sent; "
        "force-release single locks from the admin to record who did it."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--all",
            action="store_true",
            dest="include_held",
            help="Also remove locks that are currently held. Their holders are not told and "
            "another process may then acquire the same lock while they still run.",
        )
        add_backend_arguments(parser, "Clear")
        parser.add_argument(
            "--older-than",
            dest="older_than",
            metavar="SECONDS",
            help="Only locks acquired more than SECONDS ago (a number > 0).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Remove nothing; print the locks that would be removed.",
        )
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Do not ask for confirmation before removing held locks (--all).",
        )
        # Hidden: how often the running count is printed (tests use a small step).
        parser.add_argument("--progress-every", type=int, default=None, help=argparse.SUPPRESS)

    def handle(self, *args, **options):
        include_held = options["include_held"]
        dry_run = options["dry_run"]
        name_glob = validate_glob(options["name_glob"])
        older_than = parse_older_than(options["older_than"])
        verbosity = options["verbosity"]
        every = options["progress_every"] or PROGRESS_EVERY
        if every < 1:
            raise CommandError(f"--progress-every must be >= 1, got {every!r}.")
        selected = select_backends(options["backends"])

        if include_held and not dry_run and options["interactive"]:
            self.confirm([alias for alias, _ in selected], name_glob, older_than)

        failures = []
        for alias, backend in selected:
            progress = _Progress(self, alias, verbosity, every, dry_run)
            try:
                result = backend.clear(
                    include_held=include_held,
                    name_glob=name_glob,
                    older_than=older_than,
                    dry_run=dry_run,
                    progress=progress,
                )
            except (LockBackendError, ImproperlyConfigured) as exc:
                message = backend_failure(alias, exc)
                failures.append(message)
                progress.abort(message)
                continue
            count = result.count
            if progress.seen < count:
                # A backend that returned names without reporting them all as progress:
                # still list what it removed.
                progress(result.names[progress.seen :])
            verb = "would remove" if dry_run else "removed"
            self.stdout.write(self.style.SUCCESS(f"{alias}: {verb} {_count(count, include_held)}"))

        if failures:
            raise CommandError(
                "; ".join(failures)
                + ("" if len(failures) == 1 else f" ({len(failures)} backends failed)")
            )

    def confirm(self, aliases, name_glob, older_than):
        scope = f"of backend{'s' if len(aliases) != 1 else ''} {', '.join(map(repr, aliases))}"
        if name_glob:
            scope += f" whose name matches {name_glob!r}"
        if older_than is not None:
            scope += f" acquired more than {older_than:g} s ago"
        confirm_or_cancel(
            f"You have requested to remove every lock {scope}, held ones included.\n"
            "Their holders will not be told: another process can then acquire the same "
            "lock while they still run.",
            "Clearing locks cancelled: nothing was removed.",
        )


def _count(count, include_held):
    if include_held:
        return f"{plural(count, 'lock')} (held and stale)"
    return plural(count, "stale lock")


def parse_older_than(value):
    """``--older-than`` as a float > 0 (None when not given), else CommandError."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise CommandError(f"--older-than must be a number of seconds > 0, got {value!r}.")
    return seconds


class _Progress:
    """The ``progress`` callback given to ``clear()``: lists names (verbosity >= 2, or
    >= 1 on a dry run) as batches come in and writes a running count to stderr each
    ``every`` locks."""

    def __init__(self, command, alias, verbosity, every, dry_run):
        self.command = command
        self.alias = alias
        self.verbosity = verbosity
        self.every = every
        self.dry_run = dry_run
        self.seen = 0
        self.list_names = verbosity >= 2 or (dry_run and verbosity >= 1)

    def __call__(self, names):
        if self.list_names:
            prefix = "  would remove " if self.dry_run else "  removed "
            write = self.command.stdout.write
            for name in names:
                write(prefix + escape(record_display_name(name)))
        before = self.seen
        self.seen += len(names)
        if self.verbosity >= 1 and self.seen // self.every > before // self.every:
            verb = "found" if self.dry_run else "removed"
            self.command.stderr.write(f"{self.alias}: {self.seen} locks {verb} so far...")

    def abort(self, message):
        if self.seen and not self.dry_run:
            self.command.stderr.write(
                f"{self.alias}: removed {plural(self.seen, 'lock')} before failing: {message}"
            )
