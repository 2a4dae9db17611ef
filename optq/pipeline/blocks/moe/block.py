"""The expert stages of a block: collect their Hessians, solve every expert, keep the books.

A stage's experts are collected together (:func:`optq.pipeline.blocks.moe.collect.collect_stage`),
then solved as one batch of units (spread over ranks when there are several). Each expert's
report row says where its Hessian came from; fallbacks are listed among the run's fallbacks, and
``report.moe[block]`` counts the stages, chunks and forwards beyond the dense schedule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from optq.pipeline.blocks.groups import solve_units
from optq.pipeline.blocks.memo import Memo
from optq.pipeline.blocks.moe.collect import NoTokens, collect_stage
from optq.pipeline.blocks.moe.stages import Stage
from optq.pipeline.blocks.work import BlockWork, SolveUnit, in_features, naming_inputs
from optq.pipeline.methods import ROUNDING
from optq.pipeline.report import Report

__all__ = ["ExpertTally", "quantize_stage", "round_starved", "NO_TOKENS"]

NO_TOKENS = "none: no calibration token reached it; rounded to nearest, errors on H = I"


@dataclass
class ExpertTally:
    """A block's expert bookkeeping: stages, Hessian chunks and the forwards they took."""

    discovery_forwards: int
    stages: int = 0
    chunks: int = 0
    forwards: int = 0

    def record(self, report: Report, prefix: str) -> None:
        """``report.moe[prefix]``, with the forwards beyond the dense schedule (one pass per group,
        one for the outputs): discovery forwards past the first batch, and one pass per expert
        stage chunk or fallback."""
        report.moe[prefix] = {
            "stages": self.stages,
            "chunks": self.chunks,
            "forwards": self.forwards,
            "discovery_forwards": self.discovery_forwards,
            "extra_forwards": self.discovery_forwards - 1 + self.forwards - self.stages,
        }


def quantize_stage(work: BlockWork, memo: Memo, stage: Stage, first: int, tally: ExpertTally) -> int:
    """Collect and solve one expert stage as the block's groups ``first``...; returns how many
    groups it was."""
    t0 = time.perf_counter()
    with naming_inputs(work.prefix, stage.subsets[0]):
        got = collect_stage(work, memo, stage)
    work.release()
    tally.stages += 1
    tally.chunks += got.chunks
    tally.forwards += got.forwards
    share = (time.perf_counter() - t0) / len(stage.subsets)  # each expert's part of the passes
    method = work.run.settings.method_object
    units, sources = [], []
    for subset in stage.subsets:
        rep = subset[0]
        hess = got.hessians[rep]
        rtn = rep in got.rtn or hess.count == 0
        if hess.count == 0:
            hess = NoTokens(in_features(work.linears[rep]), work.linears[rep].weight.device)
        sources.append(got.sources[rep] if got.hessians[rep].count else NO_TOKENS)
        units.append(SolveUnit(subset, hess, ROUNDING if rtn else method, time.perf_counter() - share))
    solve_units(work, units, first)
    for unit, source in zip(units, sources):
        fallback = unit.method is not method or "fallback" in source  # rounded instead, or H from elsewhere
        mark(work.report, unit.subset, source, method.reads_hessian and fallback)
    count = len(units)
    del got, units
    work.release()
    return count


def round_starved(work: BlockWork, names: Sequence[str], first: int) -> int:
    """Experts of a model's own ModuleList that no batch ever called: rounded to nearest, their
    errors measured on H = I; returns how many groups they were."""
    units = [
        SolveUnit(
            [n], NoTokens(in_features(work.linears[n]), work.linears[n].weight.device), ROUNDING, time.perf_counter()
        )
        for n in names
    ]
    solve_units(work, units, first)
    for name in names:
        mark(work.report, [name], NO_TOKENS, work.run.settings.method_object.reads_hessian)
    return len(units)


def mark(report: Report, subset: Sequence[str], source: str, fallback: bool) -> None:
    """Where each expert's Hessian came from; a fallback is also listed among the run's fallbacks."""
    for name in subset:
        report.layers[name].hessian = source
        if fallback:
            report.layers[name].fallback = source
            report.fallbacks[name] = source
