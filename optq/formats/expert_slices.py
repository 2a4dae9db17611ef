"""A fused GPT-OSS source read per expert: where each expert's tensor lies in the fused tensors.

``save_pretrained`` writes GPT-OSS's experts fused (``experts.gate_up_proj`` [E, H, 2I] with
``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H] with ``down_proj_bias`` [E, H]), while
the pipeline quantizes them as :class:`~optq.formats.experts.ExpertLinears`, one linear per
expert matrix. :func:`fused_slices` says, for each per-expert tensor the model needs, which
stored tensor holds it and how to cut it out (:class:`FusedSlice`), so that a streamed run
(``optq.pipeline.stream.source``) fills each expert from a slice of the fused tensor, and writes
the experts it leaves float under their per-expert names, as ``optq.save`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from optq.formats.experts import ExpertLinears

__all__ = ["FusedSlice", "fused_slices", "fused_in_source"]


@dataclass(frozen=True)
class FusedSlice:
    """Where one expert's tensor lies in a fused stored tensor ``key``: ``fused[expert]``, its last
    dimension cut to ``[start, stop)`` (all of it when None), transposed when ``transpose`` (a
    weight of the transposed layout, stored [in, out], is [out, in] as a linear's)."""

    key: str
    expert: int
    start: int | None = None
    stop: int | None = None
    transpose: bool = False

    def take(self, fused: torch.Tensor) -> torch.Tensor:
        """This expert's tensor out of the fused one, contiguous, in memory of its own."""
        t = fused[self.expert][..., self.start : self.stop]
        return (t.T if self.transpose else t).clone(memory_format=torch.contiguous_format)

    def shape(self, fused: Sequence[int]) -> tuple[int, ...]:
        """The shape :meth:`take` returns from a fused tensor of shape ``fused``."""
        dims = [*fused[1:-1], len(range(fused[-1])[self.start : self.stop])]
        return tuple(reversed(dims)) if self.transpose else tuple(dims)


def fused_slices(model: nn.Module, keys: Container[str], names: Callable[[str], str]) -> dict[str, FusedSlice]:
    """The expert tensors of ``model``'s transposed ExpertLinears (GPT-OSS) that a source
    checkpoint (tensor ``keys``, model names to keys ``names``) stores only fused, as
    ``save_pretrained`` writes them: per-expert checkpoint name -> its :class:`FusedSlice`
    (``gate_proj`` the first half of ``gate_up_proj[e]``'s columns, ``up_proj`` the second,
    biases with them). Empty when each expert matrix has a key of its own."""
    out: dict[str, FusedSlice] = {}
    for name, module in model.named_modules():
        if not isinstance(module, ExpertLinears) or not module.layout.transposed:
            continue
        gu, down, leaf = names(f"{name}.gate_up_proj"), names(f"{name}.down_proj"), module.layout.down
        if names(f"{name}.0.{leaf}.weight") in keys or gu not in keys:
            continue
        inter = getattr(module[0], leaf).in_features
        for e in range(module.num_experts):
            for k, half in enumerate(module.layout.gate_up):
                cols = {"start": k * inter, "stop": (k + 1) * inter}
                out[names(f"{name}.{e}.{half}.weight")] = FusedSlice(gu, e, transpose=True, **cols)
                out[names(f"{name}.{e}.{half}.bias")] = FusedSlice(names(f"{name}.gate_up_proj_bias"), e, **cols)
            out[names(f"{name}.{e}.{leaf}.weight")] = FusedSlice(down, e, transpose=True)
            out[names(f"{name}.{e}.{leaf}.bias")] = FusedSlice(names(f"{name}.down_proj_bias"), e)
    return out


def fused_in_source(model: nn.Module, keys: Container[str], names: Callable[[str], str]) -> str | None:
    """Why a source checkpoint (tensor ``keys``, model names to keys ``names``) cannot fill
    ``model``'s ExpertLinears: it stores experts of a plain layout fused (``experts.gate_up_proj``
    [E, 2I, H], which no known writer does), and streaming slices only the transposed layout
    (:func:`fused_slices`). None when it can."""
    for name, module in model.named_modules():
        if not isinstance(module, ExpertLinears) or module.layout.transposed:
            continue
        fused = names(f"{name}.gate_up_proj")
        if names(f"{name}.0.{module.layout.down}.weight") not in keys and fused in keys:
            return (
                f"{fused} stores the experts fused (3-D) in a layout streaming does not slice; "
                "quantize this model in memory (optq.quantize, then optq.save)"
            )
    return None
