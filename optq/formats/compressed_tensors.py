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
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from optq.core.grid import group_index
from optq.formats.experts import is_router
from optq.formats.gptq_config import CheckpointError
from optq.formats.linears import is_linear
from optq.formats.packing import pack, pack_qweight, pack_qzeros, packed_length, unpack
from optq.formats.qlinear import QuantLinear
from optq.formats.schemes import LayerSetting

__all__ = ["export_layer", "import_layer", "check_exportable", "describe", "ignored"]


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


def _weights(s: LayerSetting) -> dict[str, Any]:
    return {
        "num_bits": s.bits,
        "type": "int",
        "symmetric": s.sym,
        "strategy": "channel" if s.group_size == -1 else "group",
        "group_size": None if s.group_size == -1 else s.group_size,
        "actorder": "static" if s.desc_act else None,
        "dynamic": False,
        "observer": "minmax",
    }


def describe(
    base: Mapping[str, Any], ignore: list[str], groups: Sequence[tuple[LayerSetting, list[str]]] = ()
) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` from the GPTQ one and the float linears.
    ``groups``: (setting, targets) per config group, the first the base one (default: every
    ``Linear`` with the base setting)."""
    if not groups:
        groups = [(LayerSetting(base["bits"], base["group_size"], base["sym"], base["desc_act"]), ["Linear"])]
    config_groups = {
        f"group_{i}": {
            "targets": targets,
            "weights": _weights(setting),
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
        for i, (setting, targets) in enumerate(groups)
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "optq": base["meta"],
    }


def import_layer(tensors: Mapping[str, torch.Tensor], setting: LayerSetting, *, name: str) -> dict[str, torch.Tensor]:
    """One pack-quantized layer's tensors (``weight_packed``, ``weight_scale``, ...) as the
    buffers of a gptq_v2 :class:`QuantLinear` (qweight, qzeros, scales, g_idx, bias)."""
    bits = setting.bits
    n_out, n_in = (int(v) for v in tensors["weight_shape"].tolist())
    packed = tensors["weight_packed"]
    if (n_out, _words(n_in, bits)) != tuple(packed.shape):
        raise CheckpointError(f"{name}.weight_shape {[n_out, n_in]} does not fit weight_packed {list(packed.shape)}")
    full = packed_length(n_in, bits)
    codes = unpack(torch.nn.functional.pad(packed, (0, full - packed.shape[1])), bits, n_in, dim=1)
    scales = tensors["weight_scale"]
    groups = scales.shape[1]
    if "weight_zero_point" in tensors:
        zp = tensors["weight_zero_point"]
        zp = torch.nn.functional.pad(zp, (0, 0, 0, packed_length(n_out, bits) - zp.shape[0]))
        zeros = unpack(zp, bits, n_out, dim=0)
    else:
        zeros = torch.full((n_out, groups), 1 << (bits - 1), dtype=torch.int32)
    out = {
        "qweight": pack_qweight(codes, bits),
        "qzeros": pack_qzeros(zeros, bits, "gptq_v2"),
        "scales": scales.t().to(torch.float16).contiguous(),
        "g_idx": group_index(n_in, setting.group_size, packed.device),
    }
    if "bias" in tensors:
        out["bias"] = tensors["bias"].to(torch.float16)
    return out
