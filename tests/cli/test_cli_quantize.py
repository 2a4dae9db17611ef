"""``optq quantize`` on a tiny local model folder: output, report, refusals, interruption."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from cli_args import quantize_args

import optq
from optq.cli import build_parser, main

transformers = pytest.importorskip("transformers")
from tiny import build  # noqa: E402


def _report_file(folder):
    path = folder / "quantization_report.json"  # the name `optq quantize --help` gives
    assert path.exists(), f"no report in {sorted(p.name for p in folder.iterdir())}"
    return path


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_quantize_writes_a_loadable_model_and_report(model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(quantize_args(model_dir, out)) == 0
    printed = capsys.readouterr().out
    assert "self_attn.q_proj" in printed and "mean objective / round-to-nearest" in printed
    report = json.loads(_report_file(out).read_text())
    assert report["config"]["bits"] == 3 and report["options"]["nsamples"] == 4
    assert report["totals"]["layers"] == 14
    assert _leftovers(tmp_path) == []
    # the same job in-process gives the same model as the one written
    from optq.data.tokens import load_tokens
    from optq.data.zoo import load_model

    fp, tok = load_model(model_dir / "model")
    optq.quantize(
        fp,
        load_tokens(model_dir / "calib.txt", tok),
        optq.QuantConfig(bits=3, group_size=16),
        nsamples=4,
        seqlen=16,
        progress=False,
    )
    written, _ = load_model(out, embeddings="model")  # the exact model (bfloat16 embeddings by default)
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(written(input_ids=ids).logits, fp(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(build("llama")(input_ids=ids).logits, fp(input_ids=ids).logits, atol=1e-4)


def test_existing_output_is_refused_unless_overwrite(model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(quantize_args(model_dir, out)) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").exists()
    assert main(quantize_args(model_dir, out, "--overwrite", "--method", "rtn")) == 0
    assert not (out / "keep.txt").exists() and _report_file(out).exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["solver", "writing"])
def test_interrupt_leaves_no_output_and_resumes(model_dir, tmp_path, monkeypatch, where):
    from pipeline.resume_helpers import on_solve

    from optq.pipeline.stream import assemble

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    if where == "solver":  # Ctrl-C in the middle of the block loop, at the first solve (either method's)
        on_solve(monkeypatch, interrupted)
    else:  # Ctrl-C at the checkpoint's last file, just before the folder gets its name
        real = assemble.write_json
        monkeypatch.setattr(
            assemble,
            "write_json",
            lambda path, obj: interrupted() if path.name == "quantization_report.json" else real(path, obj),
        )
    out = tmp_path / "q"
    assert main(quantize_args(model_dir, out)) == 130
    # Nothing that looks like a model; the unfinished run waits in OUT.partial for --resume.
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name != "model") == ["q.partial"]
    monkeypatch.undo()
    assert main(quantize_args(model_dir, out)) == 2  # not without --resume or --overwrite
    assert main(quantize_args(model_dir, out, "--resume")) == 0
    assert _report_file(out).exists() and not (tmp_path / "q.partial").exists()
    assert _leftovers(tmp_path) == []


def test_too_little_calibration_text(model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(quantize_args(model_dir, out, "--nsamples", "400")) == 2
    err = capsys.readouterr().err
    assert "tokens, fewer than nsamples x seqlen = 400 x 16" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--bits", "9"], "--bits: invalid choice: 9 (choose from 2, 3, 4, 8)"),
        (["--bits", "5"], "--bits: invalid choice: 5"),
        (["--seqlen", "0"], "seqlen=0 is out of range"),
        (["--include", "nothing"], "matches none"),
        (["--method", "rtn", "--mse-hessian"], "--mse-hessian weights the --mse search by the Hessian"),
    ],
)
def test_bad_flags(model_dir, tmp_path, capsys, extra, match):
    assert main(quantize_args(model_dir, tmp_path / "q", *extra)) == 2
    assert match in capsys.readouterr().err


def test_unknown_model_lists_the_known_ones(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "q")]) == 2
    assert "smollm2-135m" in capsys.readouterr().err


def test_flags_map_one_to_one_onto_quant_config():
    from optq.cli import CliError
    from optq.cli.quantize import config_from_args

    parser = build_parser()
    options = {o for a in parser._subparsers._group_actions[0].choices["quantize"]._actions for o in a.option_strings}
    for f in dataclasses.fields(optq.QuantConfig):
        assert "--" + f.name.replace("_", "-") in options, f.name
    args = parser.parse_args(
        [
            "quantize",
            "m",
            "-o",
            "o",
            "--bits",
            "3",
            "--group-size",
            "64",
            "--asym",
            "--act-order",
            "--static-groups",
            "--damp",
            "0.05",
            "--damp-max",
            "2",
            "--block-size",
            "32",
            "--mse",
            "--mse-grid",
            "50",
            "--mse-maxshrink",
            "0.5",
            "--mse-norm",
            "2.4",
            "--diag-shrink",
            "0.3",
        ]
    )
    assert config_from_args(args) == optq.QuantConfig(
        bits=3,
        group_size=64,
        sym=False,
        act_order=True,
        static_groups=True,
        damp=0.05,
        damp_max=2.0,
        block_size=32,
        mse=True,
        mse_grid=50,
        mse_maxshrink=0.5,
        mse_norm=2.4,
        diag_shrink=0.3,
    )
    defaults = parser.parse_args(["quantize", "m", "-o", "o"])
    assert config_from_args(defaults) == optq.QuantConfig()
    assert config_from_args(defaults).mse and config_from_args(defaults).mse_hessian  # the weighted search
    searches = {
        ("--mse-hessian",): (True, True),
        ("--no-mse-hessian",): (True, False),
        ("--no-mse",): (False, False),
        ("--method", "rtn"): (True, True),  # rounding reads no H: min/max (grid.without_hessian)
        ("--method", "rtn", "--no-mse-hessian"): (True, False),
    }
    for flags, search in searches.items():
        config = config_from_args(parser.parse_args(["quantize", "m", "-o", "o", *flags]))
        assert (config.mse, config.mse_hessian) == search, flags
    with pytest.raises(CliError, match=r"mse_hessian=True.*only together with mse=True"):
        config_from_args(parser.parse_args(["quantize", "m", "-o", "o", "--no-mse", "--mse-hessian"]))


def test_calibration_from_several_sources(model_dir, tmp_path, capsys):
    # Two texts share --nsamples: the run equals optq.quantize on the windows mixed here.
    other = tmp_path / "other.txt"
    text = (model_dir / "calib.txt").read_text().splitlines()
    other.write_text("\n".join(reversed(text)))
    out = tmp_path / "q"
    args = quantize_args(model_dir, out)
    args[args.index("--calib") + 1] = f"{model_dir / 'calib.txt'},{other}"
    assert main(args) == 0
    report = json.loads(_report_file(out).read_text())
    assert report["options"]["calib"] == f"{model_dir / 'calib.txt'},{other}"
    from optq.data.tokens import load_tokens, mixed_calibration
    from optq.data.zoo import load_model

    fp, tok = load_model(model_dir / "model")
    windows = mixed_calibration([load_tokens(model_dir / "calib.txt", tok), load_tokens(other, tok)], 4, 16, 0)
    ref = optq.quantize(fp, windows, optq.QuantConfig(bits=3, group_size=16), progress=False)
    assert set(report["layers"]) == set(ref.layers)
    for name, row in ref.layers.items():
        assert report["layers"][name]["objective"] == pytest.approx(row.objective, rel=1e-5)
    # an unknown source in the list is refused before any work
    args[args.index("--calib") + 1] = f"{model_dir / 'calib.txt'},no-such-corpus"
    assert main([*args, "--overwrite"]) == 2
    assert "'no-such-corpus' is not a known corpus" in capsys.readouterr().err


def test_quantize_a_mixture_of_experts_folder(model_dir, tmp_path, capsys):
    """A tiny Mixtral saved beside the CLI's tokenizer: experts packed under the checkpoint's
    names, the MoE flags reach the run, notes are grouped by reason, bad sizes are refused."""
    from tiny_moe import build as build_moe

    folder = tmp_path / "mixtral"
    build_moe("mixtral").save_pretrained(folder)
    for f in (model_dir / "model").glob("tokenizer*"):
        (folder / f.name).write_bytes(f.read_bytes())
    root = tmp_path
    (root / "model").symlink_to(folder)
    (root / "calib.txt").write_text((model_dir / "calib.txt").read_text())
    out = tmp_path / "q"
    assert (
        main(
            quantize_args(
                root,
                out,
                *("--method", "gptq", "--moe-calibration", "routed"),
                *("--moe-min-tokens", "1000", "--max-hessian-memory", "4KB"),
            )
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "experts.w1" in printed  # the summary groups experts by matrix, not by number
    # Every expert starved (64 tokens < 1000): one note for all of them, not one per expert.
    notes = [line for line in printed.splitlines() if line.startswith("note:") and "fallback" in line]
    assert len(notes) == 1 and "more" in notes[0]
    report = json.loads(_report_file(out).read_text())
    assert report["options"]["moe_calibration"] == "routed" and report["options"]["max_hessian_memory"] == 4000
    assert all(b["chunks"] > b["stages"] for b in report["moe"].values())  # the 4 KB budget chunked
    from optq.formats.files import read_index

    index = read_index(out)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.qweight" in index
    assert main(quantize_args(root, tmp_path / "bad", "--max-hessian-memory", "lots")) == 2
    assert "--max-hessian-memory" in capsys.readouterr().err


def test_dry_run_plans_with_the_run_s_own_settings(model_dir, tmp_path, capsys):
    """``--dry-run`` gets the same settings object as a run: float64 Hessians double the predicted
    Hessian memory (the plan used to be built without --hessian-dtype), and nothing is written."""

    def hessian_bytes(*extra: str) -> float:
        assert main(quantize_args(model_dir, tmp_path / "q", "--dry-run", *extra)) == 0
        text = capsys.readouterr().out
        rows = [line.split() for line in text.splitlines() if line.strip().startswith("hessians ")]
        assert len(rows) == 1, text
        value, unit = rows[0][1:3]
        return float(value) * {"GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1}[unit]

    single, double = hessian_bytes(), hessian_bytes("--hessian-dtype", "float64")
    assert single > 0 and double == pytest.approx(2 * single, rel=1e-3)
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()
