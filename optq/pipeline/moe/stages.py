"""Mixture-of-experts blocks: every expert's Hessian from its own tokens, in shared passes under a
memory budget, with a stated policy for experts the calibration data starves.

A block's groups of linears (``capture.Plan.subsets``) become *stages*. A dense group is a stage
of its own, as before. The same group of every expert of one experts module (all experts'
gate/up, then all experts' down) is one stage: their inputs do not depend on one another, so
one replay of the block's calibration forward fills all their Hessians at once, and they are
solved together before the next stage sees their quantized weights. When the stage's Hessians
do not fit ``max_hessian_memory`` they are collected in chunks, one forward each: those extra
forwards are counted and reported.

Where an expert's Hessian comes from (``moe_calibration``):

- ``all`` (default): every calibration token passes through every expert, for the Hessians
  only (the block's output keeps the true routing). All experts' gate/up then share one H (the
  block's MoE input), collected once. Chosen by measurement (docs/moe.md): on a random
  Mixtral-shaped model it beat ``routed`` on every expert's held-out error and on the output
  KL divergence, at about 1.45 times the CPU time of routed-only calibration (top-2 of 8).
- ``routed``: the tokens the router sends to it, as in the model's own forward. An
  expert routed fewer than ``moe_min_tokens`` tokens (default: its input width, below which H
  is singular) is *starved*: its H would describe a handful of tokens. For experts optq runs
  itself (:class:`optq.formats.experts.ExpertLinears`, every transformers MoE) it then gets the
  ``all`` Hessian above, from one more forward; for experts in a model's own ``nn.ModuleList``
  (custom code, whose routing optq cannot replay) it is rounded to nearest. Either way the report says so, by name. Experts of a model's own
  ``nn.ModuleList`` are always calibrated this way: optq cannot make custom code run every token.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from optq.formats.experts import ExpertLinears
from optq.pipeline.blocks import capture
from optq.pipeline.distributed.ranks import Dist
from optq.pipeline.blocks.hessians import LayerHessians

__all__ = ["Stage", "plan_stages", "collect_stage", "MOE_CALIBRATION",
           "default_hessian_budget", "expert_parts", "NoTokens", "MOE_WEIGHTING", "siblings"]

log = logging.getLogger("optq.pipeline")

MOE_CALIBRATION = ("routed", "all")
MOE_WEIGHTING = ("none", "routing")
_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>.+)$")


def default_hessian_budget() -> int:
    """A quarter of this machine's physical memory, in bytes."""
    try:
        import os

        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


@dataclass
class Stage:
    """Groups of linears whose Hessians one pass can fill together (see the module docstring).

    ``subsets``: the groups, each solved on its own H; ``module``: the experts module of an
    expert stage (``ExpertLinears`` or a model's ``nn.ModuleList``), else None; ``experts``: the
    expert number of each subset; ``first``: True for the experts' input group (gate/up), whose
    inputs are all the MoE input itself.
    """

    subsets: list[list[str]]
    module: nn.Module | None = None
    experts: list[int] = field(default_factory=list)
    first: bool = False


def expert_parts(name: str) -> tuple[str, int, str] | None:
    m = _EXPERT.match(name)
    return (m["module"], int(m["e"]), m["leaf"]) if m else None


def siblings(names: Iterable[str], name: str) -> list[str]:
    """The same matrix of every expert of ``name``'s experts module (``name`` included)."""
    parts = expert_parts(name)
    assert parts is not None
    return [n for n in names if (p := expert_parts(n)) and p[0] == parts[0] and p[2] == parts[2]]


