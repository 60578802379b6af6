"""Settings of the django-setnx example project: a local demo, not a deployment.

Locks live in the project's own SQLite database (the zero-setup default). Set
``SETNX_REDIS_URL`` (e.g. ``redis://127.0.0.1:6379/0``) to make Redis the
``default`` lock backend instead; the database backend then stays available as
``database``.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

# A local demo only: never deploy with this key or with DEBUG on.
SECRET_KEY = os.environ.get(
    "DJANGO_SECRET_KEY", "django-insecure-django-setnx-example-project-local-demo-only"
)
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_setnx",
    "demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "example_project.wsgi.application"
ASGI_APPLICATION = "example_project.asgi.application"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "db.sqlite3",
        # Lock rows are written on their own connection: wait for a busy file
        # rather than failing at once.
        "OPTIONS": {"timeout": 20},
    }
}

# django-setnx: the project's own database by default; Redis when SETNX_REDIS_URL is set.
SETNX_REDIS_URL = os.environ.get("SETNX_REDIS_URL", "").strip()
SETNX_DATABASE_BACKEND = {
    "BACKEND": "django_setnx.backends.database.DatabaseBackend",
    "OPTIONS": {"DATABASE": "default"},
}
if SETNX_REDIS_URL:
    SETNX_LOCKS = {
        "default": {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": SETNX_REDIS_URL,
            "KEY_PREFIX": "setnx-demo",
        },
        "database": SETNX_DATABASE_BACKEND,
    }
else:
    SETNX_LOCKS = {"default": SETNX_DATABASE_BACKEND}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
