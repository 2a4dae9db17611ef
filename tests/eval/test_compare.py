"""optq.compare: variant names, and fresh copies quantized and evaluated side by side."""

from __future__ import annotations

import pytest
import torch
import transformers

import optq
from optq.eval.compare import compare, parse_variant
from optq.formats.linears import find_linears


def test_variant_names_map_onto_configs():
    base = optq.QuantConfig(bits=4, group_size=128)
    plain = parse_variant("gptq+plain+b3+g64", base)
    assert (plain.config.act_order, plain.config.normalize_tokens, plain.config.bits, plain.config.group_size) == (
        False,
        False,
        3,
        64,
    )
    dyn = parse_variant("gptq+act_order+original", base)
    assert dyn.config.act_order and not dyn.config.static_groups and dyn.propagate == "original"
    assert parse_variant("rtn+mse+asym", base).config.mse and not parse_variant("rtn+asym", base).config.sym
    assert parse_variant("fp", base).config is None
    weighted = parse_variant("gptaq+hmse", base).config
    assert weighted.mse and weighted.mse_hessian and not parse_variant("gptaq+mse", base).config.mse_hessian
    # the default searches weighted by H; +mse unweighted; +minmax and +plain take min/max ranges
    assert parse_variant("gptq", optq.QuantConfig()).config.mse_hessian
    for spec, search in (("gptq+mse", (True, False)), ("gptq+minmax", (False, False)), ("gptq+plain", (False, False))):
        config = parse_variant(spec, optq.QuantConfig()).config
        assert (config.mse, config.mse_hessian) == search, spec
    shrunk = parse_variant("gptq+shrink0.25+damp0.1", base).config
    assert (shrunk.diag_shrink, shrunk.damp) == (0.25, 0.1)
    # optq's defaults shrink H halfway; textbook GPTQ (+plain) and +shrink0 do not
    assert parse_variant("gptq", base).config.diag_shrink == 0.5
    assert plain.config.diag_shrink == 0.0 and parse_variant("gptaq+shrink0", base).config.diag_shrink == 0.0
    for bad in (
        "awq",
        "gptq+fast",
        "fp+mse",
        "rtn+original",
        "rtn+act_order",
        "rtn+shrink0.5",
        "rtn+hmse",
        "gptq+shrinkx",
        "gptq+shrink2",
    ):
        with pytest.raises(ValueError):
            parse_variant(bad, base)


def test_compare_quantizes_copies_and_evaluates_the_same_windows():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, 64, (4, 16), generator=g)
    windows = torch.randint(0, 64, (3, 16), generator=g)
    base = optq.QuantConfig(bits=3, group_size=16)
    seen = {}
    results = compare(
        model,
        [parse_variant(v, base) for v in ("fp", "rtn", "gptq")],
        calib,
        {"text": windows},
        progress=False,
        on_result=lambda r, m: seen.__setitem__(r.variant.name, m),
    )
    # the base model is untouched; each variant had its own copy
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    fp, rtn, gptq = results
    assert fp.perplexity["text"] == pytest.approx(optq.perplexity(model, windows))
    for name, module in find_linears(seen["rtn"].model.layers, "model.layers").items():
        original = model.get_submodule(name).weight
        assert torch.equal(module.weight, optq.rtn(original, base).weight)
    assert gptq.report is not None and gptq.totals["layers"] == 14
    assert rtn.perplexity["text"] != fp.perplexity["text"] != gptq.perplexity["text"]
