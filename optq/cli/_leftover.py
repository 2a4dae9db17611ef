"""What a failed ``optq quantize`` leaves on disk, said in its error line.

A run that fails after finishing a block keeps ``OUT.partial/`` (the finished blocks and the
activations of the next block's input): once the cause is fixed (a NaN weight of a later block
replaced, space freed), ``--resume`` continues from there, since a resume checks only what the
finished blocks were computed from. The error says that the folder is there, how large it is,
and both ways on: resume, or remove it and start again.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import CliError, _message, _user_error_types


def _size(folder: Path) -> str:
    n = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def raise_with_leftover(exc: BaseException, out: Path) -> None:
    """Raise a CliError of ``exc``'s message followed by what is left in ``OUT.partial/``, when
    the failure left that folder and the message does not already speak of it; else return (the
    caller re-raises ``exc``). A bug (an error that is not the user's) is never rewritten."""
    from optq.pipeline.stream.journal import STATE, partial_path

    folder = partial_path(out)
    if not isinstance(exc, _user_error_types()) or not folder.is_dir() or str(folder) in str(exc):
        return
    try:
        done = int(json.loads((folder / STATE).read_text(encoding="utf-8"))["done"])
        blocks = f"{done} finished block{'s' if done != 1 else ''}, "
    except (OSError, ValueError, KeyError, TypeError):
        blocks = ""
    raise CliError(
        f"{_message(exc).rstrip('.')}. Left on disk: {folder}/ ({blocks}{_size(folder)}); once the cause is fixed, "
        f"rerun with --resume to continue from there, or remove it (rm -r {folder}) or pass --overwrite "
        "to start again"
    ) from exc
