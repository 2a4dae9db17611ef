"""The solvers' contract: shapes, dtypes, devices, groups, act-order bookkeeping, OBQ, the grid."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import optq
from optq.core import grid


def problem(rows=12, cols=576, tokens=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, cols, generator=g) @ torch.randn(cols, cols, generator=g) / cols**0.5
    h = optq.Hessian(cols)
    h.update(X)
    return torch.randn(rows, cols, generator=g), h.matrix()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_partial_last_group_and_code_range(bits):
    W, H = problem()  # 576 inputs: 4 groups of 128 and one of 64
    sol = optq.gptq(W, H, optq.QuantConfig(bits=bits, group_size=128))
    assert sol.scales.shape == sol.zeros.shape == (12, 5)
    assert sol.g_idx.tolist() == [k // 128 for k in range(576)]
    assert int(sol.codes.max()) <= 2**bits - 1
    # each row of each group uses at most 2^bits values
    for g in range(5):
        block = sol.weight[:, g * 128 : (g + 1) * 128]
        assert max(len(torch.unique(r)) for r in block) <= 2**bits
    assert torch.all(sol.zeros == 2 ** (bits - 1))  # symmetric zero point


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_are_solved_in_float32(dtype):
    W, H = problem(cols=64)
    W = W.to(dtype)
    cfg = optq.QuantConfig(group_size=32)
    sol = optq.gptq(W, H, cfg)
    # the same weight upcast by the caller, solved as float32: the half input must give exactly
    # this solve, only with the weight rounded once to the input's dtype at the end
    ref = optq.gptq(W.float(), H, cfg)
    assert ref.weight.dtype == ref.scales.dtype == torch.float32
    assert sol.weight.dtype == dtype and sol.scales.dtype == torch.float32
    assert torch.equal(sol.codes, ref.codes)
    assert torch.equal(sol.scales, ref.scales) and torch.equal(sol.zeros, ref.zeros)
    assert torch.equal(sol.weight, ref.weight.to(dtype))
    assert sol.loss == ref.loss
    # and the float32 grid is really used: dequantizing in the input's dtype is not the same
    # (half-precision scales round away most of the grid's precision)
    g = sol.g_idx.long()
    in_dtype = sol.scales.to(dtype)[:, g] * (sol.codes.to(dtype) - sol.zeros.to(dtype)[:, g])
    assert not torch.equal(in_dtype, sol.weight)


def test_act_order_bookkeeping():
    W, H = problem(cols=96)
    H.diagonal().mul_(torch.linspace(0.5, 3.0, 96))  # make the diagonal order non-trivial
    sol = optq.gptq(W, H, optq.QuantConfig(group_size=32, act_order=True, static_groups=False))
    expected_perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    assert torch.equal(sol.perm, expected_perm)
    # column perm[k] is quantized k-th, in group k // 32: g_idx is not monotone
    assert torch.equal(sol.g_idx[sol.perm].long(), torch.arange(96) // 32)
    assert not torch.all(sol.g_idx[1:] >= sol.g_idx[:-1])
    static = optq.gptq(W, H, optq.QuantConfig(group_size=32, act_order=True, static_groups=True))
    assert static.g_idx.tolist() == [k // 32 for k in range(96)]
    # static groups' parameters are fitted on the unquantized W, so they equal round-to-nearest's
    # on the same (unweighted) search, and the default H-weighted search's on W with diag(H)
    plain = optq.gptq(W, H, optq.QuantConfig(group_size=32, act_order=True, mse_hessian=False))
    rtn = optq.rtn(W, optq.QuantConfig(group_size=32, mse_hessian=False))
    assert torch.equal(plain.scales, rtn.scales)
    assert torch.equal(static.scales, grid.fit_groups(W, optq.QuantConfig(group_size=32), H.diagonal())[0])


def test_per_channel_group():
    W, H = problem(cols=50)
    sol = optq.gptq(W, H, optq.QuantConfig(group_size=-1, sym=False))
    assert sol.scales.shape == (12, 1) and sol.g_idx.eq(0).all()


def test_input_validation():
    W, H = problem(cols=16)
    with pytest.raises(ValueError, match=r"H must be \[16, 16\]"):
        optq.gptq(W, H[:8, :8], optq.QuantConfig())
    with pytest.raises(TypeError, match="QuantConfig"):
        optq.gptq(W, H, {"bits": 4})
    with pytest.raises(ValueError, match="2-D"):
        optq.rtn(W[0], optq.QuantConfig())
    bad = W.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        optq.gptq(bad, H, optq.QuantConfig())


def textbook_obq_row(w: torch.Tensor, H: torch.Tensor, s, z, maxq: int) -> torch.Tensor:
    """Greedy OBQ for one row, straight from the method's corollary, with explicit inverses."""
    w = w.clone()
    free = list(range(len(w)))
    codes = torch.zeros(len(w), dtype=torch.float64)
    while free:
        Hinv = torch.linalg.inv(H[free][:, free])  # inverse over the free coordinates, recomputed
        wf = w[free]
        qf = grid.quantize(wf, s[free], z[free], maxq)
        scores = (wf - grid.dequantize(qf, s[free], z[free])) ** 2 / Hinv.diagonal()
        j = int(torch.argmin(scores))
        codes[free[j]] = qf[j]
        err = (wf[j] - grid.dequantize(qf[j], s[free][j], z[free][j])) / Hinv[j, j]
        wf = wf - err * Hinv[:, j]
        for k, idx in enumerate(free):
            w[idx] = wf[k]
        free.pop(j)
    return codes


