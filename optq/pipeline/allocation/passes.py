"""The two block-by-block passes of ``--target-bits`` over the unquantized model.

:func:`measure`: each block on the sensitivity windows, every target's H = 2XᵀX/n collected by
hooks (one per shared input), then for every candidate setting the objective ½ tr(Δ H Δᵀ) of
the layer quantized at that setting, and the layer's ½ tr(W H Wᵀ); the block's float outputs
feed the next block. With :class:`Gains`, each block's cost at the output as well: the block at
its base settings on the float input starts a stream of its own, carried through the later
blocks in float, scored by KL at the head.

:func:`divergence`: the held-out windows carried through the model once per candidate
allocation (and once in float): each block runs with the candidate's quantized weights on that
candidate's stream only; at the end the final norm and the head turn every stream into
next-token distributions, and each candidate scores the mean KL(float || candidate) per token.

How a layer is quantized in both (``solve``, the run's method's proxy, ``Method.proxy_weights``):
GPTQ with the layer's own settings (act-order, damping, ``diag_shrink``) on the float model's H
from the sensitivity windows, one factorisation per layer shared by every setting; or
round-to-nearest (no H needed). GPTQ compensates inside each layer, so the layers where rounding
hurts most are not those where GPTQ's result hurts most: with rounding the proxy misranked
allocations that GPTQ then quantized (docs/allocation.md). For ``divergence`` with a proxy that
reads H (``Method.reads_hessian``) the sensitivity windows are
carried through the float model again for H (one float forward per block, no solve kept from
``measure``: memory stays one block's). Both read each block once through the run's block
source and leave its weights as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.core.hessian import Hessian
from optq.formats.linears import find_linears, get_weight, set_weight
from optq.pipeline.blocks.capture import Call, discover_subsets, run_block
from optq.pipeline.blocks.prepare import Run
from optq.pipeline.methods import Method
from optq.pipeline.methods.rtn import rounded as rtn_weight

__all__ = [
    "rtn_weight",
    "measure",
    "divergence",
    "Streams",
    "Gains",
    "block_targets",
    "mean_kl",
    "log_probs",
    "kl_terms",
    "swapped",
]

Setting = tuple[int, int]


def _quantized(
    ws: Sequence[torch.Tensor], hess: Hessian | None, config: QuantConfig, settings: Sequence[Setting], solve: Method
) -> Iterator[tuple[Setting, list[torch.Tensor]]]:
    """The weights ``ws`` (layers sharing ``hess`` and ``config``) quantized by ``solve`` (see the
    module's doc) at each of ``settings`` in turn: (setting, their float32 weights). Stacked, as
    the run's groups are solved: GPTQ treats rows independently, so one factorisation serves
    every member and setting. GPTQ falls back to rounding where no token reached them."""
    W = torch.cat([w.float() for w in ws])
    rows = [w.shape[0] for w in ws]
    for s, q in zip(settings, solve.proxy_weights(W, _matrix(hess), config, settings)):
        yield s, list(q.split(rows))


def _matrix(hess: Hessian | None) -> torch.Tensor | None:
    """H in float32, or None for a layer no token reached (or none collected)."""
    return hess.matrix().float() if hess is not None and hess.count else None


def _shared(run: Run, linears: Mapping[str, nn.Module], hessians: Mapping[str, Hessian]) -> list[list[str]]:
    """The targets grouped by the Hessian (one per shared input) and config they share."""
    groups: dict[tuple, list[str]] = {}
    for n in linears:
        hess = hessians.get(n)
        groups.setdefault((n if hess is None else id(hess), run.config_of(n)), []).append(n)
    return list(groups.values())


@contextlib.contextmanager
def swapped(linears: Mapping[str, nn.Module]):
    """Yield a setter ``put(name, weight)`` for ``linears``' weights; restore them all on exit."""
    original = {n: get_weight(m).clone() for n, m in linears.items()}
    try:
        yield lambda n, w: set_weight(linears[n], w.to(original[n].dtype))
    finally:
        for n, m in linears.items():
            set_weight(m, original[n])


@dataclasses.dataclass
class Streams:
    """Batches of hidden states entering block 0 and every block's call arguments for them."""

    hidden: list[torch.Tensor]
    calls: list[list[Call]]  # calls[block][batch]
    ids: list[torch.Tensor]  # the token ids of each batch


@dataclasses.dataclass
class Gains:
    """What :func:`measure` needs to measure each block's effect on the output: the windows
    (``streams``, float, consumed), each layer's ``base`` setting, and the head (``logits``)."""

    streams: Streams
    base: Mapping[str, Setting]
    logits: Callable[[torch.Tensor], torch.Tensor]
    # Block streams held at once (None: every block's, in one pass): a memory budget decides how
    # many passes measure makes, never the gains they measure.
    per_pass: int | None = None


def block_targets(run: Run, i: int, block: nn.Module) -> dict[str, nn.Module]:
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
    run: Run,
    source,
    streams: Streams,
    options: Mapping[str, Sequence[Setting]],
    solve: Method,
    gains: Gains | None = None,
) -> tuple[dict[str, dict[Setting, float]], dict[str, float], dict[int, float]]:
    """The objective of every target quantized (by ``solve``) at each of its ``options``
    settings, and its ½ tr(W H Wᵀ), on the sensitivity windows of ``streams`` (consumed:
    replaced by outputs); with ``gains``, each block's KL: mean KL(float || the model with only
    that block quantized, every layer at its ``base`` setting) per token on ``gains.streams``,
    by block index. That is one more stream per block carried to the end beside the float one
    (``len(blocks)`` streams of the gains windows held at the last block; block forwards grow
    with the square of the depth, on those windows only). With ``gains.per_pass`` streams at
    most are held: the blocks' streams are started that many at a time, each later pass through
    the whole model again on the same windows, each layer quantized at its base setting only, to
    the same values."""
    n, first = len(run.blocks), (list(streams.hidden), streams.calls, streams.ids)
    step = (gains.per_pass if gains is not None else None) or n
    errors, energy, kl = _pass(run, source, streams, options, (solve, gains, range(min(step, n))))
    if gains is not None:
        only_base = {name: [setting] for name, setting in gains.base.items()}
        for a in range(step, n, step):
            again = Streams(list(first[0]), first[1], first[2])
            kl.update(_pass(run, source, again, only_base, (solve, gains, range(a, min(a + step, n))))[2])
    return errors, energy, kl


