#!/usr/bin/env python3
"""The checks CI runs besides the tests: ``python3 scripts/check.py [names...]``.

Each check is one command, run from the repository root in the current Python
(``.venv/bin/python scripts/check.py``, or through ``scripts/test.py --ci``):

    lint      ruff check over the package, tests, scripts, benchmarks and the demo
    format    ruff format --check over the same
    types     mypy: the whole package, strict on the public modules (pyproject.toml)
    docs      the documentation site, built with warnings as errors (sphinx -W)
    doctest   every example in the docs, run (sphinx's doctest builder)

Without names, every check runs. Exits 0 when all pass, else 1; a summary lists
each check with its time.

The tools come with the ``dev`` extra. When a check's tool is missing (a ``.venv``
made by ``scripts/test.py`` without ``--ci`` has the ``test`` extra only), check.py
first installs the ``dev`` extra, as ``scripts/test.py`` does (``_venv.ensure``):
into ``.venv`` when that is the running Python; run by a Python outside any venv
(``python3 scripts/check.py``), into ``.venv`` (created if need be), and the checks
then run there. It never installs into another venv: it says what is missing and the
command (``python -m pip install -e ".[dev]"``) instead.
"""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import _venv

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BUILD = ROOT / "docs" / "_build"

CHECKS = {
    "lint": [PY, "-m", "ruff", "check", "."],
    "format": [PY, "-m", "ruff", "format", "--check", "."],
    "types": [PY, "-m", "mypy"],
    "docs": [
        PY,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "html",
        "docs",
        str(BUILD / "html"),
    ],
    "doctest": [
        PY,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "doctest",
        "docs",
        str(BUILD / "doctest"),
    ],
}


#: The modules each check needs, all from the ``dev`` extra.
TOOLS = {
    "lint": ["ruff"],
    "format": ["ruff"],
    "types": ["mypy", "mypy_django_plugin"],
    "docs": ["sphinx", "myst_parser"],
    "doctest": ["sphinx", "myst_parser"],
}


def missing_tools(names):
    wanted = dict.fromkeys(module for name in names for module in TOOLS[name])
    return [module for module in wanted if importlib.util.find_spec(module) is None]


def ensure_tools(names):
    """Install the ``dev`` extra when a tool of ``names`` is missing (see above).
    Returns None to go on here, or the exit code of the checks run in ``.venv``."""
    missing = missing_tools(names)
    if not missing:
        return None
    running = Path(sys.prefix).resolve()
    in_venv = sys.prefix != sys.base_prefix
    if in_venv and running != _venv.VENV.resolve():
        sys.exit(
            f"check.py: {', '.join(missing)} missing from {sys.prefix}; install the dev "
            f"extra there with:\n  {PY} -m pip install -e '.[dev]'\n"
            "or run python3 scripts/check.py outside any venv: it installs the extra "
            "into .venv and runs the checks there."
        )
    _venv.info(f"{', '.join(missing)} missing: installing the dev extra into .venv.")
    python = _venv.ensure("dev")
    if in_venv:  # the running .venv: the tools are there now
        importlib.invalidate_caches()
        return None
    return subprocess.run([str(python), __file__, *names], cwd=ROOT, check=False).returncode


def main(names):
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        sys.exit(f"unknown check(s): {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    code = ensure_tools(names or list(CHECKS))
    if code is not None:
        return code
    results = []
    for name in names or CHECKS:
        print(f"\n=== {name}: {' '.join(str(part) for part in CHECKS[name][1:])}", flush=True)
        started = time.monotonic()
        code = subprocess.run(CHECKS[name], cwd=ROOT, check=False).returncode
        results.append((name, code, time.monotonic() - started))
    print("\n=== checks")
    for name, code, seconds in results:
        print(f"  {'ok' if code == 0 else f'FAILED (exit {code})':<16} {seconds:6.1f} s  {name}")
    return 1 if any(code for _, code, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
