"""What the views say of a round-to-nearest run, which reads no calibration activation and so
measures no layer error (``Report.unmeasured``; the run itself: tests/pipeline/test_weights_only.py):
the end-of-run table, ``optq inspect`` and ``optq report``'s page show the errors as not measured,
never as numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import build, tokens

import optq
from optq.cli import main
from optq.cli.summary import summary

transformers = pytest.importorskip("transformers")
CFG = optq.QuantConfig(bits=3, group_size=16)


@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory) -> tuple[Path, optq.Report]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build("llama")
        report = optq.quantize(model, tokens(), CFG, method="rtn", progress=False)
        folder = tmp_path_factory.mktemp("rtn") / "ckpt"
        optq.save(model, folder, solutions=report.solutions, report=report)
    finally:
        torch.set_num_threads(before)
    return folder, report


def test_the_summary_table_has_no_numbers_for_unmeasured_errors(rtn_checkpoint):
    _, report = rtn_checkpoint
    lines = summary(report).splitlines()
    row = next(line for line in lines if line.startswith("self_attn.q_proj"))
    assert row.split() == ["self_attn.q_proj", "2", "-", "-", "-", "-", "-", "-"]
    assert any(line.startswith("errors not measured (method rtn reads no calibration") for line in lines)
    assert not any("worse than round-to-nearest" in line or "unit-RMS" in line for line in lines)


def test_inspect_says_the_run_read_no_calibration(rtn_checkpoint, capsys):
    folder, _ = rtn_checkpoint
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("quantized layers: 14 by rtn from the weights alone (no calibration forward")


def test_the_page_says_the_errors_were_not_measured(rtn_checkpoint):
    from optq.eval.page import build_page

    folder, report = rtn_checkpoint
    saved = json.loads((folder / "quantization_report.json").read_text())
    assert saved["unmeasured"] == report.unmeasured
    assert all(row["objective"] is None for row in saved["layers"].values())
    page = build_page(folder, evaluations=[], figures=False)
    assert "No layer error was measured: method rtn reads no calibration activation" in page
    assert "No calibration statistic was collected" in page
    assert "errors not measured" in page and "with an objective above RTN" not in page
