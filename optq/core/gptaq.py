"""GPTAQ: GPTQ solved against the float model's outputs (Li et al., "GPTAQ: Efficient
Finetuning-Free Quantization for Asymmetric Calibration", ICML 2025).

GPTQ fits each layer on the inputs X_q it receives in the partly quantized model and matches
its own float output there: min ||W X_q - Ŵ X_q||². The errors of the earlier layers are then
taken as given. GPTAQ matches the float model's output instead, min ||W X_fp - Ŵ X_q||², with
X_fp the inputs the same layer receives in the float model. With ΔX = X_fp - X_q and Δ = W - Ŵ,

    ||W X_fp - Ŵ X_q||² = ||Δ X_q + W ΔX||²,

so the objective has the GPTQ term plus a cross term in C = 2 ΔX X_qᵀ / n (``dXXT``, built like
H = 2 X_q X_qᵀ / n, from the same tokens at the same scale).

Symbols (as in ``optq.core.solver``, all in the order the columns are quantized):

    H, U    H is damped (and shrunk) as GPTQ does; U is the upper Cholesky factor of H⁻¹, H⁻¹ = Uᵀ U;
            rows i.. of U hold the inverse of H restricted to the columns not yet quantized
    P       α · triu₁(C Uᵀ) U: row i is α C[i, F] H_F⁻¹ on the columns F after i (zero elsewhere)

The paper's closed form: when column i is quantized, besides GPTQ's update of the later columns F
(-Err_i U[i, F]), the asymmetry of input channel i, W[:, i] ΔX_i, becomes fixed, and the later
columns absorb it by least squares: + W[:, i] P[i, F]. That update does not depend on how the
sweep rounds, so all of them together are W P, applied before the sweep: GPTAQ is GPTQ's sweep
(the same grid, damping, Cholesky factor, blocks, act-order and groups) of the corrected weights

    T = W (I + P).

α = 1 is the closed form itself; the authors' code (and GPTQModel) scale the term by α = 0.25.

``full=True`` is not the paper's: it starts the sweep from the least-squares optimum instead,
T = W + α W C H⁻¹ (= W* below at α = 1), so every channel's asymmetry is absorbed by all
columns, the earlier ones included, before any is rounded. From W*, GPTQ's sweep is the greedy
column-by-column minimisation of the asymmetric objective itself (the objective is GPTQ's
around W*, up to a constant); the paper's triangular P leaves the asymmetry of the last columns
to fewer and fewer columns, and of the last one to none.
With X_q = X_fp, C = 0 and GPTAQ is GPTQ exactly. The grid of a group is fitted from T's columns
(static groups) or their current values when the group starts, which already hold the
corrections of the group's earlier columns (the paper's sweep would add those a few columns
later; with a fixed grid the two sweeps are the same: tests/core/test_gptaq.py).

The objective reported (``Solution.loss``) is the asymmetric one above its least-squares floor:
½ tr((W* - Ŵ) H (W* - Ŵ)ᵀ) with W* = W + W C H⁻¹ = W + (W C Uᵀ) U, the unquantized weights that
fit the float outputs best on X_q. For the undamped H, ||W X_fp - Ŵ X_q||² / n = ||W X_fp -
W* X_q||² / n + that loss, so losses of different Ŵ compare as the asymmetric objective does;
with C = 0 it is GPTQ's loss.
"""

from __future__ import annotations

import torch

from optq.core.config import QuantConfig
from optq.core.factor import all_finite
from optq.core.solver import Solution, _check, _work_dtype, factored, objective, sweep

__all__ = ["gptaq", "gptaq_with_floor", "floor_weight", "DEFAULT_ALPHA"]

DEFAULT_ALPHA = 0.25  # the authors' code and GPTQModel scale the correction so


def _check_cross(W: torch.Tensor, dXXT: torch.Tensor, alpha: float) -> None:
    cols = W.shape[1]
    if dXXT.shape != (cols, cols):
        raise ValueError(f"dXXT must be [{cols}, {cols}] for W {tuple(W.shape)}, got {tuple(dXXT.shape)}")
    if not all_finite(dXXT):
        raise ValueError("dXXT contains NaN or Inf values; check the calibration inputs of both models")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha < float("inf"):
        raise ValueError(f"alpha={alpha!r} must be a finite number >= 0 (0: GPTQ; 1: the closed form)")


