"""The dry-run plan: its terms against hand computations from the config, its listing against
find_linears, its disk prediction against a real streaming run, and no tensor data read."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from tiny import build, tokens

import optq
from optq.formats.linears import find_linears
from optq.pipeline import planning as plan_mod
from optq.pipeline.planning import RUNTIME_BYTES, plan
from optq.pipeline.stream.quantize import quantize_pretrained
from optq.pipeline.stream.source import SafetensorsSource

CFG = optq.QuantConfig(bits=4, group_size=16)
SPEED = {"flops": 1e10, "solve_unit": 1e-10}  # fixed: no timing in the tests


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "llama"
    build("llama").to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
    return path


def _plan(source, **kw):
    kw.setdefault("nsamples", 6)
    kw.setdefault("seqlen", 16)
    kw.setdefault("config", CFG)
    return plan(source, speed=SPEED, **kw)


def test_terms_equal_hand_computation(folder):
    cfg = json.loads((folder / "config.json").read_text())
    h, i, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    n, seqlen, batch = 6, 16, 4
    p = _plan(folder, nsamples=n, seqlen=seqlen, batch_size=batch, method="gptq")  # GPTAQ's terms: below
    T = n * seqlen
    assert p.ram["runtime"] == RUNTIME_BYTES
    assert p.ram["activations"] == T * h * 4
    assert p.ram["recorded outputs (replay)"] == T * h * 4
    assert "original outputs" not in p.ram
    assert p.ram["batch temporaries"] == batch * seqlen * (3 * i + 3 * h) * 4
    # One Llama block: q, o (h x h), k, v (kv x h), gate, up (i x h), down (h x i), two norms.
    block = 2 * h * h + 2 * kv * h + 3 * i * h + 2 * h
    assert p.ram["one block"] == block * 4
    # Untied head: not loaded during the blocks; the embeddings and final norm are, in float32.
    assert cfg["tie_word_embeddings"] is False
    assert p.capture["embeddings (+ norm)"] == (vocab * h + h) * 4
    # The largest solve: gate+up (rows 2i, K=h) or down (rows h, K=i), with its Hessians (the
    # solver's on normalised tokens and the plain one, float32).
    hessians, solve = max(
        ((2 * K * K * 4, (5 * R * K + 4 * K * K) * 4) for R, K in [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]),
        key=sum,
    )
    assert (p.ram["hessians"], p.ram["solve workspace"]) == (hessians, solve)
    assert p.peak_ram == max(sum(p.capture.values()), sum(p.ram.values()), sum(p.assembly.values()))
    assert p.disk["journal: activations (2 files while replaced)"] == 2 * T * h * 4


def test_hessian_dtype_doubles_the_predicted_hessian_memory(folder):
    # The plan gets the run's own settings: float64 Hessians take twice the bytes, the rest stays.
    single = _plan(folder, nsamples=6, seqlen=16)
    double = _plan(folder, nsamples=6, seqlen=16, hessian_dtype="float64")
    assert double.ram["hessians"] == 2 * single.ram["hessians"] > 0
    assert double.ram["solve workspace"] == single.ram["solve workspace"]
    assert double.settings["hessian_dtype"] == "float64" and single.settings["hessian_dtype"] == "float32"
    rest = {k: v for k, v in single.ram.items() if k != "hessians"}
    assert rest == {k: v for k, v in double.ram.items() if k != "hessians"}


def test_strategy_propagate_dtype_terms(folder):
    h, i = 32, 64
    T = 6 * 16
    p = _plan(folder, strategy="pause", propagate="original", compute_dtype=torch.bfloat16, method="gptq")
    assert p.ram["activations"] == T * h * 2
    assert "recorded outputs (replay)" not in p.ram
    assert p.ram["original outputs"] == T * h * 2
    assert p.ram["paused forwards"] == T * (i + 2 * h) * 2


@pytest.mark.parametrize("strategy", ["replay", "pause"])
def test_gptaq_the_default_adds_one_forward_and_holds_the_float_chain(folder, strategy):
    # GPTAQ (the default method) runs a float copy of every block beside the quantized one, on
    # the float model's activations, once per block (tests/pipeline/test_gptaq_twin.py), and
    # always replays (it pairs every batch with the float block's).
    cfg = json.loads((folder / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    T = 6 * 16
    aq, q = _plan(folder, strategy=strategy), _plan(folder, method="gptq")  # GPTQ replaying
    assert aq.settings["method"] == "gptaq" and q.settings["method"] == "gptq"
    assert any("every block is replayed" in note for note in aq.notes) == (strategy == "pause")
    block = (2 * h * h + 2 * kv * h + 3 * i * h + 2 * h) * 4
    assert aq.ram["float chain, its recorded outputs and block (gptaq)"] == 2 * T * h * 4 + block
    assert "float chain, its recorded outputs and block (gptaq)" not in q.ram
    assert aq.ram["recorded outputs (replay)"] == T * h * 4 and "paused forwards" not in aq.ram
    assert aq.seconds["forwards"] == pytest.approx(3 / 2 * q.seconds["forwards"], rel=1e-12)  # replay: 2
    assert aq.seconds["hessians"] == pytest.approx(2 * q.seconds["hessians"], rel=1e-12)
    key = "journal: activations (2 files while replaced)"
    assert aq.disk[key] == 2 * q.disk[key] == 2 * 2 * T * h * 4


def test_listing_matches_find_linears(folder):
    p = _plan(folder, exclude="*.down_proj")
    model = SafetensorsSource(folder).skeleton()
    blocks = model.model.layers
    assert p.blocks_name == "model.layers"
    assert [b["name"] for b in p.blocks] == [f"model.layers.{k}" for k in range(len(blocks))]
    for k, b in enumerate(p.blocks):
        lin = find_linears(blocks[k], f"model.layers.{k}")
        assert [x["name"] for x in b["linears"]] == list(lin)
        for x in b["linears"]:
            w = lin[x["name"]].weight
            assert (x["out"], x["in"]) == tuple(w.shape)
            assert x["quantized"] == (not x["name"].endswith("down_proj"))
    text = p.format()
    assert "mlp.down_proj" in text and "(kept)" in text and "predicted peak RAM" in text
    assert json.loads(json.dumps(p.to_dict()))["peak_ram"] == p.peak_ram


def _safetensors_sizes(folder: Path) -> tuple[int, int]:
    """(tensor data bytes, header bytes) over the folder's safetensors files."""
    data = header = 0
    for f in folder.glob("*.safetensors"):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header += 8 + n
        data += len(raw) - 8 - n
    return data, header


