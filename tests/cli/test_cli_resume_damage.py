"""A damaged journal on ``optq quantize --resume`` (issue 21, item 3): one ``optq: error:`` line
that names the file and says to use --overwrite, exit status 2, and --overwrite then works."""

from __future__ import annotations

from cli_args import quantize_args

from optq.cli import main
from optq.pipeline.stream.journal import Journal


def test_a_deleted_block_file_is_one_line_naming_it(model_dir, tmp_path, capsys, monkeypatch):
    real = Journal.commit

    def commit(self, done, *a, **k):
        real(self, done, *a, **k)
        if done == 2:  # both blocks of the tiny model finished, the checkpoint not assembled
            raise KeyboardInterrupt

    monkeypatch.setattr(Journal, "commit", commit)
    out = tmp_path / "q"
    assert main(quantize_args(model_dir, out)) == 130
    monkeypatch.undo()
    partial = tmp_path / "q.partial"
    (partial / "blocks" / "00001.safetensors").unlink()
    capsys.readouterr()
    assert main(quantize_args(model_dir, out, "--resume")) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("optq")]  # not the log's lines
    assert (
        "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"optq: error: cannot resume {partial}: ")
    ), lines
    assert "blocks/00001.safetensors is missing" in lines[0] and "--overwrite" in lines[0], lines
    assert main(quantize_args(model_dir, out, "--overwrite")) == 0
    assert out.is_dir() and not partial.exists()
