"""The quantization grid: fitting scales and zero points, quantizing and dequantizing.

Conventions (the GPTQ checkpoint's): integer codes q in [0, maxq], maxq = 2^bits - 1, and

    w ≈ scale * (q - zero)

with one (scale, zero) per output row and group of input columns. Symmetric grids fix
zero = 2^(bits-1) and scale = 2 * absmax / maxq; asymmetric grids stretch [min(w, 0), max(w, 0)]
over the codes with an integer zero point. Everything here works on [rows, cols] tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from optq.core.config import QuantConfig
from optq.core.threads import single_threaded

__all__ = [
    "fit",
    "fit_groups",
    "without_hessian",
    "quantize",
    "dequantize",
    "fake_quantize",
    "group_width",
    "group_index",
]


# Elements of ``w`` in one chunk of ``fit_groups``' search (4 MB in float32): on SmolLM2's
# blocks, 1M-element chunks took half the time of 32K ones (more operations, each too short).
_FIT_CHUNK = 1 << 20


def _params_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, config: QuantConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    maxq = config.maxq
    if config.sym:
        absmax = torch.maximum(xmin.abs(), xmax.abs())
        # An all-zero row still needs a usable scale; any positive value reproduces zeros.
        absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        scale = 2 * absmax / maxq
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        xmin = torch.minimum(xmin, torch.zeros_like(xmin))
        xmax = torch.maximum(xmax, torch.zeros_like(xmax))
        empty = (xmax - xmin) == 0
        xmin = torch.where(empty, -torch.ones_like(xmin), xmin)
        xmax = torch.where(empty, torch.ones_like(xmax), xmax)
        scale = (xmax - xmin) / maxq
        zero = torch.round(-xmin / scale).clamp_(0, maxq)
    return scale, zero


def without_hessian(config: QuantConfig) -> QuantConfig:
    """The grid settings of a rounding that reads no Hessian (round-to-nearest): the H-weighted
    search (``mse_hessian``, the default) has no H to weigh by, so each range is min/max, as
    measured best for rounding; the plain search (``mse`` alone) runs as asked."""
    return dataclasses.replace(config, mse=False, mse_hessian=False) if config.mse_hessian else config


def fit(
    w: torch.Tensor, config: QuantConfig, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit one (scale, zero) per row of ``w`` [rows, cols]; returns two [rows] tensors.

    With ``config.mse`` the range is shrunk step by step (up to ``mse_maxshrink``) and, per row,
    the shrink with the least ``sum_j |w_j - dequant(quant(w_j))| ** mse_norm`` is kept. With
    ``config.mse_hessian`` and ``importance`` [cols] (the Hessian's diagonal over these columns)
    column j's term is weighted by ``importance[j]``: at ``mse_norm`` 2 the search then minimises
    the diagonal part of the layer objective. Without ``importance`` the search is unweighted.
    """
    if config.mse and config.mse_hessian and importance is not None and importance.shape != (w.shape[1],):
        raise ValueError(f"importance must be [{w.shape[1]}] for w {tuple(w.shape)}, got {tuple(importance.shape)}")
    return _fit_last_dim(w, config, importance if config.mse_hessian else None)


