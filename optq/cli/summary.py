"""The table ``optq quantize`` prints when it ends: each kind of layer against round-to-nearest,
and one note per kind of fallback or float layer."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["summary"]


def summary(report: Any) -> str:
    """A table of the report, one row per kind of layer (e.g. self_attn.q_proj) over all blocks."""
    kinds: dict[str, list[Any]] = {}
    for name, row in report.layers.items():
        parts = re.sub(r"\.experts\.\d+\.", ".experts.", name).split(".")
        kinds.setdefault(".".join(parts[-2:]), []).append(row)
    head = (
        f"{'layer':<22}{'count':>6}{'objective':>12}{'rtn':>12}{'obj/rtn':>9}{'worst':>8}{'rel err':>10}{'out/rtn':>9}"
    )
    lines = [head, "-" * len(head)]
    for kind, rows in kinds.items():
        if any(r.objective is None for r in rows):  # a run from the weights alone: nothing measured
            lines.append(f"{kind:<22}{len(rows):>6}" + "".join(f"{'-':>{w}}" for w in (12, 12, 9, 8, 10, 9)))
            continue
        ratios = [r.objective / r.rtn_objective for r in rows if r.rtn_objective > 0]
        mean = sum(ratios) / len(ratios) if ratios else float("nan")
        worst = max(ratios, default=float("nan"))
        outs = [r.output_error / r.rtn_output_error for r in rows if r.output_error is not None and r.rtn_output_error]
        lines.append(
            f"{kind:<22}{len(rows):>6}{sum(r.objective for r in rows) / len(rows):>12.4g}"
            f"{sum(r.rtn_objective for r in rows) / len(rows):>12.4g}{mean:>9.3f}{worst:>8.3f}"
            f"{sum(r.relative_error for r in rows) / len(rows):>10.2e}"
            f"{sum(outs) / len(outs) if outs else float('nan'):>9.3f}"
        )
    t = report.totals
    unmeasured = getattr(report, "unmeasured", None)
    ratio = t["mean_objective_ratio"]
    lines.append("-" * len(head))
    lines.append(
        f"{t['layers']} layers in {t['blocks']} blocks, {t['parameters']:,} weights, "
        f"mean objective / round-to-nearest = {ratio:.3f}"
        if ratio is not None
        else f"{t['layers']} layers in {t['blocks']} blocks"
    )
    if unmeasured is not None:
        lines.append(f"errors not measured ({unmeasured}); quantize time {report.seconds:.1f} s")
    else:
        lines.append(
            f"layers worse than round-to-nearest: {t['layers_worse_than_rtn']}; quantize time {report.seconds:.1f} s"
        )
    if report.config.get("normalize_tokens") and unmeasured is None:
        lines.append(
            "objective: on unit-RMS tokens (what GPTQ minimised); out/rtn: plain output "
            "error |ΔWx|² against round-to-nearest's, on a sample of the tokens"
        )
    by_reason: dict[str, list[tuple[str, str]]] = {}
    own = {name: f"quantized with {row['changes']}: {row['why']}" for name, row in report.schemes.items()}
    for name, why in {**report.skipped, **report.fallbacks, **own}.items():
        by_reason.setdefault(re.sub(r"\d+", "N", why), []).append((name, why))
    for items in by_reason.values():  # one line per kind of reason: 256 starved experts are one note
        names = [n for n, _ in items]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        vary = " (numbers vary by layer)" if len({w for _, w in items}) > 1 else ""
        lines.append(f"note: {shown}: {items[0][1]}{vary}")
    if by_reason:
        lines.append("every layer and its reason: quantization_report.json (optq report draws it)")
    return "\n".join(lines)
