"""The journal checked completely when ``--resume`` opens it, before any work.

Every file the state relies on is compared with the sha256 recorded when it was written: each
finished block's packed tensors (rank 0, which owns them) and the activations entering the next
block (each rank its own file). ``state.json`` itself carries a checksum, verified as it is read
(``Journal._open_existing``).

What a damaged or missing file means for the run:

- block 0: its inputs are the calibration's own (the capture recomputes them from the source),
  so the run starts again from block 0, with a warning; nothing intact comes before it.
- block k > 0: only the activations entering the next unfinished block are kept, so the inputs
  of block k are gone and block k cannot be recomputed without redoing blocks 0..k-1; the run
  stops and says so: restore the file, or start again with ``--overwrite``.
- the activations: the same, for every finished block.

Each case is one line (a JournalError, which the CLI prints as ``optq: error: ...``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optq.pipeline.stream.records import BLOCKS, JournalError, file_sha256

__all__ = ["check_files"]


def _damage(path: Path, want: str | None) -> str | None:
    """Why ``path`` cannot be used (None when it is intact)."""
    if not path.is_file():
        return "missing"
    if want is None:
        return "not recorded in the journal's state"
    if file_sha256(path) != want:
        return "damaged (truncated or overwritten: its sha256 differs from the one recorded when it was written)"
    return None


def check_files(journal: Any) -> None:
    """Check every file ``journal``'s state relies on (a ``journal.Journal``, which imports this
    module); reset the journal to block 0 when block 0 is damaged, raise a one-line JournalError
    saying what to do for any other damage."""
    folder, done = journal.folder, journal.done
    start_again = f"rerun with --overwrite (or delete {folder}) to start again"
    if journal.dist.rank == 0:
        sums = journal.state.get("blocks") or {}
        for i in range(done):
            path = journal.block_file(i)
            why = _damage(path, sums.get(path.name))
            if why is None:
                continue
            name = f"{BLOCKS}/{path.name}"
            if i == 0:
                journal.restart(f"{name} is {why}")
                return
            raise JournalError(
                f"cannot resume {folder}: {name} is {why}, and the inputs of block {i} are no longer "
                f"kept, so it cannot be recomputed; restore that file, or {start_again}"
            )
    name = journal.state.get("activations")
    if not name or not done:
        return
    name = journal.activations_name(done)  # the state names rank 0's file; each rank checks its own
    sums = journal.state.get("activations_sha256") or []
    why = _damage(folder / name, sums[journal.dist.rank] if journal.dist.rank < len(sums) else None)
    if why is not None:
        raise JournalError(
            f"cannot resume {folder}: {name} (the inputs of block {done}) is {why}, and it cannot be "
            f"rebuilt without recomputing blocks 0-{done - 1}; {start_again}"
        )
