"""The real models' checkpoints the `real` tests share: skip unless fetched, quantize through the CLI."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from optq.cli import main

CALIB = ["--nsamples", "8", "--seqlen", "64", "--no-progress"]
"""Calibration cut to 8 x 64 tokens: these tests are about layouts and kernels, not quality."""


def need(model: str) -> None:
    """Skip unless ``model`` and the enwiki corpus are available offline."""
    from optq.data.corpora import _cache_file
    from optq.data.zoo import model_available

    if not model_available(model):
        pytest.skip(f"{model} not available offline (optq fetch {model})")
    if not _cache_file("enwiki").exists():
        pytest.skip("enwiki corpus not cached (optq fetch enwiki)")


def quantize(model: str, out: Path, *flags: str) -> float:
    """``optq quantize model -o out flags...``; the seconds it took."""
    start = time.perf_counter()
    assert main(["quantize", model, "-o", str(out), *flags]) == 0
    return time.perf_counter() - start
