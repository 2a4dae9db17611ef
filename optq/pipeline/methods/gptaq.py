"""GPTAQ (Li et al. 2025): each layer fitted on the quantized model's inputs to the float model's
outputs (``optq.core.gptaq``). A float copy of each block runs beside it on the float chain
(``optq.pipeline.blocks.twin``), pairing every input with the float model's: each group gathers
the cross Hessian as well as H."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from optq.core import gptaq
from optq.pipeline.methods.base import Method, register
from optq.pipeline.methods.gptq import GPTQ

__all__ = ["Gptaq", "GPTAQ"]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class Gptaq(Method):
    name = "gptaq"
    help = (
        "fit each layer to the float model's outputs (GPTAQ, Li et al. 2025; a float copy of each block runs "
        "beside it: about 1.5x GPTQ's time, the activations twice; chosen on the shift matrix, docs/lab.md "
        "section 8)"
    )
    float_chain = True

    def check(self, settings: Any) -> None:
        if settings.propagate == "original":
            raise ValueError(
                "method='gptaq' fits each layer on the quantized model's inputs against the float model's; with "
                "propagate='original' both are the float model's and GPTAQ is GPTQ: use propagate='quantized' "
                "(--propagate quantized), or method='gptq' (--method gptq; GPTAQ is the default)"
            )
        if settings.moe_calibration == "routed":
            raise ValueError(
                "method='gptaq' pairs each token's input to a layer in the float and the quantized model; with "
                "moe_calibration='routed' an expert's tokens are those its router chose, which differ between the "
                "two models: use moe_calibration='all' (--moe-calibration all), or method='gptq' (--method gptq; "
                "GPTAQ is the default)"
            )

    def check_experts(self, own: Sequence[str]) -> None:
        if own:
            raise ValueError(
                f"method='gptaq' pairs each token's input to an expert in the float and the quantized model, which "
                f"needs every token through every expert; the experts of {own[0]} are the model's own code, which "
                "optq cannot run so (only routed tokens reach them): use method='gptq' (--method gptq; GPTAQ is the "
                "default), or exclude them"
            )

    def solve(self, W: torch.Tensor, H: torch.Tensor, hessians: Any, config: Any, settings: Any) -> tuple[Any, Any]:
        C = hessians.cross_matrix()
        form = {"alpha": settings.gptaq_alpha, "full": settings.gptaq_form == "full"}
        return gptaq.gptaq_with_floor(W, H, C, config, **form)

    @property
    def proxy(self) -> Method:
        # GPTAQ's own result needs the quantized model's inputs, which depend on the allocation.
        return GPTQ

    def variant_setting(self, modifier: str) -> dict[str, Any] | None:
        if modifier.startswith("alpha") and _number(modifier.removeprefix("alpha")):
            return {"gptaq_alpha": float(modifier.removeprefix("alpha"))}
        if modifier == "full":
            return {"gptaq_form": "full"}
        return None

    def check_variant(self, spec: str, modifiers: Sequence[str], propagate: str) -> None:
        super().check_variant(spec, modifiers, propagate)
        if propagate == "original":
            raise ValueError(
                f"{spec!r}: gptaq fits the quantized model's inputs to the float model's: not with +original"
            )


GPTAQ = register(Gptaq())
