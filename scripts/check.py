#!/usr/bin/env python3
"""The checks CI runs besides the tests: ``python3 scripts/check.py [names...]``.

Each check is one command, run from the repository root in the current Python
(``.venv/bin/python scripts/check.py``, or through ``scripts/test.py --ci``, which
installs the ``dev`` extra first):

    lint      ruff check over the package, tests, scripts, benchmarks and the demo
    format    ruff format --check over the same
    types     mypy: the whole package, strict on the public modules (pyproject.toml)
    docs      the documentation site, built with warnings as errors (sphinx -W)
    doctest   every example in the docs, run (sphinx's doctest builder)

Without names, every check runs. Exits 0 when all pass, else 1; a summary lists
each check with its time.
"""

import subprocess
import sys
import time
from pathlib import Path

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


def main(names):
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        sys.exit(f"unknown check(s): {', '.join(unknown)}; known: {', '.join(CHECKS)}")
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
