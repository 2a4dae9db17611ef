"""``optq quantize`` owns its process: on the CPU it fixes glibc's mmap threshold once, before
the calibration's forwards (the library's calls never do: tests/pipeline/test_process_state.py)."""

from __future__ import annotations

import pytest
from cli_args import quantize_args

from optq.cli import main
from optq.core import memory

pytest.importorskip("transformers")
from fake_libc import FakeLibc  # noqa: E402


def test_the_cli_fixes_the_mmap_threshold_before_the_run(model_dir, tmp_path, monkeypatch, capsys):
    libc = FakeLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    assert main(quantize_args(model_dir, tmp_path / "q", "--method", "gptq")) == 0
    capsys.readouterr()
    settings = [c for c in libc.calls if c[0] == "mallopt"]
    assert settings == [("mallopt", -3, memory.MMAP_THRESHOLD)]  # once, M_MMAP_THRESHOLD at 4 MiB
    first = libc.calls.index(settings[0])
    # before the block loop's first trim (the threshold holds for the whole run)
    assert ("malloc_trim", 0) in libc.calls[first + 1 :]


def test_a_dry_run_changes_no_malloc_setting(model_dir, tmp_path, monkeypatch, capsys):
    libc = FakeLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    assert main(quantize_args(model_dir, tmp_path / "q", "--dry-run")) == 0
    capsys.readouterr()
    assert [c for c in libc.calls if c[0] == "mallopt"] == []