def _fit_last_dim(
    w: torch.Tensor, config: QuantConfig, importance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fit`` over the last dimension of ``w`` [..., n], ``importance`` broadcasting against it:
    one (scale, zero) per slice. Every slice's arithmetic, its sum included, is that of a ``fit``
    of the slice alone, so fitting many groups in one call gives the same bytes."""
    xmin = w.amin(dim=-1)
    xmax = w.amax(dim=-1)
    scale, zero = _params_from_range(xmin, xmax, config)
    if not config.mse:
        return scale, zero
    weight = None if importance is None else importance.to(w.dtype).clamp(min=0)
    work = torch.empty_like(w)
    best = _rounding_error(w, scale, zero, config, weight, work)
    for i in range(1, int(config.mse_maxshrink * config.mse_grid) + 1):
        p = 1.0 - i / config.mse_grid
        s, z = _params_from_range(p * xmin, p * xmax, config)
        err = _rounding_error(w, s, z, config, weight, work)
        better = err < best
        if better.any():
            best = torch.where(better, err, best)
            scale = torch.where(better, s, scale)
            zero = torch.where(better, z, zero)
    return scale, zero


def _rounding_error(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    config: QuantConfig,
    weight: torch.Tensor | None,
    work: torch.Tensor,
) -> torch.Tensor:
    """``sum(weight * |fake_quantize(w) - w| ** mse_norm)`` over the last dimension, computed in
    ``work`` (w's shape) by ``fake_quantize``'s operations in its order."""
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    dequantize(quantize(w, s, z, config.maxq, out=work), s, z, out=work)
    work.sub_(w).abs_().pow_(config.mse_norm)
    if weight is not None:
        work.mul_(weight)
    return work.sum(dim=-1)


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Integer codes (as w's float dtype) of ``w`` on the grid; scale/zero broadcast against w.
    With ``out`` (w's shape) the codes are computed in it, by the same operations, and returned."""
    if out is None:
        return torch.clamp(torch.round(w / scale) + zero, 0, maxq)
    torch.div(w, scale, out=out)
    return out.round_().add_(zero).clamp_(0, maxq)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``scale * (q - zero)``: the one formula every kernel of the checkpoint format uses. With
    ``out`` (q's shape, ``q`` itself allowed) the values are computed in it and returned."""
    if out is None:
        return scale * (q - zero)
    return torch.sub(q, zero, out=out).mul_(scale)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Round ``w`` to the nearest grid point (quantize then dequantize)."""
    return dequantize(quantize(w, scale, zero, maxq), scale, zero)


def group_width(columns: int, group_size: int) -> int:
    """Columns per group: ``group_size``, or all ``columns`` for ``group_size=-1`` (one group per row)."""
    return columns if group_size == -1 else group_size


def group_index(columns: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    """The natural g_idx [columns] int32: column k belongs to group k // group_size (-1 = one group).

    The one definition of the natural order; checkpoints without act-order (and with
    static groups) store exactly this.
    """
    return torch.arange(columns, device=device, dtype=torch.int32) // group_width(columns, group_size)


def fit_groups(
    w: torch.Tensor, config: QuantConfig, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit (scale, zero) on each natural column group of ``w`` [rows, cols] (see ``group_index``);
    returns two [rows, groups] tensors. A last partial group is fitted on its own columns;
    ``importance`` [cols] weights the ``mse_hessian`` search (see ``fit``).

    Round-to-nearest, OBQ and GPTQ's static groups all fit their grids this way.
    """
    rows, cols = w.shape
    gs = group_width(cols, config.group_size)
    if importance is not None and importance.shape != (cols,):
        raise ValueError(f"importance must be [{cols}] for w {tuple(w.shape)}, got {tuple(importance.shape)}")
    if not config.mse_hessian:
        importance = None
    full = cols - cols % gs
    groups = full // gs
    scale, zero = w.new_empty(rows, 0), w.new_empty(rows, 0)
    # The full groups are searched together, a chunk of rows at a time ([rows, groups, gs] views):
    # one call per group was many small operations, on a CPU with threads that each one forks
    # and joins (on two busy cores a block's search then stalled for minutes). One thread, as in
    # the solver's column loop; the bytes are the same on any thread count.
    with single_threaded(w.device.type == "cpu"):
        if groups:
            imp = None if importance is None else importance[:full].reshape(1, groups, gs)
            step = max(1, _FIT_CHUNK // full)
            chunks = (w[r : r + step, :full].reshape(-1, groups, gs) for r in range(0, rows, step))
            pairs = [_fit_last_dim(chunk, config, imp) for chunk in chunks]
            scale, zero = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        if full < cols:  # a last partial group, on its own columns
            s, z = _fit_last_dim(w[:, full:], config, None if importance is None else importance[full:])
            scale, zero = torch.cat([scale, s.unsqueeze(1)], 1), torch.cat([zero, z.unsqueeze(1)], 1)
    return scale, zero
