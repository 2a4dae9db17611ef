"""Messages that name their file and what is left on disk, and one exit status (2) for every
command's error: an empty or whitespace-only text file, bytes that are not UTF-8, a journal a
failed run leaves behind, and an output path that cannot be written, for each command."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from cli_args import quantize_args

from optq.cli import main

pytest.importorskip("transformers")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("optq")]
    assert len(lines) == 1 and lines[0].startswith("optq: error: "), err
    return lines[0]


def _eval(model: Path, data: Path, *extra: str) -> list[str]:
    return ["eval", str(model), "--data", str(data), "--seqlen", "16", "--windows", "1", "--no-progress", *extra]


@pytest.fixture
def calib_only(model_dir, tmp_path):
    """``model_dir`` with its model and another calibration file, which the test writes."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "model").symlink_to(model_dir / "model")
    return root


# --- text files: empty, whitespace only, not UTF-8 ------------------------------------------


def test_an_empty_calibration_file_is_named_as_empty_before_any_work(calib_only, tmp_path, capsys, monkeypatch):
    from optq.cli import quantize

    def no_work(*a, **k):
        raise AssertionError("the model was read before the empty file was refused")

    monkeypatch.setattr(quantize, "_model_folder", no_work)
    (calib_only / "calib.txt").write_text("")
    assert main(quantize_args(calib_only, tmp_path / "q")) == 2
    line = _one_line(capsys)
    assert f"{calib_only / 'calib.txt'} is empty" in line, line
    assert "evaluate" not in line, line  # quantize evaluates nothing
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_a_whitespace_calibration_file_says_there_is_nothing_to_calibrate_on(calib_only, tmp_path, capsys):
    (calib_only / "calib.txt").write_text(" \n\n  \n")
    assert main(quantize_args(calib_only, tmp_path / "q")) == 2
    line = _one_line(capsys)
    assert f"{calib_only / 'calib.txt'} holds only whitespace" in line and "calibrate on" in line, line
    assert "evaluate" not in line, line


@pytest.mark.parametrize(("text", "what"), [("", "is empty"), ("\n \n", "holds only whitespace")])
def test_an_empty_evaluation_file_is_named(model_dir, tmp_path, capsys, text, what):
    data = tmp_path / "e.txt"
    data.write_text(text)
    assert main(_eval(model_dir / "model", data)) == 2
    line = _one_line(capsys)
    assert f"{data} {what}" in line, line


def test_the_calibration_part_of_a_short_file_needs_no_evaluation_part():
    from optq.data.tokens import load_text

    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / "one.txt"
        one.write_text("w")
        assert load_text(one, "calib") == "w"  # nothing is evaluated: nothing needs to be left over
        with pytest.raises(ValueError, match="nothing is left to evaluate on"):
            load_text(one, "eval")


@pytest.mark.parametrize("offset", [11, 20_000])  # in the text stream's first chunk, and far past it
def test_bytes_that_are_not_utf8_name_the_file_and_the_offset(tmp_path, offset):
    from optq.data.corpora import CorpusError
    from optq.data.tokens import load_text

    head = (b"w1 w2 w3 ca" + b"w4 " * offset)[:offset]
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(head + b"\xe9 w5 w6\n")
    for part in ("calib", "eval", "all"):
        with pytest.raises(CorpusError) as info:
            load_text(bad, part)
        assert str(info.value).startswith(f"{bad} is not UTF-8 text: byte 0xe9 at offset {offset:,} "), info.value
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b'{"text": "' + head + b'"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=f"^{jsonl} is not UTF-8 text: byte 0xe9 at offset {offset + 26:,} "):
        load_text(jsonl, "all")


def test_a_jsonl_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    from optq.data.corpora import CorpusError
    from optq.data.tokens import load_text

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "w1 w2"}\n\n{"text": w3}\n')
    with pytest.raises(CorpusError, match=f"^{jsonl}:3 is not JSON "):
        load_text(jsonl, "all")


def test_eval_and_quantize_name_a_file_that_is_not_utf8(model_dir, calib_only, tmp_path, capsys):
    bad = calib_only / "calib.txt"
    bad.write_bytes((model_dir / "calib.txt").read_bytes()[:100] + b"\xe9\xe9" + b" w1" * 50)
    assert main(_eval(model_dir / "model", bad)) == 2
    line = _one_line(capsys)
    assert f"{bad} is not UTF-8 text: byte 0xe9 at offset 100 " in line, line
    assert main(quantize_args(calib_only, tmp_path / "q")) == 2  # tokenised in a child process
    line = _one_line(capsys)
    assert f"{bad} is not UTF-8 text: byte 0xe9 at offset 100 " in line, line


# --- what a failed run leaves on disk --------------------------------------------------------


