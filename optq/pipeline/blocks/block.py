"""Quantizing one decoder block: plan its groups of linears, collect Hessians, solve, write back.

Used by ``optq.pipeline``; kept apart so where a block's Hessians are summed (the seam for
data-parallel calibration) and how the block is run are each in one place.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.formats.experts import ExpertLinears
from optq.formats.linears import find_linears, get_weight
from optq.pipeline.blocks import capture, memory
from optq.pipeline.moe import stages as moe
from optq.pipeline.blocks.hessians import LayerHessians
from optq.pipeline.distributed.ranks import Dist
from optq.pipeline.blocks.memo import Memo
from optq.pipeline.report import Report
from optq.pipeline.blocks.groups import solve_subset, solve_units
from optq.pipeline.blocks.stepper import PausedForwards

__all__ = ["quantize_block"]

log = logging.getLogger("optq.pipeline")
NO_TOKENS = "none: no calibration token reached it; rounded to nearest, errors on H = I"


def quantize_block(
    prefix: str,
    block: nn.Module,
    hidden: list[torch.Tensor],
    calls: list[capture.Call],
    targets: set[str],
    config: QuantConfig,
    opts: dict[str, Any],
    report: Report,
    bar: Any,
) -> None:
    """Quantize one block's targets; ``hidden`` (its inputs) is replaced by its outputs."""
    linears = find_linears(block, prefix)
    mine = [n for n in linears if n in targets]
    release = memory.releaser(opts["device"])
    original = None
    if opts["propagate"] == "original" and mine:
        # The next block's inputs come from the unquantized block: computed first, held beside
        # the inputs (the one mode that needs two copies of the activations).
        original = [capture.run_block(block, h, c) for h, c in zip(hidden, calls)]
    if not mine:
        _forward_in_place(block, hidden, calls, release)
        return
    dist: Dist = opts.get("dist") or Dist()
    known = [n for n in mine if moe.expert_parts(n) and isinstance(_experts_of(block, prefix, n), ExpertLinears)]
    plan = capture.discover_subsets(block, linears, mine, hidden, calls, known=known)
    if dist.active:  # every rank must run the same groups, whatever its own batches reached
        plan = _merge_plans(dist, plan)
    stages = moe.plan_stages(block, prefix, plan, set(mine))
    never = [n for n in plan.unused if moe.expert_parts(n) is None]
    for name in never:
        report.skipped[name] = "never called in the block's forward on calibration data"
        log.warning("%s is never called by its block; left unquantized", name)
    starved = [n for n in plan.unused if n not in never and not any(n in s for st in stages for s in st.subsets)]

    def solve(k: int, units: list[tuple[list[str], Any, str, float]]) -> None:
        # Seam 2, where Hessians are summed: the units' Hessians hold every rank's calibration
        # tokens here (all-reduced by dist.reduce_hessian); their linears are solved, spread
        # over the ranks when there are several (optq.pipeline.blocks.groups.solve_units).
        solve_units(units, k, linears, config, report, dist,
                    after=lambda subset: bar.set_postfix_str(_postfix(report, subset), refresh=False))

    def new_hessian(subset: list[str]) -> LayerHessians:
        first = linears[subset[0]]
        return LayerHessians(_in_features(first), device=first.weight.device,
                             normalize_tokens=config.normalize_tokens,
                             dtype=torch.float64 if opts.get("hessian_dtype") == "float64" else torch.float32)

    experts = any(st.module is not None for st in stages)
    if opts["strategy"] == "replay" or plan.repeated or experts or dist.active:
        if (plan.repeated or experts or dist.active) and opts["strategy"] != "replay":
            # A pause at the first call would solve before the later calls are seen; experts'
            # calls depend on each batch's routing; ranks meet at every group.
            log.info("%s: %s; replaying the block per group", prefix,
                     "experts" if experts else "several processes" if dist.active else
                     ", ".join(plan.repeated) + " called more than once per forward")
        memo = Memo(block, prefix, list(linears), plan.order, mine)
        k = 0
        moe_info: dict[str, Any] = {"stages": 0, "chunks": 0, "forwards": 0, "discovery_forwards": plan.forwards}
        for stage in stages:
            t0 = time.perf_counter()
            if stage.module is None:
                subset = stage.subsets[0]
                hess = new_hessian(subset)
                error = None
                try:
                    with _context(prefix, subset), memo.replay_pass() as at_batch:
                        capture.collect_hessian(block, linears, subset, plan.order, hidden, calls, hess,
                                                before_batch=at_batch)
                except Exception as exc:  # every rank must reach the check, or the others would hang
                    error = exc
                dist.check(error)
                dist.reduce_hessian(hess)
                release()
                solve(k, [(subset, hess, opts["method"], t0)])
                release()  # the solver's workspace, before the next pass allocates
                memo.solved(subset)
                k += 1
                continue

            def run_pass(_: Any) -> None:
                with memo.replay_pass() as at_batch:
                    for b, (h, c) in enumerate(zip(hidden, calls)):
                        at_batch(b)
                        capture.run_block(block, h, c)

            with _context(prefix, stage.subsets[0]):
                got = moe.collect_stage(block, linears, stage, new_hessian, _in_features(linears[stage.subsets[0][0]]),
                                        {**opts, "normalize_tokens": config.normalize_tokens}, run_pass, dist)
            release()
            moe_info["stages"] += 1
            moe_info["chunks"] += got.chunks
            moe_info["forwards"] += got.forwards
            share = (time.perf_counter() - t0) / len(stage.subsets)  # each expert's part of the passes
            units, sources = [], []
            for subset in stage.subsets:
                rep = subset[0]
                rtn = rep in got.rtn or got.hessians[rep].count == 0
                hess = got.hessians[rep] if got.hessians[rep].count else moe.NoTokens(
                    _in_features(linears[rep]), linears[rep].weight.device)
                sources.append(got.sources[rep] if got.hessians[rep].count else NO_TOKENS)
                units.append((subset, hess, "rtn" if rtn else opts["method"], time.perf_counter() - share))
            solve(k, units)
            for (subset, _, method, _), source in zip(units, sources):
                _mark(report, subset, source, opts["method"] != "rtn" and (method == "rtn" or "fallback" in source))
            k += len(units)
            del got, units
            release()
            memo.solved([n for s in stage.subsets for n in s])
        if starved:  # experts of a model's own ModuleList that no batch ever called
            solve(k, [([n], moe.NoTokens(_in_features(linears[n]), linears[n].weight.device), "rtn",
                        time.perf_counter()) for n in starved])
            for name in starved:
                _mark(report, [name], NO_TOKENS, opts["method"] != "rtn")
        if experts or starved:
            # Beyond the dense schedule (one pass per group, one for the outputs): discovery
            # forwards past the first batch, and one pass per expert stage chunk or fallback.
            moe_info["extra_forwards"] = plan.forwards - 1 + moe_info["forwards"] - moe_info["stages"]
            report.moe[prefix] = moe_info
        if original is not None:
            for b, out in enumerate(original):
                _keep(hidden, b, out)
        else:
            with memo.replay_pass(last=True) as at_batch:
                _forward_in_place(block, hidden, calls, release, at_batch)
        return
    stops = [linears[s[0]] for s in plan.subsets]
    with PausedForwards(block, stops, hidden, calls, release=release) as paused:
        for k, subset in enumerate(plan.subsets):
            t0 = time.perf_counter()
            hess = new_hessian(subset)
            with _context(prefix, subset):
                paused.advance(k, hess)
            solve(k, [(subset, hess, opts["method"], t0)])
        # "original": the paused forwards are abandoned (closing unwinds them); their outputs,
        # computed from partly quantized layers, are not what propagates.
        outputs = original if original is not None else paused.finish()
        for b, out in enumerate(outputs):
            _keep(hidden, b, out)


