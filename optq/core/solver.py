"""Hessian-aware rounding of one weight matrix: GPTQ, its greedy ancestor OBQ, and round-to-nearest.

Symbols follow the paper. For a linear layer with weight W [rows, cols] (nn.Linear layout: one
row per output channel, one column per input channel) and calibration inputs X [cols, n]:

    H     = 2 X Xᵀ / n, the Hessian of the layer objective ||W X - Ŵ X||² / n (shared by rows)
    Hinv  = the upper Cholesky factor U of H⁻¹ (H⁻¹ = Uᵀ U); row q of U holds, scaled by U_qq,
            the OBS update direction for column q once columns < q are fixed
    Err   = (w_q - quant(w_q)) / U_qq for each quantized column, the scaled errors that the lazy
            block update pushes onto the later columns

The layer objective reported is ``objective(W, Ŵ, H) = ½ tr((W-Ŵ) H (W-Ŵ)ᵀ)``, the mean squared
output error per calibration token when H is ``Hessian.matrix()``.
"""

from __future__ import annotations

import math

import torch

from optq.core import grid
from optq.core.config import QuantConfig
from optq.core.factor import FactorizationError, all_finite, inverse_factor
from optq.core.threads import single_threaded

__all__ = ["Solution", "FactorizationError", "gptq", "rtn", "objective"]


