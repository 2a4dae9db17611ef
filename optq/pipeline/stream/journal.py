"""The resume journal of a streaming run: ``OUT.partial/`` until the checkpoint is complete.

Layout of ``OUT.partial/`` while a run is going on::

    manifest.json            what the run is: hashes of the source and calibration, the settings
                             that change the output (not memory budgets: records.SCHEDULING), each
                             source shard's size, time and header (pipeline/stream/fingerprint),
                             and a checksum over all of it (pipeline/stream/records)
    state.json               how far it got: blocks done, their report rows, the activations file,
                             the sha256 of every block and activations file and of every source
                             tensor read, and a checksum over all of it
    blocks/00000.safetensors the packed tensors of each finished block
    activations-00007.safetensors   the hidden states entering the next block (block 7 here);
                             with method="gptaq" also the float model's ("fp." keys)

Every file is written to a temporary name and renamed, and ``state.json`` is renamed last, so a
run killed at any moment leaves a journal whose state names only complete files: ``--resume``
redoes at most the block that was running. A file damaged after it was written (a disk error, a
stray write, a deletion) is found when ``--resume`` opens the journal, before any work, by its
checksum (``optq.pipeline.stream.verify``). When the last block is done the checkpoint is
assembled in ``OUT.partial/final/`` (afresh on resume), which one rename makes ``OUT``; then the
journal is removed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from optq.formats.atomic import atomic_write, move_into_place
from optq.pipeline.distributed.ranks import Dist
from optq.pipeline.stream.records import (
    BLOCKS,
    MANIFEST,
    SCHEDULING,
    STATE,
    JournalError,
    _json,
    file_sha256,
    partial_path,
    read_manifest,
    refusal,
    sealed,
    unsealed,
)
from optq.pipeline.stream.verify import check_files

__all__ = ["Journal", "JournalError", "partial_path", "file_sha256"]

log = logging.getLogger("optq.pipeline")

FINAL = "final"  # the checkpoint being assembled, renamed to OUT when complete
OFFLOAD = "activations.mmap"  # --offload-activations: the live activations, memory-mapped
FP = "fp."  # the float chain's keys in an activations file (GPTAQ)


def fresh_state() -> dict[str, Any]:
    """The state of a journal with no finished block."""
    return {"done": 0, "activations": None, "activations_sha256": None, "report": None, "blocks": {}, "sources": {}}


@contextmanager
def _writing(what: Path) -> Iterator[None]:
    # A full disk or a read-only folder ends the run, with the journal as it was before this
    # write: the partial folder stays resumable.
    try:
        yield
    except OSError as exc:
        hint = (
            "the disk is full: free space, then rerun with --resume"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else "fix that, then rerun with --resume"
        )
        raise JournalError(f"cannot write {what} ({exc.strerror or exc}); {hint}") from exc


class Journal:
    """Opens (or resumes) ``OUT.partial/`` for a run described by ``manifest``.

    ``manifest`` maps a part of the run ("source", "calibration", "config", "settings",
    "options") to a JSON-able value or digest; resuming a journal whose manifest differs names the
    parts. The options that only schedule the work (``records.SCHEDULING``) are left out.
    """

    def __init__(
        self, out: str | Path, manifest: dict[str, Any], *, resume: bool, overwrite: bool, dist: Dist | None = None
    ) -> None:
        self.out = Path(out)
        self.folder = partial_path(self.out)
        # What it reads back as, for comparisons; only what changes the output (records.SCHEDULING).
        self.manifest = json.loads(_json(manifest))
        if isinstance(self.manifest.get("options"), dict):
            self.manifest["options"] = {k: v for k, v in self.manifest["options"].items() if k not in SCHEDULING}
        self.overwrite = overwrite
        self.state: dict[str, Any] = fresh_state()
        # The source shards' fingerprints the journal's blocks were computed from (a resume
        # compares them with the folder: fingerprint.check_shards), and block files written
        # but not committed yet, with their sha256.
        self.shards: dict[str, Any] = self.manifest.get("shards", {})
        self.written: dict[str, str] = {}
        # Under torch.distributed rank 0 owns the journal (blocks, state, the output); every rank
        # keeps its own share of the activations in a file of its own.
        self.dist = dist or Dist()
        if self.dist.active:
            with self.dist.failing_together():
                if self.dist.rank == 0:
                    self._open(resume)
            # After rank 0 (which may have reset a damaged journal); a rank whose own
            # activations are damaged stops every rank. A fresh run's journal is rank 0's new one.
            with self.dist.failing_together():
                if self.dist.rank != 0 and resume and self.folder.exists() and (self.folder / STATE).exists():
                    self._open_existing()
            return
        self._open(resume)

    def _open(self, resume: bool) -> None:
        if self.out.exists() and not self.overwrite:
            raise JournalError(f"{self.out} already exists; pass --overwrite (overwrite=True) or choose another folder")
        if self.folder.exists():
            if resume:
                self._open_existing()
                return
            if not self.overwrite:
                raise JournalError(
                    f"{self.folder} holds an unfinished run; pass --resume to continue it or --overwrite to start again"
                )
            shutil.rmtree(self.folder)
        elif resume:
            log.info("%s does not exist: nothing to resume, starting from the first block", self.folder)
        with _writing(self.folder):
            (self.folder / BLOCKS).mkdir(parents=True)
            atomic_write(self.folder / MANIFEST, sealed(self.manifest))
            atomic_write(self.folder / STATE, sealed(self.state))

    def _open_existing(self) -> None:
        found = read_manifest(self.folder)
        try:
            state = unsealed((self.folder / STATE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise JournalError(
                f"cannot resume {self.folder}: {STATE} is missing or damaged ({exc}), so what is finished is "
                f"unknown; rerun with --overwrite (or delete {self.folder}) to start again"
            ) from None
        error = refusal(self.folder, found, self.manifest, self.overwrite, every=True)
        if error is not None:
            raise error
        self.state = state
        self.shards = found.get("shards") or {}
        check_files(self)
        if self.dist.rank == 0 and self.done == 0:  # nothing depends on the source yet: record it as it is
            with _writing(self.folder):
                (self.folder / BLOCKS).mkdir(exist_ok=True)
                atomic_write(self.folder / MANIFEST, sealed(self.manifest))
            self.shards = self.manifest.get("shards", {})
        log.info("resuming %s after %d finished blocks", self.folder, self.done)

    def restart(self, reason: str) -> None:
        """Forget every finished block (rank 0): the journal is damaged where only the
        calibration's own inputs can recompute it, so the run starts again from block 0."""
        log.warning("%s: %s; recomputing every block from the first", self.folder, reason)
        with _writing(self.folder):
            shutil.rmtree(self.folder / BLOCKS, ignore_errors=True)
            for path in self.folder.glob("activations-*"):
                path.unlink(missing_ok=True)
            self.state = fresh_state()
            atomic_write(self.folder / STATE, sealed(self.state))

    def writing(self, what: Path) -> Any:
        """A context in which a failed write (full disk, lost permission) becomes a JournalError
        that says the partial run is kept for ``--resume``."""
        return _writing(what)

    @property
    def done(self) -> int:
        """How many blocks are finished and written."""
        return int(self.state["done"])

    def block_file(self, i: int) -> Path:
        return self.folder / BLOCKS / f"{i:05d}.safetensors"

    def _save(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``path`` atomically; its sha256 goes to ``written`` for the next state."""
        tmp = path.with_name(f".{path.name}.tmp")
        with _writing(path):
            try:
                save_file(
                    {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"}
                )
                os.chmod(tmp, 0o644)
                # Hashed from the file just written (in the page cache), so the checksum covers
                # the bytes a resume will read, header included.
                self.written[path.name] = file_sha256(tmp)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def write_block(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """The packed tensors of block ``i`` (not yet counted as done: see ``commit``)."""
        if self.dist.rank == 0:
            self._save(self.block_file(i), tensors)

    def activations_name(self, done: int) -> str:
        """This rank's activations file entering block ``done``."""
        return f"activations-{done:05d}" + (f".rank{self.dist.rank}" if self.dist.active else "") + ".safetensors"

    def commit(self, done: int, chains: tuple | None, report: dict[str, Any], sources: dict[str, str]) -> None:
        """Record ``done`` blocks finished, with the activations entering the next block
        (``chains`` = (hidden, fp_hidden): the quantized chain's, and the float chain's or None)
        and the sha256 of every source tensor read so far (``sources``: key -> digest)."""
        acts, sums = None, None
        # Every rank's activations are on disk before the state says so.
        with self.dist.failing_together():
            if chains is not None:
                hidden, fp = chains
                acts = self.activations_name(done)
                tensors = {f"{b:06d}": h for b, h in enumerate(hidden)}
                tensors.update({f"{FP}{b:06d}": h for b, h in enumerate(fp or ())})
                self._save(self.folder / acts, tensors)
        if chains is not None:  # the same on every rank (only the last block has none)
            sums = self.dist.all_gather(self.written.pop(acts, None))  # each rank checks its own on resume
        old = self.state.get("activations")
        blocks = {**self.state.get("blocks", {}), **self.written}  # rank 0's block files since the last commit
        self.written = {}
        self.state = {
            "done": done,
            "activations": acts,
            "activations_sha256": sums,
            "report": report,
            "blocks": blocks,
            "sources": {**self.state.get("sources", {}), **sources},
        }
        if self.dist.rank == 0:
            with _writing(self.folder / STATE):
                atomic_write(self.folder / STATE, sealed(self.state))
        self.dist.barrier()
        if old and old != acts:
            (self.folder / old).unlink(missing_ok=True)

    def activations(self, fp: bool = False) -> list[torch.Tensor]:
        """The hidden states saved with the last commit (one tensor per batch); ``fp``: the float
        chain's (method="gptaq")."""
        name = self.state.get("activations")
        if name and self.dist.active:  # the state names rank 0's file; each rank reads its own
            name = self.activations_name(int(self.state["done"]))
        if not name:
            raise JournalError(f"{self.folder} holds no activations to resume from; use --overwrite")
        try:  # checked when the journal was opened (verify.check_files); this guards a race only
            loaded = load_file(str(self.folder / name))
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise JournalError(
                f"cannot read {self.folder / name} ({exc}); rerun with --overwrite (or delete {self.folder})"
            ) from None
        keys = sorted(k for k in loaded if k.startswith(FP) == fp)
        if fp and not keys:
            raise JournalError(f"{self.folder / name} holds no float-model activations to resume GPTAQ from")
        return [loaded[k] for k in keys]

    def offload(self, hidden: Sequence[torch.Tensor], chain: str = "") -> list[torch.Tensor]:
        """The same tensors, backed by a memory-mapped file in the journal folder instead of RAM.

        Writes into them (each block's outputs replace its inputs) go to the page cache and on
        to disk, which the kernel may evict under memory pressure: activations larger than the
        memory then fit, at the cost of disk traffic. ``chain``: a suffix of the file's name (the
        float chain's is "fp").
        """
        total = sum(h.numel() for h in hidden)
        if not hidden or total == 0:
            return list(hidden)
        dtype = hidden[0].dtype
        if any(h.dtype != dtype or h.device.type != "cpu" for h in hidden):
            raise JournalError("offloaded activations must be CPU tensors of one dtype")
        name = OFFLOAD + (f".{chain}" if chain else "")
        path = self.folder / (f"{name}.rank{self.dist.rank}" if self.dist.active else name)
        path.unlink(missing_ok=True)
        with self.writing(path):
            flat = torch.from_file(str(path), shared=True, size=total, dtype=dtype)
        out, start = [], 0
        for h in hidden:
            view = flat[start : start + h.numel()].view(h.shape)
            view.copy_(h)
            out.append(view)
            start += h.numel()
        return out

    @contextmanager
    def removed_if_empty(self) -> Iterator[None]:
        """The run inside: when it fails with an error before any block is finished, the journal
        holds nothing worth resuming and is removed, so that the next plain run needs no
        --overwrite. One holding finished blocks is always kept, and so is any journal after an
        interrupt (Ctrl-C, a kill: not an Exception), which the user means to --resume. Under
        torch.distributed rank 0, which owns the folder, alone removes it (the other ranks'
        failures reach it as a DistributedError)."""
        try:
            yield
        except Exception:
            if self.dist.rank == 0 and self.done == 0 and self.folder.is_dir():
                shutil.rmtree(self.folder, ignore_errors=True)
            raise

    @property
    def final(self) -> Path:
        """Where the finished checkpoint is assembled, inside the journal folder."""
        return self.folder / FINAL

    def finish(self) -> Path:
        """Give the assembled checkpoint (``self.final``) its name ``OUT`` in one rename, then
        remove the journal; an existing ``OUT`` is replaced only with overwrite. Killed before
        the rename, the journal is whole and resumes to the assembly; after it, OUT is complete."""
        move_into_place(self.final, self.out, self.overwrite)
        if self.final.exists():  # the old output, exchanged into our place
            shutil.rmtree(self.final, ignore_errors=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.out
