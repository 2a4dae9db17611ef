"""Fast CPU matmuls for :class:`~optq.formats.qlinear.QuantLinear`, at every bit width.

Two kernels, both computing in bfloat16 (in torch 2.13 the only dtype whose CPU kernels for
these operations are vectorised: float32 and float16 inputs take scalar loops, about 100x
slower, measured on this machine):

- decode (fewer rows than :data:`PREFILL_ROWS`): PyTorch's packed int4 kernel
  ``_weight_int4pack_mm_for_cpu``, which computes ``w = (c - 8) * S + M`` per group from 4-bit
  codes c. Our weight is ``s * (q - z)``; with ``m = 2^(b-1)``, the middle code, a layer of
  b <= 4 bits is one *plane* with ``c = q + 8 - m``, ``S = s``, ``M = s * (m - z)``. 2- and
  3-bit codes fit the 4-bit range exactly (centred on 8, so that ``(c - 8) * S`` and ``M`` stay
  as small as the weight and bfloat16's rounding of them stays relative to it); the kernel's
  weight is then 4-bit in memory (half a byte per weight, not 3/8 or 1/4). An 8-bit code
  q = 16 h + l is two planes, ``h`` with ``S = 16 s, M = s * (136 - z)`` and ``l`` with
  ``S = s, M = 0``; their sum is ``16 s h + s l - s z = s * (q - z)``. It reads one byte per
  weight, as an int8 kernel would. (PyTorch's int8 kernel ``_weight_int8pack_mm`` takes one
  scale per output channel only; our 8-bit layers have a scale and zero point per group,
  which it cannot express without one call per group.)
- prefill (more rows): the int4 kernel is slower than float32 matmul there (it is built for
  matrix-vector products), so the weight is dequantized to bfloat16 from the checkpoint's
  packed codes, ``(q - m) * s + s * (m - z)``, and multiplied with bfloat16 matmul, which uses
  the CPU's bfloat16 units. The dequantized weight lives in a scratch buffer for the call.

Both agree with the exact float32 reference to bfloat16 precision: the activations and S, M
are rounded to 8 significant bits (unit roundoff 2^-8 each), products accumulate in float32.
The layout needs out_features % 16 == 0 (the int4 packer) and a kernel group size of 32, 64,
128 or 256 dividing both the group size and in_features, with each group's input channels
contiguous once sorted by ``g_idx`` (natural order and act-order with static groups).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from optq.core.grid import group_index

__all__ = [
    "KERNEL_GROUPS",
    "PREFILL_ROWS",
    "FastWeight",
    "build",
    "dequantize",
    "matmul",
    "release_freed_memory",
    "supported",
    "unpack_codes",
]

KERNEL_GROUPS = (256, 128, 64, 32)
"""Group sizes ``_weight_int4pack_mm_for_cpu`` accepts (largest first: fewer scales to read)."""

PREFILL_ROWS = {2: 80, 3: 80, 4: 80, 8: 40}
"""Rows (tokens) per call from which dequantize + bfloat16 matmul replaces the int4 kernel, by
bits: where the two cross on SmolLM2's layer shapes (benchmarks/kernels.py; an 8-bit layer takes
two int4 calls, so it crosses earlier)."""


def supported(bits: int, in_features: int, out_features: int, group_size: int) -> int | None:
    """The kernel group size for this shape, or None when the fast path cannot run it
    (act-order layouts are checked in :func:`build`, which sees ``g_idx``)."""
    if bits not in (2, 3, 4, 8) or out_features % 16 or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    g = in_features if group_size == -1 else group_size
    return next((c for c in KERNEL_GROUPS if g % c == 0 and in_features % c == 0), None)


@dataclass
class FastWeight:
    """A layer's codes in the int4 kernel's layout, with what both kernels need, for one dtype.

    ``dtype``: what the kernels compute in. ``mid``: the middle code 2^(bits-1). ``planes``: one
    (packed codes, S and M [K/group, N, 2] in ``dtype``) per 4-bit plane (two for 8-bit layers).
    ``scale_zero``: s and ``s * (mid - z)`` of the whole code, for dequantizing
    ``(q - mid) * s + s * (mid - z)`` (the prefill path unpacks the checkpoint's ``qweight``
    again, so no second copy of the codes is kept). ``perm``: the input-channel order
    (act-order) or None.
    """

    dtype: torch.dtype
    group: int
    mid: float
    planes: list[tuple[torch.Tensor, torch.Tensor]]
    scale_zero: torch.Tensor
    perm: torch.Tensor | None

    def nbytes(self) -> int:
        """Bytes held beyond the checkpoint's own buffers."""
        tensors = [t for p in self.planes for t in p] + [self.scale_zero]
        return sum(t.numel() * t.element_size() for t in tensors) + (0 if self.perm is None else self.perm.nbytes)


