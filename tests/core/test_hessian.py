"""optq.Hessian: accumulation, merging, normalisation and input checks."""

from __future__ import annotations

import pytest
import torch

import optq


def test_matrix_is_two_x_xt_over_count():
    x = torch.randn(37, 6, dtype=torch.float64)
    h = optq.Hessian(6, dtype=torch.float64, normalize_tokens=False)
    h.update(x)
    assert h.count == 37
    assert torch.allclose(h.matrix(), 2 * x.T @ x / 37, rtol=1e-12)


def test_merge_equals_single_accumulation():
    x = torch.randn(3, 40, 16)
    one = optq.Hessian(16)
    one.update(x)
    parts = [optq.Hessian(16) for _ in range(3)]
    for p, xi in zip(parts, x):
        p.update(xi)
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert merged.count == one.count == 120
    assert torch.allclose(merged.matrix(), one.matrix(), rtol=1e-5, atol=1e-6)


def test_batch_shapes_agree():
    x = torch.randn(2, 5, 7, 8)
    a, b = optq.Hessian(8), optq.Hessian(8)
    a.update(x)
    b.update(x.reshape(-1, 8))
    assert a.count == b.count == 70
    assert torch.equal(a.matrix(), b.matrix())


def test_float64_accumulation_on_request():
    h = optq.Hessian(4, dtype=torch.float64)
    h.update(torch.randn(10, 4))
    assert h.matrix().dtype == torch.float64


def test_bad_inputs_are_named():
    h = optq.Hessian(4, normalize_tokens=False)  # the plain path finds bad values another way
    x = torch.randn(5, 4)
    x[0, 1] = float("nan")
    x[3, 2] = float("inf")
    with pytest.raises(ValueError, match="2 NaN/Inf"):
        h.update(x)
    assert h.count == 0  # nothing was added
    normed = optq.Hessian(4)
    with pytest.raises(ValueError, match="2 NaN/Inf"):
        normed.update(x)
    assert normed.count == 0 and torch.equal(normed.sum, torch.zeros(4, 4))
    with pytest.raises(ValueError, match="expects 4"):
        h.update(torch.randn(5, 3))
    with pytest.raises(ValueError, match="in_features"):
        optq.Hessian(0)
    with pytest.raises(ValueError, match="same in_features"):
        h.merge(optq.Hessian(5))


def test_empty_hessian_is_zero():
    assert torch.equal(optq.Hessian(3).matrix(), torch.zeros(3, 3))


def test_normalized_tokens_weigh_equally():
    x = torch.randn(40, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[3] *= 1000.0  # one massive-activation token
    h = optq.Hessian(6, dtype=torch.float64, normalize_tokens=True)
    h.update(x)
    unit = x / x.pow(2).mean(1, keepdim=True).sqrt()
    assert torch.allclose(h.matrix(), 2 * unit.T @ unit / 40, rtol=1e-12)
    plain = optq.Hessian(6, dtype=torch.float64, normalize_tokens=False)
    plain.update(x)
    # the massive token owns the plain Hessian (its share of the trace), not the normalised one
    share = 2 * x[3].pow(2).sum() / 40 / plain.matrix().trace()
    assert share > 0.99
    assert torch.isclose(h.matrix().trace(), torch.tensor(2.0 * 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="normalize_tokens"):
        h.merge(plain)


def test_default_normalizes_tokens_as_the_pipeline_does():
    # optq.Hessian(k) + optq.gptq must optimise what optq.quantize does with a default config
    assert optq.Hessian(4).normalize_tokens is optq.QuantConfig().normalize_tokens is True
    x = torch.randn(30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    default, normed = optq.Hessian(4, dtype=torch.float64), optq.Hessian(4, dtype=torch.float64, normalize_tokens=True)
    default.update(x)
    normed.update(x)
    assert torch.equal(default.matrix(), normed.matrix())
    assert "normalize_tokens=True" in repr(default)


def test_update_is_byte_identical_on_one_and_two_threads():
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(2))
    out = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for normalize in (False, True):
                h = optq.Hessian(96, normalize_tokens=normalize)
                for chunk in x.split(64):
                    h.update(chunk)
                out.append(h.matrix())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3])


def test_synthetic_inputs_do_not_depend_on_the_thread_count():
    from optq.core.synthetic import correlated_inputs

    threads = torch.get_num_threads()
    try:
        out = []
        for t in (1, 2):
            torch.set_num_threads(t)
            out.append(correlated_inputs(200, 96, seed=3))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[0], out[1])


def test_token_weights_scale_each_tokens_outer_product():
    torch.manual_seed(0)
    x = torch.randn(7, 5)
    w = torch.rand(7)
    for normalize in (False, True):
        h = optq.Hessian(5, dtype=torch.float64, normalize_tokens=normalize)
        h.update(x, weight=w)
        xd = x.double()
        if normalize:
            xd = xd * (5**0.5 / xd.norm(dim=1, keepdim=True))
        want = sum(float(w[t]) * torch.outer(xd[t], xd[t]) for t in range(7)) * (2.0 / 7)
        assert torch.allclose(h.matrix(), want, atol=1e-12)
        assert h.count == 7
    # Weight 1 everywhere is the unweighted Hessian; a zero weight drops the token's term.
    a, b = optq.Hessian(5, dtype=torch.float64), optq.Hessian(5, dtype=torch.float64)
    a.update(x, weight=torch.ones(7))
    b.update(x)
    assert torch.equal(a.sum, b.sum)
    c = optq.Hessian(5, dtype=torch.float64)
    c.update(x, weight=torch.tensor([0.0] * 6 + [1.0]))
    d = optq.Hessian(5, dtype=torch.float64)
    d.update(x[6:])
    assert torch.allclose(c.sum, d.sum, atol=1e-12)


def test_bad_token_weights_are_refused():
    h = optq.Hessian(3)
    with pytest.raises(ValueError, match="one non-negative value per token"):
        h.update(torch.randn(4, 3), weight=torch.ones(3))
    with pytest.raises(ValueError, match="non-negative"):
        h.update(torch.randn(4, 3), weight=torch.tensor([1.0, -1.0, 1.0, 1.0]))
