"""Per-layer quantization settings in a checkpoint's ``quantization_config``.

A checkpoint whose linears differ in bits, group size, symmetry or act-order keeps one base
setting (the most common) and names the others:

- GPTQ: ``dynamic``, as GPTQModel writes it and vLLM and GPTQModel read it: ordered
  ``{pattern: overrides}``; the first pattern that ``re.match``-es a module's full name
  decides; ``-:pattern`` excludes the module (float), ``+:pattern`` or a bare pattern
  overrides ``bits``, ``group_size``, ``sym`` and ``desc_act`` of the base.
- compressed-tensors: one config group per setting; the base group targets ``Linear``, the
  others one ``re:`` pattern each (compressed-tensors ranks a name match above a class match).

vLLM fuses q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj`` and every routed expert of a
layer into ``experts``, and looks the fused name up: so our patterns name the fused modules too,
and the siblings of one fused module must share their setting (:func:`check_fused`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optq.formats.files import CheckpointError
from optq.formats.packing import SUPPORTED_BITS

__all__ = [
    "LayerSetting",
    "base_setting",
    "fused_units",
    "check_fused",
    "name_pattern",
    "dynamic_overrides",
    "dynamic_match",
    "layer_schemes",
]

FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.[^.]+$")


@dataclass(frozen=True, order=True)
class LayerSetting:
    """What a loader must know of one quantized linear. ``desc_act``: reorder by ``g_idx``."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool

    def as_override(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "sym": self.sym, "desc_act": self.desc_act}


def base_setting(settings: Mapping[str, LayerSetting]) -> LayerSetting:
    """The most common setting; ties go to the smallest (bits, group_size, sym, desc_act)."""
    counts = Counter(settings.values())
    return min(counts, key=lambda s: (-counts[s], s))


def fused_units(names: Iterable[str]) -> dict[str, list[str]]:
    """vLLM's fused module name -> the checkpoint layers it merges (only units of two or more
    layers present in ``names``): ``...qkv_proj``, ``...gate_up_proj`` and ``...experts``."""
    units: dict[str, list[str]] = {}
    for name in sorted(names):
        found = _EXPERTS.match(name)
        if found:
            units.setdefault(found.group(1), []).append(name)
            continue
        prefix, _, leaf = name.rpartition(".")
        for fused, shards in FUSED_PROJECTIONS.items():
            if leaf in shards:
                units.setdefault(f"{prefix}.{fused}" if prefix else fused, []).append(name)
    return {unit: members for unit, members in units.items() if len(members) > 1}


def check_fused(settings: Mapping[str, LayerSetting]) -> None:
    """Raise CheckpointError when layers vLLM fuses into one module have different settings
    (vLLM reads one setting per fused module; GPTQModel warns of the same)."""
    for unit, members in fused_units(settings).items():
        distinct = {settings[m] for m in members}
        if len(distinct) > 1:
            listed = ", ".join(f"{m} {_describe(settings[m])}" for m in members)
            raise CheckpointError(
                f"{listed} differ, but vLLM loads them as one module {unit} with one setting: quantize them alike"
            )


def _describe(s: LayerSetting) -> str:
    return f"(bits={s.bits}, group_size={s.group_size}, sym={s.sym}, desc_act={s.desc_act})"


def name_pattern(names: Sequence[str], units: Mapping[str, Sequence[str]] | None = None) -> str:
    """An anchored regex matching exactly ``names`` and the fused modules (``units``, default
    :func:`fused_units` of ``names``) whose layers are all among them."""
    chosen = set(names)
    if units is None:
        units = fused_units(names)
    fused = [unit for unit, members in units.items() if set(members) <= chosen]
    return "^(?:" + "|".join(re.escape(n) for n in sorted({*chosen, *fused})) + ")$"


def dynamic_overrides(settings: Mapping[str, LayerSetting], base: LayerSetting) -> dict[str, dict[str, Any]]:
    """GPTQ ``dynamic``: one ``+:`` entry per setting other than ``base``, in sorted order (the
    patterns are disjoint, so their order does not matter)."""
    units = fused_units(settings)
    by_setting: dict[LayerSetting, list[str]] = {}
    for name, s in settings.items():
        if s != base:
            by_setting.setdefault(s, []).append(name)
    return {f"+:{name_pattern(names, units)}": s.as_override() for s, names in sorted(by_setting.items())}


