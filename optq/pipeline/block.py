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

from optq.core import solver
from optq.core.config import QuantConfig
from optq.formats.linears import find_linears, get_weight, set_weight
from optq.formats.experts import ExpertLinears
from optq.pipeline import capture, memory, moe
from optq.pipeline.hessians import LayerHessians
from optq.pipeline.memo import Memo
from optq.pipeline.report import LayerReport, Report
from optq.pipeline.stepper import PausedForwards

__all__ = ["quantize_block"]

log = logging.getLogger("optq.pipeline")


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
    known = [n for n in mine if moe.expert_parts(n) and isinstance(_experts_of(block, prefix, n), ExpertLinears)]
    plan = capture.discover_subsets(block, linears, mine, hidden, calls, known=known)
    stages = moe.plan_stages(block, prefix, plan, set(mine))
    never = [n for n in plan.unused if moe.expert_parts(n) is None]
    for name in never:
        report.skipped[name] = "never called in the block's forward on calibration data"
        log.warning("%s is never called by its block; left unquantized", name)
    starved = [n for n in plan.unused if n not in never and not any(n in s for st in stages for s in st.subsets)]

    def solve(k: int, subset: list[str], hess: Any, t0: float, method: str | None = None) -> None:
        # Seam 2, where Hessians are summed: both strategies come here once the group's Hessian
        # holds every local calibration token. Data-parallel calibration all-reduces its sums
        # and token counts at this point, before the solve (docs/architecture.md).
        _solve_subset(linears, subset, k, hess, config, method or opts["method"], report, t0)
        bar.set_postfix_str(_postfix(report, subset), refresh=False)

    def new_hessian(subset: list[str]) -> LayerHessians:
        first = linears[subset[0]]
        return LayerHessians(_in_features(first), device=first.weight.device,
                             normalize_tokens=config.normalize_tokens,
                             dtype=torch.float64 if opts.get("hessian_dtype") == "float64" else torch.float32)

    experts = any(st.module is not None for st in stages)
    if opts["strategy"] == "replay" or plan.repeated or experts:
        if (plan.repeated or experts) and opts["strategy"] != "replay":
            # A pause at the first call would solve before the later calls are seen; experts'
            # calls depend on each batch's routing.
            log.info("%s: %s; replaying the block per group", prefix,
                     "experts" if experts else ", ".join(plan.repeated) + " called more than once per forward")
        memo = Memo(block, prefix, list(linears), plan.order, mine)
        k = 0
        extra = plan.forwards - 1
        moe_info: dict[str, Any] = {"stages": 0, "chunks": 0, "forwards": 0, "discovery_forwards": plan.forwards}
        for stage in stages:
            t0 = time.perf_counter()
            if stage.module is None:
                subset = stage.subsets[0]
                hess = new_hessian(subset)
                with _context(prefix, subset), memo.replay_pass() as at_batch:
                    capture.collect_hessian(block, linears, subset, plan.order, hidden, calls, hess,
                                            before_batch=at_batch)
                release()
                solve(k, subset, hess, t0)
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
                                        {**opts, "normalize_tokens": config.normalize_tokens}, run_pass)
            release()
            moe_info["stages"] += 1
            moe_info["chunks"] += got.chunks
            moe_info["forwards"] += got.forwards
            share = (time.perf_counter() - t0) / len(stage.subsets)  # each expert's part of the passes
            for subset in stage.subsets:
                t0 = time.perf_counter() - share
                rep = subset[0]
                rtn = rep in got.rtn or got.hessians[rep].count == 0
                hess = got.hessians[rep] if got.hessians[rep].count else moe.NoTokens(
                    _in_features(linears[rep]), linears[rep].weight.device)
                source = got.sources[rep] if got.hessians[rep].count else "none: no calibration token reached it; rounded to nearest, errors on H = I"
                solve(k, subset, hess, t0, "rtn" if rtn else None)
                _mark(report, subset, source, opts["method"] != "rtn" and (rtn or "fallback" in source))
                k += 1
            del got
            release()
            memo.solved([n for s in stage.subsets for n in s])
        for name in starved:  # experts of a model's own ModuleList that no batch ever called
            solve(k, [name], moe.NoTokens(_in_features(linears[name]), linears[name].weight.device),
                  time.perf_counter(), "rtn")
            _mark(report, [name], "none: no calibration token reached it; rounded to nearest, errors on H = I",
                  opts["method"] != "rtn")
            k += 1
        if experts or starved:
            # Beyond the dense schedule (one pass per group, one for the outputs): discovery
            # forwards past the first batch, and one pass per expert stage chunk or fallback.
            moe_info["extra_forwards"] = extra + moe_info["forwards"] - moe_info["stages"]
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
            solve(k, subset, hess, t0)
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