@pytest.mark.parametrize("arch,shard", [("llama", "5GB"), ("qwen2", "8KB"), ("gpt2", "5GB")])
def test_disk_prediction_matches_a_streaming_run(tmp_path, arch, shard):
    src = tmp_path / "src"
    build(arch).to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    p = _plan(src, max_shard_size=shard)
    out = tmp_path / "out"
    quantize_pretrained(src, out, tokens(n=6, seqlen=16), CFG, max_shard_size=shard, progress=False)
    data, _ = _safetensors_sizes(out)
    assert p.disk["output tensors"] == data  # exact: every packed and copied tensor
    assert (out / "model.safetensors.index.json").exists() == (shard == "8KB")
    actual = sum(f.stat().st_size for f in out.iterdir())
    assert abs(p.output_bytes - actual) < 4096, (p.output_bytes, actual)
    # The packed part by hand: 4-bit codes, per-group fp16 scales and packed zeros, int32 g_idx.
    model = SafetensorsSource(src).skeleton()
    packed = 0
    for name, mod in find_linears(model).items():
        if ".layers." not in name and ".h." not in name:
            continue
        w = mod.weight if type(mod).__name__ != "Conv1D" else mod.weight.T
        N, K = w.shape
        groups = math.ceil(K / 16)
        packed += K * N // 2 + groups * math.ceil(N / 8) * 4 + groups * N * 2 + K * 4
        packed += N * 2 if getattr(mod, "bias", None) is not None else 0
    assert p.disk["journal: packed blocks"] - packed == pytest.approx(0, abs=4096 * len(p.blocks))
    assert p.disk["journal: packed blocks"] >= packed


