"""The method's own results, checked against independent computations on small problems."""

from __future__ import annotations

import math

import pytest
import torch

import optq
from optq.core import grid

torch.set_default_dtype(torch.float32)


def correlated(n: int, d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """n tokens of d strongly correlated features (a random mixing of a decaying spectrum)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=dtype)
    scale = torch.logspace(0, -2, d, dtype=dtype)
    return (torch.randn(n, d, generator=g, dtype=dtype) * scale) @ mix


def hessian_of(X: torch.Tensor) -> torch.Tensor:
    """The paper's plain H = 2XXᵀ/n (no token normalisation)."""
    h = optq.Hessian(X.shape[-1], dtype=X.dtype, normalize_tokens=False)
    h.update(X)
    return h.matrix()


# 1 ------------------------------------------------------------------------------------------
def test_objective_decomposes_over_rows_and_matches_brute_force():
    X = correlated(50, 12, seed=1)  # tokens x d_in
    W = torch.randn(7, 12, dtype=torch.float64)
    W_hat = W + 0.1 * torch.randn(7, 12, dtype=torch.float64)
    full = ((W @ X.T - W_hat @ X.T) ** 2).sum()
    per_row = sum((W[i] - W_hat[i]) @ (X.T @ X) @ (W[i] - W_hat[i]) for i in range(7))
    assert torch.allclose(full, per_row, rtol=1e-12)
    # objective() on the normalised Hessian 2XᵀX/n is the mean squared output error per token
    assert optq.objective(W, W_hat, hessian_of(X)) == pytest.approx(float(full) / 50, rel=1e-12)


# 2 ------------------------------------------------------------------------------------------
def test_single_coordinate_update_is_the_constrained_least_squares_solution():
    d, q = 9, 4
    H = hessian_of(correlated(40, d, seed=2))
    w = torch.randn(d, dtype=torch.float64)
    target = 0.3  # quant(w_q): any fixed value for the coordinate
    Hinv = torch.linalg.inv(H)
    # the closed form of the method
    delta = -(w[q] - target) / Hinv[q, q] * Hinv[:, q]
    cost = (w[q] - target) ** 2 / (2 * Hinv[q, q])
    # independently: minimise ½ δᵀHδ subject to δ_q = target - w_q through the KKT system
    kkt = torch.zeros(d + 1, d + 1, dtype=torch.float64)
    kkt[:d, :d] = H
    kkt[d, q] = kkt[q, d] = 1.0
    rhs = torch.zeros(d + 1, dtype=torch.float64)
    rhs[d] = target - w[q]
    solved = torch.linalg.solve(kkt, rhs)[:d]
    assert torch.allclose(delta, solved, atol=1e-10)
    assert float(0.5 * solved @ H @ solved) == pytest.approx(float(cost), rel=1e-10)
    assert (w + delta)[q] == pytest.approx(target)


# 3 ------------------------------------------------------------------------------------------
def test_rank_one_deletion_equals_inverse_of_the_reduced_hessian():
    d, q = 8, 3
    H = hessian_of(correlated(30, d, seed=3))
    Hinv = torch.linalg.inv(H)
    deleted = Hinv - torch.outer(Hinv[:, q], Hinv[q, :]) / Hinv[q, q]
    keep = [i for i in range(d) if i != q]
    expected = torch.linalg.inv(H[keep][:, keep])
    assert torch.allclose(deleted[keep][:, keep], expected, atol=1e-9)
    assert torch.allclose(deleted[q], torch.zeros(d, dtype=torch.float64), atol=1e-9)


# 4 ------------------------------------------------------------------------------------------
def textbook_gptq(W: torch.Tensor, H: torch.Tensor, cfg: optq.QuantConfig) -> torch.Tensor:
    """The per-coordinate algorithm with explicit rank-one deletions (no Cholesky, no blocks)."""
    rows, d = W.shape
    imp = H.diagonal().clone() if cfg.mse and cfg.mse_hessian else None  # the search's weights: the caller's H
    H = (1 - cfg.diag_shrink) * H + cfg.diag_shrink * torch.diag(H.diagonal())  # toward its diagonal
    H.diagonal().add_(cfg.damp * H.diagonal().mean())
    order = torch.argsort(torch.diagonal(H), descending=True, stable=True) if cfg.act_order else torch.arange(d)
    gs = d if cfg.group_size == -1 else cfg.group_size
    Hinv = torch.linalg.inv(H)
    w = W.clone()
    codes = torch.zeros(rows, d, dtype=torch.float64)
    params = {}
    if cfg.static_groups:
        for g in range(math.ceil(d / gs)):
            cols = slice(g * gs, (g + 1) * gs)
            params[g] = grid.fit(W[:, cols], cfg, None if imp is None else imp[cols])
    for pos, q in enumerate(order.tolist()):
        if cfg.static_groups:
            s, z = params[q // gs]
        elif pos % gs == 0:
            cols = order[pos : pos + gs]
            s, z = grid.fit(w[:, cols], cfg, None if imp is None else imp[cols])
        c = grid.quantize(w[:, q], s, z, cfg.maxq)
        codes[:, q] = c
        err = (w[:, q] - grid.dequantize(c, s, z)) / Hinv[q, q]
        w -= torch.outer(err, Hinv[q, :])
        Hinv -= torch.outer(Hinv[:, q], Hinv[q, :]) / Hinv[q, q]
    return codes


@pytest.mark.parametrize(
    "group_size,act_order,static_groups",
    [
        (-1, False, False),
        (16, False, False),
        (13, False, False),
        (16, True, False),
        (13, True, False),
        (16, True, True),
    ],
)
@pytest.mark.parametrize("shrink", [0.0, 0.5])  # plain GPTQ, optq's default
@pytest.mark.parametrize("search", ["minmax", "hmse"])  # min/max ranges; the H-weighted search (the default)
def test_blocked_solver_equals_textbook_loop(group_size, act_order, static_groups, shrink, search):
    # Asymmetric grid: a symmetric grid puts ±absmax exactly on a rounding tie (±(2^b - 1)/2),
    # where float-order differences legitimately pick either neighbour at equal cost.
    d = 40
    H = hessian_of(correlated(200, d, seed=4))
    W = torch.randn(6, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    kw = dict(
        bits=3,
        group_size=group_size,
        sym=False,
        act_order=act_order,
        static_groups=static_groups,
        diag_shrink=shrink,
        mse=search == "hmse",
    )
    expected = textbook_gptq(W, H, optq.QuantConfig(**kw))
    for block in (1, 7, 128):
        sol = optq.gptq(W, H, optq.QuantConfig(**kw, block_size=block))
        assert torch.equal(sol.codes.double(), expected), f"block_size={block}"


# 5 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sym", [True, False])
def test_diagonal_hessian_gives_round_to_nearest(sym):
    g = torch.Generator().manual_seed(6)
    W = torch.randn(32, 100, generator=g)
    H = torch.diag(torch.rand(100, generator=g) + 0.1)
    for act_order in (False, True):
        for mse in (False, True):  # min/max ranges, and the unweighted search rounding uses
            cfg = optq.QuantConfig(
                bits=4, group_size=-1 if act_order else 32, sym=sym, act_order=act_order, mse=mse, mse_hessian=False
            )
            assert torch.equal(optq.gptq(W, H, cfg).codes, optq.rtn(W, cfg).codes)


def test_gptq_beats_round_to_nearest_on_correlated_inputs_over_many_seeds():
    ratios = []
    for seed in range(20):
        X = correlated(256, 64, seed=seed, dtype=torch.float32)
        H = hessian_of(X)
        W = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + seed))
        cfg = optq.QuantConfig(bits=3, group_size=32)
        ratios.append(optq.gptq(W, H, cfg).loss / optq.objective(W, optq.rtn(W, cfg).weight, H))
    assert max(ratios) <= 1.0
    assert sum(ratios) / len(ratios) < 0.7  # clearly below, not merely equal


# 6 ------------------------------------------------------------------------------------------
def test_growing_damping_approaches_round_to_nearest():
    H = hessian_of(correlated(256, 48, seed=7))
    W = torch.randn(24, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    rtn = optq.rtn(W, optq.QuantConfig(bits=3, group_size=16, sym=False, mse=False))
    mismatch = []
    for damp in (0.01, 1.0, 1e2, 1e6):  # on rounding's grid: min/max ranges
        cfg = optq.QuantConfig(bits=3, group_size=16, sym=False, damp=damp, damp_max=damp, mse=False)
        mismatch.append(int((optq.gptq(W, H, cfg).codes != rtn.codes).sum()))
    assert mismatch[0] > 0
    assert mismatch == sorted(mismatch, reverse=True)
    assert mismatch[-1] == 0


# 7 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["gptq", "gptq-act", "gptq-static", "rtn", "obq"])
def test_weight_is_exactly_the_dequantized_codes(method):
    H = hessian_of(correlated(128, 24, seed=9, dtype=torch.float32))
    W = torch.randn(5, 24)
    cfg = optq.QuantConfig(
        bits=3,
        group_size=10,
        act_order=method != "gptq" and method.startswith("gptq"),
        static_groups=method == "gptq-static",
        sym=False,
    )
    sol = {"rtn": lambda: optq.rtn(W, cfg), "obq": lambda: optq.obq(W, H, cfg)}.get(
        method, lambda: optq.gptq(W, H, cfg)
    )()
    assert sol.codes.dtype == torch.uint8 and int(sol.codes.max()) <= 7
    for n in range(5):
        for k in range(24):
            g = int(sol.g_idx[k])
            value = sol.scales[n, g] * (sol.codes[n, k].float() - sol.zeros[n, g].float())
            assert sol.weight[n, k] == value


# 8 ------------------------------------------------------------------------------------------
def test_rank_deficient_hessian_is_handled_by_damping():
    X = correlated(6, 32, seed=10, dtype=torch.float32)  # 6 tokens, 32 inputs: rank 6
    H = hessian_of(X)
    W = torch.randn(8, 32)
    sol = optq.gptq(W, H, optq.QuantConfig(bits=4, group_size=16, damp=0.0, diag_shrink=0.0))  # H singular
    assert torch.isfinite(sol.weight).all()
    assert sol.damp > 0.0  # escalated from 0, and recorded
    assert sol.loss <= optq.objective(W, optq.rtn(W, optq.QuantConfig(bits=4, group_size=16)).weight, H)


def test_impossible_hessian_raises_a_clear_error_and_never_nan():
    W = torch.randn(4, 8)
    with pytest.raises(optq.FactorizationError, match="raise damp"):
        optq.gptq(W, -torch.eye(8), optq.QuantConfig(damp_max=0.1))
    H = torch.eye(8)
    H[2, 3] = float("nan")
    with pytest.raises(optq.FactorizationError, match="NaN"):
        optq.gptq(W, H, optq.QuantConfig())


def test_dead_inputs_are_rounded_and_kept():
    X = correlated(64, 16, seed=11, dtype=torch.float32)
    X[:, 3] = 0.0
    W = torch.randn(4, 16)
    for mse in (False, True):  # min/max ranges; the default H-weighted search, where it weighs nothing
        cfg = optq.QuantConfig(bits=4, group_size=-1, mse=mse)
        sol = optq.gptq(W, hessian_of(X), cfg)
        # the dead column is not zeroed: it is rounded on its grid, as round-to-nearest would
        rounded = grid.quantize(W[:, 3:4], sol.scales, sol.zeros.float(), cfg.maxq)[:, 0]
        assert torch.equal(sol.codes[:, 3].float(), rounded.float())
        if not mse:
            assert torch.equal(sol.codes[:, 3], optq.rtn(W, cfg).codes[:, 3])
    assert torch.isfinite(sol.weight).all()


# the objective and the solution's loss ------------------------------------------------------
@pytest.mark.parametrize("act_order", [False, True])
def test_reported_loss_is_the_objective_on_the_undamped_hessian(act_order):
    X = correlated(100, 30, seed=12)
    X[:, 7] = 0.0  # a dead input too
    H = hessian_of(X)
    W = torch.randn(9, 30, dtype=torch.float64)
    sol = optq.gptq(W, H, optq.QuantConfig(bits=2, group_size=8, act_order=act_order, damp=0.05))
    assert sol.loss == pytest.approx(optq.objective(W, sol.weight, H), rel=1e-9)
    obq = optq.obq(W, H, optq.QuantConfig(bits=2, group_size=8))
    assert obq.loss == pytest.approx(optq.objective(W, obq.weight, H), rel=1e-9)


# shrinking H toward its diagonal ------------------------------------------------------------
@pytest.mark.parametrize("act_order", [False, True])
def test_diag_shrink_solves_the_shrunk_hessian_and_reports_on_the_callers(act_order):
    X = correlated(200, 40, seed=21)
    H = hessian_of(X)
    W = torch.randn(12, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(22))
    base = optq.QuantConfig(bits=3, group_size=8, act_order=act_order, diag_shrink=0.0)
    for s in (0.3, 0.9):
        shrunk = (1 - s) * H + s * torch.diag(H.diagonal())  # built here, independently
        sol = optq.gptq(W, H, optq.QuantConfig(**{**base.to_dict(), "diag_shrink": s}))
        ref = optq.gptq(W, shrunk, base)
        assert torch.equal(sol.codes, ref.codes)
        torch.testing.assert_close(sol.weight, ref.weight, rtol=1e-12, atol=0)  # (1-s)h + sh vs h: last bits
        assert sol.loss == pytest.approx(optq.objective(W, sol.weight, H), rel=1e-9)
        assert sol.loss != pytest.approx(ref.loss, rel=1e-6)  # ref's loss is on the shrunk H
    # Shrunk all the way, H is diagonal: no compensation, round-to-nearest exactly.
    full = optq.gptq(W, H, optq.QuantConfig(**{**base.to_dict(), "diag_shrink": 1.0}))
    unweighted = {**base.to_dict(), "mse_hessian": False}  # the search rounding can run too: unweighted
    same_grid = optq.gptq(W, H, optq.QuantConfig(**{**unweighted, "diag_shrink": 1.0}))
    assert torch.equal(same_grid.codes, optq.rtn(W, optq.QuantConfig(**unweighted)).codes)
    # And on its own H, GPTQ is at least as good as any shrunk solve.
    plain = optq.gptq(W, H, base).loss
    assert plain <= min(sol.loss, full.loss)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_diag_shrink_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="diag_shrink"):
        optq.QuantConfig(diag_shrink=bad)
