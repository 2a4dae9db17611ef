"""GPT-OSS's fused experts (transposed, biased, gate and up interleaved, a clamped SwiGLU) as one
linear per expert matrix (docs/moe-checkpoints.md): the same logits, the split the checkpoint
readers expect, at most 2% of the block matrices left float, and each expert's tensors cut out of
a saved (fused) source as the split does. The save/load round trip is in the parametrized MoE
tests; streaming a fused source end to end in tests/pipeline/test_stream_gpt_oss.py."""

from __future__ import annotations

import re

import pytest
import torch

import optq
from optq.formats.experts import GPT_OSS, ExpertLinear, ExpertLinears, unfuse_experts

tiny_moe = pytest.importorskip("tiny_moe")
IDS = tiny_moe.tokens()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _build(**overrides):
    from transformers import AutoModelForCausalLM

    cfg = tiny_moe._config("gpt_oss")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) and ".router." not in name:
                p.normal_(0.0, 0.02)
    return model


def test_unfused_gpt_oss_computes_bit_identical_logits():
    model = tiny_moe.build("gpt_oss")
    default = _logits(model)  # transformers' grouped_mm experts: its own matmul kernel and sums
    model.set_experts_implementation("eager")  # transformers' loop over experts, as ExpertLinears
    fused = model.model.layers[1].mlp.experts
    gu, gub = fused.gate_up_proj.detach().clone(), fused.gate_up_proj_bias.detach().clone()
    down, downb = fused.down_proj.detach().clone(), fused.down_proj_bias.detach().clone()
    before = _logits(model)
    done, left = unfuse_experts(model)
    assert done == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] and left == {}
    after = _logits(model)
    # The fused product is one [H, 2I] matmul, ours two [I, H] ones: the same sums, but the BLAS
    # kernel for each shape may round differently on some CPUs (bit-identical where this test
    # was written, 6e-8 apart on an AVX-512 EPYC), so equal to float32 rounding, not bit for bit.
    assert torch.allclose(after, before, atol=1e-6, rtol=0)
    assert torch.allclose(after, default, atol=1e-6, rtol=0)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, ExpertLinears) and experts.layout == GPT_OSS
    inter = down.shape[1]
    for e in range(tiny_moe.EXPERTS):  # [out, in] halves of the fused columns, biases with them
        ex = experts[e]
        assert all(type(getattr(ex, leaf)) is ExpertLinear for leaf in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(ex.gate_proj.weight, gu[e, :, :inter].T) and torch.equal(ex.gate_proj.bias, gub[e, :inter])
        assert torch.equal(ex.up_proj.weight, gu[e, :, inter:].T) and torch.equal(ex.up_proj.bias, gub[e, inter:])
        assert torch.equal(ex.down_proj.weight, down[e].T) and torch.equal(ex.down_proj.bias, downb[e])
        assert ex.gate_proj.weight.is_contiguous() and ex.down_proj.weight.is_contiguous()
    # The activation de-interleaves as the model does: gate = fused columns 0, 2, ...; up = 1, 3, ...
    x = torch.randn(5, 32)
    with torch.no_grad():
        g, u = experts[0].gate_proj(x), experts[0].up_proj(x)
        fused_out = torch.cat([g, u], dim=-1)
        gate, up = fused_out[:, ::2].clamp(max=7.0), fused_out[:, 1::2].clamp(-7.0, 7.0)
        want = (up + 1) * gate * torch.sigmoid(gate * 1.702)
        assert torch.allclose(experts.activation(g, u), want, atol=1e-6, rtol=0)


def test_top4_eager_gpt_oss_stays_bit_identical():
    # Four experts per token: transformers' loop and ours add them in the same (expert) order.
    model = _build(num_experts_per_tok=4)
    model.set_experts_implementation("eager")
    assert model.model.layers[0].mlp.router.top_k == 4
    before = _logits(model)
    unfuse_experts(model)
    assert torch.equal(_logits(model), before)


def test_at_most_two_percent_of_gpt_oss_block_matrices_stay_float_and_are_named(tmp_path, capsys):
    from optq.cli import main

    model, report, _ = tiny_moe.quantize("gpt_oss")
    total = left = 0
    floats = []
    for name, p in model.model.layers.named_parameters(prefix="model.layers"):
        if p.dim() != 2:
            continue  # biases, norms, sinks: vectors
        total += p.numel()
        if name[: -len(".weight")] not in report.solutions:
            left += p.numel()
            floats.append(name)
    assert floats == [f"model.layers.{i}.mlp.router.weight" for i in range(2)]
    assert left / total <= 0.02, left / total  # 2 x 128 of 2 x 9344: 1.4%
    assert all(n in report.skipped or n[: -len(".weight")] in report.skipped for n in floats)
    assert not any("experts" in n for n in report.skipped)
    optq.save(model, tmp_path / "q", solutions=report.solutions, report=report)
    assert main(["inspect", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    listed = [line.strip() for line in out.splitlines() if line.startswith("    model.")]
    assert listed == ["model.layers.*.mlp.router.weight: 2 x [4, 32], routers"], listed
    assert "expert weights left in float" not in out and "\nengines (" in out, out
    loaded = optq.load(tmp_path / "q", embeddings="model")
    assert torch.isfinite(_logits(loaded)).all()


def test_fused_slices_cut_each_expert_out_of_the_saved_fused_tensors_as_unfuse_does(tmp_path):
    from optq.formats.expert_slices import fused_in_source, fused_slices
    from optq.formats.experts import checkpoint_namer
    from optq.formats.files import read_index
    from optq.pipeline.stream.source import SafetensorsSource

    model = tiny_moe.build("gpt_oss")
    model.save_pretrained(tmp_path / "src")
    index = read_index(tmp_path / "src")
    assert not [k for k in index if re.search(r"experts\.\d+\.", k)]  # fused on disk
    src = SafetensorsSource(tmp_path / "src")
    unfuse_experts(model)
    names = checkpoint_namer(model)
    slices = fused_slices(model, index, names)
    want = {k: v for k, v in model.state_dict().items() if ".experts." in k}
    assert sorted(slices) == sorted(want)  # every expert weight and bias, nothing else
    assert fused_in_source(model, index, names) is None
    for key, s in slices.items():
        fused = src.read(s.key)
        got = s.take(fused)
        assert torch.equal(got, want[key]) and got.is_contiguous(), key
        assert s.shape(index[s.key][1]) == tuple(want[key].shape), key
    assert slices["model.layers.1.mlp.experts.2.up_proj.weight"].key == "model.layers.1.mlp.experts.gate_up_proj"
    # A source with one key per expert matrix needs no slice.
    assert fused_slices(model, set(want) | set(index), names) == {}


def test_a_plain_layout_stored_fused_is_refused_in_one_line():
    from optq.formats.expert_slices import fused_in_source, fused_slices

    model = tiny_moe.build("mixtral")
    unfuse_experts(model)
    keys = {k for k in model.state_dict() if ".experts." not in k} | {"model.layers.0.mlp.experts.gate_up_proj"}
    why = fused_in_source(model, keys, lambda n: n)  # under the model's names, for brevity
    assert why is not None and why.startswith("model.layers.0.mlp.experts.gate_up_proj stores the experts fused")
    assert "\n" not in why and "optq.quantize" in why
    assert fused_slices(model, keys, lambda n: n) == {}  # only the transposed layout is sliced
