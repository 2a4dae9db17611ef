"""Options travel as objects: below the user-facing entry points no function takes more than 8
parameters (a run's options are one ``RunSettings``, the solver's one ``QuantConfig``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "optq"
LIMIT = 8
# The entry points users call with keywords (they build the settings object once), and the
# public record whose constructor names each of its fields.
ALLOWED = {
    "optq/pipeline/run.py:quantize",
    "optq/pipeline/stream/quantize.py:quantize_pretrained",
    "optq/core/solver.py:Solution.__init__",
}


def too_many(root: Path) -> dict[str, int]:
    """``path:qualified name`` -> parameter count of each function over the limit (self and cls
    not counted; *args and **kwargs count one each), outside the CLI."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = f"{root.name}/{path.relative_to(root).as_posix()}"
        if rel.startswith(f"{root.name}/cli/"):
            continue

        def visit(nodes: list[ast.stmt], owner: str, rel: str = rel) -> None:
            for node in nodes:
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{owner}{node.name}.")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                    n = len(params) + (a.vararg is not None) + (a.kwarg is not None)
                    if params and params[0].arg in ("self", "cls"):
                        n -= 1
                    if n > LIMIT:
                        found[f"{rel}:{owner}{node.name}"] = n
                    visit(node.body, f"{owner}{node.name}.")

        visit(ast.parse(path.read_text(encoding="utf-8")).body, "")
    return found


def test_no_function_below_the_entry_points_takes_more_than_eight_parameters():
    over = {k: v for k, v in too_many(PACKAGE).items() if k not in ALLOWED}
    assert not over, f"functions with more than {LIMIT} parameters (pass a settings object): {over}"
    # The allowed ones exist (a rename would otherwise leave a stale exemption).
    assert set(too_many(PACKAGE)) <= ALLOWED | set(over)
    assert {k.split(":")[0] for k in ALLOWED} <= {
        f"optq/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*.py")
    }


def test_the_check_sees_a_planted_long_signature(tmp_path):
    pkg = tmp_path / "optq" / "pipeline"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "def ok(a, b, c, d, e, f, g, h):\n    pass\n\n"
        "def bad(a, b, c, d, e, f, g, h, i):\n    pass\n\n"
        "class K:\n    def method(self, a, b, c, d, e, f, g, *args, **kw):\n        pass\n"
    )
    cli = tmp_path / "optq" / "cli"
    cli.mkdir()
    (cli / "y.py").write_text("def parse(a, b, c, d, e, f, g, h, i, j):\n    pass\n")
    assert too_many(tmp_path / "optq") == {"optq/pipeline/x.py:bad": 9, "optq/pipeline/x.py:K.method": 9}
