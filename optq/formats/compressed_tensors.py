"""compressed-tensors "pack-quantized" export and import (llm-compressor's and vLLM's format).

Per quantized layer (codes q in [0, 2^b - 1], zero point z, as optq stores them):
``weight_packed`` int32 [N, ceil(K*b/32)] packs q (= signed code + 2^(b-1)) along K with the
same dense bit stream as GPTQ; ``weight_scale`` [N, G] in the model's float dtype;
``weight_zero_point`` int32 [ceil(N*b/32), G] packs z along N (asymmetric only);
``weight_shape`` int64 [2] = [N, K]. Act-order is written only with static groups (actorder
"static"): compressed-tensors 0.20 dropped "group" act-order and its ``weight_g_idx``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping
from typing import Any

import torch
from torch import nn

from optq.formats.experts import is_router
from optq.formats.gptq_config import CheckpointError
from optq.formats.linears import is_linear
from optq.formats.packing import pack
from optq.formats.qlinear import QuantLinear

__all__ = ["export_layer", "check_exportable", "describe", "ignored", "plan_load"]


def _words(count: int, bits: int) -> int:
    return math.ceil(count * bits / 32)


def ignored(model: nn.Module, quantized: Container[str], names: Callable[[str], str] | None = None) -> list[str]:
    """The ``ignore`` list: modules left in float that the ``Linear`` target could claim, under
    checkpoint names (``names``): float linears, and mixture-of-experts routers (``mlp.gate``;
    no ``nn.Linear`` in transformers 5, but one in older transformers and in vLLM, whose
    llm-compressor recipes list them too)."""
    out = []
    for name, module in model.named_modules():
        if not name or name in quantized:
            continue
        weight = getattr(module, "weight", None)
        if is_linear(module) or (is_router(name) and isinstance(weight, torch.Tensor) and weight.dim() == 2):
            out.append((names or str)(name))
    return sorted(out)


def check_exportable(base: Mapping[str, Any]) -> None:
    """Refuse settings compressed-tensors cannot read (``base``: the GPTQ quantization_config)."""
    if base["desc_act"] and not base["static_groups"]:
        # compressed-tensors 0.20 removed "group" act-order (non-monotone g_idx): refuse rather
        # than write a folder its own loader rejects.
        raise CheckpointError(
            "compressed-tensors no longer reads act-order without static groups; quantize with "
            "static_groups=True, or save with format='gptq'"
        )


def export_layer(name: str, q: QuantLinear, *, sym: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One layer's pack-quantized tensors (``q`` in the gptq_v2 convention); scales and bias in
    ``dtype``, the model's."""
    bits = q.bits
    codes = q.codes()
    zeros = q.zeros()
    out = {
        "weight_packed": pack(codes, bits, dim=1)[:, : _words(q.in_features, bits)].contiguous(),
        "weight_scale": q.scales.t().to(dtype).contiguous(),
        "weight_shape": torch.tensor([q.out_features, q.in_features], dtype=torch.int64),
    }
    if not sym:
        out["weight_zero_point"] = pack(zeros, bits, dim=0)[: _words(q.out_features, bits)].contiguous()
    elif not bool((zeros == 1 << (bits - 1)).all()):
        raise CheckpointError(f"{name}: symmetric config but zero points differ from {1 << (bits - 1)}")
    if q.bias is not None:
        out["bias"] = q.bias.to(dtype)
    return out


def describe(base: Mapping[str, Any], ignore: list[str]) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` from the GPTQ one and the float linears."""
    group_size = base["group_size"]
    weights = {
        "num_bits": base["bits"],
        "type": "int",
        "symmetric": base["sym"],
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "actorder": "static" if base["desc_act"] else None,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "optq": base["meta"],
    }


def plan_load(qc: Mapping[str, Any], index: Mapping[str, Any]) -> Any:
    """Reading pack-quantized folders back is not implemented: load them with transformers."""
    raise CheckpointError(
        "optq.load reads GPTQ folders; load a compressed-tensors folder with transformers' "
        "AutoModelForCausalLM.from_pretrained (needs the compressed-tensors package)"
    )
