"""GPTAQ's second chain: a float copy of the block, run on the float model's own activations.

GPTAQ (``optq.core.gptaq``) fits each layer to min ||W X_fp - Ŵ X_q||²: X_q is what the layer
receives in the partly quantized model (the run's usual inputs), X_fp what the same tokens give it
in the float model. So a GPTAQ run carries two chains of hidden states from block to block: the
quantized chain (the block loop's ``hidden``) and the float chain (``fp_hidden``), and keeps a
float copy of the block being quantized (its :class:`FloatTwin`), taken before any of its weights
changes. For every batch of a Hessian pass, the twin runs first on that batch's float hidden
states and records the inputs of the linears the pass accumulates, call by call; the quantized
forward's hooks then pair each input with the twin's (:meth:`FloatTwin.paired`). At the end of
the block the twin's outputs replace the float chain, as the quantized block's replace ``hidden``.

The twin replays its finished children like the block does (``optq.pipeline.blocks.memo``): its
weights never change, but a child must still run while a later pass hooks a linear inside it, so
it is final when the block's own child is (:meth:`FloatTwin.solved`, called with ``Memo.solved``).
Cost: one more block in memory, the float activations beside the quantized ones, and about one
more block forward per group.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from optq.formats.linears import find_linears
from optq.pipeline.blocks.capture import Call, run_block
from optq.pipeline.blocks.memo import Memo

__all__ = ["FloatTwin", "pairing"]


class _Stop(Exception):
    """Ends the twin's forward once every input it was asked for is recorded."""


class _Paired:
    """Stands in for a Hessian in a pass's hooks: each update takes the twin's matching input."""

    def __init__(self, twin: FloatTwin, name: str, hessian: Any) -> None:
        self.twin, self.name, self.hessian = twin, name, hessian

    def update(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        taken = self.twin.taken.get(self.name)
        if not taken:
            raise ValueError(
                f"{self.name} was called in the quantized model more often than in the float model on this batch: "
                "GPTAQ needs each token's input in both (a block whose control flow depends on its inputs)"
            )
        self.hessian.update(x, weight, fp=taken.pop(0))


class FloatTwin:
    """The float copy of ``block`` (taken now: build it before any weight changes), its linears
    by the block's own names, and the float chain ``hidden`` it runs on with ``calls``;
    ``order`` and ``targets``: the block's linear calls and the linears to quantize."""

    def __init__(
        self,
        block: nn.Module,
        prefix: str,
        names: tuple[Sequence[str], Sequence[str]],
        hidden: list[torch.Tensor],
        calls: list[Call],
    ) -> None:
        order, targets = names
        self.block = copy.deepcopy(block)
        self.linears = find_linears(self.block, prefix)
        self.memo = Memo(self.block, prefix, list(self.linears), order, targets)
        self.hidden, self.calls = hidden, calls
        self.taken: dict[str, list[torch.Tensor]] = {}

    def solved(self, names: Sequence[str]) -> None:
        """``names`` are quantized: no later pass records their inputs."""
        self.memo.solved(names)

    def module(self, original: nn.Module, block: nn.Module) -> nn.Module:
        """The twin's counterpart of ``original``, a module inside ``block``."""
        name = next(n for n, m in block.named_modules() if m is original)
        return self.block.get_submodule(name)

    @contextlib.contextmanager
    def paired(
        self,
        hessians: dict[str, Any],
        calls_per_forward: int | None = None,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> Iterator[tuple[dict[str, _Paired], Callable[[int], None]]]:
        """For a pass accumulating ``hessians`` (by linear name): stand-ins to hook instead of
        them, and ``before(b)``, to call before batch ``b``'s quantized forward, which runs the
        twin on the float chain's batch ``b`` and records those linears' inputs. The twin stops
        after ``calls_per_forward`` calls of the one linear when given, else runs to the end;
        ``context()`` is entered around each twin forward (the expert stages' calibration)."""
        recorded: dict[str, list[torch.Tensor]] = {}

        def hook(name: str) -> Callable:
            def pre(_m: nn.Module, args: tuple) -> None:
                recorded[name].append(args[0].detach())
                if calls_per_forward is not None and len(recorded[name]) == calls_per_forward:
                    raise _Stop

            return pre

        handles = [self.linears[n].register_forward_pre_hook(hook(n)) for n in hessians]
        try:
            with self.memo.replay_pass() as at_batch:

                def before(b: int) -> None:
                    self._left_over()
                    for name in hessians:
                        recorded[name] = []
                    at_batch(b)
                    try:
                        with context():
                            run_block(self.block, self.hidden[b], self.calls[b])
                    except _Stop:
                        pass
                    self.taken = dict(recorded)

                yield {n: _Paired(self, n, h) for n, h in hessians.items()}, before
                self._left_over()
        finally:
            for h in handles:
                h.remove()
            self.taken = {}

    def _left_over(self) -> None:
        extra = [n for n, inputs in self.taken.items() if inputs]
        if extra:
            raise ValueError(
                f"{', '.join(extra)} was called in the float model more often than in the quantized model on one "
                "batch: GPTAQ needs each token's input in both (a block whose control flow depends on its inputs)"
            )

    def propagate(self, keep: Callable[[list[torch.Tensor], int, torch.Tensor], None]) -> None:
        """The twin's outputs replace the float chain, batch by batch (``keep(hidden, b, out)``)."""
        with self.memo.replay_pass(last=True) as at_batch:
            for b, call in enumerate(self.calls):
                at_batch(b)
                keep(self.hidden, b, run_block(self.block, self.hidden[b], call))


@contextlib.contextmanager
def pairing(
    twin: FloatTwin | None,
    hessians: dict[str, Any],
    at_batch: Callable[[int], None],
    calls_per_forward: int | None = None,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Iterator[tuple[dict[str, Any], Callable[[int], None]]]:
    """What a Hessian pass hooks and calls before each batch: ``hessians`` and ``at_batch`` as
    they are without a twin (GPTQ), else the twin's stand-ins and ``at_batch`` preceded by the
    twin's forward (see :meth:`FloatTwin.paired`)."""
    if twin is None:
        yield hessians, at_batch
        return
    with twin.paired(hessians, calls_per_forward, context) as (stand_ins, before):

        def both(b: int) -> None:
            before(b)
            at_batch(b)

        yield stand_ins, both
