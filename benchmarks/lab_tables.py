"""Tables, number formats and figure plumbing shared by the lab's page (lab_report.py, lab_report_calibration.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

CORPORA = ["enwiki", "debref-de", "code", "debref-ja"]


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",
            "svg.hashsalt": "optq-lab",
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    return plt


def save_svg(fig: Any, folder: Path, name: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / f"{name}.svg", format="svg", metadata={"Date": None}, bbox_inches="tight")
    pyplot().close(fig)
    return f"lab/{name}.svg"


def fmt(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.2f}"


def ppl_row(name: str, ppl: dict[str, float], fp: dict[str, float] | None = None) -> list[str]:
    cells = [name]
    for c in CORPORA:
        v = ppl.get(c)
        cells.append(fmt(v) + (f" ({v - fp[c]:+.2f})" if fp and v is not None else ""))
    return cells


def by_bits(ax: Any, rows: list[dict[str, Any]], fp: dict[str, float], keys: tuple[str, str], title: str) -> None:
    """enwiki perplexity increase over fp against bits: two GPTQ variants and RTN."""
    bits = [r["bits"] for r in rows]
    for key, style in ((keys[0], "o-"), (keys[1], "s--"), ("rtn", "^:")):
        ax.plot(bits, [r[key]["enwiki"] - fp["enwiki"] for r in rows], style, label=key if key != "rtn" else "RTN")
    ax.set_yscale("log")
    ax.set_xticks(bits)
    ax.set_xlabel("bits")
    ax.set_ylabel("enwiki perplexity increase over fp")
    ax.legend(frameon=False, fontsize=7, title=title)
