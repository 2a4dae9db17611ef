"""The error the fast CPU kernels may make against the exact reference, from their arithmetic."""

from __future__ import annotations

import torch

from optq.formats.qlinear import QuantLinear


def bf16_bound(x: torch.Tensor, q: QuantLinear, ref: torch.Tensor) -> torch.Tensor:
    """What bfloat16 compute may cost per output. The kernels compute each weight as
    ``(q - m) * s + s * (m - z)`` (m the middle code; cpu_kernels) with x, s and s (m - z)
    rounded to 8 significant bits (unit roundoff 2^-8 each), sums in float32, the result rounded
    to bfloat16 once (2^-8 of |y|). So a weight's error is at most 2^-8 of the magnitudes it is
    computed from, and x's rounding adds 2^-8 of |x||w|. 8-bit layers: the two planes'
    (16 s (h - 8) + s (136 - z), s (l - 8)) magnitudes are counted too."""
    g, m = q.g_idx.long(), 1 << (q.bits - 1)
    c, z, s = q.codes().float(), q.zeros().float()[:, g], q.scales.float().t()[:, g]
    parts = (c - m).abs() * s + (m - z).abs() * s
    if q.bits == 8:
        parts += 16 * ((c // 16) - 8).abs() * s + (136 - z).abs() * s + ((c % 16) - 8).abs() * s
    return 2.0**-8 * (x.abs() @ (parts + q.dequantize().abs()).t()) + 2.0**-8 * ref.abs() + 1e-5
