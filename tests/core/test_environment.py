"""Every environment variable optq reads is declared in optq.core.environment, read only there,
and listed (with its default) in docs/environment.md.

The source checks walk each module's syntax tree; each is also run on a planted violation, so a
check that could never fail would not pass vacuously.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from optq.core import environment

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "optq"
HOME = PACKAGE / "core" / "environment.py"
DOC = ROOT / "docs" / "environment.md"
# What reads or changes the process's environment: os.environ and its relatives.
_ENVIRON = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environ_uses(source: str) -> list[int]:
    """The lines of ``source`` that touch the environment directly (``os.environ``,
    ``os.getenv``, ``from os import environ``, through any alias of os)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in _ENVIRON:
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt"):
            if any(alias.name in _ENVIRON or alias.name == "*" for alias in node.names):
                found.append(node.lineno)
    return found


def names_read(source: str, getter: str = "environment.get") -> list[str | None]:
    """The variable names ``source`` passes to ``getter``: a string literal, or a module-level
    constant holding one (``ENV = "..."``); None for anything else (a name not known here)."""
    tree = ast.parse(source)
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == getter and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(arg.value)
            else:
                found.append(constants.get(arg.id) if isinstance(arg, ast.Name) else None)
    return found


def _modules() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


# --- the real package -----------------------------------------------------------------------


def test_only_the_environment_module_touches_os_environ():
    modules = _modules()
    assert environ_uses(modules.pop(HOME)), "optq/core/environment.py no longer reads os.environ"
    found = {str(p.relative_to(ROOT)): lines for p, source in modules.items() if (lines := environ_uses(source))}
    assert not found, f"read the environment through optq.core.environment, not directly: {found}"


def test_every_variable_read_is_declared_and_every_declared_one_is_read():
    read = []
    for path, source in _modules().items():
        read += names_read(source, "get" if path == HOME else "environment.get")
    assert None not in read, "a variable read through a name this test cannot resolve"
    assert set(read) == set(environment.VARIABLES)


def test_the_doc_lists_every_variable_with_its_default():
    text = DOC.read_text(encoding="utf-8")
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([A-Z_]+)` \| ([^|]*) \|", text, re.M)}
    for name, var in environment.VARIABLES.items():
        assert name in rows, f"docs/environment.md has no row for {name}"
        assert rows[name].strip() == var.default, f"{name}: the doc says {rows[name]!r}, the code {var.default!r}"
    assert set(rows) == set(environment.VARIABLES), "the doc's table lists a variable optq does not read"
    assert f"optq reads {len(environment.VARIABLES)} environment variables" in text


def test_get_reads_now_and_refuses_an_undeclared_name(monkeypatch):
    monkeypatch.setenv("OPTQ_DIST_TIMEOUT", "12")
    assert environment.get("OPTQ_DIST_TIMEOUT") == "12"
    monkeypatch.setenv("OPTQ_DIST_TIMEOUT", "")
    assert environment.get("OPTQ_DIST_TIMEOUT") is None  # empty counts as unset
    monkeypatch.delenv("OPTQ_DIST_TIMEOUT")
    assert environment.get("OPTQ_DIST_TIMEOUT") is None
    monkeypatch.setenv("HOME_GROWN", "1")
    with pytest.raises(KeyError, match="HOME_GROWN is not declared"):
        environment.get("HOME_GROWN")


def test_child_environment_puts_the_path_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("OPTQ_CACHE", "/cache")
    env = environment.child_environment("/mine")
    assert env["PYTHONPATH"] == f"/mine{__import__('os').pathsep}/elsewhere"
    assert env["OPTQ_CACHE"] == "/cache"  # the rest is passed on
    monkeypatch.delenv("PYTHONPATH")
    assert environment.child_environment("/mine")["PYTHONPATH"] == "/mine"


# --- planted violations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        'import os\nx = os.environ.get("X")',
        'import os\nx = os.getenv("X")',
        'import os as o\nx = o.environ["X"]',
        "from os import environ",
        "from os import getenv as g",
        'import os\nos.putenv("X", "1")',
    ],
)
def test_a_planted_direct_read_is_found(code):
    source = (PACKAGE / "data" / "corpora.py").read_text(encoding="utf-8")
    assert environ_uses(source) == []
    lines = len(source.splitlines())
    planted = environ_uses(source + "\n" + code + "\n")
    assert planted and min(planted) > lines


def test_a_planted_undeclared_or_unresolved_read_is_found():
    source = (PACKAGE / "data" / "corpora.py").read_text(encoding="utf-8")
    before = names_read(source)
    assert before == ["OPTQ_CACHE", "XDG_CACHE_HOME"]

    def planted(code):
        return sorted(names_read(source + "\n" + code + "\n"), key=str)

    assert planted('x = environment.get("HOME_GROWN")') == ["HOME_GROWN", *before]
    assert planted("NAME = 'MINE'\nx = environment.get(NAME)") == ["MINE", *before]
    assert None not in before and None in planted("x = environment.get(pick())")