def test_config_dict_source_matches_folder(folder):
    cfg = json.loads((folder / "config.json").read_text())
    a, b = _plan(folder), _plan(cfg, source_dtype=torch.bfloat16)
    assert a.ram == b.ram
    assert a.disk["output tensors"] == b.disk["output tensors"]
    assert [x["name"] for blk in a.blocks for x in blk["linears"]] == [
        x["name"] for blk in b.blocks for x in blk["linears"]
    ]


def test_tied_embeddings_count_once(tmp_path):
    model = build("gemma3").to(torch.bfloat16)  # Gemma ties its head to the embeddings
    model.save_pretrained(tmp_path / "g")
    p = _plan(tmp_path / "g")
    cfg = model.config
    norms = cfg.hidden_size  # the final norm
    assert p.capture["embeddings (+ norm)"] == (cfg.vocab_size * cfg.hidden_size + norms) * 4


def test_plan_reads_no_tensor_data(folder, monkeypatch):
    def refuse(self, name):
        raise AssertionError(f"the plan read {name}")

    monkeypatch.setattr(SafetensorsSource, "read", refuse)
    monkeypatch.setattr(SafetensorsSource, "load", lambda *a, **k: refuse(None, "a module"))
    p = _plan(folder)
    assert p.peak_ram > RUNTIME_BYTES


def test_time_estimate_scales_with_speed(folder):
    cfg = json.loads((folder / "config.json").read_text())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    n, seqlen = 6, 16
    T = n * seqlen
    # The work, from the config by hand: each linear's matmul (2 T N K), attention (4 T L h), two
    # passes per block (replay); one Hessian (2 T K²) per group of a parent module and input width
    # (self_attn: q, k, v, o on h; mlp: gate, up on h; down on i); a solve of K³ + R K² per group.
    linear = 2 * T * (h * h + 2 * kv * h + h * h + 2 * i * h + h * i)
    forwards = 2 * layers * (linear + 4 * T * seqlen * h)
    hessians = layers * 2 * T * (h * h + h * h + i * i)
    solves = layers * ((h**3 + (2 * h + 2 * kv) * h * h) + (h**3 + 2 * i * h * h) + (i**3 + h * i * i))
    for flops, unit in ((1e9, 1e-9), (1e10, 1e-10)):
        speed = {"flops": flops, "solve_unit": unit}
        p = plan(folder, nsamples=n, seqlen=seqlen, config=CFG, speed=speed, method="gptq")
        assert p.seconds["forwards"] == pytest.approx(forwards / flops, rel=1e-12)
        assert p.seconds["hessians"] == pytest.approx(hessians / flops, rel=1e-12)
        assert p.seconds["solves"] == pytest.approx(solves * unit, rel=1e-12)
    assert plan_mod.machine_speed()["flops"] > 0


@pytest.mark.parametrize("strategy", ["replay", "pause"])
def test_rtn_from_the_weights_alone_plans_no_calibration(folder, strategy):
    # Run.weights_only: round-to-nearest without target_bits captures nothing, runs no block,
    # holds no Hessian and journals no activations; its packed output is GPTQ's.
    r, q = _plan(folder, method="rtn", strategy=strategy), _plan(folder, method="gptq", strategy=strategy)
    assert r.capture == {} and q.capture["activations"] > 0
    assert "while capturing" not in r.format() and "while capturing" in q.format()
    assert r.ram["activations"] == r.ram["hessians"] == 0 < q.ram["hessians"]
    assert not {"recorded outputs (replay)", "paused forwards", "batch temporaries"} & set(r.ram)
    assert r.seconds["forwards"] == r.seconds["hessians"] == 0 < q.seconds["forwards"]
    assert r.disk["journal: activations (2 files while replaced)"] == 0
    assert r.output_bytes == q.output_bytes and r.journal_bytes[0] == q.journal_bytes[0]
    assert any("reads no calibration" in n for n in r.notes) and not any("calibration" in n for n in q.notes)
    # With target_bits the allocation measures every layer on calibration activations.
    t = _plan(folder, method="rtn", strategy=strategy, target_bits=4.25)
    assert t.capture and t.ram["activations"] > 0 and t.seconds["forwards"] > 0
