"""Mixture-of-experts blocks as stages: which groups of linears one pass can fill together.

A block's groups of linears (``capture.Schedule.subsets``) become *stages*. A dense group is a
stage of its own. The same group of every expert of one experts module (all experts' gate/up,
then all experts' down) is one stage: their inputs do not depend on one another, so one replay
of the block's calibration forward fills all their Hessians at once (``optq.pipeline.blocks.moe.collect``,
in chunks when they do not fit ``max_hessian_memory``), and they are solved together before the
next stage sees their quantized weights (``optq.pipeline.blocks.moe.block``). Where each expert's
Hessian comes from (``moe_calibration``, starved experts) is described in
``optq.pipeline.blocks.moe.collect``; docs/moe.md gives the measurements behind the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from optq.formats.experts import ExpertLinears
from optq.pipeline.blocks import capture
from optq.pipeline.discovery import expert_parts

__all__ = ["Stage", "plan_stages", "hessian_bytes"]


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


def plan_stages(block: nn.Module, prefix: str, schedule: capture.Schedule, targets: set[str]) -> list[Stage]:
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
    for subset in schedule.subsets:
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
                    add(
                        expert_stage(module_name, leaves_, known[module_name], leaves_ == tuple(layout.gate_up)),
                        e,
                        group,
                    )
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


def hessian_bytes(in_features: int, normalize_tokens: bool, itemsize: int = 4, cross: bool = False) -> int:
    """Memory of one group's Hessians (the solver's, the plain one when tokens are normalised,
    and GPTAQ's cross term with ``cross``)."""
    return in_features * in_features * itemsize * ((2 if normalize_tokens else 1) + cross)