def plan_stages(block: nn.Module, prefix: str, plan: capture.Plan, targets: set[str]) -> list[Stage]:
    """The block's stages, in the order their inputs are first used (see the module docstring).

    Groups of ``ExpertLinears`` experts are known from their layout, so experts no calibration
    batch routed a token to are planned as well; the experts of one stage are in increasing
    order, so the plan does not depend on which batch reached an expert first.
    """
    known: dict[str, ExpertLinears] = {}
    for name, mod in block.named_modules():
        if isinstance(mod, ExpertLinears):
            known[f"{prefix}.{name}" if name else prefix] = mod
    stages: list[Stage] = []
    by_key: dict[tuple[str, tuple[str, ...]], Stage] = {}

    def expert_stage(module_name: str, leaves: tuple[str, ...], module: nn.Module, first: bool) -> Stage:
        key = (module_name, leaves)
        if key not in by_key:
            by_key[key] = Stage([], module, [], first)
            stages.append(by_key[key])
        return by_key[key]

    def add(stage: Stage, e: int, subset: list[str]) -> None:
        if e not in stage.experts:
            stage.experts.append(e)
            stage.subsets.append(subset)

    roles_seen: dict[str, list[tuple[str, ...]]] = {}
    for subset in plan.subsets:
        parts = [expert_parts(n) for n in subset]
        if any(p is None for p in parts) or len({(p[0], p[1]) for p in parts if p}) != 1:
            stages.append(Stage([subset]))
            continue
        module_name, e = parts[0][0], parts[0][1]  # type: ignore[index]
        leaves = tuple(p[2] for p in parts if p)
        if module_name in known:
            # The layout fixes the groups; a subset from discovery is one of them.
            layout = known[module_name].layout
            for leaves_ in (tuple(layout.gate_up), (layout.down,)):
                group = [f"{module_name}.{e}.{leaf}" for leaf in leaves_ if f"{module_name}.{e}.{leaf}" in targets]
                if group:
                    add(expert_stage(module_name, leaves_, known[module_name], leaves_ == tuple(layout.gate_up)), e, group)
            continue
        module = block.get_submodule(module_name[len(prefix) + 1 :])
        seen = roles_seen.setdefault(module_name, [])
        if leaves not in seen:
            seen.append(leaves)
        add(expert_stage(module_name, leaves, module, seen.index(leaves) == 0), e, subset)
    for module_name, mod in known.items():  # experts the calibration data never reached
        layout = mod.layout
        for leaves_ in (tuple(layout.gate_up), (layout.down,)):
            for e in range(mod.num_experts):
                group = [f"{module_name}.{e}.{leaf}" for leaf in leaves_ if f"{module_name}.{e}.{leaf}" in targets]
                if group:
                    add(expert_stage(module_name, leaves_, mod, leaves_ == tuple(layout.gate_up)), e, group)
    for stage in stages:
        if stage.module is not None:
            pairs = sorted(zip(stage.experts, stage.subsets))
            stage.experts = [e for e, _ in pairs]
            stage.subsets = [s for _, s in pairs]
    return stages


def hessian_bytes(in_features: int, normalize_tokens: bool, itemsize: int = 4) -> int:
    """Memory of one group's Hessians (the solver's, and the plain one when tokens are normalised)."""
    return in_features * in_features * itemsize * (2 if normalize_tokens else 1)


@dataclass
class Collected:
    """What :func:`collect_stage` gathered: a Hessian per subset (by its first member), where
    each came from, the forwards and chunks it took, and the subsets to round to nearest."""

    hessians: dict[str, LayerHessians]
    sources: dict[str, str]
    forwards: int
    chunks: int
    rtn: set[str] = field(default_factory=set)
    weighting: str = "none"
    dist: Dist = field(default_factory=Dist)


