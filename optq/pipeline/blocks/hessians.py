"""The Hessians of one group of linears: the solver's, and a plain one for the report.

With ``normalize_tokens`` (the default) the solver's Hessian is built from tokens scaled to unit
RMS, so its objective is an error relative to each token's activation norm, not the layer's
output error. The report also gives the plain output error, ½ tr(Δ H_plain Δᵀ) with
H_plain = 2 X Xᵀ / n of the raw inputs. Accumulating H_plain from every token would cost a
second K x K product per token, as much as the solver's Hessian: measured +24% of the quantize
time (one block of SmolLM2-135M's shapes, 128 x 512 tokens, CPU time on one thread; the Hessians
were 26% of it). So H_plain is accumulated from a systematic sample of the tokens, every
``stride``-th token of the calibration stream (stride 16, or the next integer coprime with the
window length, e.g. 17 for 512-token windows), so that the sample visits every position of a
window equally often: the first position, whose massive activations dominate the plain error,
gets exactly its share. Measured the same way: +2.9% (+0.26 s accumulating, +0.13 s for the two
extra objectives, of 16.9 s), and +3.7% (1.8 ms of per-call overhead) on a tiny 2-block model.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from optq.core.hessian import Hessian

__all__ = ["LayerHessians", "PLAIN_SAMPLE_EVERY", "token_energy_stats"]

PLAIN_SAMPLE_EVERY = 16  # about one token in this many enters the plain Hessian


def _coprime_stride(target: int, length: int) -> int:
    stride = target
    while math.gcd(stride, length) != 1:
        stride += 1
    return stride


class LayerHessians:
    """``update(x)`` feeds the solver's Hessian (``matrix()``, ``count``) with every token and,
    when it normalises tokens, a plain Hessian (``plain_matrix()``, ``plain_count``) with a
    systematic sample of them. Without normalisation the two are the same matrix. With ``cross``
    (GPTAQ), ``update(x, fp=x_fp)`` also sums the cross term (``cross_matrix()``) from every token."""

    def __init__(
        self,
        in_features: int,
        *,
        device: torch.device | str | None = None,
        normalize_tokens: bool = True,
        sample_every: int | None = None,
        dtype: torch.dtype = torch.float32,
        cross: bool = False,
    ) -> None:
        self.main = Hessian(in_features, device=device, normalize_tokens=normalize_tokens, dtype=dtype, cross=cross)
        self.plain = (
            Hessian(in_features, device=device, normalize_tokens=False, dtype=dtype) if normalize_tokens else None
        )
        self.sample_every = PLAIN_SAMPLE_EVERY if sample_every is None else sample_every
        self.stride: int | None = None  # fixed at the first update, from its window length
        # Each token's squared norm |x_t|² and its position in its window: the trace of the plain
        # Hessian is their sum, so they show how much of it a few tokens own (the report's
        # calibration statistics). One float per token and position: n x 8 bytes.
        self._energy: list[torch.Tensor] = []
        self._position: list[torch.Tensor] = []
        self._reduced = False  # all_reduce ran: sums and statistics hold every rank's tokens

    @property
    def count(self) -> int:
        """Tokens in the solver's Hessian."""
        return self.main.count

    @property
    def plain_count(self) -> int:
        """Tokens in the plain Hessian."""
        return self.main.count if self.plain is None else self.plain.count

    def update(self, x: torch.Tensor, weight: torch.Tensor | None = None, fp: torch.Tensor | None = None) -> None:
        """Add the tokens of ``x`` ([..., in_features]; ``[batch, length, features]`` for windows).

        ``weight`` (one per token) weighs the solver's Hessian only; the plain one measures the
        layer's own output error. ``fp``: the same tokens' inputs in the float model (``cross``)."""
        seen = self.main.count
        self.main.update(x, weight, fp=fp)  # checks the shapes and that every value is finite
        # A reduction, no copy of x: |x_t| in float32, then squared.
        energy = torch.linalg.vector_norm(x.detach().reshape(-1, x.shape[-1]), dim=1, dtype=torch.float32).pow_(2)
        self._energy.append(energy.cpu())
        if x.dim() >= 3:  # [..., length, features]: windows, so positions are known
            length = x.shape[-2]
            self._position.append(torch.arange(length, dtype=torch.int32).repeat(energy.numel() // length))
        if self.plain is None:
            return
        if self.stride is None:
            self.stride = _coprime_stride(self.sample_every, x.shape[-2] if x.dim() >= 3 else 1)
        flat = x.reshape(-1, x.shape[-1])
        # The tokens whose index in the stream of all tokens so far is a multiple of the stride.
        first = -seen % self.stride
        if first < flat.shape[0]:
            self.plain.update(flat[first :: self.stride])

    def token_stats(self) -> dict[str, float | int | None]:
        """How concentrated the plain Hessian's trace is on a few tokens: see :func:`token_energy_stats`."""
        energy = torch.cat(self._energy) if self._energy else torch.zeros(0)
        positions = torch.cat(self._position) if len(self._position) == len(self._energy) and self._position else None
        return token_energy_stats(energy, positions)

    def all_reduce(self, dist: Any) -> None:
        """Sum over the ranks of ``dist`` (a ``Dist``), in place: the sums, token counts and token
        statistics; every rank then holds the Hessian of all ranks' tokens. Once only."""
        if not dist.active or self._reduced:
            return
        parts = [self.main] + ([self.plain] if self.plain is not None else [])
        counts = torch.tensor([h.count for h in parts], dtype=torch.int64, device=self.main.sum.device)
        cross = [] if self.main.cross_sum is None else [self.main.cross_sum]  # GPTAQ's, summed like H
        dist.all_reduce_([*(h.sum for h in parts), *cross, counts])
        for h, c in zip(parts, counts.tolist()):
            h.count = int(c)
        # The token statistics keep one value per token: every rank gets all of them, in rank order.
        energy = torch.cat(self._energy) if self._energy else torch.zeros(0)
        positions = torch.cat(self._position) if self._position else None
        gathered = dist.all_gather((energy, positions), "all_reduce")
        self._energy = [e for e, _ in gathered]
        self._position = [p for _, p in gathered] if all(p is not None for _, p in gathered) else []
        self._reduced = True

    def matrix(self) -> torch.Tensor:
        """The solver's Hessian."""
        return self.main.matrix()

    def cross_matrix(self) -> torch.Tensor:
        """GPTAQ's cross term 2 (X_fp - X) Xᵀ / n, at the solver's Hessian's scale."""
        return self.main.cross_matrix()

    def plain_matrix(self) -> torch.Tensor | None:
        """2 X Xᵀ / n of the sampled raw tokens; None without normalisation (then it is ``matrix()``)."""
        return None if self.plain is None else self.plain.matrix()


def token_energy_stats(energy: torch.Tensor, positions: torch.Tensor | None = None) -> dict[str, float | int | None]:
    """Shares of Σ_t |x_t|² (the trace of the plain Hessian, up to 2/n) owned by a few tokens.

    ``energy``: each token's squared norm; ``positions``: each token's position in its window
    (None when unknown). Returns ``tokens``; ``top1pct_share``, the share of the largest 1% of
    tokens (at least one); ``position0_share``, the share of the tokens at position 0, against
    ``position0_tokens``, their share of the tokens; ``max_over_median``, the largest squared
    norm over the median one. Without normalisation a few massive-activation tokens (often the
    first of each window) own most of H; that is what these numbers show per layer.
    """
    n = int(energy.numel())
    if n == 0:
        return {
            "tokens": 0,
            "top1pct_share": None,
            "position0_share": None,
            "position0_tokens": None,
            "max_over_median": None,
        }
    e = energy.double()
    total = float(e.sum())
    k = max(1, math.ceil(n / 100))
    top = float(torch.topk(e, k).values.sum())
    median = float(e.median())
    stats: dict[str, float | int | None] = {
        "tokens": n,
        "top1pct_share": top / total if total > 0 else None,
        "position0_share": None,
        "position0_tokens": None,
        "max_over_median": float(e.max()) / median if median > 0 else None,
    }
    if positions is not None and positions.numel() == n:
        first = positions == 0
        stats["position0_share"] = float(e[first].sum()) / total if total > 0 else None
        stats["position0_tokens"] = float(first.double().mean())
    return stats