def build(codes: torch.Tensor, layer: Mapping[str, Any], dtype: torch.dtype) -> FastWeight | None:
    """The fast layout of codes [N, K] for ``layer`` (``scales`` [G, N], ``zeros`` [N, G] in code
    units, ``g_idx``, ``bits``, ``group_size``), computing in ``dtype``.

    None when the shape or ``g_idx`` does not allow it (see the module's description).
    """
    n, k = codes.shape
    bits, group_size = layer["bits"], layer["group_size"]
    kernel_group = supported(bits, k, n, group_size)
    if kernel_group is None:
        return None
    g_idx = layer["g_idx"].to(torch.int32)
    natural = group_index(k, group_size, g_idx.device)
    perm = None
    if not torch.equal(g_idx, natural):
        # Act-order g_idx: sorting input channels by group makes groups contiguous again.
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], natural):
            return None
        codes = codes[:, perm]
    # Kernel sub-group j covers sorted channels [j*kg, (j+1)*kg), all inside group j*kg // g.
    groups = natural[::kernel_group].long()
    s = layer["scales"].float()[groups]  # [K/kg, N]
    z = layer["zeros"].t().float()[groups]
    codes = codes.to(torch.int32)
    mid = float(1 << (bits - 1))

    def sz(scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return torch.stack([scale, offset], dim=-1).to(dtype).contiguous()

    scale_zero = sz(s, s * (mid - z))
    if bits <= 4:
        planes = [(_pack(codes + int(8 - mid)), scale_zero)]
    else:
        planes = [(_pack(codes >> 4), sz(16.0 * s, s * (136.0 - z))), (_pack(codes & 15), sz(s, torch.zeros_like(s)))]
    return FastWeight(dtype, kernel_group, mid, planes, scale_zero, perm)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


_TABLES: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}


def _byte_table(bits: int, dtype: torch.dtype, minus: int) -> torch.Tensor:
    """[256, 8 // bits]: the codes (minus ``minus``) that one packed byte holds, low first."""
    table = _TABLES.get((bits, dtype, minus))
    if table is None:
        byte = torch.arange(256).unsqueeze(1)
        shifts = torch.arange(0, 8, bits)
        table = _TABLES[(bits, dtype, minus)] = (((byte >> shifts) & ((1 << bits) - 1)) - minus).to(dtype)
    return table


def _byte_values(qweight: torch.Tensor, bits: int, dtype: torch.dtype, minus: int) -> torch.Tensor:
    """[W, 4, 8 // bits, N] (a view): the codes of ``qweight`` [W, N] minus ``minus``, by byte."""
    words, n = qweight.shape
    values = _byte_table(bits, dtype, minus)[qweight.view(torch.uint8).view(words, n, 4).long()]
    return values.permute(0, 2, 3, 1)


def unpack_codes(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The codes [N, K] (int32, contiguous) of a GPTQ ``qweight`` [K * bits / 32, N], for 2, 4
    and 8 bits: one table lookup per byte (the general unpacker takes a shift per value)."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values straddle words; use optq.formats.packing.unpack_qweight")
    values = _byte_values(qweight, bits, torch.int32, 0).flatten(0, 2)[:in_features]  # [K, N]
    return values.t().contiguous()


