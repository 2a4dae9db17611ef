"""What ``optq.quantize`` did, layer by layer: the Report and its JSON form."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from optq.core.solver import Solution

__all__ = ["LayerReport", "Report"]


@dataclass
class LayerReport:
    """One quantized linear layer.

    ``objective`` is the layer objective ½ tr((W-Ŵ) H (W-Ŵ)ᵀ) reached by the method (the mean
    squared output error per calibration token), ``rtn_objective`` that of round-to-nearest on the
    same grid and Hessian, ``relative_error`` = objective / ½ tr(W H Wᵀ) (the output error relative
    to the output's own energy). ``seconds`` is the layer's share, by rows, of its subset's
    Hessian pass and solve.
    """

    name: str
    shape: tuple[int, int]
    tokens: int
    damp: float | None
    objective: float
    rtn_objective: float
    relative_error: float
    seconds: float
    subset: int
    fallback: str | None = None

    @property
    def gain(self) -> float:
        """How many times smaller the objective is than round-to-nearest's (inf when exact)."""
        if self.objective == 0.0:
            return math.inf if self.rtn_objective > 0 else 1.0
        return self.rtn_objective / self.objective


@dataclass
class Report:
    """The result of ``optq.quantize``: per-layer numbers, totals, settings and versions.

    ``solutions`` maps each quantized module name to its solver ``Solution`` (codes, scales,
    zeros, g_idx, perm), which ``optq.save`` packs into a checkpoint; it is not part of the JSON.
    Each solution's ``weight`` is a view of the module's weight (no second copy of the model).
    ``skipped`` names targeted layers left unquantized and why; ``fallbacks`` names layers where
    the run deviated from the config (e.g. damping escalated to factorise H). Nothing ever falls
    back to round-to-nearest silently.
    """

    layers: dict[str, LayerReport]
    config: dict[str, Any]
    options: dict[str, Any]
    versions: dict[str, str]
    seconds: float
    block_seconds: list[float]
    skipped: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    solutions: dict[str, Solution] = field(default_factory=dict, repr=False)

    @property
    def totals(self) -> dict[str, Any]:
        """Sums and means over layers (ratios are means of per-layer ratios)."""
        rows = list(self.layers.values())
        ratios = [r.objective / r.rtn_objective for r in rows if r.rtn_objective > 0]
        return {
            "layers": len(rows),
            "blocks": len(self.block_seconds),
            "parameters": sum(r.shape[0] * r.shape[1] for r in rows),
            "objective": sum(r.objective for r in rows),
            "rtn_objective": sum(r.rtn_objective for r in rows),
            "mean_objective_ratio": sum(ratios) / len(ratios) if ratios else None,
            "layers_worse_than_rtn": sum(r.objective > r.rtn_objective for r in rows),
            "mean_relative_error": sum(r.relative_error for r in rows) / len(rows) if rows else None,
            "max_damp": max((r.damp for r in rows if r.damp is not None), default=None),
            "seconds": self.seconds,
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (no tensors); non-finite numbers become null."""
        return _finite(
            {
                "layers": {n: {**asdict(r), "gain": r.gain} for n, r in self.layers.items()},
                "totals": self.totals,
                "config": self.config,
                "options": self.options,
                "versions": self.versions,
                "seconds": self.seconds,
                "block_seconds": self.block_seconds,
                "skipped": self.skipped,
                "fallbacks": self.fallbacks,
            }
        )

    def save_json(self, path: str | os.PathLike) -> Path:
        """Write ``to_dict()`` as indented JSON to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def _finite(value: Any) -> Any:
    # JSON has no inf/nan; null says "not a number" without breaking strict parsers.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
