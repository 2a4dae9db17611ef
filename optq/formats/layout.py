"""A checkpoint's layout, in one place: its ``quantization_config`` and each packed layer's tensors.

``optq.save``, the streaming run's assembly and the dry-run plan all describe a checkpoint
through :func:`quantization_config` and :func:`packed_layout`, from a :class:`Scheme`: so what the
plan predicts is what the writers write, and ``desc_act`` (loaders reorder by ``g_idx``) is
derived here only, from whether every layer's ``g_idx`` is the natural k // group_size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from optq.core.config import QuantConfig
from optq.formats import compressed_tensors
from optq.formats.gptq_config import CheckpointError, describe_gptq, is_natural
from optq.formats.packing import FORMATS, packed_length
from optq.formats.qlinear import QuantLinear
from optq.formats.schemes import LayerSetting, base_setting, check_fused, dynamic_overrides, name_pattern

__all__ = ["Scheme", "quantization_config", "packed_layout", "storage_format", "CHECKPOINT_FORMATS"]

CHECKPOINT_FORMATS = (*FORMATS, "compressed-tensors")  # what optq writes: GPTQ's two, and pack-quantized


def storage_format(fmt: str) -> str:
    """The zero-point convention of ``QuantLinear`` for a checkpoint format (compressed-tensors
    packs from gptq_v2's zero points)."""
    return "gptq_v2" if fmt == "compressed-tensors" else fmt


@dataclass(frozen=True)
class Scheme:
    """What a checkpoint's ``quantization_config`` says of its layers. ``natural``: every layer's
    ``g_idx`` is k // group_size, so loaders need not reorder (``desc_act`` is its negation).

    The fields are the base setting (the most common one); ``layers`` holds the layers whose
    setting differs from it, by checkpoint name (empty for a uniform model, whose config is
    written as before). :meth:`for_layer` gives one layer's scheme."""

    bits: int
    group_size: int
    sym: bool
    static_groups: bool
    damp: float
    natural: bool
    lm_head: bool = False
    layers: tuple[tuple[str, LayerSetting], ...] = ()

    @classmethod
    def of_config(cls, config: QuantConfig, natural: bool | None = None) -> Scheme:
        """The scheme a run with ``config`` writes. ``natural`` as found in the packed layers, or
        (None) as the config implies: act-order without static groups permutes groups."""
        if natural is None:
            natural = config.natural_groups
        return cls(config.bits, config.group_size, config.sym, bool(config.static_groups), config.damp, natural)

    @classmethod
    def of_configs(
        cls, base: QuantConfig, layers: Mapping[str, QuantConfig], natural: bool | Mapping[str, bool] | None = None
    ) -> Scheme:
        """The scheme of a run that quantized each layer of ``layers`` (every quantized layer,
        by checkpoint name) with its own config; ``base``: the run's config (its damp, and the
        scheme when ``layers`` is empty). ``natural``: per layer (a mapping, missing layers as
        their config implies), for all layers (a bool), or as the configs imply (None)."""
        if not layers:
            return cls.of_config(base, natural if isinstance(natural, bool) else None)

        def is_nat(name: str, config: QuantConfig) -> bool:
            if isinstance(natural, bool):
                return natural
            if natural is not None and name in natural:
                return natural[name]
            return config.natural_groups

        marks = {n: (c.bits, c.group_size, c.sym, is_nat(n, c)) for n, c in layers.items()}
        return cls._of(marks, static_groups=any(bool(c.static_groups) for c in layers.values()), damp=base.damp)

    @classmethod
    def of_layers(cls, layers: Mapping[str, QuantLinear]) -> Scheme:
        """The scheme of packed layers (by checkpoint name): each its own bits, group size,
        symmetry (the solver's, else whether every zero point is the midpoint) and g_idx."""
        marks = {}
        for name, q in layers.items():
            c = q.quant_config
            sym = c.sym if c is not None else bool((q.zeros() == 1 << (q.bits - 1)).all())
            marks[name] = (q.bits, q.group_size, sym, is_natural(q))
        configs = [q.quant_config for q in layers.values() if q.quant_config is not None]
        return cls._of(
            marks, static_groups=any(bool(c.static_groups) for c in configs), damp=configs[0].damp if configs else 0.01
        )

    @classmethod
    def _of(cls, marks: Mapping[str, tuple[int, int, bool, bool]], *, static_groups: bool, damp: float) -> Scheme:
        """From (bits, group_size, sym, natural) per layer. desc_act is decided per (bits,
        group_size, sym): set when any such layer is not natural (reordering a natural layer is
        harmless), so a uniform model keeps one setting."""
        moving = {m[:3] for m in marks.values() if not m[3]}
        settings = {n: LayerSetting(*m[:3], desc_act=m[:3] in moving) for n, m in marks.items()}
        check_fused(settings)
        base = base_setting(settings)
        return cls(
            base.bits,
            base.group_size,
            base.sym,
            static_groups,
            damp,
            not base.desc_act,
            any(n == "lm_head" or n.endswith(".lm_head") for n in marks),
            tuple(sorted((n, s) for n, s in settings.items() if s != base)),
        )

    @cached_property
    def _by_name(self) -> dict[str, LayerSetting]:  # one dict per scheme: for_layer runs per layer
        return dict(self.layers)

    @property
    def base(self) -> LayerSetting:
        return LayerSetting(self.bits, self.group_size, self.sym, not self.natural)

    def for_layer(self, name: str) -> Scheme:
        """The scheme of one layer (checkpoint name), for :func:`packed_layout`: the base one
        unless ``layers`` names it."""
        s = self._by_name.get(name)
        if s is None:
            return replace(self, layers=())
        return replace(self, bits=s.bits, group_size=s.group_size, sym=s.sym, natural=not s.desc_act, layers=())


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
    settings = dict(scheme.layers)  # the layers that differ from the base
    if fmt != "compressed-tensors":
        if settings:
            base["dynamic"] = dynamic_overrides(settings, scheme.base)
        return base
    compressed_tensors.check_exportable(base)
    groups: list[tuple[LayerSetting, list[str]]] = [(scheme.base, ["Linear"])]
    by_setting: dict[LayerSetting, list[str]] = {}
    for name, s in settings.items():
        by_setting.setdefault(s, []).append(name)
    for s, names in sorted(by_setting.items()):
        compressed_tensors.check_exportable({"desc_act": s.desc_act, "static_groups": scheme.static_groups})
        groups.append((s, [f"re:{name_pattern(names)}"]))
    return compressed_tensors.describe(base, sorted(ignore), groups)


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
