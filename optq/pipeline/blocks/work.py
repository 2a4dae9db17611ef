"""One block's work in progress: what the dense path, the expert stages and the pause strategy share.

:class:`BlockWork` gathers what quantizing one block needs (the run, the block and its linears,
its inputs, the report) so the functions that do the work take one object instead of ten
arguments; :class:`SolveUnit` is one group of linears ready to be solved on its Hessian.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from optq.formats.linears import get_weight
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.hessians import LayerHessians
from optq.pipeline.methods import Method
from optq.pipeline.report import Report

if TYPE_CHECKING:
    from optq.pipeline.blocks.prepare import Run

__all__ = ["BlockWork", "SolveUnit", "in_features", "naming_inputs"]


@dataclass
class SolveUnit:
    """A group of linears sharing one input, its Hessian (``LayerHessians``, or ``NoTokens`` for
    a layer no token reached), the method to solve it with, and when its work started (for the
    report's seconds)."""

    subset: list[str]
    hessian: Any
    method: Method
    started: float


@dataclass
class BlockWork:
    """One block being quantized. ``hidden``/``calls``: its inputs per batch (replaced by its
    outputs at the end); ``mine``: its linears to quantize; ``release``: hands freed memory back
    to the system between passes; ``bar``: the progress bar (its postfix shows the last layer);
    ``twin``: for a method on a float chain (GPTAQ), the block's float copy there (``blocks.twin``)."""

    run: Run
    prefix: str
    block: nn.Module
    linears: dict[str, nn.Module]
    mine: list[str]
    hidden: list[torch.Tensor]
    calls: list[capture.Call]
    report: Report
    bar: Any
    release: Callable[[], None]
    twin: Any = None

    def new_hessian(self, subset: Sequence[str]) -> LayerHessians:
        """An empty Hessian for the input of ``subset``, in the run's Hessian dtype."""
        first = self.linears[subset[0]]
        return LayerHessians(
            in_features(first),
            device=first.weight.device,
            normalize_tokens=self.run.config.normalize_tokens,
            dtype=self.run.settings.hessian_torch_dtype,
            cross=self.twin is not None,
        )

    def run_pass(self, before_batch: Callable[[int], None]) -> None:
        """One forward of every calibration batch through the block (outputs dropped)."""
        for b, (h, c) in enumerate(zip(self.hidden, self.calls)):
            before_batch(b)
            capture.run_block(self.block, h, c)


def in_features(module: nn.Module) -> int:
    return int(get_weight(module).shape[1])


@contextlib.contextmanager
def naming_inputs(prefix: str, subset: Sequence[str]) -> Iterator[None]:
    """Hessian.update refuses non-finite inputs without knowing whose they are: name the block
    and the layers whose input it was."""
    try:
        yield
    except ValueError as exc:
        names = ", ".join(n[len(prefix) + 1 :] if n.startswith(prefix + ".") else n for n in subset)
        raise ValueError(f"{prefix}: the input of {names}: {exc}") from exc
