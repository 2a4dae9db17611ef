"""The layout holds: imports run one way between the layers, no module-level import cycle, no
file over 400 lines, and the core knows no nn.Module or transformers (docs/architecture.md).

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
    import_graph,
    layer,
    long_files,
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


def test_no_module_level_import_cycle():
    graph = import_graph(OPTQ)
    assert graph["optq.formats.checkpoint"], "the graph misses module-level imports"
    assert "optq.cli" in graph["optq.__main__"], "the graph misses relative imports"  # from .cli import main
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


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


def test_the_checker_sees_lazy_and_module_level_imports(tmp_path):
    # A lazy import inside a function goes up a layer just the same, but runs too late to close
    # an import cycle; one under `if TYPE_CHECKING:` never runs at all.
    code = "from optq.core import solver\n\ndef f():\n    from optq.pipeline.loop import quantize\n"
    code += "\nif TYPE_CHECKING:\n    from optq.eval import perplexity\n"
    package, first = _plant(tmp_path, "core/grid.py", code)
    assert [(v.line, v.message.split()[1]) for v in upward_uses(package)] == [
        (first + 3, "optq.pipeline.loop.quantize")
    ]
    graph = import_graph(package)
    assert "optq.core.solver" in graph["optq.core.grid"] and "optq.pipeline.loop" not in graph["optq.core.grid"]


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
    ],
    ids=["relative", "import_module", "facade"],
)
def test_a_planted_import_cycle_is_caught(tmp_path, code):
    package, _ = _plant(tmp_path, "core/grid.py", code)
    cycle = find_cycle(import_graph(package))
    assert cycle and {"optq.core.grid", "optq.core.solver"} <= set(cycle)


def test_a_planted_long_file_is_caught(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)
    assert long_files([long, short]) == {str(long): MAX_LINES + 1}
