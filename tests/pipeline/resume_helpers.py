"""What the resume tests (test_resume.py, test_resume_guards.py) share: the run's sizes, the
stand-in for a kill, the crash after block 1's write, and a look at the journal and the solves.

The source and its uninterrupted output are conftest.py's ``reference`` fixture."""

from __future__ import annotations

import json
from pathlib import Path

from optq.core import solver
from optq.pipeline.stream.journal import Journal

LAYERS = 3
OUT_SHARD = 8_000  # several output shards
LINEARS = 7  # per llama block
SOLVES = 4  # gptq calls per llama block: one per group of linears sharing an input (qkv, o, gate+up, down)


class Kill(BaseException):
    """Stands for a kill: not an Exception, so no `except Exception` in the library catches it."""


def journal_state(out: Path) -> dict:
    """The state.json of ``out``'s journal (``OUT.partial/``)."""
    return json.loads((out.parent / f"{out.name}.partial" / "state.json").read_text())


def count_solves(monkeypatch) -> list[int]:
    """Count the gptq calls from now on (in the returned list's one item)."""
    calls = [0]
    orig = solver.gptq

    def gptq(*a, **k):
        calls[0] += 1
        return orig(*a, **k)

    monkeypatch.setattr(solver, "gptq", gptq)
    return calls


def after_write_block_1(mp, partial):
    """A crash point (see test_resume.CRASHES): Kill once block 1's file is written, before the
    commit; returns the blocks the journal then says are done."""
    orig = Journal.write_block

    def write_block(self, i, tensors):
        orig(self, i, tensors)
        if i == 1:
            raise Kill

    mp.setattr(Journal, "write_block", write_block)
    return 1
