"""Round-to-nearest: every weight on its group's grid, no calibration statistic read.

It reads no Hessian (``reads_hessian = False``): a run with it and nothing else that needs
calibration activations (``Run.weights_only``: no ``target_bits``, one process) quantizes each
layer from its weight alone, with no calibration forward, and reports no error (null). Under
``target_bits`` or several processes the blocks run as for every method, and each group's
Hessian is collected for the report. The pipeline also uses this method as the fallback for
experts no calibration token reached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from optq.core import grid, solver
from optq.core.config import QuantConfig
from optq.pipeline.methods.base import Method, register

__all__ = ["RoundToNearest", "ROUNDING", "rounded"]


def rounded(w: torch.Tensor, config: QuantConfig, setting: tuple[int, int]) -> torch.Tensor:
    """``w`` rounded to nearest on its natural groups at ``setting`` (bits, group size), float32."""
    cfg = grid.without_hessian(dataclasses.replace(config, bits=setting[0], group_size=setting[1]))
    w = w.float()
    scale, zero = grid.fit_groups(w, cfg)
    idx = grid.group_index(w.shape[1], cfg.group_size, w.device).long()
    return grid.fake_quantize(w, scale[:, idx], zero[:, idx], cfg.maxq)


class RoundToNearest(Method):
    name = "rtn"
    help = "round to nearest"
    proxy_text = "round-to-nearest"
    reads_hessian = False

    def solve(self, W: torch.Tensor, H: Any, hessians: Any, config: Any, settings: Any) -> tuple[Any, Any]:
        return solver.rtn(W, config), W

    def proxy_weights(self, W: Any, H: Any, config: Any, settings: Sequence[tuple[int, int]]) -> Iterator[Any]:
        for s in settings:
            yield rounded(W, config, s)

    def differs_from_proxy(self, settings: Any) -> bool:
        return False  # rounding does not depend on the inputs: the proxy is the run


ROUNDING = register(RoundToNearest())
