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
from tiny import CFG, build, tokens  # noqa: E402
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


def _reference_hessian(state: dict, block: int, linear: str, calib: torch.Tensor, normalize: bool,
                       original: dict | None) -> torch.Tensor:
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
        # Which linear heads this group: the stacked W starts with its (still unquantized) rows.
        heads = [n for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and m.weight.shape[1] == W.shape[1]
                 and torch.equal(m.weight, W[: m.weight.shape[0]])]
        assert len(heads) == 1, heads
        # The model's state at this moment is the one the pipeline calibrated this group from.
        state = {k: v.clone() for k, v in model.state_dict().items()}
        seen.append((heads[0], tuple(W.shape), H.clone(), state))
        return real(W, H, cfg)

    monkeypatch.setattr(solver, "gptq", record)
    _run(model, calib=calib, config=config, strategy=strategy, propagate=propagate, batch_size=2)

    names = [f"model.layers.{b}.{g}" for b in range(2) for g in GROUPS]
    assert [s[0] for s in seen] == names
    assert [s[1] for s in seen] == [(64, 32), (32, 32), (128, 32), (32, 64)] * 2
    for name, _, H, state in seen:
        block, linear = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        ref = _reference_hessian(state, int(block), linear, calib, normalize_tokens,
                                 original if propagate == "original" else None)
        err = float((H.double() - ref).norm() / ref.norm())
        assert err < 1e-5, f"{name}: relative Frobenius error {err:.3g}"
        torch.testing.assert_close(H.double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()), msg=name)
