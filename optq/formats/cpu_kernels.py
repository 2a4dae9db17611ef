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
  matrix-vector products), so the weight is dequantized to bfloat16 from the kernel's own
  packed codes, ``(q - m) * s + s * (m - z)``, and multiplied with bfloat16 matmul, which uses
  the CPU's bfloat16 units (on a CPU without them, the same bfloat16 operands go through float32
  matmul: :func:`bf16_matmul_is_native`). The dequantized weight lives in a scratch buffer for the call. The
  packed planes hold the codes exactly, so the checkpoint's ``qweight`` can be rebuilt from
  them (:func:`codes_from_packed`) and need not stay in memory beside them.

Both agree with the exact float32 reference to bfloat16 precision: the activations and S, M
are rounded to 8 significant bits (unit roundoff 2^-8 each), products accumulate in float32.
The layout needs out_features % 16 == 0 (the int4 packer) and a kernel group size of 32, 64,
128 or 256 dividing both the group size and in_features, with each group's input channels
contiguous once sorted by ``g_idx`` (natural order and act-order with static groups).
"""

from __future__ import annotations

import functools
import platform
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
    "BF16_MATMUL_NATIVE",
    "bf16_matmul_is_native",
    "build",
    "centred_codes",
    "codes_from_packed",
    "dequantize",
    "dequantize_traced",
    "from_packed",
    "is_x86",
    "linear",
    "matmul",
    "packed_block",
    "packed_layout_known",
    "supported",
    "unpack_codes",
]

KERNEL_GROUPS = (256, 128, 64, 32)
"""Group sizes ``_weight_int4pack_mm_for_cpu`` accepts (largest first: fewer scales to read)."""

PREFILL_ROWS = {2: 80, 3: 80, 4: 80, 8: 40}
"""Rows (tokens) per call from which dequantize + bfloat16 matmul replaces the int4 kernel, by
bits: where the two cross on SmolLM2's layer shapes (benchmarks/prefill_kernels.py; an 8-bit layer takes
two int4 calls, so it crosses earlier)."""


def is_x86() -> bool:
    """Whether this machine is x86, whose CPUs differ in the vector units torch and vLLM dispatch on."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def bf16_matmul_is_native() -> bool:
    """Whether torch's bfloat16 matmul runs on the CPU's own bfloat16 units (x86: AVX-512 BF16 or
    AMX; other architectures are assumed to). Where it does not (an x86 CPU with AVX2 only), it is
    emulated and far slower than float32: measured on a 2-core AMD EPYC without AVX-512, a
    [512, 576] x [576, 1536] product took 1.61 s in bfloat16 against 0.041 s in float32, and
    SmolLM2-135M's 4-bit forward of 2 x 512 tokens 351 s against 28 s once the prefill matmul
    took the same bfloat16 operands to float32 (the exact float32 path: 32 s). There the prefill
    kernel multiplies in float32 (:func:`matmul`)."""
    if not is_x86():
        return True
    cpu = torch.cpu
    return bool(
        getattr(cpu, "_is_avx512_bf16_supported", lambda: True)() or getattr(cpu, "_is_amx_tile_supported", bool)()
    )


