"""Reusing the outputs of a block's finished parts when the block is replayed.

strategy="replay" runs a block from its inputs once per group of linears (q/k/v, o, gate/up,
down in a Llama block) and once more for its outputs. Once every linear up to and including a
child module's last one is quantized (the attention module after o_proj), that child's output
can no longer change: its inputs come only from finished computation and its own weights are
final. ``Memo`` records such a child's output for every batch on one pass and hands it back on
the later passes instead of running the child again, which saves the attention (projections,
rotary embedding, softmax) on every later pass for one activation-sized buffer.

A block whose weights never change (GPTAQ's float copy, ``frozen=True``) has every child final
from the start, except that a pass must still run a child whose linear it hooks: its child is
recorded on the pass that hooks the last of its targets (:attr:`Memo.finishing`: that pass runs
the child to its end before stopping) and replayed on every later pass.

Only direct children of the block that contain linears and are called exactly once per forward
are candidates. Outputs are recorded as copies and every use but the last gets another copy, so
a block that modifies a child's output in place cannot corrupt a later pass.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["Memo"]


def _detached(value: Any) -> Any:
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _copy(value: Any) -> Any:
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


class _Child:
    def __init__(self, name: str, module: nn.Module, pending: set[str], inside: set[str]) -> None:
        self.name = name
        self.module = module
        self.pending = pending  # target linears that must be solved before its output is final
        self.inside = inside  # its linears
        self.is_linear = False  # it is one of them itself
        self.outputs: dict[int, Any] | None = None  # batch index -> recorded output
        self.calls: dict[int, int] = {}


class Memo:
    """Records and replays the outputs of finished children of ``block`` across replay passes.

    ``solved(names)`` after each group is solved; ``with memo.replay_pass(last) as at_batch:``
    around each pass over the batches, calling ``at_batch(b)`` before batch ``b``'s forward.
    ``last`` marks the pass after which nothing is replayed again (recorded outputs are freed
    batch by batch as they are used). ``frozen``: the block's weights never change (see the
    module's docstring); its passes name the linears they hook (``replay_pass(hooked=...)``).
    """

    def __init__(
        self,
        block: nn.Module,
        prefix: str,
        linears: Sequence[str],
        order: Sequence[str],
        targets: Sequence[str],
        frozen: bool = False,
    ) -> None:
        self.children: list[_Child] = []
        self.batch = -1
        self.frozen = frozen
        # During a pass of a frozen memo: hooked linear -> the module of the child that contains
        # it and is recorded on this pass (the pass must let that child finish).
        self.finishing: dict[str, nn.Module] = {}
        wanted = set(targets)
        for cname, module in block.named_children():
            base = f"{prefix}.{cname}"
            inside = {n for n in linears if n == base or n.startswith(base + ".")}
            positions = [i for i, n in enumerate(order) if n in inside]
            if not positions or any(sum(1 for m in order if m == n) > 1 for n in inside):
                continue  # no linear of it runs, or one runs twice: not a simple function
            last = max(positions)
            # Targets inside it count even when no forward so far called them (an expert no
            # batch routed a token to is still solved before the child's output is final).
            pending = {n for n in order[: last + 1] if n in wanted} | (inside & wanted)
            if frozen:  # its inputs never change either: only its own targets' hooks need it to run
                pending = inside & wanted
            self.children.append(_Child(cname, module, pending, inside))
            self.children[-1].is_linear = inside == {base}

    def solved(self, names: Sequence[str]) -> None:
        """Mark linears as quantized (their weights are final)."""
        for child in self.children:
            child.pending.difference_update(names)

    @property
    def recorded(self) -> list[str]:
        """Names of the children whose outputs are held for the next pass."""
        return [c.name for c in self.children if c.outputs is not None]

    @contextmanager
    def replay_pass(self, last: bool = False, hooked: Collection[str] = ()) -> Iterator[Callable[[int], None]]:
        hooked = set(hooked)
        replaying = [c for c in self.children if c.outputs is not None and not c.inside & hooked]
        # Frozen: a child whose last pending targets this pass hooks is final once it returns
        # (not a hooked linear itself: finishing it would save no later pass any work).
        final = (
            (lambda c: not c.pending or (c.pending <= hooked and not c.is_linear))
            if self.frozen and hooked
            else (lambda c: not c.pending)
        )
        recording = [] if last else [c for c in self.children if c.outputs is None and final(c)]
        self.finishing = {n: c.module for c in recording for n in c.inside & hooked}
        saved: list[tuple[nn.Module, Any]] = []
        # Both record and replay replace the child's forward (not hooks): the module's own
        # hooks then run exactly once on every call, recorded or replayed.
        for child in replaying:
            saved.append((child.module, child.module.__dict__.get("forward")))
            child.module.forward = self._replayer(child, last)
        for child in recording:
            saved.append((child.module, child.module.__dict__.get("forward")))
            child.calls = {}
            child.outputs = {}
            child.module.forward = self._recorder(child, child.module.forward)

        def at_batch(b: int) -> None:
            self.batch = b

        ok = False
        try:
            yield at_batch
            ok = True
        finally:
            for module, old in saved:
                if old is None:
                    del module.forward
                else:
                    module.forward = old
            for child in recording:
                # Keep a recording only if every batch called the child exactly once.
                complete = (
                    ok
                    and len(child.calls) == self.batch + 1
                    and all(child.calls.get(b) == 1 for b in range(self.batch + 1))
                )
                if not complete:
                    child.outputs = None
                child.calls = {}
            if last or not ok:
                for child in self.children:
                    child.outputs = None
            self.batch = -1
            self.finishing = {}

    def _recorder(self, child: _Child, real: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            output = real(*args, **kwargs)
            b = self.batch
            child.calls[b] = child.calls.get(b, 0) + 1
            assert child.outputs is not None
            # A copy: the block may still modify its child's output in place (x.mul_(...)).
            child.outputs[b] = _copy(_detached(output))
            return output

        return forward

    def _replayer(self, child: _Child, last: bool) -> Callable:
        def forward(*_args: Any, **_kwargs: Any) -> Any:
            assert child.outputs is not None
            if last:
                return child.outputs.pop(self.batch)
            return _copy(child.outputs[self.batch])

        return forward