def dynamic_match(dynamic: Mapping[str, Mapping[str, Any]] | None, name: str) -> Mapping[str, Any] | bool | None:
    """The override ``dynamic`` gives module ``name``: the first pattern (in order) that
    ``re.match``-es it decides; False for a ``-:`` pattern (not quantized), None for no match.
    GPTQModel (quantization/config.py ``dynamic_get``) and vLLM (quantization/utils/gptq_utils.py
    ``get_dynamic_override``) both read it so."""
    for pattern, overrides in (dynamic or {}).items():
        negative = pattern.startswith("-:")
        raw = pattern[2:] if negative or pattern.startswith("+:") else pattern
        try:
            hit = re.match(raw, name)
        except re.error as exc:
            raise CheckpointError(f"quantization_config.dynamic has an invalid pattern {pattern!r}: {exc}") from exc
        if hit:
            return False if negative else overrides
    return None


def _checked(name: str, bits: Any, group_size: Any, sym: Any, desc_act: Any) -> LayerSetting:
    if bits not in SUPPORTED_BITS:
        raise CheckpointError(f"{name}: bits={bits!r} is not supported; optq reads {SUPPORTED_BITS}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size != -1 and group_size < 1):
        raise CheckpointError(f"{name}: group_size={group_size!r} must be -1 or a positive integer")
    return LayerSetting(bits, group_size, bool(sym), bool(desc_act))


def _gptq_schemes(qc: Mapping[str, Any], names: Iterable[str]) -> dict[str, LayerSetting]:
    base = (qc.get("bits"), qc.get("group_size", -1), qc.get("sym", True), qc.get("desc_act", False))
    out = {}
    for name in names:
        over = dynamic_match(qc.get("dynamic"), name)
        if over is False:
            raise CheckpointError(
                f"{name} holds packed tensors, but quantization_config.dynamic excludes it from quantization"
            )
        fields = list(base)
        for i, (key, kind) in enumerate((("bits", int), ("group_size", int), ("sym", bool), ("desc_act", bool))):
            value = (over or {}).get(key)
            if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
                fields[i] = value  # as vLLM: only a value of the right type overrides
        out[name] = _checked(name, *fields)
    return out


def _ct_group(qc: Mapping[str, Any], name: str) -> tuple[str, Mapping[str, Any]]:
    """The config group compressed-tensors gives ``name`` (a linear): exact name, then ``re:``
    patterns (sorted), then a class target (compressed-tensors' utils/match.py ``match_targets``)."""
    targets: dict[str, str] = {}
    for group, body in (qc.get("config_groups") or {}).items():
        for target in body.get("targets", []):
            targets.setdefault(target, group)
    for ignore in qc.get("ignore") or []:
        if ignore == name or (ignore.startswith("re:") and re.match(ignore[3:], name)):
            raise CheckpointError(f"{name} holds packed tensors, but quantization_config.ignore lists it")
    ranked = sorted(targets, key=lambda t: (t.startswith("re:"), t))
    for target in ranked:
        if target == name or (target.startswith("re:") and re.match(target[3:], name)):
            return target, qc["config_groups"][targets[target]]
    for target in ranked:  # class names: every layer here is a linear
        if not target.startswith("re:") and "." not in target:
            return target, qc["config_groups"][targets[target]]
    raise CheckpointError(f"{name} holds packed tensors, but no compressed-tensors config group targets it")


def _ct_schemes(qc: Mapping[str, Any], names: Iterable[str]) -> dict[str, LayerSetting]:
    out = {}
    for name in names:
        target, group = _ct_group(qc, name)
        w = group.get("weights") or {}
        strategy, actorder = w.get("strategy"), w.get("actorder")
        if w.get("type", "int") != "int" or strategy not in ("group", "channel") or actorder not in (None, "static"):
            raise CheckpointError(
                f"{name}: the group targeting {target!r} has weights type={w.get('type')!r}, "
                f"strategy={strategy!r}, actorder={actorder!r}; optq reads int weights by group or "
                "channel without act-order g_idx"
            )
        group_size = -1 if strategy == "channel" else w.get("group_size")
        out[name] = _checked(name, w.get("num_bits"), group_size, w.get("symmetric", True), actorder is not None)
    return out


def layer_schemes(qc: Mapping[str, Any], names: Iterable[str]) -> dict[str, LayerSetting]:
    """Each quantized layer's setting (``names``: checkpoint names of the layers holding packed
    tensors) under ``qc``, a GPTQ (with or without ``dynamic``) or compressed-tensors
    ``quantization_config``. Raises CheckpointError when the config excludes a layer, gives
    none, or gives one optq cannot read."""
    method = qc.get("quant_method", "gptq")
    if method == "gptq":
        return _gptq_schemes(qc, names)
    if method == "compressed-tensors":
        return _ct_schemes(qc, names)
    raise CheckpointError(f"quant_method={method!r} is not supported; optq reads 'gptq' and 'compressed-tensors'")
