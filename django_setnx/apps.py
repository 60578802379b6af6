from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DjangoSetnxConfig(AppConfig):
    name = "django_setnx"
    verbose_name = _("Locks")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Registers the system checks; importing checks reads no settings.
        from . import checks  # noqa: F401
