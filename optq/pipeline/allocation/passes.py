"""The two block-by-block passes of ``--target-bits`` over the unquantized model.

:func:`measure`: each block on the sensitivity windows, every target's H = 2XᵀX/n collected by
hooks (one per shared input), then for every candidate setting the round-to-nearest objective
½ tr(Δ H Δᵀ) (no GPTQ solve) and the layer's ½ tr(W H Wᵀ); the block's float outputs feed the
next block.

:func:`divergence`: the held-out windows carried through the model once per candidate
allocation (and once in float): each block runs with the candidate's round-to-nearest weights
on that candidate's stream only; at the end the final norm and the head turn every stream into
next-token distributions, and each candidate scores the mean KL(float || candidate) per token.
Both read each block once through the run's block source and leave its weights as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from optq.core import grid
from optq.core.config import QuantConfig
from optq.core.hessian import Hessian
from optq.formats.linears import find_linears, get_weight, set_weight
from optq.pipeline.blocks.capture import Call, discover_subsets, run_block
from optq.pipeline.blocks.prepare import Run

__all__ = ["rtn_weight", "measure", "divergence", "Streams"]

Setting = tuple[int, int]


def rtn_weight(w: torch.Tensor, config: QuantConfig, setting: Setting) -> torch.Tensor:
    """``w`` rounded to nearest on its natural groups at ``setting`` (bits, group size)."""
    cfg = dataclasses.replace(config, bits=setting[0], group_size=setting[1])
    w = w.float()
    scale, zero = grid.fit_groups(w, cfg)
    idx = grid.group_index(w.shape[1], cfg.group_size, w.device).long()
    return grid.fake_quantize(w, scale[:, idx], zero[:, idx], cfg.maxq)


@dataclasses.dataclass
class Streams:
    """Batches of hidden states entering block 0 and every block's call arguments for them."""

    hidden: list[torch.Tensor]
    calls: list[list[Call]]  # calls[block][batch]
    ids: list[torch.Tensor]  # the token ids of each batch


def _targets(run: Run, i: int, block: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in find_linears(block, run.block_name(i)).items() if n in run.targets}


def _hessians(run: Run, linears: Mapping[str, nn.Module], block: nn.Module, streams: Streams, i: int):
    """Each target's Hessian on this block's inputs (one per group of layers sharing an input,
    as ``discover_subsets`` groups them), and the block's outputs (float)."""
    schedule = discover_subsets(block, dict(linears), list(linears), streams.hidden[0], streams.calls[i][0])
    found: dict[str, Hessian] = {}
    handles = []
    for subset in schedule.subsets:
        rep = subset[0]
        w = get_weight(linears[rep])
        hess = Hessian(
            w.shape[1],
            dtype=run.settings.hessian_torch_dtype,
            device=w.device,
            normalize_tokens=run.config_of(rep).normalize_tokens,
        )
        found.update({n: hess for n in subset})
        handles.append(linears[rep].register_forward_pre_hook(lambda _m, args, h=hess: h.update(args[0])))
    try:
        outs = [run_block(block, h, call) for h, call in zip(streams.hidden, streams.calls[i])]
    finally:
        for handle in handles:
            handle.remove()
    return found, outs


def measure(
    run: Run, source, streams: Streams, options: Mapping[str, Sequence[Setting]]
) -> tuple[dict[str, dict[Setting, float]], dict[str, float]]:
    """Round-to-nearest objective of every target at each of its ``options`` settings, and its
    ½ tr(W H Wᵀ), on the sensitivity windows of ``streams`` (consumed: replaced by outputs)."""
    errors: dict[str, dict[Setting, float]] = {}
    energy: dict[str, float] = {}
    with torch.no_grad():
        for i, block in enumerate(run.blocks):
            source.load(i, block)
            try:
                linears = _targets(run, i, block)
                hessians, outs = _hessians(run, linears, block, streams, i)
                for name, mod in linears.items():
                    w = get_weight(mod).float()
                    hess = hessians.get(name)
                    H = hess.matrix().float() if hess is not None and hess.count else None
                    energy[name] = _half_trace(w, H)
                    errors[name] = {s: _half_trace(rtn_weight(w, run.config_of(name), s) - w, H) for s in options[name]}
            finally:
                source.release(i, block)
            streams.hidden = outs
    return errors, energy


def _half_trace(d: torch.Tensor, H: torch.Tensor | None) -> float:
    """½ tr(D H Dᵀ) (H = I for a layer no token reached)."""
    if H is None:
        return 0.5 * float((d * d).sum())
    return 0.5 * float(((d @ H) * d).sum())


def divergence(
    run: Run,
    source,
    streams: Streams,
    allocations: Mapping[str, Mapping[str, Setting]],
    logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Mean KL(float || candidate) per token of each allocation's round-to-nearest model on the
    windows of ``streams``; ``logits`` maps final hidden states [b, t, h] to logits."""
    fp = list(streams.hidden)
    cand = {k: list(streams.hidden) for k in allocations}
    with torch.no_grad():
        for i, block in enumerate(run.blocks):
            source.load(i, block)
            linears = _targets(run, i, block)
            original = {n: get_weight(m).clone() for n, m in linears.items()}
            rounded: dict[tuple[str, Setting], torch.Tensor] = {}
            try:
                fp = [run_block(block, h, c) for h, c in zip(fp, streams.calls[i])]
                for key, allocation in allocations.items():
                    for n, m in linears.items():
                        s = allocation[n]
                        if (n, s) not in rounded:
                            rounded[(n, s)] = rtn_weight(original[n], run.config_of(n), s).to(original[n].dtype)
                        set_weight(m, rounded[(n, s)])
                    cand[key] = [run_block(block, h, c) for h, c in zip(cand[key], streams.calls[i])]
            finally:
                for n, m in linears.items():
                    set_weight(m, original[n])
                source.release(i, block)
        total = {k: 0.0 for k in allocations}
        count = 0
        for b, h in enumerate(fp):
            for w in range(h.shape[0]):  # one window at a time: vocab-sized logits are large
                p = torch.log_softmax(logits(h[w : w + 1]).float(), dim=-1)
                count += p.shape[-2] * p.shape[0]
                for k in allocations:
                    q = torch.log_softmax(logits(cand[k][b][w : w + 1]).float(), dim=-1)
                    total[k] += float((p.exp() * (p - q)).sum())
    return {k: v / max(count, 1) for k, v in total.items()}
