"""Filling an expert stage's Hessians: shared passes, chunks under the memory budget, starved experts.

Where an expert's Hessian comes from (``RunSettings.moe_calibration``; docs/moe.md):

- ``all`` (default): every calibration token passes through every expert, for the Hessians
  only (the block's output keeps the true routing). All experts' gate/up then share one H (the
  block's MoE input), collected once.
- ``routed``: the tokens the router sends to it. An expert routed fewer than ``moe_min_tokens``
  tokens (default: its input width, below which H is singular) is *starved*: for experts optq
  runs itself (:class:`optq.formats.experts.ExpertLinears`, every transformers MoE) it then gets
  the ``all`` Hessian, from one more forward; for experts in a model's own ``nn.ModuleList``
  (custom code, whose routing optq cannot replay) it is rounded to nearest. Either way the
  report says so, by name.

``ExpertLinears`` holds weights only; the calibration state (which experts run every token, the
routing weight of the tokens an expert is running) lives here, in the forward that
:func:`calibrating` swaps in for the length of a pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from optq.formats.experts import ExpertLinears
from optq.pipeline.blocks.hessians import LayerHessians
from optq.pipeline.blocks.memo import Memo
from optq.pipeline.blocks.moe.stages import Stage, hessian_bytes
from optq.pipeline.blocks.twin import pairing
from optq.pipeline.blocks.work import BlockWork, in_features

__all__ = ["Collected", "collect_stage", "calibrating", "Routing", "NoTokens"]


@dataclass
class Collected:
    """What :func:`collect_stage` gathered: a Hessian per subset (by its first member), where
    each came from, the forwards and chunks it took, and the subsets to round to nearest."""

    hessians: dict[str, LayerHessians]
    sources: dict[str, str]
    forwards: int = 0
    chunks: int = 0
    rtn: set[str] = field(default_factory=set)


@dataclass
class Routing:
    """The routing weight of each token an expert is running in the current call (None when it
    runs every token); the calibrating forward sets it, the Hessian hooks read it."""

    weight: torch.Tensor | None = None


@contextlib.contextmanager
def calibrating(module: ExpertLinears, everyone: frozenset[int], routing: Routing) -> Iterator[None]:
    """``module`` computes its usual output, but experts in ``everyone`` run every token (keeping
    the routed rows of the result), so their linears see the whole MoE input; ``routing.weight``
    holds the routing weights of the tokens an expert runs while it runs them."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, route in enumerate(module.routes(top_k_index, top_k_weights)):
            if e in everyone:
                if route is None:  # no token routed here: the expert still sees them all
                    idx = torch.empty(0, dtype=torch.long, device=hidden_states.device)
                    w = top_k_weights.new_empty(0, 1)
                else:
                    _, idx, w = route
                routing.weight = None
                y = module.expert(e, hidden_states)[idx]
            elif route is None:
                continue
            else:
                _, idx, w = route
                routing.weight = w[:, 0]
                y = module.expert(e, hidden_states[idx])
            routing.weight = None
            y = y * w
            out.index_add_(0, idx, y.to(out.dtype))
        return out

    module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        del module.forward


def collect_stage(work: BlockWork, memo: Memo, stage: Stage) -> Collected:
    """Fill the Hessians of an expert stage's subsets (see the module docstring). Each pass is a
    replay of the block's calibration forward through ``memo``; chunks keep the stage's Hessians
    within the run's ``max_hessian_memory``."""
    s = work.run.settings
    width = in_features(work.linears[stage.subsets[0][0]])
    min_tokens = width if s.moe_min_tokens is None else s.moe_min_tokens
    ours = isinstance(stage.module, ExpertLinears)
    assert work.twin is None or ours, "prepare refuses GPTAQ with experts optq cannot run on every token"
    per = hessian_bytes(width, work.run.config.normalize_tokens, s.hessian_itemsize, work.twin is not None)
    size = max(1, s.hessian_budget // per)
    collector = _Collector(work, memo, stage, Collected({}, {}))
    out = collector.out
    shared = ours and s.moe_calibration == "all" and stage.first
    idx = list(range(len(stage.subsets)))
    # Every expert's gate/up input is the MoE input itself: one H serves them all.
    chunks = [idx] if shared else [idx[i : i + size] for i in range(0, len(idx), size)]
    for chunk in chunks:
        out.chunks += 1
        if s.moe_calibration == "all" and ours:
            collector.run(chunk, shared=shared, source="all")
            continue
        source = "routed, weighted by routing weight²" if s.moe_weighting == "routing" and ours else "routed"
        if s.moe_calibration == "all" and not ours:
            source = "routed (all tokens need transformers' experts; this is the model's own expert code)"
        collector.run(chunk, shared=False, source=source, routed=True)
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
                out.sources[rep] = (
                    f"routed, {n} tokens < {min_tokens}: rounded to nearest (the "
                    "model's own expert code cannot be replayed with all tokens)"
                )
        if ours:
            collector.run(starved, shared=stage.first, source=None)
    return out


@dataclass
class _Collector:
    work: BlockWork
    memo: Memo
    stage: Stage
    out: Collected

    def run(self, chunk: list[int], *, shared: bool, source: str | None, routed: bool = False) -> None:
        """One pass filling the Hessians of the stage's subsets ``chunk``; ``shared``: one H for
        them all (the MoE input); ``routed``: each expert sees only its routed tokens."""
        work, stage, out = self.work, self.stage, self.out
        subsets = [stage.subsets[k] for k in chunk]
        experts = [stage.experts[k] for k in chunk]
        if shared:
            one = work.new_hessian(subsets[0])
            hooked = {subsets[0][0]: one}
            for s in subsets:
                out.hessians[s[0]] = one
            everyone = frozenset(experts[:1])  # one expert runs every token: its input is the MoE input
        else:
            hooked = {s[0]: work.new_hessian(s) for s in subsets}
            out.hessians.update(hooked)
            everyone = frozenset() if routed else frozenset(experts)
        if source is not None:
            for s in subsets:
                out.sources[s[0]] = source
        ours = isinstance(stage.module, ExpertLinears)
        weigh = routed and ours and work.run.settings.moe_weighting == "routing"
        routing = Routing()

        def hook(hess: LayerHessians) -> Callable:
            def pre(_m: nn.Module, args: tuple) -> None:
                w = routing.weight if weigh else None
                # The expert's output is scaled by w, so its output error by w²: weigh tokens so.
                hess.update(args[0], None if w is None else w.square())

            return pre

        twin = work.twin
        # GPTAQ: the float copy's experts run every token too, so each expert's inputs pair.
        twin_context = (
            (lambda: calibrating(twin.module(stage.module, work.block), everyone, Routing()))
            if twin is not None
            else contextlib.nullcontext
        )
        calibration = calibrating(stage.module, everyone, routing) if ours else contextlib.nullcontext()
        handles = []
        try:
            with (
                work.run.dist.failing_together(),
                calibration,
                self.memo.replay_pass() as at_batch,
                pairing(twin, hooked, at_batch, context=twin_context) as (paired, before),
            ):
                handles = [work.linears[rep].register_forward_pre_hook(hook(hess)) for rep, hess in paired.items()]
                work.run_pass(before)
                out.forwards += 1
        finally:
            for h in handles:
                h.remove()
        for hess in hooked.values():  # seam 2: every rank's tokens, before the starved test and solves
            hess.all_reduce(work.run.dist)


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
