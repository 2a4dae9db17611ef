"""A per-layer shrink toward the diagonal, chosen from the layer's own calibration statistics.

The rule (Ledoit & Wolf 2004; Schäfer & Strimmer 2005, target "D"): when H is the mean of k
independent units' Hessians H_u, the shrinkage (1 - λ) H + λ diag(H) that minimises the expected
squared error of H's off-diagonal entries is

    λ = Σ_{i≠j} Var(h̄_ij) / Σ_{i≠j} E[h̄_ij]²,   estimated as   Σ_{i≠j} s²_ij / k  /  Σ_{i≠j} h̄_ij²

(s² the unbiased variance of the units' entries), clamped to [0, 1]. The unit decides what the
shrinkage guards against. With a mixture of calibration sources the units are the sources:
the serving text is one more draw from a population of texts, and λ is large where the sources
disagree on a layer's input correlations. With one source the units are its windows, and λ only
measures sampling noise (small at 32 x 512 tokens: benchmarks/shift_lw.py).

This is the benchmark's prototype of the rule: λ comes from the fp model's activations (the
pipeline would see the partly quantized model's) and travels to the solver as per-layer
``diag_shrink`` overrides (``RunSettings.overrides``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class UnitMoments:
    """Welford's running mean and sum of squared deviations of the units' matrices."""

    def __init__(self) -> None:
        self.k = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, h: torch.Tensor) -> None:
        h = h.double()
        self.k += 1
        if self.mean is None:
            self.mean, self.m2 = h.clone(), torch.zeros_like(h)
            return
        delta = h - self.mean
        self.mean += delta / self.k
        self.m2 += delta * (h - self.mean)

    def intensity(self) -> float:
        """λ of the module docstring; 0 with fewer than two units (no variance to estimate)."""
        if self.k < 2 or self.mean is None or self.m2 is None:
            return 0.0
        off = ~torch.eye(self.mean.shape[0], dtype=torch.bool, device=self.mean.device)
        noise = (self.m2[off] / (self.k - 1)).sum() / self.k
        signal = self.mean[off].pow(2).sum()
        return float(min(1.0, noise / signal)) if signal > 0 else 1.0


def units_of(calibration: torch.Tensor, sources: int) -> list[torch.Tensor]:
    """The calibration windows cut into units: one per source for a mixture (rows come source by
    source, ``n // k`` each and one more for the first ``n % k``, as
    ``optq.data.tokens.mixed_calibration`` draws them), else one per window."""
    n = calibration.shape[0]
    if sources < 2:
        return [calibration[i : i + 1] for i in range(n)]
    shares = [n // sources + (i < n % sources) for i in range(sources)]
    return list(torch.split(calibration, shares))


def layer_shrinks(model: nn.Module, units: Sequence[torch.Tensor], batch_size: int = 8) -> dict[str, float]:
    """λ for every linear of the decoder blocks, from the fp model's inputs to it (tokens at
    unit RMS, as optq's Hessians). Linears reading one input (q/k/v, gate/up) share a λ."""
    from optq.formats.linears import find_linears
    from optq.pipeline.discovery import find_blocks

    prefix, blocks = find_blocks(model)
    linears = {n: m for i, b in enumerate(blocks) for n, m in find_linears(b, f"{prefix}.{i}").items()}
    reader: dict[str, str] = {}  # linear -> the linear whose input it reads (q/k/v: q's)
    moments: dict[str, UnitMoments] = {}
    unit_sum: dict[str, list] = {}
    last: list = [None, ""]  # the input tensor last taken, and by whom (held, so never reused)

    def hook(name: str):
        def grab(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0]
            if x is last[0]:  # the linear before this one read the same tensor
                reader[name] = last[1]
                return
            last[0], last[1] = x, name
            reader[name] = name
            x = x.detach().reshape(-1, x.shape[-1]).float()
            x = x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
            acc = unit_sum.setdefault(name, [0, 0])
            acc[0], acc[1] = acc[0] + x.T @ x, acc[1] + x.shape[0]

        return grab

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            for unit in units:
                for b in range(0, unit.shape[0], batch_size):
                    model(input_ids=unit[b : b + batch_size], use_cache=False)
                    last[0] = None
                for name, (total, count) in unit_sum.items():
                    moments.setdefault(name, UnitMoments()).add(total / count)
                unit_sum.clear()
    finally:
        for h in handles:
            h.remove()
    return {name: moments[reader[name]].intensity() for name in linears}
