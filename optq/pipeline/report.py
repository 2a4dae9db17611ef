"""What ``optq.quantize`` did, layer by layer: the Report and its JSON form.

Each layer has two errors (``LayerReport``): the ``objective`` the solver minimised, which with
``normalize_tokens`` (the default) is relative to each token's activation norm, and the plain
``output_error``, the mean squared output error per token; the JSON's ``definitions`` say which
is which for the run.
"""

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

    Two errors are reported, with Δ = W - Ŵ and x_t the calibration inputs of the layer:

    ``objective`` = ½ tr(Δ H Δᵀ) is what the solver minimised, on the solver's Hessian H (the
    same as ``Solution.loss``); ``rtn_objective`` is round-to-nearest's on the same grid and H;
    ``relative_error`` = objective / ½ tr(W H Wᵀ). With ``normalize_tokens`` (the default) H is
    built from every token scaled to unit RMS, H = 2/n Σ_t (K / |x_t|²) x_t x_tᵀ, so the objective
    is the mean over tokens of |Δ x_t|² K / |x_t|²: each token's output error relative to its own
    squared activation norm (times K), every token weighing the same. It is NOT the output error.
    Without ``normalize_tokens`` it is the plain mean squared output error per token.

    ``output_error`` = ½ tr(Δ H_plain Δᵀ), H_plain = 2 X Xᵀ / n of the raw inputs: the mean over
    tokens of the squared output error |Δ x_t|², the quantity the GPTQ paper minimises, and
    ``rtn_output_error`` round-to-nearest's. With ``normalize_tokens`` it is measured on a
    systematic sample of ``output_tokens`` tokens (about one in 16, visiting every position of a
    window equally often; see ``optq.pipeline.blocks.hessians``): that costs about 3% of the quantize
    time where all tokens would cost 24%. Without ``normalize_tokens`` it equals the objective,
    on every token, at no cost.

    ``calibration`` says how concentrated the layer's calibration input is on a few tokens
    (``optq.pipeline.blocks.hessians.token_energy_stats``): the share of Σ|x_t|² owned by the top 1% of
    tokens and by the tokens at position 0.

    ``seconds`` is the layer's share, by rows, of its subset's Hessian pass and solve.

    ``hessian`` says, for mixture-of-experts experts, where H came from: ``routed`` (the tokens
    routed to the expert), ``all`` (every calibration token), a fallback for a starved expert, or
    none (no token reached it: rounded to nearest, errors on H = I). None for other layers.

    A run from the weights alone (round-to-nearest: ``Report.unmeasured`` says why) reads no
    calibration token: ``tokens``, the errors and ``calibration`` are None (null in the JSON),
    never an estimate; ``subset`` is then the layer's position in its block (no forward tells
    which linears share an input).
    """

    name: str
    shape: tuple[int, int]
    tokens: int | None
    damp: float | None
    objective: float | None
    rtn_objective: float | None
    relative_error: float | None
    seconds: float
    subset: int
    fallback: str | None = None
    output_error: float | None = None
    rtn_output_error: float | None = None
    output_tokens: int | None = None
    calibration: dict[str, Any] | None = None
    hessian: str | None = None

    @property
    def gain(self) -> float | None:
        """How many times smaller the objective is than round-to-nearest's (inf when exact; None
        when not measured)."""
        if self.objective is None or self.rtn_objective is None:
            return None
        return _gain(self.objective, self.rtn_objective)

    @property
    def output_gain(self) -> float | None:
        """How many times smaller the output error is than round-to-nearest's."""
        if self.output_error is None or self.rtn_output_error is None:
            return None
        return _gain(self.output_error, self.rtn_output_error)


def _gain(error: float, rtn_error: float) -> float:
    if error == 0.0:
        return math.inf if rtn_error > 0 else 1.0
    return rtn_error / error


