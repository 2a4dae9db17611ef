"""One description of a checkpoint's layout (optq.formats.layout) serves the writers and the plan:
the tensors it predicts are the tensors the writers produce, and desc_act follows g_idx."""

from __future__ import annotations

import pytest
import torch

import optq
from optq.formats import compressed_tensors
from optq.formats.files import CheckpointError
from optq.formats.layout import Scheme, packed_layout, quantization_config, storage_format
from optq.formats.qlinear import QuantLinear


def _layer(shape, config, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(*shape, generator=g)
    X = torch.randn(4 * shape[1], shape[1], generator=g)
    sol = optq.gptq(W, X.T @ X / X.shape[0], config)
    return sol, (torch.randn(shape[0], generator=g) if bias else None)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2", "compressed-tensors"])
@pytest.mark.parametrize(
    ("shape", "bits", "group", "sym", "bias"),
    [
        ((48, 64), 4, 16, True, False),
        ((40, 96), 3, 32, False, True),
        ((24, 50), 2, -1, False, False),
        ((16, 72), 8, 64, True, True),
    ],
)
def test_packed_layout_is_what_the_writers_write(fmt, shape, bits, group, sym, bias):
    config = optq.QuantConfig(bits=bits, group_size=group, sym=sym, act_order=False)
    sol, b = _layer(shape, config, bias)
    layer = QuantLinear.from_solution(sol, b, storage_format(fmt))
    dtype = torch.bfloat16
    if fmt == "compressed-tensors":
        tensors = compressed_tensors.export_layer("x", layer, sym=sym, dtype=dtype)
    else:
        tensors = layer.state_dict()
    written = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    assert written == packed_layout(fmt, shape, bias=bias, scheme=Scheme.of_config(config), float_dtype=dtype)


def test_desc_act_follows_natural_g_idx_and_one_function_serves_every_format():
    static = optq.QuantConfig(act_order=True, static_groups=True)
    moving = optq.QuantConfig(act_order=True, static_groups=False)
    plain = optq.QuantConfig(act_order=False)
    assert quantization_config(Scheme.of_config(static), "gptq")["desc_act"] is False
    assert quantization_config(Scheme.of_config(plain), "gptq")["desc_act"] is False
    assert quantization_config(Scheme.of_config(moving), "gptq")["desc_act"] is True
    # What the layers turned out to be wins over what the config implies.
    assert quantization_config(Scheme.of_config(moving, natural=True), "gptq_v2")["desc_act"] is False
    ct = quantization_config(Scheme.of_config(static), "compressed-tensors", ["model.layers.0.mlp.gate"])
    assert ct["quant_method"] == "compressed-tensors" and ct["ignore"] == ["model.layers.0.mlp.gate"]
    assert ct["optq"] == quantization_config(Scheme.of_config(static), "gptq")["meta"]
    with pytest.raises(CheckpointError, match="act-order without static groups"):
        quantization_config(Scheme.of_config(moving), "compressed-tensors")
    with pytest.raises(CheckpointError, match="unknown"):
        quantization_config(Scheme.of_config(plain), "awq")


def test_scheme_of_layers_reads_what_the_solver_used():
    config = optq.QuantConfig(bits=3, group_size=16, sym=False, act_order=True, static_groups=False, damp=0.05)
    sol, _ = _layer((32, 64), config, False)
    layer = QuantLinear.from_solution(sol, None, "gptq")
    scheme = Scheme.of_layers({"model.layers.0.mlp.down_proj": layer})
    assert (scheme.bits, scheme.group_size, scheme.sym, scheme.damp) == (3, 16, False, 0.05)
    assert scheme.natural == bool(torch.equal(layer.g_idx, torch.arange(64, dtype=torch.int32) // 16))
    other = QuantLinear.from_solution(_layer((32, 64), optq.QuantConfig(bits=4, group_size=16), False)[0], None)
    # layers may differ: the base is the most common setting, the others are listed by name
    mixed = Scheme.of_layers({"a": layer, "b": other, "c": other})
    assert (mixed.bits, mixed.group_size, mixed.sym, mixed.natural) == (4, 16, True, True)
    assert [n for n, _ in mixed.layers] == ["a"] and mixed.for_layer("a").bits == 3
    assert mixed.for_layer("b") == Scheme(4, 16, True, True, 0.05, True)
