"""method="gptaq" in the pipeline: every Hessian and cross term the solver receives against whole-model
forwards computed here (the partly quantized model for X_q, the untouched float model for X_fp),
in dense blocks and in mixture-of-experts stages, and the refusals.

Streaming, resume and torch.distributed with gptaq: test_gptaq_runs.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import optq
from optq.core import gptaq as gptaq_mod

pytest.importorskip("transformers")
from tiny import CFG, stack_head, tokens  # noqa: E402
from tiny import run as _run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GROUPS = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]  # first of each group


def _model() -> torch.nn.Module:
    """The tiny Llama with random RMSNorm gains (as test_hessian_reference.py, for the same reason)."""
    from tiny import build

    model = build("llama")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 + 0.2)
    return model


def _inputs(model: torch.nn.Module, module: str, calib: torch.Tensor) -> torch.Tensor:
    """The raw inputs [tokens, features] (float64) of ``module`` over a whole-model forward."""
    xs = []
    handle = model.get_submodule(module).register_forward_pre_hook(
        lambda m, a: xs.append(a[0].detach().reshape(-1, a[0].shape[-1]).double())
    )
    with torch.no_grad():
        model(input_ids=calib, use_cache=False)
    handle.remove()
    return torch.cat(xs)


def reference(X_q: torch.Tensor, X_fp: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """H = 2/n Σ s_t² x_t x_tᵀ and C = 2/n Σ s_t² (x_fp,t - x_t) x_tᵀ, s_t = √K/|x_t| (or 1)."""
    s = X_q.shape[1] ** 0.5 / X_q.norm(dim=1, keepdim=True) if normalize else torch.ones(X_q.shape[0], 1)
    A, D = X_q * s, (X_fp - X_q) * s.double()
    return 2.0 / X_q.shape[0] * (A.T @ A), 2.0 / X_q.shape[0] * (D.T @ A)


def recording(monkeypatch, model: torch.nn.Module) -> list:
    """Record every GPTAQ solve: (the linear heading the stacked W, H, C, the model's state then)."""
    seen, real = [], gptaq_mod.gptaq_with_floor

    def record(W, H, C, cfg, **kw):
        seen.append((stack_head(model, W), H.clone(), C.clone(), {k: v.clone() for k, v in model.state_dict().items()}))
        return real(W, H, C, cfg, **kw)

    monkeypatch.setattr(gptaq_mod, "gptaq_with_floor", record)
    return seen


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got.double() - want).norm() / want.norm())
    assert err < 1e-5, f"{what}: relative Frobenius error {err:.3g}"


@pytest.mark.parametrize("strategy", ["replay", "pause"])  # pause replays: gptaq pairs every batch
@pytest.mark.parametrize("normalize_tokens", [True, False])
def test_every_hessian_and_cross_term_matches_whole_model_forwards(monkeypatch, normalize_tokens, strategy):
    model = _model()
    fp_model = _model()  # never quantized: the float chain
    calib = tokens(n=6, seqlen=16)
    config = dataclasses.replace(CFG, normalize_tokens=normalize_tokens)
    seen = recording(monkeypatch, model)
    _run(model, calib=calib, config=config, method="gptaq", strategy=strategy, batch_size=4)  # batches of 4 and 2
    assert [s[0] for s in seen] == [f"model.layers.{b}.{g}" for b in range(2) for g in GROUPS]
    for name, H, C, state in seen:
        at = _model()
        at.load_state_dict(state)  # the model as the pipeline left it when it calibrated this group
        X_q, X_fp = _inputs(at, name, calib), _inputs(fp_model, name, calib)
        H_ref, C_ref = reference(X_q, X_fp, normalize_tokens)
        close(H, H_ref, f"{name} H")
        if name == "model.layers.0.self_attn.q_proj":  # nothing quantized before it: no shift at all
            assert not C.any() and torch.equal(X_q, X_fp)
        else:
            assert float(C_ref.norm()) > 1e-3 * float(H_ref.norm()), name  # a real shift, to be matched
            close(C, C_ref, f"{name} C")


def test_gptaq_differs_from_gptq_only_after_the_first_group(monkeypatch):
    calib = tokens(n=6, seqlen=16)
    a = _run(_model(), calib=calib, method="gptaq")
    b = _run(_model(), calib=calib, method="gptq")
    first = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    for name in a.solutions:
        same = torch.equal(a.solutions[name].codes, b.solutions[name].codes)
        assert same == (name in first), name
    # the report measures GPTAQ against its least-squares floor W* (GPTQ's W when nothing shifted)
    row = a.layers["model.layers.1.mlp.down_proj"]
    assert 0 < row.objective < row.rtn_objective


