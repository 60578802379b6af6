#!/usr/bin/env python3
"""Run the example project: ``python3 scripts/demo.py [--port 8000]``.

Needs nothing but Python 3.10+. Creates (or reuses) ``.venv``, installs
django-setnx there (``-e .``, which brings Django; plus ``redis`` when
``SETNX_REDIS_URL`` is set, making Redis the default lock backend), migrates the
SQLite database ``example_project/db.sqlite3``, seeds a few held and stale locks
(``manage.py seed_demo_locks``), creates the local admin user ``admin`` / ``admin``
if it is missing (for this local demo only) and starts Django's development server
on 127.0.0.1. Stop it with Ctrl-C. Celery is optional: the demo's task page says
how to install it.

    python3 scripts/demo.py
    python3 scripts/demo.py --port 8001
    SETNX_REDIS_URL=redis://127.0.0.1:6379/0 python3 scripts/demo.py
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv
from _venv import ROOT, header, info

PROJECT = ROOT / "example_project"
ADMIN_USER = "admin"
ADMIN_PASSWORD = "admin"  # for this local demo only

#: Run in ``manage.py shell``: create the local demo superuser unless it exists.
CREATE_ADMIN = f"""
from django.contrib.auth import get_user_model
User = get_user_model()
if User.objects.filter(username={ADMIN_USER!r}).exists():
    print("exists")
else:
    User.objects.create_superuser({ADMIN_USER!r}, "admin@example.invalid", {ADMIN_PASSWORD!r})
    print("created")
"""


def main(argv):
    parser = argparse.ArgumentParser(
        description="Run the django-setnx example project on 127.0.0.1."
    )
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be between 1 and 65535, not {args.port}")

    redis_url = os.environ.get("SETNX_REDIS_URL", "").strip()
    header("Environment: .venv")
    python = _venv.ensure("redis" if redis_url else "core")
    info(f"Ready: {python}")

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DJANGO_SETTINGS_MODULE", None)  # manage.py sets the example project's
    manage = [str(python), "manage.py"]

    header("Database: migrate (example_project/db.sqlite3)")
    proc = subprocess.run([*manage, "migrate", "--noinput"], cwd=PROJECT, env=env, check=False)
    if proc.returncode != 0:
        return proc.returncode

    header("Demo locks: seed_demo_locks (a few held and stale locks)")
    proc = subprocess.run([*manage, "seed_demo_locks"], cwd=PROJECT, env=env, check=False)
    if proc.returncode != 0:
        return proc.returncode

    header("Admin user (for this local demo only)")
    proc = subprocess.run(
        [*manage, "shell", "-c", CREATE_ADMIN],
        cwd=PROJECT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        return proc.returncode
    state = "created" if "created" in proc.stdout else "already there"
    print(
        f"  Username: {ADMIN_USER}\n"
        f"  Password: {ADMIN_PASSWORD}\n"
        f"  ({state}; for this local demo only: never use these credentials elsewhere)",
        flush=True,
    )

    url = f"http://127.0.0.1:{args.port}/"
    backend = f"Redis at {redis_url}" if redis_url else "the SQLite database"
    header(f"Demo: {url}")
    print(
        f"  {url:<40} the demo's index: links to everything below\n"
        f"  {url + 'report/':<40} a 5-second view under @locked('demo:slow-report'); open it\n"
        f"  {'':<40} twice at once and the second answers 409 busy, with Retry-After\n"
        f"  {url + 'async-report/':<40} the same as an async view\n"
        f"  {url + 'task/':<40} a Celery task, run-exclusive and enqueue-once (optional)\n"
        f"  {url + 'locks/':<40} the current locks (name, state, fencing token, owner)\n"
        f"  {url + 'admin/':<40} the admin (log in as {ADMIN_USER} / {ADMIN_PASSWORD}); its\n"
        f"  {'':<40} Locks page: {url}admin/django_setnx/lockrecord/\n"
        f"  Locks live in {backend}. Stop the server with Ctrl-C.\n",
        flush=True,
    )
    cmd = [*manage, "runserver", f"127.0.0.1:{args.port}"]
    os.chdir(PROJECT)
    if os.name == "posix":
        os.execve(cmd[0], cmd, env)  # the server becomes this process: Ctrl-C just works
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