def test_obq_equals_the_greedy_textbook_and_is_no_worse_than_gptq_here():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(120, 10, generator=g, dtype=torch.float64) @ torch.randn(10, 10, generator=g, dtype=torch.float64)
    h = optq.Hessian(10, dtype=torch.float64)
    h.update(X)
    H = h.matrix()
    W = torch.randn(3, 10, generator=g, dtype=torch.float64)
    cfg = optq.QuantConfig(bits=2, group_size=5, sym=False)
    sol = optq.obq(W, H, cfg)
    Hd = H + cfg.damp * H.diagonal().mean() * torch.eye(10, dtype=torch.float64)
    for r in range(3):
        s, z = sol.scales[r, sol.g_idx.long()], sol.zeros[r, sol.g_idx.long()].double()
        assert torch.equal(textbook_obq_row(W[r], Hd, s, z, cfg.maxq), sol.codes[r].double())
    rtn_loss = optq.objective(W, optq.rtn(W, cfg).weight, H)
    assert sol.loss < rtn_loss


def test_mse_clipping_search_is_the_best_candidate():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 64, generator=g)
    w[:, 0] *= 8  # outliers make clipping worthwhile
    for sym in (True, False):
        cfg = optq.QuantConfig(bits=3, sym=sym, mse=True, mse_grid=20, mse_maxshrink=0.5)
        s, z = grid.fit(w, cfg)
        err = ((grid.fake_quantize(w, s[:, None], z[:, None], cfg.maxq) - w) ** 2).sum(1)
        # brute force over the same candidate shrinks, row by row
        for r in range(6):
            best = float("inf")
            for i in range(0, 11):
                p = 1 - i / 20
                lo, hi = w[r].min() * p, w[r].max() * p
                if sym:
                    si = 2 * torch.maximum(lo.abs(), hi.abs()) / cfg.maxq
                    zi = torch.tensor(4.0)
                else:
                    lo, hi = torch.clamp(lo, max=0), torch.clamp(hi, min=0)
                    si = (hi - lo) / cfg.maxq
                    zi = torch.round(-lo / si)
                best = min(best, float(((grid.fake_quantize(w[r], si, zi, cfg.maxq) - w[r]) ** 2).sum()))
            assert float(err[r]) == pytest.approx(best, rel=1e-5)
        plain = grid.fit(w, optq.QuantConfig(bits=3, sym=sym, mse=False))
        plain_err = ((grid.fake_quantize(w, plain[0][:, None], plain[1][:, None], 7) - w) ** 2).sum(1)
        assert torch.all(err <= plain_err) and torch.any(err < plain_err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    W, H = problem(cols=256)
    cfg = optq.QuantConfig(group_size=128, act_order=True)
    cpu = optq.gptq(W, H, cfg)
    gpu = optq.gptq(W.cuda().half(), H.cuda(), cfg)
    assert gpu.weight.device.type == "cuda" and gpu.weight.dtype == torch.float16
    assert (gpu.codes.cpu() != cpu.codes).float().mean() < 0.01
    assert gpu.loss == pytest.approx(cpu.loss, rel=1e-2)


class Stop(Exception):
    pass


@pytest.mark.parametrize("error", [Stop, KeyboardInterrupt])
def test_thread_count_is_restored_when_the_column_loop_is_interrupted(monkeypatch, error):
    W, H = problem(cols=64)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(torch.get_num_threads())
        raise error()

    monkeypatch.setattr(grid, "dequantize", interrupted)  # called once per column, in the loop
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(error):
            optq.gptq(W, H, optq.QuantConfig(group_size=32, mse=False))  # the range search dequantizes too
        assert calls == [1]  # it did run single-threaded ...
        assert torch.get_num_threads() == 2  # ... and is back to what the caller had
    finally:
        torch.set_num_threads(threads)


def test_solver_output_is_byte_identical_on_one_and_two_threads():
    # MKL's multi-threaded Cholesky rounds differently from its serial one (from about 256
    # columns): without a serial factorisation some codes flip with the thread count.
    g = torch.Generator().manual_seed(7)
    X = torch.randn(600, 320, generator=g) @ torch.randn(320, 320, generator=g) / 320**0.5
    h = optq.Hessian(320)
    h.update(X)
    W = torch.randn(64, 320, generator=g)
    threads = torch.get_num_threads()
    out = {}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out[t] = [
                optq.gptq(W, h.matrix(), optq.QuantConfig(bits=4, group_size=64, act_order=a)) for a in (False, True)
            ]
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(out[1], out[2]):
        assert torch.equal(one.codes, two.codes) and torch.equal(one.weight, two.weight)
        assert torch.equal(one.scales, two.scales) and one.loss == two.loss


def _weighted_brute_force(w, imp, cfg):
    """Row by row, the least importance-weighted squared rounding error over the search's
    candidate shrinks (symmetric grid), computed directly."""
    best = []
    for r in range(w.shape[0]):
        errs = []
        for i in range(int(cfg.mse_maxshrink * cfg.mse_grid) + 1):
            p = 1 - i / cfg.mse_grid
            s = 2 * torch.maximum((w[r].min() * p).abs(), (w[r].max() * p).abs()) / cfg.maxq
            q = torch.clamp(torch.round(w[r] / s) + (cfg.maxq + 1) // 2, 0, cfg.maxq)
            errs.append(float((imp * (s * (q - (cfg.maxq + 1) // 2) - w[r]) ** 2).sum()))
        best.append(min(errs))
    return torch.tensor(best, dtype=torch.float64)


def test_hessian_weighted_mse_search_is_the_best_weighted_candidate():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 32, generator=g)
    w[:, 3] *= 6  # an outlier column the weighted search may clip when it matters little
    imp = torch.rand(32, generator=g) * 10
    imp[3] = 0.01
    cfg = optq.QuantConfig(bits=3, mse=True, mse_hessian=True, mse_grid=20, mse_maxshrink=0.75)
    s, z = grid.fit(w, cfg, imp)
    err = (imp * (grid.fake_quantize(w, s[:, None], z[:, None], cfg.maxq) - w) ** 2).sum(1).double()
    torch.testing.assert_close(err, _weighted_brute_force(w, imp, cfg), rtol=1e-5, atol=0)
    # The unweighted search keeps more of the outlier column's range: its weighted error is worse.
    plain = grid.fit(w, dataclasses.replace(cfg, mse_hessian=False), imp)
    plain_err = (imp * (grid.fake_quantize(w, plain[0][:, None], plain[1][:, None], cfg.maxq) - w) ** 2).sum(1)
    assert torch.all(err <= plain_err.double() + 1e-6) and torch.any(err < plain_err.double() - 1e-6)
    assert torch.any(s < plain[0])
    # Uniform importance is the unweighted search; without importance the search is unweighted.
    for same in (grid.fit(w, cfg, torch.full((32,), 3.0)), grid.fit(w, cfg)):
        assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1])
    with pytest.raises(ValueError, match=r"importance must be \[32\]"):
        grid.fit(w, cfg, imp[:31])


@pytest.mark.parametrize("static", [True, False])
def test_gptq_weights_its_mse_search_by_the_hessian_diagonal(static):
    W, H = problem(rows=6, cols=96)
    H.diagonal().mul_(torch.linspace(0.05, 5.0, 96, dtype=H.dtype))  # importance that differs by column
    cfg = optq.QuantConfig(bits=3, group_size=32, mse=True, mse_hessian=True, mse_grid=20, static_groups=static)
    sol = optq.gptq(W, H, cfg)
    unweighted = optq.gptq(W, H, dataclasses.replace(cfg, mse_hessian=False))
    assert not torch.equal(sol.scales, unweighted.scales)
    if static:  # fitted up front on W's natural groups, weighted by diag(H)
        s, z = grid.fit_groups(W, cfg, H.diagonal().float())
        assert torch.equal(sol.scales, s) and torch.equal(sol.zeros, z)
    else:  # groups follow act-order's positions: renaming the inputs renames the solution
        p = torch.randperm(96, generator=torch.Generator().manual_seed(1))
        moved = optq.gptq(W[:, p], H[p][:, p], cfg)
        assert torch.equal(moved.codes, sol.codes[:, p])
        torch.testing.assert_close(moved.weight, sol.weight[:, p])
    # With every column equally important the weighting changes nothing.
    flat = H.clone()
    flat.diagonal().fill_(float(H.diagonal().mean()))
    a = optq.gptq(W, flat, cfg)
    b = optq.gptq(W, flat, dataclasses.replace(cfg, mse_hessian=False))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    # OBQ fits its groups up front the same way.
    small = dataclasses.replace(cfg, group_size=16)
    o = optq.obq(W[:2, :32], H[:32, :32], small)
    s, z = grid.fit_groups(W[:2, :32], small, H.diagonal()[:32].float())
    assert torch.equal(o.scales, s) and not torch.equal(s, grid.fit_groups(W[:2, :32], small)[0])


def test_round_to_nearest_keeps_min_max_ranges_under_the_default_weighted_search():
    g = torch.Generator().manual_seed(9)
    W = torch.randn(8, 64, generator=g)
    W[:, 5] *= 10  # an outlier that the plain search would clip
    minmax = optq.rtn(W, optq.QuantConfig(bits=3, group_size=32, mse=False))
    default = optq.rtn(W, optq.QuantConfig(bits=3, group_size=32))  # mse and mse_hessian on: no H to weigh by
    plain = optq.rtn(W, optq.QuantConfig(bits=3, group_size=32, mse_hessian=False))  # the unweighted search
    assert torch.equal(default.codes, minmax.codes) and torch.equal(default.scales, minmax.scales)
    assert not default.config.mse and not torch.equal(plain.scales, minmax.scales)
    assert torch.equal(plain.scales, grid.fit_groups(W, optq.QuantConfig(bits=3, group_size=32, mse_hessian=False))[0])
