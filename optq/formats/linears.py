"""Which modules are the linear layers optq quantizes, and their weights in one layout.

``nn.Linear`` and transformers' ``Conv1D`` (GPT-2), whose weight is stored transposed
([in, out]); both are read and written here as [out_features, in_features].
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["find_linears", "is_linear", "get_weight", "set_weight"]


def _is_conv1d(module: nn.Module) -> bool:
    # Matched by name so transformers stays an optional import for the core library.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def is_linear(module: nn.Module) -> bool:
    """True for ``nn.Linear`` and transformers' ``Conv1D`` (the layers optq quantizes)."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def get_weight(module: nn.Module) -> torch.Tensor:
    """The weight in ``nn.Linear`` layout [out_features, in_features] (a view, not a copy).

    A ``detach()``ed view, which shares the parameter's version counter (``.data`` would not):
    in-place changes of the parameter stay visible through ``_version``.
    """
    w = module.weight.detach()
    return w.T if _is_conv1d(module) else w


def set_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """Write a [out_features, in_features] weight back in the module's own layout, in place."""
    target = module.weight
    src = weight.T if _is_conv1d(module) else weight
    if src.shape != target.shape:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not fit {type(module).__name__}")
    # Not through .data: an in-place copy under no_grad bumps the parameter's version counter,
    # which solutions holding dropped codes rely on to notice a changed weight.
    with torch.no_grad():
        target.copy_(src)


def find_linears(module: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """All quantizable linears under ``module``, by full name (``prefix`` + relative name)."""
    out = {}
    for name, sub in module.named_modules():
        if sub is not module and is_linear(sub):
            out[f"{prefix}.{name}" if prefix else name] = sub
    return out
