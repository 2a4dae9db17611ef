"""Fixtures the checkpoint tests share."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gptqmodel_site() -> Path | None:
    """None when GPTQModel is importable here, else a folder holding it (fetched once, cached)."""
    if importlib.util.find_spec("gptqmodel") and importlib.util.find_spec("optimum"):
        return None
    from formats.gptqmodel_env import Unavailable, gptqmodel_path

    from optq.data.corpora import cache_dir

    try:
        return gptqmodel_path(cache_dir() / "test-packages")
    except (Unavailable, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"GPTQModel 7.7 could not be fetched or built here: {exc}")


@pytest.fixture(scope="session")
def smol_checkpoint(tmp_path_factory) -> Path:
    """`optq quantize smollm2-135m` with the default engine settings, small calibration (the
    real-model serving and kernel tests share it)."""
    from formats.real_models import CALIB, need, quantize

    need("smollm2-135m")
    out = tmp_path_factory.mktemp("serving") / "smollm2-4bit"
    print(f"\nquantize smollm2-135m: {quantize('smollm2-135m', out, *CALIB):.1f} s")
    return out
