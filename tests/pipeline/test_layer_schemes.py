"""Per-layer configs in a run (optq.pipeline.schemes): overrides by pattern, the group sizes the
serving engines need, and the refusals that stop a run before any block is read."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import llama

import optq
from optq.core.config import QuantConfig
from optq.pipeline.schemes import parse_override_text, resolve
from optq.pipeline.settings import RunSettings

transformers = pytest.importorskip("transformers")

CFG = QuantConfig(bits=3, group_size=16)


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))


def _quantize(model, config=CFG, **kw):
    return optq.quantize(model, _ids(), config, progress=False, batch_size=4, **kw)


def test_an_override_changes_only_the_layers_it_names():
    plain = _quantize(llama())
    report = _quantize(llama(), overrides={"*.down_proj": {"bits": 8}, "*.0.mlp.*": {"bits": 2}})
    for name, sol in report.solutions.items():
        want = 8 if name.endswith("down_proj") else (2 if ".0.mlp." in name else 3)  # the first pattern decides
        assert sol.config.bits == want, name
        assert int(sol.codes.max()) < 2**want and (want != 8 or int(sol.codes.max()) > 15), name
    # Block 0's attention is solved before any overridden layer: byte for byte the plain run's.
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        key = f"model.layers.0.self_attn.{name}"
        assert torch.equal(report.solutions[key].codes, plain.solutions[key].codes), key
    assert report.schemes["model.layers.1.mlp.down_proj"]["changes"] == {"bits": 8}
    assert report.schemes["model.layers.0.mlp.down_proj"]["why"] == "override '*.down_proj'"
    assert "model.layers.1.mlp.up_proj" not in report.schemes
    assert json.loads(json.dumps(report.to_dict()))["schemes"] == report.schemes


def test_members_of_one_hessian_with_different_configs_are_solved_apart():
    # k_proj alone at 4 bits, group 8: q and v are still solved stacked on the shared H, and a
    # stacked solve equals separate ones, so they are the plain run's exactly.
    plain = _quantize(llama())
    report = _quantize(llama(), overrides=[("*.0.self_attn.k_proj", {"bits": 4, "group_size": 8})])
    k = report.solutions["model.layers.0.self_attn.k_proj"]
    assert (k.config.bits, k.config.group_size, k.scales.shape[1]) == (4, 8, 4)
    assert int(k.codes.max()) > 7  # a 4-bit grid was used, not the 3-bit one
    for name in ("q_proj", "v_proj"):
        key = f"model.layers.0.self_attn.{name}"
        assert torch.equal(report.solutions[key].codes, plain.solutions[key].codes), key


def test_group_sizes_are_fitted_per_layer_for_vllm_and_optq_and_model_wide_for_transformers():
    # hidden 96: q/k/v/o/gate/up read 96 columns, down_proj 256; 64 divides only 256.
    model = llama(hidden=96, inter=256, heads=4, kv=4)
    config = QuantConfig(bits=4, group_size=64)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}
    per_layer = resolve(linears, list(linears), config, serve=("vllm", "optq"))
    assert {n: c.group_size for n, c in per_layer.layers.items()} == {
        n: 32 for n in linears if not n.endswith("down_proj")
    }
    assert per_layer.of("model.layers.0.mlp.down_proj") == config
    assert "input width 96" in per_layer.why["model.layers.0.self_attn.q_proj"]
    assert len(per_layer.notes) == 1 and "12 layer(s)" in per_layer.notes[0]
    # transformers builds every GPTQ layer from the config's one scheme: one group for all.
    wide = resolve(linears, list(linears), config, serve=("vllm", "transformers", "optq"))
    assert {c.group_size for c in wide.layers.values()} == {32} and set(wide.layers) == set(linears)
    assert "input width 96" in wide.why["model.layers.0.self_attn.q_proj"]
    assert "one group size for every layer" in wide.why["model.layers.0.mlp.down_proj"]  # 256 alone takes 64
    # compressed-tensors holds one group per setting: per layer again.
    ct = resolve(linears, list(linears), config, serve=("vllm", "transformers", "optq"), fmt="compressed-tensors")
    assert set(ct.layers) == set(per_layer.layers)
    # The run quantizes with the fitted groups: g_idx of a 96-wide layer has 3 groups.
    report = _quantize(model, config, serve=("vllm", "optq"))
    q = report.solutions["model.layers.1.self_attn.q_proj"]
    assert q.config.group_size == 32 and int(q.g_idx.max()) == 2
    assert report.solutions["model.layers.1.mlp.down_proj"].config.group_size == 64


def test_strict_groups_refuses_before_any_block_naming_the_layers():
    model = llama(hidden=96, inter=256, heads=4, kv=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"--strict-groups: 12 layer\(s\).*q_proj \(96\)"):
        _quantize(model, QuantConfig(bits=4, group_size=64), serve=("vllm", "optq"), strict_groups=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_what_no_group_size_fixes_is_refused_naming_layer_and_engine():
    # 3 bits on a 16-wide output: vLLM's gptq kernel packs output columns in 32-bit words.
    first = r"4 layer\(s\)[^\n]*\n  model.layers.0.self_attn.k_proj \(vllm\): .*output width x bits % 32"
    with pytest.raises(ValueError, match=first):
        _quantize(llama(), serve=("vllm",))
    _quantize(llama(), serve=("optq",))  # optq's loader runs any shape


def test_an_override_that_splits_a_layer_vllm_fuses_is_refused():
    with pytest.raises(ValueError, match="qkv_proj|fused"):
        _quantize(
            llama(hidden=128, inter=256),
            QuantConfig(bits=4, group_size=32),
            overrides={"*.q_proj": {"bits": 8}},
            serve=("vllm",),
        )


@pytest.mark.parametrize(
    "value,match",
    [
        ({"*.q_proj": {"bitz": 8}}, "bitz"),
        ({"*.q_proj": {"bits": 5}}, "bits"),
        ({"*.q_proj": {}}, "nothing"),
        ({"*.q_proj": {"normalize_tokens": False}}, "normalize_tokens"),
        ([("*.q_proj",)], "pairs"),
    ],
)
def test_bad_overrides_are_refused_when_the_settings_are_built(value, match):
    with pytest.raises(ValueError, match=match):
        RunSettings(overrides=value)


def test_an_override_matching_no_layer_is_refused():
    with pytest.raises(ValueError, match="'\\*.qproj' matches none"):
        _quantize(llama(), overrides={"*.qproj": {"bits": 8}})


def test_serve_settings():
    assert RunSettings(serve="all").serve == ("vllm", "transformers", "optq")
    assert RunSettings(serve="none").serve == () == RunSettings().serve
    assert RunSettings(serve=["optq", "vllm"]).serve == ("optq", "vllm")
    with pytest.raises(ValueError, match="tgi"):
        RunSettings(serve="vllm,tgi")
    d = RunSettings(serve="vllm", overrides={"*.q_proj": {"bits": 8}}).to_dict()
    assert json.loads(json.dumps(d))["overrides"] == [["*.q_proj", {"bits": 8}]] and d["serve"] == ["vllm"]


@pytest.mark.parametrize(
    "text,want",
    [
        ("*.down_proj:bits=8", ("*.down_proj", {"bits": 8})),
        ("re:layers\\.0\\.:bits=8,group_size=64", ("re:layers\\.0\\.", {"bits": 8, "group_size": 64})),
        ("q_proj:sym=false,damp=0.1", ("q_proj", {"sym": False, "damp": 0.1})),
        ("q_proj:act-order=no", ("q_proj", {"act_order": False})),
    ],
)
def test_override_text(text, want):
    assert parse_override_text(text) == want


@pytest.mark.parametrize("text", ["down_proj", "down_proj:bits", "down_proj:bitz=8", "down_proj:bits=x", ":bits=8"])
def test_bad_override_text(text):
    with pytest.raises(ValueError, match="--override"):
        parse_override_text(text)


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_a_streamed_checkpoint_records_per_layer_schemes_as_planned(tmp_path, fmt):
    import struct

    from optq.formats.qlinear import QuantLinear
    from optq.pipeline.planning.predict import plan
    from optq.pipeline.stream.quantize import quantize_pretrained

    src, out = tmp_path / "src", tmp_path / "out"
    llama().save_pretrained(src)
    kw = dict(overrides={"*.down_proj": {"bits": 8}}, serve=("optq",), format=fmt)
    predicted = plan(src, CFG, nsamples=8, seqlen=16, speed={"flops": 1e10, "solve_unit": 1e-10}, **kw)
    report = quantize_pretrained(src, out, _ids(), CFG, progress=False, batch_size=4, **kw)
    data = 0
    for f in out.glob("*.safetensors"):
        raw = f.read_bytes()
        data += len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]
    assert predicted.disk["output tensors"] == data  # the 8-bit layers' packed sizes, as planned
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert ("dynamic" in qc) == (fmt == "gptq") and (len(qc.get("config_groups", {})) == 2) == (fmt != "gptq")
    loaded = optq.load(out, embeddings="model")
    bits = {n: m.bits for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    assert bits and all(b == (8 if n.endswith("down_proj") else 3) for n, b in bits.items()), bits
    assert set(report.schemes) == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}


def test_save_warns_per_engine_that_refuses_saved_layers(tmp_path, caplog):
    def saved(model, report, folder):
        caplog.clear()
        with caplog.at_level("WARNING", logger="optq.checkpoint"):
            optq.save(model, tmp_path / folder, solutions=report.solutions)
        return [r.getMessage() for r in caplog.records if r.name == "optq.checkpoint"]

    model = llama()
    warned = saved(model, _quantize(model, QuantConfig(bits=4, group_size=16)), "odd")  # no serve: nothing fitted
    assert len(warned) == 1 and ": transformers refuses 14 of 14 layers" in warned[0], warned  # GPTQModel: group 16
    model = llama(hidden=128, inter=256)
    report = _quantize(model, QuantConfig(bits=4, group_size=32), serve=("vllm", "transformers", "optq"))
    assert saved(model, report, "clean") == []
