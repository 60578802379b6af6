"""Settings to look at the admin's Locks page locally (a screenshot for the docs).

FOR A LOCAL PREVIEW ONLY: a middleware logs every request in as a superuser, so a
headless browser can open the page without a login form. Never use it elsewhere.

    DJANGO_SETTINGS_MODULE=benchmarks._admin_preview_settings python3 -m django migrate
    DJANGO_SETTINGS_MODULE=benchmarks._admin_preview_settings python3 -c \\
        "import benchmarks._admin_preview_settings as s; s.seed()"
    DJANGO_SETTINGS_MODULE=benchmarks._admin_preview_settings python3 -m django \\
        runserver 127.0.0.1:8765 --noreload

SQLite in ``$SETNX_PREVIEW_DB`` (default ``/tmp/setnx-admin-preview.sqlite3``); a Redis
alias too when ``SETNX_PREVIEW_REDIS_URL`` is set.
"""

import os

SECRET_KEY = "django-setnx-admin-preview-only"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
ROOT_URLCONF = __name__
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_setnx",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    f"{__name__}.preview_autologin",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SETNX_PREVIEW_DB", "/tmp/setnx-admin-preview.sqlite3"),
    }
}
SETNX_LOCKS = {"default": {"BACKEND": "django_setnx.backends.database.DatabaseBackend"}}
if os.environ.get("SETNX_PREVIEW_REDIS_URL"):
    SETNX_LOCKS["redis"] = {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        "LOCATION": os.environ["SETNX_PREVIEW_REDIS_URL"],
        "KEY_PREFIX": "setnx-preview",
    }


def preview_autologin(get_response):
    """PREVIEW ONLY: log every request in as the superuser "preview"."""

    def middleware(request):
        from django.contrib.auth import login
        from django.contrib.auth.models import User

        if not request.user.is_authenticated:
            user, _ = User.objects.get_or_create(
                username="preview", defaults={"is_staff": True, "is_superuser": True}
            )
            login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        return get_response(request)

    return middleware


def __getattr__(name):
    # The URLconf (ROOT_URLCONF is this module), built on first use, once apps are ready.
    if name == "urlpatterns":
        from django.contrib import admin
        from django.urls import path

        admin.site.enable_nav_sidebar = False  # a wider table in the screenshot
        return [path("admin/", admin.site.urls)]
    raise AttributeError(name)


def seed():
    """A few held and stale locks on every configured backend."""
    import django

    django.setup()
    import time

    from django_setnx import lock, locks

    for alias in locks:
        locks[alias].clear(include_held=True)
        for name, ttl, guards in [
            ("reports:daily", 3600, "reports.tasks.build_daily_report"),
            ("invoices:send:2024-06", 900, "billing.views.send_invoices"),
            ("import:catalog", 120, "catalog.management.commands.import_catalog"),
            ("<script>alert(1)</script>", 600, None),
        ]:
            lock(name, ttl=ttl, backend=alias, guards=guards).acquire(blocking=False)
        for name in ("cache:warmup", "sync:crm:contacts"):
            lock(name, ttl=0.05, backend=alias, guards="crm.tasks.sync").acquire(blocking=False)
    time.sleep(0.2)