class Solution:
    """A quantized weight matrix. ``weight`` is exactly the dequantization of the others:

    ``weight == (scales[:, g_idx] * (codes - zeros[:, g_idx])).to(W.dtype)``.

    Attributes:
        weight: [rows, cols] dequantized weight, the input's dtype and device.
        codes: [rows, cols] uint8 codes in [0, 2^bits - 1], natural column order (stored, or,
            after ``drop_codes``, recomputed exactly from ``weight`` on each access).
        scales: [rows, groups] float32 (float64 when W is float64).
        zeros: [rows, groups] int32 zero points (2^(bits-1) for symmetric grids).
        g_idx: [cols] int32 group of each input column.
        perm: [cols] int64 order in which columns were quantized (identity without act_order).
        loss: layer objective ½ tr(ΔHΔᵀ) reached on the undamped H (None for rtn).
        damp: damping fraction of the mean diagonal finally used (None for rtn).
        config: the settings used.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor,
        perm: torch.Tensor,
        loss: float | None,
        damp: float | None,
        config: QuantConfig,
    ) -> None:
        self.weight = weight
        self.codes = codes
        self.scales = scales
        self.zeros = zeros
        self.g_idx = g_idx
        self.perm = perm
        self.loss = loss
        self.damp = damp
        self.config = config

    @property
    def codes(self) -> torch.Tensor:
        """[rows, cols] uint8 codes, natural column order (see ``drop_codes``)."""
        if self._codes is not None:
            return self._codes
        self._check_weight_unchanged()
        return self._codes_from_weight()

    @codes.setter
    def codes(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"codes must be a tensor, got {type(value).__name__}")
        self._codes: torch.Tensor | None = value
        # After drop_codes: the weight tensor the codes are recomputed from and its version
        # counter then (torch bumps it on every in-place change, through views too).
        self._dropped_from: tuple[torch.Tensor, int] | None = None

    def __repr__(self) -> str:
        rows, cols = self.weight.shape
        return (
            f"Solution({rows}x{cols} {self.weight.dtype}, bits={self.config.bits}, "
            f"groups={self.scales.shape[1]}, loss={self.loss}, damp={self.damp}, "
            f"codes={'stored' if self._codes is not None else 'from weight'})"
        )

    def dequantize(self) -> torch.Tensor:
        """Recompute the weight (in the scales' dtype) from codes, scales, zeros and g_idx."""
        g = self.g_idx.long()
        s = self.scales[:, g]
        return grid.dequantize(self.codes.to(s.dtype), s, self.zeros[:, g].to(s.dtype))

    def _check_weight_unchanged(self) -> None:
        weight, version = self._dropped_from
        if self.weight is not weight or weight._version != version:
            raise RuntimeError(
                "the codes of this solution were dropped (see Solution.drop_codes) and its weight, "
                "the model's own, has been replaced or modified in place since (load_state_dict, "
                "training, another quantization); save the checkpoint before changing the model"
            )

    def _codes_from_weight(self) -> torch.Tensor:
        g = self.g_idx.long()
        s = self.scales[:, g]
        w = self.weight.to(device=s.device, dtype=s.dtype)
        return grid.quantize(w, s, self.zeros[:, g].to(s.dtype), self.config.maxq).to(torch.uint8)

    def drop_codes(self) -> bool:
        """Stop storing ``codes`` if they can be recomputed exactly from ``weight`` (then
        ``codes`` is recomputed on every access); returns whether they were dropped.

        ``weight`` is ``scale * (code - zero)`` rounded to its dtype, so ``round(weight / scale)
        + zero`` gives the code back whenever that rounding is finer than half a grid step
        (float32, float16; not bfloat16 at 8 bits). This is checked, not assumed. The pipeline
        uses it to keep one byte per weight fewer while a model is quantized; ``weight`` must then
        stay the same, unchanged tensor (it is the model's own weight there): reading ``codes``
        after ``weight`` was replaced or changed in place raises RuntimeError instead of
        returning other codes.
        """
        if self._codes is None:  # dropped already: still recomputable?
            self._check_weight_unchanged()
            return True
        if not torch.equal(self._codes_from_weight(), self._codes.to(self.scales.device)):
            return False
        self._codes = None
        self._dropped_from = (self.weight, self.weight._version)
        return True


def objective(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """½ tr((W - Ŵ) H (W - Ŵ)ᵀ): the layer's output error under Hessian H (float64 sum)."""
    delta = (W.to(H.dtype) - W_hat.to(H.dtype)).to(H.device)
    return 0.5 * float(((delta @ H) * delta).sum(dtype=torch.float64))


def _work_dtype(W: torch.Tensor) -> torch.dtype:
    # Half-precision weights are solved in float32; float64 stays float64 (exact tests).
    return torch.float64 if W.dtype == torch.float64 else torch.float32


def _check(W: torch.Tensor, H: torch.Tensor | None, config: QuantConfig) -> None:
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an optq.QuantConfig, got {type(config).__name__}")
    if W.dim() != 2 or not W.is_floating_point():
        raise ValueError(f"W must be a 2-D float tensor [out, in], got {W.dtype} {tuple(W.shape)}")
    if not all_finite(W):
        raise ValueError("W contains NaN or Inf values")
    if H is not None and H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(f"H must be [{W.shape[1]}, {W.shape[1]}] for W {tuple(W.shape)}, got {tuple(H.shape)}")


_SUB_BLOCK = 16  # columns per inner lazy sub-block (rank-one updates stay inside it)


def _current(
    Wt: torch.Tensor, U: torch.Tensor, Err: torch.Tensor, cols: tuple[int, int], blocks: tuple[int, int, int, int]
) -> torch.Tensor:
    """Columns ``cols`` = [pos, end) of the weight as they stand after every error pushed so far.

    ``blocks`` = (i1, i2, j1, j2): inside the current sub-block [j1, j2) the rank-one updates are
    applied eagerly; the rest of the block [j2, i2) still lacks this sub-block's errors
    Err[j1:pos]; columns past the block lack all of the block's errors Err[i1:pos].
    """
    (pos, end), (i1, i2, j1, j2) = cols, blocks
    parts = [Wt[pos : min(end, j2)]]
    if end > j2:
        hi = min(end, i2)
        parts.append(Wt[j2:hi] - U[j1:pos, j2:hi].T @ Err[j1:pos])
    if end > i2:
        parts.append(Wt[i2:end] - U[i1:pos, i2:end].T @ Err[i1:pos])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def gptq(W: torch.Tensor, H: torch.Tensor, config: QuantConfig) -> Solution:
    """Quantize W [rows, cols] with GPTQ under Hessian H [cols, cols] (e.g. ``Hessian.matrix()``).

    One column order for all rows, all rows at once, U from one Cholesky factorisation, errors
    pushed onto later columns lazily in blocks of ``config.block_size``. With ``act_order``
    columns go by descending diag(H); group parameters are fitted when a group starts, from the
    error-updated weights (or, with ``static_groups``, up front from W in natural order).
    """
    _check(W, H, config)
    return sweep(W, factored(W, H, config), config, W.dtype)


def factored(W: torch.Tensor, H: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, ...]:
    """What the column sweep needs of H: (the caller's H on W's device, the column order perm,
    U in that order, the damping fraction used, the diagonal added to H), after ``diag_shrink``
    and damping (escalated as ``inverse_factor`` does)."""
    cols, device = W.shape[1], W.device
    H = H_caller = H.to(device)
    if config.diag_shrink:  # toward the diagonal: (1 - s) H + s diag(H)
        H = H * (1.0 - config.diag_shrink)
        H.diagonal().copy_(H_caller.diagonal())
    if config.act_order:
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    else:
        perm = torch.arange(cols, device=device)
    order = perm if config.act_order else None
    U, damp_used, added = inverse_factor(H, config.damp, config.damp_max, order, _work_dtype(W))
    return H_caller, perm, U, damp_used, added


def sweep(W: torch.Tensor, factors: tuple[torch.Tensor, ...], config: QuantConfig, dtype: torch.dtype) -> Solution:
    """GPTQ's column sweep of W [rows, cols] with ``factors`` (see ``factored``): the Solution,
    its weight in ``dtype``, its loss ½ tr((W - Ŵ) H (W - Ŵ)ᵀ) on the caller's H."""
    H_caller, perm, U, damp_used, added = factors
    del factors
    rows, cols = W.shape
    out_dtype, dtype = dtype, _work_dtype(W)
    device = W.device
    maxq = config.maxq
    gs = grid.group_width(cols, config.group_size)
    n_groups = math.ceil(cols / gs)

    # Work transposed ([cols, rows], contiguous): a column of W is then one contiguous vector,
    # so the per-column rounding and rank-one updates stream through memory.
    Wt = W.to(dtype).T.contiguous()
    if config.act_order:
        Wt = Wt.index_select(0, perm)
    scales = torch.empty(n_groups, rows, dtype=dtype, device=device)
    zeros = torch.empty(n_groups, rows, dtype=dtype, device=device)
    natural = grid.group_index(cols, config.group_size, device)
    if config.natural_groups:
        g_idx = natural
    else:
        g_idx = torch.empty(cols, dtype=torch.int32, device=device)
        g_idx[perm] = natural
    group_of_pos = g_idx[perm].tolist()  # group of the column quantized at each position
    # --mse-hessian weights each column's rounding error by H's diagonal (natural column order).
    importance = H_caller.diagonal().to(dtype) if config.mse and config.mse_hessian else None
    if config.static_groups:
        static_scales, static_zeros = grid.fit_groups(W.to(dtype), config, importance)
        scales.copy_(static_scales.T)
        zeros.copy_(static_zeros.T)
        del static_scales, static_zeros
    fit_at = set() if config.static_groups else set(range(0, cols, gs))
    diag = U.diagonal().tolist()

    # Codes are rounded in the working dtype one block at a time, then stored as bytes: a
    # [cols, rows] float buffer would cost as much as W itself.
    codes = torch.empty(cols, rows, dtype=torch.uint8, device=device)
    block_codes = torch.empty(min(config.block_size, cols), rows, dtype=dtype, device=device)
    Err = torch.empty(cols, rows, dtype=dtype, device=device)  # row q: Err of column q
    B = config.block_size
    b = min(_SUB_BLOCK, B)
    # The column loop is thousands of tiny ops: on CPU, forking threads for each costs more than
    # it saves (and stalls badly when other processes share the cores). The block-level GEMMs
    # below stay multi-threaded.
    serial = device.type == "cpu"
    for i1 in range(0, cols, B):
        i2 = min(i1 + B, cols)
        with single_threaded(serial):
            # Two levels of laziness: rank-one updates only inside sub-blocks of b columns, one
            # GEMM per sub-block for the rest of the block, one GEMM per block for later columns.
            for j1 in range(i1, i2, b):
                j2 = min(j1 + b, i2)
                for pos in range(j1, j2):
                    g = group_of_pos[pos]
                    if pos in fit_at:
                        part = _current(Wt, U, Err, (pos, min(pos + gs, cols)), (i1, i2, j1, j2))
                        imp = None if importance is None else importance[perm[pos : pos + part.shape[0]]]
                        scales[g], zeros[g] = grid.fit(part.T, config, imp)
                    s, z = scales[g], zeros[g]
                    w = Wt[pos]
                    q = block_codes[pos - i1]
                    grid.quantize(w, s, z, maxq, out=q)
                    e = Err[pos]
                    dq = grid.dequantize(q, s, z)
                    torch.sub(w, dq, out=e)
                    e.div_(diag[pos])
                    w.copy_(dq)  # the finished column now holds its dequantized value
                    if pos + 1 < j2:
                        Wt[pos + 1 : j2].addr_(U[pos, pos + 1 : j2], e, alpha=-1)
                if j2 < i2:
                    Wt[j2:i2].addmm_(U[j1:j2, j2:i2].T, Err[j1:j2], alpha=-1)
        codes[i1:i2].copy_(block_codes[: i2 - i1])
        if i2 < cols:
            Wt[i2:].addmm_(U[i1:i2, i2:].T, Err[i1:i2], alpha=-1)
    del U

    del block_codes
    # Back to natural column order and [rows, cols]: position p holds column perm[p].
    if config.act_order:
        codes = torch.empty_like(codes).index_copy_(0, perm, codes)
        weight = torch.empty(rows, cols, dtype=dtype, device=device)
        weight.T.index_copy_(0, perm, Wt)  # no permuted copy of Wt on the way
    else:
        weight = Wt.T.contiguous()  # exactly scale * (code - zero), as computed in the loop
    del Wt
    sol = Solution(
        weight=weight.to(out_dtype),
        codes=codes.T.contiguous(),
        scales=scales.T.contiguous(),
        zeros=zeros.T.to(torch.int32).contiguous(),
        g_idx=g_idx.to(torch.int32),
        perm=perm.to(torch.int64),
        loss=None,
        damp=damp_used,
        config=config,
    )
    # The objective without another [rows, cols] x [cols, cols] product: GPTQ's final error is
    # Δ = Err U (permuted), so ½ tr(Δ H_d Δᵀ) = ½ ||Err||² exactly for the damped H_d = H + diag(added);
    # remove what the added diagonal contributed to get the objective on the caller's H.
    # (float32 sums are pairwise and accurate here; float64 would double the memory traffic;
    # one thread, because a parallel sum's rounding depends on how the threads split it)
    with single_threaded(serial):
        if config.diag_shrink:  # the solver's H is not the caller's: one product on the caller's
            sol.loss = objective(W, weight, H_caller)
        else:
            delta_sq = (W.to(dtype) - weight).square_().sum(0)
            sol.loss = 0.5 * (float(Err.square_().sum()) - float(added @ delta_sq))
    return sol


def _solution(
    W: torch.Tensor,
    H: torch.Tensor | None,
    grid_parts: tuple[torch.Tensor, ...],
    damp: float | None,
    config: QuantConfig,
) -> Solution:
    """The Solution of ``W`` from ``grid_parts`` = (codes, scales, zeros, g_idx, perm), with its
    loss on ``H`` (None: round-to-nearest, no loss) and the damping used."""
    codes, scales, zeros, g_idx, perm = grid_parts
    sol = Solution(
        weight=W,  # placeholder, replaced just below
        codes=codes.to(torch.uint8),
        scales=scales,
        zeros=zeros.to(torch.int32),
        g_idx=g_idx.to(torch.int32),
        perm=perm.to(torch.int64),
        loss=None,
        damp=damp,
        config=config,
    )
    weight = sol.dequantize()  # in the scales' dtype: exactly what the solver rounded to
    if H is not None:
        sol.loss = objective(W, weight, H.to(device=W.device, dtype=_work_dtype(W)))
    sol.weight = weight.to(W.dtype)
    return sol


def rtn(W: torch.Tensor, config: QuantConfig) -> Solution:
    """Round-to-nearest on the same grid as ``gptq`` (groups in natural column order); it reads
    no Hessian, so the default H-weighted range search leaves its ranges min/max
    (``grid.without_hessian``)."""
    _check(W, None, config)
    config = grid.without_hessian(config)
    rows, cols = W.shape
    Wf = W.to(_work_dtype(W))
    scales, zeros = grid.fit_groups(Wf, config)
    g_idx = grid.group_index(cols, config.group_size, W.device)
    codes = grid.quantize(Wf, scales[:, g_idx], zeros[:, g_idx], config.maxq)
    perm = torch.arange(cols, device=W.device)
    return _solution(W, None, (codes, scales, zeros, g_idx, perm), None, config)