def _pass(run: Run, source, streams: Streams, options, how):
    """One pass of :func:`measure` (``how``: the solve, the gains and the blocks whose streams
    start in this pass)."""
    solve, gains, starts = how
    errors: dict[str, dict[Setting, float]] = {}
    energy: dict[str, float] = {}
    fp = list(gains.streams.hidden) if gains is not None else []
    alone: dict[int, list[torch.Tensor]] = {}  # block -> its stream (only that block quantized)
    with torch.no_grad():
        for i, block in enumerate(run.blocks):
            source.load(i, block)
            try:
                linears = block_targets(run, i, block)
                hessians, outs = _hessians(run, linears, block, streams, i)
                base = {}
                for members in _shared(run, linears, hessians):
                    hess = hessians.get(members[0])
                    H = _matrix(hess)
                    ws = [get_weight(linears[n]).float() for n in members]
                    for n, w in zip(members, ws):
                        energy[n], errors[n] = _half_trace(w, H), {}
                    settings = sorted({o for n in members for o in options[n]})
                    for s, qs in _quantized(ws, hess, run.config_of(members[0]), settings, solve):
                        for n, w, q in zip(members, ws, qs):
                            if s in options[n]:
                                errors[n][s] = _half_trace(q - w, H)
                            if gains is not None and gains.base[n] == s:
                                base[n] = q
                if gains is not None:
                    fp = _alone(block, linears, base, (fp, gains.streams.calls[i]), alone, i if i in starts else None)
            finally:
                source.release(i, block)
            streams.hidden = outs
        kl = mean_kl(fp, alone, gains.logits) if gains is not None else {}
    return errors, energy, kl


