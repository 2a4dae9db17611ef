"""Quantizing one decoder block: plan its groups of linears, collect Hessians, solve, write back.

``quantize_block`` finds the block's groups (the linears sharing an input, in the order the
forward uses them), then takes one of two paths:

- replayed (the default, ``strategy="replay"``): per group, the block is run again from its
  inputs up to the group (children already quantized are replayed from a memo), the group's
  Hessian is filled, solved and written back (:func:`_dense_group`); a mixture-of-experts stage
  fills many experts' Hessians per pass (``optq.pipeline.blocks.moe.block``);
- paused (``strategy="pause"``): every batch's forward pauses at each group's input while the
  group is solved, then resumes (:func:`_paused`).

A run from the weights alone (``Run.weights_only``: round-to-nearest) takes neither: each target
is quantized on its own, in the block's order, and the block never runs (a linear the forward
would not call is quantized too).

The block's outputs then replace its inputs. With method="gptaq" a float copy of the block runs
beside it on the float chain (``fp_hidden``), pairing every Hessian input with the float model's
(``optq.pipeline.blocks.twin``); its outputs replace the float chain.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from optq.core import memory
from optq.formats.experts import ExpertLinears
from optq.formats.linears import find_linears
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.groups import solve_units
from optq.pipeline.blocks.memo import Memo
from optq.pipeline.blocks.moe import block as moe_block
from optq.pipeline.blocks.moe.stages import Stage, plan_stages
from optq.pipeline.blocks.prepare import Run
from optq.pipeline.blocks.stepper import PausedForwards
from optq.pipeline.blocks.twin import FloatTwin, pairing
from optq.pipeline.blocks.work import BlockWork, SolveUnit, naming_inputs
from optq.pipeline.discovery import expert_parts
from optq.pipeline.distributed.ranks import Dist
from optq.pipeline.report import Report

__all__ = ["quantize_block"]

log = logging.getLogger("optq.pipeline")


def quantize_block(
    run: Run,
    prefix: str,
    block: nn.Module,
    inputs: tuple[list[torch.Tensor], list[capture.Call]],
    report: Report,
    bar: object,
    fp_hidden: list[torch.Tensor] | None = None,
) -> None:
    """Quantize one block's targets; ``inputs`` (its hidden states and call arguments per batch):
    the hidden states are replaced by the block's outputs. ``fp_hidden`` (method="gptaq"): the
    float chain's hidden states, replaced by the float block's outputs."""
    hidden, calls = inputs
    linears = find_linears(block, prefix)
    mine = [n for n in linears if n in run.targets]
    release = memory.releaser(run.device)
    float_chain = run.settings.method_object.float_chain  # GPTAQ: a float copy of the block there
    if float_chain and fp_hidden is None:
        raise ValueError(f"method={run.settings.method!r} needs the float chain's hidden states (fp_hidden)")
    if run.weights_only:  # each target from its weight alone: no forward, no Hessian, no outputs
        work = BlockWork(run, prefix, block, linears, mine, hidden, calls, report, bar, release)
        for k, name in enumerate(mine):
            solve_units(work, [SolveUnit([name], None, run.settings.method_object, time.perf_counter())], k)
        return
    if not mine:
        for chain in (hidden, fp_hidden) if float_chain else (hidden,):
            _forward_in_place(block, chain, calls, release)
        return
    work = BlockWork(run, prefix, block, linears, mine, hidden, calls, report, bar, release)
    original = None
    if run.settings.propagate == "original":
        # The next block's inputs come from the unquantized block: computed first, held beside
        # the inputs (the one mode that needs two copies of the activations).
        original = [capture.run_block(block, h, c) for h, c in zip(hidden, calls)]
    known = [n for n in mine if expert_parts(n) and isinstance(_experts_of(block, prefix, n), ExpertLinears)]
    schedule = capture.discover_subsets(block, linears, mine, hidden, calls, known=known)
    if run.dist.active:  # every rank must run the same groups, whatever its own batches reached
        schedule = _merge_schedules(run.dist, schedule)
    if float_chain:  # before any weight of the block changes
        work.twin = FloatTwin(block, prefix, (schedule.order, mine), fp_hidden, calls)
    stages = plan_stages(block, prefix, schedule, set(mine))
    never = [n for n in schedule.unused if expert_parts(n) is None]
    for name in never:
        report.skipped[name] = "never called in the block's forward on calibration data"
        log.warning("%s is never called by its block; left unquantized", name)
    starved = [n for n in schedule.unused if n not in never and not any(n in s for st in stages for s in st.subsets)]
    experts = any(st.module is not None for st in stages)
    why = (
        "experts"
        if experts
        else "several processes"
        if run.dist.active
        else f"{run.settings.method} pairs every batch with the float block's"
        if float_chain
        else ", ".join(schedule.repeated) + " called more than once per forward"
        if schedule.repeated
        else None
    )
    if run.settings.strategy == "pause" and why is None:
        _paused(work, schedule, original)
        return
    if run.settings.strategy == "pause":
        # A pause at the first call would solve before the later calls are seen; experts' calls
        # depend on each batch's routing; ranks meet at every group.
        log.info("%s: %s; replaying the block per group", prefix, why)
    _replayed(work, schedule, stages, starved, original)


def _replayed(
    work: BlockWork,
    schedule: capture.Schedule,
    stages: list[Stage],
    starved: list[str],
    original: list[torch.Tensor] | None,
) -> None:
    memo = Memo(work.block, work.prefix, list(work.linears), schedule.order, work.mine)
    tally = moe_block.ExpertTally(discovery_forwards=schedule.forwards)
    k = 0
    for stage in stages:
        if stage.module is None:
            # The last pass also moves the float twin's chain on (nothing after it needs its inputs).
            last = stage is stages[-1] and not starved and original is None
            _dense_group(work, memo, schedule, stage.subsets[0], k, last)
            k += 1
        else:
            k += moe_block.quantize_stage(work, memo, stage, k, tally)
        memo.solved([n for s in stage.subsets for n in s])
        if work.twin is not None:
            work.twin.solved([n for s in stage.subsets for n in s])
    if starved:  # experts of a model's own ModuleList that no batch ever called
        k += moe_block.round_starved(work, starved, k)
    if tally.stages or starved:
        tally.record(work.report, work.prefix)
    if original is not None:
        for b, out in enumerate(original):
            _keep(work.hidden, b, out)
    else:
        with memo.replay_pass(last=True) as at_batch:
            _forward_in_place(work.block, work.hidden, work.calls, work.release, at_batch)
    if work.twin is not None:
        work.twin.propagate(_keep)
        work.release()


def _dense_group(
    work: BlockWork, memo: Memo, schedule: capture.Schedule, subset: list[str], k: int, last: bool = False
) -> None:
    """One group of a dense block: replay the block up to it, fill its Hessian, solve it."""
    t0 = time.perf_counter()
    hess = work.new_hessian(subset)
    per_forward = schedule.order.count(subset[0])
    with (
        work.run.dist.failing_together(),
        naming_inputs(work.prefix, subset),
        memo.replay_pass() as at_batch,
        pairing(work.twin, {subset[0]: hess}, at_batch, per_forward, keep=_keep if last else None) as (hooked, before),
    ):
        hess_in = hooked[subset[0]]
        capture.collect_hessian(
            work.block, work.linears, subset, schedule.order, work.hidden, work.calls, hess_in, before_batch=before
        )
    hess.all_reduce(work.run.dist)
    work.release()
    solve_units(work, [SolveUnit(subset, hess, work.run.settings.method_object, t0)], k)
    work.release()  # the solver's workspace, before the next pass allocates


def _paused(work: BlockWork, schedule: capture.Schedule, original: list[torch.Tensor] | None) -> None:
    """Every batch's forward paused at each group's input while the group is solved."""
    stops = [work.linears[s[0]] for s in schedule.subsets]
    with PausedForwards(work.block, stops, work.hidden, work.calls, release=work.release) as paused:
        for k, subset in enumerate(schedule.subsets):
            t0 = time.perf_counter()
            hess = work.new_hessian(subset)
            with naming_inputs(work.prefix, subset):
                paused.advance(k, hess)
            solve_units(work, [SolveUnit(subset, hess, work.run.settings.method_object, t0)], k)
        # "original": the paused forwards are abandoned (closing unwinds them); their outputs,
        # computed from partly quantized layers, are not what propagates.
        outputs = original if original is not None else paused.finish()
        for b, out in enumerate(outputs):
            _keep(work.hidden, b, out)


def _forward_in_place(
    block: nn.Module,
    hidden: list[torch.Tensor],
    calls: list[capture.Call],
    release: Callable[[], None],
    before_batch: Callable[[int], None] | None = None,
) -> None:
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


def _merge_schedules(dist: Dist, schedule: capture.Schedule) -> capture.Schedule:
    """One schedule for every rank: the groups any rank's batches found, in rank order."""
    s = schedule
    parts = dist.gather({str(dist.rank): (s.subsets, s.order, s.unused, s.repeated, s.forwards)})
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
    unused = [n for n in s.unused if all(n in r[2] for r in ranks)]
    repeated = list(dict.fromkeys(n for r in ranks for n in r[3]))
    return capture.Schedule(subsets, order, unused, repeated, max(r[4] for r in ranks))


def _experts_of(block: nn.Module, prefix: str, name: str) -> nn.Module | None:
    parts = expert_parts(name)
    if parts is None:
        return None
    try:
        return block.get_submodule(parts[0][len(prefix) + 1 :])
    except AttributeError:
        return None
