"""``optq inspect``: per serving engine which layers run on which kernel and which are refused and
why (the verdicts of optq/formats/engines.py, the table ``--serve`` checks), act-order as the run
used it, each layer's bits and group size, and why a layer differs (the report's ``schemes``).

Checkpoints are tiny Llamas quantized with ``optq.quantize`` and written with ``optq.save``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tiny import llama, tokens

import optq
from optq.cli import main
from optq.formats.engines import ENGINES, LayerShape, check_engines
from optq.formats.schemes import layer_schemes

transformers = pytest.importorskip("transformers")

STATIC = "act-order: yes, static groups (g_idx natural, no reordering)"
AVX_ELSE_ATEN = "TorchCpuAvx512Linear on CPUs with AVX512-BF16, else TorchAtenLinear"


def _saved(folder: Path, config: optq.QuantConfig, fmt: str = "gptq", kv_heads: int = 2, **options) -> Path:
    model = llama(hidden=128, inter=256, kv=kv_heads)  # 4 heads of 32: k/v 64 wide (32 with one kv head)
    report = optq.quantize(model, tokens(n=4, seqlen=16), config, progress=False, **options)
    optq.save(model, folder, solutions=report.solutions, report=report, format=fmt)
    return folder


def _inspect(folder: Path, capsys, *extra: str) -> list[str]:
    assert main(["inspect", str(folder), *extra]) == 0
    return capsys.readouterr().out.splitlines()


def _engine(out: list[str], engine: str) -> str:
    return next(line for line in out if line.startswith(f"  {engine} "))


def _table(out: list[str]) -> dict[str, tuple[int, ...]]:
    """The layer table: {layer: (in, out, bits, group)} (rows of one layer each)."""
    rows = [re.fullmatch(r"  (model\.\S+) +(\d+) +(\d+) +(\d+) +(-?\d+) (yes|no)", line) for line in out]
    return {m.group(1): tuple(int(m.group(i)) for i in range(2, 6)) for m in rows if m}


def _verdicts(folder: Path, fmt: str = "gptq") -> dict:
    """The engines' verdicts computed here from the checkpoint's config and shapes."""
    from optq.formats.files import read_index

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    index = read_index(folder)
    names = [k[: -len(".qweight")] for k in index if k.endswith(".qweight")]
    settings = layer_schemes(qc, names)
    shapes = {
        n: LayerShape(index[f"{n}.g_idx"][1][0], index[f"{n}.qweight"][1][1], *s.as_override().values())
        for n, s in settings.items()
    }
    base = LayerShape(1, 1, qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"])
    return check_engines(shapes, ENGINES, fmt, base=base)


def test_a_checkpoint_every_engine_takes_names_the_kernels_and_no_refusal(tmp_path, capsys):
    folder = _saved(tmp_path / "q", optq.QuantConfig(bits=4, group_size=32, act_order=False))
    verdicts = _verdicts(folder)
    assert not any(v.refused for found in verdicts.values() for v in found.values())  # chosen so
    out = _inspect(folder, capsys)
    assert out[0].endswith("4-bit, group size 32, symmetric, act-order: no")
    assert out[1].startswith("quantized layers: 14 by gptaq (H shrunk 0.5 toward its diagonal); parameters: ")
    assert out[3] == "engines (from optq/formats/engines.py; the run checked --serve none):"
    assert out[4:7] == [
        "  vllm          14 layers, all on Marlin  (CUDA, tensor parallel 1)",
        f"  transformers  14 layers, all on {AVX_ELSE_ATEN}  (GPTQModel 7.7 CPU kernels)",
        "  optq          14 layers, all on int4 (torch _weight_int4pack_mm_for_cpu)  (optq.load)",
    ]
    assert not any("refused" in line for line in out)
    table = _table(out)
    assert len(table) == 14 and set(table.values()) == {(128, 128, 4, 32), (128, 64, 4, 32), (128, 256, 4, 32)} | {
        (256, 128, 4, 32)
    }
    assert "schemes: base 4-bit, group 32, symmetric; 0 of 14 layers differ" in out


def test_a_refused_checkpoint_says_which_engine_refuses_which_layers_and_why(tmp_path, capsys):
    # Group 16 at 4 bits: GPTQModel's CPU kernels (without AVX512) need a group of 32..256;
    # vLLM leaves gptq_marlin for gptq's gptq_gemm; optq takes its reference path.
    folder = _saved(tmp_path / "q", optq.QuantConfig(bits=4, group_size=16, act_order=False))
    verdicts = _verdicts(folder)
    assert all(v.refused for v in verdicts["transformers"].values())
    out = _inspect(folder, capsys)
    line = _engine(out, "transformers")
    assert line.startswith("  transformers  0 of 14 layers run; refused 14 ") and "all on" not in line
    reason = out[out.index(line) + 1]
    assert reason.startswith("      refused model.layers.0.mlp.down_proj, ") and reason.endswith(
        "TorchFusedLinear: without CPUs with AVX512-BF16: needs group length (input width for -1) in "
        "(32, 64, 128, 256) (aten/src/ATen/native/LinearAlgebra.cpp: _weight_int4pack_mm_cpu: qGroupSize)"
    )
    assert out[out.index(line) + 2].startswith("        passed over first: TorchAtenLinear needs group size in ")
    assert (
        _engine(out, "vllm")
        == "  vllm          14 layers, all on gptq_gemm (float16 models)  (CUDA, tensor parallel 1)"
    )
    assert _engine(out, "optq") == "  optq          14 layers, all on reference dequantize  (optq.load)"
    assert set(_table(out)[n][2:] for n in _table(out)) == {(4, 16)}


def test_vllm_refusing_16_wide_3_bit_layers_is_said_with_the_method_it_left(tmp_path, capsys):
    from tiny import build, run

    model = build("llama")  # hidden 32: k/v are 16 wide, 48 bits a row at 3 bits
    report = run(model)
    optq.save(model, tmp_path / "q", solutions=report.solutions, report=report)
    out = _inspect(tmp_path / "q", capsys)
    vllm = _engine(out, "vllm")
    assert vllm.startswith("  vllm          10 of 14 layers run (10 on gptq_gemm (float16 models)); refused 4 ")
    assert out[out.index(vllm) + 1] == (
        "      refused model.layers.*.self_attn.k_proj (2), model.layers.*.self_attn.v_proj (2): gptq_gemm "
        "(float16 models): needs output width x bits % 32 "
        "(vllm/model_executor/layers/quantization/gptq.py: GPTQLinearMethod.create_weights: pack_factor)"
    )
    assert out[out.index(vllm) + 2] == (
        "        passed over first: gptq_marlin needs 4/8-bit symmetric, group size in (-1, 32, 64, 128)"
    )
    refused = sorted(n for n, v in _verdicts(tmp_path / "q")["vllm"].items() if v.refused)
    assert refused == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "kv"]


def test_layers_marlin_leaves_are_named_with_the_kernel_that_takes_them(tmp_path, capsys):
    # Act-order with reordering: Marlin wants output widths % 64, so the 32-wide k/v go to Exllama
    # (vLLM's old summary said a plain "yes" here).
    cfg = optq.QuantConfig(bits=4, group_size=32, act_order=True, static_groups=False)
    folder = _saved(tmp_path / "q", cfg, kv_heads=1)
    out = _inspect(folder, capsys)
    assert out[0].endswith("act-order: yes (desc_act, loaders reorder)")
    vllm = _engine(out, "vllm")
    assert vllm == "  vllm          14 layers: 10 on Marlin; 4 on Exllama (float16 models)  (CUDA, tensor parallel 1)"
    assert out[out.index(vllm) + 1] == (
        "      on Exllama (float16 models): model.layers.*.self_attn.k_proj (2), model.layers.*.self_attn.v_proj (2)"
    )
    kernels = {n: v.kernel for n, v in _verdicts(folder)["vllm"].items()}
    assert sorted(n for n, k in kernels.items() if k != "Marlin") == [
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "kv"
    ]


def test_act_order_is_reported_as_the_run_used_it(tmp_path, capsys):
    folder = _saved(tmp_path / "q", optq.QuantConfig(bits=4, group_size=32))  # static groups: the default
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is False  # loaders see a plain layout
    assert _inspect(folder, capsys)[0].endswith(STATIC)
    # the report decides: a run without act-order says no, whatever the config's flags
    report = json.loads((folder / "quantization_report.json").read_text())
    report["config"].update(act_order=False, static_groups=False)
    (folder / "quantization_report.json").write_text(json.dumps(report))
    assert _inspect(folder, capsys)[0].endswith("act-order: no")
    # without a report, the config's static_groups flag says it
    (folder / "quantization_report.json").unlink()
    assert _inspect(folder, capsys)[0].endswith(STATIC)


def test_mixed_layers_show_their_bits_and_the_reports_why(tmp_path, capsys):
    folder = _saved(tmp_path / "q", optq.QuantConfig(bits=4, group_size=32), overrides={"*.down_proj": {"bits": 8}})
    out = _inspect(folder, capsys)
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert "(base; 2 layers differ: see schemes)" in out[0]
    table = _table(out)
    assert {n: row[2:] for n, row in table.items() if row[2] != 4} == {n: (8, 32) for n in downs}
    assert len(table) == 14
    assert "schemes: base 4-bit, group 32, symmetric; 2 of 14 layers differ" in out
    assert f"    8-bit: {downs[0]}, {downs[1]} (why: override '*.down_proj')" in out
    # transformers builds every GPTQ layer from the config's base: the 8-bit ones are refused
    line = _engine(out, "transformers")
    assert line.startswith("  transformers  12 of 14 layers run (12 on ") and "refused 2 " in line
    assert "never reads `dynamic`" in out[out.index(line) + 1] and downs[1] in out[out.index(line) + 1]
    # optq's fast path runs the 8-bit layers too (two 4-bit planes)
    assert _engine(out, "optq").startswith("  optq          14 layers, all on int4 ")
    # older reports have no schemes; without a report nothing says why
    report = json.loads((folder / "quantization_report.json").read_text())
    del report["schemes"]
    (folder / "quantization_report.json").write_text(json.dumps(report))
    out = _inspect(folder, capsys)
    assert any(line.endswith("(why: the report records no reasons (written before per-layer schemes))") for line in out)
    (folder / "quantization_report.json").unlink()
    out = _inspect(folder, capsys)
    assert f"    8-bit: {downs[0]}, {downs[1]} (why: no quantization_report.json says why)" in out


def test_compressed_tensors_checkpoints_are_inspected_alike(tmp_path, capsys):
    cfg = optq.QuantConfig(bits=4, group_size=32)
    folder = _saved(tmp_path / "q", cfg, fmt="compressed-tensors", overrides={"*.down_proj": {"bits": 8}})
    out = _inspect(folder, capsys)
    assert out[0].startswith(f"{folder}: compressed-tensors (pack-quantized), 4-bit, group size 32, symmetric")
    assert out[0].endswith(STATIC)  # from the report: compressed-tensors stores no actorder for natural g_idx
    assert _engine(out, "vllm") == "  vllm          14 layers, all on Marlin  (CUDA, tensor parallel 1)"
    assert _engine(out, "transformers") == (
        "  transformers  14 layers, all on decompress to float  (compressed-tensors 0.20)"
    )
    table = _table(out)
    assert sorted(n for n, row in table.items() if row[2] == 8) == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert any(line.startswith("    8-bit: model.layers.0.mlp.down_proj") and "override" in line for line in out)


def test_a_large_table_merges_rows_alike_but_for_their_numbers(tmp_path, capsys, monkeypatch):
    from optq.cli import inspect as inspect_cmd

    folder = _saved(
        tmp_path / "q", optq.QuantConfig(bits=4, group_size=32), overrides={"*.0.mlp.down_proj": {"bits": 8}}
    )
    monkeypatch.setattr(inspect_cmd, "MAX_ROWS", 10)
    out = _inspect(folder, capsys)
    rows = [line.split() for line in out if line.startswith("  model.")]
    assert ["model.layers.*.mlp.down_proj", "1", "256", "128", "8", "32", "yes"] in rows
    assert ["model.layers.*.mlp.down_proj", "1", "256", "128", "4", "32", "yes"] in rows
    assert ["model.layers.*.self_attn.q_proj", "2", "128", "128", "4", "32", "yes"] in rows
    assert len(rows) == 8 and sum(int(r[1]) for r in rows) == 14
    assert len(_table(_inspect(folder, capsys, "--all-layers"))) == 14


def test_the_serve_engines_the_run_checked_are_named(tmp_path, capsys):
    folder = _saved(tmp_path / "q", optq.QuantConfig(bits=4, group_size=32), serve="vllm,optq")
    out = _inspect(folder, capsys)
    assert out[3] == "engines (from optq/formats/engines.py; the run checked --serve vllm, optq):"


def test_moe_layers_saved_under_other_names_get_the_reports_why(tmp_path, capsys):
    # Mixtral's experts are model.layers.N.mlp.experts.E.wK in the model (the report's names) and
    # ...block_sparse_moe.experts.E.wK in the checkpoint; the run's own setting (3-bit) is held by
    # fewer layers than the experts' override, so the checkpoint's base is the override's.
    from tiny_moe import quantize

    model, report, _ = quantize("mixtral", overrides={"*.experts.*": {"bits": 4}})
    assert all(".mlp.experts." in n for n in report.schemes)
    optq.save(model, tmp_path / "q", solutions=report.solutions, report=report)
    out = _inspect(tmp_path / "q", capsys)
    experts = ", ".join(f"model.layers.*.block_sparse_moe.experts.*.w{i} (8)" for i in (1, 2, 3))
    attention = ", ".join(f"model.layers.*.self_attn.{p}_proj (2)" for p in "koqv")
    assert "schemes: base 4-bit, group 16, symmetric; 8 of 32 layers differ" in out
    assert f"    bits=4, as the base: {experts} (why: override '*.experts.*')" in out
    assert f"    3-bit: {attention} (why: the run's own setting; the base is the one most layers hold)" in out
    assert {row[2] for n, row in _table(out).items() if "self_attn" in n} == {3}
