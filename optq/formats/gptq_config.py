"""The GPTQ side of a checkpoint: which layers are quantized, packed in a format's convention,
and the ``quantization_config`` that describes them (shared/spec/gptq-checkpoint.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from optq.core.grid import group_index
from optq.formats.files import CheckpointError
from optq.formats.linears import is_linear
from optq.formats.packing import FORMATS, SUPPORTED_BITS, pack_qzeros
from optq.formats.qlinear import QuantLinear

if TYPE_CHECKING:
    from optq.core.solver import Solution

__all__ = ["CheckpointError", "quantized_layers", "describe_gptq", "is_natural", "check_gptq_config"]


def quantized_layers(
    model: nn.Module, solutions: Mapping[str, Solution] | None, checkpoint_format: str
) -> dict[str, QuantLinear]:
    """The QuantLinear of every quantized layer, packed in ``checkpoint_format``'s convention."""
    fmt = "gptq_v2" if checkpoint_format == "compressed-tensors" else checkpoint_format
    layers: dict[str, QuantLinear] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            layers[name] = _convert(name, module, fmt)
    if solutions:
        for name, solution in solutions.items():
            module = model.get_submodule(name)
            if not is_linear(module):
                raise CheckpointError(f"solutions name {name}, a {type(module).__name__}, not a linear layer")
            try:
                layers[name] = QuantLinear.from_solution(solution, module.bias, fmt)
            except ValueError as exc:
                raise CheckpointError(f"{name}: {exc}") from exc
    if not layers:
        raise CheckpointError(
            "the model has no quantized layers: pass solutions={name: Solution} (the pipeline "
            "report's) or replace its linears with optq.formats.qlinear.replace_linears first"
        )
    return layers


def _convert(name: str, layer: QuantLinear, fmt: str) -> QuantLinear:
    if layer.checkpoint_format == fmt:
        return layer
    out = QuantLinear(
        layer.in_features,
        layer.out_features,
        layer.bits,
        layer.group_size,
        layer.bias is not None,
        fmt,
        device=layer.qweight.device,
    )
    out.load_state_dict(layer.state_dict())
    try:
        out.qzeros.copy_(pack_qzeros(layer.zeros(), layer.bits, fmt))
    except ValueError as exc:
        raise CheckpointError(f"{name}: {exc}") from exc
    out.quant_config = layer.quant_config
    return out


def describe_gptq(
    *,
    bits: int,
    group_size: int,
    sym: bool,
    natural: bool,
    static_groups: bool,
    damp: float,
    checkpoint_format: str,
    lm_head: bool = False,
) -> dict[str, Any]:
    """The GPTQ ``quantization_config`` with these settings (``optq.formats.layout.quantization_config``
    builds every checkpoint's from a ``Scheme`` through this).

    ``natural``: every layer's g_idx is k // group_size. desc_act tells loaders to reorder by
    g_idx; act-order with static groups keeps g_idx natural, so such a file is written as plain
    (no reordering; vLLM's fast kernels take it as is).
    """
    from optq import __version__

    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": not natural,
        "sym": sym,
        "static_groups": static_groups,
        "true_sequential": True,
        "damp_percent": damp,
        "checkpoint_format": checkpoint_format,
        "lm_head": lm_head,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"optq:{__version__}"]},
    }


def is_natural(q: QuantLinear) -> bool:
    """Whether the layer's g_idx is the natural k // group_size (no reordering needed)."""
    return torch.equal(q.g_idx.to(torch.int32), group_index(q.in_features, q.group_size, q.g_idx.device))


def check_gptq_config(qc: Mapping[str, Any]) -> tuple[int, int, str]:
    bits, group_size = qc.get("bits"), qc.get("group_size", -1)
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if bits not in SUPPORTED_BITS:
        raise CheckpointError(f"quantization_config.bits={bits!r} is not supported; optq reads {SUPPORTED_BITS}")
    if fmt not in FORMATS:
        raise CheckpointError(f"quantization_config.checkpoint_format={fmt!r} is unknown; optq reads {FORMATS}")
    if not isinstance(group_size, int) or (group_size != -1 and group_size < 1):
        raise CheckpointError(f"quantization_config.group_size={group_size!r} must be -1 or a positive integer")
    return bits, group_size, fmt
