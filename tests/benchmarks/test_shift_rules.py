"""benchmarks/shift_rules.py: the per-layer shrink (Ledoit-Wolf intensity over calibration units)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tiny
import torch

from optq.data.tokens import mixed_calibration

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from shift_rules import UnitMoments, layer_shrinks, units_of  # noqa: E402


def direct(units: torch.Tensor) -> float:
    """The formula written out: Σ_{i≠j} s²_ij / k over Σ_{i≠j} mean_ij², s² the unbiased variance."""
    k, d, _ = units.shape
    num = den = 0.0
    for i in range(d):
        for j in range(d):
            if i != j:
                col = [float(units[u, i, j]) for u in range(k)]
                mean = sum(col) / k
                num += sum((c - mean) ** 2 for c in col) / (k - 1) / k
                den += mean**2
    return min(1.0, num / den)


def test_running_moments_give_the_formula():
    g = torch.Generator().manual_seed(0)
    units = torch.randn(5, 4, 4, generator=g, dtype=torch.float64) * 0.3 + torch.ones(4, 4, dtype=torch.float64)
    m = UnitMoments()
    for u in units:
        m.add(u)
    assert m.intensity() == pytest.approx(direct(units), rel=1e-12)
    one = UnitMoments()
    one.add(units[0])
    assert one.intensity() == 0.0  # one unit: no variance to estimate, no shrink


def test_the_intensity_minimises_the_expected_error_of_the_mean():
    # Units are draws around a true matrix M; the shrinkage of their mean's off-diagonal entries
    # that minimises the average squared distance to M over many trials must be what the
    # estimator reports on average.
    g = torch.Generator().manual_seed(1)
    d, k, trials = 6, 4, 1500
    M = torch.randn(d, d, generator=g, dtype=torch.float64)
    M = M @ M.T / d
    off = ~torch.eye(d, dtype=torch.bool)
    draws = M + 0.5 * torch.randn(trials, k, d, d, generator=g, dtype=torch.float64)
    means = draws.mean(1)
    grid = torch.linspace(0, 1, 201, dtype=torch.float64)
    errors = torch.stack([((1 - lam) * means[:, off] - M[off]).pow(2).sum(1).mean() for lam in grid])
    best = float(grid[errors.argmin()])
    estimates = []
    for t in range(trials):
        m = UnitMoments()
        for u in draws[t]:
            m.add(u)
        estimates.append(m.intensity())
    assert 0.2 < best < 0.8  # a case where shrinking matters
    assert sum(estimates) / trials == pytest.approx(best, abs=0.05)


def test_units_follow_the_mixture_draw():
    streams = [torch.full((100,), i) for i in range(3)]
    calib = mixed_calibration(streams, nsamples=8, seqlen=4, seed=0)  # shares 3, 3, 2
    units = units_of(calib, 3)
    assert [u.shape[0] for u in units] == [3, 3, 2]
    assert [set(u.unique().tolist()) for u in units] == [{0}, {1}, {2}]
    assert [u.shape[0] for u in units_of(calib, 1)] == [1] * 8  # one source: one unit per window


def test_layer_shrinks_on_a_tiny_model():
    model = tiny.llama()
    units = [tiny.tokens(2, 16, seed=s) for s in (1, 2, 3)]
    shrinks = layer_shrinks(model, units, batch_size=1)  # two forwards per unit
    attn = "model.layers.1.self_attn"
    assert shrinks[f"{attn}.q_proj"] == shrinks[f"{attn}.k_proj"] == shrinks[f"{attn}.v_proj"]
    # down_proj's λ from its inputs captured here, normalised and averaged per unit.
    seen: list[torch.Tensor] = []
    down = model.model.layers[1].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    hs = []
    with torch.no_grad():
        for u in units:
            seen.clear()
            model(input_ids=u, use_cache=False)
            x = torch.cat(seen).double()
            x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
            hs.append(x.T @ x / x.shape[0])
    handle.remove()
    assert shrinks["model.layers.1.mlp.down_proj"] == pytest.approx(direct(torch.stack(hs)), rel=1e-4)
    assert len(shrinks) == 14 and all(0 <= v <= 1 for v in shrinks.values())
