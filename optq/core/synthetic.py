"""Synthetic layer inputs that look like a transformer's: for demos, benchmarks and tests."""

from __future__ import annotations

import torch

from optq.core.threads import single_threaded

__all__ = ["correlated_inputs"]


def correlated_inputs(
    tokens: int, dim: int, *, seed: int = 0, outliers: int = 8, outlier_scale: float = 30.0
) -> torch.Tensor:
    """[tokens, dim] float32 inputs with a power-law spectrum and a few outlier channels.

    Real projection inputs are strongly correlated (a decaying spectrum in a random basis) and
    carry a handful of channels with much larger magnitude; both matter to GPTQ (correlation is
    what it exploits, outliers dominate the mean diagonal used for damping).
    """
    g = torch.Generator().manual_seed(seed)
    with single_threaded():  # MKL's threaded QR rounds differently: same seed, same bytes
        basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g))
    spectrum = torch.arange(1, dim + 1, dtype=torch.float32).pow(-0.7)
    X = (torch.randn(tokens, dim, generator=g) * spectrum) @ basis.T
    X[:, torch.randperm(dim, generator=g)[:outliers]] *= outlier_scale
    return X
