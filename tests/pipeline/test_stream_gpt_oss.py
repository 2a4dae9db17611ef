"""A GPT-OSS model folder streamed (``quantize_pretrained``, what ``optq quantize`` runs): its
experts are stored fused, as ``save_pretrained`` writes them, and each expert matrix is read as
a slice of the fused tensors, each fused tensor read and hashed once. The output is the bytes of
``optq.quantize`` + ``optq.save``, with experts left out written per expert in float as
``optq.save`` writes them; a killed run resumes to the same bytes; the dry-run plan counts the
experts as packed and predicts the output tensors exactly."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch

import optq
from optq.formats.files import INDEX, read_index
from optq.formats.qlinear import QuantLinear
from optq.pipeline.stream.source import SafetensorsSource, tensor_sha256

tiny_moe = pytest.importorskip("tiny_moe")

pytestmark = pytest.mark.usefixtures("one_thread")

FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
LEAVES = ("gate_proj", "up_proj", "down_proj")


def _save(folder: Path, dtype: torch.dtype, shard: int) -> Path:
    tiny_moe.build("gpt_oss").to(dtype).save_pretrained(folder, max_shard_size=shard)
    keys = set(read_index(folder))
    assert {f"model.layers.{i}.mlp.experts.{k}" for i in range(2) for k in FUSED} <= keys
    assert not any(".experts.0." in k for k in keys)  # fused on disk: nothing per expert
    return folder


def _in_memory(kit, src: Path, out: Path, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    report = optq.quantize(model, kit.tokens(n=6, seqlen=16), kit.CFG, progress=False, **kw)
    optq.save(model, out, solutions=report.solutions, max_shard_size=kit.SHARD)
    return report


def _same_weights(kit, streamed: Path, saved: Path) -> dict[str, bytes]:
    a, b = kit.folder_bytes(streamed), kit.folder_bytes(saved)
    weights = sorted(k for k in b if k.endswith(".safetensors") or k == INDEX)
    assert sorted(k for k in a if k.endswith(".safetensors") or k == INDEX) == weights
    for name in [*weights, "quantize_config.json"]:
        assert a[name] == b[name], name
    s_cfg, m_cfg = json.loads(a["config.json"]), json.loads(b["config.json"])
    assert s_cfg["quantization_config"] == m_cfg["quantization_config"]
    return a


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = optq.load(folder, embeddings="model")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.use_fast_path = False  # the exact path
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_fp32_streamed_gpt_oss_is_byte_identical_to_quantize_and_save(kit, tmp_path, monkeypatch):
    src = _save(tmp_path / "src", torch.float32, kit.SHARD)
    reads: Counter[str] = Counter()
    orig = SafetensorsSource.read

    def read(self, name):
        reads[name] += 1
        return orig(self, name)

    with monkeypatch.context() as mp:
        mp.setattr(SafetensorsSource, "read", read)
        streamed = kit.stream(src, tmp_path / "streamed")
    fused = [k for k in read_index(src) if k.rsplit(".", 1)[1] in FUSED]
    assert {k: reads[k] for k in fused} == dict.fromkeys(fused, 1)  # once per block, not per expert
    assert not [k for k in reads if ".experts.0." in k]  # per-expert names are slices, never read
    _in_memory(kit, src, tmp_path / "saved")
    out = _same_weights(kit, tmp_path / "streamed", tmp_path / "saved")
    index = read_index(tmp_path / "streamed")
    assert not [k for k in index if k.rsplit(".", 1)[1] in FUSED]  # no fused tensor copied
    for i in range(2):
        for e in range(tiny_moe.EXPERTS):
            for leaf in LEAVES:
                name = f"model.layers.{i}.mlp.experts.{e}.{leaf}"
                assert f"{name}.qweight" in index and index[f"{name}.bias"][2] == torch.float16, name
    assert all(".experts." not in n or streamed.layers[n].hessian for n in streamed.layers)
    assert json.loads(out[kit.REPORT])["layers"].keys() == streamed.layers.keys()
    ids = tiny_moe.tokens(n=2, seqlen=16)
    assert torch.equal(_logits(tmp_path / "streamed", ids), _logits(tmp_path / "saved", ids))


def test_the_journal_hashes_each_fused_tensor_once_as_read(kit, tmp_path, monkeypatch):
    from optq.pipeline.stream.journal import Journal

    src = _save(tmp_path / "src", torch.bfloat16, 10**9)
    commits: list[dict[str, str]] = []
    orig = Journal.commit

    def commit(self, done, hidden, snap, sources):
        commits.append(dict(sources))
        return orig(self, done, hidden, snap, sources)

    with monkeypatch.context() as mp:
        mp.setattr(Journal, "commit", commit)
        kit.stream(src, tmp_path / "out")
    source = SafetensorsSource(src)
    for i, sources in enumerate(commits):
        for k in FUSED:
            key = f"model.layers.{i}.mlp.experts.{k}"
            assert sources[key] == tensor_sha256(source.read(key)), key
        assert not any(".experts.0." in k for k in sources)


def test_streamed_gpt_oss_killed_after_block_0_resumes_to_the_same_bytes(kit, tmp_path, monkeypatch):
    from pipeline.resume_helpers import Kill, after_write_block

    src = _save(tmp_path / "src", torch.bfloat16, kit.SHARD)
    ref = kit.stream(src, tmp_path / "ref")
    with monkeypatch.context() as mp:
        after_write_block(mp, 0)
        with pytest.raises(Kill):
            kit.stream(src, tmp_path / "out")
    resumed = kit.stream(src, tmp_path / "out", resume=True)
    assert kit.folder_bytes(tmp_path / "out") == kit.folder_bytes(tmp_path / "ref")
    assert resumed.moe == ref.moe
    # bf16 source: the copied tensors stay bf16, the experts packed.
    index = read_index(tmp_path / "out")
    assert index["model.layers.0.mlp.router.weight"][2] == torch.bfloat16
    assert "model.layers.1.mlp.experts.3.down_proj.qweight" in index


def test_excluded_experts_are_written_per_expert_in_float_as_optq_save_does(kit, tmp_path):
    # Layer 0: every expert left out; layer 1: one expert's down_proj only.
    exclude = ["model.layers.0.mlp.experts.*", "model.layers.1.mlp.experts.2.down_proj"]
    src = _save(tmp_path / "src", torch.float32, kit.SHARD)
    kit.stream(src, tmp_path / "streamed", exclude=exclude)
    _in_memory(kit, src, tmp_path / "saved", exclude=exclude)
    _same_weights(kit, tmp_path / "streamed", tmp_path / "saved")
    index = read_index(tmp_path / "streamed")
    assert not [k for k in index if k.rsplit(".", 1)[1] in FUSED]  # not even for layer 0
    for e in range(tiny_moe.EXPERTS):
        for leaf in LEAVES:
            name = f"model.layers.0.mlp.experts.{e}.{leaf}"
            assert index[f"{name}.weight"][2] == torch.float32 and f"{name}.qweight" not in index
    assert index["model.layers.1.mlp.experts.2.down_proj.weight"][1] == (32, 16)  # [out, in], transposed back
    assert "model.layers.1.mlp.experts.2.up_proj.qweight" in index
    with torch.no_grad():  # the float slices are the fused source's, exactly
        from safetensors.torch import load_file

        fused = SafetensorsSource(src).read("model.layers.0.mlp.experts.gate_up_proj")
        out = {}
        for f in (tmp_path / "streamed").glob("*.safetensors"):
            out.update(load_file(f))
        assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], fused[1][:, 16:].T)
    ids = tiny_moe.tokens(n=2, seqlen=16)
    assert torch.equal(_logits(tmp_path / "streamed", ids), _logits(tmp_path / "saved", ids))


def test_the_dry_run_plan_counts_gpt_oss_experts_as_packed(tmp_path):
    from optq.pipeline.planning import plan
    from optq.pipeline.stream.quantize import quantize_pretrained

    src = _save(tmp_path / "src", torch.bfloat16, 10**9)
    cfg = optq.QuantConfig(bits=4, group_size=16)
    p = plan(src, cfg, speed={"flops": 1e10, "solve_unit": 1e-10}, nsamples=6, seqlen=16)
    experts = [x for b in p.blocks for x in b["linears"] if ".experts." in x["name"]]
    assert len(experts) == 2 * tiny_moe.EXPERTS * 3 and all(x["quantized"] for x in experts)
    quantize_pretrained(src, tmp_path / "out", tiny_moe.tokens(n=6, seqlen=16), cfg, progress=False)
    data = 0
    for f in (tmp_path / "out").glob("*.safetensors"):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        data += len(raw) - 8 - n
    assert p.disk["output tensors"] == data  # the fused tensors replaced by the packed experts
