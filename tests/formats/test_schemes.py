"""Per-layer schemes: a checkpoint whose linears differ in bits, group size, symmetry and
act-order, written as GPTQ ``dynamic`` overrides or compressed-tensors config groups, and read
back by optq.load, GPTQModel, transformers + compressed-tensors, and (its matching rules
re-implemented here) vLLM."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from formats.test_checkpoint import IDS, VOCAB, _logits, _quantize, _tiny_llama
from safetensors.torch import load_file, save_file

import optq
from optq.formats.checkpoint import CheckpointError
from optq.formats.layout import Scheme, packed_layout, quantization_config, storage_format
from optq.formats.linears import find_linears, get_weight
from optq.formats.qlinear import QuantLinear, replace_linears
from optq.formats.schemes import LayerSetting, layer_schemes

FORMATS = ["gptq", "gptq_v2", "compressed-tensors"]
ODD = "model.layers.1.self_attn.o_proj"  # the one asymmetric, act-order layer


def _config(name: str, fmt: str, asym: bool = True) -> optq.QuantConfig:
    if name.endswith("down_proj"):
        return optq.QuantConfig(bits=8, group_size=32, act_order=False)
    if name.endswith(("q_proj", "k_proj", "v_proj")):
        return optq.QuantConfig(bits=4, group_size=64, act_order=False)
    if name == ODD and asym:  # compressed-tensors holds act-order only with static groups
        return optq.QuantConfig(bits=4, group_size=32, sym=False, act_order=True, static_groups=fmt != "gptq")
    return optq.QuantConfig(bits=4, group_size=32, act_order=False)


def _expected(name: str, fmt: str, asym: bool = True) -> LayerSetting:
    c = _config(name, fmt, asym)
    return LayerSetting(c.bits, c.group_size, c.sym, bool(c.act_order and not c.static_groups))


def _mixed(fmt: str, asym: bool = True):
    """A tiny Llama (untied head), its per-layer solutions, and the fake-quantized model's logits."""
    model = _tiny_llama(tie=False)
    names = [n for n in find_linears(model) if "lm_head" not in n]
    sols = {n: _quantize(model, _config(n, fmt, asym))[n] for n in names}
    fake = _tiny_llama(tie=False)
    for n, s in sols.items():
        get_weight(fake.get_submodule(n)).data.copy_(s.weight)
    return model, sols, _logits(fake, IDS)


def _qc(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_checkpoint_round_trips_through_optq_load(tmp_path: Path, fmt: str) -> None:
    model, sols, expected = _mixed(fmt)
    optq.save(model, tmp_path / "q", solutions=sols, format=fmt)
    qc = _qc(tmp_path / "q")
    # the base is the most common setting: q/k/v (6 layers) at group 64
    settings = layer_schemes(qc, list(sols))
    assert settings == {n: _expected(n, fmt) for n in sols}
    if fmt == "compressed-tensors":
        assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and len(qc["config_groups"]) == 4
        assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64
    else:
        assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 64, True, False)
        assert len(qc["dynamic"]) == 3 and qc == json.loads((tmp_path / "q" / "quantize_config.json").read_text())
    replace_linears(model, sols, checkpoint_format=storage_format(fmt))
    in_memory = _logits(model, IDS)
    loaded = optq.load(tmp_path / "q", embeddings="model")
    for n in sols:
        q = loaded.get_submodule(n)
        assert isinstance(q, QuantLinear) and (q.bits, q.group_size) == (settings[n].bits, settings[n].group_size), n
        assert torch.equal(q.dequantize(), model.get_submodule(n).dequantize()), n
    out = _logits(loaded, IDS)
    assert torch.allclose(out, in_memory, atol=1e-5)
    assert torch.allclose(out, expected, atol=5e-3), (out - expected).abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_layout_per_layer_is_what_save_writes(tmp_path: Path, fmt: str) -> None:
    model, sols, _ = _mixed(fmt)
    optq.save(model, tmp_path / "q", solutions=sols, format=fmt)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    layers = {n: QuantLinear.from_solution(s, None, storage_format(fmt)) for n, s in sols.items()}
    scheme = Scheme.of_layers(layers)
    assert {n for n, _ in scheme.layers} == {n for n in sols if not n.endswith(("q_proj", "k_proj", "v_proj"))}
    assert quantization_config(scheme, fmt, ["lm_head"] if fmt == "compressed-tensors" else ()) == _qc(tmp_path / "q")
    for n, s in sols.items():
        written = {k[len(n) + 1 :]: (tuple(t.shape), t.dtype) for k, t in tensors.items() if k.startswith(f"{n}.")}
        layout = packed_layout(
            fmt, tuple(s.weight.shape), bias=False, scheme=scheme.for_layer(n), float_dtype=torch.float32
        )
        assert written == layout, n


