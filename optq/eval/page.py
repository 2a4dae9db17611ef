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
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optq.formats.files import natural_key, read_index

__all__ = ["build_page", "write_page", "find_evaluations", "PageError", "REPORT_FILE"]

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


def find_evaluations(folder: Path) -> list[Path]:
    """The comparison or evaluation JSON files sitting in the checkpoint folder or beside it."""
    found = []
    for where in (folder, folder.parent):
        found += [where / n for n in EVALUATION_FILES if (where / n).is_file()]
    return found


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return html.escape(str(v))


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else _fmt(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f'<div class="scroll"><table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'


class _Raw(str):
    """HTML already escaped."""


def _sizes(folder: Path, report: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Bytes on disk, and the fp model's size estimated from the checkpoint's own tensors."""
    index = read_index(folder)
    disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    layers = report.get("layers", {})
    source = (report.get("options", {}).get("source_dtype") or config.get("torch_dtype") or config.get("dtype")
              or "float32")
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
    floats = [(n, tuple(s), str(d).removeprefix("torch.")) for n, (_, s, d) in sorted(index.items())
              if n.rsplit(".", 1)[0] not in packed and len(s) >= 2 and d.is_floating_point]
    return {"disk": disk, "fp": fp, "fp_dtype": str(source).removeprefix("torch."), "floats": floats}


def _run_order(layers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The layers in the order the run solved them: by block, then by group within the block.

    A saved report's keys may be sorted as strings (layers.10 before layers.2); the block
    index and each row's ``subset`` (its group's position in the block) restore the order.
    """
    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        m = re.search(r"^(.*?\.\d+)\.", row["name"])
        return (natural_key(m.group(1)) if m else [row["name"]], row.get("subset", 0), row["name"])

    return sorted(layers.values(), key=key)


def _summary(folder: Path, report: dict[str, Any], config: dict[str, Any], sizes: dict[str, Any],
             calib_hint: str | None = None) -> str:
    q = report.get("config", {})
    o = report.get("options", {})
    t = report.get("totals", {})
    name = (o.get("model") or config.get("_model_name_or_path") or config.get("_name_or_path")
            or config.get("name_or_path") or folder.name)
    arch = ", ".join(config.get("architectures") or []) or config.get("model_type", "?")
    act = "yes (static groups)" if q.get("act_order") and q.get("static_groups") else (
        "yes" if q.get("act_order") else "no")
    ratio = sizes["fp"] / sizes["disk"] if sizes["disk"] else math.nan
    calib = o.get("calib") or calib_hint or "token windows given by the caller"
    rows = [
        ("model", f"{name} ({arch})"),
        ("method", f"{str(o.get('method', 'gptq')).upper()}, {q.get('bits')}-bit "
                   f"{'symmetric' if q.get('sym', True) else 'asymmetric'} grid, group size {q.get('group_size')}"),
        ("act-order (columns by decreasing Hessian diagonal)", act),
        ("token normalisation (every token at unit RMS in H)", "yes" if q.get("normalize_tokens") else "no"),
        ("damping (fraction of the mean diagonal added to H)", f"{q.get('damp')} (largest used: {_fmt(t.get('max_damp'))})"),
        ("error propagation", "from the already-quantized model" if o.get("propagate", "quantized") == "quantized"
         else "from the original model"),
        ("H shrunk toward its diagonal (--diag-shrink)", f"{q.get('diag_shrink') or 0:g}"),
        ("grid search (--mse)", "yes" if q.get("mse") else "no (min/max ranges)"),
        ("size on disk", f"{_mb(sizes['disk'])} against {_mb(sizes['fp'])} in {sizes['fp_dtype']} "
                         f"(estimated from the checkpoint's tensors): {ratio:.2f}x smaller"),
        ("quantize time", f"{report.get('seconds', 0.0):.1f} s on {o.get('device', '?')}, "
                          f"{o.get('num_threads', '?')} threads"),
        ("calibration", f"{calib}: {o.get('nsamples')} samples x {o.get('seqlen')} tokens, seed {o.get('seed')}"),
        ("layers", f"{t.get('layers')} linears in {t.get('blocks')} blocks, {t.get('parameters', 0):,} weights; "
                   f"{t.get('layers_worse_than_rtn', 0)} with an objective above RTN's"),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted(report.get("versions", {}).items()))),
    ]
    return _table(["", ""], [(k, v) for k, v in rows], cls="kv")


def _calib_hint(evals: Sequence[tuple[Path, Any]]) -> str | None:
    """The calibration corpus a comparison JSON names (the report of ``optq demo`` does not)."""
    for path, data in evals:
        if isinstance(data, dict) and data.get("calib"):
            return f"{data['calib']} (as {path.name} says)"
    return None


