"""optq.Solution: its fields, codes dropped and recomputed from the weight, and the guard on that."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import optq
from optq.core import grid


def solved(act_order: bool = False, dtype: torch.dtype = torch.float32) -> optq.Solution:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 64, generator=g)
    h = optq.Hessian(64)
    h.update(X)
    W = torch.randn(8, 64, generator=g).to(dtype)
    return optq.gptq(W, h.matrix(), optq.QuantConfig(bits=4, group_size=16, act_order=act_order))


def test_built_with_codes_and_read_like_a_record():
    sol = solved()
    twin = optq.Solution(
        weight=sol.weight,
        codes=sol.codes,
        scales=sol.scales,
        zeros=sol.zeros,
        g_idx=sol.g_idx,
        perm=sol.perm,
        loss=sol.loss,
        damp=sol.damp,
        config=sol.config,
    )
    assert twin.codes is sol.codes and twin.weight is sol.weight and twin.config is sol.config
    assert (twin.loss, twin.damp) == (sol.loss, sol.damp)
    assert torch.equal(twin.dequantize(), sol.weight)
    assert "8x64" in repr(twin) and "codes=stored" in repr(twin)
    with pytest.raises(TypeError, match="codes must be a tensor"):
        twin.codes = None  # type: ignore[assignment]


@pytest.mark.parametrize("act_order", [False, True])
def test_dropped_codes_are_recomputed_exactly(act_order):
    sol = solved(act_order)
    codes = sol.codes.clone()
    assert sol.drop_codes()
    assert sol._codes is None  # nothing held: one byte per weight saved
    assert "codes=from weight" in repr(sol)
    assert sol.codes.dtype == torch.uint8 and torch.equal(sol.codes, codes)
    assert torch.equal(sol.dequantize(), sol.weight)
    assert sol.drop_codes()  # dropping again is a no-op that still succeeds
    sol.codes = codes  # storing codes again lifts the guard
    assert sol.codes is codes


def test_codes_are_kept_when_the_weight_does_not_give_them_back():
    sol = solved()
    codes = sol.codes.clone()
    sol.weight = sol.weight.clone()
    sol.weight[0, 0] += sol.scales[0, 0]  # one grid step away from the solver's code
    assert not sol.drop_codes()
    assert torch.equal(sol.codes, codes)


def test_reading_dropped_codes_after_an_in_place_change_raises():
    sol = solved()
    assert sol.drop_codes()
    sol.weight[0, 0] += sol.scales[0, 0]  # the model's weight trained on, reloaded, ...
    with pytest.raises(RuntimeError, match="modified in place"):
        _ = sol.codes
    with pytest.raises(RuntimeError, match="modified in place"):
        sol.drop_codes()


def test_reading_dropped_codes_after_the_weight_was_replaced_raises():
    sol = solved()
    assert sol.drop_codes()
    # A new tensor, one grid step away in one place, with the same version counter as the
    # dropped one: a version check alone would return that tensor's codes as the solver's.
    moved = torch.zeros_like(sol.weight)
    moved[0, 0] = sol.scales[0, 0]
    replaced = sol.weight + moved
    assert replaced._version == sol.weight._version
    sol.weight = replaced
    with pytest.raises(RuntimeError, match="replaced"):
        _ = sol.codes


def test_views_of_the_weight_share_the_guard():
    sol = solved()
    sol.weight = sol.weight.detach()  # as the pipeline holds it: a view of the module's weight
    base = sol.weight
    assert sol.drop_codes()
    base.view(-1)[5] = 0.0  # written through another view of the same memory
    with pytest.raises(RuntimeError):
        _ = sol.codes


@pytest.mark.parametrize("chunk", [1, 150, 1 << 20])
def test_fit_groups_searches_rows_in_chunks_as_each_group_alone(monkeypatch, chunk):
    # fit_groups searches every full group at once, a chunk of rows at a time (one row per chunk
    # at 1, several at 150, all at 1 << 20); each group must get the bytes of a fit on it alone.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 200, generator=gen)
    w[:, ::17] *= 6  # outliers: the search clips
    imp = torch.rand(200, generator=gen) * 4
    monkeypatch.setattr(grid, "_FIT_CHUNK", chunk)
    threads = torch.get_num_threads()
    for group_size, kw in ((64, {}), (64, {"sym": False}), (50, {"mse_hessian": False}), (-1, {})):
        cfg = optq.QuantConfig(bits=3, group_size=group_size, mse_grid=30, **kw)
        scales, zeros = grid.fit_groups(w, cfg, imp)
        width = 200 if group_size == -1 else group_size
        assert scales.shape == zeros.shape == (37, len(range(0, 200, width)))
        for g, lo in enumerate(range(0, 200, width)):  # 200 = 3 x 64 + 8 and 4 x 50
            s, z = grid.fit(w[:, lo : lo + width], cfg, imp[lo : lo + width])
            assert torch.equal(scales[:, g], s) and torch.equal(zeros[:, g], z), (group_size, kw, g)
        minmax = grid.fit_groups(w, dataclasses.replace(cfg, mse=False, mse_hessian=False), imp)
        assert not torch.equal(minmax[0], scales)  # the search ran
    assert torch.get_num_threads() == threads


def test_quantize_and_dequantize_in_a_buffer_give_the_allocating_forms_bytes():
    # the solver's column loop and the range search compute in place; the bytes must not move
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(9, 33, generator=gen) * 3
    scale = torch.rand(9, 1, generator=gen) + 0.05
    zero = torch.full((9, 1), 4.0)
    q = grid.quantize(w, scale, zero, 7)
    buf = torch.empty_like(w)
    assert grid.quantize(w, scale, zero, 7, out=buf) is buf and torch.equal(buf, q)
    assert q.min() == 0 and q.max() == 7  # the clamp ran on both ends
    dq = grid.dequantize(q, scale, zero)
    assert grid.dequantize(buf, scale, zero, out=buf) is buf and torch.equal(buf, dq)


def test_fit_groups_is_grid_fit_on_each_natural_group():
    w = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    for group_size, cfg_kw in (
        (16, {"mse": False}),
        (-1, {"sym": False, "mse": False}),
        (7, {"mse": True, "mse_grid": 10, "mse_hessian": False}),  # the search rounding runs too: unweighted
    ):
        cfg = optq.QuantConfig(bits=3, group_size=group_size, **cfg_kw)
        scales, zeros = grid.fit_groups(w, cfg)
        width = 40 if group_size == -1 else group_size
        starts = range(0, 40, width)
        assert scales.shape == zeros.shape == (5, len(starts))  # 40 = 16+16+8: a short last group
        for g, lo in enumerate(starts):
            s, z = grid.fit(w[:, lo : lo + width], cfg)
            assert torch.equal(scales[:, g], s) and torch.equal(zeros[:, g], z)
        assert torch.equal(grid.group_index(40, group_size), torch.arange(40, dtype=torch.int32) // width)
        # round-to-nearest and GPTQ's static groups use exactly these grids
        assert torch.equal(optq.rtn(w, cfg).scales, scales)
        if group_size != -1:
            static = optq.gptq(
                w, torch.eye(40), optq.QuantConfig(**cfg.to_dict() | {"act_order": True, "static_groups": True})
            )
            assert torch.equal(static.scales, scales) and torch.equal(static.g_idx, grid.group_index(40, group_size))
