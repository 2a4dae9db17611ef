"""Damping and factorisation of the layer Hessian: the upper Cholesky factor of its inverse."""

from __future__ import annotations

import torch

from optq.core.threads import single_threaded

__all__ = ["FactorizationError", "inverse_factor", "all_finite"]


class FactorizationError(ValueError):
    """H stayed non-positive-definite (or non-finite) after escalated damping."""


def all_finite(t: torch.Tensor) -> bool:
    # One reduction instead of an elementwise isfinite pass over a d x d matrix; a non-finite
    # sum (NaN/Inf present, or an overflow) falls back to the exact elementwise test.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def inverse_factor(
    H: torch.Tensor, damp: float, damp_max: float, order: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Upper Cholesky factor U of the damped inverse Hessian, in the quantization order.

    Works on Hd = H[order][:, order] with dead inputs (zero diagonal) given the mean live
    diagonal (they are then simply rounded, pulling on nothing) and λ = damp · mean(diag) added
    to the diagonal; λ escalates ×10 (from at least 1e-4) up to ``damp_max`` while the
    factorisation fails. One Cholesky factorisation of the reversed matrix gives U directly:
    with J the reversal, J Hd J = L Lᵀ implies Hd⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J), and J L⁻¹ J is upper
    triangular with a positive diagonal. Returns (U, damp used, the diagonal added to H in
    natural column order).
    """
    n = H.shape[0]
    if not all_finite(H):
        raise FactorizationError("the Hessian contains NaN or Inf values; check the calibration inputs")
    diag = H.diagonal().to(dtype)
    dead = diag == 0
    live_mean = float(diag[~dead].mean()) if not bool(dead.all()) else 1.0
    added = torch.where(dead, live_mean, 0.0).to(dtype)
    mean_diag = float((diag + added).mean())
    if order is None:
        Hd = H.to(dtype).flip(0, 1)
        rev = torch.arange(n - 1, -1, -1, device=H.device)
    else:
        rev = order.flip(0)
        Hd = H.to(dtype).index_select(0, rev).index_select(1, rev)
    Hd.diagonal().add_(added[rev])
    tried, fraction, applied = [], damp, 0.0
    while True:
        tried.append(fraction)
        Hd.diagonal().add_((fraction - applied) * mean_diag)
        applied = fraction
        # One thread on CPU: MKL's multi-threaded Cholesky rounds differently from its serial
        # one (U then differs by ~1e-4 at 1024 columns and some codes flip), so the result would
        # depend on the thread count. Serial is no slower here (measured up to 4096 columns).
        with single_threaded(Hd.device.type == "cpu"):
            L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            J = torch.eye(n, dtype=dtype, device=H.device).flip(0)
            U = torch.linalg.solve_triangular(L, J, upper=False).flip(0)  # J L⁻¹ J
            if all_finite(U):
                return U, fraction, added + fraction * mean_diag
        if fraction >= damp_max:
            break
        fraction = min(damp_max, max(fraction * 10.0, 1e-4))
    raise FactorizationError(
        "Hessian is not positive definite after damping "
        f"{tried[0]:g}..{tried[-1]:g} of its mean diagonal; raise damp (--damp) or damp_max, "
        "or give more calibration tokens"
    )