@dataclass
class Report:
    """The result of ``optq.quantize``: per-layer numbers, totals, settings and versions.

    ``solutions`` maps each quantized module name to its solver ``Solution`` (codes, scales,
    zeros, g_idx, perm), which ``optq.save`` packs into a checkpoint; it is not part of the JSON.
    Each solution's ``weight`` is a view of the module's weight (no second copy of the model).
    ``skipped`` names targeted layers left unquantized and why; ``fallbacks`` names layers where
    the run deviated from the config (e.g. damping escalated to factorise H, a starved expert's
    Hessian taken from all tokens or rounded to nearest). Nothing ever falls back to
    round-to-nearest silently. ``moe`` holds, per mixture-of-experts block, its expert stages, the
    Hessian chunks and the forwards they cost beyond the dense schedule. ``solved_by`` names, in a
    run over several processes (torch.distributed), the rank that solved each layer. ``schemes``
    names each layer quantized with settings other than ``config``: what differs, and why (an
    override, or a group size the serving engines need; ``optq.pipeline.schemes``). ``allocation``
    (``target_bits`` runs): the budget, the stored bits reached, every candidate allocation checked
    with its KL to the float model, and each layer's bits, group size and reason
    (``optq.pipeline.allocation.allocate``). ``unmeasured``: why the layers' errors are null (a
    run from the weights alone, which reads no calibration activation), or None when measured.
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
    moe: dict[str, dict[str, Any]] = field(default_factory=dict)
    solved_by: dict[str, int] = field(default_factory=dict)
    schemes: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocation: dict[str, Any] = field(default_factory=dict)  # --target-bits: what it chose and why
    unmeasured: str | None = None  # why no layer error was measured (a weights-only run)

    @property
    def totals(self) -> dict[str, Any]:
        """Sums and means over layers (ratios are means of per-layer ratios); the error totals
        are over the layers whose errors were measured, None when none was."""
        rows = list(self.layers.values())
        measured = [r for r in rows if r.objective is not None and r.rtn_objective is not None]
        ratios = [r.objective / r.rtn_objective for r in measured if r.rtn_objective > 0]
        outs = [r for r in rows if r.output_error is not None and r.rtn_output_error is not None]
        out_ratios = [r.output_error / r.rtn_output_error for r in outs if r.rtn_output_error > 0]
        rel = [r.relative_error for r in rows if r.relative_error is not None]
        return {
            "layers": len(rows),
            "blocks": len(self.block_seconds),
            "parameters": sum(r.shape[0] * r.shape[1] for r in rows),
            "objective": sum(r.objective for r in measured) if measured else None,
            "rtn_objective": sum(r.rtn_objective for r in measured) if measured else None,
            "mean_objective_ratio": sum(ratios) / len(ratios) if ratios else None,
            "layers_worse_than_rtn": sum(r.objective > r.rtn_objective for r in measured) if measured else None,
            "output_error": sum(r.output_error for r in outs) if outs else None,
            "rtn_output_error": sum(r.rtn_output_error for r in outs) if outs else None,
            "mean_output_error_ratio": sum(out_ratios) / len(out_ratios) if out_ratios else None,
            "layers_output_worse_than_rtn": sum(r.output_error > r.rtn_output_error for r in outs) if outs else None,
            "mean_relative_error": sum(rel) / len(rel) if rel else None,
            "max_damp": max((r.damp for r in rows if r.damp is not None), default=None),
            "seconds": self.seconds,
        }

    def definitions(self) -> dict[str, str]:
        """What the error fields of this report mean (also written to the JSON)."""
        if self.unmeasured is not None:
            fields = ("tokens", "objective", "rtn_objective", "relative_error", "gain", "output_error")
            return dict.fromkeys((*fields, "rtn_output_error", "output_gain"), f"null: {self.unmeasured}")
        normalized = bool(self.config.get("normalize_tokens", False))
        if normalized:
            objective = (
                "½ tr(ΔHΔᵀ), Δ = W - Ŵ, H from tokens scaled to unit RMS: the mean over "
                "tokens of K |Δx|² / |x|², each token's output error relative to its "
                "activation norm (what the solver minimised; not the output error)"
            )
            output = (
                "½ tr(Δ H_plain Δᵀ), H_plain = 2XXᵀ/n of the raw inputs: the mean squared "
                "output error |Δx|² per token, on a systematic sample of output_tokens tokens"
            )
        else:
            objective = (
                "½ tr(ΔHΔᵀ), Δ = W - Ŵ, H = 2XXᵀ/n: the mean squared output error |Δx|² "
                "per token (what the solver minimised)"
            )
            output = "the same as objective (tokens are not normalised)"
        return {
            "objective": objective,
            "rtn_objective": "objective of round-to-nearest on the same grid",
            "relative_error": "objective / ½ tr(W H Wᵀ)",
            "gain": "rtn_objective / objective",
            "output_error": output,
            "rtn_output_error": "output_error of round-to-nearest on the same grid",
            "output_gain": "rtn_output_error / output_error",
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (no tensors); non-finite numbers become null."""
        return _finite(
            {
                "definitions": self.definitions(),
                "layers": {
                    n: {**asdict(r), "gain": r.gain, "output_gain": r.output_gain} for n, r in self.layers.items()
                },
                "totals": self.totals,
                "config": self.config,
                "options": self.options,
                "versions": self.versions,
                "seconds": self.seconds,
                "block_seconds": self.block_seconds,
                "skipped": self.skipped,
                "fallbacks": self.fallbacks,
                "schemes": self.schemes,
                "allocation": self.allocation,
                "moe": self.moe,
                "distributed": self.distributed(),
                "unmeasured": self.unmeasured,
            }
        )

    def distributed(self) -> dict[str, Any] | None:
        """World size, and per rank its calibration share and the layers it solved (None for one
        process)."""
        world = int(self.options.get("world_size", 1))
        if world <= 1:
            return None
        shares = self.options.get("calibration_shares") or [None] * world
        return {
            "world_size": world,
            "ranks": [
                {
                    "rank": r,
                    "calibration_samples": shares[r],
                    "layers_solved": [n for n, o in self.solved_by.items() if o == r],
                }
                for r in range(world)
            ],
        }

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