BF16_MATMUL_NATIVE = bf16_matmul_is_native()
""":func:`bf16_matmul_is_native` on this machine, read once (a constant, so that torch.compile
traces the prefill kernel without calling into ``torch.cpu``)."""


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

    ``dtype``: what the kernels compute in (mid below: the middle code 2^(bits-1)). ``planes``: one
    (packed codes, S and M [K/group, N, 2] in ``dtype``) per 4-bit plane (two for 8-bit layers).
    ``scale_zero``: s and ``s * (mid - z)`` of the whole code, for dequantizing
    ``(q - mid) * s + s * (mid - z)`` (the prefill path reads the codes back from the planes,
    so no second copy of them is needed: see :func:`packed_layout_known`). ``perm``: the
    input-channel order (act-order) or None.
    """

    dtype: torch.dtype
    group: int
    planes: list[tuple[torch.Tensor, torch.Tensor]]
    scale_zero: torch.Tensor
    perm: torch.Tensor | None
    readable: bool = False  # whether the planes' codes can be read back (:func:`from_packed`)
    block: int = 64  # the packer's output-channel block on this CPU (:func:`packed_block`)

    def nbytes(self) -> int:
        """Bytes of the layout's tensors, each counted once (below 8 bits the plane's scales are
        ``scale_zero`` itself)."""
        tensors = {
            id(t): t for t in [*(t for p in self.planes for t in p), self.scale_zero, self.perm] if t is not None
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())


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
    block = packed_block()
    readable = block is not None and n % block == 0
    return FastWeight(dtype, kernel_group, planes, scale_zero, perm, readable, block or 64)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


def unpack_codes(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The codes [N, K] (int32, contiguous) of a GPTQ ``qweight`` [K * bits / 32, N], for 2, 4
    and 8 bits: one shift and mask per value (the general unpacker also handles values that
    straddle words)."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values straddle words; use optq.formats.packing.unpack_qweight")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, -1, 1)
    values = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [W, 32/b, N]: k = 32/b * word + slot
    return values.view(-1, qweight.shape[1])[:in_features].t().contiguous()


_SCRATCH = threading.local()


def _scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of this shape reused across calls on this thread: a fresh one per layer and
    call costs page faults that took longer than the arithmetic (measured)."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = buffers.get((shape, dtype))
    if buf is None:
        with torch.inference_mode(False):  # made under generate's inference mode, it could not be written outside it
            buf = buffers[(shape, dtype)] = torch.empty(shape, dtype=dtype)
    return buf


# The packer's output-channel block B: bytes [N/B, K, B/2], byte j = (n = j | n = B/2 + j << 4).
# torch 2.13 packs with B = 64 on CPUs with AVX-512 and B = 32 on AVX2 (measured on an AMD EPYC).
_BLOCKS = (64, 32)


def _nibbles(packed: torch.Tensor, n: int, k: int, out: torch.Tensor, block: int) -> torch.Tensor:
    """The 4-bit codes [K, N] (uint8, into ``out``) of a plane packed by the int4 packer, rows in
    the kernel's channel order. The packer (``_convert_weight_to_int4pack_for_cpu``) stores
    [N/B, K, B/2] bytes (B = ``block``) whose low nibble is channel B b + j and high nibble
    B b + B/2 + j; two strided passes write whole B/2-byte runs."""
    by_k = packed.view(torch.uint8).view(n // block, k, block // 2).permute(1, 0, 2)
    halves = out.view(k, n // block, 2, block // 2)
    torch.bitwise_and(by_k, 15, out=halves[:, :, 0])
    torch.bitwise_right_shift(by_k, 4, out=halves[:, :, 1])
    return out


@functools.cache
def packed_block() -> int | None:
    """The output-channel block of the layout this torch's int4 packer writes on this CPU, of
    those :func:`_nibbles` reads (checked once, on random codes), or None for another layout."""
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return None
    n, k = 2 * max(_BLOCKS), 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = _pack(codes)
    for block in _BLOCKS:
        try:
            back = _nibbles(packed, n, k, torch.empty(k, n, dtype=torch.uint8), block)
        except RuntimeError:  # another layout's size
            continue
        if torch.equal(back.t().to(torch.int32), codes):
            return block
    return None


def packed_layout_known() -> bool:
    """Whether this torch's int4 packer writes a layout :func:`_nibbles` reads: then the packed
    codes alone describe the weight, and the checkpoint's ``qweight`` can be rebuilt from them
    instead of being kept beside them."""
    return packed_block() is not None


def from_packed(fast: FastWeight, n: int) -> bool:
    """Whether ``fast``'s packed codes (n output channels) can be read back
    (:func:`centred_codes`): decided when it was built, so that a compiled forward does not
    run the layout check."""
    return fast.readable and n % fast.block == 0


def centred_codes(fast: FastWeight, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The codes minus the middle code, ``q - 2^(b-1)``, int8 [K, N], rows in the kernels'
    channel order (``fast.perm``), read from the packed planes (needs :func:`from_packed`).
    For b <= 4 bits that is the plane's ``c - 8``; at 8 bits ``16 (h - 8) + l``, the byte
    ``h l`` with its top bit flipped."""
    k = fast.planes[0][0].numel() * 2 // n
    out = torch.empty(k, n, dtype=torch.int8) if out is None else out
    raw = out.view(torch.uint8)
    _nibbles(fast.planes[0][0], n, k, raw, fast.block)
    if len(fast.planes) == 1:
        return out.sub_(8)
    low = _nibbles(fast.planes[1][0], n, k, _scratch((k, n), torch.uint8), fast.block)
    raw.bitwise_left_shift_(4).bitwise_or_(low).bitwise_xor_(0x80)
    return out