def collect_stage(
    block: nn.Module,
    linears: dict[str, nn.Module],
    stage: Stage,
    new_hessian: Callable[[list[str]], LayerHessians],
    in_features: int,
    opts: dict,
    run_pass: Callable[[Callable[[int], None]], None],
    dist: Dist | None = None,
) -> Collected:
    """Fill the Hessians of an expert stage's subsets (see the module docstring).

    ``run_pass(hooks_installed)`` runs one replay pass over every calibration batch (the caller
    wraps it in its memo); this function installs the hooks and sets which experts see every
    token. Chunks keep the stage's Hessians within ``opts["max_hessian_memory"]`` bytes.
    """
    mode = opts.get("moe_calibration", "all")
    min_tokens = in_features if opts.get("moe_min_tokens") is None else opts["moe_min_tokens"]
    budget = opts.get("max_hessian_memory") or default_hessian_budget()
    normalize = bool(opts.get("normalize_tokens", True))
    ours = isinstance(stage.module, ExpertLinears)
    per = hessian_bytes(in_features, normalize, 8 if opts.get("hessian_dtype") == "float64" else 4)
    size = max(1, budget // per)
    out = Collected({}, {}, 0, 0, weighting=opts.get("moe_weighting", "none"), dist=dist or Dist())
    shared = ours and mode == "all" and stage.first
    if shared:
        # Every expert's gate/up input is the MoE input itself: one H serves them all.
        chunks = [list(range(len(stage.subsets)))]
    else:
        idx = list(range(len(stage.subsets)))
        chunks = [idx[i : i + size] for i in range(0, len(idx), size)]
    for chunk in chunks:
        out.chunks += 1
        if mode == "all" and ours:
            _pass(block, linears, stage, chunk, new_hessian, out, run_pass, shared=shared, source="all")
            continue
        source = "routed, weighted by routing weight²" if out.weighting == "routing" and ours else "routed"
        if mode == "all" and not ours:
            source = "routed (all tokens need transformers' experts; this is the model's own expert code)"
        _pass(block, linears, stage, chunk, new_hessian, out, run_pass, shared=False, source=source, routed=True)
        starved = [k for k in chunk if out.hessians[stage.subsets[k][0]].count < min_tokens]
        if not starved:
            continue
        for k in starved:
            rep = stage.subsets[k][0]
            n = out.hessians[rep].count
            if ours:
                del out.hessians[rep]  # freed before the fallback pass allocates
                out.sources[rep] = f"all (fallback: {n} routed tokens < {min_tokens})"
            else:  # errors are still measured on the few routed tokens there are
                out.rtn.add(rep)
                out.sources[rep] = (f"routed, {n} tokens < {min_tokens}: rounded to nearest (the "
                                    "model's own expert code cannot be replayed with all tokens)")
        if ours:
            _pass(block, linears, stage, starved, new_hessian, out, run_pass, shared=stage.first,
                  source=None)
    return out


def _pass(block: nn.Module, linears: dict[str, nn.Module], stage: Stage, chunk: list[int],
          new_hessian: Callable[[list[str]], LayerHessians], out: Collected,
          run_pass: Callable[[Callable[[int], None]], None], *, shared: bool, source: str | None,
          routed: bool = False) -> None:
    subsets = [stage.subsets[k] for k in chunk]
    experts = [stage.experts[k] for k in chunk]
    if shared:
        one = new_hessian(subsets[0])
        hooked = {subsets[0][0]: one}
        for s in subsets:
            out.hessians[s[0]] = one
        everyone = frozenset(experts[:1])  # one expert runs every token: its input is the MoE input
    else:
        hooked = {s[0]: new_hessian(s) for s in subsets}
        out.hessians.update(hooked)
        everyone = frozenset() if routed else frozenset(experts)
    if source is not None:
        for s in subsets:
            out.sources[s[0]] = source
    handles = []
    module = stage.module
    weigh = routed and isinstance(module, ExpertLinears) and out.weighting == "routing"

    def hook(hess: LayerHessians) -> Callable:
        def pre(_m: nn.Module, args: tuple) -> None:
            w = module.routing_weight if weigh else None  # type: ignore[union-attr]
            # The expert's output is scaled by w, so its output error by w²: weigh tokens so.
            hess.update(args[0], None if w is None else w.square())

        return pre

    for rep, hess in hooked.items():
        handles.append(linears[rep].register_forward_pre_hook(hook(hess)))
    error = None
    try:
        if isinstance(module, ExpertLinears):
            module.calibrate_all = everyone
        run_pass(lambda b: None)
        out.forwards += 1
    except Exception as exc:  # every rank must reach the check, or the others would hang
        error = exc
    finally:
        if isinstance(module, ExpertLinears):
            module.calibrate_all = frozenset()
        for h in handles:
            h.remove()
    out.dist.check(error)
    for hess in hooked.values():  # seam 2: every rank's tokens, before the starved test and solves
        out.dist.reduce_hessian(hess)


class NoTokens:
    """Stands in for the Hessian of a layer no calibration token reached (rounded to nearest):
    its errors are measured on H = I, the weights' own squared error."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.in_features, self.device = in_features, device
        self.count = self.plain_count = 0

    def matrix(self) -> torch.Tensor:
        return torch.eye(self.in_features, device=self.device)

    def plain_matrix(self) -> None:
        return None

    def token_stats(self) -> dict:
        from optq.pipeline.blocks.hessians import token_energy_stats

        return token_energy_stats(torch.zeros(0))
