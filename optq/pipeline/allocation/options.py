"""What each linear may be stored as under ``--target-bits``: its candidate (bits, group size)
settings that the serving engines take, their exact stored size, and the units that must share
one setting.

Stored size is counted from the checkpoint's own layout (``optq.formats.layout.packed_layout``):
every tensor a quantized linear is written as (codes, scales, zero points, g_idx, ...), bias
excluded, in bits. ``bits_per_weight`` = that total over all quantized layers / their weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from optq.core.config import SUPPORTED_BITS, QuantConfig
from optq.formats import engines
from optq.formats.layout import Scheme, packed_layout
from optq.formats.schemes import fused_units

__all__ = ["Setting", "GROUPS", "layer_settings", "stored_bits", "units_of", "heuristics", "size_of", "overrides"]

Setting = tuple[int, int]  # (bits, group_size)
GROUPS = (32, 64, 128, -1)  # the group sizes tried (those dividing the layer's width)


def stored_bits(shape: tuple[int, int], setting: Setting, config: QuantConfig, fmt: str) -> int:
    """Bits one linear of ``shape`` (out, in) is stored in with ``setting``, bias excluded."""
    cfg = dataclasses.replace(config, bits=setting[0], group_size=setting[1])
    layout = packed_layout(fmt, shape, bias=False, scheme=Scheme.of_config(cfg))
    total = 0
    for dims, dtype in layout.values():
        itembits = dtype.itemsize * 8
        total += math.prod(dims) * itembits
    return total


def _takes(shape: tuple[int, int], setting: Setting, config: QuantConfig, serve: Sequence[str], fmt: str) -> bool:
    n_out, n_in = shape
    bits, group = setting
    if group != -1 and n_in % group:
        return False
    layer = engines.LayerShape(n_in, n_out, bits, group, config.sym, not config.natural_groups)
    return not any(engines.verdict(e, layer, fmt).refused for e in serve)


def layer_settings(
    shape: tuple[int, int], config: QuantConfig, serve: Sequence[str], fmt: str, bits: Sequence[int] = SUPPORTED_BITS
) -> list[Setting]:
    """The (bits, group) settings a layer of ``shape`` may take: each width of ``bits`` with each
    group size of :data:`GROUPS` dividing the input width that every engine of ``serve`` runs
    as the checkpoint's only scheme (the model-wide rules are checked on whole allocations)."""
    return [(b, g) for b in bits for g in GROUPS if _takes(shape, (b, g), config, serve, fmt)]


def units_of(names: Sequence[str]) -> list[list[str]]:
    """The layers grouped into units that must share one setting (vLLM's fused qkv and gate_up,
    which every checkpoint optq writes keeps alike), each other layer alone; in name order."""
    fused = fused_units(names)
    taken = {m for members in fused.values() for m in members}
    units = [sorted(m) for m in fused.values()] + [[n] for n in names if n not in taken]
    return sorted(units, key=lambda u: u[0])


def size_of(allocation: Mapping[str, Setting], sizes: Mapping[tuple[str, Setting], int]) -> int:
    """Total stored bits of an allocation (``sizes`` by (layer, setting))."""
    return sum(sizes[(n, s)] for n, s in allocation.items())


def overrides(allocation: Mapping[str, Setting]) -> list[tuple[str, dict[str, int]]]:
    """An allocation as per-layer overrides (``RunSettings.overrides``, ``schemes.resolve``)."""
    return [(n, {"bits": b, "group_size": g}) for n, (b, g) in sorted(allocation.items())]


def _block_of(name: str) -> int | None:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if b.isdigit() and a in ("layers", "h", "blocks", "layer"):
            return int(b)
    return None


def _attention(name: str) -> bool:
    return any(k in name for k in ("attn", "attention"))


def heuristics(names: Sequence[str]) -> dict[str, dict[str, int]]:
    """Fixed bit layouts to compare with (group sizes are chosen later to fill the budget):
    uniform 2/3/4/8 bits; first and last blocks at 4, the rest at 3; attention at 4, MLP at 3;
    down projections at 4, the rest at 3."""
    blocks = [b for b in (_block_of(n) for n in names) if b is not None]
    first, last = (min(blocks), max(blocks)) if blocks else (None, None)
    out = {f"uniform-{b}": {n: b for n in names} for b in (2, 3, 4, 8)}
    out["first-last-4"] = {n: 4 if _block_of(n) in (first, last) else 3 for n in names}
    out["attention-4-mlp-3"] = {n: 4 if _attention(n) else 3 for n in names}
    out["down-4"] = {
        n: 4 if n.rsplit(".", 1)[-1] in ("down_proj", "fc2", "c_proj", "w2") and not _attention(n) else 3 for n in names
    }
    return out