def _poisoned(model_dir: Path, tmp_path: Path, block: int, tensor: str = "post_attention_layernorm.weight") -> Path:
    """``model_dir`` with one NaN in block ``block``'s ``tensor`` (by default its second norm:
    its MLP input goes NaN)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path / f"bad{block}"
    shutil.copytree(model_dir / "model", root / "model")
    shutil.copy(model_dir / "calib.txt", root / "calib.txt")
    tensors = load_file(str(root / "model" / "model.safetensors"))
    tensors[f"model.layers.{block}.{tensor}"].view(-1)[0] = float("nan")
    save_file(tensors, str(root / "model" / "model.safetensors"), metadata={"format": "pt"})
    return root


def test_nan_in_block_1_says_what_is_left_on_disk_and_the_resume_it_offers_works(model_dir, tmp_path, capsys):
    from pipeline.spawned import folder_tensors

    root = _poisoned(model_dir, tmp_path, 1)
    out = tmp_path / "q"
    partial = Path(f"{out}.partial")
    assert main(quantize_args(root, out)) == 2
    line = _one_line(capsys)
    assert "NaN/Inf" in line and "model.layers.1" in line, line
    assert f"Left on disk: {partial}/ (1 finished block, " in line, line
    assert "--resume" in line and f"rm -r {partial}" in line and "--overwrite" in line, line
    assert (partial / "state.json").is_file() and not out.exists()
    # What it offers holds: with the model fixed, --resume finishes to the bytes of a fresh run.
    shutil.copy(model_dir / "model" / "model.safetensors", root / "model" / "model.safetensors")
    assert main(quantize_args(root, out, "--resume")) == 0
    assert not partial.exists()
    assert main(quantize_args(model_dir, tmp_path / "fresh")) == 0
    got, want = folder_tensors(out), folder_tensors(tmp_path / "fresh")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_nan_weight_in_block_1_names_its_file_and_what_is_left(model_dir, tmp_path, capsys):
    root = _poisoned(model_dir, tmp_path, 1, "mlp.up_proj.weight")
    out = tmp_path / "q"
    assert main(quantize_args(root, out)) == 2
    line = _one_line(capsys)
    shard = root / "model" / "model.safetensors"
    assert f"optq: error: {shard}: model.layers.1.mlp.up_proj.weight has NaN/Inf values" in line, line
    assert f"Left on disk: {out}.partial/ (1 finished block, " in line, line


def test_nan_in_block_0_leaves_nothing_and_says_nothing_of_it(model_dir, tmp_path, capsys):
    root = _poisoned(model_dir, tmp_path, 0)
    out = tmp_path / "q"
    assert main(quantize_args(root, out)) == 2
    line = _one_line(capsys)
    assert "NaN/Inf" in line and "Left on disk" not in line, line
    assert not Path(f"{out}.partial").exists() and not out.exists()


# --- every command: an output path that cannot be written exits 2, naming it -----------------


@pytest.fixture
def unwritable(tmp_path):
    """A folder in which nothing can be created: a read-only folder, or (for root, whom modes do
    not stop) /sys."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    folder = Path("/sys")
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError:
        yield folder
    else:  # pragma: no cover - a system where root can write /sys
        pytest.skip("no folder that root cannot write in")


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "q"
    assert main(quantize_args(model_dir, out)) == 0
    return out


def _no_work(monkeypatch, module, name):
    def work(*a, **k):
        raise AssertionError(f"{name} ran before the output path was checked")

    monkeypatch.setattr(module, name, work)


def test_every_command_exits_2_naming_an_output_path_it_cannot_write(
    model_dir, checkpoint, unwritable, tmp_path, capsys, monkeypatch
):
    from optq.data import zoo

    target = unwritable / "sub" / "x"
    calib = str(model_dir / "calib.txt")
    runs = {
        "quantize": quantize_args(model_dir, target),
        "eval": [*_eval(model_dir / "model", model_dir / "calib.txt"), "--json", f"{target}.json"],
        "report": ["report", str(checkpoint), "-o", f"{target}.html", "--no-figures"],
        "compare": ["compare", str(model_dir / "model"), "--calib", calib, "--json", f"{target}.json"],
        "demo": ["demo", "-o", str(target)],
    }
    for command, argv in runs.items():
        with monkeypatch.context() as m:
            if command == "compare":
                _no_work(m, zoo, "load_model")  # minutes of quantizing before the JSON is written
            if command == "demo":
                _no_work(m, zoo, "model_available")  # a download and minutes of work
            assert main(argv) == 2, command
        line = _one_line(capsys)
        assert str(target) in line and str(unwritable) in line, (command, line)
    assert not (checkpoint / "report.html").exists()
    # fetch writes into the cache
    monkeypatch.setenv("OPTQ_CACHE", str(target))
    assert main(["fetch", "news"]) == 2
    line = _one_line(capsys)
    assert f"optq: error: news: {unwritable}" in line and "[Errno" not in line, line


def test_an_output_file_that_is_a_folder_is_refused_by_name(model_dir, checkpoint, tmp_path, capsys):
    folder = tmp_path / "taken"
    folder.mkdir()
    assert main(["report", str(checkpoint), "-o", str(folder), "--no-figures"]) == 2
    line = _one_line(capsys)
    assert f"-o {folder}: is a folder, not a file" in line, line
