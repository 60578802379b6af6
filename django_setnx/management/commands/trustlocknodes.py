"""``manage.py trustlocknodes``: let a brand-new set of Redlock masters vote at once.

A Redlock master without its marker key (brand-new, or restarted without its data),
or another run of redis-server than the one last seen (restarted with only part of
its data, restored, a replica promoted in its place), sits out of every vote for
``MAX_TTL`` after a client first meets it, so that every lock it may have forgotten
has expired before it votes again (the delayed-restart rule, see
:mod:`django_setnx.backends.redlock`). For masters that were just deployed no lock
can have been held, and waiting is pointless: this command marks them trusted now.
``--dry-run`` only lists which masters do not vote yet, and for how long.
"""

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError
from django.utils.module_loading import import_string

from django_setnx.backends.redlock import TRUST_COMMAND, RedlockBackend
from django_setnx.handler import locks

from ._common import confirm_or_cancel, plural, select_backends


class Command(BaseCommand):
    help = (
        "Mark the masters of a Redlock backend trusted now, so that a brand-new set votes "
        "at once instead of after MAX_TTL. Only for masters on which no lock can be held "
        "(just deployed, or restarted while certainly no lock was held): trusting a master "
        "that lost held locks lets a second holder in. Asks first unless --noinput; "
        "--dry-run lists the masters that do not vote yet."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--backend",
            action="append",
            dest="backends",
            metavar="ALIAS",
            help="Only this Redlock alias of SETNX_LOCKS (repeatable; default: every "
            "Redlock alias).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Change nothing; list the masters that do not vote yet and how long until "
            "each does.",
        )
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Do not ask for confirmation.",
        )

    def handle(self, *args, **options):
        dry_run = options["dry_run"]
        failures = []
        to_trust = []
        for alias, backend in self.redlock_backends(options["backends"]):
            statuses = backend.node_status()
            self.report(alias, backend, statuses)
            if any(status.error is None and not status.trusted for status in statuses):
                to_trust.append((alias, backend, statuses))
            elif not any(status.error for status in statuses):
                self.stdout.write(
                    self.style.SUCCESS(f"{alias}: every master votes already; nothing to do.")
                )
            if not dry_run:
                failures.extend(
                    f"{alias}: {status.label} did not answer ({status.error})"
                    for status in statuses
                    if status.error is not None
                )
        if dry_run or not to_trust:
            self.raise_failures(failures)
            return
        if options["interactive"]:
            self.confirm([alias for alias, _, _ in to_trust])
        for alias, backend, statuses in to_trust:
            marked = backend.trust_nodes()
            if marked:
                self.stdout.write(
                    self.style.SUCCESS(
                        f"{alias}: {plural(len(marked), 'master')} trusted now: "
                        f"{', '.join(marked)}."
                    )
                )
            failures.extend(
                f"{alias}: {status.label} could not be marked trusted"
                for status in statuses
                if status.error is None and status.label not in marked
            )
        self.raise_failures(failures)

    def raise_failures(self, failures):
        if failures:
            raise CommandError(
                "; ".join(failures) + ". Run the command again once every master answers."
            )

    def redlock_backends(self, requested):
        """``[(alias, backend)]``: the requested aliases (CommandError for one that is
        unknown or not Redlock), or every Redlock alias."""
        if requested:
            selected = select_backends(requested)
            others = [
                f"{alias!r} is a {type(backend).__name__}"
                for alias, backend in selected
                if not isinstance(backend, RedlockBackend)
            ]
            if others:
                raise CommandError(
                    f"Lock backend {'; '.join(others)}, not a RedlockBackend: only Redlock "
                    f"masters sit out after losing their data."
                )
            return selected
        aliases = [alias for alias, params in locks.settings.items() if _is_redlock(params)]
        if not aliases:
            raise CommandError("No Redlock backend is configured in SETNX_LOCKS.")
        try:
            return [(alias, locks[alias]) for alias in aliases]
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc

    def report(self, alias, backend, statuses):
        """Write one line per master: whether it votes, and if not, when it will."""
        self.stdout.write(
            f"{alias}: {plural(len(statuses), 'master')} (MAX_TTL = {backend.max_ttl:g} s)"
        )
        for status in statuses:
            if status.error is not None:
                state = f"did not answer: {status.error}"
            elif status.trusted:
                state = "trusted: votes"
            elif status.votes_in is None:
                state = (
                    f"no marker (brand-new, or restarted empty): sits out for "
                    f"{backend.max_ttl:g} s from the first acquire that reaches it"
                )
            else:
                state = f"untrusted: votes in {status.votes_in:.0f} s"
            self.stdout.write(f"  {status.label}  {state}")

    def confirm(self, aliases):
        aliases = ", ".join(map(repr, aliases))
        confirm_or_cancel(
            f"You have requested to trust the masters of {aliases} now.\n"
            "A master that restarted without all its data (empty, from a snapshot or a "
            "backup, or a replica promoted in its place) may have forgotten locks it "
            "granted; until MAX_TTL has passed those locks may still be held, and trusting "
            "it lets a second holder take them.\n"
            "Only continue for brand-new masters, or masters restarted while certainly no "
            "lock was held, or with every key they had.",
            f"{TRUST_COMMAND} cancelled: no master was marked trusted.",
        )


def _is_redlock(params):
    try:
        backend_cls = import_string(params["BACKEND"])
    except (ImportError, KeyError, TypeError):
        return False  # not loadable: `manage.py check` reports it
    return isinstance(backend_cls, type) and issubclass(backend_cls, RedlockBackend)
