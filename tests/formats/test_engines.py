"""The engine table: each rule refuses what it says, the installed engines agree with it, and the
group sizes chosen for real model widths are refused by no engine."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from optq.formats.engines import (
    ENGINES,
    FORMATS,
    KERNELS,
    LayerShape,
    check_engines,
    describe,
    group_size_for,
    parse_engines,
    verdict,
)
from optq.formats.qlinear import QuantLinear

GRID = {
    "in_features": (64, 96, 130, 192, 255, 256, 576, 640, 1024),
    "out_features": (4, 8, 16, 24, 32, 48, 64, 96, 192, 576),
    "bits": (1, 2, 3, 4, 5, 8, 9),
    "group_size": (-1, 3, 8, 16, 32, 64, 96, 128, 256, 512, 1024),
    "sym": (True, False),
    "desc_act": (False, True),
}


def _layers():
    for values in itertools.product(*GRID.values()):
        yield LayerShape(**dict(zip(GRID, values)))


LAYERS = list(_layers())


def _one_rule_pairs(kernel):
    """rule -> (a layer the kernel takes, the same layer with one field changed that breaks only
    that rule), searched over GRID."""
    pairs = {}
    for good in (s for s in LAYERS if kernel.broken(s) is None):
        for name, values in GRID.items():
            for value in values:
                bad = replace(good, **{name: value})
                broken = [r for r in kernel.rules if not r.holds(bad)]
                if len(broken) == 1 and broken[0] not in pairs:
                    pairs[broken[0]] = (good, bad)
        if len(pairs) == len(kernel.rules):
            break
    return pairs


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k.engine}-{k.name}-{k.formats[0]}")
def test_each_rule_alone_refuses_a_layer_the_kernel_otherwise_takes(kernel):
    pairs = _one_rule_pairs(kernel)
    breakable = [r for r in kernel.rules if r.what != "nothing"]
    assert set(breakable) <= set(pairs), [r.what for r in breakable if r not in pairs]
    for rule, (good, bad) in pairs.items():
        assert kernel.broken(good) is None and kernel.broken(bad) == rule
        assert rule.source and rule.engine == kernel.engine
        fmt = kernel.formats[0]
        first = next(k for k in KERNELS if k.engine == kernel.engine and fmt in k.formats)
        # (vLLM's GPTQ config picks gptq_marlin or gptq first: tested below.)
        if first is kernel and not kernel.hardware and (kernel.engine, fmt) != ("vllm", "gptq"):
            # The engine's first choice: the verdict names it, or names this rule's source.
            assert verdict(kernel.engine, good, fmt).kernel.startswith(kernel.name)
            assert any(rule.source in reason for _, reason in verdict(kernel.engine, bad, fmt).refusals)


def test_a_fatal_rule_refuses_the_layer_and_another_falls_through():
    # 576 inputs, group 128: GPTQModel picked the int4 kernel from the config, so the layer fails.
    v = verdict("transformers", LayerShape(576, 576, 4, 128))
    assert v.refused and "_weight_int4pack_mm_cpu" in describe(v) and "TorchCpuAvx512Linear" in describe(v)
    # 3 bits: no int4 kernel is picked, the dequantize kernel takes any width.
    assert verdict("transformers", LayerShape(576, 576, 3, 128)).kernel == "TorchLinear (dequantize)"
    # vLLM: Marlin refuses act-order at 576 inputs, Exllama (float16) still takes it.
    v = verdict("vllm", LayerShape(576, 576, 4, 64, desc_act=True))
    assert v.kernel == "Exllama (float16 models)" and v.refusals[0][0] == "Marlin"
    v = verdict("vllm", LayerShape(576, 576, 3, 64))
    assert v.kernel == "gptq_gemm (float16 models)" and v.refusals[0][0] == "gptq_marlin"
    assert "is_gptq_marlin_compatible" in v.refusals[0][1]
    assert verdict("vllm", LayerShape(576, 576, 4, 256)).refused  # gptq_gemm: 256 does not divide 576
    assert verdict("vllm", LayerShape(576, 576, 3, 64), "compressed-tensors").refused


def _torch_int4_runs(n: int, k: int, group: int) -> bool:
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = torch.randn(max(k // group, 1), n, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.randn(2, k, dtype=torch.bfloat16), packed, group, sz)
    except RuntimeError:
        return False
    return True


def test_torch_rules_match_the_real_int4_kernel():
    fused, aten = (next(k for k in KERNELS if k.name == n) for n in ("TorchFusedLinear", "TorchAtenLinear"))
    torch_rules = [r for r in fused.rules if "LinearAlgebra.cpp" in r.source]
    assert len(torch_rules) == 3
    seen = set()
    for n, k, g in itertools.product((8, 16, 24, 48), (64, 96, 130, 256, 576), (-1, 16, 32, 64, 128, 256, 512)):
        expected = all(r.holds(LayerShape(k, n, 4, g)) for r in torch_rules)
        assert _torch_int4_runs(n, k, k if g == -1 else g) == expected, (n, k, g)
        seen.add(expected)
    assert seen == {True, False}
    # GPTQModel's aten kernel lists exactly the group sizes torch runs, and checks the same shapes.
    assert [g for g in (16, 32, 64, 96, 128, 256, 512) if aten.broken(LayerShape(256, 16, 4, g)) is None] == [
        g for g in (16, 32, 64, 96, 128, 256, 512) if 256 % g == 0 and _torch_int4_runs(16, 256, g)
    ]
    assert {r.source for r in aten.rules if r.fatal} <= {r.source for r in torch_rules}


def test_optq_rules_match_quantlinear_fast_path():
    x = torch.randn(2, 1, dtype=torch.bfloat16)
    seen = set()
    for k, n, bits, g in itertools.product((64, 96, 192, 576, 640), (8, 16, 48), (2, 3, 4, 8), (-1, 32, 64, 128)):
        layer = QuantLinear(k, n, bits, g)
        fast = layer._fast_layout(x.expand(2, k)) is not None
        v = verdict("optq", LayerShape(k, n, bits, g))
        assert v.kernel == ("int4 (torch _weight_int4pack_mm_for_cpu)" if fast else "reference dequantize"), (k, n, g)
        seen.add(fast)
    assert seen == {True, False}


def test_compressed_tensors_decompression_matches_its_rule():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    for k, g in ((576, 128), (576, 64), (640, 128), (130, 32)):
        args = QuantizationArgs(num_bits=4, strategy="group", group_size=g, symmetric=True)
        groups = -(-k // g)
        codes = torch.randint(-8, 8, (16, k)).to(torch.int8)
        try:
            dequantize(codes, torch.rand(16, groups) + 0.1, torch.zeros(16, groups, dtype=torch.int8), args)
            ran = True
        except ValueError:
            ran = False
        assert ran == (not verdict("transformers", LayerShape(k, 16, 4, g), "compressed-tensors").refused), (k, g)


@pytest.mark.parametrize("fmt", FORMATS)
def test_group_size_for(fmt):
    pick = lambda k, g=128, **kw: group_size_for(k, g, engines=ENGINES, bits=4, fmt=fmt, **kw)  # noqa: E731
    assert pick(576) == 64
    assert pick(1536) == 128 and pick(640) == 128
    assert pick(576, 64) == 64 and pick(576, 256) == 64
    assert group_size_for(4096, -1, engines=["vllm", "optq"], bits=4, fmt=fmt) == -1
    # GPTQModel runs -1 through torch's int4 kernel with a group as wide as the input: refused
    # unless that is 32..256 wide; compressed-tensors decompresses any width.
    gptq = fmt != "compressed-tensors"
    assert pick(576, -1) == (64 if gptq else -1) and pick(4096, -1) == (128 if gptq else -1)
    assert pick(256, -1) == -1
    if gptq:
        with pytest.raises(ValueError, match="input width 100"):
            pick(100)
    else:
        assert pick(100) == -1
    # Only optq named: it never refuses, yet 128 does not divide 576; 3 bits keeps a divisor.
    assert group_size_for(576, 128, engines=["optq"], bits=4, fmt=fmt) == 64
    assert group_size_for(1536, 512, engines=["optq"], bits=3, fmt=fmt) == 512


def _model(hidden, inter, heads, kv, head_dim, fmt, engines=ENGINES):
    widths = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim)}
    widths |= {"v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden)}
    widths |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    layers = {}
    for i, (name, (k, n)) in itertools.product(range(2), widths.items()):
        g = group_size_for(k, 128, engines=engines, bits=4, out_features=n, fmt=fmt)
        part = "self_attn" if name[0] in "qkvo" else "mlp"
        layers[f"model.layers.{i}.{part}.{name}"] = LayerShape(k, n, 4, g)
    return layers


MODELS = {"SmolLM2-135M": (576, 1536, 9, 3, 64), "gemma-3-270m": (640, 2048, 4, 1, 256)}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model", MODELS)
def test_real_model_shapes_are_refused_by_no_engine(model, fmt):
    layers = _model(*MODELS[model], fmt)
    found = check_engines(layers, ENGINES, fmt)
    refused = {(e, n): describe(v) for e, vs in found.items() for n, v in vs.items() if v.refused}
    if model == "SmolLM2-135M" and fmt != "compressed-tensors":
        # Per-layer groups (64 for 576 inputs, 128 for down_proj) break transformers' GPTQ load:
        # optimum builds every layer from the config's one group size.
        assert refused and {e for e, _ in refused} == {"transformers"}
        assert all("optimum" in why for why in refused.values())
        layers = {n: replace(s, group_size=64) for n, s in layers.items()}  # one group for the model
        found = check_engines(layers, ENGINES, fmt)
        refused = {(e, n) for e, vs in found.items() for n, v in vs.items() if v.refused}
    assert not refused
    assert all(v.kernel == "Marlin" for v in found["vllm"].values())


def test_fused_parts_with_different_schemes_are_refused_by_vllm():
    layers = {f"m.self_attn.{p}": LayerShape(512, 512, 4, 128) for p in ("q_proj", "k_proj", "v_proj")}
    layers["m.self_attn.k_proj"] = LayerShape(512, 512, 4, 64)
    found = check_engines(layers, ["vllm", "optq"], "compressed-tensors")
    assert all(v.refused and "fused" in describe(v) for v in found["vllm"].values())
    assert not any(v.refused for v in found["optq"].values())
    # A base config vLLM reads with gptq_marlin refuses a 3-bit override.
    found = check_engines({"a": LayerShape(512, 512, 4, 128), "b": LayerShape(512, 512, 3, 128)}, ["vllm"])
    assert found["vllm"]["b"].refused and not found["vllm"]["a"].refused


def test_parse_engines():
    assert parse_engines("vllm,transformers,optq") == ENGINES == parse_engines("all")
    assert parse_engines(" optq , vllm,optq") == ("optq", "vllm")
    with pytest.raises(ValueError, match="sglang.*vllm, transformers, optq"):
        parse_engines("vllm,sglang")
    with pytest.raises(ValueError, match="unknown"):
        verdict("tgi", LayerShape(64, 64, 4, 32))
