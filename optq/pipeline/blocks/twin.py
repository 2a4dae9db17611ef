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

The twin replays its finished children like the block does (``optq.pipeline.blocks.memo``,
``frozen``): its weights never change, so a child is final once no later pass hooks a linear
inside it (:meth:`FloatTwin.solved`, called with ``Memo.solved``); the pass that hooks the last of
them lets the twin finish the child and records its output before stopping (in a Llama block the
o_proj pass runs the attention to its end, and later passes replay it). On the block's last pass
(``keep``) the twin runs to the block's end and its outputs replace the float chain batch by
batch, so :meth:`FloatTwin.propagate` has nothing left to run. Cost: one more block in memory,
the float activations beside the quantized ones, and about one more block forward per block.
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
        self.memo = Memo(self.block, prefix, list(self.linears), order, targets, frozen=True)
        self.hidden, self.calls = hidden, calls
        self.taken: dict[str, list[torch.Tensor]] = {}
        self.propagated: set[int] = set()  # batches whose float chain already holds the twin's output

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
        keep: Callable[[list[torch.Tensor], int, torch.Tensor], None] | None = None,
    ) -> Iterator[tuple[dict[str, _Paired], Callable[[int], None]]]:
        """For a pass accumulating ``hessians`` (by linear name): stand-ins to hook instead of
        them, and ``before(b)``, to call before batch ``b``'s quantized forward, which runs the
        twin on the float chain's batch ``b`` and records those linears' inputs. The twin stops
        after ``calls_per_forward`` calls of the one linear when given (at the end of the child
        that contains it when the memo records that child now), else runs to the end;
        ``context()`` is entered around each twin forward (the expert stages' calibration).
        ``keep`` (the block's last pass, with ``calls_per_forward``): the twin runs every batch
        to the block's end and ``keep(hidden, b, out)`` puts its output in the float chain once
        batch ``b``'s quantized forward has taken the inputs (see :meth:`propagate`)."""
        recorded: dict[str, list[torch.Tensor]] = {}
        stopping = [False]  # the hooked linear is done: stop when its recorded child returns
        done: list[tuple[int, torch.Tensor]] = []  # the last batch's output, kept after its pairing

        def hook(name: str) -> Callable:
            def pre(_m: nn.Module, args: tuple) -> None:
                got = recorded[name]
                if calls_per_forward is not None and len(got) >= calls_per_forward:
                    return  # running on past the pass's stop (keep or a child to finish)
                got.append(args[0].detach())
                if calls_per_forward is not None and len(got) == calls_per_forward and keep is None:
                    if name not in self.memo.finishing:
                        raise _Stop
                    stopping[0] = True

            return pre

        def finished(_m: nn.Module, _args: tuple, _out: Any) -> None:
            if stopping[0]:
                raise _Stop

        def flush() -> None:
            if done:
                b, out = done.pop()
                keep(self.hidden, b, out)
                self.propagated.add(b)

        hooked = list(hessians) if calls_per_forward is not None else []
        handles = [self.linears[n].register_forward_pre_hook(hook(n)) for n in hessians]
        try:
            with self.memo.replay_pass(last=keep is not None, hooked=hooked) as at_batch:
                children = {id(m): m for m in self.memo.finishing.values()}
                handles += [m.register_forward_hook(finished) for m in children.values()]

                def before(b: int) -> None:
                    self._left_over()
                    flush()  # batch b-1's quantized forward has paired its inputs
                    for name in hessians:
                        recorded[name] = []
                    stopping[0] = False
                    at_batch(b)
                    try:
                        with context():
                            out = run_block(self.block, self.hidden[b], self.calls[b])
                    except _Stop:
                        pass
                    else:
                        if keep is not None:
                            done.append((b, out))
                    self.taken = dict(recorded)

                yield {n: _Paired(self, n, h) for n, h in hessians.items()}, before
                self._left_over()
                flush()
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
        """The twin's outputs replace the float chain, batch by batch (``keep(hidden, b, out)``),
        but for the batches the last pass already ran to the end (``paired(keep=...)``)."""
        with self.memo.replay_pass(last=True) as at_batch:
            for b, call in enumerate(self.calls):
                if b in self.propagated:
                    continue
                at_batch(b)
                keep(self.hidden, b, run_block(self.block, self.hidden[b], call))
        self.propagated = set()


@contextlib.contextmanager
def pairing(
    twin: FloatTwin | None,
    hessians: dict[str, Any],
    at_batch: Callable[[int], None],
    calls_per_forward: int | None = None,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    keep: Callable[[list[torch.Tensor], int, torch.Tensor], None] | None = None,
) -> Iterator[tuple[dict[str, Any], Callable[[int], None]]]:
    """What a Hessian pass hooks and calls before each batch: ``hessians`` and ``at_batch`` as
    they are without a twin (GPTQ), else the twin's stand-ins and ``at_batch`` preceded by the
    twin's forward (see :meth:`FloatTwin.paired`; ``keep``: the block's last pass)."""
    if twin is None:
        yield hessians, at_batch
        return
    if calls_per_forward is None:
        keep = None  # a pass of many linears (experts): the float chain moves in propagate
    with twin.paired(hessians, calls_per_forward, context, keep) as (stand_ins, before):

        def both(b: int) -> None:
            before(b)
            at_batch(b)

        yield stand_ins, both