def _alone(block, linears, base, inputs, alone: dict[int, list[torch.Tensor]], i: int | None) -> list[torch.Tensor]:
    """Carry every earlier block's stream through ``block`` in float, start block ``i``'s own
    stream (``block`` at ``base`` weights on the float input; None: none) and return the float
    output."""
    fp, calls = inputs
    for j, hidden in alone.items():
        alone[j] = [run_block(block, h, c) for h, c in zip(hidden, calls)]
    out = [run_block(block, h, c) for h, c in zip(fp, calls)]
    if i is None:
        return out
    with swapped(linears) as put:
        for n in linears:
            put(n, base[n])
        alone[i] = [run_block(block, h, c) for h, c in zip(fp, calls)]
    return out


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities of ``logits`` (float32 over the last dimension)."""
    return torch.log_softmax(logits.float(), dim=-1)


def kl_terms(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The terms of KL(P || Q) from log-probabilities ``p``, ``q`` (:func:`log_probs`): exp(p)(p - q),
    elementwise; summed over the last dimension, each position's KL in nats. optq's one KL:
    ``--target-bits`` (:func:`mean_kl`) and ``optq eval``/``compare`` (``optq.eval.divergence``)."""
    return p.exp() * (p - q)


def mean_kl(fp: Sequence[torch.Tensor], streams: Mapping, logits) -> dict:
    """Mean KL(float || stream) per token at the head, for each of ``streams`` (by key)."""
    total = {k: 0.0 for k in streams}
    count = 0
    for b, h in enumerate(fp):
        for w in range(h.shape[0]):  # one window at a time: vocab-sized logits are large
            p = log_probs(logits(h[w : w + 1]))
            count += p.shape[-2] * p.shape[0]
            for k, hidden in streams.items():
                q = log_probs(logits(hidden[b][w : w + 1]))
                total[k] += float(kl_terms(p, q).sum())
    return {k: v / max(count, 1) for k, v in total.items()}


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
    solve: Method,
    fit: Streams | None = None,
) -> dict[str, float]:
    """Mean KL(float || candidate) per token of each allocation's quantized model on the windows
    of ``streams``; ``logits`` maps final hidden states [b, t, h] to logits. Layers are quantized
    by ``solve``'s proxy weights, on H from ``fit`` (the sensitivity windows, consumed; None: no
    H, and a proxy that reads H rounds)."""
    fp = list(streams.hidden)
    cand = {k: list(streams.hidden) for k in allocations}
    with torch.no_grad():
        for i, block in enumerate(run.blocks):
            source.load(i, block)
            linears = block_targets(run, i, block)
            try:
                quantized = _block_candidates(run, (i, block), linears, allocations, (solve, fit))
                fp = [run_block(block, h, c) for h, c in zip(fp, streams.calls[i])]
                with swapped(linears) as put:
                    for key, allocation in allocations.items():
                        for n in linears:
                            put(n, quantized[(n, allocation[n])])
                        cand[key] = [run_block(block, h, c) for h, c in zip(cand[key], streams.calls[i])]
            finally:
                source.release(i, block)
        return mean_kl(fp, cand, logits)


def _block_candidates(run: Run, where, linears, allocations, how: tuple[Method, Streams | None]):
    """Every (layer, setting) the allocations use in this block, quantized by ``how`` (the proxy,
    and the windows of its H); those windows advanced."""
    (i, block), (solve, fit) = where, how
    hessians = {}
    if fit is not None:
        hessians, fit.hidden = _hessians(run, linears, block, fit, i)
    out: dict[tuple[str, Setting], torch.Tensor] = {}
    for members in _shared(run, linears, hessians):
        settings = sorted({a[n] for a in allocations.values() for n in members})
        ws = [get_weight(linears[n]) for n in members]
        for s, qs in _quantized(ws, hessians.get(members[0]), run.config_of(members[0]), settings, solve):
            out.update({(n, s): q for n, q in zip(members, qs)})
    return out
