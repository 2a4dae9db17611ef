"""The pipeline's Hessians against an independent reference: a plain forward-hook loop here.

The pause-vs-replay tests compare two strategies that share capture, Hessian accumulation and
the solver, so a bug common to both would go unseen. Here every Hessian the solver receives is
checked against H = 2/n Σ x xᵀ computed in float64 from the inputs that a WHOLE-model forward,
with the model exactly as the pipeline left it at that moment (earlier blocks and the block's
earlier groups already quantized in place), feeds the group's first linear. With
``propagate="original"`` the block's inputs are the fp model's instead: the reference then runs
the original model with only the current block's (partly quantized) weights swapped in.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from optq.core import solver

pytest.importorskip("transformers")
from tiny import CFG, build, stack_head, tokens  # noqa: E402
from tiny import run as _run  # noqa: E402

GROUPS = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]  # first of each group


def _model() -> torch.nn.Module:
    """The tiny Llama with random RMSNorm gains: freshly initialised gains are all ones, which
    would hand q/k/v and gate/up tokens of unit RMS already, and token normalisation would go
    untested there."""
    model = build("llama")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 + 0.2)
    return model


def _reference_hessian(
    state: dict, block: int, linear: str, calib: torch.Tensor, normalize: bool, original: dict | None
) -> torch.Tensor:
    """2/n Σ x xᵀ (float64) of ``model.layers.{block}.{linear}``'s inputs over a whole-model
    forward of ``calib``, with the weights ``state``; with ``original``, every block except
    ``block`` gets its original weights (so ``block`` sees the fp model's activations)."""
    model = _model()
    if original is not None:
        mine = f"model.layers.{block}."
        state = {k: (v if k.startswith(mine) else original[k]) for k, v in state.items()}
    model.load_state_dict(state)
    xs = []
    module = model.get_submodule(f"model.layers.{block}.{linear}")
    handle = module.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=calib, use_cache=False)
    handle.remove()
    X = torch.cat(xs).double()
    if normalize:
        X = X * (X.shape[1] ** 0.5 / X.norm(dim=1, keepdim=True))
    return 2.0 / X.shape[0] * (X.T @ X)


@pytest.mark.parametrize("propagate", ["quantized", "original"])
@pytest.mark.parametrize("strategy", ["pause", "replay"])
@pytest.mark.parametrize("normalize_tokens", [True, False])
def test_every_hessian_matches_a_whole_model_forward(monkeypatch, normalize_tokens, strategy, propagate):
    model = _model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    calib = tokens(n=6, seqlen=16)
    config = dataclasses.replace(CFG, normalize_tokens=normalize_tokens)
    seen = []
    real = solver.gptq

    def record(W, H, cfg):
        head = stack_head(model, W)  # which linear heads this group
        # The model's state at this moment is the one the pipeline calibrated this group from.
        state = {k: v.clone() for k, v in model.state_dict().items()}
        seen.append((head, tuple(W.shape), H.clone(), state))
        return real(W, H, cfg)

    monkeypatch.setattr(solver, "gptq", record)
    # GPTQ's Hessians (GPTAQ's, with its cross terms: test_gptaq_pipeline.py)
    _run(model, calib=calib, config=config, strategy=strategy, propagate=propagate, batch_size=2, method="gptq")

    names = [f"model.layers.{b}.{g}" for b in range(2) for g in GROUPS]
    assert [s[0] for s in seen] == names
    assert [s[1] for s in seen] == [(64, 32), (32, 32), (128, 32), (32, 64)] * 2
    for name, _, H, state in seen:
        block, linear = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        ref = _reference_hessian(
            state, int(block), linear, calib, normalize_tokens, original if propagate == "original" else None
        )
        err = float((H.double() - ref).norm() / ref.norm())
        assert err < 1e-5, f"{name}: relative Frobenius error {err:.3g}"
        torch.testing.assert_close(H.double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()), msg=name)


def _reference_inputs(state: dict, block: int, linear: str, calib: torch.Tensor) -> torch.Tensor:
    """The raw inputs [windows, length, features] of ``linear`` over a whole-model forward."""
    model = _model()
    model.load_state_dict(state)
    xs = []
    module = model.get_submodule(f"model.layers.{block}.{linear}")
    handle = module.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach().double()))
    with torch.no_grad():
        model(input_ids=calib, use_cache=False)
    handle.remove()
    return torch.cat(xs)


def test_calibration_statistics_match_a_whole_model_forward(monkeypatch):
    # The report's per-layer token statistics against brute force on the reference inputs:
    # the largest 1% of tokens by |x|² (at least one) and the tokens at position 0.
    model = _model()
    calib = tokens(n=6, seqlen=16)
    states = {}
    real = solver.gptq

    def record(W, H, cfg):
        states[stack_head(model, W)] = {k: v.clone() for k, v in model.state_dict().items()}
        return real(W, H, cfg)

    monkeypatch.setattr(solver, "gptq", record)
    report = _run(model, calib=calib, batch_size=4, method="gptq")  # batches of 4 and 2: positions restart
    assert len(states) == 8
    for name, state in states.items():
        block, linear = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        X = _reference_inputs(state, int(block), linear, calib)
        energy = (X**2).sum(-1)  # [windows, length]
        total = float(energy.sum())
        flat = sorted(energy.flatten().tolist(), reverse=True)
        top = sum(flat[:1])  # 96 tokens: 1% rounds up to one token
        stats = report.layers[name].calibration
        assert stats["tokens"] == 96
        assert stats["top1pct_share"] == pytest.approx(top / total, rel=1e-4)
        assert stats["position0_share"] == pytest.approx(float(energy[:, 0].sum()) / total, rel=1e-4)
        assert stats["position0_tokens"] == pytest.approx(1 / 16)
        assert stats["max_over_median"] == pytest.approx(flat[0] / float(energy.flatten().median()), rel=1e-4)
        # Members of the group share the input, hence the statistics.
        for other, row in report.layers.items():
            if row.subset == report.layers[name].subset and other.rsplit(".", 2)[0] == name.rsplit(".", 2)[0]:
                assert row.calibration == stats


def test_token_energy_stats_small_cases():
    from optq.pipeline.blocks.hessians import token_energy_stats

    energy = torch.tensor([100.0, 1.0, 1.0, 2.0, 50.0, 1.0, 1.0, 4.0])
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    s = token_energy_stats(energy, positions)
    assert s["tokens"] == 8
    assert s["top1pct_share"] == pytest.approx(100 / 160)  # one token: the largest
    assert s["position0_share"] == pytest.approx(150 / 160)
    assert s["position0_tokens"] == pytest.approx(0.25)
    assert s["max_over_median"] == pytest.approx(100 / 1.0)  # torch's median: the lower middle
    assert token_energy_stats(energy)["position0_share"] is None
    assert token_energy_stats(torch.zeros(0))["top1pct_share"] is None
    many = torch.ones(250)
    many[:3] = 10.0
    assert token_energy_stats(many)["top1pct_share"] == pytest.approx(30 / 277)  # ceil(2.5) = 3 tokens
