"""Every Python example of the documentation runs.

The tutorial's examples are doctests, run by ``scripts/check.py doctest`` (Sphinx's
doctest builder). The other pages' ```python blocks, and the README's, run here, each in a fresh
namespace, against the test settings and the real backends. A block indented under a
list item runs too (dedented). A block whose page marks it
``<!-- docs-test: compile-only (why) -->`` on the line above (it needs the reader's own
model, say) is compiled only; keep those few.

Beyond running: a ``SETNX_LOCKS`` a block defines goes through the library's own
validation (the system checks, and each alias' backend built without connecting); the
README's 30-second example calls the functions it defines; the code example of
``django_setnx.contrib.celery``'s docstring (the Celery reference page) runs; the
signatures written by hand in the API reference match the code; and no page repeats a
heading.
"""

import ast
import asyncio
import inspect
import re
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<info>[^`\n]*)$")
COMPILE_ONLY = re.compile(r"^\s*<!-- docs-test: compile-only \((?P<why>[^)]*)\) -->\s*$")

pytestmark = pytest.mark.autocommit


def fenced_blocks(text):
    """Yield ``(info, line, code, why)`` for each fenced block of a Markdown page, at
    any indentation: ``info`` is the fence's info string (``python``), ``line`` the
    1-based line of the code's first line, ``code`` dedented, ``why`` the reason of a
    compile-only marker on the line above the fence (else None)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        ticks, start = opening["ticks"], i + 1
        end = start
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        marker = COMPILE_ONLY.match(lines[i - 1]) if i else None
        code = textwrap.dedent("\n".join(lines[start:end])) + "\n"
        yield opening["info"].strip(), start + 1, code, marker["why"] if marker else None
        i = end + 1


def examples():
    found = []
    for path in PAGES:
        for info, line, code, why in fenced_blocks(path.read_text()):
            if info == "python":
                found.append(
                    pytest.param(path, line, code, why, id=f"{path.relative_to(ROOT)}:{line}")
                )
    return found


def test_the_docs_have_examples():
    assert len(examples()) >= 10


@pytest.mark.no_db
def test_no_python_block_is_missed():
    """Every block that looks like Python is a ```python block (which runs), and few
    are compile-only."""
    others = [
        f"{path.relative_to(ROOT)}:{line} ({info})"
        for path in PAGES
        for info, line, _code, _why in fenced_blocks(path.read_text())
        if info != "python" and re.match(r"(py|ipython)", info)
    ]
    assert others == []
    assert sum(1 for param in examples() if param.values[3]) <= 2


def validate_lock_settings(namespace):
    """Give the ``SETNX_LOCKS`` (and ``CACHES``, if any) an example defines to the
    library: its system checks must report nothing, and each alias' backend must be
    built (which validates, and connects nowhere)."""
    from django.core import checks
    from django.test import override_settings

    from django_setnx.handler import LockHandler

    overrides = {"SETNX_LOCKS": namespace["SETNX_LOCKS"]}
    if "CACHES" in namespace:
        overrides["CACHES"] = namespace["CACHES"]
    with override_settings(**overrides):
        messages = checks.run_checks(tags=["django_setnx"])
        assert [f"{m.id}: {m.msg}" for m in messages if m.level >= checks.WARNING] == []
        handler = LockHandler()
        for alias in handler.settings:
            handler.create_connection(alias).close()


@pytest.mark.parametrize("path, line, code, compile_only", examples())
def test_example_runs(path, line, code, compile_only):
    compiled = compile(code, f"{path}:{line}", "exec")
    if compile_only:
        return
    from django_setnx import locks

    namespace = {"__name__": f"docs_example_{line}"}
    try:
        exec(compiled, namespace)
    finally:
        for alias in locks:
            locks[alias].clear(include_held=True)
    if "SETNX_LOCKS" in namespace:
        validate_lock_settings(namespace)


def test_readme_example_calls_its_functions():
    """The README's 30-second example, run, then its decorated and async functions
    called: a wrong argument in their bodies fails here."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## 30-second example") :]
    _info, line, code, _why = next(b for b in fenced_blocks(section) if b[0] == "python")
    namespace = {"__name__": "docs_readme_example"}
    exec(compile(code, "README.md (30-second example)", "exec"), namespace)
    from django_setnx import lock

    assert namespace["charge"](1, 2) is None
    assert asyncio.run(namespace["refresh_report"]()) is None
    # The decorator really takes the lock its template names.
    with lock("invoice:1", timeout=0):
        from django_setnx.exceptions import LockNotAcquired

        with pytest.raises(LockNotAcquired):
            namespace["charge"](1, 2)


