"""``optq eval`` and ``optq compare``: KL against the float model and top-token agreement in the
table and in --json (kl, kl_p99, top1), the float model found from the checkpoint's report."""

from __future__ import annotations

import json

import pytest
from cli_args import quantize_args

from optq.cli import main


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kl") / "q"
    assert main(quantize_args(model_dir, out)) == 0
    return out


def _eval(model, data, out, *extra):
    args = ["eval", str(model), "--data", str(data), "--seqlen", "16", "--windows", "3", "--no-progress"]
    return main([*args, "--json", str(out), *extra])


def test_eval_finds_the_float_model_in_the_report_and_writes_kl(model_dir, checkpoint, tmp_path, capsys):
    from optq.data.tokens import eval_windows, load_tokens
    from optq.data.zoo import load_model
    from optq.eval.divergence import divergence_detail

    calib = model_dir / "calib.txt"
    assert _eval(checkpoint, calib, tmp_path / "e.json") == 0
    out = capsys.readouterr().out
    assert "KL p99" in out and "top1" in out
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["reference"] == str(model_dir / "model")
    (row,) = data["results"]
    assert row["kl"] > 0 and row["kl_p99"] >= row["kl"] and 0 < row["top1"] <= 1
    # the same numbers as the library's on the same windows of the same text
    q, tok = load_model(checkpoint)
    fp, _ = load_model(model_dir / "model")
    d = divergence_detail(fp, q, eval_windows(load_tokens(str(calib), tok, "eval"), 16, 3))
    assert (row["kl"], row["kl_p99"], row["top1"]) == pytest.approx((d.kl, d.kl_p99, d.top1))
    assert d.tokens == row["tokens"]  # perplexity's predicted tokens, the same windows
    # --reference none: perplexity only, the fields null
    assert _eval(checkpoint, calib, tmp_path / "n.json", "--reference", "none") == 0
    (row,) = json.loads((tmp_path / "n.json").read_text())["results"]
    assert (row["kl"], row["kl_p99"], row["top1"]) == (None, None, None)
    assert "KL" not in capsys.readouterr().out.splitlines()[1]


def test_eval_without_a_float_model_says_so_and_a_bad_reference_is_an_error(model_dir, checkpoint, tmp_path, capsys):
    calib = model_dir / "calib.txt"
    assert _eval(model_dir / "model", calib, tmp_path / "f.json") == 0  # a float model: nothing to compare
    assert "no KL against a float model" in capsys.readouterr().out
    assert json.loads((tmp_path / "f.json").read_text())["results"][0]["top1"] is None
    # a report naming a model that is not here: skipped, said, not a crash
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in checkpoint.iterdir():
        (moved / f.name).symlink_to(f)
    (moved / "quantization_report.json").unlink()
    report = json.loads((checkpoint / "quantization_report.json").read_text())
    report["options"]["model"] = str(tmp_path / "gone")
    (moved / "quantization_report.json").write_text(json.dumps(report))
    assert _eval(moved, calib, tmp_path / "m.json") == 0
    assert "cannot be loaded here" in capsys.readouterr().out
    assert json.loads((tmp_path / "m.json").read_text())["reference"] is None
    # given explicitly: an error in one line
    assert _eval(checkpoint, calib, tmp_path / "x.json", "--reference", str(tmp_path / "gone")) == 2
    assert "--reference" in capsys.readouterr().err


def test_compare_json_and_table_carry_kl_per_variant(model_dir, tmp_path, capsys):
    out = tmp_path / "c.json"
    calib = str(model_dir / "calib.txt")
    argv = ["compare", str(model_dir / "model"), "--variants", "fp,rtn", "--calib", calib, "--data", calib]
    argv += ["--nsamples", "2", "--seqlen", "16", "--windows", "2", "--bits", "2", "--group-size", "16"]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "KL p99" in text and "100.0%" in text  # fp's own row: top-1 agreement 1
    rows = {r["name"]: r for r in json.loads(out.read_text())["variants"]}
    assert rows["fp"]["kl"] == {calib: 0.0} and rows["fp"]["top1"] == {calib: 1.0}
    assert rows["rtn"]["kl"][calib] > 0 and 0 < rows["rtn"]["top1"][calib] <= 1
    assert rows["rtn"]["kl_p99"][calib] >= rows["rtn"]["kl"][calib]
    assert main([*argv, "--json", str(out), "--no-progress", "--no-kl"]) == 0
    assert "KL" not in capsys.readouterr().out
    assert json.loads(out.read_text())["variants"][1]["kl"] is None
