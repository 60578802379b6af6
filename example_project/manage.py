#!/usr/bin/env python
"""Django's command-line utility for the django-setnx example project."""

import os
import sys


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    try:
        from django.core.management import execute_from_command_line
    except ImportError as exc:
        raise ImportError(
            "Couldn't import Django. Run the demo with `python3 scripts/demo.py` from the "
            "repository root: it creates .venv and installs django-setnx and Django there."
        ) from exc
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
