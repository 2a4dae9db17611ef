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
