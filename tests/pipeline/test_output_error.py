"""The report's plain output error beside the (token-normalised) objective."""

from __future__ import annotations

import pytest
import torch

import optq
from optq.pipeline.blocks import hessians
from optq.pipeline.blocks.hessians import LayerHessians

pytest.importorskip("transformers")
from tiny import CFG, build, run, tokens  # noqa: E402

LAYER = "model.layers.0.self_attn.q_proj"  # its input does not depend on quantized layers


def _model():
    # Norm weights away from 1: LAYER's inputs are not at unit RMS, so the normalised objective
    # and the plain output error differ.
    model = build("llama")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.copy_(torch.linspace(0.2, 3.0, 32))
    return model


def _raw_inputs(calib):
    """The fp model's inputs of LAYER for every calibration token, in batch order: [T, K]."""
    model = _model()
    seen = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1]))
    )
    with torch.no_grad():
        model(input_ids=calib)
    handle.remove()
    return torch.cat(seen).double(), model.model.layers[0].self_attn.q_proj.weight.detach().double()


def _quantized(**kw):
    model = _model()
    report = run(model, **kw)
    return report, model.model.layers[0].self_attn.q_proj.weight.detach().double()


def _mean_squared_output_error(X, W, W_hat):
    return float(((X @ (W - W_hat).T) ** 2).sum(dim=1).mean())


def test_output_error_is_the_mean_squared_output_error_over_all_tokens(monkeypatch):
    monkeypatch.setattr(hessians, "PLAIN_SAMPLE_EVERY", 1)  # every token in H_plain
    calib = tokens(n=6, seqlen=16)
    X, W = _raw_inputs(calib)
    report, W_hat = _quantized(calib=calib)
    row = report.layers[LAYER]
    assert row.output_tokens == row.tokens == 96
    assert row.output_error == pytest.approx(_mean_squared_output_error(X, W, W_hat), rel=1e-4)
    # the objective is on unit-RMS tokens: a different number (mean of K |Δx|² / |x|²)
    scaled = X * (X.shape[1] ** 0.5 / X.norm(dim=1, keepdim=True))
    assert row.objective == pytest.approx(_mean_squared_output_error(scaled, W, W_hat), rel=1e-4)
    assert not 0.5 < row.objective / row.output_error < 2
    assert report.totals["output_error"] == pytest.approx(sum(r.output_error for r in report.layers.values()))


def test_output_error_by_default_is_exact_on_a_systematic_sample():
    calib = tokens(n=6, seqlen=16)
    X, W = _raw_inputs(calib)
    report, W_hat = _quantized(calib=calib)
    row = report.layers[LAYER]
    # stride 16 shares a factor with the 16-token windows, so 17: tokens 0, 17, 34, ...
    sample = X[::17]
    assert row.output_tokens == len(sample) == 6
    assert row.output_error == pytest.approx(_mean_squared_output_error(sample, W, W_hat), rel=1e-4)
    assert row.rtn_output_error > 0 and row.output_gain == row.rtn_output_error / row.output_error
    data = report.to_dict()
    assert data["layers"][LAYER]["output_error"] == row.output_error
    assert "not the output error" in data["definitions"]["objective"]


def test_without_normalisation_the_output_error_is_the_objective():
    config = optq.QuantConfig(bits=3, group_size=16, normalize_tokens=False)
    report = run(build("llama"), config=config)
    for row in report.layers.values():
        assert row.output_error == row.objective and row.rtn_output_error == row.rtn_objective
        assert row.output_tokens == row.tokens
    assert "the same as objective" in report.to_dict()["definitions"]["output_error"]


def test_rtn_output_error_is_not_measured_without_a_forward():
    # round-to-nearest reads no calibration activation: no error is made up for it
    report = run(build("llama"), method="rtn")
    for row in report.layers.values():
        assert row.output_error is None and row.rtn_output_error is None and row.output_tokens is None
    assert report.totals["output_error"] is None and report.unmeasured is not None


def test_the_sample_visits_every_window_position_equally_often():
    # one-hot features: the diagonal of the plain Hessian counts the sampled positions
    L = 16
    acc = LayerHessians(L, normalize_tokens=True, sample_every=16)
    windows = torch.eye(L).expand(34, L, L)  # 34 windows of 16 tokens: 544 tokens
    for batch in windows.split(5):  # uneven batches: the sample continues across updates
        acc.update(batch)
    assert acc.stride == 17 and acc.plain_count == 32 and acc.count == 544
    counts = acc.plain.sum.diagonal()
    assert counts.tolist() == [2.0] * L
    assert torch.equal(acc.plain_matrix(), acc.plain.sum * (2 / 32))


def test_plain_hessian_is_absent_without_normalisation():
    acc = LayerHessians(4, normalize_tokens=False)
    acc.update(torch.randn(3, 5, 4))
    assert acc.plain_matrix() is None and acc.plain_count == acc.count == 15


def test_default_config_is_normalised():
    assert CFG.normalize_tokens  # the tests above rely on it