def test_uniform_checkpoints_are_written_as_before(tmp_path: Path) -> None:
    model = _tiny_llama()
    config = optq.QuantConfig(bits=4, group_size=32, act_order=True, static_groups=False)
    sols = _quantize(model, config)
    for fmt in FORMATS[:2]:
        optq.save(model, tmp_path / fmt, solutions=sols, format=fmt)
        qc = _qc(tmp_path / fmt)
        assert "dynamic" not in qc and qc == quantization_config(Scheme.of_config(config), fmt)
    names = {n: config for n in sols}
    assert Scheme.of_configs(config, names) == Scheme.of_config(config)
    static = optq.QuantConfig(bits=4, group_size=32, act_order=True, static_groups=True)
    ct = quantization_config(Scheme.of_configs(static, {n: static for n in sols}), "compressed-tensors")
    assert ct == quantization_config(Scheme.of_config(static), "compressed-tensors")
    assert list(ct["config_groups"]) == ["group_0"]


def test_scheme_of_configs_matches_the_packed_layers() -> None:
    model, sols, _ = _mixed("gptq")  # the odd layer: act-order without static groups
    layers = {n: QuantLinear.from_solution(s, None, "gptq_v2") for n, s in sols.items()}
    base = optq.QuantConfig(bits=4, group_size=32)
    assert Scheme.of_configs(base, {n: s.config for n, s in sols.items()}) == Scheme.of_layers(layers)
    one = Scheme.of_configs(base, {n: s.config for n, s in sols.items()}).for_layer(ODD)
    assert (one.bits, one.group_size, one.sym, one.natural, one.layers) == (4, 32, False, False, ())


def test_layers_vllm_fuses_must_share_a_setting() -> None:
    base = optq.QuantConfig(bits=4, group_size=32)
    configs = {f"model.layers.0.self_attn.{p}_proj": base for p in "qkvo"}
    configs["model.layers.0.self_attn.k_proj"] = optq.QuantConfig(bits=8, group_size=32)
    with pytest.raises(CheckpointError, match=r"k_proj.*bits=8.*model\.layers\.0\.self_attn\.qkv_proj"):
        Scheme.of_configs(base, configs)
    experts = {f"model.layers.0.mlp.experts.{e}.{p}": base for e in range(3) for p in ("gate_proj", "down_proj")}
    experts["model.layers.0.mlp.experts.2.down_proj"] = optq.QuantConfig(bits=4, group_size=16)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts with one setting"):
        Scheme.of_configs(base, experts)
    configs["model.layers.0.self_attn.o_proj"] = configs.pop("model.layers.0.self_attn.k_proj")
    assert dict(Scheme.of_configs(base, configs).layers) == {
        "model.layers.0.self_attn.o_proj": LayerSetting(8, 32, True, False)
    }


def _vllm_override(dynamic: dict, prefix: str, key: str, default):
    """vLLM's ``get_dynamic_override`` (vllm/model_executor/layers/quantization/utils/gptq_utils.py):
    ``dynamic`` in order; ``-:`` matched -> False; else the first ``re.match`` gives
    ``overrides.get(key, default)``."""
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern.removeprefix("-:"), prefix):
                return False
        elif re.match(pattern.removeprefix("+:"), prefix):
            return overrides.get(key, default)
    return default


def _vllm_prefixes(names: list[str]) -> dict[str, list[str]]:
    """vLLM's module prefixes (q/k/v -> qkv_proj, gate/up -> gate_up_proj, experts -> experts)."""
    out: dict[str, list[str]] = {}
    for n in names:
        prefix, _, leaf = n.rpartition(".")
        m = re.match(r"(.*\.experts)\.\d+\.", n)
        fused = (
            m.group(1)
            if m
            else {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}.get(
                leaf, {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}.get(leaf)
            )
        )
        out.setdefault(fused if m else f"{prefix}.{fused}" if fused else n, []).append(n)
    return out


