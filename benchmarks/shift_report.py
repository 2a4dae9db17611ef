"""The shift matrix's tables, heat maps (docs/lab/shift-*.png) and page (docs/shift.md), from shift.json.

Everything here is computed from the measured numbers: rerunning the sweep rewrites the page.
A section is one (model, bits, group, calibration size, evaluation windows): cells measured at
different sizes are never mixed in one table, and every heading says which size it holds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from common import md_table

# Display order (shift.py's defaults first; anything else measured follows in sorted order).
EVAL = ["enwiki", "debref-de", "code", "debref-en", "debref-fr", "debref-ja", "debref-zh-cn", "news"]
CALIB = ["enwiki", "debref-de", "code", "enwiki+debref-de+code", "enwiki+debref-de+code+debref-ja"]
SHORT = {"enwiki+debref-de+code": "mix3", "enwiki+debref-de+code+debref-ja": "mix3+ja"}
# Most informative first: plain GPTQ, then diagonal shrinkage, then the rest. Names are explicit
# about the shrink and the range search: shift.py reads every candidate on min/max ranges unless
# it says +mse or +hmse, so a name means the same run whatever optq's defaults of the day are.
CANDIDATES = [
    "gptq+shrink0",
    "gptq+shrink0.5",
    "gptq+shrink0.25",
    "gptq+shrink0.75",
    "gptq+lw",
    "gptq+shrink0+damp0.1",
    "gptq+shrink0.5+mse",
    "gptaq+shrink0.5",
    "gptaq+shrink0.5+hmse",
]
SECTION = ("model", "bits", "group_size", "nsamples", "seqlen", "windows")


def baseline_key(model: str, method: str, bits: int, group_size: int, seqlen: int, windows: int, corpus: str) -> str:
    """The cache key of fp's or RTN's perplexity on one text; fp's depends on neither bits nor group."""
    grid = "" if method == "fp" else f"|b{bits}|g{group_size}"
    return f"{model}|{method}{grid}|L{seqlen}|w{windows}|{corpus}"


def cell(gptq: float, rtn: float, fp: float) -> float:
    """GPTQ's perplexity increase over fp as a fraction of RTN's: below 1, GPTQ wins."""
    if not rtn > fp:  # RTN costs nothing here: no ratio exists
        return math.nan
    return (gptq - fp) / (rtn - fp)


def in_domain(calib: str, corpus: str) -> bool:
    """Whether ``corpus`` is (part of) the calibration source ``calib``."""
    return corpus in calib.split("+")


def _ordered(values: set[str], first: list[str]) -> list[str]:
    return [v for v in first if v in values] + sorted(values - set(first))