def _layers(report: dict[str, Any], figures: Any) -> str:
    rows = _run_order(report.get("layers", {}))
    if not rows:
        return "<p>No layer was quantized.</p>"
    out = []
    if figures is not None:
        out.append(f"<figure>{figures.layer_objectives(rows)}<figcaption>Each linear's objective, the error "
                   "the solver minimised (½ tr(ΔHΔᵀ), see the definitions below), for GPTQ and for RTN on "
                   "the same grid and Hessian, in block order.</figcaption></figure>")
    defs = report.get("definitions", {})
    out.append("<details><summary>Definitions</summary><ul>" + "".join(
        f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in defs.items()) + "</ul></details>")
    table = [(r["name"], f"{r['shape'][0]}×{r['shape'][1]}", r["tokens"], r.get("damp"), r["objective"],
              r["rtn_objective"], r.get("gain"), r.get("output_gain"), r.get("fallback") or "")
             for r in rows]
    out.append("<details><summary>Every layer (" + str(len(rows)) + ")</summary>" + _table(
        ["layer", "shape", "tokens", "damping", "GPTQ objective", "RTN objective", "RTN / GPTQ",
         "output error RTN / GPTQ", "fallback"], table) + "</details>")
    return "\n".join(out)


def _experts(report: dict[str, Any]) -> str | None:
    rows = [r for r in _run_order(report.get("layers", {})) if r.get("hessian")]
    if not rows:
        return None  # a dense model: no section
    experts: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        m = re.match(r"(.+\.experts)\.(\d+)\.(.+)$", r["name"])
        experts.setdefault((m[1], int(m[2])) if m else (r["name"], -1), []).append(r)
    sources: dict[str, int] = {}
    for r in rows:
        kind = r["hessian"].split(" (")[0].split(",")[0].split(":")[0]
        sources[kind] = sources.get(kind, 0) + 1
    moe = report.get("moe", {})
    extra = sum(b.get("extra_forwards", 0) for b in moe.values())
    opts = report.get("options", {})
    out = [f"<p>{len(rows)} expert linears in {len(experts)} experts, every one quantized. Hessian from: "
           + ", ".join(f"{html.escape(k)} {v}" for k, v in sorted(sources.items()))
           + f". Calibration mode {html.escape(str(opts.get('moe_calibration', 'routed')))}, starved below "
           f"{html.escape(str(opts.get('moe_min_tokens') or 'input-width'))} routed tokens; {extra} block forwards beyond "
           f"the dense schedule over {len(moe)} blocks (discovery, Hessian chunks, fallbacks).</p>"]
    table = []
    for (module, e), members in experts.items():
        ratios = ", ".join(f"{m['name'].rsplit('.', 1)[-1]} {_fmt(m['objective'] / m['rtn_objective'], 3)}"
                           if m["rtn_objective"] else m["name"].rsplit(".", 1)[-1] for m in members)
        first = members[0]
        table.append((f"{module}.{e}", first["tokens"], first["hessian"], first.get("fallback") or "", ratios))
    body = _table(["expert", "tokens", "Hessian", "fallback", "GPTQ / RTN objective"], table)
    out.append(body if len(table) <= 64 else f"<details><summary>Every expert ({len(table)})</summary>{body}</details>")
    return "\n".join(out)


def _exceptions(report: dict[str, Any], sizes: dict[str, Any]) -> str:
    parts = []
    fallbacks = report.get("fallbacks", {})
    skipped = report.get("skipped", {})
    if fallbacks:
        parts.append('<p class="warn">Fallbacks: ' + str(len(fallbacks)) + " layers deviated from the settings.</p>"
                     + _table(["layer", "what happened"], sorted(fallbacks.items(), key=lambda kv: natural_key(kv[0]))))
    else:
        parts.append("<p>No fallback: every layer was solved as configured.</p>")
    if skipped:
        parts.append('<p class="warn">Targeted but not quantized: ' + str(len(skipped)) + " layers.</p>"
                     + _table(["layer", "why"], sorted(skipped.items(), key=lambda kv: natural_key(kv[0]))))
    floats = sizes["floats"]
    parts.append(f"<p>Weight matrices stored in floating point ({len(floats)}; embeddings, output head and any "
                 "layer not targeted):</p>" + _table(["tensor", "shape", "dtype"],
                                                     [(n, "×".join(map(str, s)), d) for n, s, d in floats]))
    return "\n".join(parts)


def _calibration(report: dict[str, Any], figures: Any) -> str:
    rows = [r for r in _run_order(report.get("layers", {})) if r.get("calibration")]
    groups: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:  # layers of one group share their input: one row each
        groups.setdefault((r["name"].rsplit(".", 2)[0], r["subset"]), r)
    rows = list(groups.values())
    if not rows:
        return "<p>This report has no calibration statistics (written by an older optq).</p>"
    out = ["<p>How much of each layer group's plain Hessian H = 2XXᵀ/n (its trace, Σ|x|²) a few tokens "
           "own. A share far above the tokens' own share means a handful of tokens with massive "
           "activations dominate the plain Hessian; token normalisation gives every token the same "
           "weight instead.</p>"]
    if figures is not None:
        out.append(f"<figure>{figures.token_concentration(rows)}<figcaption>Share of Σ|x|² by layer group "
                   "(named by its first linear).</figcaption></figure>")
    out.append("<details><summary>Per layer group</summary>" + _table(
        ["first linear", "tokens", "top 1% share", "position 0 share", "position 0 tokens", "max / median |x|²"],
        [(r["name"], r["calibration"]["tokens"], r["calibration"].get("top1pct_share"),
          r["calibration"].get("position0_share"), r["calibration"].get("position0_tokens"),
          r["calibration"].get("max_over_median")) for r in rows]) + "</details>")
    return "\n".join(out)