@pytest.mark.no_db
def test_settings_validation_catches_mistakes():
    """The validation the examples go through notices what a reader would copy wrong."""
    good = {"BACKEND": "django_setnx.backends.database.DatabaseBackend"}
    for wrong in (
        {**good, "BACKEND": "django_setnx.backends.database.NoSuchBackend"},
        {**good, "TTL": -30},
        {**good, "OPTIONS": {"DATABSE": "default"}},
        {**good, "TLL": 30},
    ):
        with pytest.raises(AssertionError):  # a check message
            validate_lock_settings({"SETNX_LOCKS": {"default": wrong}})
    validate_lock_settings({"SETNX_LOCKS": {"default": good}})


@pytest.mark.no_db
def test_no_page_repeats_a_heading():
    """A heading twice at the same level of a page (under the same parent heading:
    the changelog's ``### Added`` of each release is fine) is a copy-paste duplicate;
    Sphinx does not mind, it numbers the second anchor."""
    repeated = []
    for path in [*PAGES, ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md"]:
        text = path.read_text()
        # Headings outside fenced blocks only (a ``#`` comment in code is no heading).
        for _info, _line, code, _why in fenced_blocks(text):
            text = text.replace(code.rstrip("\n"), "")
        parents, seen = [], set()
        for hashes, title in re.findall(r"^(#{1,6}) +(.+?)[ #]*$", text, re.M):
            level = len(hashes)
            parents = [p for p in parents if p[0] < level]
            key = (tuple(parents), level, title)
            if key in seen:
                repeated.append(f"{path.relative_to(ROOT)}: {hashes} {title}")
            seen.add(key)
            parents.append((level, title))
    assert repeated == []


def test_celery_docstring_example_runs(capsys):
    """The example of ``django_setnx.contrib.celery``'s docstring (rendered on the
    Celery reference page), run with an app on Celery's in-memory broker: the tasks
    are defined, the second ``delay(7)`` is refused, and the direct calls run."""
    pytest.importorskip("celery")
    from celery import Celery
    from celery._state import _set_current_app, get_current_app
    from django.conf import settings

    from django_setnx.contrib import celery as contrib_celery

    doc = contrib_celery.__doc__
    body = doc[doc.index("::\n") + 3 :]
    block = re.match(r"(?:\n|[ \t]+[^\n]*\n)+", body).group()
    code = textwrap.dedent(block)
    assert "shared_task" in code

    app = Celery(f"docs_celery_{uuid.uuid4().hex}", set_as_current=False)
    app.conf.update(broker_url="memory://", result_backend="cache+memory://")
    previous = get_current_app()
    _set_current_app(app)  # shared_task's tasks resolve through the current app
    try:
        namespace = {"__name__": f"docs_celery_example_{uuid.uuid4().hex}"}
        exec(compile(code, "<django_setnx.contrib.celery docstring>", "exec"), namespace)
        assert "already queued as" in capsys.readouterr().out
        if "redis" in settings.SETNX_LOCKS:
            assert namespace["build_report"](1, "2026-01") is None
        assert namespace["reindex"](5) is None
    finally:
        _set_current_app(previous)
        app.close()


def hand_written_signatures():
    """The calls in the first column of api.md's tables: ``lock(name, ...)``,
    ``lk.acquire(...)`` (not ``with lock(...)``, which is no signature)."""
    text = (DOCS / "reference" / "api.md").read_text()
    found = []
    for row in re.findall(r"^\| *`([^|]*)` *\|", text, re.M):
        for call in re.findall(r"`?((?:lk\.)?\w+\((?!\.\.\.\)).*?\))`?(?: / |$)", row):
            found.append(call)
    return found


@pytest.mark.no_db
@pytest.mark.parametrize(
    "written", hand_written_signatures(), ids=lambda written: written.split("(")[0]
)
def test_api_reference_signatures_match_the_code(written):
    """Each signature written by hand in api.md has the code's parameters, in order,
    of the same kind, with the same defaults (``...``: a private sentinel meaning
    "the value given to lock()")."""
    import django_setnx

    name = written.split("(", 1)[0]
    if name.startswith("lk."):
        target = getattr(django_setnx.Lock, name[3:])
    else:
        target = getattr(django_setnx, name)
    real = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]

    args = ast.parse(f"def {name.replace('.', '_')}{written[len(name) :]}: pass").body[0].args
    defaults = dict(
        zip([a.arg for a in args.args][len(args.args) - len(args.defaults) :], args.defaults)
    )
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d})
    documented = [(a.arg, "POSITIONAL_OR_KEYWORD") for a in args.args]
    documented += [(a.arg, "KEYWORD_ONLY") for a in args.kwonlyargs]
    assert documented == [(p.name, p.kind.name) for p in real]
    for param in real:
        if param.default is inspect.Parameter.empty:
            assert param.name not in defaults, param.name
            continue
        value = ast.literal_eval(defaults[param.name])
        if value is Ellipsis:
            assert type(param.default) is object, param.name  # a sentinel
        else:
            assert value == param.default, param.name
