"""Accumulating the layer Hessian H = 2 X Xᵀ / n from calibration inputs (tokens at unit RMS by default)."""

from __future__ import annotations

import torch

__all__ = ["Hessian"]


class Hessian:
    """Running sum of x xᵀ over calibration tokens for one linear layer's input.

    ``update`` takes inputs of any leading shape ``[..., in_features]``; every row of the
    flattened input is one token. ``normalize_tokens`` (default True, as in QuantConfig and so
    as in ``optq.quantize``) scales each token to unit RMS first, so the objective weighs every
    token equally (see QuantConfig.normalize_tokens); ``normalize_tokens=False`` gives the
    paper's plain H = 2 X Xᵀ / n. The sum (not a running mean) is kept, so ``merge`` of two
    accumulators is exactly the accumulator of the union of their inputs, up to float
    summation order; this is what data-parallel calibration all-reduces.

    Example::

        >>> h = Hessian(8)
        >>> h.update(torch.randn(2, 5, 8))
        >>> h.count, tuple(h.matrix().shape)
        (10, (8, 8))
    """

    def __init__(
        self,
        in_features: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        normalize_tokens: bool = True,
        cross: bool = False,
    ) -> None:
        if not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be a positive integer, got {in_features!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"Hessian accumulates in float32 or float64, not {dtype}")
        self.in_features = in_features
        self.dtype = dtype
        self.normalize_tokens = normalize_tokens
        self.sum = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        # GPTAQ's cross term: the sum of (x_fp - x) xᵀ over the same tokens, at the same scale.
        self.cross_sum = torch.zeros_like(self.sum) if cross else None
        self.count = 0

    def update(self, x: torch.Tensor, weight: torch.Tensor | None = None, *, fp: torch.Tensor | None = None) -> None:
        """Add the tokens of ``x`` ([..., in_features]) to the sum.

        ``weight``: one non-negative weight per token (after normalisation, token t adds
        ``weight[t] x_t x_tᵀ``), e.g. a mixture-of-experts routing weight; None weighs all alike.
        ``fp`` (an accumulator made with ``cross=True``): the same tokens' inputs in the float
        model, x's shape; token t adds s_t² (fp_t - x_t) x_tᵀ to the cross sum, s_t² being what it
        adds x_t x_tᵀ with (its normalisation and weight)."""
        if (fp is not None) != (self.cross_sum is not None):
            raise ValueError("fp= goes with an accumulator made with cross=True, and such one needs it")
        if fp is not None and fp.shape != x.shape:
            raise ValueError(
                f"the float model's input {tuple(fp.shape)} does not pair with the quantized one {tuple(x.shape)}: "
                "GPTAQ needs each token's input in both models"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"input has {x.shape[-1]} features per token, this Hessian expects "
                f"{self.in_features} (shape {tuple(x.shape)})"
            )
        x = x.reshape(-1, self.in_features)
        if x.shape[0] == 0:
            return
        x = raw = x.to(device=self.sum.device, dtype=self.dtype)
        # A NaN/Inf anywhere makes its token's norm (or its feature's column sum) non-finite:
        # one reduction finds a bad batch without an elementwise test of every value.
        if self.normalize_tokens:
            norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
            finite = bool(torch.isfinite(norm).all())
        else:
            finite = bool(torch.isfinite(x.sum(dim=0)).all())
        if not finite:
            bad = int((~torch.isfinite(raw)).sum())
            what = f"{bad} NaN/Inf values (of {raw.numel()})" if bad else "values too large to sum"
            raise ValueError(
                f"calibration input contains {what}: a NaN/Inf weight upstream, a dtype that "
                "overflows on this data (use float32) or bad inputs"
            )
        scales = []  # what each token is multiplied by, applied to fp - x alike
        if self.normalize_tokens:
            # Every token at unit RMS: each weighs the same in the objective, instead of in
            # proportion to its squared norm (a few massive-activation tokens otherwise own H).
            scales.append(torch.where(norm > 0, self.in_features**0.5 / norm, torch.ones_like(norm)))
            x = x * scales[-1]
        if weight is not None:
            weight = weight.reshape(-1).to(device=x.device, dtype=self.dtype)
            if weight.numel() != x.shape[0] or not bool((weight >= 0).all()):
                raise ValueError(
                    f"weight must hold one non-negative value per token ({x.shape[0]}), got shape {tuple(weight.shape)}"
                )
            scales.append(weight.sqrt()[:, None])
            x = x * scales[-1]
        if fp is not None:
            d = fp.reshape(raw.shape).to(device=raw.device, dtype=self.dtype) - raw
            if not bool(torch.isfinite(d.sum(dim=0)).all()):
                raise ValueError("the float model's calibration input contains NaN/Inf values (or values too large)")
            for scale in scales:
                d.mul_(scale)  # d is the subtraction's own tensor: in place, the same products
            self.cross_sum.addmm_(d.T, x)
        self.sum.addmm_(x.T, x)  # in place: no K x K temporary
        self.count += x.shape[0]

    def merge(self, other: Hessian) -> Hessian:
        """Add another accumulator's tokens into this one (in place); returns self."""
        if not isinstance(other, Hessian) or other.in_features != self.in_features:
            raise ValueError("can only merge a Hessian of the same in_features")
        if other.normalize_tokens != self.normalize_tokens:
            raise ValueError("cannot merge Hessians with different normalize_tokens settings")
        if (other.cross_sum is None) != (self.cross_sum is None):
            raise ValueError("cannot merge an accumulator with a cross term (cross=True) and one without")
        self.sum += other.sum.to(device=self.sum.device, dtype=self.dtype)
        if self.cross_sum is not None:
            self.cross_sum += other.cross_sum.to(device=self.sum.device, dtype=self.dtype)
        self.count += other.count
        return self

    def matrix(self) -> torch.Tensor:
        """The Hessian 2 XᵀX / count of the (unit-RMS, by default) tokens; zeros before any update."""
        if self.count == 0:
            return torch.zeros_like(self.sum)
        return self.sum * (2.0 / self.count)

    def cross_matrix(self) -> torch.Tensor:
        """GPTAQ's cross term 2 (X_fp - X) Xᵀ / count, at the scale of ``matrix()`` (``cross=True``)."""
        if self.cross_sum is None:
            raise ValueError("this accumulator has no cross term: make it with cross=True and give fp= to update")
        if self.count == 0:
            return torch.zeros_like(self.cross_sum)
        return self.cross_sum * (2.0 / self.count)

    def __repr__(self) -> str:
        return (
            f"Hessian(in_features={self.in_features}, count={self.count}, dtype={self.dtype}, "
            f"normalize_tokens={self.normalize_tokens})"
        )