@pytest.mark.parametrize("alpha, form", [(0.0, "paper"), (0.0, "full")])
def test_alpha_zero_is_gptq(alpha, form):
    calib = tokens(n=6, seqlen=16)
    a = _run(_model(), calib=calib, method="gptaq", gptaq_alpha=alpha, gptaq_form=form)
    b = _run(_model(), calib=calib, method="gptq")
    for name in b.solutions:
        assert torch.equal(a.solutions[name].codes, b.solutions[name].codes), name


def test_settings_refuse_what_gptaq_cannot_do():
    with pytest.raises(ValueError, match="propagate='original' both are the float model's"):
        optq.RunSettings(method="gptaq", propagate="original")
    with pytest.raises(ValueError, match="moe_calibration='routed' an expert's tokens"):
        optq.RunSettings(method="gptaq", moe_calibration="routed")
    with pytest.raises(ValueError, match="gptaq_alpha=-1"):
        optq.RunSettings(method="gptaq", gptaq_alpha=-1)
    with pytest.raises(ValueError, match="gptaq_form"):
        optq.RunSettings(method="gptaq", gptaq_form="half")
    s = optq.RunSettings(method="gptaq", gptaq_alpha=1)
    assert s.gptaq_alpha == 1.0 and isinstance(s.gptaq_alpha, float)


# --------------------------------------------------------------------------- experts
def test_expert_hessians_and_cross_terms_match_all_token_forwards(monkeypatch):
    from tiny_moe import build as build_moe
    from tiny_moe import tokens as moe_tokens

    from optq.formats.experts import ExpertLinears, unfuse_experts

    model, fp_model = build_moe("mixtral"), build_moe("mixtral")
    unfuse_experts(fp_model)
    ids = moe_tokens(n=8, seqlen=16)
    model_ref = [model]
    unfuse_experts(model)
    seen = recording(monkeypatch, model)
    optq.quantize(model, ids, CFG, method="gptaq", progress=False, batch_size=4)
    del model_ref

    def expert_input(m: torch.nn.Module, name: str) -> torch.Tensor:
        """All tokens through expert e of ``m`` (moe_calibration="all"): the MoE input, or for
        down, the expert's activation of it."""
        owner, e, leaf = re.fullmatch(r"(.+)\.(\d+)\.(\w+)", name).groups()
        experts = m.get_submodule(owner)
        assert isinstance(experts, ExpertLinears)
        xs = []
        handle = experts.register_forward_pre_hook(lambda _m, a: xs.append(a[0].detach()))
        with torch.no_grad():
            for b in range(0, len(ids), 4):
                m(input_ids=ids[b : b + 4], use_cache=False)
        handle.remove()
        X = torch.cat(xs)
        if leaf == experts.layout.down:
            gate, up = (getattr(experts[int(e)], g) for g in experts.layout.gate_up)
            with torch.no_grad():
                X = experts.activation(gate(X), up(X))
        return X.double()

    experts_seen = [s for s in seen if ".experts." in s[0]]
    assert len(experts_seen) == 2 * 4 * 2  # 2 blocks x 4 experts x (gate/up, down)
    for name, H, C, state in experts_seen:
        at = build_moe("mixtral")
        unfuse_experts(at)
        at.load_state_dict(state)
        H_ref, C_ref = reference(expert_input(at, name), expert_input(fp_model, name), CFG.normalize_tokens)
        close(H, H_ref, f"{name} H")
        close(C, C_ref, f"{name} C")


def test_experts_of_the_models_own_code_are_refused_before_any_work():
    from tiny_moe import build as build_moe
    from tiny_moe import tokens as moe_tokens

    model = build_moe("custom")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="experts of model.layers.0.mlp.experts are the model's own code"):
        optq.quantize(model, moe_tokens(n=4, seqlen=16), CFG, method="gptaq", progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # excluded, they are no obstacle
    report = optq.quantize(
        model, moe_tokens(n=4, seqlen=16), CFG, method="gptaq", progress=False, exclude="*.experts.*"
    )
    assert report.layers and not any(".experts." in n for n in report.layers)