def _corrections(
    W: torch.Tensor, dXXT: torch.Tensor, perm: torch.Tensor, U: torch.Tensor, form: tuple[float, bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, W*) in natural column order: the corrected weights the sweep rounds and the
    least-squares floor, from W, C = dXXT and U (U in the order ``perm``); ``form`` = (alpha, full)."""
    alpha, full = form
    dtype = U.dtype
    Wp = W.to(dtype).index_select(1, perm)
    M = dXXT.to(device=U.device, dtype=dtype).index_select(0, perm).index_select(1, perm) @ U.T  # C Uᵀ
    # W* = W + W C H⁻¹ = W + ((W C Uᵀ) U); T = W + α W (triu₁(C Uᵀ) U), or W + α (W* - W) when full.
    shift = (Wp @ M) @ U
    floor = Wp + shift
    target = Wp + alpha * (shift if full else (Wp @ M.triu_(1)) @ U)
    del M
    back = torch.empty_like(perm).index_copy_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return target.index_select(1, back), floor.index_select(1, back)


def floor_weight(W: torch.Tensor, H: torch.Tensor, dXXT: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """W* = W + W C H_d⁻¹ (H_d: H damped and shrunk as the solver does), the unquantized weights
    that best fit the float outputs on the quantized inputs; the reference of GPTAQ's loss."""
    _check(W, H, config)
    _check_cross(W, dXXT, 1.0)
    _, perm, U, _, _ = factored(W, H, config)
    return _corrections(W, dXXT, perm, U, (1.0, True))[1].to(W.dtype)


def gptaq(
    W: torch.Tensor,
    H: torch.Tensor,
    dXXT: torch.Tensor,
    config: QuantConfig,
    *,
    alpha: float = DEFAULT_ALPHA,
    full: bool = False,
) -> Solution:
    """Quantize W [rows, cols] to match the float model's outputs: min ||W X_fp - Ŵ X_q||².

    ``H`` = 2 X_q X_qᵀ / n and ``dXXT`` = 2 (X_fp - X_q) X_qᵀ / n, from the same tokens (e.g.
    ``Hessian.matrix()`` and ``Hessian.cross_matrix()`` of an accumulator fed both inputs);
    ``alpha`` scales the correction (0: GPTQ; 1: the paper's closed form); ``full``: start from
    the least-squares optimum instead (not the paper's). Returns GPTQ's Solution of the corrected
    weights T (see the module docstring), with the loss measured against W*.

    Example::

        >>> Xfp = torch.randn(256, 16)
        >>> Xq = Xfp + 0.1 * torch.randn(256, 16)  # the same tokens, as the quantized model sees them
        >>> h = optq.Hessian(16, normalize_tokens=False, cross=True)
        >>> h.update(Xq, fp=Xfp)
        >>> sol = optq.gptaq(torch.randn(8, 16), h.matrix(), h.cross_matrix(), optq.QuantConfig(group_size=-1))
    """
    return gptaq_with_floor(W, H, dXXT, config, alpha=alpha, full=full)[0]


def gptaq_with_floor(
    W: torch.Tensor,
    H: torch.Tensor,
    dXXT: torch.Tensor,
    config: QuantConfig,
    *,
    alpha: float = DEFAULT_ALPHA,
    full: bool = False,
) -> tuple[Solution, torch.Tensor]:
    """``gptaq``'s Solution and the floor W* its loss is measured against (``floor_weight``), from
    one factorisation (the pipeline reports every objective against W*)."""
    _check(W, H, config)
    _check_cross(W, dXXT, alpha)
    H_caller, perm, U, damp_used, added = factored(W, H, config)
    target, floor = _corrections(W, dXXT, perm, U, (float(alpha), bool(full)))
    if not all_finite(target):
        raise ValueError(
            "the GPTAQ correction W (I + P) is not finite: the float and quantized inputs differ too much "
            "for this Hessian; raise damp or lower alpha"
        )
    sol = sweep(target, (H_caller, perm, U, damp_used, added), config, W.dtype)
    del U, target
    sol.loss = objective(floor, sol.weight.to(_work_dtype(W)), H_caller)
    return sol, floor.to(W.dtype)
