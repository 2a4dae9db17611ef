"""Capture what reaches each decoder block, replay blocks on it, and collect layer Hessians.

The model is run once over the calibration batches with every block's ``forward`` swapped for a
recorder: it keeps the first block's hidden states and, for every block, the other positional
and keyword arguments (attention mask, position ids, rotary cos/sin, cache position, ...). The
recorders pass the hidden states through untouched and the last one stops the forward, so the
capture costs the embeddings, not a model forward. Arguments are recorded per block because
some models hand different blocks different masks or rotary tables (Gemma 3's sliding and full
attention layers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optq.core.hessian import Hessian
from optq.pipeline.blocks.hessians import LayerHessians

__all__ = ["Call", "Schedule", "capture_inputs", "run_block", "discover_subsets", "collect_hessian"]


class _Stop(Exception):
    """Raised inside a forward to end it early (private: never escapes this module)."""


@dataclass
class Call:
    """One batch's arguments of one block, except the hidden states."""

    args: tuple
    kwargs: dict[str, Any]
    hidden_as_kwarg: bool = False


class _Store:
    """Moves captured arguments to the compute device, keeping one copy of equal tensors.

    The same causal mask or rotary table reaches every block for every batch; stored once per
    distinct value, the captured arguments cost next to nothing beside the activations.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen: dict[tuple, list[torch.Tensor]] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            t = value.detach().to(self.device)
            bucket = self.seen.setdefault((tuple(t.shape), t.dtype), [])
            for old in bucket:
                if old is t or torch.equal(old, t):
                    return old
            bucket.append(t)
            return t
        if isinstance(value, tuple):
            return tuple(self(v) for v in value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        return value


def _like(template: Any, hidden: torch.Tensor) -> Any:
    # Blocks return a tensor (transformers 5) or a tuple whose first item is the hidden states.
    if isinstance(template, (tuple, list)):
        return type(template)((hidden, *template[1:]))
    return hidden


def _accepts(fn: Callable, name: str) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def capture_inputs(
    model: nn.Module, blocks: Sequence[nn.Module], batches: Sequence[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[list[Call]]]:
    """Hidden states entering the first block (one tensor per batch, on ``device``) and the
    other arguments of every block (``calls[block][batch]``), from one recorded model pass."""
    hidden: list[torch.Tensor] = []
    calls: list[list[Call]] = [[] for _ in blocks]
    store = _Store(device)
    template: list[Any] = []
    saved = [blk.__dict__.get("forward") for blk in blocks]

    def recorder(i: int, real: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if args:
                h, rest, as_kw = args[0], args[1:], False
            else:
                h, rest, as_kw = kwargs.pop("hidden_states"), (), True
            calls[i].append(Call(store(rest), store(kwargs), as_kw))
            if i == 0:
                # A private copy: block outputs are later written into these buffers, and the
                # model may still hold (and pass to other blocks) the tensor it gave us.
                hidden.append(h.detach().to(device, copy=True))
            if i == len(blocks) - 1:
                raise _Stop
            if not template:
                # One real call teaches the output structure the model's loop expects.
                out = real(*rest, hidden_states=h, **kwargs) if as_kw else real(h, *rest, **kwargs)
                template.append(out)
                return out
            return _like(template[0], h)

        return forward

    extra = {"use_cache": False} if _accepts(model.forward, "use_cache") else {}
    try:
        for i, blk in enumerate(blocks):
            blk.forward = recorder(i, blk.forward)
        for batch in batches:
            try:
                model(input_ids=batch.to(_model_device(model)), **extra)
            except _Stop:
                pass
            else:
                raise RuntimeError("the model forward never reached its last decoder block")
    finally:
        for blk, old in zip(blocks, saved):
            if old is None:
                del blk.forward
            else:
                blk.forward = old
    return hidden, calls


def _model_device(model: nn.Module) -> torch.device:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    param = next(iter(emb.parameters() if emb is not None else model.parameters()))
    return param.device


def run_block(block: nn.Module, hidden: torch.Tensor, call: Call) -> torch.Tensor:
    """The block's output hidden states for one batch."""
    if call.hidden_as_kwarg:
        out = block(*call.args, hidden_states=hidden, **call.kwargs)
    else:
        out = block(hidden, *call.args, **call.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _input_key(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)


@dataclass
class Schedule:
    """How one block's linears are quantized, learned from forwards of its calibration batches.

    ``subsets``: target names grouped by shared input, in the order that input is first used
    (q/k/v, then o, then gate/up, then down in a Llama block); ``order``: the sequence of linear
    calls of the first batch's forward, then the linears first called by later batches (names of
    all linears); ``unused``: targets no forward called; ``repeated``: targets called more than
    once in some forward (each is a subset of its own); ``forwards``: batches run to learn this.
    """

    subsets: list[list[str]]
    order: list[str]
    unused: list[str]
    repeated: list[str]
    forwards: int = 1


def discover_subsets(
    block: nn.Module,
    linears: dict[str, nn.Module],
    targets: Sequence[str],
    hidden: torch.Tensor | Sequence[torch.Tensor],
    call: Call | Sequence[Call],
    known: Sequence[str] = (),
) -> Schedule:
    """Run the block on its first batch and group ``targets`` by the input tensor they share (see
    ``Schedule``). Targets the first batch does not call (experts it routes no token to) are looked for
    in the next batches, one forward each, until every target outside ``known`` (linears whose
    grouping the caller knows without seeing them called) is found or the batches run out; so
    the plan depends on which targets the calibration data reaches, not on the batches' order.
    """
    hiddens = [hidden] if isinstance(hidden, torch.Tensor) else list(hidden)
    calls = [call] if isinstance(call, Call) else list(call)
    order: list[str] = []
    subsets: list[list[str]] = []
    calls_of: dict[str, int] = {}
    wanted = set(targets)
    forwards = 0
    for h, c in zip(hiddens, calls):
        batch_order, groups = _one_forward(block, linears, h, c)
        forwards += 1
        new = [n for n in dict.fromkeys(batch_order) if n not in calls_of]
        for name in batch_order:
            if name in new:
                order.append(name)
        for name in dict.fromkeys(batch_order):
            calls_of[name] = max(calls_of.get(name, 0), batch_order.count(name))
        seen_groups: dict[tuple, list[str]] = {}
        for name in new:
            if name not in wanted:
                continue
            if batch_order.count(name) > 1:
                subsets.append([name])  # called on several inputs: its Hessian covers all of them
                continue
            key = groups[name]
            if key not in seen_groups:
                seen_groups[key] = []
                subsets.append(seen_groups[key])
            seen_groups[key].append(name)
        if all(n in calls_of for n in wanted if n not in known):
            break
    unused = [n for n in targets if n not in calls_of]
    repeated = [n for n in targets if calls_of.get(n, 0) > 1]
    return Schedule(subsets, order, unused, repeated, forwards)


def _one_forward(
    block: nn.Module, linears: dict[str, nn.Module], hidden: torch.Tensor, call: Call
) -> tuple[list[str], dict[str, tuple]]:
    # The sequence of linear calls of one forward, and each linear's first input's identity.
    order: list[str] = []
    first_key: dict[str, tuple] = {}
    keep: list[torch.Tensor] = []  # holding inputs alive keeps their addresses unique

    def hook(name: str) -> Callable:
        def pre(_m: nn.Module, args: tuple) -> None:
            order.append(name)
            keep.append(args[0])
            first_key.setdefault(name, _input_key(args[0]))

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        run_block(block, hidden, call)
    finally:
        for h in handles:
            h.remove()
    return order, first_key


def collect_hessian(
    block: nn.Module,
    linears: dict[str, nn.Module],
    subset: Sequence[str],
    order: Sequence[str],
    hidden: Sequence[torch.Tensor],
    calls: Sequence[Call],
    hessian: Hessian | LayerHessians,
    *,
    before_batch: Callable[[int], None] | None = None,
) -> None:
    """Replay every batch through ``block``, adding the input of ``subset`` to ``hessian``.

    All members of a subset share one input, so only the first member's is accumulated, and
    each forward stops right after that member's last call: the rest of the block cannot change
    what the subset sees. ``before_batch(b)`` is called before batch ``b``'s forward.
    """
    rep = subset[0]
    calls_per_forward = sum(1 for n in order if n == rep)
    seen = [0]

    def pre(_m: nn.Module, args: tuple) -> None:
        hessian.update(args[0])
        seen[0] += 1
        if seen[0] == calls_per_forward:
            raise _Stop

    handle = linears[rep].register_forward_pre_hook(pre)
    try:
        for b, (h, call) in enumerate(zip(hidden, calls)):
            seen[0] = 0
            if before_batch is not None:
                before_batch(b)
            try:
                run_block(block, h, call)
            except _Stop:
                pass
    finally:
        handle.remove()
