"""Solving one group of linears that share a Hessian, and spreading groups over ranks.

``solve_group`` stacks the group's rows (GPTQ treats rows independently and they share H: one
stacked solve equals separate solves, with one factorisation), writes the quantized weights back
and fills the report. ``solve_units`` does that for a stage's groups; under torch.distributed
each rank solves the linears :mod:`optq.pipeline.distributed.ranks` assigns it, and every rank
then takes the others' solutions (codes, scales, zeros, g_idx and perm broadcast as tensors from
the rank that solved each linear; the weight dequantized from them, exactly), so all ranks
continue with the same block.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from optq.core import solver
from optq.formats.linears import get_weight, set_weight
from optq.pipeline.blocks.work import BlockWork, SolveUnit
from optq.pipeline.methods import ROUNDING
from optq.pipeline.report import LayerReport

__all__ = ["solve_group", "solve_units"]

log = logging.getLogger("optq.pipeline")


def solve_units(work: BlockWork, units: Sequence[SolveUnit], first: int) -> None:
    """Seam 2, where Hessians are summed: the units' Hessians hold every rank's calibration
    tokens here. Solve each unit of ``work``'s block; unit ``u`` is the block's group number ``first + u``.
    The progress bar's postfix follows each subset once its weights are in, on every rank.

    With one process every unit is solved here, in order. Under torch.distributed each linear
    (its rows) is a work item, costed K³ / (members of its group) + rows x K², assigned by
    :meth:`Dist.assign`; a rank solves the members of each group it owns (on the group's H,
    which is the same on every rank after the all-reduce), then the report rows are gathered, each
    solution is broadcast from its rank as tensors, and both are applied everywhere, in the
    single-process order.
    """
    dist, report = work.run.dist, work.report
    if not dist.active:
        for u, unit in enumerate(units):
            started = time.perf_counter()
            solve_group(work, unit, first + u)
            dist.seconds["solve"] += time.perf_counter() - started
            _after(work, unit.subset)
        return
    items = [(u, name) for u, unit in enumerate(units) for name in unit.subset]

    def cost(u: int, name: str) -> float:
        N, K = get_weight(work.linears[name]).shape
        return float(K) ** 3 / len(units[u].subset) + float(N) * K * K

    owner = {n: r for (_, n), r in zip(items, dist.assign([cost(u, n) for u, n in items]))}
    mine = {n for n, r in owner.items() if r == dist.rank}
    started = time.perf_counter()
    with dist.failing_together():  # every rank reaches the check, or the others would hang
        for u, unit in enumerate(units):
            part = [n for n in unit.subset if n in mine]
            if part:
                solve_group(work, unit, first + u, part)
    dist.seconds["solve"] += time.perf_counter() - started
    # Report rows are small: one object gather. Solutions travel as tensors, one broadcast per
    # linear from the rank that solved it, in the same order on every rank.
    rows = {n: (report.layers.pop(n), report.fallbacks.pop(n, None), _header(report.solutions[n])) for n in mine}
    gathered = dist.gather(rows)
    for unit in units:
        for name in unit.subset:
            row, fallback, header = gathered[name]
            module = work.linears[name]
            sol = report.solutions.pop(name, None)
            sol = _exchange(dist, owner[name], sol, header, (get_weight(module), work.run.config_of(name)))
            if name not in mine:
                set_weight(module, sol.weight)
            report.layers[name] = row
            report.solutions[name] = sol
            if fallback is not None:
                report.fallbacks[name] = fallback
            report.solved_by[name] = owner[name]
        _after(work, unit.subset)
    torch.clear_autocast_cache()


def _after(work: BlockWork, subset: Sequence[str]) -> None:
    last = work.report.layers[subset[-1]]
    short = ".".join(subset[-1].split(".")[-2:])
    text = f"{short} obj/rtn={last.objective / last.rtn_objective:.3f}" if last.rtn_objective else short
    work.bar.set_postfix_str(text, refresh=False)


# A solution's tensors, sent as bytes; its weight is rebuilt from them (exactly: see Solution).
_FIELDS = ("codes", "scales", "zeros", "g_idx", "perm")


def _header(sol: solver.Solution) -> dict[str, Any]:
    """What a receiver needs besides the bytes: each tensor's shape and dtype, the loss and damping."""
    return {
        "tensors": [(tuple(getattr(sol, f).shape), getattr(sol, f).dtype) for f in _FIELDS],
        "loss": sol.loss,
        "damp": sol.damp,
    }


