"""The report page's figures, drawn with matplotlib as inline SVG (text kept as text).

Each function takes plain rows (from ``quantization_report.json`` and comparison JSON) and
returns one ``<svg>`` element as a string. The same rows give the same bytes: the SVG ids come
from a fixed salt and no date is written.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["available", "layer_objectives", "token_concentration", "calibration_shift"]

# Colour per kind of linear (the last part of its name), in a block's usual order.
_KIND_COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]


def available() -> bool:
    """Whether matplotlib is installed (the ``plot`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",
            "svg.hashsalt": "optq",
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    return plt


def _svg(fig: Any) -> str:
    plt = _pyplot()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "optq"}, bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # drop the XML prolog and doctype: the element is inlined
    # Drawn at its natural size; the page's CSS (max-width: 100%) shrinks it on narrow screens.
    return text.replace("<svg ", '<svg role="img" ', 1)


def _blocks(names: Sequence[str]) -> list[tuple[str, str]]:
    """(block, kind) of each layer name: ``model.layers.3.self_attn.q_proj`` -> ("3", "q_proj")."""
    out = []
    for name in names:
        m = re.search(r"\.(\d+)\.(.+)$", name)
        out.append((m.group(1), m.group(2).rsplit(".", 1)[-1]) if m else ("", name.rsplit(".", 1)[-1]))
    return out


def _block_axis(ax: Any, blocks: list[str]) -> None:
    """Shade every other block and label each block's span on the x axis."""
    spans: list[tuple[str, int, int]] = []
    for i, b in enumerate(blocks):
        if spans and spans[-1][0] == b:
            spans[-1] = (b, spans[-1][1], i)
        else:
            spans.append((b, i, i))
    for k, (_, lo, hi) in enumerate(spans):
        if k % 2:
            ax.axvspan(lo - 0.5, hi + 0.5, color="#f0f0f0", zorder=0, lw=0)
    step = max(1, math.ceil(len(spans) / 16))
    ticks = [(lo + hi) / 2 for k, (_, lo, hi) in enumerate(spans) if k % step == 0]
    labels = [b for k, (b, _, _) in enumerate(spans) if k % step == 0]
    ax.set_xticks(ticks, labels)
    ax.set_xlim(-0.5, len(blocks) - 0.5)
    ax.set_xlabel("block")


def layer_objectives(rows: Sequence[dict[str, Any]]) -> str:
    """Top: each layer's GPTQ objective (filled) and round-to-nearest's (open), log scale; bottom:
    their ratio, below 1 where GPTQ wins. Coloured by kind of linear, grouped by block."""
    plt = _pyplot()
    where = _blocks([r["name"] for r in rows])
    kinds = list(dict.fromkeys(k for _, k in where))
    colors = {k: _KIND_COLORS[i % len(_KIND_COLORS)] for i, k in enumerate(kinds)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.2), sharex=True, height_ratios=[3, 2])
    for kind in kinds:
        idx = [i for i, (_, k) in enumerate(where) if k == kind]
        gptq = [max(rows[i]["objective"], 1e-30) for i in idx]
        rtn = [max(rows[i]["rtn_objective"], 1e-30) for i in idx]
        ratio = [g / r for g, r in zip(gptq, rtn)]
        c = colors[kind]
        top.scatter(idx, rtn, s=14, facecolors="none", edgecolors=c, linewidths=0.8)
        top.scatter(idx, gptq, s=12, color=c, label=kind)
        bottom.scatter(idx, ratio, s=10, color=c)
    top.set_yscale("log")
    top.set_ylabel("layer objective\n(filled GPTQ, open RTN)")
    top.legend(fontsize=7, ncol=min(len(kinds), 7), loc="upper left", bbox_to_anchor=(0, 1.16), frameon=False)
    bottom.set_yscale("log")
    bottom.axhline(1.0, color="black", lw=0.8)
    bottom.set_ylabel("GPTQ / RTN\n(below 1: GPTQ better)")
    _block_axis(top, [b for b, _ in where])
    _block_axis(bottom, [b for b, _ in where])
    top.set_xlabel("")
    return _svg(fig)


def token_concentration(rows: Sequence[dict[str, Any]]) -> str:
    """Per layer group: the share of Σ|x|² (the plain Hessian's trace) owned by the top 1% of
    tokens and by the tokens at position 0, against the share those tokens would own if every
    token weighed the same."""
    plt = _pyplot()
    where = _blocks([r["name"] for r in rows])
    fig, ax = plt.subplots(figsize=(9, 3.2))
    x = list(range(len(rows)))
    top = [r["calibration"].get("top1pct_share") for r in rows]
    first = [r["calibration"].get("position0_share") for r in rows]
    ax.plot(
        x, [v if v is not None else math.nan for v in top], "o-", ms=3, lw=1, color="#d62728", label="top 1% of tokens"
    )
    if any(v is not None for v in first):
        ax.plot(
            x,
            [v if v is not None else math.nan for v in first],
            "s-",
            ms=3,
            lw=1,
            color="#1f77b4",
            label="tokens at position 0",
        )
        uniform = next(
            (r["calibration"].get("position0_tokens") for r in rows if r["calibration"].get("position0_tokens")), None
        )
        if uniform:
            ax.axhline(uniform, color="#1f77b4", lw=0.8, ls=":", label=f"equal weight ({uniform:.1%})")
    ax.axhline(0.01, color="#d62728", lw=0.8, ls=":", label="equal weight (1%)")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("share of Σ|x|²")
    ax.legend(fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0, 1.18), frameon=False)
    _block_axis(ax, [b for b, _ in where])
    return _svg(fig)


def calibration_shift(variants: Sequence[dict[str, Any]], corpora: Sequence[str], calib: str | None) -> str:
    """Perplexity increase over fp per evaluation corpus, one bar per quantized variant; the
    calibration corpus is marked."""
    plt = _pyplot()
    fp = next((v["perplexity"] for v in variants if v["method"] == "fp"), None)
    quant = [v for v in variants if v["method"] != "fp"]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.2 + 1.5 * len(corpora)), 3.2))
    width = 0.8 / max(len(quant), 1)
    for i, v in enumerate(quant):
        values = [v["perplexity"][c] - (fp[c] if fp else 0.0) for c in corpora]
        bars = ax.bar([k + i * width for k in range(len(corpora))], values, width, label=v["name"])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    labels = [f"{c}\n(calibration)" if c == calib else c for c in corpora]
    ax.set_xticks([k + width * (len(quant) - 1) / 2 for k in range(len(corpora))], labels)
    ax.set_ylabel("perplexity increase over fp" if fp else "perplexity")
    ax.legend(fontsize=7, frameon=False)
    return _svg(fig)