@contextlib.contextmanager
def _context(prefix: str, subset: Sequence[str]) -> Iterator[None]:
    # Hessian.update refuses non-finite inputs without knowing whose they are: name the block
    # and the layers whose input it was.
    try:
        yield
    except ValueError as exc:
        names = ", ".join(n[len(prefix) + 1 :] if n.startswith(prefix + ".") else n for n in subset)
        raise ValueError(f"{prefix}: the input of {names}: {exc}") from exc


def _forward_in_place(block: nn.Module, hidden: list[torch.Tensor], calls: list[capture.Call],
                      release: Callable[[], None],
                      before_batch: Callable[[int], None] | None = None) -> None:
    # Each batch's output is written into its input's buffer as soon as it exists: the
    # activations are held once plus one batch, in the same buffers for the whole run (the
    # buffers are private copies made at capture; see _keep).
    for b, call in enumerate(calls):
        if before_batch is not None:
            before_batch(b)
        _keep(hidden, b, capture.run_block(block, hidden[b], call))
    release()


def _keep(hidden: list[torch.Tensor], b: int, out: torch.Tensor) -> None:
    # New long-lived tensors allocated between a pass's temporaries fragment the heap (measured:
    # +0.3 GB of peak on SmolLM2); writing into the existing buffer avoids that.
    old = hidden[b]
    if out.shape == old.shape and out.dtype == old.dtype and out.device == old.device:
        old.copy_(out)
    else:  # a block that changes the hidden states' shape: a new private buffer
        hidden[b] = out.detach().clone()


def _merge_plans(dist: Dist, plan: capture.Plan) -> capture.Plan:
    """One plan for every rank: the groups any rank's batches found, in rank order."""
    parts = dist.gather({str(dist.rank): (plan.subsets, plan.order, plan.unused, plan.repeated, plan.forwards)})
    ranks = [parts[str(r)] for r in range(dist.world_size)]
    subsets: list[list[str]] = []
    order: list[str] = []
    seen: set[str] = set()
    for sub, ordr, _, _, _ in ranks:
        for group in sub:
            if not seen.intersection(group):
                subsets.append(list(group))
                seen.update(group)
        order += [n for n in ordr if n not in order]
    unused = [n for n in plan.unused if all(n in r[2] for r in ranks)]
    repeated = [n for n in dict.fromkeys(n for r in ranks for n in r[3])]
    return capture.Plan(subsets, order, unused, repeated, max(r[4] for r in ranks))


def _experts_of(block: nn.Module, prefix: str, name: str) -> nn.Module | None:
    parts = moe.expert_parts(name)
    if parts is None:
        return None
    try:
        return block.get_submodule(parts[0][len(prefix) + 1 :])
    except AttributeError:
        return None


def _mark(report: Report, subset: Sequence[str], source: str, fallback: bool) -> None:
    # Where each expert's Hessian came from; a fallback is also listed among the run's fallbacks.
    for name in subset:
        report.layers[name].hessian = source
        if fallback:
            report.layers[name].fallback = source
            report.fallbacks[name] = source


def _in_features(module: nn.Module) -> int:
    return int(get_weight(module).shape[1])


def _postfix(report: Report, subset: Sequence[str]) -> str:
    last = report.layers[subset[-1]]
    short = ".".join(subset[-1].split(".")[-2:])
    return f"{short} obj/rtn={last.objective / last.rtn_objective:.3f}" if last.rtn_objective else short