def _solve_subset(
    linears: dict[str, nn.Module],
    subset: list[str],
    index: int,
    hess: LayerHessians,
    config: QuantConfig,
    method: str,
    report: Report,
    t0: float,
) -> None:
    mods = [linears[n] for n in subset]
    weights = [get_weight(m) for m in mods]
    if hess.count == 0 and method != "rtn":
        raise RuntimeError(f"no calibration tokens reached {subset[0]}")
    H = hess.matrix()
    # Rows of layers sharing an input share H, and GPTQ treats rows independently: one stacked
    # solve equals separate solves, with one factorisation instead of several.
    W = torch.cat(weights, dim=0)  # a copy: the modules are overwritten below
    try:
        sol = solver.gptq(W, H, config) if method == "gptq" else solver.rtn(W, config)
    except solver.FactorizationError as exc:
        names = ", ".join(subset)
        raise solver.FactorizationError(
            f"Hessian of {names} could not be factorised even with damping up to "
            f"{config.damp_max} ({exc}); raise damp/damp_max (--damp) or give more or more "
            "varied calibration tokens"
        ) from exc
    if sol.damp is not None and sol.damp > config.damp:
        log.warning("%s needed damping %.3g (asked %.3g)", ", ".join(subset), sol.damp, config.damp)
        for name in subset:
            report.fallbacks[name] = f"damping raised from {config.damp:g} to {sol.damp:g} to factorise H"
    seconds = time.perf_counter() - t0
    # Round-to-nearest is row-wise too: one call on the stacked rows serves every member.
    rtn_W = solver.rtn(W, config).weight if method == "gptq" else sol.weight
    objs = _row_objectives(W, sol.weight, H)
    rtn_objs = objs if method == "rtn" else _row_objectives(W, rtn_W, H)
    energy = _row_objectives(W, None, H)
    H_plain = hess.plain_matrix()
    if H_plain is None:  # tokens not normalised: the objective is the output error
        outs, rtn_outs = objs, rtn_objs
    else:
        outs = _row_objectives(W, sol.weight, H_plain)
        rtn_outs = outs if method == "rtn" else _row_objectives(W, rtn_W, H_plain)
        del H_plain
    calibration = hess.token_stats()
    row = 0
    for name, mod, w in zip(subset, mods, weights):
        n = w.shape[0]
        part = _rows(sol, row, row + n)
        obj, rtn_obj, e, out, rtn_out = (
            float(v[row : row + n].sum()) for v in (objs, rtn_objs, energy, outs, rtn_outs))
        row += n
        if method == "gptq":
            part.loss = obj
        report.layers[name] = LayerReport(
            name=name,
            shape=(int(w.shape[0]), int(w.shape[1])),
            tokens=hess.count,
            damp=sol.damp,
            objective=obj,
            rtn_objective=rtn_obj,
            relative_error=obj / e if e > 0 else 0.0,
            output_error=out,
            rtn_output_error=rtn_out,
            output_tokens=hess.plain_count,
            calibration=calibration,
            seconds=seconds * n / W.shape[0],
            subset=index,
        )
        set_weight(mod, part.weight)
        report.solutions[name] = part
        log.debug("%s: objective %.4g, rtn %.4g", name, obj, rtn_obj)
    # Under a caller's autocast, weights cast earlier (e.g. by the discovery forward) stay cached
    # until the autocast region ends: drop them, or later forwards would use the old weights.
    torch.clear_autocast_cache()


def _row_objectives(W: torch.Tensor, W_hat: torch.Tensor | None, H: torch.Tensor) -> torch.Tensor:
    """Per-row terms of ``optq.objective(W, W_hat, H)``: ½ δ_r H δ_rᵀ (δ = W - W_hat), float64."""
    out = torch.empty(W.shape[0], dtype=torch.float64, device=W.device)
    step = max(1, (1 << 20) // max(1, W.shape[1]))  # rows per chunk: temporaries of ~8 MB, not of W's size
    for lo in range(0, W.shape[0], step):
        hi = lo + step
        delta = W[lo:hi].to(H.dtype)
        if W_hat is not None:
            delta = delta - W_hat[lo:hi].to(H.dtype)
        out[lo:hi] = ((delta @ H) * delta).sum(dim=1, dtype=torch.float64)
    return out.mul_(0.5)


def _rows(sol: solver.Solution, lo: int, hi: int) -> solver.Solution:
    # Per-row fields are sliced; g_idx and perm belong to the shared columns.
    if lo == 0 and hi == sol.weight.shape[0]:
        return sol
    return solver.Solution(
        weight=sol.weight[lo:hi],  # replaced by a view of the module weight after the block
        codes=sol.codes[lo:hi].clone(),
        scales=sol.scales[lo:hi].clone(),
        zeros=sol.zeros[lo:hi].clone(),
        g_idx=sol.g_idx,
        perm=sol.perm,
        loss=sol.loss,
        damp=sol.damp,
        config=sol.config,
    )
