"""No code outside the method implementations asks for a method by its name.

What a method needs (its chains, statistics, solve, refusals, plan terms) is asked of its object
(``optq.pipeline.methods``), never decided by comparing ``RunSettings.method`` with "rtn", "gptq"
or "gptaq". This test reads every module of optq (the AST, so docstrings and messages that name a
method do not count) and finds each place that does: a comparison (==, !=, in, not in) with a
method's name or a literal collection holding one, a lookup in a literal dict keyed by names, a
``match`` on a name, a comparison with a module constant bound to a name, and a list of methods
written out (a literal collection of two names or more: the registry lists them). Allowed: the methods
package itself; ``optq/formats`` (below the registry, where "gptq" is a checkpoint format); and a
comparison whose other side is a format (an expression naming ``format`` or ``quant_method``:
"gptq" is also ``format="gptq"`` and a checkpoint's ``quant_method``).

The check runs on the real tree, and on planted violations (and planted allowed cases), so it
cannot pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

from optq.pipeline import methods

ROOT = Path(__file__).resolve().parents[1] / "optq"
ALLOWED_DIRS = ("pipeline/methods/", "formats/")
FORMAT_WORDS = ("format", "quant_method")


def _names_in(node: ast.AST, names: set[str], aliases: set[str]) -> bool:
    """Whether ``node`` is a method name, an alias of one, or a literal collection holding one."""
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e, names, aliases) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple"):
        return any(_names_in(a, names, aliases) for a in node.args)
    return False


def _is_format(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return any(word in text for word in FORMAT_WORDS)


def _keyed_by_names(node: ast.AST, names: set[str]) -> bool:
    return isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in names for k in node.keys)


def name_comparisons(root: Path, names: set[str]) -> list[str]:
    """``path:line: code`` of every place under ``root`` (a package folder) that compares a
    method's name (see the module's doc), outside the allowed places."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(ALLOWED_DIRS):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {
            t.id
            for stmt in tree.body
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and stmt.value.value in names
            for t in stmt.targets
            if isinstance(t, ast.Name)
        }
        exports = {  # __all__ names functions (optq.gptq, optq.rtn), not methods
            id(stmt.value)
            for stmt in tree.body
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)
        }
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in exports:
                hit = len({e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names}) >= 2
            elif isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                named = [o for o in operands if _names_in(o, names, aliases)]
                hit = bool(named) and not any(_is_format(o) for o in operands if o not in named)
            elif isinstance(node, ast.Subscript):
                hit = _keyed_by_names(node.value, names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                hit = _keyed_by_names(node.func.value, names)
            elif isinstance(node, ast.match_case):
                hit = any(
                    isinstance(p, ast.MatchValue) and _names_in(p.value, names, aliases) for p in ast.walk(node.pattern)
                )
            if hit:
                found.append(f"{root.name}/{rel}:{node.lineno if hasattr(node, 'lineno') else node.pattern.lineno}")
    return sorted(set(found))


def test_no_code_outside_the_methods_compares_a_method_name():
    names = set(methods.names())
    assert names >= {"rtn", "gptq", "gptaq"}
    assert len(list(ROOT.rglob("*.py"))) > 100  # the tree was read
    found = name_comparisons(ROOT, names)
    assert not found, "a method's name compared outside optq.pipeline.methods (ask the method object):\n" + "\n".join(
        found
    )


PLANTED = {
    # violations: (file, code, line of the violation)
    "pipeline/a.py": ('def f(s):\n    if s.method == "gptaq":\n        return 1\n', 2),
    "pipeline/b.py": ('def f(m):\n    return m not in ("rtn", "gptq")\n', 2),
    "pipeline/c.py": ('def f(k):\n    return {"gptq": 1, "rtn": 2}[k]\n', 2),
    "eval/d.py": ('def f(k):\n    return {"gptaq": 1}.get(k)\n', 2),
    "cli/e.py": ('def f(m):\n    match m:\n        case "rtn":\n            return 1\n    return 0\n', 3),
    "pipeline/f.py": ('RTN = "rtn"\n\n\ndef f(s):\n    return s.method != RTN\n', 5),
    "cli/k.py": ('CHOICES = ["gptq", "gptaq"]\n', 1),
}
ALLOWED = {
    "pipeline/g.py": 'def f(s, cfg):\n    return s.format == "gptq" or cfg["quant_method"] == "gptq"\n',
    "formats/h.py": 'def f(method):\n    return method == "gptq"\n',
    "pipeline/methods/i.py": 'def f(s):\n    return s.method == "gptaq"\n',
    "core/l.py": '__all__ = ["gptq", "rtn"]\n',  # exported functions' names
    "pipeline/j.py": 'def f(s):\n    return "gptaq pairs tokens" if s.ok else "rtn"\n',  # names, not compared
}


def test_the_check_finds_planted_comparisons_and_spares_formats(tmp_path):
    root = tmp_path / "optq"
    for rel, code in [*((r, c) for r, (c, _) in PLANTED.items()), *ALLOWED.items()]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code, encoding="utf-8")
    found = name_comparisons(root, {"rtn", "gptq", "gptaq"})
    assert sorted(found) == sorted(f"optq/{rel}:{line}" for rel, (_, line) in PLANTED.items())