def test_vllm_reads_each_fused_module_s_setting_from_our_dynamic() -> None:
    base = optq.QuantConfig(bits=4, group_size=32)
    eight = optq.QuantConfig(bits=8, group_size=64, sym=False, act_order=True)
    configs = {}
    for i in range(3):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            configs[f"model.layers.{i}.self_attn.{p}"] = eight if i == 1 and p != "o_proj" else base
        for p in ("gate_proj", "up_proj", "down_proj"):
            configs[f"model.layers.{i}.mlp.{p}"] = eight if (i, p) in {(0, "gate_proj"), (0, "up_proj")} else base
        for e in range(4):
            for p in ("w1", "w2", "w3"):
                configs[f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}"] = eight if i == 2 else base
    scheme = Scheme.of_configs(base, configs)
    qc = quantization_config(scheme, "gptq")
    assert qc["bits"] == 4 and len(qc["dynamic"]) == 1
    prefixes = _vllm_prefixes(list(configs))
    assert "model.layers.1.self_attn.qkv_proj" in prefixes and "model.layers.2.block_sparse_moe.experts" in prefixes
    for prefix, members in prefixes.items():
        want = scheme.for_layer(members[0])
        got = [_vllm_override(qc["dynamic"], prefix, k, qc[k]) for k in ("bits", "group_size", "sym", "desc_act")]
        assert got == [want.bits, want.group_size, want.sym, not want.natural], prefix
    assert layer_schemes(qc, list(configs)) == {n: scheme.for_layer(n).base for n in configs}


def test_gptqmodel_written_dynamic_is_read(tmp_path: Path) -> None:
    model, sols, expected = _mixed("gptq")
    optq.save(model, tmp_path / "q", solutions=sols, format="gptq")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = cfg["quantization_config"]
    # As GPTQModel users write it: unanchored regexes, a bare pattern, a negative one first.
    qc["bits"], qc["group_size"], qc["desc_act"] = 4, 32, False
    qc["dynamic"] = {
        r"-:.*lm_head": {},
        r"+:.*\.down_proj": {"bits": 8, "damp_percent": 0.05},
        r".*\.[qkv]_proj": {"group_size": 64},
        r"+:.*layers\.1\.self_attn\.o_proj": {"sym": False, "desc_act": True},
    }
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "q" / "quantize_config.json").unlink()
    assert layer_schemes(qc, list(sols)) == {n: _expected(n, "gptq") for n in sols}
    assert torch.allclose(_logits(optq.load(tmp_path / "q", embeddings="model"), IDS), expected, atol=5e-3)
    qc["dynamic"] = {r"-:.*down_proj": {}, **qc["dynamic"]}  # excluded, yet packed: refused
    with pytest.raises(CheckpointError, match="down_proj holds packed tensors, but .*dynamic excludes it"):
        layer_schemes(qc, list(sols))
    qc["dynamic"] = {r"+:.*down_proj": {"bits": 5}}
    with pytest.raises(CheckpointError, match="down_proj: bits=5"):
        layer_schemes(qc, list(sols))


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors not installed")
def test_compressed_tensors_assigns_each_layer_its_group(tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model, sols, _ = _mixed("compressed-tensors")
    optq.save(model, tmp_path / "q", solutions=sols, format="compressed-tensors")
    fresh = _tiny_llama(tie=False)
    apply_quantization_config(fresh, QuantizationConfig.model_validate(_qc(tmp_path / "q")))
    for n in sols:
        w = fresh.get_submodule(n).quantization_scheme.weights
        s = _expected(n, "compressed-tensors")
        assert (w.num_bits, w.group_size, w.symmetric) == (s.bits, s.group_size, s.sym), n
    assert getattr(fresh.lm_head, "quantization_scheme", None) is None


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors not installed")
def test_transformers_decompresses_a_mixed_compressed_tensors_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # symmetric only: transformers expects unpacked asymmetric zero points (test_checkpoint)
    model, sols, _ = _mixed("compressed-tensors", asym=False)
    optq.save(model, tmp_path / "q", solutions=sols, format="compressed-tensors")
    assert len(_qc(tmp_path / "q")["config_groups"]) == 3
    replace_linears(model, sols, checkpoint_format="gptq_v2")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32, device_map="cpu")
    with torch.no_grad():
        out = theirs(IDS).logits
    ref = _logits(model, IDS)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptqmodel_loads_a_mixed_checkpoint(tmp_path: Path, gptqmodel_site: Path | None, fmt: str) -> None:
    from formats.gptqmodel_env import load_with_gptqmodel
    from safetensors import safe_open

    model, sols, _ = _mixed(fmt)
    optq.save(model, tmp_path / "q", solutions=sols, format=fmt, tokenizer=_tokenizer())
    replace_linears(model, sols, checkpoint_format=fmt)
    ref = _logits(model, IDS)
    save_file({"ids": IDS}, tmp_path / "ids.safetensors")
    load_with_gptqmodel(gptqmodel_site, tmp_path / "q", tmp_path / "ids.safetensors", tmp_path / "out.safetensors")
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        out, layers = f.get_tensor("logits"), json.loads(f.metadata()["layers"])
    # GPTQModel built each layer with the setting dynamic gives it
    assert {n: LayerSetting(*v) for n, v in layers.items()} == {n: _expected(n, fmt) for n in sols}
    # bfloat16 kernels: measured 6.1e-3 (gptq) on this CPU; a mis-read layer gives ~1
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2