def sections(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs grouped by model, bits, group and size: ``{**size, runs, calibs, candidates, corpora}``."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in data.get("runs", {}).values():
        groups.setdefault(tuple(run[k] for k in SECTION), []).append(run)
    out = []
    for key in sorted(groups, key=lambda k: (k[0], -k[1], k[2], k[3], k[4], k[5])):
        runs = groups[key]
        candidates = list(dict.fromkeys(r["candidate"] for r in sorted(runs, key=lambda r: _cand_rank(r["candidate"]))))
        out.append(
            {
                **dict(zip(SECTION, key)),
                "runs": runs,
                "calibs": _ordered({r["calib"] for r in runs}, CALIB),
                "candidates": candidates,
                "corpora": _ordered({c for r in runs for c in r["ppl"]}, EVAL),
            }
        )
    return out


def _cand_rank(name: str) -> tuple[int, str]:
    return (CANDIDATES.index(name) if name in CANDIDATES else len(CANDIDATES), name)


def baseline(data: dict[str, Any], sec: dict[str, Any], method: str, corpus: str) -> float | None:
    key = baseline_key(sec["model"], method, sec["bits"], sec["group_size"], sec["seqlen"], sec["windows"], corpus)
    entry = data.get("baselines", {}).get(key)
    return None if entry is None else entry["ppl"]


def matrix(data: dict[str, Any], sec: dict[str, Any], candidate: str) -> dict[str, dict[str, float | None]]:
    """calibration source -> evaluation text -> cell (None: not measured yet)."""
    runs = {r["calib"]: r for r in sec["runs"] if r["candidate"] == candidate}
    out: dict[str, dict[str, float | None]] = {}
    for calib in sec["calibs"]:
        row: dict[str, float | None] = {}
        for c in sec["corpora"]:
            g = runs[calib]["ppl"].get(c) if calib in runs else None
            r, f = baseline(data, sec, "rtn", c), baseline(data, sec, "fp", c)
            row[c] = None if g is None or r is None or f is None else cell(g, r, f)
        out[calib] = row
    return out


def summary(m: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    """Worst off-diagonal and in-domain cells (with where), the mean in-domain gain
    (1 - cell: the share of RTN's loss GPTQ recovers on its own calibration text) and counts."""
    off = [(v, k, c) for k, row in m.items() for c, v in row.items() if v is not None and not in_domain(k, c)]
    ind = [(v, k, c) for k, row in m.items() for c, v in row.items() if v is not None and in_domain(k, c)]
    total = sum(len(row) for row in m.values())
    return {
        "worst_off": max(off) if off else None,
        "worst_in": max(ind) if ind else None,
        "in_gain": sum(1 - v for v, _, _ in ind) / len(ind) if ind else None,
        "mean_off": sum(v for v, _, _ in off) / len(off) if off else None,
        "above_1": sum(v >= 1 for v, _, _ in off + ind),
        "done": len(off) + len(ind),
        "total": total,
    }


def f2(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.2f}"


def short(calib: str) -> str:
    return SHORT.get(calib, calib)


def _where(item: tuple[float, str, str] | None) -> str:
    return "–" if item is None else f"{f2(item[0])} ({short(item[1])} → {item[2]})"


def heading(sec: dict[str, Any]) -> str:
    return (
        f"{sec['model']}, {sec['bits']}-bit g{sec['group_size']}: calibrated on {sec['nsamples']} x {sec['seqlen']} "
        f"tokens, evaluated on {sec['windows']} windows of {sec['seqlen']} per text"
    )


def summary_table(data: dict[str, Any], sec: dict[str, Any]) -> str:
    rows = []
    for cand in sec["candidates"]:
        s = summary(matrix(data, sec, cand))
        rows.append(
            [
                cand,
                _where(s["worst_off"]),
                f2(s["mean_off"]),
                _where(s["worst_in"]),
                f2(s["in_gain"]),
                s["above_1"],
                f"{s['done']}/{s['total']}",
            ]
        )
    head = ["candidate", "worst off-diagonal cell", "mean off-diag", "worst in-domain", "in-domain gain", "cells ≥ 1"]
    return md_table([*head, "cells measured"], rows)


def matrix_table(data: dict[str, Any], sec: dict[str, Any], candidate: str) -> str:
    m = matrix(data, sec, candidate)
    rows = [
        [short(k)] + [f"**{f2(v)}**" if in_domain(k, c) and v is not None else f2(v) for c, v in row.items()]
        for k, row in m.items()
    ]
    return md_table(["calibrated on \\ evaluated on", *sec["corpora"]], rows)


def baseline_table(data: dict[str, Any], sec: dict[str, Any]) -> str:
    rows = [
        [name] + [f2(baseline(data, sec, method, c)) for c in sec["corpora"]]
        for name, method in (("fp", "fp"), (f"RTN {sec['bits']}-bit g{sec['group_size']}", "rtn"))
    ]
    return md_table(["perplexity", *sec["corpora"]], rows)


def text_tables(data: dict[str, Any]) -> str:
    """What the terminal shows: per section, the baselines, the summary and every matrix."""
    out = []
    for sec in sections(data):
        out += [f"\n== {heading(sec)}", baseline_table(data, sec), "", summary_table(data, sec)]
        for cand in sec["candidates"]:
            out += [f"\n{cand}", matrix_table(data, sec, cand)]
    return "\n".join(out)


def figure_name(sec: dict[str, Any]) -> str:
    return (
        f"shift-{sec['model']}-b{sec['bits']}-g{sec['group_size']}-n{sec['nsamples']}x{sec['seqlen']}-w{sec['windows']}"
    )


def draw(data: dict[str, Any], sec: dict[str, Any], folder: Path) -> str | None:
    """One heat map per candidate (rows: calibration, columns: evaluation text); None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    cands = sec["candidates"]
    ncols = min(4, len(cands))
    nrows = math.ceil(len(cands) / ncols)
    size = (4.2 * ncols + 1.0, 0.45 * len(sec["calibs"]) * nrows + 1.6 * nrows)
    fig, axes = plt.subplots(nrows, ncols, figsize=size, layout="constrained")
    axes = [axes] if len(cands) == 1 else list(getattr(axes, "flat", axes))
    values = [v for c in cands for row in matrix(data, sec, c).values() for v in row.values() if v is not None]
    finite = [v for v in values if math.isfinite(v)]
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(1.5, max(finite, default=1.5)))
    for ax, cand in zip(axes, cands):
        m = matrix(data, sec, cand)
        grid = [[math.nan if v is None else v for v in row.values()] for row in m.values()]
        image = ax.imshow(grid, cmap="RdYlGn_r", norm=norm, aspect="auto")
        for i, (calib, row) in enumerate(m.items()):
            for j, (corpus, v) in enumerate(row.items()):
                if v is not None:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6.5)
                if in_domain(calib, corpus):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.2, ec="black"))
        ax.set_xticks(range(len(sec["corpora"])), [c.removeprefix("debref-") for c in sec["corpora"]], fontsize=7)
        ax.set_yticks(range(len(m)), [short(k) for k in m], fontsize=7)
        ax.set_title(cand, fontsize=8)
    for ax in axes[len(cands) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="(GPTQ − fp) / (RTN − fp)")
    fig.suptitle(heading(sec).replace(": ", ":\n") + "; boxed: calibration text", fontsize=8)
    folder.mkdir(parents=True, exist_ok=True)
    name = figure_name(sec)
    fig.savefig(folder / f"{name}.png", dpi=110, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
    return f"lab/{name}.png"


INTRO = """# The shift matrix: GPTQ against round-to-nearest on texts it was not calibrated on

Generated by `benchmarks/shift.py` from `benchmarks/results/shift.json` (issue 18); rerun it, or
`python benchmarks/shift.py --write-only`, to redraw. Each cell is

    (GPTQ perplexity - fp perplexity) / (RTN perplexity - fp perplexity)

on one evaluation text, for GPTQ calibrated on one source: below 1 GPTQ beats round-to-nearest
(RTN) on the same grid, 0 is the fp model's perplexity. Bold cells (boxed in the figures) are
evaluated on (part of) their own calibration text; the others measure the shift.

Evaluation texts: the three calibration corpora (enwiki, debref-de, code); the same Debian book
in English (debref-en: debref-de's topic without its language), French (debref-fr: a
Latin-script language no source calibrates on), Japanese and Simplified Chinese (debref-ja,
debref-zh-cn: scripts no calibration set contains, except mix3+ja for Japanese) and English
news (a genre apart from encyclopedia, manual and code). The Debian reference also offers es,
it, pt, pt-br, id and zh-tw: Latin-script languages like French, and Traditional Chinese like
Simplified; pydoc sits between debref-en and code. Each is the held-out part of its corpus
(optq.data.corpora), first consecutive windows, BOS per window where the model needs one.

Calibration sources: enwiki, debref-de, code; mix3 = enwiki+debref-de+code in equal shares; mix3+ja
= the same plus debref-ja (four equal shares), to see whether one non-Latin script in
calibration carries over to another (debref-zh-cn stays out). Candidates are `optq compare`
variants, each on min/max ranges unless it says otherwise: `gptq+shrink0` is plain GPTQ at
optq's other defaults (act-order with static groups, token-normalised Hessian, damp 0.01: optq's
default before issue 18); `+shrinkS` shrinks H toward its diagonal, (1 - S) H + S diag(H);
`gptaq` variants are GPTAQ (docs/gptaq.md; `gptaq+shrink0.5`, chosen in docs/lab.md, section 8,
was optq's default until 2026-12-06); `+dampX` damps with X of the mean diagonal; `+mse` fits
each group's range by least squared rounding error; `+hmse` by the same search with each
column's error weighted by H's diagonal, its mean squared activation (`--mse-hessian`).
`gptaq+shrink0.5+hmse` is optq's default since 2026-12-06 (issue 34): calibrated on enwiki, it
has a lower ratio than `gptaq+shrink0.5` on 31 of the 32 texts x models x bit widths measured.
`+lw` chooses each layer's shrink from its own calibration statistics (benchmarks/shift_rules.py):
the Ledoit-Wolf intensity over the mixture's sources (over the windows for a single source).
RTN (the denominator) is always plain min/max round-to-nearest at the same bits and group.

"In-domain gain" is the mean over the bold cells of 1 - cell: the share of RTN's loss that GPTQ
recovers on its own calibration text.
"""


# The candidates the page's opening summary compares: plain GPTQ, the shrink, and optq's default.
HEADLINE = {
    "gptq+shrink0": "plain GPTQ",
    "gptq+shrink0.5": "GPTQ, H shrunk halfway",
    "gptaq+shrink0.5": "GPTAQ, H shrunk halfway (the default until 2026-12-06)",
    "gptaq+shrink0.5+hmse": "GPTAQ, H shrunk halfway, H-weighted range search (the default)",
}


def overview(data: dict[str, Any]) -> str:
    """The page's opening summary: each section's worst cell for the headline candidates."""
    secs = sections(data)
    cands = [c for c in HEADLINE if any(c in sec["candidates"] for sec in secs)]
    rows = []
    for sec in secs:
        worst = []
        for cand in cands:
            cells = [v for row in matrix(data, sec, cand).values() for v in row.values() if v is not None]
            worst.append(f2(max(cells)) if cand in sec["candidates"] and cells else "–")
        rows.append([heading(sec).replace(": calibrated on", ",").replace(" tokens, evaluated on", ";"), *worst])
    return (
        "In short: each section's worst cell (the largest ratio over every calibration source and "
        "evaluation text; below 1, the candidate beats round-to-nearest on every text), for "
        + ", ".join(HEADLINE[c] for c in cands)
        + ":\n\n"
        + md_table(["section", *(HEADLINE[c] for c in cands)], rows)
        + "\n"
    )


def write_doc(data: dict[str, Any], docs: Path) -> Path:
    """docs/shift.md and its figures."""
    title, rest = INTRO.split("\n", 1)
    parts = [title + "\n", overview(data), rest.lstrip("\n")]
    for sec in sections(data):
        parts.append(f"## {heading(sec)}\n")
        fig = draw(data, sec, docs / "lab")
        if fig:
            parts.append(f"![{figure_name(sec)}]({fig})\n")
        secs = [r["seconds"] for r in sec["runs"]]
        parts.append(
            f"{len(secs)} runs, {sum(secs) / len(secs) / 60:.1f} min each on average (quantize and evaluate).\n"
        )
        parts += [baseline_table(data, sec), "", summary_table(data, sec), ""]
        for cand in sec["candidates"]:
            parts += [f"**{cand}**\n", matrix_table(data, sec, cand), ""]
    path = docs / "shift.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts).rstrip() + "\n")
    return path