def _quality(evaluations: Sequence[tuple[Path, Any]], figures: Any) -> str:
    if not evaluations:
        return ("<p>No evaluation found. Run <code>optq compare MODEL --data enwiki,debref-de,code --json "
                "compare.json</code> (fp vs RTN vs GPTQ) or <code>optq eval CHECKPOINT --json eval.json</code>, "
                "then <code>optq report CHECKPOINT --eval FILE</code>.</p>")
    out = []
    for path, data in evaluations:
        out.append(f"<h3>{html.escape(path.name)}</h3>")
        if "variants" in data:
            corpora, variants, calib = data.get("corpora", []), data["variants"], data.get("calib")
            fp = next((v["perplexity"] for v in variants if v["method"] == "fp"), None)
            rows = []
            for v in variants:
                cells = [v["name"]]
                for c in corpora:
                    ppl = v["perplexity"].get(c)
                    d = f" ({ppl - fp[c]:+.3f})" if fp and v["method"] != "fp" and ppl is not None else ""
                    cells.append(_Raw(f"{_fmt(ppl, 5)}{d}"))
                cells.append(f"{v.get('quantize_s', 0.0):.1f}")
                rows.append(cells)
            head = ["variant", *[f"{c} (calibration)" if c == calib else c for c in corpora], "quantize s"]
            out.append(f"<p>Perplexity (lower is better) on {data.get('windows')} windows of {data.get('seqlen')} "
                       f"tokens per corpus; in brackets the increase over fp. Calibrated on "
                       f"{html.escape(str(calib))}, {data.get('nsamples')} x {data.get('seqlen')} tokens.</p>")
            out.append(_table(head, rows))
            if figures is not None and corpora:
                out.append(f"<figure>{figures.calibration_shift(variants, corpora, calib)}<figcaption>Calibration "
                           "shift: the cost of each method on each corpus. A method tuned to the calibration "
                           "text can gain there and lose elsewhere; the calibration corpus's own perplexity "
                           "does not show it.</figcaption></figure>")
        elif "results" in data:
            out.append(_table(["corpus", "windows", "tokens", "perplexity"],
                              [(r["corpus"], r.get("windows"), r.get("tokens"), r["perplexity"])
                               for r in data["results"]]))
        else:
            out.append(f"<p>{html.escape(path.name)} is neither a comparison nor an evaluation result.</p>")
    return "\n".join(out)


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
    config = _read_json(folder / "config.json", "the model config") if (folder / "config.json").is_file() else {}
    paths = find_evaluations(folder) if evaluations is None else [Path(p) for p in evaluations]
    evals = [(p, _read_json(p, "an evaluation")) for p in paths]
    drawer = figs if figures and figs.available() else None
    sizes = _sizes(folder, report, config)
    title = f"optq report: {folder.resolve().name}"
    missing = "" if drawer is not None else (
        '<p class="warn">Figures left out: they need matplotlib (<code>pip install "optq[plot]"</code>).</p>')
    sections = [
        ("summary", "Summary", _summary(folder, report, config, sizes, _calib_hint(evals))),
        ("layers", "Per layer: GPTQ against round-to-nearest", _layers(report, drawer)),
        ("experts", "Mixture of experts", _experts(report)),
        ("calibration", "Calibration statistics", _calibration(report, drawer)),
        ("quality", "Quality", _quality(evals, drawer)),
        ("float", "Fallbacks and what stays in floating point", _exceptions(report, sizes)),
    ]
    sections = [(i, t, c) for i, t, c in sections if c is not None]
    nav = "".join(f'<a href="#{i}">{html.escape(t)}</a>' for i, t, _ in sections)
    body = "".join(f'<section id="{i}"><h2>{html.escape(t)}</h2>\n{c}</section>\n' for i, t, c in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body><main>"
            f"<h1>{html.escape(title)}</h1><p>{ABBREVIATIONS}</p>{missing}<nav>{nav}</nav>\n{body}"
            f'<p class="note">Written by optq from {html.escape(REPORT_FILE)}'
            + "".join(f", {html.escape(p.name)}" for p, _ in evals) + ".</p></main></body></html>\n")


def write_page(folder: str | Path, out: str | Path | None = None, evaluations: Sequence[str | Path] | None = None,
               *, figures: bool = True) -> Path:
    """Write :func:`build_page` to ``out`` (default ``FOLDER/report.html``); returns the path."""
    from optq.formats.files import atomic_write

    page = build_page(folder, evaluations, figures=figures)
    path = Path(out) if out is not None else Path(folder) / "report.html"
    atomic_write(path, page)
    return path
