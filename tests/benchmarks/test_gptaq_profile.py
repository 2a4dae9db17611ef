"""benchmarks/gptaq_profile.py's operation counts against closed forms: the in-place products
and the CPU's attention kernel, which torch's own counter leaves out, and the allocating ones it
counts, each once."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gptaq_profile  # noqa: E402


def test_product_flops_counts_each_product_by_its_closed_form():
    n, k, rows = 7, 5, 3
    x, w = torch.randn(n, k), torch.randn(rows, k)
    b, h, sq, sk, d, dv = 2, 3, 4, 6, 8, 8
    q, key, v = torch.randn(b, h, sq, d), torch.randn(b, h, sk, d), torch.randn(b, h, sk, dv)
    acc, bacc = torch.zeros(k, k), torch.zeros(b, sq, sk)

    def run() -> None:
        acc.addmm_(x.T, x)  # an H sum: k x n times n x k
        bacc.baddbmm_(q[:, 0], key[:, 0].transpose(1, 2))
        F.scaled_dot_product_attention(q, key, v)
        F.linear(x, w)

    ops = gptaq_profile.product_flops(run)
    assert ops["addmm_"] == 2 * k * n * k
    assert ops["baddbmm_"] == 2 * b * sq * d * sk
    assert ops["_scaled_dot_product_flash_attention_for_cpu"] == 2 * b * h * sq * sk * (d + dv)
    assert ops["mm"] == 2 * n * k * rows  # torch's own count of the linear
    assert ops["total"] == sum(c for op, c in ops.items() if op != "total")
