"""Checkpoints: save/load round trips, an independent decoder written from the spec, errors,
and (when installed) the ecosystem's own loaders."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import optq
from optq.formats.checkpoint import CheckpointError
from optq.formats.linears import find_linears, get_weight
from optq.formats.qlinear import QuantLinear, replace_linears

VOCAB = 96


def _tiny_llama(tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


def _quantize(model, config: optq.QuantConfig) -> dict[str, optq.Solution]:
    """GPTQ on each block linear, with Hessians of its inputs on random tokens."""
    linears = {n: m for n, m in find_linears(model).items() if "lm_head" not in n}
    hessians = {n: optq.Hessian(get_weight(m).shape[1]) for n, m in linears.items()}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, n=n: hessians[n].update(args[0])) for n, m in linears.items()
    ]
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1)))
    for h in hooks:
        h.remove()
    return {n: optq.gptq(get_weight(m).detach(), hessians[n].matrix(), config) for n, m in linears.items()}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.use_fast_path = False  # compare exact dequantization, not bf16 kernels
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
CASES = [
    (dict(bits=2, group_size=32, act_order=False), "gptq"),
    (dict(bits=3, group_size=32, act_order=False), "gptq"),
    (dict(bits=4, group_size=32, act_order=False), "gptq"),
    (dict(bits=8, group_size=-1, act_order=False), "gptq"),
    (dict(bits=4, group_size=32, act_order=True, static_groups=False), "gptq"),
    (dict(bits=4, group_size=32, act_order=True, static_groups=True), "gptq"),
    (dict(bits=3, group_size=32, sym=False, act_order=True, static_groups=False), "gptq_v2"),
]


@pytest.mark.parametrize("cfg,fmt", CASES, ids=[f"{c}-{f}" for c, f in CASES])
def test_save_load_logits_match_in_memory_model(tmp_path: Path, cfg: dict, fmt: str) -> None:
    model = _tiny_llama()
    sols = _quantize(model, optq.QuantConfig(**cfg))
    fake = _tiny_llama()  # the solver's dequantized weights in plain linears
    for n, s in sols.items():
        get_weight(fake.get_submodule(n)).data.copy_(s.weight)
    expected = _logits(fake, IDS)
    optq.save(model, tmp_path / "q", solutions=sols, format=fmt, report={"note": "test"})
    replace_linears(model, sols, checkpoint_format=fmt)
    in_memory = _logits(model, IDS)
    loaded = optq.load(tmp_path / "q", embeddings="model")
    out = _logits(loaded, IDS)
    assert torch.allclose(out, in_memory, atol=1e-5)
    assert torch.allclose(out, expected, atol=5e-3), (out - expected).abs().max()
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == len(sols)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((tmp_path / "q" / "quantize_config.json").read_text())
    assert (qc["bits"], qc["group_size"], qc["checkpoint_format"]) == (cfg["bits"], cfg["group_size"], fmt)
    dynamic = cfg.get("act_order", True) and not cfg.get("static_groups", cfg.get("act_order", True))
    assert qc["desc_act"] == dynamic and qc["sym"] == cfg.get("sym", True)
    assert qc["meta"]["quantizer"] == [f"optq:{optq.__version__}"]
    assert json.loads((tmp_path / "q" / "quantization_report.json").read_text()) == {"note": "test"}


def _spec_unpack(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Decode along dim 0 straight from the spec's bit-stream description (pure Python ints)."""
    cols = []
    for c in range(words.shape[1]):
        stream = 0
        for i, w in enumerate(words[:, c].tolist()):
            stream |= (w & 0xFFFFFFFF) << (32 * i)
        cols.append([(stream >> (bits * j)) & ((1 << bits) - 1) for j in range(count)])
    return torch.tensor(cols).t()  # [count, columns]


@pytest.mark.parametrize(
    "bits,fmt,act", [(3, "gptq", True), (4, "gptq", False), (2, "gptq_v2", True), (8, "gptq", False)]
)
def test_independent_decoder_reads_saved_file(tmp_path: Path, bits: int, fmt: str, act: bool) -> None:
    model = _tiny_llama()
    # act-order without static groups: g_idx is a permuted group map the decoder must follow
    cfg = optq.QuantConfig(bits=bits, group_size=32, act_order=act, static_groups=False, sym=fmt == "gptq")
    sols = _quantize(model, cfg)
    optq.save(model, tmp_path / "q", solutions=sols, format=fmt)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    replace_linears(model, sols, checkpoint_format=fmt)  # the in-memory quantized model
    if act:
        assert any(
            not torch.equal(tensors[f"{n}.g_idx"], torch.arange(s.codes.shape[1]) // 32) for n, s in sols.items()
        )  # the act-order g_idx path is really exercised
    for name, sol in sols.items():
        n, k = sol.codes.shape
        assert {key for key in tensors if key.startswith(f"{name}.")} == {
            f"{name}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx")
        }
        q = _spec_unpack(tensors[f"{name}.qweight"], bits, k)  # [K, N]
        z = _spec_unpack(tensors[f"{name}.qzeros"].t(), bits, n).t()  # [G, N]
        z = z + (1 if fmt == "gptq" else 0)
        scales = tensors[f"{name}.scales"]
        g_idx = tensors[f"{name}.g_idx"].long()
        assert scales.dtype == torch.float16 and tensors[f"{name}.g_idx"].dtype == torch.int32
        assert q.shape == (k, n) and int(q.max()) < (1 << bits) and z.shape == (math.ceil(k / 32), n)
        W = scales.float()[g_idx, :] * (q - z[g_idx, :]).float()  # W[k, n], the spec's formula
        in_memory = model.get_submodule(name).dequantize(torch.float32)
        assert torch.equal(W.t(), in_memory), (name, (W.t() - in_memory).abs().max())
        # and the file is the solver's result, up to float16 scales
        tol = sol.scales.max().item() * 2.0**-11 * (1 << bits)
        assert (W.t() - sol.weight).abs().max().item() <= tol


