"""The streaming path writes every checkpoint format byte for byte as the in-memory save does."""

from __future__ import annotations

import pytest
import torch

import optq
from optq.pipeline.stream.quantize import quantize_pretrained

transformers = pytest.importorskip("transformers")
from tiny import build, tokens  # noqa: E402

CFG = optq.QuantConfig(bits=4, group_size=16)


@pytest.mark.parametrize("fmt", ["gptq_v2", "compressed-tensors"])
def test_streamed_format_equals_the_in_memory_save(tmp_path, fmt):
    build("llama").save_pretrained(tmp_path / "src")
    calib = tokens(n=6, seqlen=16)
    quantize_pretrained(tmp_path / "src", tmp_path / "stream", calib, CFG, format=fmt, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    report = optq.quantize(model, calib, CFG, progress=False)
    optq.save(model, tmp_path / "memory", solutions=report.solutions, format=fmt)
    assert (tmp_path / "stream" / "model.safetensors").read_bytes() == (
        tmp_path / "memory" / "model.safetensors"
    ).read_bytes()
    import json

    def qc(folder):
        return json.loads((folder / "config.json").read_text())["quantization_config"]

    assert qc(tmp_path / "stream") == qc(tmp_path / "memory")
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stream", dtype=torch.float32).eval()
        x = calib[:2]
        with torch.no_grad():
            diff = (loaded(x).logits - model(x).logits).abs().max()
        assert diff < 1e-3  # scales stored in the model's dtype; codes identical
    else:
        loaded = optq.load(tmp_path / "stream", embeddings="model")
        with torch.no_grad():
            assert torch.allclose(loaded(calib[:2]).logits, model(calib[:2]).logits, atol=1e-3)


def test_compressed_tensors_refuses_act_order_without_static_groups_up_front(tmp_path):
    build("llama").save_pretrained(tmp_path / "src")
    cfg = optq.QuantConfig(bits=4, group_size=16, act_order=True, static_groups=False)
    with pytest.raises(ValueError, match="static groups"):
        quantize_pretrained(
            tmp_path / "src", tmp_path / "q", tokens(n=2, seqlen=16), cfg, format="compressed-tensors", progress=False
        )
    assert not (tmp_path / "q.partial").exists()  # refused before any work
