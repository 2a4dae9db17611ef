"""Sibling QuantLinears (q/k/v, gate/up) fused into one fast-path call: the same outputs as
each layer alone, whatever order they are called in, and nothing stale after a change."""

from __future__ import annotations

import pytest
import torch
from formats.bounds import bf16_bound
from torch import nn

import optq
from optq.formats.fused import build_fast_paths, fuse_siblings
from optq.formats.qlinear import QuantLinear, replace_linears


def _layer(n: int, k: int, bits: int = 4, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, k, generator=g)
    H = optq.Hessian(k)
    H.update(torch.randn(4 * k, k, generator=g))
    sol = optq.gptq(W, H.matrix(), optq.QuantConfig(bits=bits, group_size=64, sym=False))
    return QuantLinear.from_solution(sol, bias=torch.randn(n), checkpoint_format="gptq_v2")


class Attention(nn.Module):
    def __init__(self, bits: tuple[int, int, int] = (4, 4, 4)) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (
            _layer(n, 192, b, seed=i) for i, (n, b) in enumerate(zip((192, 64, 128), bits, strict=True))
        )


def _alone(layers: list[QuantLinear], x: torch.Tensor) -> list[torch.Tensor]:
    import copy

    return [copy.deepcopy(q)(x) for q in layers]  # each on its own fast path, unfused


@pytest.mark.parametrize("rows", [1, 5, 96])  # the int4 kernel, and dequantize + matmul
def test_fused_siblings_give_each_layers_own_output(rows: int) -> None:
    attn = Attention()
    build_fast_paths(attn, fuse=False)
    x = torch.randn(1, rows, 192)
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    alone = _alone(members, x)
    assert fuse_siblings(attn) == 1 and all(m._fused is not None for m in members)
    fused = [m(x) for m in members]
    for got, want, m in zip(fused, alone, members, strict=True):
        assert got.shape == want.shape == (1, rows, m.out_features)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
        ref = m.forward_reference(x)
        assert ((got - ref).abs() <= bf16_bound(x.view(rows, -1), m, ref.view(rows, -1)).view_as(ref)).all()
    # any order, repeats, one member alone: each still gets its own output
    assert torch.allclose(attn.v_proj(x), alone[2], rtol=1e-5, atol=1e-5)
    assert torch.allclose(attn.k_proj(x), alone[1], rtol=1e-5, atol=1e-5)
    assert torch.allclose(attn.k_proj(x), alone[1], rtol=1e-5, atol=1e-5)
    x2 = torch.randn(1, rows, 192)
    assert torch.allclose(attn.k_proj(x2), _alone([attn.k_proj], x2)[0], rtol=1e-5, atol=1e-5)


def test_an_input_changed_in_place_is_computed_again() -> None:
    attn = Attention()
    build_fast_paths(attn)
    x = torch.randn(2, 192)
    attn.q_proj(x)  # k and v's outputs for x are now waiting
    x.mul_(-2.0)
    want = _alone([attn.k_proj], x)[0]
    assert torch.allclose(attn.k_proj(x), want, rtol=1e-5, atol=1e-5)


def test_a_member_changed_after_fusing_runs_alone_and_the_others_stay_right() -> None:
    attn = Attention()
    build_fast_paths(attn)
    other = _layer(64, 192, seed=9)
    x = torch.randn(3, 192)
    q_before = attn.q_proj(x)
    attn.k_proj.load_state_dict(other.state_dict())
    assert torch.allclose(attn.k_proj(x), other(x), rtol=1e-5, atol=1e-5)
    assert torch.allclose(attn.q_proj(x), q_before, rtol=1e-5, atol=1e-5)


def test_fused_members_share_codes_and_give_them_back() -> None:
    attn = Attention()
    state = {k: v.clone() for k, v in attn.state_dict().items()}
    build_fast_paths(attn)  # codes dropped, then fused
    group = attn.q_proj._fused[0]
    shared = group.fast.planes[0][0]
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m._buffers["qweight"] is None
        assert m.fast_weight.planes[0][0].untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    saved = attn.state_dict()
    assert all(torch.equal(saved[k], state[k]) for k in state)


def test_members_run_alone_as_under_compile_from_their_own_view_of_the_planes() -> None:
    from optq.formats import cpu_kernels

    attn = Attention()
    build_fast_paths(attn)
    x = torch.randn(3, 192)
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        alone = cpu_kernels.matmul(m.fast_weight, x).float() + m.bias.float()
        assert torch.allclose(alone, m(x), rtol=1e-5, atol=1e-5)
        assert torch.allclose(m._forward_traced(x), m(x), rtol=1e-5, atol=1e-5)


def test_layers_whose_layouts_differ_are_not_fused() -> None:
    attn = Attention(bits=(4, 8, 4))  # an 8-bit layer is two planes
    build_fast_paths(attn)
    assert attn.q_proj._fused is None and attn.k_proj._fused is None


def test_a_small_llama_runs_the_same_fused_and_not() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from optq.formats.linears import find_linears, get_weight

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    models = []
    for fuse in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        sols = {
            n: optq.rtn(get_weight(m).detach(), optq.QuantConfig(bits=4, group_size=64))
            for n, m in find_linears(model).items()
            if "lm_head" not in n
        }
        replace_linears(model, sols)
        build_fast_paths(model, fuse=fuse)
        models.append(model)
    assert sum(m._fused is not None for m in models[1].modules() if isinstance(m, QuantLinear)) == 2 * 5
    ids = torch.randint(0, 128, (1, 100))  # prefill above the dequantize threshold, then tokens
    with torch.inference_mode():  # as generate runs: tensors without a write counter
        outs = [m.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False) for m in models]
        logits = [m(ids).logits for m in models]
    assert torch.equal(outs[0], outs[1])
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_buffers_first_made_under_inference_mode_serve_outside_it() -> None:
    from optq.formats import cpu_kernels

    attn = Attention()
    build_fast_paths(attn)
    x = torch.randn(96, 192)  # the dequantize path and its scratch buffers
    cpu_kernels._SCRATCH.__dict__.pop("buffers", None)  # made afresh below, under inference mode
    with torch.inference_mode():
        inside = [m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    with torch.no_grad():
        outside = [m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert all(torch.equal(a, b) for a, b in zip(inside, outside, strict=True))


def test_a_groups_own_bytes_are_its_concatenated_scales() -> None:
    attn = Attention()
    build_fast_paths(attn)
    group = attn.q_proj._fused[0]
    members = (attn.q_proj, attn.k_proj, attn.v_proj)
    assert group.nbytes() == sum(m.fast_weight.scale_zero.nbytes for m in members)
    assert sum(m.fast_weight.planes[0][0].nbytes for m in members) == group.fast.planes[0][0].nbytes
