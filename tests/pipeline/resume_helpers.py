"""What the resume tests (test_resume.py, test_resume_guards.py) share: the run's sizes, the
stand-in for a kill, the crash after block 1's write or after a commit, a look at the journal and
the solves, and the ways a journal or source file gets damaged.

The source and its uninterrupted output are conftest.py's ``reference`` fixture."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from optq.core import gptaq, solver
from optq.pipeline.stream.journal import Journal

LAYERS = 3
OUT_SHARD = 8_000  # several output shards
LINEARS = 7  # per llama block
SOLVES = 4  # solves per llama block: one per group of linears sharing an input (qkv, o, gate+up, down)


class Kill(BaseException):
    """Stands for a kill: not an Exception, so no `except Exception` in the library catches it."""


def journal_state(out: Path) -> dict:
    """The state.json of ``out``'s journal (``OUT.partial/``)."""
    return json.loads((out.parent / f"{out.name}.partial" / "state.json").read_text())


def on_solve(monkeypatch, hook: Callable[[int], None] | None = None) -> list[int]:
    """Count the solves from now on (in the returned list's one item), GPTQ's or GPTAQ's (the
    default method's), calling ``hook(n)`` before the n-th (from 1): it may raise, to crash there."""
    calls = [0]

    def wrapped(orig):
        def solve(*a, **k):
            calls[0] += 1
            if hook is not None:
                hook(calls[0])
            return orig(*a, **k)

        return solve

    monkeypatch.setattr(solver, "gptq", wrapped(solver.gptq))
    monkeypatch.setattr(gptaq, "gptaq_with_floor", wrapped(gptaq.gptaq_with_floor))
    return calls


def count_solves(monkeypatch) -> list[int]:
    """Count the solves from now on (in the returned list's one item)."""
    return on_solve(monkeypatch)


def after_write_block(mp, block: int) -> None:
    """Kill once ``block``'s packed file is written, before its commit (``mp``: a monkeypatch)."""
    orig = Journal.write_block

    def write_block(self, i, tensors):
        orig(self, i, tensors)
        if i == block:
            raise Kill

    mp.setattr(Journal, "write_block", write_block)


def after_write_block_1(mp, partial):
    """A crash point (see test_resume.CRASHES): Kill once block 1's file is written, before the
    commit; returns the blocks the journal then says are done."""
    after_write_block(mp, 1)
    return 1


def after_commit(mp, blocks: int) -> None:
    """Kill once ``blocks`` blocks are committed (state.json says so), before the next one."""
    orig = Journal.commit

    def commit(self, done, *a, **k):
        orig(self, done, *a, **k)
        if done == blocks:
            raise Kill

    mp.setattr(Journal, "commit", commit)


def scribble(path: Path, n: int = 1000, seed: int = 0) -> None:
    """Write ``n`` random bytes inside the tensor data of a safetensors file (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # the first byte after the header
    assert len(data) - start > n, f"{path} holds only {len(data) - start} data bytes"
    at = start + (len(data) - start - n) // 2
    data[at : at + n] = random.Random(seed).randbytes(n)
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    """Cut a file to half its size (a copy or a write that stopped short)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def one_line(err, *names: str) -> str:
    """The refusal's text, checked: one line, a ValueError, naming ``names`` and --overwrite."""
    text = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in text, text
    assert all(n in text for n in names) and "--overwrite" in text, text
    return text
