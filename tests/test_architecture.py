"""The layout holds: imports run one way between the layers, no module-level import cycle, no
file over 400 lines, and the core knows no nn.Module or transformers (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "optq"
# A layer may import itself and the layers before it, never one after it.
LAYERS = ["core", "formats", "data", "pipeline", "eval", "cli"]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _imports(path: Path, *, module_level_only: bool) -> list[tuple[int, str]]:
    """(line, imported optq module) for each import of optq in the file.

    ``from optq.a import b`` counts as an import of ``optq.a.b`` when that is a module, else of
    ``optq.a``. Imports under ``if TYPE_CHECKING:`` never run and are left out.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []

    def visit(nodes: list, top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("optq"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("optq"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.append((node.lineno, sub if sub in MODULES else node.module))
            if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                child = getattr(node, field, None)
                if isinstance(child, list):
                    visit([c for c in child if isinstance(c, (ast.stmt, ast.ExceptHandler))], top)

    visit(tree.body, True)
    return found


def test_the_layers_exist_and_hold_every_module():
    for layer in LAYERS:
        assert f"optq.{layer}" in MODULES, f"missing subpackage optq/{layer}"
    loose = [m for m in MODULES if m.count(".") == 1 and _layer(m) is None]
    assert sorted(loose) == ["optq.__main__"], f"modules outside the layers: {loose}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m)))
def test_imports_never_go_up_a_layer(module):
    mine = LAYERS.index(_layer(module))
    for line, target in _imports(MODULES[module], module_level_only=False):
        layer = _layer(target)
        if layer is None:
            continue  # `from optq import __version__`
        assert LAYERS.index(layer) <= mine, f"{MODULES[module].name}:{line} imports {target}, a layer above {_layer(module)}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a closed path, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, [*stack, nxt])):
                return found
        state[node] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_module_level_import_cycle():
    graph = {m: {t for _, t in _imports(p, module_level_only=True) if t in MODULES and t != m} for m, p in MODULES.items()}
    assert graph["optq.formats.checkpoint"], "the graph misses module-level imports"
    cycle = _find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_core_knows_no_modules_or_transformers():
    for module, path in MODULES.items():
        if _layer(module) != "core":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                assert not n.startswith(("transformers", "torch.nn", "accelerate")) or n.startswith("torch.nn.functional"), (
                    f"{path.name}:{node.lineno} imports {n}; optq.core works on tensors only"
                )


def test_no_file_over_the_limit():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_checker_sees_an_upward_import(tmp_path):
    # The checks above would pass vacuously if _imports found nothing: make sure it finds a
    # lazy import inside a function as well as a module-level one.
    src = tmp_path / "x.py"
    src.write_text("from optq.core import grid\n\ndef f():\n    from optq.pipeline.loop import quantize\n")
    assert [t for _, t in _imports(src, module_level_only=False)] == ["optq.core.grid", "optq.pipeline.loop"]
    assert [t for _, t in _imports(src, module_level_only=True)] == ["optq.core.grid"]
