"""The sources compile without warnings: an invalid escape such as ``"\\ "`` in a docstring is a
DeprecationWarning on Python 3.11, a SyntaxWarning from 3.12 and an error in a later version,
and its docstring renders without the backslash meant there."""

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("specdec", "benchmarks", "tests") for p in (ROOT / folder).rglob("*.py"))


def test_sources_are_found():
    assert len(SOURCES) > 50 and any(p.name == "engine.py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_compiles_without_warnings(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
