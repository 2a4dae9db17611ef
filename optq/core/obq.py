"""Optimal Brain Quantization: the greedy, per-row ancestor of GPTQ (a reference for small layers)."""

from __future__ import annotations

import torch

from optq.core import grid
from optq.core.config import QuantConfig
from optq.core.factor import inverse_factor
from optq.core.solver import Solution, _check, _solution, _work_dtype

__all__ = ["obq"]


def obq(W: torch.Tensor, H: torch.Tensor, config: QuantConfig) -> Solution:
    """Greedy Optimal Brain Quantization: each row picks its own order, one weight at a time.

    At every step each row quantizes the remaining coordinate q with the least
    (w_q - quant(w_q))² / [H⁻¹]_qq, moves its other remaining weights by the OBS update, and
    removes q from its inverse Hessian by the rank-one deletion
    H⁻¹ ← H⁻¹ - H⁻¹[:, q] H⁻¹[q, :] / [H⁻¹]_qq. Costs rows · cols³: a reference and research
    option for small layers. Grid parameters are fitted up front on W's natural groups (the
    greedy order has no group start); ``perm`` is the identity since each row has its own order.
    """
    _check(W, H, config)
    rows, cols = W.shape
    dtype = _work_dtype(W)
    U, damp_used, _ = inverse_factor(H.to(W.device), config.damp, config.damp_max, dtype=dtype)
    Hinv = (U.T @ U).expand(rows, cols, cols).clone()  # one inverse per row: rows choose apart
    del U
    w = W.to(dtype=dtype, copy=True)
    importance = H.diagonal().to(device=W.device, dtype=dtype) if config.mse and config.mse_hessian else None
    scales, zeros = grid.fit_groups(w, config, importance)
    g_idx = grid.group_index(cols, config.group_size, W.device)
    s_col, z_col = scales[:, g_idx], zeros[:, g_idx]
    done = torch.zeros(rows, cols, dtype=torch.bool, device=W.device)
    codes = torch.empty(rows, cols, dtype=dtype, device=W.device)
    r = torch.arange(rows, device=W.device)
    for _ in range(cols):
        q_all = grid.quantize(w, s_col, z_col, config.maxq)
        d = Hinv.diagonal(dim1=1, dim2=2)
        score = (w - grid.dequantize(q_all, s_col, z_col)).square() / d
        q = score.masked_fill(done, float("inf")).argmin(dim=1)
        codes[r, q] = q_all[r, q]
        dq = grid.dequantize(q_all[r, q], s_col[r, q], z_col[r, q])
        d_q = d[r, q]
        col = Hinv[r, :, q]  # [rows, cols]: H⁻¹ e_q of each row
        w -= ((w[r, q] - dq) / d_q).unsqueeze(1) * col
        w[r, q] = dq  # exact: the update above lands there up to rounding
        Hinv -= col.unsqueeze(2) * (Hinv[r, q, :] / d_q.unsqueeze(1)).unsqueeze(1)
        done[r, q] = True
        # Deleted coordinates keep a unit diagonal so later divisions stay finite (masked anyway).
        Hinv[r, q, q] = 1.0
    perm = torch.arange(cols, device=W.device)
    return _solution(W, H, (codes, scales, zeros, g_idx, perm), damp_used, config)
