"""``torchrun --nproc-per-node 2 -m optq quantize``: the same command line as one process, run
by two (gloo on CPU), writes what one process writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cli_args import quantize_args

pytest.importorskip("transformers")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_torchrun_launches_the_cli_and_writes_what_one_process_writes(model_dir, tmp_path):
    """``torchrun --nproc-per-node 2 -m optq quantize``: the same arguments as one process, one
    output written by rank 0, the same tensors (float64 Hessians), the world recorded."""
    import subprocess
    import sys

    args = quantize_args(model_dir, None, "--hessian-dtype", "float64", "--batch-size", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPTQ_DIST_TIMEOUT": "120"}
    one = subprocess.run(
        [sys.executable, "-m", "optq", *args, "-o", str(tmp_path / "one")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = Path(sys.executable).with_name("torchrun")
    two = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-port",
            "29581",
            "-m",
            "optq",
            *args,
            "-o",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 speaks for the run
    a, b = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((tmp_path / "two" / "quantization_report.json").read_text())
    assert report["distributed"]["world_size"] == 2
    assert json.loads((tmp_path / "one" / "quantization_report.json").read_text())["distributed"] is None
    assert not list(tmp_path.glob("*.partial"))


def test_a_rank_that_stopped_answering_is_one_error_line_and_status_2(model_dir, monkeypatch, capsys):
    """A DistributedError (here: a peer that stopped answering) is the run's failure, not a bug
    in optq: ``optq: error: <one line>``, exit status 2, no traceback."""
    import optq.pipeline.stream.quantize as stream
    from optq.cli import main
    from optq.pipeline.distributed.ranks import DistributedError

    def stopped(*args, **kwargs):
        raise DistributedError("rank 1 of 2 stopped answering: no heartbeat for 61 s\n(OPTQ_DIST_PEER_TIMEOUT=60 s)")

    monkeypatch.setattr(stream, "quantize_pretrained", stopped)
    status = main(quantize_args(model_dir, model_dir / "never"))
    err = capsys.readouterr().err
    assert status == 2
    assert err == "optq: error: rank 1 of 2 stopped answering: no heartbeat for 61 s (OPTQ_DIST_PEER_TIMEOUT=60 s)\n"
