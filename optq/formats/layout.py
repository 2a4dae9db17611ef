"""A checkpoint's layout, in one place: its ``quantization_config`` and each packed layer's tensors.

``optq.save``, the streaming run's assembly and the dry-run plan all describe a checkpoint
through :func:`quantization_config` and :func:`packed_layout`, from a :class:`Scheme`: so what the
plan predicts is what the writers write, and ``desc_act`` (loaders reorder by ``g_idx``) is
derived here only, from whether every layer's ``g_idx`` is the natural k // group_size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optq.core.config import QuantConfig
from optq.formats import compressed_tensors
from optq.formats.gptq_config import CheckpointError, describe_gptq, is_natural
from optq.formats.packing import FORMATS, packed_length
from optq.formats.qlinear import QuantLinear

__all__ = ["Scheme", "quantization_config", "packed_layout", "storage_format", "CHECKPOINT_FORMATS"]

CHECKPOINT_FORMATS = (*FORMATS, "compressed-tensors")  # what optq writes: GPTQ's two, and pack-quantized


def storage_format(fmt: str) -> str:
    """The zero-point convention of ``QuantLinear`` for a checkpoint format (compressed-tensors
    packs from gptq_v2's zero points)."""
    return "gptq_v2" if fmt == "compressed-tensors" else fmt


@dataclass(frozen=True)
class Scheme:
    """What a checkpoint's ``quantization_config`` says of its layers. ``natural``: every layer's
    ``g_idx`` is k // group_size, so loaders need not reorder (``desc_act`` is its negation)."""

    bits: int
    group_size: int
    sym: bool
    static_groups: bool
    damp: float
    natural: bool
    lm_head: bool = False

    @classmethod
    def of_config(cls, config: QuantConfig, natural: bool | None = None) -> Scheme:
        """The scheme a run with ``config`` writes. ``natural`` as found in the packed layers, or
        (None) as the config implies: act-order without static groups permutes groups."""
        if natural is None:
            natural = not config.act_order or bool(config.static_groups)
        return cls(config.bits, config.group_size, config.sym, bool(config.static_groups), config.damp, natural)

    @classmethod
    def of_layers(cls, layers: Mapping[str, QuantLinear]) -> Scheme:
        """The scheme of packed layers (one (bits, group_size) for the whole model)."""
        settings = {(q.bits, q.group_size) for q in layers.values()}
        if len(settings) > 1:
            raise CheckpointError(
                f"layers use different (bits, group_size) settings {sorted(settings)}; the "
                "format stores one setting per model"
            )
        first = next(iter(layers.values()))
        configs = [q.quant_config for q in layers.values() if q.quant_config is not None]
        half = 1 << (first.bits - 1)
        sym = all(c.sym for c in configs) if configs else all(bool((q.zeros() == half).all()) for q in layers.values())
        return cls(
            first.bits,
            first.group_size,
            sym,
            any(bool(c.static_groups) for c in configs),
            configs[0].damp if configs else 0.01,
            all(is_natural(q) for q in layers.values()),
            any(n == "lm_head" or n.endswith(".lm_head") for n in layers),
        )


def quantization_config(scheme: Scheme, fmt: str, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint in format ``fmt`` ("gptq", "gptq_v2" or
    "compressed-tensors"); ``ignore``: the float linears compressed-tensors must be told of, under
    checkpoint names. Raises CheckpointError for what the format cannot hold."""
    if fmt not in CHECKPOINT_FORMATS:
        raise CheckpointError(f"format={fmt!r} is unknown; choose one of {CHECKPOINT_FORMATS}")
    base = describe_gptq(
        bits=scheme.bits,
        group_size=scheme.group_size,
        sym=scheme.sym,
        natural=scheme.natural,
        static_groups=scheme.static_groups,
        damp=scheme.damp,
        checkpoint_format=storage_format(fmt),
        lm_head=scheme.lm_head,
    )
    if fmt != "compressed-tensors":
        return base
    compressed_tensors.check_exportable(base)
    return compressed_tensors.describe(base, sorted(ignore))


def packed_layout(
    fmt: str, shape: tuple[int, int], *, bias: bool, scheme: Scheme, float_dtype: torch.dtype = torch.float16
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors one quantized linear of ``shape`` (out, in) is stored as, by suffix: their
    shapes and dtypes. ``float_dtype``: the model's (compressed-tensors keeps scales and bias in
    it; GPTQ formats store float16)."""
    N, K = shape
    bits = scheme.bits
    groups = 1 if scheme.group_size == -1 else math.ceil(K / scheme.group_size)
    if fmt == "compressed-tensors":
        out = {
            "weight_packed": ((N, math.ceil(K * bits / 32)), torch.int32),
            "weight_scale": ((N, groups), float_dtype),
            "weight_shape": ((2,), torch.int64),
        }
        if not scheme.sym:
            out["weight_zero_point"] = ((math.ceil(N * bits / 32), groups), torch.int32)
        if bias:
            out["bias"] = ((N,), float_dtype)
        return out
    out = {
        "qweight": ((packed_length(K, bits), N), torch.int32),
        "qzeros": ((groups, packed_length(N, bits)), torch.int32),
        "scales": ((groups, N), torch.float16),
        "g_idx": ((K,), torch.int32),
    }
    if bias:
        out["bias"] = ((N,), torch.float16)
    return out
