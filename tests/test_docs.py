"""Every Python example of the documentation runs.

The tutorial's examples are doctests, run by ``scripts/check.py doctest`` (Sphinx's
doctest builder). The other pages' ```python blocks, and the README's, run here, each in a fresh
namespace, against the test settings and the real backends; a block whose page marks
it ``<!-- docs-test: compile-only (why) -->`` (it needs the reader's own model, say)
is compiled only.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(
    r"^(<!-- docs-test: compile-only \((?P<why>[^)]*)\) -->\n)?```python\n(?P<code>.*?)^```",
    re.S | re.M,
)

pytestmark = pytest.mark.autocommit


def examples():
    found = []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start("code")].count("\n") + 1
            found.append(
                pytest.param(
                    path, line, match["code"], match["why"], id=f"{path.relative_to(ROOT)}:{line}"
                )
            )
    return found


def test_the_docs_have_examples():
    assert len(examples()) >= 10


@pytest.mark.parametrize("path, line, code, compile_only", examples())
def test_example_runs(path, line, code, compile_only):
    compiled = compile(code, f"{path}:{line}", "exec")
    if compile_only:
        return
    from django_setnx import locks

    try:
        exec(compiled, {"__name__": f"docs_example_{line}"})
    finally:
        for alias in locks:
            locks[alias].clear(include_held=True)
