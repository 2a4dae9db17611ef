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

import torch

from optq.core.hessian import Hessian

__all__ = ["LayerHessians", "PLAIN_SAMPLE_EVERY"]

PLAIN_SAMPLE_EVERY = 16  # about one token in this many enters the plain Hessian


def _coprime_stride(target: int, length: int) -> int:
    stride = target
    while math.gcd(stride, length) != 1:
        stride += 1
    return stride


class LayerHessians:
    """``update(x)`` feeds the solver's Hessian (``matrix()``, ``count``) with every token and,
    when it normalises tokens, a plain Hessian (``plain_matrix()``, ``plain_count``) with a
    systematic sample of them. Without normalisation the two are the same matrix."""

    def __init__(self, in_features: int, *, device: torch.device | str | None = None,
                 normalize_tokens: bool = True, sample_every: int | None = None) -> None:
        self.main = Hessian(in_features, device=device, normalize_tokens=normalize_tokens)
        self.plain = Hessian(in_features, device=device, normalize_tokens=False) if normalize_tokens else None
        self.sample_every = PLAIN_SAMPLE_EVERY if sample_every is None else sample_every
        self.stride: int | None = None  # fixed at the first update, from its window length

    @property
    def count(self) -> int:
        """Tokens in the solver's Hessian."""
        return self.main.count

    @property
    def plain_count(self) -> int:
        """Tokens in the plain Hessian."""
        return self.main.count if self.plain is None else self.plain.count

    def update(self, x: torch.Tensor) -> None:
        """Add the tokens of ``x`` ([..., in_features]; ``[batch, length, features]`` for windows)."""
        seen = self.main.count
        self.main.update(x)  # checks the shape and that every value is finite
        if self.plain is None:
            return
        if self.stride is None:
            self.stride = _coprime_stride(self.sample_every, x.shape[-2] if x.dim() >= 3 else 1)
        flat = x.reshape(-1, x.shape[-1])
        # The tokens whose index in the stream of all tokens so far is a multiple of the stride.
        first = -seen % self.stride
        if first < flat.shape[0]:
            self.plain.update(flat[first :: self.stride])

    def matrix(self) -> torch.Tensor:
        """The solver's Hessian."""
        return self.main.matrix()

    def plain_matrix(self) -> torch.Tensor | None:
        """2 X Xᵀ / n of the sampled raw tokens; None without normalisation (then it is ``matrix()``)."""
        return None if self.plain is None else self.plain.matrix()
