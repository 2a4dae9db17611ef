"""A library call leaves the process as it found it: torch's thread count and glibc's malloc
settings are the same after ``optq.quantize`` / ``quantize_pretrained`` returns or raises.

glibc is replaced by a recorder (``optq.core.memory._libc``), so the tests see every call optq
makes to it; the thread count is checked around a run on two threads, which the solver's column
loop lowers to one while it runs (recorded from inside the loop, so the check is not vacuous).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optq.core import grid, memory

pytest.importorskip("transformers")
from fake_libc import FakeLibc  # noqa: E402
from tiny import CFG, build  # noqa: E402
from tiny import run as _run  # noqa: E402


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(memory, "_libc", lambda: fake)
    return fake


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _threads_in_the_column_loop(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Record torch's thread count at every dequantization (the solver's per column, among
    others); raise at the ``fail_at``-th."""
    seen: list[int] = []
    real = grid.dequantize

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        if fail_at is not None and len(seen) == fail_at:
            raise RuntimeError("planted failure in the column loop")
        return real(*args, **kwargs)

    monkeypatch.setattr(grid, "dequantize", recording)
    return seen


def test_quantize_leaves_the_thread_count_and_malloc_settings(monkeypatch, libc, two_threads):
    seen = _threads_in_the_column_loop(monkeypatch)
    _run(build("llama"), method="gptq")
    assert 1 in seen  # the column loop did run on one thread ...
    assert torch.get_num_threads() == 2  # ... and the caller has its two back
    assert ("malloc_trim", 0) in libc.calls  # the releaser reached glibc ...
    assert [c for c in libc.calls if c[0] != "malloc_trim"] == []  # ... and changed no setting


def test_quantize_that_raises_leaves_the_thread_count_and_malloc_settings(monkeypatch, libc, two_threads):
    seen = _threads_in_the_column_loop(monkeypatch, fail_at=40)  # inside the first block's solves
    minmax = dataclasses.replace(CFG, mse=False, mse_hessian=False)  # the range search dequantizes too
    with pytest.raises(RuntimeError, match="planted failure"):
        _run(build("llama"), method="gptq", config=minmax)
    assert len(seen) == 40 and seen[-1] == 1  # raised inside the single-threaded loop
    assert torch.get_num_threads() == 2
    assert ("malloc_trim", 0) in libc.calls
    assert [c for c in libc.calls if c[0] != "malloc_trim"] == []


def test_streamed_quantize_changes_no_malloc_setting(monkeypatch, libc, two_threads, tmp_path, kit_any_threads):
    kit = kit_any_threads
    seen = _threads_in_the_column_loop(monkeypatch)
    kit.stream(kit.save_tiny(tmp_path / "src", "llama", layers=2), tmp_path / "out")
    assert 1 in seen and torch.get_num_threads() == 2
    assert ("malloc_trim", 0) in libc.calls
    assert [c for c in libc.calls if c[0] != "malloc_trim"] == []


def test_fix_mmap_threshold_sets_glibc_s_threshold_once(libc):
    assert memory.fix_mmap_threshold()
    assert libc.calls == [("mallopt", -3, memory.MMAP_THRESHOLD)]  # M_MMAP_THRESHOLD is -3 in malloc.h
    assert memory.MMAP_THRESHOLD == 4 << 20


def test_without_glibc_nothing_is_trimmed_or_set(monkeypatch):
    monkeypatch.setattr(memory, "_libc", lambda: None)
    assert not memory.fix_mmap_threshold()
    assert memory.releaser("cpu")() is None
    memory.release_host_memory()
