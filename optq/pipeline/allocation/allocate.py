"""``target_bits`` (``--target-bits B``): each linear's bits and group size under a budget of B
stored bits per quantized weight (codes, scales, zero points and g_idx counted, bias not).

1. Candidates per layer: bits 2, 3, 4, 8 with group sizes 32, 64, 128 dividing the input width,
   and per channel, those every engine of ``serve`` runs (``options``); layers vLLM fuses (q/k/v,
   gate/up) form one unit with one setting.
2. Sensitivity (``passes.measure``): the float model block by block on most of the calibration
   batches; each layer's objective ½ tr(Δ H Δᵀ) at every candidate setting, Δ being what the
   run's method leaves: GPTQ's solution on the float model's H (GPTQ and GPTAQ runs; GPTAQ's own
   result needs the quantized model's inputs, which depend on the allocation), or rounding
   (``method="rtn"``).
   In the same pass, each block's gain: the KL at the model's output when only that block is
   quantized (every layer at its base setting: the widest bits within the budget, the finest
   group), on the first sensitivity batch carried to the end once per block. Layer objectives
   measure errors at each layer's output; the gains say what errors cost where they are made
   (SmolLM2's first and last blocks cost most). The streams take one batch per block; past
   ``max_hessian_memory`` they are measured in several passes over the model, to the same gains.
3. Candidate allocations: the exact-size knapsack (``knapsack.solve``) under three error
   weightings (the objective; the objective relative to ½ tr(W H Wᵀ); their geometric mean),
   each alone and with every layer's weighted error scaled so that its block sums to the block's
   gain (``+blocks``); the fixed heuristics (uniform 3 and 4 bits; first and last blocks at 4;
   attention at 4 and MLP at 3; down projections at 4), each at the finest common group size
   that fits; and each heuristic with the budget it leaves spent by the knapsack, no layer
   stored below the heuristic's setting (``+fill``). Allocations some named engine refuses as a
   whole model (``schemes.resolve``) are dropped.
4. Summed layer errors do not predict the model's loss (EvoPress, Sieberling et al. 2024), so
   the allocations are compared by their effect on the output (``passes.divergence``): mean
   KL(float || quantized model) per token on the calibration batches held out of step 2 (the
   last quarter; with one batch, that batch), each candidate's layers quantized as in step 2.
   The proxy stands in for the run: GPTQ on float inputs for GPTAQ, which corrects for the
   quantized inputs too, and it misranks close candidates; so the ``target_check`` with the
   lowest proxy KL are quantized as the run does (``recheck``) and scored again on the same
   windows. The lowest KL of the last comparison wins.

The result is JSON (the report's ``allocation``; the streaming journal keeps it, so a resumed run
quantizes with the same settings) and becomes per-layer schemes through :func:`apply`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from optq.formats.linears import get_weight
from optq.pipeline.allocation import knapsack, recheck
from optq.pipeline.allocation.options import (
    GROUPS,
    Setting,
    heuristics,
    layer_settings,
    overrides,
    stored_bits,
    units_of,
)
from optq.pipeline.allocation.passes import Gains, Streams, divergence, measure
from optq.pipeline.blocks.capture import Call
from optq.pipeline.blocks.prepare import Run
from optq.pipeline.methods import Method
from optq.pipeline.schemes import LayerSchemes, resolve

__all__ = ["plan", "apply", "head_logits", "WEIGHTINGS"]

WEIGHTINGS = ("objective", "relative", "geometric")
_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")


def head_logits(model: nn.Module, blocks_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Final hidden states -> logits: the model's final norm (and projection) and head."""
    parent = model.get_submodule(blocks_name.rpartition(".")[0]) if "." in blocks_name else model
    norm = next((getattr(parent, a) for a in _NORMS if isinstance(getattr(parent, a, None), nn.Module)), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if norm is None or head is None:
        raise ValueError(
            f"target_bits compares allocations by the model's output, but optq finds no final norm "
            f"({'/'.join(_NORMS)} beside {blocks_name}) or output head in {type(model).__name__}; "
            "quantize it with fixed settings (--bits, --override) instead"
        )
    project = getattr(parent, "project_out", None)
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    def logits(h: torch.Tensor) -> torch.Tensor:
        x = norm(h)
        if isinstance(project, nn.Module):
            x = project(x)
        y = head(x.to(get_weight(head).dtype))
        return cap * torch.tanh(y / cap) if cap else y

    return logits


def _check(run: Run) -> None:
    if run.dist.world_size > 1:
        raise ValueError(
            "target_bits runs in a single process for now; run it without torchrun (the allocation "
            "is chosen before any block is quantized), or give fixed settings (--override) per layer"
        )
    if any(".experts." in n for n in run.targets):
        raise ValueError(
            "target_bits does not allocate mixture-of-experts layers yet; quantize this model with fixed "
            "settings (--bits, --group-size, --override)"
        )


def _split(n: int) -> tuple[list[int], list[int]]:
    """Batch indices for the Hessians and for the KL check (held out, the last quarter)."""
    if n < 2:
        return [0], [0]
    held = max(1, n // 4)
    return list(range(n - held)), list(range(n - held, n))


def plan(
    run: Run, model: nn.Module, source: Any, activations: tuple[list[torch.Tensor], list[list[Call]]]
) -> tuple[dict[str, Any], LayerSchemes]:
    """Choose every target's (bits, group size) under ``run.settings.target_bits``; returns the
    report's ``allocation`` and the chosen per-layer schemes (resolved once, for :func:`apply`).
    ``source`` loads and releases blocks (the run's block source); ``activations``: the hidden
    states entering block 0 per batch and every block's calls (left as they are). Raises
    ValueError before any weight changes when no allocation fits."""
    _check(run)
    start = time.perf_counter()
    s, target = run.settings, run.settings.target_bits
    names = sorted(run.targets)
    shapes = {n: tuple(get_weight(run.linears[n]).shape) for n in names}
    options = {n: layer_settings(shapes[n], run.config_of(n), s.serve, s.format) for n in names}
    units = units_of(names)
    unit_options = {u[0]: [o for o in options[u[0]] if all(o in options[m] for m in u)] for u in units}
    for u in units:
        if not unit_options[u[0]]:
            raise ValueError(f"target_bits: no setting of {', '.join(u)} suits {','.join(s.serve)}")
    sizes = {(n, o): stored_bits(shapes[n], o, run.config_of(n), s.format) for n in names for o in options[n]}
    weights = sum(shapes[n][0] * shapes[n][1] for n in names)
    budget = target * weights
    low = sum(min(sum(sizes[(m, o)] for m in u) for o in unit_options[u[0]]) for u in units) / weights
    high = sum(max(sum(sizes[(m, o)] for m in u) for o in unit_options[u[0]]) for u in units) / weights
    if budget < low * weights:
        served = f" for {','.join(s.serve)}" if s.serve else ""
        raise ValueError(
            f"target_bits={target:g} is below the smallest allocation{served}: {low:.3f} stored bits per weight "
            f"(achievable: {low:.3f} to {high:.3f}); raise it"
            + (", or name fewer engines (--serve)" if s.serve else "")
        )
    hidden, calls = activations
    fit, held = _split(len(hidden))
    ids = run.batches
    solve = _solve(run)
    logits = head_logits(model, run.blocks_name)
    base = _base(units, unit_options, target)
    gains = Gains(_streams(hidden, calls, ids, fit[:1]), base, logits)  # not the KL check's windows
    stream = sum(h.numel() * h.element_size() for h in gains.streams.hidden)
    gains.per_pass = max(1, s.hessian_budget // stream) if stream else None  # passes, not results
    errors, energy, block_kl = measure(run, source, _streams(hidden, calls, ids, fit), options, solve, gains)
    factors = {}  # per weighting; none without block gains
    if block_kl:
        factors = {k: _block_factors(run, names, (k, errors, energy), base, block_kl) for k in WEIGHTINGS}
    candidates = _candidates(names, units, unit_options, (errors, energy, factors), sizes, budget)
    refused, resolved = {}, {}
    for key, allocation in list(candidates.items()):
        try:
            resolved[key] = resolve(run.linears, names, run.config, overrides(allocation), serve=s.serve, fmt=s.format)
        except ValueError as exc:
            refused[key] = str(exc).splitlines()[0]
            del candidates[key]
    if not candidates:
        raise ValueError(
            f"target_bits={target:g}: every allocation checked is refused by the engines named ({','.join(s.serve)}): "
            + "; ".join(f"{k}: {why}" for k, why in list(refused.items())[:3])
            + ". Name only the engines you serve with (--serve), or use --format compressed-tensors"
        )
    kl = divergence(
        run,
        source,
        _streams(hidden, calls, ids, held),
        candidates,
        logits,
        solve=solve,
        fit=_streams(hidden, calls, ids, fit) if solve.reads_hessian else None,
    )
    ranked = sorted(candidates, key=lambda k: (kl[k], list(candidates).index(k)))
    streams = (_streams(hidden, calls, ids, fit), _streams(hidden, calls, ids, held))
    check, run_kl = recheck.choose(run, source, streams, [(k, resolved[k]) for k in ranked], logits)
    chosen = min(run_kl, key=lambda k: (run_kl[k], ranked.index(k))) if run_kl else ranked[0]
    outcome = (candidates, kl, run_kl, refused, chosen, (base, block_kl), check)
    return _result(run, outcome, sizes, energy, errors, (fit, held, start)), resolved[chosen]


def _solve(run: Run) -> Method:
    """How the proxy quantizes a layer: the run's method's proxy (itself; GPTQ for GPTAQ)."""
    return run.settings.method_object.proxy


def _streams(hidden: Sequence[torch.Tensor], calls: Sequence[Sequence[Call]], ids, which: list[int]) -> Streams:
    return Streams([hidden[b] for b in which], [[c[b] for b in which] for c in calls], [ids[b] for b in which])


def _weighted(kind: str, err: float, energy: float) -> float:
    if kind == "objective":
        return err
    scale = energy if kind == "relative" else math.sqrt(energy)
    return err / scale if scale > 0 else err


def _base(units, unit_options, target: float) -> dict[str, Setting]:
    """Each layer's setting for the block gains: the widest bits not above the budget (the
    narrowest the unit takes if none) at the finest group size the unit takes there."""
    out = {}
    for u in units:
        opts = unit_options[u[0]]
        fits = [b for b, _ in opts if b <= target]
        bits = max(fits) if fits else min(b for b, _ in opts)
        setting = min((o for o in opts if o[0] == bits), key=lambda o: _ORDER[o[1]])
        out.update({m: setting for m in u})
    return out


def _block_factors(run: Run, names, measured, base, block_kl: Mapping[int, float]) -> dict[str, float]:
    """Each layer's factor turning its weighted objective into its share of its block's KL: the
    block's KL (only that block quantized at ``base``) over the block's summed weighted objective
    at ``base``. Layer objectives measure errors at each layer's output; the block's KL says what
    such errors cost at the model's output there (the first and last blocks' cost more)."""
    kind, errors, energy = measured
    out = {}
    for i in range(len(run.blocks)):
        members = [n for n in names if n.startswith(run.block_name(i) + ".")]
        total = sum(_weighted(kind, errors[n][base[n]], energy[n]) for n in members)
        for n in members:
            out[n] = block_kl[i] / total if i in block_kl and total > 0 else 1.0
    return out


def _candidates(names, units, unit_options, measured, sizes, budget) -> dict[str, dict[str, Setting]]:
    """The allocations to compare, by name, identical ones once (the first name kept): the
    knapsack under each weighting, alone and scaled by each layer's block factor (``+blocks``);
    each heuristic with the budget it leaves spent by the knapsack (geometric weighting, with the
    block factors), no layer below the heuristic's setting (``+fill``); the heuristics."""
    errors, energy, factors = measured

    def cost(kind: str, scaled: bool):
        factor = factors[kind] if scaled else dict.fromkeys(names, 1.0)
        return lambda m, o: _weighted(kind, errors[m][o], energy[m]) * factor[m]

    out: dict[str, dict[str, Setting]] = {}
    for scaled in (True, False) if factors else (False,):
        for kind in WEIGHTINGS:
            allocation = _knapsack(units, [unit_options[u[0]] for u in units], sizes, cost(kind, scaled), budget)
            if allocation is not None:
                _add(out, f"knapsack-{kind}" + ("+blocks" if scaled else ""), allocation)
    fixed = {}
    for key, bits in heuristics(names).items():
        for group in GROUPS:  # the finest that fits: the most accurate at this size
            allocation = _with_group(units, unit_options, bits, group)
            if allocation is not None and sum(sizes[(n, o)] for n, o in allocation.items()) <= budget:
                fixed[f"{key}-g{group}"] = allocation
                break
    for key, allocation in fixed.items():  # each heuristic, its unused budget spent by the knapsack
        kept = [[o for o in unit_options[u[0]] if _dominates(o, allocation[u[0]])] for u in units]
        filled = _knapsack(units, kept, sizes, cost("geometric", bool(factors)), budget)
        if filled is not None:
            _add(out, f"{key}+fill", filled)
    for key, allocation in fixed.items():
        _add(out, key, allocation)
    return out


def _knapsack(units, options, sizes, cost, budget) -> dict[str, Setting] | None:
    """The least-cost choice of one of ``options[k]`` per unit within ``budget`` (None: none fits);
    ``cost(layer, setting)``."""
    table = [
        [(sum(sizes[(m, o)] for m in u), sum(cost(m, o) for m in u)) for o in opts] for u, opts in zip(units, options)
    ]
    choice = knapsack.solve(table, budget)
    if choice is None:
        return None
    return {m: opts[j] for u, opts, j in zip(units, options, choice) for m in u}


_ORDER = {g: k for k, g in enumerate(GROUPS)}  # finest group first


def _dominates(option: Setting, floor: Setting) -> bool:
    """At least ``floor``'s bits and a group at least as fine: never less accurate storage."""
    return option[0] >= floor[0] and _ORDER[option[1]] <= _ORDER[floor[1]]


def _add(out: dict[str, dict[str, Setting]], key: str, allocation: dict[str, Setting]) -> None:
    if all(allocation != other for other in out.values()):
        out[key] = allocation


def _with_group(units, unit_options, bits: Mapping[str, int], group: int) -> dict[str, Setting] | None:
    """Each unit at its bits and ``group``, else the next coarser group it takes (None: none)."""
    out = {}
    for u in units:
        b = bits[u[0]]
        found = next((g for g in GROUPS[GROUPS.index(group) :] if (b, g) in unit_options[u[0]]), None)
        if found is None:
            return None
        out.update({m: (b, found) for m in u})
    return out


def _result(run: Run, outcome, sizes, energy, errors, when) -> dict[str, Any]:
    candidates, kl, run_kl, refused, chosen, (base, block_kl), check = outcome
    fit, held, start = when
    names = sorted(run.targets)
    weights = {n: math.prod(get_weight(run.linears[n]).shape) for n in names}
    total = sum(weights.values())

    def bpw(allocation: Mapping[str, Setting]) -> float:
        return sum(sizes[(n, o)] for n, o in allocation.items()) / total

    windows = sum(int(run.batches[b].shape[0]) for b in held)
    best = candidates[chosen]
    proxy = _solve(run).proxy_text
    why = f"target-bits {run.settings.target_bits:g}: allocation {chosen}, the lowest KL to the float model "
    if run_kl:
        why += (
            f"({run_kl[chosen]:.4g} per token on {windows} held-out windows) quantized as the run does "
            f"({run.settings.method}) of the {len(run_kl)} with the lowest KL by the proxy ({proxy}) "
        )
    else:
        why += f"({kl[chosen]:.4g} per token, {proxy}, {windows} held-out windows) "
    why += f"of {len(candidates)} checked"
    layers = {}
    for n in names:
        b, g = best[n]
        rel = errors[n][best[n]] / energy[n] if energy[n] > 0 else None
        layers[n] = {
            "bits": b,
            "group_size": g,
            "bits_per_weight": sizes[(n, best[n])] / weights[n],
            "relative_error": rel,
            "why": f"{why}; {b}-bit, group {g}" + ("" if rel is None else f", its relative error {rel:.3g}"),
        }
    return {
        "target_bits": run.settings.target_bits,
        "bits_per_weight": bpw(best),
        "chosen": chosen,
        "proxy": f"mean KL(float || quantized model) per token on held-out calibration windows, {proxy}",
        "windows": {"sensitivity_batches": fit, "kl_batches": held, "kl_windows": windows},
        "gains": {  # each block's KL with only that block quantized, every layer at its base setting
            "batches": fit[:1] if block_kl else [],
            "skipped": None if block_kl else "no blocks",
            "base": {n: list(base[n]) for n in names},
            "block_kl": [block_kl.get(i) for i in range(len(run.blocks))],
        },
        "check": check,  # the best candidates by the proxy, quantized as the run does (their run_kl)
        "candidates": {
            **{
                k: {"bits_per_weight": bpw(a), "kl": kl[k], **({"run_kl": run_kl[k]} if k in run_kl else {})}
                for k, a in candidates.items()
            },
            **{k: {"refused": why_not} for k, why_not in refused.items()},
        },
        "layers": layers,
        "seconds": time.perf_counter() - start,
    }


def apply(run: Run, allocation: Mapping[str, Any], report: Any = None, schemes: LayerSchemes | None = None) -> None:
    """Make ``allocation`` (:func:`plan`'s result) the run's per-layer schemes, each layer's
    reason saying why; and ``report``'s ``allocation`` and ``schemes``. ``schemes``: the
    allocation's, as :func:`plan` resolved them; resolved here when not given (a resumed run)."""
    s = run.settings
    if schemes is None:
        chosen = {n: (row["bits"], row["group_size"]) for n, row in allocation["layers"].items()}
        schemes = resolve(run.linears, sorted(run.targets), run.config, overrides(chosen), serve=s.serve, fmt=s.format)
    for n, row in allocation["layers"].items():
        schemes.why[n] = row["why"]
    schemes.notes.append(
        f"target-bits {allocation['target_bits']:g}: {allocation['bits_per_weight']:.3f} stored bits per weight, "
        f"allocation {allocation['chosen']}"
    )
    run.schemes = schemes
    if report is not None:
        report.allocation = dict(allocation)
        report.schemes = schemes.to_dict()
