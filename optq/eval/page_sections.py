"""The sections of ``optq report``'s page: per-layer errors, experts, calibration statistics,
quality, and what stays in float; and the small HTML helpers they share (see ``optq.eval.page``)."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optq.formats.files import natural_key

__all__ = [
    "layers_section",
    "experts_section",
    "calibration_section",
    "quality_section",
    "float_section",
    "fmt",
    "mb",
    "html_table",
]


def fmt(v: Any, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return html.escape(str(v))


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def html_table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else fmt(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f'<div class="scroll"><table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'


class _Raw(str):
    """HTML already escaped."""


def _run_order(layers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The layers in the order the run solved them: by block, then by group within the block.

    A saved report's keys may be sorted as strings (layers.10 before layers.2); the block
    index and each row's ``subset`` (its group's position in the block) restore the order.
    """

    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        m = re.search(r"^(.*?\.\d+)\.", row["name"])
        return (natural_key(m.group(1)) if m else [row["name"]], row.get("subset", 0), row["name"])

    return sorted(layers.values(), key=key)


def layers_section(report: dict[str, Any], figures: Any) -> str:
    rows = _run_order(report.get("layers", {}))
    if not rows:
        return "<p>No layer was quantized.</p>"
    out = []
    if report.get("unmeasured") is not None:  # a run from the weights alone
        out.append(f"<p>No layer error was measured: {html.escape(str(report['unmeasured']))}.</p>")
    elif figures is not None:
        out.append(
            f"<figure>{figures.layer_objectives(rows)}<figcaption>Each linear's objective, the error "
            "the solver minimised (½ tr(ΔHΔᵀ), see the definitions below), for GPTQ and for RTN on "
            "the same grid and Hessian, in block order.</figcaption></figure>"
        )
    defs = report.get("definitions", {})
    out.append(
        "<details><summary>Definitions</summary><ul>"
        + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in defs.items())
        + "</ul></details>"
    )
    table = [
        (
            r["name"],
            f"{r['shape'][0]}×{r['shape'][1]}",
            r["tokens"],
            r.get("damp"),
            r["objective"],
            r["rtn_objective"],
            r.get("gain"),
            r.get("output_gain"),
            r.get("fallback") or "",
        )
        for r in rows
    ]
    out.append(
        "<details><summary>Every layer ("
        + str(len(rows))
        + ")</summary>"
        + html_table(
            [
                "layer",
                "shape",
                "tokens",
                "damping",
                "GPTQ objective",
                "RTN objective",
                "RTN / GPTQ",
                "output error RTN / GPTQ",
                "fallback",
            ],
            table,
        )
        + "</details>"
    )
    return "\n".join(out)


def experts_section(report: dict[str, Any]) -> str | None:
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
    out = [
        f"<p>{len(rows)} expert linears in {len(experts)} experts, every one quantized. Hessian from: "
        + ", ".join(f"{html.escape(k)} {v}" for k, v in sorted(sources.items()))
        + f". Calibration mode {html.escape(str(opts.get('moe_calibration', 'not recorded')))}, starved below "
        f"{html.escape(str(opts.get('moe_min_tokens') or 'input-width'))} routed tokens; {extra} block forwards beyond "
        f"the dense schedule over {len(moe)} blocks (discovery, Hessian chunks, fallbacks).</p>"
    ]
    table = []
    for (module, e), members in experts.items():
        ratios = ", ".join(
            f"{m['name'].rsplit('.', 1)[-1]} {fmt(m['objective'] / m['rtn_objective'], 3)}"
            if m["rtn_objective"]
            else m["name"].rsplit(".", 1)[-1]
            for m in members
        )
        first = members[0]
        table.append((f"{module}.{e}", first["tokens"], first["hessian"], first.get("fallback") or "", ratios))
    body = html_table(["expert", "tokens", "Hessian", "fallback", "GPTQ / RTN objective"], table)
    out.append(body if len(table) <= 64 else f"<details><summary>Every expert ({len(table)})</summary>{body}</details>")
    return "\n".join(out)


def float_section(report: dict[str, Any], sizes: dict[str, Any]) -> str:
    parts = []
    fallbacks = report.get("fallbacks", {})
    skipped = report.get("skipped", {})
    if fallbacks:
        parts.append(
            '<p class="warn">Fallbacks: '
            + str(len(fallbacks))
            + " layers deviated from the settings.</p>"
            + html_table(["layer", "what happened"], sorted(fallbacks.items(), key=lambda kv: natural_key(kv[0])))
        )
    else:
        parts.append("<p>No fallback: every layer was solved as configured.</p>")
    if skipped:
        parts.append(
            '<p class="warn">Targeted but not quantized: '
            + str(len(skipped))
            + " layers.</p>"
            + html_table(["layer", "why"], sorted(skipped.items(), key=lambda kv: natural_key(kv[0])))
        )
    floats = sizes["floats"]
    parts.append(
        f"<p>Weight matrices stored in floating point ({len(floats)}; embeddings, output head and any "
        "layer not targeted):</p>"
        + html_table(["tensor", "shape", "dtype"], [(n, "×".join(map(str, s)), d) for n, s, d in floats])
    )
    return "\n".join(parts)


