"""Tables of the database backend.

``LockRecord`` holds one row per held or stale lock; its unique ``name`` is the
SETNX. A row whose ``token`` is empty is no lock: it was released while a waiter
was next in line, and only keeps that waiter's place (the backend hides it). Its
``fencing`` column is the fencing token of the row's acquisition: a hybrid clock
(the database's clock in µs, or the row's previous token plus one if larger), so
no table grows with every name ever locked. Times are integer milliseconds since
the epoch **from the database's clock**, so comparisons never depend on an app
server's clock or time zone.

The backend writes these tables with raw SQL on its own connection; the models
exist for migrations, the admin and ad-hoc queries.
"""

from django.db import models
from django.utils.translation import gettext_lazy as _

from .conf import MAX_NAME_LENGTH


class LockRecord(models.Model):
    # The name is the primary key: one index for the SETNX, and no auto-increment
    # column (MySQL's insert id then carries the acquire's fencing token back).
    name = models.CharField(_("name"), max_length=MAX_NAME_LENGTH, primary_key=True)
    token = models.CharField(_("token"), max_length=64)
    owner = models.TextField(
        _("owner"), default="{}", help_text=_("JSON: host, pid, thread, guards.")
    )
    acquired_at = models.BigIntegerField(
        _("acquired at"), help_text=_("Milliseconds since the epoch, database clock.")
    )
    expires_at = models.BigIntegerField(
        _("expires at"), help_text=_("Milliseconds since the epoch, database clock.")
    )
    fencing = models.BigIntegerField(_("fencing token"), default=0)
    # The waiter next in line (see backends/database.py, "Fairness"): the token of
    # the longest-waiting caller, when it started waiting (its own clock, ms; only
    # compared with other waiters') and when it last asked (database clock, ms).
    next_token = models.CharField(_("next in line"), max_length=64, default="", blank=True)
    next_since = models.BigIntegerField(_("waiting since"), default=0)
    next_seen = models.BigIntegerField(_("last seen waiting"), default=0)

    class Meta:
        db_table = "django_setnx_lock"
        verbose_name = _("lock")
        verbose_name_plural = _("locks")
        default_permissions = ("view",)
        permissions = [("release_lock", _("Can force-release locks"))]

    def __str__(self):
        return self.name
