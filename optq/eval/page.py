"""``optq report``: one self-contained HTML page of what quantization did to a checkpoint.

Built from the checkpoint's ``quantization_report.json`` (and, when given or found beside it, a
comparison JSON of ``optq demo`` / ``optq compare``, or an ``optq eval --json`` file). The figures
are inline SVG, the style is inline CSS, and nothing is fetched: the file reads the same opened
from disk, offline. Sections: summary, per-layer errors, calibration statistics, quality, and
every tensor left in float (by name).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optq.eval.page_sections import (
    calibration_section,
    experts_section,
    float_section,
    fmt,
    html_table,
    layers_section,
    mb,
    quality_section,
)
from optq.formats.files import read_index

__all__ = ["build_page", "write_page", "find_evaluations", "check_report", "PageError", "REPORT_FILE"]

REPORT_FILE = "quantization_report.json"
EVALUATION_FILES = ("compare.json", "eval.json")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

ABBREVIATIONS = (
    "<b>fp</b>: floating point, the model before quantization. "
    "<b>RTN</b>: round-to-nearest, each weight rounded to its grid on its own. "
    "<b>GPTQ</b>: Hessian-aware rounding (Frantar et al., \u201cOPTQ\u201d, ICLR 2023): each rounding "
    "error is compensated by the not-yet-rounded weights, to keep the layer's output on calibration data."
)

_CSS = """
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1b1b1b;background:#fff}
main{max-width:980px;margin:0 auto;padding:16px}
h1{font-size:1.5em;margin:.2em 0}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
nav a{margin-right:1em}
table{border-collapse:collapse;font-size:13px;font-variant-numeric:tabular-nums}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
.scroll{overflow-x:auto;max-width:100%}
figure{margin:1em 0}figure svg{max-width:100%;height:auto;display:block}
figcaption{font-size:13px;color:#555}
.kv td:first-child{color:#555}.kv td{text-align:left;white-space:normal}
.warn{background:#fff4e5;border-left:4px solid #f0a030;padding:6px 10px}
.note{color:#555;font-size:13px}
"""


class PageError(ValueError):
    """The folder is not a checkpoint with a quantization report, or a JSON file is unreadable."""


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PageError(f"{path} does not exist ({what})") from None
    except (OSError, ValueError) as exc:
        raise PageError(f"{path} is not readable JSON ({what}): {exc}") from None


def check_report(report: Any, path: Path) -> None:
    """Refuse a quantization report the page cannot describe truthfully, naming the field: a page
    that says "None-bit" or a traceback helps nobody (a hand-edited or truncated JSON)."""

    def bad(field: str, want: str, got: Any) -> PageError:
        return PageError(f"{path}: field {field!r} must be {want}, not {type(got).__name__} {got!r:.60}")

    if not isinstance(report, dict):
        raise bad("(top level)", "an object", report)
    config = report.get("config")
    if not isinstance(config, dict):
        raise bad("config", "an object (the QuantConfig)", config)
    for key, ok in (("bits", lambda v: v in (2, 3, 4, 8)), ("group_size", lambda v: v == -1 or v > 0)):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
            raise bad(f"config.{key}", "2, 3, 4 or 8" if key == "bits" else "-1 or a positive integer", value)
    layers = report.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(r, dict) for r in layers.values()):
        raise bad("layers", "an object of layer rows", layers)
    unmeasured = report.get("unmeasured") is not None  # a run from the weights alone: errors null
    for name, row in layers.items():
        for key in ("objective", "rtn_objective"):
            if unmeasured and row.get(key) is None:
                continue
            if isinstance(row.get(key), bool) or not isinstance(row.get(key), (int, float)):
                raise bad(f"layers.{name}.{key}", "a number", row.get(key))
    for key in ("options", "totals", "skipped", "fallbacks", "moe", "versions"):
        if key in report and not isinstance(report[key], dict):
            raise bad(key, "an object", report[key])


def find_evaluations(folder: Path) -> list[Path]:
    """The comparison or evaluation JSON files sitting in the checkpoint folder or beside it."""
    found = []
    for where in (folder, folder.parent):
        found += [where / n for n in EVALUATION_FILES if (where / n).is_file()]
    return found


def _sizes(folder: Path, report: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Bytes on disk, and the fp model's size estimated from the checkpoint's own tensors."""
    index = read_index(folder)
    disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    layers = report.get("layers", {})
    source = (
        report.get("options", {}).get("source_dtype") or config.get("torch_dtype") or config.get("dtype") or "float32"
    )
    itemsize = _ITEMSIZE.get(str(source).removeprefix("torch."), 4)
    fp = 0
    packed = set(layers)
    for name, (_, shape, dtype) in index.items():
        if name.rsplit(".", 1)[0] not in packed:
            fp += math.prod(shape) * dtype.itemsize
    for row in layers.values():
        fp += row["shape"][0] * row["shape"][1] * itemsize
        if f"{row['name']}.bias" in index:
            fp += row["shape"][0] * itemsize
    floats = [
        (n, tuple(s), str(d).removeprefix("torch."))
        for n, (_, s, d) in sorted(index.items())
        if n.rsplit(".", 1)[0] not in packed and len(s) >= 2 and d.is_floating_point
    ]
    return {"disk": disk, "fp": fp, "fp_dtype": str(source).removeprefix("torch."), "floats": floats}


def _search_text(q: dict[str, Any], method: str) -> str:
    """How each group's range was fitted, as the report's summary says it."""
    if not q.get("mse"):
        return "no (min/max ranges)"
    from optq.pipeline import methods

    try:
        reads_hessian = methods.get(method).reads_hessian
    except ValueError:  # a method this install does not register: its report says what it read
        reads_hessian = True
    if not reads_hessian:  # no Hessian to weight the search by (grid.without_hessian)
        return "no (min/max ranges: round-to-nearest reads no Hessian)" if q.get("mse_hessian") else "yes, unweighted"
    return "yes, weighted by H's diagonal (--mse-hessian)" if q.get("mse_hessian") else "yes, unweighted"


def _summary(
    folder: Path, report: dict[str, Any], config: dict[str, Any], sizes: dict[str, Any], calib_hint: str | None = None
) -> str:
    q = report.get("config", {})
    o = report.get("options", {})
    t = report.get("totals", {})
    name = (
        o.get("model")
        or config.get("_model_name_or_path")
        or config.get("_name_or_path")
        or config.get("name_or_path")
        or folder.name
    )
    arch = ", ".join(config.get("architectures") or []) or config.get("model_type", "?")
    act = (
        "yes (static groups)"
        if q.get("act_order") and q.get("static_groups")
        else ("yes" if q.get("act_order") else "no")
    )
    ratio = sizes["fp"] / sizes["disk"] if sizes["disk"] else math.nan
    calib = o.get("calib") or calib_hint or "token windows given by the caller"
    rows = [
        ("model", f"{name} ({arch})"),
        (
            "method",
            f"{str(o.get('method', 'gptq')).upper()}, {q.get('bits')}-bit "
            f"{'symmetric' if q.get('sym', True) else 'asymmetric'} grid, group size {q.get('group_size')}",
        ),
        ("act-order (columns by decreasing Hessian diagonal)", act),
        ("token normalisation (every token at unit RMS in H)", "yes" if q.get("normalize_tokens") else "no"),
        (
            "damping (fraction of the mean diagonal added to H)",
            f"{q.get('damp')} (largest used: {fmt(t.get('max_damp'))})",
        ),
        (
            "error propagation",
            "from the already-quantized model"
            if o.get("propagate", "quantized") == "quantized"
            else "from the original model",
        ),
        ("H shrunk toward its diagonal (--diag-shrink)", f"{q.get('diag_shrink') or 0:g}"),
        ("grid search (--mse)", _search_text(q, str(o.get("method", "gptq")))),
        (
            "size on disk",
            f"{mb(sizes['disk'])} against {mb(sizes['fp'])} in {sizes['fp_dtype']} "
            f"(estimated from the checkpoint's tensors): {ratio:.2f}x smaller",
        ),
        (
            "quantize time",
            f"{report.get('seconds', 0.0):.1f} s on {o.get('device', '?')}, {o.get('num_threads', '?')} threads",
        ),
        ("calibration", f"{calib}: {o.get('nsamples')} samples x {o.get('seqlen')} tokens, seed {o.get('seed')}"),
        (
            "layers",
            f"{t.get('layers')} linears in {t.get('blocks')} blocks, {t.get('parameters', 0):,} weights; "
            + (
                f"errors not measured ({report['unmeasured']})"
                if report.get("unmeasured") is not None
                else f"{t.get('layers_worse_than_rtn', 0)} with an objective above RTN's"
            ),
        ),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted(report.get("versions", {}).items()))),
    ]
    return html_table(["", ""], [(k, v) for k, v in rows], cls="kv")


def _calib_hint(evals: Sequence[tuple[Path, Any]]) -> str | None:
    """The calibration corpus a comparison JSON names (the report of ``optq demo`` does not)."""
    for path, data in evals:
        if isinstance(data, dict) and data.get("calib"):
            return f"{data['calib']} (as {path.name} says)"
    return None


def build_page(folder: str | Path, evaluations: Sequence[str | Path] | None = None, *, figures: bool = True) -> str:
    """The HTML of the report page of the checkpoint ``folder``.

    ``evaluations``: comparison (``optq compare``/``optq demo``) or ``optq eval --json`` files;
    None looks for ``compare.json`` / ``eval.json`` in the folder and beside it. ``figures=False``
    (or no matplotlib) leaves the figures out and says so.
    """
    from optq.eval import figures as figs

    folder = Path(folder)
    if not folder.is_dir():
        raise PageError(f"{folder} is not a folder")
    if not (folder / REPORT_FILE).is_file():
        raise PageError(f"{folder} has no {REPORT_FILE}: it is not a checkpoint written by optq")
    report = _read_json(folder / REPORT_FILE, "the quantization report")
    check_report(report, folder / REPORT_FILE)
    config = _read_json(folder / "config.json", "the model config") if (folder / "config.json").is_file() else {}
    paths = find_evaluations(folder) if evaluations is None else [Path(p) for p in evaluations]
    evals = [(p, _read_json(p, "an evaluation")) for p in paths]
    drawer = figs if figures and figs.available() else None
    sizes = _sizes(folder, report, config)
    title = f"optq report: {folder.resolve().name}"
    missing = (
        ""
        if drawer is not None
        else ('<p class="warn">Figures left out: they need matplotlib (<code>pip install "optq[plot]"</code>).</p>')
    )
    sections = [
        ("summary", "Summary", _summary(folder, report, config, sizes, _calib_hint(evals))),
        ("layers", "Per layer: GPTQ against round-to-nearest", layers_section(report, drawer)),
        ("experts", "Mixture of experts", experts_section(report)),
        ("calibration", "Calibration statistics", calibration_section(report, drawer)),
        ("quality", "Quality", quality_section(evals, drawer)),
        ("float", "Fallbacks and what stays in floating point", float_section(report, sizes)),
    ]
    sections = [(i, t, c) for i, t, c in sections if c is not None]
    nav = "".join(f'<a href="#{i}">{html.escape(t)}</a>' for i, t, _ in sections)
    body = "".join(f'<section id="{i}"><h2>{html.escape(t)}</h2>\n{c}</section>\n' for i, t, c in sections)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body><main>"
        f"<h1>{html.escape(title)}</h1><p>{ABBREVIATIONS}</p>{missing}<nav>{nav}</nav>\n{body}"
        f'<p class="note">Written by optq from {html.escape(REPORT_FILE)}'
        + "".join(f", {html.escape(p.name)}" for p, _ in evals)
        + ".</p></main></body></html>\n"
    )


def write_page(
    folder: str | Path,
    out: str | Path | None = None,
    evaluations: Sequence[str | Path] | None = None,
    *,
    figures: bool = True,
) -> Path:
    """Write :func:`build_page` to ``out`` (default ``FOLDER/report.html``); returns the path."""
    from optq.formats.atomic import atomic_write

    page = build_page(folder, evaluations, figures=figures)
    path = Path(out) if out is not None else Path(folder) / "report.html"
    atomic_write(path, page)
    return path
