"""Sphinx configuration of django-setnx's documentation.

Sphinx, not MkDocs: the package's docstrings are reStructuredText with Sphinx roles
(``:class:``, ``:meth:``), which autodoc renders as they are, and Sphinx's doctest
builder runs the examples of every page (``scripts/check.py doctest``). The prose is
Markdown (MyST), like the README it grew out of.

The examples run against a real Django project configured below: the ``default``
lock backend is the database backend on a throwaway SQLite file, ``memory`` the
local-memory backend.
"""

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

_DB_DIR = tempfile.mkdtemp(prefix="setnx-docs-")
if not settings.configured:
    settings.configure(
        SECRET_KEY="django-setnx-docs",
        USE_TZ=True,
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django_setnx",
        ],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": os.path.join(_DB_DIR, "docs.sqlite3"),
            },
        },
        SETNX_LOCKS={
            "default": {
                "BACKEND": "django_setnx.backends.database.DatabaseBackend",
                "OPTIONS": {"DATABASE": "default"},
            },
            "memory": {"BACKEND": "django_setnx.backends.locmem.LocMemBackend"},
        },
        ROOT_URLCONF=__name__,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        LOGGING_CONFIG=None,
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)

urlpatterns: list = []

project = "django-setnx"
author = "django-setnx developers"
copyright = "2026, django-setnx developers"
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Locks for Django that a crash cannot deadlock"}

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

# Every example starts from no lock records.
doctest_global_setup = """
from django_setnx import locks
for _alias in locks:
    locks[_alias].clear(include_held=True)
"""


def setup(app):
    """``{django-command-help} name``: the ``--help`` of a management command, as a
    literal block, rendered at build time."""
    from docutils import nodes
    from docutils.parsers.rst import Directive

    class CommandHelp(Directive):
        required_arguments = 1

        def run(self):
            from django.core.management import load_command_class

            command = load_command_class("django_setnx", self.arguments[0])
            parser = command.create_parser("manage.py", self.arguments[0])
            text = parser.format_help()
            return [nodes.literal_block(text, text)]

    app.add_directive("django-command-help", CommandHelp)
