"""``optq quantize --resume`` against the journal's settings (issue 35, items 1 and 2; issue 32,
item 3): an edited manifest is refused naming it, other settings are refused before the
calibration text is tokenised (a stand-in fails if reached), and another ``--max-hessian-memory``
resumes to the bytes of an uninterrupted run."""

from __future__ import annotations

import json

from cli_args import quantize_args

from optq.cli import main
from optq.cli import quantize as cli_quantize
from optq.pipeline.stream.journal import Journal

FOUR = ("--bits", "4")  # the default's bits (quantize_args asks for 3)


def _killed_after_block_1(model_dir, out, monkeypatch) -> None:
    real = Journal.commit

    def commit(self, done, *a, **k):
        real(self, done, *a, **k)
        if done == 1:
            raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(Journal, "commit", commit)
        assert main(quantize_args(model_dir, out, *FOUR)) == 130


def _no_tokenising(mp) -> None:
    def reached(*a, **k):
        raise AssertionError("the calibration text was tokenised before the settings were compared")

    mp.setattr(cli_quantize, "_calibration_tokens", reached)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("optq")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_resume_refusals_come_before_tokenising_and_name_the_file(model_dir, tmp_path, capsys, monkeypatch):
    out, partial = tmp_path / "q", tmp_path / "q.partial"
    _killed_after_block_1(model_dir, out, monkeypatch)
    capsys.readouterr()
    with monkeypatch.context() as mp:
        _no_tokenising(mp)
        assert main(quantize_args(model_dir, out, "--bits", "3", "--resume")) == 2
        line = _error_line(capsys)
        assert line.startswith(f"optq: error: cannot resume {partial}: the config (bits 4 then, 3 now)"), line
        # The manifest edited to say 3 bits, then resumed with 3 bits: refused, never used.
        path = partial / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["config"]["bits"] = 3
        path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        assert main(quantize_args(model_dir, out, "--bits", "3", "--resume")) == 2
        line = _error_line(capsys)
        assert str(path) in line and "checksum does not match" in line and "--overwrite" in line, line
    assert not out.exists()


def test_another_memory_budget_resumes_to_the_same_bytes(model_dir, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    assert main(quantize_args(model_dir, ref, *FOUR, "--max-hessian-memory", "2GB")) == 0
    out = tmp_path / "q"
    _killed_after_block_1(model_dir, out, monkeypatch)  # at the default budget, a quarter of the RAM
    assert main(quantize_args(model_dir, out, *FOUR, "--max-hessian-memory", "64MB", "--resume")) == 0
    files = sorted(p.name for p in ref.iterdir() if p.name != "quantization_report.json")
    assert files == sorted(p.name for p in out.iterdir() if p.name != "quantization_report.json")
    assert any(name.endswith(".safetensors") for name in files)
    for name in files:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
