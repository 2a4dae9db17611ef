"""The checks behind tests/test_architecture.py, as functions of a package directory.

They read the source with ``ast`` and never import it, so the tests can run them on a temporary
copy of optq with a violation planted in it and watch them fail, not only on the real tree.

Every file is reduced to its *uses*: absolute dotted names it depends on, found in

* import statements, absolute or relative (``from ..pipeline import x`` is resolved against the
  importing module's package, ``__init__.py`` being the package itself);
* ``importlib.import_module(...)`` / ``import_module(...)`` / ``__import__(...)`` calls whose
  arguments are string literals (or ``__name__`` / ``__package__``), relative forms included;
* attribute chains on a name an import bound (``torch.nn.Linear`` after ``import torch``,
  ``optq.quantize`` after ``import optq``).

A use of ``optq.NAME`` where NAME is a public name of the facade ``optq/__init__.py`` resolves
through its lazy ``_EXPORTS`` table to the module defining NAME (``from optq import quantize``
is an import of the pipeline layer); other names of the root (``__version__``) have no layer.
Code under ``if TYPE_CHECKING:`` never runs: it is left out of the layer check, not of the import
graph (a loop closed there, or inside a function, is still a loop). Names rebound at run time
(``m = importlib; m.import_module(...)``, computed strings) are out of reach of a static check.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

# A layer may import itself and the layers before it, never one after it.
LAYERS = ("core", "formats", "data", "pipeline", "eval", "cli")
MAX_LINES = 400
# optq.core works on tensors only: no modules, no models (docs/architecture.md).
CORE_FORBIDDEN = ("torch.nn", "transformers", "accelerate")
CORE_ALLOWED = ("torch.nn.functional",)  # functions on tensors, not modules
_VERBS = {"import": "imports", "call": "imports at run time", "attribute": "uses"}


class Use(NamedTuple):
    """One dependency of a file on ``name``, an absolute dotted name (a module or something in one)."""

    line: int
    name: str
    kind: str  # "import" (a statement), "call" (import_module / __import__), "attribute" (a.b.c)
    deferred: bool  # inside a function or lambda: runs when called, not when the module is imported
    type_only: bool  # under `if TYPE_CHECKING:`, or through a name only imported there: never runs


class Violation(NamedTuple):
    path: str  # relative to the package's parent: "optq/core/grid.py"
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.message}"


def within(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` or inside it, on dotted boundaries (``torch.nnx`` is not in ``torch.nn``)."""
    return name == prefix or name.startswith(prefix + ".")


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def resolve_relative(anchor: str, level: int, name: str | None) -> str | None:
    """importlib's rule: level 1 is the package ``anchor``, each further level one package up.

    None when it climbs above the top-level package (Python raises ImportError there).
    """
    parts = anchor.split(".") if anchor else []
    if level > len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_type_checking(test: ast.expr) -> bool:
    # Only `if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:`; `if not TYPE_CHECKING:` does run.
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Scanner(ast.NodeVisitor):
    """Collects the uses of one module; ``module`` is its dotted name, ``package`` its package."""

    def __init__(self, module: str, package: str):
        self.module, self.package = module, package
        self.uses: list[Use] = []
        self.deferred = self.type_only = False
        # Local name -> (dotted name an import binds it to, whether only a TYPE_CHECKING import
        # does). Not scope-aware: a module's imports are what its names mean in practice.
        self.bound: dict[str, tuple[str, bool]] = {}

    def scan(self, tree: ast.Module) -> list[Use]:
        self.visit(tree)  # the first pass learns every binding, wherever the import sits
        self.uses = []
        self.visit(tree)
        return self.uses

    def _bind(self, name: str, dotted: str) -> None:
        if not self.type_only or name not in self.bound:
            self.bound[name] = (dotted, self.type_only)

    def _use(self, node: ast.AST, name: str, kind: str, type_only: bool = False) -> None:
        self.uses.append(Use(node.lineno, name, kind, self.deferred, self.type_only or type_only))

    def _from_module(self, node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        return resolve_relative(self.package, node.level, node.module)

    def _dotted(self, node: ast.expr) -> tuple[str, bool] | None:
        """``a.b.c`` as (the dotted name it means, type-only) when an import bound ``a``, else None."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.bound:
            return None
        base, type_only = self.bound[node.id]
        return ".".join([base, *reversed(attrs)]), type_only

    def _literal(self, node: ast.expr | None) -> object:
        """The value of a literal argument; ``__name__``/``__package__`` are known too. None if unknown."""
        if isinstance(node, ast.Name) and node.id in ("__name__", "__package__"):
            return self.module if node.id == "__name__" else self.package
        try:
            return ast.literal_eval(node) if node is not None else None
        except (ValueError, TypeError, SyntaxError):
            return None

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            return self.generic_visit(node)
        outer, self.type_only = self.type_only, True
        for child in node.body:
            self.visit(child)
        self.type_only = outer
        for child in node.orelse:
            self.visit(child)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # Decorators and defaults run at definition time; the body and annotations do not.
        for child in [*getattr(node, "decorator_list", []), *node.args.defaults, *node.args.kw_defaults]:
            if child is not None:
                self.visit(child)
        outer, self.deferred = self.deferred, True
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None and arg.annotation is not None:
                self.visit(arg.annotation)
        body = node.body if isinstance(node.body, list) else [node.body]
        for child in [*body, *([node.returns] if getattr(node, "returns", None) else [])]:
            self.visit(child)
        self.deferred = outer

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._use(node, alias.name, "import")
            top = alias.name.split(".")[0]
            self._bind(alias.asname or top, alias.name if alias.asname else top)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._from_module(node)
        for alias in node.names if base else []:
            self._use(node, base if alias.name == "*" else f"{base}.{alias.name}", "import")
            if alias.name != "*":
                self._bind(alias.asname or alias.name, f"{base}.{alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # Visited from the outside in: the whole chain is one use, its prefixes are not visited.
        if (dotted := self._dotted(node)) is None:
            return self.generic_visit(node)
        self._use(node, dotted[0], "attribute", dotted[1])

    def visit_Call(self, node: ast.Call) -> None:
        func = (self._dotted(node.func) or (None,))[0]
        if func is None and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            func = "builtins.__import__"
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        args = [*node.args, *[None] * 5]
        name = self._literal(args[0] or keywords.get("name"))
        if func == "importlib.import_module" and isinstance(name, str):
            anchor = self._literal(args[1] or keywords.get("package"))
            level = len(name) - len(name.lstrip("."))
            if level and isinstance(anchor, str):
                name = resolve_relative(anchor, level, name[level:] or None)
            if name and not name.startswith("."):
                self._use(node, name, "call")
        elif func == "builtins.__import__" and isinstance(name, str):
            # __import__(name, globals, locals, fromlist, level): relative to this module's package.
            level = self._literal(args[4] or keywords.get("level")) or 0
            fromlist = self._literal(args[3] or keywords.get("fromlist")) or ()
            base = resolve_relative(self.package, level, name or None) if isinstance(level, int) and level else name
            if base and isinstance(fromlist, (list, tuple)):
                for target in [f"{base}.{f}" for f in fromlist if isinstance(f, str)] or [base]:
                    self._use(node, target, "call")
        self.generic_visit(node)


class Package:
    """The Python package in directory ``root`` (the folder holding its ``__init__.py``)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.name = self.root.name
        self._uses: dict[str, list[Use]] = {}

    @cached_property
    def modules(self) -> dict[str, Path]:
        """Dotted module name -> file, for every .py file under the root."""
        out = {}
        for path in sorted(self.root.rglob("*.py")):
            parts = (self.name, *path.relative_to(self.root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        return out

    @property
    def packages(self) -> list[str]:
        """The dotted names of the package and its subpackages (folders with an ``__init__.py``)."""
        return [m for m, path in self.modules.items() if path.name == "__init__.py"]

    @cached_property
    def exports(self) -> dict[str, str]:
        """The facade's lazy ``_EXPORTS`` table as public name -> absolute module, read with ast.

        A table that is not a literal dict raises here: the check must not go blind to the facade.
        """
        init = self.root / "__init__.py"
        tree = ast.parse(init.read_text(encoding="utf-8")) if init.exists() else ast.Module(body=[])
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and node.value is not None:
                return {k: f"{self.name}.{v}" for k, v in ast.literal_eval(node.value).items()}
        return {}

    def path(self, module: str) -> str:
        return self.modules[module].relative_to(self.root.parent).as_posix()

    def uses(self, module: str) -> list[Use]:
        if module not in self._uses:
            path = self.modules[module]
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            tree = ast.parse(path.read_text(encoding="utf-8"))
            self._uses[module] = _Scanner(module, package).scan(tree)
        return self._uses[module]

    def module_of(self, name: str) -> str | None:
        """The module of this package that using ``name`` loads, or None when ``name`` is outside it.

        ``optq.NAME`` for a facade name is the module that defines NAME; otherwise the longest
        prefix of ``name`` that is a module (``optq.core.grid.fit`` -> ``optq.core.grid``).
        """
        if not within(name, self.name):
            return None
        parts = name.split(".")
        if len(parts) > 1 and parts[1] in self.exports:
            return self.exports[parts[1]]
        return next((m for n in range(len(parts), 0, -1) if (m := ".".join(parts[:n])) in self.modules), self.name)


def _dedup(found: Iterable[Violation]) -> list[Violation]:
    return list(dict.fromkeys(found))


def upward_uses(package: Package) -> list[Violation]:
    """Each use, at module level or lazy, of a module in a layer after the user's own."""
    found = []
    for module in package.modules:
        if (mine := layer(module)) is None:
            continue
        for use in package.uses(module):
            if use.type_only:
                continue  # never runs; a type named in an annotation is no dependency at run time
            target = package.module_of(use.name)
            theirs = layer(target) if target else None
            if theirs and LAYERS.index(theirs) > LAYERS.index(mine):
                message = f"{_VERBS[use.kind]} {use.name} ({target}), a layer above {mine}"
                found.append(Violation(package.path(module), use.line, message))
    return _dedup(found)


def import_graph(package: Package) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (statements and calls), at any depth: imports
    inside functions and under ``if TYPE_CHECKING:`` count, a loop they close is hidden, not gone."""
    graph = {}
    for module in package.modules:
        uses = [u for u in package.uses(module) if u.kind != "attribute"]
        graph[module] = {t for u in uses if (t := package.module_of(u.name)) and t != module}
    return graph


def _folder_node(package: str, module: str) -> str:
    """The child of ``package`` that holds ``module``: a subpackage as ``a.b/``, a module as itself."""
    if module == package:
        return module  # the package's own __init__.py
    child = module[len(package) + 1 :].split(".")[0]
    rest = module[len(package) + 1 + len(child) :]
    return f"{package}.{child}" + ("/" if rest else "")


def folder_graph(graph: dict[str, set[str]], packages: Iterable[str]) -> dict[str, set[str]]:
    """The module graph seen from each package: an edge between the children of the deepest
    package holding both ends, a subpackage standing for every module in it (``a.b/``).

    A cycle here is a cycle between subpackages (``blocks/`` imports ``moe/``, which imports
    ``blocks/``) even where no single chain of modules closes; every module-level cycle shows too.
    """
    packages = sorted(packages, key=len, reverse=True)  # deepest first
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            common = next((p for p in packages if within(a, p) and within(b, p)), None)
            if common is None:
                continue
            src, dst = _folder_node(common, a), _folder_node(common, b)
            if src != dst:
                out.setdefault(src, set()).add(dst)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a closed path, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*stack, nxt])):
                return found
        state[node] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of nodes that reach one another (each holds a cycle), sorted; none when acyclic."""
    index, low, stack, found = {}, {}, [], []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def core_forbidden(name: str) -> bool:
    return any(within(name, f) for f in CORE_FORBIDDEN) and not any(within(name, a) for a in CORE_ALLOWED)


def core_uses_of_modules(package: Package) -> list[Violation]:
    """Each use of torch.nn (but torch.nn.functional), transformers or accelerate in core.

    Type-only uses count too: the core does not even name an nn.Module in its annotations.
    """
    found = []
    for module in package.modules:
        if layer(module) != "core":
            continue
        for use in package.uses(module):
            if core_forbidden(use.name):
                message = f"{_VERBS[use.kind]} {use.name}; optq.core works on tensors only"
                found.append(Violation(package.path(module), use.line, message))
    return _dedup(found)


def long_files(files: Iterable[Path], limit: int = MAX_LINES) -> dict[str, int]:
    """File -> its line count, for each file longer than ``limit`` lines."""
    return {str(p): n for p in files if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit}