def _exchange(
    dist: Any, src: int, sol: solver.Solution | None, header: dict[str, Any], like: tuple[torch.Tensor, Any]
) -> solver.Solution:
    """Rank ``src``'s solution on every rank: codes, scales, zeros, g_idx and perm packed into one
    uint8 tensor and broadcast; a receiver dequantizes the weight (in ``like``'s dtype and device;
    ``like`` = (the module's weight, the run's QuantConfig))."""
    weight, config = like
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in header["tensors"]]
    if dist.rank == src:
        assert sol is not None
        parts = [getattr(sol, f).detach().contiguous().reshape(-1).view(torch.uint8) for f in _FIELDS]
        buf = torch.cat([p.to(dist.device()) for p in parts])
    else:
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=dist.device())
    dist.broadcast_(buf, src)
    if dist.rank == src:
        assert sol is not None
        return sol
    tensors, at = [], 0
    for (shape, dtype), n in zip(header["tensors"], sizes):
        # clone: a chunk's offset need not be aligned for the wider dtype
        tensors.append(buf[at : at + n].clone().view(dtype).reshape(shape).to(weight.device))
        at += n
    codes, scales, zeros, g_idx, perm = tensors
    out = solver.Solution(weight, codes, scales, zeros, g_idx, perm, header["loss"], header["damp"], config)
    out.weight = out.dequantize().to(weight.dtype)
    return out


def solve_group(work: BlockWork, unit: SolveUnit, index: int, members: Sequence[str] | None = None) -> None:
    """Solve ``members`` of ``unit`` (default: all of its subset) stacked, on the unit's Hessian;
    write their weights back and their rows into the report (``index``: the block's group
    number, for the report)."""
    subset = list(unit.subset if members is None else members)
    parts: dict[Any, list[str]] = {}  # members quantized with one config are solved stacked
    for name in subset:
        parts.setdefault(work.run.config_of(name), []).append(name)
    for config, names in parts.items():
        _solve_stack(work, unit, index, names, config)


def _solve_stack(work: BlockWork, unit: SolveUnit, index: int, subset: list[str], config: Any) -> None:
    hess, method, report = unit.hessian, unit.method, work.report
    if hess is None:  # a run from the weights alone (Run.weights_only): no H to measure errors on
        _from_weights(work, unit, index, subset, config)
        return
    mods = [work.linears[n] for n in subset]
    weights = [get_weight(m) for m in mods]
    if hess.count == 0 and method.reads_hessian:
        raise RuntimeError(f"no calibration tokens reached {subset[0]}")
    H = hess.matrix()
    # Rows of layers sharing an input share H, and GPTQ treats rows independently: one stacked
    # solve equals separate solves, with one factorisation instead of several.
    W = torch.cat(weights, dim=0)  # a copy: the modules are overwritten below
    try:  # W_ref: what the objectives measure Ŵ against (for GPTAQ, its least-squares floor W*)
        sol, W_ref = method.solve(W, H, hess, config, work.run.settings)
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
    seconds = time.perf_counter() - unit.started
    # Round-to-nearest is row-wise too: one call on the stacked rows serves every member.
    rounding = method is ROUNDING  # the report's round-to-nearest columns are then the solution's
    rtn_W = sol.weight if rounding else solver.rtn(W, config).weight
    objs = _row_objectives(W_ref, sol.weight, H)
    rtn_objs = objs if rounding else _row_objectives(W_ref, rtn_W, H)
    energy = _row_objectives(W_ref, None, H)
    del W_ref
    H_plain = hess.plain_matrix()
    if H_plain is None:  # tokens not normalised: the objective is the output error
        outs, rtn_outs = objs, rtn_objs
    else:
        outs = _row_objectives(W, sol.weight, H_plain)
        rtn_outs = outs if rounding else _row_objectives(W, rtn_W, H_plain)
        del H_plain
    calibration = hess.token_stats()
    row = 0
    for name, mod, w in zip(subset, mods, weights):
        n = w.shape[0]
        part = _rows(sol, row, row + n)
        obj, rtn_obj, e, out, rtn_out = (
            float(v[row : row + n].sum()) for v in (objs, rtn_objs, energy, outs, rtn_outs)
        )
        row += n
        if method.reads_hessian:
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


def _from_weights(work: BlockWork, unit: SolveUnit, index: int, subset: list[str], config: Any) -> None:
    """Quantize ``subset`` with a method that reads no Hessian, with no calibration token: the
    report's rows hold no token count and null errors (``Report.unmeasured`` says why)."""
    mods = [work.linears[n] for n in subset]
    weights = [get_weight(m) for m in mods]
    W = torch.cat(weights, dim=0)
    sol, _ = unit.method.solve(W, None, None, config, work.run.settings)
    seconds = time.perf_counter() - unit.started
    row = 0
    for name, mod, w in zip(subset, mods, weights):
        n = w.shape[0]
        part = _rows(sol, row, row + n)
        row += n
        work.report.layers[name] = LayerReport(
            name=name,
            shape=(int(w.shape[0]), int(w.shape[1])),
            tokens=None,
            damp=sol.damp,
            objective=None,
            rtn_objective=None,
            relative_error=None,
            seconds=seconds * n / W.shape[0],
            subset=index,
        )
        set_weight(mod, part.weight)
        work.report.solutions[name] = part
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
