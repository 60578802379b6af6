"""``manage.py seed_demo_locks``: a few held and stale locks for the admin's Locks page.

Held locks get a long TTL (an hour by default) and a ``guards`` description, as if
a worker held them; stale locks are taken with a 50 ms TTL and left to expire,
as if their holder had died. Idempotent: a lock that already exists (held or
stale) is left alone, so running it again adds nothing.
"""

import time

from django.core.management.base import BaseCommand

from django_setnx import lock, locks
from django_setnx.conf import DEFAULT_LOCK_ALIAS

HELD = [
    ("invoice:2024-0042", "celery task billing.tasks.charge_invoice"),
    ("report:monthly:acme", "POST /reports/monthly/ (reports.views.build_report)"),
    ("import:catalog:shop-7", "manage.py import_catalog --shop 7"),
]
STALE = [
    ("sync:shop-3", "celery task shops.tasks.sync_shop (worker killed)"),
    ("cron:nightly-cleanup", "cron cleanup.jobs.nightly (host rebooted)"),
]
STALE_TTL = 0.05


class Command(BaseCommand):
    help = "Create a few held and stale demo locks on a lock backend (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--backend",
            default=DEFAULT_LOCK_ALIAS,
            help="lock backend alias (default: %(default)s)",
        )
        parser.add_argument(
            "--ttl",
            type=float,
            default=3600,
            help="TTL of the held locks, in seconds (default: %(default)s)",
        )

    def handle(self, *, backend, ttl, **options):
        store = locks[backend]
        created_stale = False
        for name, guards, lock_ttl in [(n, g, ttl) for n, g in HELD] + [
            (n, g, STALE_TTL) for n, g in STALE
        ]:
            if store.get(name) is not None:
                self.stdout.write(f"  exists  {name}")
                continue
            # Taken and never released: the record stays until it expires.
            taken = lock(name, ttl=lock_ttl, backend=backend, timeout=0, guards=guards).acquire()
            if taken:
                created_stale |= lock_ttl == STALE_TTL
                kind = "stale" if lock_ttl == STALE_TTL else "held"
                self.stdout.write(f"  {kind:<7} {name}")
            else:
                self.stdout.write(f"  busy    {name} (held by someone else)")
        if created_stale:
            time.sleep(STALE_TTL * 4)  # let the short ones expire: they are stale now
        held = sum(1 for _ in store.list(state="held"))
        stale = sum(1 for _ in store.list(state="stale"))
        self.stdout.write(
            self.style.SUCCESS(f"Backend {backend!r}: {held} held and {stale} stale lock(s).")
        )