def test_symmetric_4bit_file_has_0x77777777_zeros(tmp_path: Path) -> None:
    model = _tiny_llama()
    optq.save(model, tmp_path / "q", solutions=_quantize(model, optq.QuantConfig(bits=4, group_size=32)))
    t = load_file(tmp_path / "q" / "model.safetensors")
    zeros = [v for k, v in t.items() if k.endswith(".qzeros")]
    assert zeros and all(bool((z == 2004318071).all()) for z in zeros)
    assert "lm_head.weight" not in t  # tied to the embeddings


def test_save_records_the_architecture_when_the_config_lacks_it(tmp_path: Path) -> None:
    model = _tiny_llama()
    assert not model.config.architectures  # built from a config, as GGUF conversions used to leave it
    sols = _quantize(model, optq.QuantConfig(bits=4, group_size=32, act_order=False))
    for fmt in ("gptq", "compressed-tensors"):
        optq.save(model, tmp_path / fmt, solutions=sols, format=fmt)
        assert json.loads((tmp_path / fmt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model.config.architectures = ["SomethingElseForCausalLM"]  # a recorded one is kept
    optq.save(model, tmp_path / "kept", solutions=sols)
    assert json.loads((tmp_path / "kept" / "config.json").read_text())["architectures"] == ["SomethingElseForCausalLM"]


def test_shards_and_untied_head(tmp_path: Path) -> None:
    model = _tiny_llama(tie=False)
    sols = _quantize(model, optq.QuantConfig(bits=4, group_size=32))
    optq.save(model, tmp_path / "q", solutions=sols, max_shard_size="40KB")
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and "lm_head.weight" in index["weight_map"]
    replace_linears(model, sols)
    assert torch.allclose(_logits(optq.load(tmp_path / "q", embeddings="model"), IDS), _logits(model, IDS), atol=1e-5)


def test_save_replaced_model_and_convert_convention(tmp_path: Path) -> None:
    model = _tiny_llama()
    sols = _quantize(model, optq.QuantConfig(bits=4, group_size=32))
    replace_linears(model, sols, checkpoint_format="gptq_v2")
    optq.save(model, tmp_path / "q", format="gptq")  # QuantLinear modules, converted to v1
    assert torch.allclose(_logits(optq.load(tmp_path / "q", embeddings="model"), IDS), _logits(model, IDS), atol=1e-5)


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    model = _tiny_llama()
    optq.save(model, tmp_path / "q", solutions=_quantize(model, optq.QuantConfig(bits=4, group_size=32)))
    return tmp_path / "q"


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    t = load_file(path)
    edit(t)
    save_file(t, path, metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_load_errors(saved: Path) -> None:
    key = "model.layers.0.mlp.down_proj.qweight"
    _edit_tensors(saved, lambda t: t.pop("model.layers.1.self_attn.o_proj.scales"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.self_attn.o_proj.scales'\]"):
        optq.load(saved, embeddings="model")
    _edit_tensors(
        saved,
        lambda t: t.update(
            {"model.layers.1.self_attn.o_proj.scales": torch.ones(2, 64).half(), "extra.weight": torch.ones(1)}
        ),
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['extra.weight'\]"):
        optq.load(saved, embeddings="model")
    _edit_tensors(saved, lambda t: t.pop("extra.weight"))
    _edit_tensors(saved, lambda t: t.update({key: t[key][:-1].contiguous()}))
    with pytest.raises(CheckpointError, match=f"{key} has shape"):
        optq.load(saved, embeddings="model")
    _edit_tensors(saved, lambda t: t.update({key: torch.zeros(16, 64, dtype=torch.int64)}))
    with pytest.raises(CheckpointError, match=f"{key} has dtype"):
        optq.load(saved, embeddings="model")


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"checkpoint_format": "gptq_v3"}, "checkpoint_format"),
        ({"bits": 5}, "bits"),
        ({"quant_method": "awq"}, "quant_method"),
    ],
)
def test_load_refuses_unknown_config(saved: Path, changes: dict, match: str) -> None:
    _edit_config(saved, **changes)
    with pytest.raises(CheckpointError, match=match):
        optq.load(saved, embeddings="model")


def test_v1_refuses_asymmetric_zero_point_zero(tmp_path: Path) -> None:
    model = _tiny_llama()
    sols = _quantize(model, optq.QuantConfig(bits=4, group_size=32, sym=False))
    name = next(iter(sols))
    sols[name].zeros[0, 0] = 0  # an all-positive group: zero point 0
    with pytest.raises(CheckpointError, match=rf"{name}: .*gptq_v2"):
        optq.save(model, tmp_path / "q", solutions=sols, format="gptq")
    assert not (tmp_path / "q").exists() and list(tmp_path.iterdir()) == []
    optq.save(model, tmp_path / "q", solutions=sols, format="gptq_v2")
    assert optq.load(tmp_path / "q", embeddings="model").get_submodule(name).zeros()[0, 0] == 0


def test_existing_folder_and_bad_format(saved: Path) -> None:
    model = _tiny_llama()
    sols = _quantize(model, optq.QuantConfig(bits=4, group_size=32))
    before = sorted(p.name for p in saved.iterdir())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        optq.save(model, saved, solutions=sols)
    with pytest.raises(CheckpointError, match="format"):
        optq.save(model, saved.parent / "x", solutions=sols, format="awq")
    with pytest.raises(CheckpointError, match="no quantized layers"):
        optq.save(model, saved.parent / "y")
    optq.save(model, saved, solutions=sols, overwrite=True)
    assert sorted(p.name for p in saved.iterdir()) == before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["q"]  # no temporary leftovers


def _reference_and_folder(tmp_path: Path, fmt: str, **cfg):
    model = _tiny_llama(tie=False)
    sols = _quantize(model, optq.QuantConfig(**cfg))
    optq.save(model, tmp_path / "q", solutions=sols, format=fmt)
    replace_linears(model, sols)
    return _logits(model, IDS), tmp_path / "q"


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt,cfg",
    [("gptq", dict(bits=4, group_size=32)), ("gptq_v2", dict(bits=4, group_size=32, sym=False, act_order=True))],
)
def test_transformers_gptqmodel_loads_our_checkpoint(
    tmp_path: Path, gptqmodel_site: Path | None, fmt: str, cfg: dict
) -> None:
    from formats.gptqmodel_env import load_with_transformers

    ref, folder = _reference_and_folder(tmp_path, fmt, **cfg)
    save_file({"ids": IDS}, tmp_path / "ids.safetensors")
    load_with_transformers(gptqmodel_site, folder, tmp_path / "ids.safetensors", tmp_path / "out.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        out, kinds = f.get_tensor("logits"), json.loads(f.metadata()["kinds"])
    assert any(k.startswith("gptqmodel.") for k in kinds), kinds  # GPTQModel's kernels ran
    assert "torch.nn.modules.linear.Linear" not in kinds  # every block linear was replaced
    # Measured on this CPU (GPTQModel's TorchCpuAvx512Linear): 1.9e-4 (v1) and 2.3e-4 (v2).
    assert ((out - ref).norm() / ref.norm()).item() < 5e-4


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors not installed")
@pytest.mark.parametrize(
    "cfg", [dict(bits=4, group_size=32), dict(bits=8, group_size=-1, act_order=True, static_groups=True)]
)
def test_compressed_tensors_decompressor_reads_our_export(tmp_path: Path, cfg: dict) -> None:
    from transformers import AutoModelForCausalLM

    ref, folder = _reference_and_folder(tmp_path, "compressed-tensors", **cfg)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu")
    with torch.no_grad():
        out = theirs(IDS).logits
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_compressed_tensors_refuses_dynamic_act_order(tmp_path: Path) -> None:
    model = _tiny_llama()
    sols = _quantize(model, optq.QuantConfig(bits=4, group_size=32, act_order=True, static_groups=False))
    with pytest.raises(CheckpointError, match="static_groups=True"):
        optq.save(model, tmp_path / "q", solutions=sols, format="compressed-tensors")
    assert not (tmp_path / "q").exists()


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors not installed")
def test_compressed_tensors_decompressor_asymmetric(tmp_path: Path) -> None:
    # transformers' from_pretrained expects unpacked zero points for asymmetric pack-quantized
    # models (a mismatch with compressed-tensors' own writer), so call the decompressor directly.
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    model = _tiny_llama()
    cfg = optq.QuantConfig(bits=3, group_size=32, sym=False, act_order=True, static_groups=True)
    sols = _quantize(model, cfg)
    optq.save(model, tmp_path / "q", solutions=sols, format="compressed-tensors")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(**{**qc["config_groups"]["group_0"], "targets": ["Linear"]})
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    for name, sol in sols.items():
        local = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        weight = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        expected = QuantLinear.from_solution(sol, checkpoint_format="gptq_v2").dequantize()
        assert torch.allclose(weight.float(), expected, atol=1e-6), name