def codes_from_packed(fast: FastWeight, bits: int, n: int) -> torch.Tensor:
    """The codes [N, K] (int32, the checkpoint's channel order) of ``fast``: exactly the ones it
    was built from."""
    kernel_order = centred_codes(fast, n).t().to(torch.int32).add_(1 << (bits - 1))
    if fast.perm is None:
        return kernel_order.contiguous()
    codes = torch.empty_like(kernel_order)
    codes[:, fast.perm] = kernel_order
    return codes


def dequantize(fast: FastWeight, bits: int, n: int, codes: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The weight's transpose [K, N] in the fast dtype, rows in the kernels' channel order
    (:func:`matmul` orders x's columns alike). Valid until the next call on this thread (a
    scratch buffer).

    The codes come from the packed planes when their layout is known (two nibble passes), else
    from ``codes()`` (the checkpoint's codes [N, K]); each weight is then one fused multiply-add,
    ``(q - mid) * s + s * (mid - z)``.
    """
    kg, dtype = fast.group, fast.dtype
    s, m = (t.contiguous() for t in fast.scale_zero.unbind(-1))  # [K/kg, N]: small; strided, they slow the FMA
    if from_packed(fast, n):
        k = fast.planes[0][0].numel() * 2 // n
        centred = centred_codes(fast, n, _scratch((k, n), torch.int8))
    else:
        q = codes().t()
        if fast.perm is not None:
            q = q.index_select(0, fast.perm)
        centred = q - (1 << (bits - 1))
    grouped = centred.view(-1, kg, n)
    out = _scratch(tuple(grouped.shape), dtype)
    torch.addcmul(m.unsqueeze(1), grouped, s.unsqueeze(1), out=out)
    return out.view(-1, n)


def dequantize_traced(fast: FastWeight, n: int) -> torch.Tensor:
    """:func:`dequantize` for a readable layout in plain tensor operations (no scratch buffers,
    no ``out=``), for torch.compile, which fuses them into one loop."""
    k = fast.planes[0][0].numel() * 2 // n

    def nibbles(packed: torch.Tensor) -> torch.Tensor:
        by_k = packed.view(torch.uint8).view(n // fast.block, k, fast.block // 2).permute(1, 0, 2)
        return torch.stack([by_k & 15, by_k >> 4], dim=2).reshape(k, n)

    codes = nibbles(fast.planes[0][0]).to(torch.int16)
    if len(fast.planes) == 1:
        centred = codes - 8
    else:
        centred = codes * 16 + nibbles(fast.planes[1][0]).to(torch.int16) - 128
    s, m = fast.scale_zero.unbind(-1)
    weight = centred.view(-1, fast.group, n).to(fast.dtype) * s.unsqueeze(1) + m.unsqueeze(1)
    return weight.view(k, n)


def linear(fast: FastWeight, x: torch.Tensor, bits: int, n: int, dense: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``x [..., K] @ W.T`` as [..., n] in x's dtype (no bias): the int4 kernel below
    :data:`PREFILL_ROWS` rows, else ``dense()``'s dequantized weight (:func:`dequantize` or, under
    torch.compile, :func:`dequantize_traced`) with bfloat16 matmul."""
    x2 = x.reshape(-1, x.shape[-1])
    weight = dense() if x2.shape[0] >= PREFILL_ROWS[bits] else None
    return matmul(fast, x2, weight).to(x.dtype).view(*x.shape[:-1], n)


def matmul(fast: FastWeight, x: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T``, computed and returned in the fast dtype (the caller casts back).

    ``dense``: None for the int4 kernel; for dequantize + matmul, :func:`dequantize`'s result
    (see :data:`PREFILL_ROWS`).
    """
    if fast.perm is not None:
        x = x.index_select(1, fast.perm)
    x = x.to(fast.dtype).contiguous()
    if dense is not None:
        if dense.dtype == torch.bfloat16 and not BF16_MATMUL_NATIVE:
            return (x.float() @ dense.float()).to(fast.dtype)  # the same bfloat16 operands, float32 kernel
        return x @ dense
    packed, scale_zero = fast.planes[0]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, fast.group, scale_zero.contiguous())
    if len(fast.planes) == 2:
        packed, scale_zero = fast.planes[1]
        y.add_(torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, fast.group, scale_zero.contiguous()))
    return y