def release_freed_memory() -> None:
    """Hand the heap pages freed by building fast paths back to the system (glibc's malloc_trim;
    elsewhere nothing): the per-layer temporaries otherwise stay in this process's RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_SCRATCH = threading.local()


def _scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of this shape reused across calls on this thread: a fresh one per layer and
    call costs page faults that took longer than the arithmetic (measured)."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = buffers.get((shape, dtype))
    if buf is None:
        buf = buffers[(shape, dtype)] = torch.empty(shape, dtype=dtype)
    return buf


def _centred_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """For 2, 4 and 8 bits: the codes minus the middle code, int8 [8/bits, 4, W, N], indexed
    (position t in the byte, low first; byte j of the word; word i; output n): value
    k = 32/bits * i + 8/bits * j + t. One contiguous write per position (a scratch buffer)."""
    words, n = qweight.shape
    per_byte = 8 // bits
    by_byte = qweight.view(torch.uint8).view(words, n, 4).permute(2, 0, 1)  # [4, W, N], strided
    codes = _scratch((per_byte, 4, words, n), torch.int8)
    raw = codes.view(torch.uint8)
    if bits == 8:
        return torch.bitwise_xor(by_byte, 0x80, out=raw[0]).view(torch.int8).unsqueeze(0)  # q - 128
    mask = (1 << bits) - 1
    for t in range(per_byte):
        if t == 0:
            torch.bitwise_and(by_byte, mask, out=raw[0])
        else:
            torch.bitwise_right_shift(by_byte, t * bits, out=raw[t])
            if (t + 1) * bits < 8:
                raw[t].bitwise_and_(mask)
    return codes.sub_(1 << (bits - 1))


def dequantize(
    fast: FastWeight, qweight: torch.Tensor, bits: int, codes: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """The weight's transpose [K, N] in the fast dtype, and the values per byte when its rows
    follow the packed bytes (then :func:`matmul` reorders x to match), else 0 (rows in the
    kernels' channel order). Valid until the next call on this thread (a scratch buffer).

    For 2, 4 and 8 bits in natural order the codes come out of ``qweight``'s bytes with one
    mask or shift per value into rows ordered (position in byte, byte in word, word), so every
    write is contiguous, and are scaled with one fused multiply-add per weight; x's columns are
    reordered instead of the weight's rows. ``codes`` returns the codes [N, K] for the other
    cases (3 bits, act-order).
    """
    kg, dtype, n = fast.group, fast.dtype, qweight.shape[1]
    s, m = (t.contiguous() for t in fast.scale_zero.unbind(-1))  # [K/kg, N]: small; strided, they slow the FMA
    if 32 % bits == 0 and fast.perm is None:
        centred = _centred_codes(qweight, bits)
        words_per_group = kg * bits // 32  # word i is in group i // words_per_group
        grouped = centred.view(centred.shape[0], 4, -1, words_per_group, n)
        out = _scratch(tuple(grouped.shape), dtype)
        torch.addcmul(m.view(1, 1, -1, 1, n), grouped, s.view(1, 1, -1, 1, n), out=out)
        return out.view(-1, n), centred.shape[0]
    q = codes().t()
    if fast.perm is not None:
        q = q.index_select(0, fast.perm)
    centred = (q - (1 << (bits - 1))).to(dtype).view(-1, kg, n)
    return torch.addcmul(m.unsqueeze(1), centred, s.unsqueeze(1)).view(-1, n), 0


def matmul(fast: FastWeight, x: torch.Tensor, dense: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T``, computed and returned in the fast dtype (the caller casts back).

    ``dense``: None for the int4 kernel; for dequantize + matmul, :func:`dequantize`'s result
    (see :data:`PREFILL_ROWS`).
    """
    if fast.perm is not None:
        x = x.index_select(1, fast.perm)
    x = x.to(fast.dtype).contiguous()
    if dense is not None:
        weight, per_byte = dense
        if per_byte:  # the weight's rows go (position in byte, byte in word, word): so do x's columns
            x = x.view(x.shape[0], -1, 4, per_byte).permute(0, 3, 2, 1).reshape(x.shape[0], -1)
        return x @ weight
    y = None
    for packed, scale_zero in fast.planes:
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, fast.group, scale_zero)
        y = part if y is None else y.add_(part)
    assert y is not None
    return y
