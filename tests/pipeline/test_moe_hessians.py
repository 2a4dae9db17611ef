"""Each expert's Hessian in the MoE pipeline: every expert's objective against a Hessian
computed here from the final model (routed and all-token), starved experts handled and
reported, and routing-weighted Hessians.

Tiny random models (tests/tiny_moe.py): see test_moe.py."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from tiny_moe import FUSED, MARK, MARKED, NEVER, expert_linears, quantize, tokens  # noqa: E402

from optq.formats.experts import ExpertLinears  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- objectives
def _objective(W: torch.Tensor, W_hat: torch.Tensor, X: torch.Tensor) -> float:
    """½ tr(Δ H Δᵀ), H = 2/n Σ_t (K/|x_t|²) x_t x_tᵀ (tokens at unit RMS), in float64."""
    X = X.reshape(-1, X.shape[-1]).double()
    K = X.shape[1]
    Xn = X * (K**0.5 / X.norm(dim=1, keepdim=True))
    H = 2.0 / X.shape[0] * Xn.T @ Xn
    D = (W - W_hat).double()
    return 0.5 * float(((D @ H) * D).sum())


def _inputs(model, ids: torch.Tensor) -> tuple[dict[str, list], dict[str, list]]:
    """Each expert linear's inputs, and each ExpertLinears module's full input, in ``model``."""
    per, whole = {}, {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, ExpertLinears):
            handles.append(mod.register_forward_pre_hook(lambda _m, a, n=name: whole.setdefault(n, []).append(a[0])))
        elif re.search(r"\.experts\.\d+\.", name) and isinstance(mod, torch.nn.Linear):
            handles.append(mod.register_forward_pre_hook(lambda _m, a, n=name: per.setdefault(n, []).append(a[0])))
    with torch.no_grad():
        for b in range(0, len(ids), 4):
            model(input_ids=ids[b : b + 4], use_cache=False)
    for h in handles:
        h.remove()
    return per, whole


@pytest.mark.parametrize("arch", FUSED)
@pytest.mark.parametrize("mode", ["routed", "all"])
def test_expert_objectives_match_a_hessian_built_here(arch, mode):
    ids = tokens(n=16, seqlen=32)
    model, report, original = quantize(arch, ids, moe_calibration=mode, moe_min_tokens=0)
    # Every expert's input in the final model is what its stage saw: attention, routers and
    # earlier blocks were final before the experts' stages; gate/up before down.
    per, whole = _inputs(model, ids)
    checked = 0
    for name, mod in expert_linears(model).items():
        row = report.layers[name]
        if mode == "routed":
            X = torch.cat(per[name])
            assert row.hessian == "routed" and row.tokens == X.shape[0], (name, row.hessian, row.tokens)
        else:
            owner = name.rsplit(".", 2)[0]
            X = torch.cat(whole[owner])
            experts = model.get_submodule(owner)
            e, leaf = int(name.rsplit(".", 2)[1]), name.rsplit(".", 1)[1]
            if leaf == experts.layout.down:  # all tokens through this expert's quantized gate/up
                gate, up = (getattr(experts[e], g) for g in experts.layout.gate_up)
                with torch.no_grad():
                    X = experts.activation(gate(X), up(X))
            assert row.hessian == "all" and row.tokens == X.shape[0]
        want = _objective(original[f"{name}.weight"], mod.weight, X)
        assert row.objective == pytest.approx(want, rel=2e-3, abs=1e-7), name
        assert row.objective <= row.rtn_objective * (1 + 1e-6), name
        checked += 1
    assert checked == len(expert_linears(model))


# --------------------------------------------------------------------------- starved experts
def test_starved_fused_experts_take_the_all_token_hessian_and_say_so():
    ids = tokens(n=4, seqlen=16)  # 64 tokens, top-2 of 4 experts: about 32 routed each
    model, report, _ = quantize("mixtral", ids, moe_calibration="routed", moe_min_tokens=40)
    per, whole = _inputs(model, ids)
    fell_back = [n for n, r in report.layers.items() if r.hessian and r.hessian.startswith("all (fallback")]
    routed = [n for n, r in report.layers.items() if r.hessian == "routed"]
    assert fell_back
    for name in fell_back:
        n_routed = sum(x.shape[0] for x in per.get(name, []))
        assert f"{n_routed} routed tokens < 40" in report.layers[name].hessian
        assert name in report.fallbacks and report.layers[name].tokens == 64
    for name in routed:
        assert report.layers[name].tokens >= 40


def test_custom_moduleList_experts_starved_and_never_routed():
    ids = tokens(n=8, seqlen=16)  # MARK only in the last sample: batch 2 of 2
    model, report, original = quantize("custom", ids, moe_min_tokens=0)
    for layer in (0, 1):
        marked = f"model.layers.{layer}.mlp.experts.{MARKED}"
        never = f"model.layers.{layer}.mlp.experts.{NEVER}"
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            row = report.layers[f"{marked}.{leaf}"]
            assert row.tokens == int((ids == MARK).sum()) and row.hessian.startswith("routed (all tokens need")
            row = report.layers[f"{never}.{leaf}"]
            assert row.tokens == 0 and row.hessian.startswith("none") and f"{never}.{leaf}" in report.fallbacks
            assert f"{never}.{leaf}" in report.solutions  # rounded to nearest, packed like the rest
        assert report.moe[f"model.layers.{layer}"]["discovery_forwards"] == 2  # the marked batch found it
    # With the default threshold, the one-token expert is rounded to nearest, and says why.
    _, report, _ = quantize("custom", ids)
    row = report.layers[f"model.layers.0.mlp.experts.{MARKED}.gate_proj"]
    assert "rounded to nearest" in row.hessian and row.fallback == row.hessian


# --------------------------------------------------------------------------- routing weights
def _routing(x: torch.Tensor, router: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert index, weight) [tokens, top_k] of Qwen3-MoE's router, computed here as its
    ``Qwen3MoeTopKRouter.forward`` does: softmax of the logits in float32, top-k, renormalised
    over the top-k when ``norm_topk_prob``, cast back to the logits' dtype."""
    logits = nn.functional.linear(x.reshape(-1, x.shape[-1]), router)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weight, index = torch.topk(probs, config.num_experts_per_tok, dim=-1)
    if config.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    return index, weight.to(logits.dtype)


