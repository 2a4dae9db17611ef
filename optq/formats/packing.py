"""Bit packing of integer codes and zero points into int32 words (the GPTQ checkpoint layout).

Values are laid out as one little-endian bit stream per block of words: value i of a block
occupies stream bits [b*i, b*i + b), and word w of the block holds stream bits [32w, 32w + 32).
For 2, 4 and 8 bits a block is one word (16, 8 or 4 values); for 3 bits a block is three words
holding 32 values, so v10 and v21 run across word boundaries exactly as the spec describes.
Words are uint32 bit patterns stored in int32 tensors (what the format's files hold).

Example::

    >>> import torch
    >>> from optq.formats.packing import pack, unpack
    >>> codes = torch.tensor([[7], [7], [7], [7], [7], [7], [7], [7]])
    >>> hex(pack(codes, bits=4, dim=0).item() & 0xFFFFFFFF)
    '0x77777777'
    >>> unpack(pack(codes, 4, 0), 4, count=8, dim=0).flatten().tolist()
    [7, 7, 7, 7, 7, 7, 7, 7]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from optq.core.config import SUPPORTED_BITS

__all__ = [
    "FORMATS",
    "SUPPORTED_BITS",
    "pack",
    "unpack",
    "packed_length",
    "pack_qweight",
    "unpack_qweight",
    "pack_qzeros",
    "unpack_qzeros",
    "zero_offset",
]

FORMATS = ("gptq", "gptq_v2")
"""Zero-point conventions: "gptq" (v1) stores z - 1, "gptq_v2" stores z."""

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class _Layout:
    """Where each value of a block sits: (word, shift) of its low part and whether it spills."""

    bits: int
    values: int  # values per block
    words: int  # int32 words per block
    slots: tuple[tuple[int, int, bool], ...]  # per value: word index, shift, spills into next


def _layout(bits: int) -> _Layout:
    words = bits // math.gcd(bits, 32)
    values = words * 32 // bits
    slots = []
    for i in range(values):
        start = bits * i
        word, shift = divmod(start, 32)
        slots.append((word, shift, shift + bits > 32))
    return _Layout(bits, values, words, tuple(slots))


# bits -> layout, the dispatch table for every function below.
_LAYOUTS: dict[int, _Layout] = {b: _layout(b) for b in SUPPORTED_BITS}


def _get_layout(bits: int) -> _Layout:
    layout = _LAYOUTS.get(bits)
    if layout is None:
        raise ValueError(f"bits={bits!r} cannot be packed; supported widths are {SUPPORTED_BITS}")
    return layout


def packed_length(count: int, bits: int) -> int:
    """Number of int32 words that hold ``count`` values of ``bits`` bits (full blocks)."""
    layout = _get_layout(bits)
    return -(-count // layout.values) * layout.words


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 tensor of uint32 bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(codes: torch.Tensor, bits: int, dim: int = 0) -> torch.Tensor:
    """Pack integer ``codes`` (values in [0, 2^bits - 1]) along ``dim`` into int32 words.

    The length along ``dim`` is padded with zero codes to whole blocks; the result has
    ``packed_length(codes.shape[dim], bits)`` words along ``dim`` and the other dims unchanged.
    """
    layout = _get_layout(bits)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"pack expects an integer tensor, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("pack expects at least one dimension")
    x = codes.movedim(dim, 0).to(torch.int64)
    if x.numel() and (int(x.min()) < 0 or int(x.max()) > (1 << bits) - 1):
        raise ValueError(
            f"codes must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing; "
            f"got values from {int(x.min())} to {int(x.max())}"
        )
    count, rest = x.shape[0], x.shape[1:]
    blocks = -(-count // layout.values)
    pad = blocks * layout.values - count
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *rest))], dim=0)
    x = x.reshape(blocks, layout.values, *rest)
    out = x.new_zeros((blocks, layout.words, *rest))
    for i, (word, shift, spills) in enumerate(layout.slots):
        v = x[:, i]
        out[:, word] |= (v << shift) & _MASK32
        if spills:
            out[:, word + 1] |= v >> (32 - shift)
    out = out.reshape(blocks * layout.words, *rest)
    return _to_int32(out).movedim(0, dim).contiguous()


def unpack(packed: torch.Tensor, bits: int, count: int, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``count`` values along ``dim``, as int32."""
    layout = _get_layout(bits)
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack expects an int32 tensor, got {packed.dtype}")
    # int32 arithmetic throughout (the hot path of the reference forward): right shifts
    # sign-extend, so every field is masked to the bits it really owns.
    x = packed.movedim(dim, 0)
    n, rest = x.shape[0], x.shape[1:]
    if n % layout.words or count > n // layout.words * layout.values or count < 0:
        raise ValueError(
            f"{n} packed {bits}-bit words along dim {dim} cannot hold {count} values "
            f"(expected {packed_length(count, bits)} words)"
        )
    x = x.reshape(n // layout.words, layout.words, *rest)
    mask = (1 << bits) - 1
    values = []
    for word, shift, spills in layout.slots:
        if spills:
            low = (x[:, word] >> shift) & ((1 << (32 - shift)) - 1)
            v = low | ((x[:, word + 1] << (32 - shift)) & mask)
        else:
            v = (x[:, word] >> shift) & mask
        values.append(v)
    out = torch.stack(values, dim=1).reshape(-1, *rest)[:count]
    return out.movedim(0, dim).contiguous()


def zero_offset(checkpoint_format: str) -> int:
    """What the format subtracts from a zero point before storing it (1 for v1, 0 for v2)."""
    if checkpoint_format not in FORMATS:
        raise ValueError(f"unknown checkpoint_format {checkpoint_format!r}; expected one of {FORMATS}")
    return 1 if checkpoint_format == "gptq" else 0


def pack_qweight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] (nn.Linear layout) -> ``qweight`` int32 [K*bits/32, N], packed along K."""
    return pack(codes.t(), bits, dim=0)


def unpack_qweight(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """``qweight`` [K*bits/32, N] -> codes [N, K] int32 (nn.Linear layout)."""
    return unpack(qweight, bits, in_features, dim=0).t()


def pack_qzeros(zeros: torch.Tensor, bits: int, checkpoint_format: str = "gptq") -> torch.Tensor:
    """Zero points [N, G] (code units) -> ``qzeros`` int32 [G, N*bits/32], packed along N.

    Raises ValueError when a zero point cannot be stored in the convention (v1 stores z - 1,
    so an asymmetric zero point of 0 would become -1 and corrupt its neighbour).
    """
    offset = zero_offset(checkpoint_format)
    stored = zeros.t().to(torch.int64) - offset
    maxq = (1 << bits) - 1
    if stored.numel() and (int(stored.min()) < 0 or int(stored.max()) > maxq):
        bad = int(zeros.min()) if int(stored.min()) < 0 else int(zeros.max())
        hint = ' (write checkpoint_format="gptq_v2", which stores z itself)' if bad == 0 else ""
        raise ValueError(f'zero point {bad} cannot be stored as {bits}-bit "{checkpoint_format}"{hint}')
    return pack(stored, bits, dim=1)


def unpack_qzeros(qzeros: torch.Tensor, bits: int, out_features: int, checkpoint_format: str = "gptq") -> torch.Tensor:
    """``qzeros`` [G, N*bits/32] -> zero points [N, G] int32 in code units (offset undone)."""
    offset = zero_offset(checkpoint_format)
    return (unpack(qzeros, bits, out_features, dim=1) + offset).t().contiguous()
