"""Mixture-of-experts checkpoints (docs/moe-checkpoints.md): one packed 2-D matrix per expert under
the source checkpoint's names (Mixtral's ``block_sparse_moe.experts.{e}.w1``), routers float,
read back by optq.load (and by transformers + compressed-tensors), streamed sources read under
those names, and ``optq inspect``'s parameters per kind.

The quantized models are built here without the pipeline: experts split, then round-to-nearest."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import optq
from optq.formats.checkpoint import CheckpointError
from optq.formats.experts import ExpertLinears, checkpoint_namer, unfuse_experts
from optq.formats.files import read_index
from optq.formats.linears import find_linears, get_weight, set_weight
from optq.formats.qlinear import QuantLinear, replace_linears

tiny_moe = pytest.importorskip("tiny_moe")

CFG = optq.QuantConfig(bits=4, group_size=16)
FORMATS = ["gptq", "gptq_v2", "compressed-tensors"]
MARKER = {"gptq": "qweight", "gptq_v2": "qweight", "compressed-tensors": "weight_packed"}
ROUTERS = ("gate", "shared_expert_gate", "router")
MOE_LAYERS = {"deepseek_v3": 1}  # DeepSeek-V3's first layer is dense; 2 MoE layers otherwise
IDS = tiny_moe.tokens()


def source_name(arch: str, name: str) -> str:
    """The source checkpoint's name of a module of the model, written out here (not optq's namer)."""
    return name.replace(".mlp.", ".block_sparse_moe.") if arch == "mixtral" else name


def float_expert(arch: str) -> str:
    """The one expert matrix the tests leave in float (as ``exclude`` would)."""
    return f"model.layers.1.mlp.experts.1.{'w2' if arch == 'mixtral' else 'down_proj'}"


def quantized(arch: str, *, keep_float: bool = True, cfg: optq.QuantConfig = CFG):
    """(model, solutions): a tiny MoE model with its experts split, every block linear but the
    routers (and ``float_expert``) set to its round-to-nearest weight."""
    model = tiny_moe.build(arch)
    unfuse_experts(model)
    sols = {}
    for name, module in find_linears(model).items():
        if name == "lm_head" or name.rsplit(".", 1)[-1] in ROUTERS or (keep_float and name == float_expert(arch)):
            continue
        sols[name] = optq.rtn(get_weight(module), cfg)
        set_weight(module, sols[name].weight)
    return model, sols


def logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.use_fast_path = False  # exact dequantization, as in test_checkpoint
    with torch.no_grad():
        return model(ids).logits


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for fname in sorted({f for f, _, _ in read_index(folder).values()}):
        out.update(load_file(folder / fname))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", tiny_moe.ALL)
def test_every_expert_is_packed_under_its_source_name_and_routers_stay_float(tmp_path, arch, fmt):
    model, sols = quantized(arch)
    folder = optq.save(model, tmp_path / "q", solutions=sols, format=fmt)
    saved = tensors(folder)
    marker = MARKER[fmt]
    packed = {k[: -len(marker) - 1] for k in saved if k.endswith("." + marker)}
    assert packed == {source_name(arch, n) for n in sols}
    experts = [n for n in sols if re.search(r"\.experts\.\d+\.", n)]
    assert len(experts) == MOE_LAYERS.get(arch, 2) * tiny_moe.EXPERTS * 3 - 1
    assert all(t.dim() <= 2 for t in saved.values()) and not [k for k in saved if "gate_up_proj" in k]
    if arch == "mixtral":
        assert f"model.layers.0.block_sparse_moe.experts.3.w1.{marker}" in saved
        assert not [k for k in saved if ".mlp." in k]
    # the expert left out: its float weight, under its source name
    left = source_name(arch, float_expert(arch))
    assert torch.equal(saved[f"{left}.weight"], model.get_submodule(float_expert(arch)).weight)
    # routers: float, as in the model
    state = model.state_dict()
    routers = [k for k in state if k.rsplit(".", 2)[-2] in ROUTERS]
    assert routers
    for key in routers:
        stored = saved[source_name(arch, key)]
        assert stored.dtype == torch.float32 and torch.equal(stored, state[key]), key
    if fmt == "compressed-tensors":
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        # float linears and the routers (linears in older transformers and vLLM), source names
        routers = {k.rsplit(".", 1)[0] for k in routers}
        assert qc["ignore"] == sorted(source_name(arch, n) for n in {*find_linears(model), *routers} if n not in sols)
        router = "model.layers.1.mlp." + ("router" if arch == "gpt_oss" else "gate")
        assert left in qc["ignore"] and source_name(arch, router) in qc["ignore"]


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("arch", tiny_moe.FUSED)
def test_load_computes_the_in_memory_quantized_model(tmp_path, arch, fmt):
    model, sols = quantized(arch)
    optq.save(model, tmp_path / "q", solutions=sols, format=fmt)
    replace_linears(model, sols, checkpoint_format=fmt)
    loaded = optq.load(tmp_path / "q", embeddings="model")
    assert torch.allclose(logits(loaded), logits(model), atol=1e-6, rtol=0)
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, ExpertLinears) and experts.num_experts == tiny_moe.EXPERTS
    assert all(isinstance(loaded.get_submodule(n), QuantLinear) for n in sols)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == len(sols)
    left, kept = loaded.get_submodule(float_expert(arch)), model.get_submodule(float_expert(arch))
    assert type(left) is type(kept) and torch.equal(left.weight, kept.weight)  # nn.Linear (ExpertLinear: GPT-OSS)
    for name, m in loaded.named_modules():
        if name.rsplit(".", 1)[-1] in ROUTERS:
            assert not isinstance(m, QuantLinear), name


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors not installed")
# transformers keeps GPT-OSS's experts fused on disk too: it has no per-expert names to merge from
@pytest.mark.parametrize("arch", [a for a in tiny_moe.FUSED if a != "gpt_oss"])
def test_transformers_reads_the_compressed_tensors_experts(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model, sols = quantized(arch, keep_float=False)
    optq.save(model, tmp_path / "q", solutions=sols, format="compressed-tensors")
    replace_linears(model, sols, checkpoint_format="gptq_v2")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32, device_map="cpu")
    assert torch.allclose(logits(theirs), logits(model), atol=1e-5, rtol=0)


def test_custom_experts_keep_their_names(tmp_path):
    # A model's own nn.ModuleList experts: nothing to rename. optq.load builds the architecture
    # from config.json (a Llama here), which has no experts: refused, naming the tensor; the
    # file itself loads into the model's own structure.
    model, sols = quantized("custom")
    optq.save(model, tmp_path / "q", solutions=sols)
    with pytest.raises(
        CheckpointError, match=r"tensor model\.layers\.\d\.mlp\.experts\.\d\.\w+\.qweight names no module"
    ):
        optq.load(tmp_path / "q", embeddings="model")
    replace_linears(model, sols)
    other, _ = quantized("custom")
    other.model.embed_tokens.weight.data.normal_()
    replace_linears(other, sols)
    assert not torch.allclose(logits(other), logits(model))
    other.load_state_dict(tensors(tmp_path / "q"), strict=True)
    assert torch.equal(logits(other), logits(model))


def _edit(folder: Path, edit) -> None:
    t = load_file(folder / "model.safetensors")
    new = edit(t)
    t = t if new is None else new
    save_file(t, folder / "model.safetensors", metadata={"format": "pt"})


def test_load_errors_name_checkpoint_tensors(tmp_path):
    model, sols = quantized("mixtral")
    folder = optq.save(model, tmp_path / "q", solutions=sols)
    key = "model.layers.1.block_sparse_moe.experts.2.w3.scales"
    _edit(folder, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match=rf"missing tensors \['{re.escape(key)}'\]"):
        optq.load(folder, embeddings="model")
    optq.save(model, folder, solutions=sols, overwrite=True)
    key = "model.layers.0.block_sparse_moe.experts.0.w1.qweight"
    _edit(folder, lambda t: t.update({key: t[key][:-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(key)} has shape"):
        optq.load(folder, embeddings="model")
    # written under transformers' in-memory names instead of the checkpoint's: refused
    optq.save(model, folder, solutions=sols, overwrite=True)
    _edit(folder, lambda t: {k.replace("block_sparse_moe", "mlp"): v for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.experts\.0\.w1\.qweight names no module"):
        optq.load(folder, embeddings="model")


def test_save_splits_fused_experts_first(tmp_path):
    model = tiny_moe.build("mixtral")
    fused = model.model.layers[0].mlp.experts
    gate_up, down = fused.gate_up_proj.detach().clone(), fused.down_proj.detach().clone()
    ref = logits(model)
    attention = {n: m for n, m in find_linears(model).items() if "self_attn" in n}  # experts are 3-D here
    sols = {n: optq.rtn(get_weight(m), CFG) for n, m in attention.items()}
    optq.save(model, tmp_path / "q", solutions=sols)
    assert isinstance(model.model.layers[0].mlp.experts, ExpertLinears)
    assert torch.allclose(logits(model), ref, atol=1e-6)  # the same function, per expert
    saved = tensors(tmp_path / "q")
    inter = down.shape[2]
    for e in range(tiny_moe.EXPERTS):
        prefix = f"model.layers.0.block_sparse_moe.experts.{e}"
        assert torch.equal(saved[f"{prefix}.w1.weight"], gate_up[e, :inter])
        assert torch.equal(saved[f"{prefix}.w3.weight"], gate_up[e, inter:])
        assert torch.equal(saved[f"{prefix}.w2.weight"], down[e])
    replace_linears(model, sols)
    assert torch.allclose(logits(optq.load(tmp_path / "q", embeddings="model")), logits(model), atol=1e-6, rtol=0)


def _inspect(folder: Path, capsys) -> tuple[list[str], dict[str, tuple[int, int]], list[str]]:
    """(output lines, {kind: (quantized, float)}, the float-matrix lines) of ``optq inspect``."""
    from optq.cli import main

    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index(next(line for line in out if line.startswith("parameters by kind")))
    kinds = {}
    for line in out[start + 1 :]:
        m = re.fullmatch(r"  (\S.*?)\s+([\d,]+)\s+([\d,]+)", line)
        if not m:
            break
        kinds[m.group(1)] = (int(m.group(2).replace(",", "")), int(m.group(3).replace(",", "")))
    return out, kinds, [line.strip() for line in out if line.startswith("    model.")]


def _kind(name: str) -> str:
    if re.search(r"\.experts\.", name + "."):
        return "experts (routed)"
    if ".shared_expert" in name:
        return "shared experts" if not name.endswith("shared_expert_gate") else "routers"
    if name.endswith((".gate", ".router")):
        return "routers"
    if "norm" in name.rsplit(".", 1)[-1] or "layers" not in name:
        return "other"
    return "attention" if ".self_attn." in name else "dense MLP"


def expected_kinds(model, sols) -> dict[str, tuple[int, int]]:
    """Parameters per kind computed from the model: solutions quantized, everything else float."""
    counts: dict[str, list[int]] = {}
    for name, t in model.state_dict().items():
        owner = name.rsplit(".", 1)[0]
        row = counts.setdefault(_kind(owner), [0, 0])
        row[0 if owner in sols and name.endswith(".weight") else 1] += t.numel()
    return {k: (q, f) for k, (q, f) in counts.items()}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_inspect_counts_parameters_per_kind(tmp_path, capsys, arch):
    model, sols = quantized(arch, cfg=optq.QuantConfig(bits=4, group_size=-1))
    optq.save(model, tmp_path / "q", solutions=sols)
    out, kinds, floats = _inspect(tmp_path / "q", capsys)
    assert kinds == expected_kinds(model, sols)
    assert kinds["experts (routed)"][1] == model.get_submodule(float_expert(arch)).weight.numel()
    if arch != "mixtral":
        assert kinds["shared experts"][0] > 0
    w2 = source_name(arch, float_expert(arch)).replace("layers.1", "layers.*").replace("experts.1", "experts.*")
    assert f"{w2}.weight: 1 x [32, 16], experts (routed)" in floats
    assert any(line.startswith(f"{source_name(arch, 'model.layers.*.mlp.gate')}.weight: ") for line in floats)
    note = next(line for line in out if line.startswith("  expert weights left in float ("))
    assert note.endswith(") run unquantized on every engine") and w2 in note and ".gate" not in note
    assert any(re.match(r"  vllm +\d+ layers, all on Marlin ", line) for line in out)  # the quantized ones
    # every expert quantized: a plain yes
    model, sols = quantized(arch, keep_float=False, cfg=optq.QuantConfig(bits=4, group_size=-1))
    optq.save(model, tmp_path / "all", solutions=sols)
    out, kinds, floats = _inspect(tmp_path / "all", capsys)
    assert kinds["experts (routed)"][1] == 0
    assert not any("expert weights left in float" in line for line in out)
    assert any(re.match(r"  vllm +\d+ layers, all on Marlin ", line) for line in out)
    assert all("routers" in line for line in floats)


def test_fused_experts_optq_cannot_split_stay_float_and_are_named(tmp_path, capsys, monkeypatch):
    # A model type with no per-expert layout, transformers' or optq's: GPT-OSS with optq's removed.
    from optq.formats import experts as experts_module

    monkeypatch.setattr(experts_module, "_OWN_LAYOUTS", {})
    model = tiny_moe.build("gpt_oss")
    assert unfuse_experts(model)[0] == []  # left fused
    attention = {n: m for n, m in find_linears(model).items() if "self_attn" in n}
    sols = {n: optq.rtn(get_weight(m), optq.QuantConfig(bits=4, group_size=32)) for n, m in attention.items()}
    optq.save(model, tmp_path / "q", solutions=sols)
    saved = tensors(tmp_path / "q")
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(saved["model.layers.0.mlp.experts.gate_up_proj"], fused)
    replace_linears(model, sols)
    assert torch.allclose(logits(optq.load(tmp_path / "q", embeddings="model")), logits(model), atol=1e-6, rtol=0)
    out, kinds, floats = _inspect(tmp_path / "q", capsys)
    assert f"model.layers.*.mlp.experts.gate_up_proj: 2 x {list(fused.shape)}, experts (routed)" in floats
    assert "model.layers.*.mlp.experts.down_proj: 2 x [4, 16, 32], experts (routed)" in floats
    assert kinds["experts (routed)"][0] == 0 and kinds["attention"][0] == sum(s.weight.numel() for s in sols.values())
    note = next(line for line in out if line.startswith("  expert weights left in float ("))
    assert "model.layers.*.mlp.experts.gate_up_proj" in note


# ----------------------------------------------------------------------------- streaming
def test_save_pretrained_writes_per_expert_source_names_and_the_source_reads_them(tmp_path):
    from optq.pipeline.stream.source import SafetensorsSource, SourceError

    original = tiny_moe.build("mixtral")
    original.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    index = read_index(tmp_path / "src")
    per_expert = {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
        for i in range(2)
        for e in range(tiny_moe.EXPERTS)
        for w in ("w1", "w2", "w3")
    }
    assert per_expert <= set(index) and not [k for k in index if ".mlp." in k or "gate_up_proj" in k]

    src = SafetensorsSource(tmp_path / "src")
    model = src.skeleton()
    unfuse_experts(model)
    block = model.model.layers[0]
    with pytest.raises(SourceError, match=r"has no tensor model\.layers\.0\.mlp\."):
        src.load(block, "model.layers.0", "cpu", torch.float32)  # transformers' names: not in the file
    src.use_names(checkpoint_namer(model))
    src.load(block, "model.layers.0", "cpu", torch.float32)
    assert set(src.loaded) == {k for k in index if k.startswith("model.layers.0.")}
    fused = original.model.layers[0].mlp.experts
    inter = fused.down_proj.shape[2]
    for e in range(tiny_moe.EXPERTS):
        assert torch.equal(block.mlp.experts[e].w1.weight, fused.gate_up_proj[e, :inter].float())
        assert torch.equal(block.mlp.experts[e].w3.weight, fused.gate_up_proj[e, inter:].float())
        assert torch.equal(block.mlp.experts[e].w2.weight, fused.down_proj[e].float())
    assert torch.equal(block.mlp.gate.weight, original.model.layers[0].mlp.gate.weight.float())


@pytest.mark.parametrize("fmt", ["gptq_v2", "compressed-tensors"])
def test_streamed_mixtral_matches_quantize_and_save(tmp_path, fmt):
    # Runs the pipeline (optq.quantize, quantize_pretrained) end to end on a tiny Mixtral.
    from transformers import AutoModelForCausalLM

    from optq.pipeline.stream.quantize import quantize_pretrained

    tiny_moe.build("mixtral").save_pretrained(tmp_path / "src")
    cfg = optq.QuantConfig(bits=4, group_size=16)
    left = float_expert("mixtral")  # excluded: written in float, and listed in ignore
    quantize_pretrained(tmp_path / "src", tmp_path / "streamed", IDS, cfg, format=fmt, exclude=left, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    report = optq.quantize(model, IDS, cfg, exclude=left, progress=False)
    optq.save(model, tmp_path / "saved", solutions=report.solutions, format=fmt)
    streamed, saved = tensors(tmp_path / "streamed"), tensors(tmp_path / "saved")
    assert f"model.layers.1.block_sparse_moe.experts.3.w2.{MARKER[fmt]}" in saved
    assert f"{source_name('mixtral', left)}.weight" in saved
    assert sorted(streamed) == sorted(saved) and not [k for k in saved if ".mlp." in k]
    for key, t in saved.items():
        assert torch.equal(streamed[key], t), key
    s_qc, m_qc = (
        json.loads((tmp_path / f / "config.json").read_text())["quantization_config"] for f in ("streamed", "saved")
    )
    assert s_qc == m_qc
    if fmt == "compressed-tensors":
        routers = [f"model.layers.{i}.block_sparse_moe.gate" for i in range(2)]
        assert s_qc["ignore"] == sorted(["lm_head", *routers, source_name("mixtral", left)])