def test_routing_weighted_hessian_weighs_each_token_by_its_squared_routing_weight():
    from transformers.activations import ACT2FN

    ids = tokens(n=8, seqlen=16)
    model, report, original = quantize(
        "qwen3_moe", ids, moe_calibration="routed", moe_min_tokens=0, moe_weighting="routing", hessian_dtype="float64"
    )
    config = model.config
    act = ACT2FN[config.hidden_act]
    # Each MoE block's input in the final model is what its expert stages saw (attention, router
    # and earlier blocks were final before them); the router's own output checks _routing.
    inputs: dict[int, list] = {}
    routed: dict[int, list] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [
            layer.mlp.register_forward_pre_hook(lambda _m, a, i=i: inputs.setdefault(i, []).append(a[0])),
            layer.mlp.gate.register_forward_hook(lambda _m, _a, y, i=i: routed.setdefault(i, []).append(y)),
        ]
    with torch.no_grad():
        for b in range(0, len(ids), 4):
            model(input_ids=ids[b : b + 4], use_cache=False)
    for h in handles:
        h.remove()
    checked = 0
    for i, layer in enumerate(model.model.layers):
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[i]])
        with torch.no_grad():
            index, weight = _routing(x, layer.mlp.gate.weight, config)
        assert torch.equal(index, torch.cat([r[2] for r in routed[i]])), i
        assert torch.equal(weight, torch.cat([r[1] for r in routed[i]])), i
        for e in range(config.num_experts):
            tok, slot = torch.where(index == e)
            w = weight[tok, slot].double()
            assert 0 < float(w.min()) and float(w.max()) < 0.9  # far from 1: w and w² differ
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            gate, up = (model.get_submodule(f"{prefix}.{m}") for m in ("gate_proj", "up_proj"))
            with torch.no_grad():  # down_proj's input: through the expert's quantized gate/up
                h = act(gate(x[tok])) * up(x[tok])
            for leaf, X in (("gate_proj", x[tok]), ("up_proj", x[tok]), ("down_proj", h)):
                name = f"{prefix}.{leaf}"
                row = report.layers[name]
                assert row.hessian.startswith("routed, weighted") and row.tokens == len(tok), name
                # H = 2/n Σ_t w_t² x̂_t x̂_tᵀ: tokens at unit RMS (normalize_tokens), then weighed
                # by w² (the expert's output, hence its error, is scaled by w), n routed tokens.
                X = X.double()
                Xw = X * (X.shape[1] ** 0.5 / X.norm(dim=1, keepdim=True)) * w[:, None]
                H = 2.0 / len(tok) * Xw.T @ Xw
                D = (original[f"{name}.weight"] - model.get_submodule(name).weight).double()
                # float64 sums on both sides (measured 5e-9 apart); weighing by w instead of w²
                # scales each token's term by 1/w > 1.1 (measured: 3.8x on the first expert).
                assert row.objective == pytest.approx(0.5 * float(((D @ H) * D).sum()), rel=1e-5), name
                checked += 1
    assert checked == 2 * config.num_experts * 3
