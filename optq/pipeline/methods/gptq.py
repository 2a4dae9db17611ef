"""GPTQ (Frantar et al. 2022) on the quantized model's inputs: ``optq.core.solver.gptq`` per group."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from optq.core import solver
from optq.pipeline.methods.base import Method, register
from optq.pipeline.methods.rtn import rounded

__all__ = ["Gptq", "GPTQ"]


class Gptq(Method):
    name = "gptq"
    help = "GPTQ on the quantized model's inputs alone"
    proxy_text = "GPTQ on the float model's H"

    def solve(self, W: torch.Tensor, H: torch.Tensor, hessians: Any, config: Any, settings: Any) -> tuple[Any, Any]:
        return solver.gptq(W, H, config), W

    def proxy_weights(self, W: Any, H: Any, config: Any, settings: Sequence[tuple[int, int]]) -> Iterator[Any]:
        # One factorisation serves every setting; a layer no token reached is rounded.
        factors = solver.factored(W, H, config) if H is not None else None
        for s in settings:
            if factors is None:
                yield rounded(W, config, s)
            else:
                cfg = dataclasses.replace(config, bits=s[0], group_size=s[1])
                yield solver.sweep(W, factors, cfg, torch.float32).weight

    def differs_from_proxy(self, settings: Any) -> bool:
        # The proxy is GPTQ on the float model's H: the run itself with propagate="original".
        return settings.propagate == "quantized"


GPTQ = register(Gptq())
