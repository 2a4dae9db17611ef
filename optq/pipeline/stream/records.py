"""The resume journal's files as records, and the check of a resume's settings before any work.

Below both the journal (``optq.pipeline.stream.journal``) and its file check
(``optq.pipeline.stream.verify``), which import from here and not from each other.

``manifest.json`` and ``state.json`` are each sealed by a ``checksum`` field, the sha256 of the
rest of the file: a damaged file, or one edited by hand, is refused rather than trusted.

The manifest records only what changes the bytes a run writes. Memory budgets
(``max_hessian_memory``), the device and where activations live decide how the work is
scheduled, never which weights come out, so a resume may change them: on another machine, or
with another ``--max-hessian-memory`` (:data:`SCHEDULING`; the thread count too, as before:
the same bytes are promised at the same thread count, which is the user's to keep). Its ``config`` and
``settings`` parts depend on the arguments alone, so :func:`check_resume` compares them with a
journal's before the model is loaded, the calibration tokenised or anything hashed: a resume
with other settings is refused in well under a second.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "JournalError",
    "partial_path",
    "file_sha256",
    "sealed",
    "unsealed",
    "read_manifest",
    "output_settings",
    "check_resume",
    "refusal",
    "SCHEDULING",
]

MANIFEST = "manifest.json"
STATE = "state.json"
BLOCKS = "blocks"
CHECKSUM = "checksum"  # the field of manifest.json and state.json: sha256 of the rest, as _json writes it
# Run options that change only how the work is scheduled, not the bytes written: left out of the
# manifest, so a resume may change them.
SCHEDULING = ("num_threads", "device", "offload_activations", "max_hessian_memory")


class JournalError(ValueError):
    """The partial output cannot be used: it belongs to another run, or nothing can be written."""


def partial_path(out: str | Path) -> Path:
    """Where a streaming run writes before its output is complete."""
    out = Path(out)
    return out.parent / f"{out.name}.partial"


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sealed(record: Mapping[str, Any]) -> str:
    """``record`` as JSON text with its ``checksum`` field."""
    body = {k: v for k, v in record.items() if k != CHECKSUM}
    return _json({**body, CHECKSUM: hashlib.sha256(_json(body).encode()).hexdigest()})


def unsealed(text: str) -> dict[str, Any]:
    """The record in ``text``; ValueError when its checksum is missing or wrong (a damaged file,
    or one edited by hand: either way it cannot be trusted)."""
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError("it is not a JSON object")
    body = {k: v for k, v in record.items() if k != CHECKSUM}
    if record.get(CHECKSUM) != hashlib.sha256(_json(body).encode()).hexdigest():
        raise ValueError("its checksum does not match its content")
    return body


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the journal in ``folder``, checked; a one-line JournalError naming the file
    when it is missing, damaged or edited."""
    path = folder / MANIFEST
    try:
        return unsealed(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JournalError(
            f"cannot resume {folder}: {path} is missing, damaged or edited ({exc}), so what the interrupted "
            f"run was is unknown; rerun with --overwrite (or delete {folder}) to start again"
        ) from None


def output_settings(settings: Any, provenance: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's ``settings`` part: the run settings that can change the output (every
    ``RunSettings`` field but :data:`SCHEDULING`) and what the caller recorded (``provenance``)."""
    out = {k: v for k, v in settings.to_dict().items() if k not in SCHEDULING}
    return json.loads(_json({**out, **(provenance or {})}))


def refusal(
    folder: Path, found: Mapping[str, Any], wanted: Mapping[str, Any], overwrite: bool, every: bool = False
) -> JournalError | None:
    """The error for resuming the journal in ``folder`` (whose manifest is ``found``) with the
    manifest parts ``wanted`` (only those; ``every``: found's too), or None when they agree. The
    shards' fingerprints hold modification times, compared by their own rule
    (fingerprint.check_shards), not for equality."""
    parts = {*found, *wanted} if every else set(wanted)
    differ = sorted(k for k in parts if k != "shards" and found.get(k) != wanted.get(k))
    if not differ:
        return None
    # --overwrite is already given with --resume: starting again needs --resume dropped.
    again = "drop --resume to start again" if overwrite else "pass --overwrite to start again"
    return JournalError(
        f"cannot resume {folder}: the {_differences(found, wanted, differ)} differ from the "
        f"interrupted run's; rerun with the same model, calibration and settings, or {again}"
    )


def check_resume(out: str | Path, config: Any, settings: Any, provenance: Any = None, **flags: bool) -> None:
    """Refuse, before anything is loaded, tokenised or hashed, to resume (``flags``: ``resume``,
    ``overwrite``) ``out``'s journal with another ``config`` (a QuantConfig) or other output
    settings (``RunSettings``, ``provenance``) than those it was started with, or one whose
    manifest is damaged or edited. Nothing to check without ``resume`` or a journal."""
    folder = partial_path(out)
    if not flags.get("resume") or not (folder / MANIFEST).exists():
        return
    wanted = {"config": json.loads(_json(config.to_dict())), "settings": output_settings(settings, provenance)}
    error = refusal(folder, read_manifest(folder), wanted, bool(flags.get("overwrite")))
    if error is not None:
        raise error


def _differences(found: Mapping[str, Any], wanted: Mapping[str, Any], parts: list[str]) -> str:
    """The manifest parts that differ; for settings, which ones, then and now (e.g. the world size
    of a torchrun journal resumed by one process)."""
    out = []
    for part in parts:
        then, now = found.get(part), wanted.get(part)
        if not (isinstance(then, dict) and isinstance(now, dict)):
            out.append(part)
            continue
        keys = sorted(k for k in {*then, *now} if then.get(k) != now.get(k))
        shown = "; ".join(f"{k} {then.get(k)!r:.40} then, {now.get(k)!r:.40} now" for k in keys[:4])
        out.append(f"{part} ({shown}{'; ...' if len(keys) > 4 else ''})")
    return ", ".join(out)
