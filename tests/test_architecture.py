"""The layout holds: imports run one way between the layers, no import cycle at any depth (inside
functions and under TYPE_CHECKING too, between modules or between folders), no file over 400
lines, and the core knows no nn.Module or transformers (docs/architecture.md).

The checks live in tests/architecture_check.py as functions of a package directory. Each is run
on the real optq, and on a temporary copy of optq with a violation planted in a lower-layer
module: a check that cannot fail on a planted violation would pass vacuously on the real tree.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from architecture_check import (
    LAYERS,
    MAX_LINES,
    Package,
    core_uses_of_modules,
    find_cycle,
    folder_graph,
    import_graph,
    layer,
    long_files,
    loops,
    upward_uses,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "optq"
OPTQ = Package(PACKAGE)


def _plant(tmp_path: Path, module: str, code: str) -> tuple[Package, int]:
    """A copy of optq with ``code`` appended to ``module`` ("core/grid.py"), and the first line it took."""
    root = tmp_path / "optq"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    path = root / module
    text = path.read_text(encoding="utf-8").rstrip("\n") + "\n\n"
    path.write_text(text + code + "\n", encoding="utf-8")
    return Package(root), len(text.splitlines()) + 1


# --- the real package -----------------------------------------------------------------------


def test_the_layers_exist_and_hold_every_module():
    for name in LAYERS:
        assert f"optq.{name}" in OPTQ.modules, f"missing subpackage optq/{name}"
    loose = [m for m in OPTQ.modules if m.count(".") == 1 and layer(m) is None]
    assert sorted(loose) == ["optq.__main__"], f"modules outside the layers: {loose}"


def test_the_facade_table_is_read_and_names_real_modules():
    # `from optq import quantize` resolves through this table; an empty or stale one would hide
    # upward imports through the facade.
    assert OPTQ.exports, "optq/__init__.py's _EXPORTS table was not found"
    stale = {name: m for name, m in OPTQ.exports.items() if m not in OPTQ.modules or layer(m) is None}
    assert not stale, f"_EXPORTS names modules that do not exist: {stale}"
    assert layer(OPTQ.module_of("optq.quantize")) == "pipeline"
    assert OPTQ.module_of("optq.__version__") == "optq"  # no layer: allowed everywhere


def test_imports_never_go_up_a_layer():
    found = upward_uses(OPTQ)
    assert not found, "upward imports:\n" + "\n".join(map(str, found))


def test_no_import_cycle_at_any_depth():
    graph = import_graph(OPTQ)
    assert graph["optq.formats.checkpoint"], "the graph misses module-level imports"
    assert "optq.cli" in graph["optq.__main__"], "the graph misses relative imports"  # from .cli import main
    folders = folder_graph(graph, OPTQ.packages)
    assert "optq.pipeline.blocks/" in folders["optq.pipeline.stream/"], "the folder graph misses subpackages"
    found = [*loops(graph), *(c for c in loops(folders) if c not in loops(graph))]
    assert not found, "import cycles (modules, or folders ending in /):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_core_knows_no_modules_or_transformers():
    found = core_uses_of_modules(OPTQ)
    assert not found, "\n".join(map(str, found))


def test_no_file_over_the_limit():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    long = long_files(files)
    assert not long, f"files over {MAX_LINES} lines: {long}"


# --- the checks see what they are meant to see ----------------------------------------------


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert loops(graph) == [["a", "b"], ["c", "d", "e"]]
    assert loops({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_folder_graph_joins_the_children_of_the_deepest_common_package():
    # p.x.m -> p.y.n and p.y.k -> p.x.j close no chain of modules, but x/ and y/ import each other.
    graph = {"p.x.m": {"p.y.n"}, "p.y.k": {"p.x.j"}, "p.x.j": {"p.x.i"}, "p.r": {"p.x.m", "p"}, "p": set()}
    packages = ["p", "p.x", "p.y"]
    assert folder_graph(graph, packages) == {
        "p.x/": {"p.y/"},
        "p.y/": {"p.x/"},
        "p.x.j": {"p.x.i"},
        "p.r": {"p.x/", "p"},
    }
    assert loops(graph) == [] and loops(folder_graph(graph, packages)) == [["p.x/", "p.y/"]]


def test_the_checker_sees_lazy_and_module_level_imports(tmp_path):
    # A lazy import inside a function goes up a layer just the same; one under `if TYPE_CHECKING:`
    # never runs, so it is no upward use. Both are edges of the import graph: a loop they close
    # is hidden from Python, not from the design.
    code = "from optq.core import solver\n\ndef f():\n    from optq.pipeline.loop import quantize\n"
    code += "\nif TYPE_CHECKING:\n    from optq.eval import perplexity\n"
    package, first = _plant(tmp_path, "core/grid.py", code)
    assert [(v.line, v.message.split()[1]) for v in upward_uses(package)] == [
        (first + 3, "optq.pipeline.loop.quantize")
    ]
    graph = import_graph(package)
    assert {"optq.core.solver", "optq.pipeline", "optq.eval.perplexity"} <= graph["optq.core.grid"]


UPWARD = {
    "absolute": "from optq.pipeline import loop",
    # 1. relative imports, resolved against the importing module's package
    "relative-parent": "from ..pipeline import loop",
    "relative-module": "from ..pipeline.loop import quantize",
    "relative-deep": "from ..eval.perplexity import perplexity",
    "relative-root": "from .. import pipeline",
    "relative-lazy": "def f():\n    from ..eval import compare",
    # 2. the facade's lazy re-exports
    "facade": "from optq import quantize",
    "facade-relative": "from .. import perplexity",
    "facade-attribute": "import optq\n\ndef f():\n    return optq.quantize",
    "package-attribute": "import optq.core\n\nX = optq.pipeline.loop",
    # 3. imports by string at run time
    "import_module": 'import importlib\n\nimportlib.import_module("optq.pipeline.loop")',
    "import_module-aliased": 'from importlib import import_module as im\n\ndef f():\n    return im("optq.eval")',
    "import_module-relative": 'import importlib\n\nimportlib.import_module(".loop", "optq.pipeline")',
    "import_module-package=": 'import importlib\n\nimportlib.import_module(".pipeline.loop", package="optq")',
    "import_module-__package__": 'import importlib\n\nimportlib.import_module("..pipeline", __package__)',
    "__import__": '__import__("optq.pipeline.loop")',
    "__import__-fromlist": '__import__("optq", fromlist=["quantize"])',
    "__import__-level": '__import__("pipeline", globals(), locals(), [], 2)',
}


@pytest.mark.parametrize("code", UPWARD.values(), ids=UPWARD.keys())
def test_a_planted_upward_import_is_caught(tmp_path, code):
    package, first = _plant(tmp_path, "core/grid.py", code)
    found = upward_uses(package)
    assert found, f"missed: {code!r}"
    assert {v.path for v in found} == {"optq/core/grid.py"} and all(v.line >= first for v in found)
    assert all(layer(v.message.split("(")[1].split(")")[0]) in ("pipeline", "eval") for v in found)


@pytest.mark.parametrize(
    ("module", "code", "caught"),
    [
        # In a package's __init__.py `.` is the package itself, in a plain module its parent.
        ("data/__init__.py", "from .. import pipeline", True),
        ("data/zoo/__init__.py", "from .. import pipeline", False),  # optq.data.pipeline
        ("data/zoo/__init__.py", "from ... import pipeline", True),
        ("data/zoo/load.py", "from ... import eval", True),
        ("formats/__init__.py", "from .. import cli", True),
    ],
    ids=["init-parent", "init-sibling", "init-grandparent", "module-grandparent", "init-cli"],
)
def test_relative_imports_resolve_against_their_package(tmp_path, module, code, caught):
    package, _ = _plant(tmp_path, module, code)
    assert bool(upward_uses(package)) == caught


ALLOWED = {
    "version": "from optq import __version__",
    "facade-core": "from optq import QuantConfig\nfrom .. import gptq",
    "sibling": "from . import solver",
    "computed": 'import importlib\n\nimportlib.import_module(f"optq.{NAME}")',
    "unknown-anchor": 'import importlib\n\nimportlib.import_module(".loop", PACKAGE)',
    "type-checking": "if TYPE_CHECKING:\n    from optq.pipeline import loop",
    "functional": "import torch.nn.functional as F\nfrom torch.nn import functional\n\ntorch.nn.functional.relu",
    "torch": "import torch as t\n\nt.cuda.is_available()",
}


@pytest.mark.parametrize("code", ALLOWED.values(), ids=ALLOWED.keys())
def test_an_allowed_use_in_core_is_not_flagged(tmp_path, code):
    package, _ = _plant(tmp_path, "core/grid.py", code)
    assert not upward_uses(package) and not core_uses_of_modules(package)


NN = {
    "import-as": "import torch.nn as nn",
    "import": "import torch.nn",
    "from-torch": "from torch import nn",
    "from-torch-nn": "from torch.nn import Linear",
    # 4. torch.nn reached through `import torch`
    "attribute": "torch.nn.Linear(2, 2)",
    "attribute-lazy": "def f(x):\n    return isinstance(x, torch.nn.Module)",
    "attribute-alias": "import torch as t\n\nM = t.nn.Module",
    "attribute-bare": "nn = torch.nn",
    "annotation": "def f(m: torch.nn.Module) -> None:\n    pass",
    "import_module": 'import importlib\n\nimportlib.import_module("torch.nn")',
    "transformers": "from transformers import AutoModel",
    "accelerate": "import accelerate",
}


@pytest.mark.parametrize("code", NN.values(), ids=NN.keys())
def test_a_planted_use_of_modules_in_core_is_caught(tmp_path, code):
    package, first = _plant(tmp_path, "core/grid.py", code)  # grid.py does `import torch`
    found = core_uses_of_modules(package)
    assert found and {v.path for v in found} == {"optq/core/grid.py"} and all(v.line >= first for v in found)


@pytest.mark.parametrize(
    "code",
    [
        "from . import solver",  # solver imports grid at module level
        'import importlib\n\nimportlib.import_module("optq.core.solver")',
        "from optq import gptq",  # through the facade: optq.core.solver
        "def f():\n    from . import solver",  # runs only when called: a loop all the same
        "def f():\n    def g():\n        from optq.core.solver import gptq",  # at any depth
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from optq.core.solver import Solution",
    ],
    ids=["relative", "import_module", "facade", "deferred", "deferred-nested", "type-checking"],
)
def test_a_planted_import_cycle_is_caught(tmp_path, code):
    assert not any("optq.core.grid" in c for c in loops(import_graph(OPTQ)))
    package, _ = _plant(tmp_path, "core/grid.py", code)
    assert any({"optq.core.grid", "optq.core.solver"} <= set(c) for c in loops(import_graph(package)))
    cycle = find_cycle({k: v for k, v in import_graph(package).items() if k.startswith("optq.core")})
    assert cycle and {"optq.core.grid", "optq.core.solver"} <= set(cycle)


@pytest.mark.parametrize(
    "code",
    [
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from optq.pipeline.stream import journal",
        "def f():\n    from ..stream.source import SafetensorsSource",
        "def f():\n    import importlib\n\n    return importlib.import_module('optq.pipeline.stream.sink')",
    ],
    ids=["type-checking", "deferred", "deferred-import_module"],
)
def test_a_planted_folder_cycle_is_caught(tmp_path, code):
    # stream/ imports blocks/ (the sink, the loop); a use of stream/ anywhere in blocks/ closes a
    # loop between the folders, whether or not a chain of modules closes too.
    real = loops(folder_graph(import_graph(OPTQ), OPTQ.packages))
    assert not any("optq.pipeline.blocks/" in c for c in real)
    package, _ = _plant(tmp_path, "pipeline/blocks/hessians.py", code)
    found = loops(folder_graph(import_graph(package), package.packages))
    assert any({"optq.pipeline.blocks/", "optq.pipeline.stream/"} <= set(c) for c in found), found


def test_a_planted_long_file_is_caught(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)
    assert long_files([long, short]) == {str(long): MAX_LINES + 1}
