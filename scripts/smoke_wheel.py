#!/usr/bin/env python3
"""Build the sdist and the wheel, install the wheel (not editable) into a fresh
virtualenv with the ``redis`` and ``celery`` extras, and smoke-test the installed
package from outside the source tree.

    python3 scripts/smoke_wheel.py          # CI runs this (scripts/test.py --ci)

What the smoke test proves, against what a user gets from PyPI rather than from a
checkout: the package imports without settings; its migrations, templates and
``py.typed`` are in the wheel; ``manage.py check`` and ``migrate`` pass on SQLite;
a lock is acquired and released through the database backend; the Locks admin page
renders; ``listlocks`` and ``clearlocks`` run; the LICENSE is shipped in both
artifacts; and the ``celery`` extra brings Celery's Redis transport (its absence
once broke the demo's task page).

Exit code 0 on success; the step's output says what failed otherwise.
"""

import os
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SMOKE_SETTINGS = """
SECRET_KEY = "smoke"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["testserver"]
ROOT_URLCONF = "smoke_urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
    "django.contrib.sessions", "django.contrib.messages", "django_setnx",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "smoke.sqlite3"}}
"""

SMOKE_URLS = """
from django.contrib import admin
from django.urls import path
urlpatterns = [path("admin/", admin.site.urls)]
"""

SMOKE_SCRIPT = """
import io, os, sys
import django
import django_setnx  # importing reads no settings
os.environ["DJANGO_SETTINGS_MODULE"] = "smoke_settings"
django.setup()
from pathlib import Path
from django.core.management import call_command
from django.test import Client
from django.contrib.auth.models import User

package = Path(django_setnx.__file__).parent
assert ".venv" not in str(package) and "site-packages" in str(package), package
assert (package / "py.typed").exists(), "py.typed is not in the wheel"
call_command("check", fail_level="WARNING")
call_command("migrate", verbosity=0)

from django_setnx import lock
with lock("smoke:first", ttl=10) as lk:
    assert lk.owned() and lk.fencing_token >= 1
    out = io.StringIO()
    call_command("listlocks", "--json", stdout=out)
    assert "smoke:first" in out.getvalue(), out.getvalue()

User.objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.login(username="admin", password="pw")
page = client.get("/admin/django_setnx/lockrecord/")
assert page.status_code == 200 and b"Locks" in page.content, page.status_code
out = io.StringIO()
call_command("clearlocks", "--dry-run", stdout=out)

import kombu.transport.redis  # the celery extra brings the Redis transport
import django_setnx.contrib.celery
from django_setnx.backends.redis import RedisBackend  # the redis extra
print("smoke test passed:", django_setnx.__version__, "from", package)
"""


def run(cmd, **kwargs):
    print("$", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, stdin=subprocess.DEVNULL, **kwargs)


def main():
    with tempfile.TemporaryDirectory(prefix="setnx-wheel-") as tmp:
        tmp = Path(tmp)
        dist = tmp / "dist"
        run([sys.executable, "-m", "build", "--outdir", dist, ROOT])
        wheel = next(dist.glob("*.whl"))
        sdist = next(dist.glob("*.tar.gz"))
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
        for required in (
            "django_setnx/py.typed",
            "django_setnx/migrations/0001_initial.py",
            "templates/admin/django_setnx/locks/change_list.html",
            "LICENSE",
        ):
            if not any(name.endswith(required) for name in names):
                sys.exit(f"the wheel lacks {required}")
        if any(name.startswith("tests/") for name in names):
            sys.exit("the wheel ships the test suite")
        with tarfile.open(sdist) as tf:
            if not any(name.endswith("/LICENSE") for name in tf.getnames()):
                sys.exit("the sdist lacks LICENSE")

        env_dir = tmp / "venv"
        venv.EnvBuilder(with_pip=True).create(env_dir)
        python = env_dir / "bin" / "python"
        run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                f"{wheel}[redis,celery]",
            ]
        )
        work = tmp / "project"
        work.mkdir()
        (work / "smoke_settings.py").write_text(textwrap.dedent(SMOKE_SETTINGS))
        (work / "smoke_urls.py").write_text(textwrap.dedent(SMOKE_URLS))
        (work / "smoke.py").write_text(textwrap.dedent(SMOKE_SCRIPT))
        # Run from the project directory, never from the checkout: the import must
        # find the installed wheel, not the source tree.
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE")
        }
        env["PYTHONPATH"] = str(work)
        run([python, work / "smoke.py"], cwd=work, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