def calibration_section(report: dict[str, Any], figures: Any) -> str:
    rows = [r for r in _run_order(report.get("layers", {})) if r.get("calibration")]
    groups: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:  # layers of one group share their input: one row each
        groups.setdefault((r["name"].rsplit(".", 2)[0], r["subset"]), r)
    rows = list(groups.values())
    if not rows and report.get("unmeasured") is not None:  # a run from the weights alone
        return f"<p>No calibration statistic was collected: {html.escape(str(report['unmeasured']))}.</p>"
    if not rows:
        return "<p>This report has no calibration statistics (written by an older optq).</p>"
    out = [
        "<p>How much of each layer group's plain Hessian H = 2XXᵀ/n (its trace, Σ|x|²) a few tokens "
        "own. A share far above the tokens' own share means a handful of tokens with massive "
        "activations dominate the plain Hessian; token normalisation gives every token the same "
        "weight instead.</p>"
    ]
    if figures is not None:
        out.append(
            f"<figure>{figures.token_concentration(rows)}<figcaption>Share of Σ|x|² by layer group "
            "(named by its first linear).</figcaption></figure>"
        )
    out.append(
        "<details><summary>Per layer group</summary>"
        + html_table(
            ["first linear", "tokens", "top 1% share", "position 0 share", "position 0 tokens", "max / median |x|²"],
            [
                (
                    r["name"],
                    r["calibration"]["tokens"],
                    r["calibration"].get("top1pct_share"),
                    r["calibration"].get("position0_share"),
                    r["calibration"].get("position0_tokens"),
                    r["calibration"].get("max_over_median"),
                )
                for r in rows
            ],
        )
        + "</details>"
    )
    return "\n".join(out)


def quality_section(evaluations: Sequence[tuple[Path, Any]], figures: Any) -> str:
    if not evaluations:
        return (
            "<p>No evaluation found. Run <code>optq compare MODEL --data enwiki,debref-de,code --json "
            "compare.json</code> (fp vs RTN vs GPTQ) or <code>optq eval CHECKPOINT --json eval.json</code>, "
            "then <code>optq report CHECKPOINT --eval FILE</code>.</p>"
        )
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
                    cells.append(_Raw(f"{fmt(ppl, 5)}{d}"))
                cells.append(f"{v.get('quantize_s', 0.0):.1f}")
                rows.append(cells)
            head = ["variant", *[f"{c} (calibration)" if c == calib else c for c in corpora], "quantize s"]
            out.append(
                f"<p>Perplexity (lower is better) on {data.get('windows')} windows of {data.get('seqlen')} "
                f"tokens per corpus; in brackets the increase over fp. Calibrated on "
                f"{html.escape(str(calib))}, {data.get('nsamples')} x {data.get('seqlen')} tokens.</p>"
            )
            if any(v.get("kl") for v in variants):  # KL from fp: after the perplexities, per corpus
                head += [h for c in corpora for h in (f"KL {c}", "KL p99", "top-1")]
                for cells, v in zip(rows, variants, strict=True):
                    cells += _divergence_cells(v, corpora)
                out.append(f"<p>{KL_NOTE}</p>")
            out.append(html_table(head, rows))
            if figures is not None and corpora:
                out.append(
                    f"<figure>{figures.calibration_shift(variants, corpora, calib)}<figcaption>Calibration "
                    "shift: the cost of each method on each corpus. A method tuned to the calibration "
                    "text can gain there and lose elsewhere; the calibration corpus's own perplexity "
                    "does not show it.</figcaption></figure>"
                )
        elif "results" in data:
            results = data["results"]
            kl = any(r.get("kl") is not None for r in results)
            extra = [f"KL (vs {data.get('reference')})", "KL p99", "top-1 agreement"] if kl else []
            out.append(
                html_table(
                    ["corpus", "windows", "tokens", "perplexity", *extra],
                    [
                        (r["corpus"], r.get("windows"), r.get("tokens"), r["perplexity"])
                        + ((r.get("kl"), r.get("kl_p99"), _share(r.get("top1"))) if kl else ())
                        for r in results
                    ],
                )
            )
            if kl:
                out.append(f"<p>{KL_NOTE}</p>")
        else:
            out.append(f"<p>{html.escape(path.name)} is neither a comparison nor an evaluation result.</p>")
    return "\n".join(out)


KL_NOTE = (
    "KL: the mean KL(fp || quantized) per predicted token, in nats, on the same windows as the "
    "perplexity (0: the same next-token distributions); KL p99: its 99th percentile over the tokens; "
    "top-1 agreement: the share of positions whose most likely next token is fp's."
)


def _share(v: Any) -> str | None:
    return None if v is None else f"{100 * v:.2f}%"


def _divergence_cells(variant: dict[str, Any], corpora: Sequence[str]) -> list[Any]:
    """Per corpus: mean KL from fp, its 99th percentile, top-1 agreement (blank where not measured)."""
    cells: list[Any] = []
    for c in corpora:
        if variant.get("kl") and c in variant["kl"]:
            cells += [variant["kl"][c], variant["kl_p99"][c], _share(variant["top1"][c])]
        else:
            cells += [None, None, None]
    return cells
