"""What a resumed streaming run checks against its source model folder.

A journal's finished blocks were computed from the tensors the run read then: the embeddings
and final norm the capture read, and each finished block's tensors. Two records let a resume
prove that those are still what the folder holds:

- the manifest's ``shards``: each shard's size, modification time (ns) and a sha256 of its
  header bytes (the 8-byte length and the JSON header: names, dtypes, shapes, offsets);
- the state's ``sources``: a sha256 of every tensor's bytes (``tensor_sha256``), taken by
  :meth:`SafetensorsSource.read` as the tensor is read (one pass over bytes already in memory).

The rule on resume (:func:`check_shards`): a shard whose size or header differs was rewritten
with another layout, and is refused outright. A shard whose modification time alone differs
may have been rewritten with new values of the same shapes, or only touched (copied, restored
from a backup, ``touch``): the tensors the journal depends on that live in it are read and
hashed again, and the resume is refused only if one differs. So the cost of the content check
is paid only for shards that were written since the interrupted run, and a touch that changes
no byte is accepted. Tensors the journal does not depend on (blocks not finished yet, an untied
head the capture never reads) may change freely: the resumed run reads them afresh, exactly as
an uninterrupted run over the folder as it is now would.

The tensors read again anyway are compared for free: the capture's on resume
(:func:`check_reads`), and every tensor the assembly copies from the source, so embeddings
changed under a resume, whatever their modification time, are refused too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from optq.pipeline.stream.journal import JournalError
from optq.pipeline.stream.source import SafetensorsSource, tensor_sha256

__all__ = ["shard_prints", "check_shards", "check_reads"]

_ADVICE = "restore the source, or rerun with --overwrite to start again"


def _header_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        # A damaged length must not make us read a whole shard: safetensors caps headers at 100 MB.
        return hashlib.sha256(head + f.read(min(length, 100_000_000))).hexdigest()


def shard_prints(folder: Path, files: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Each shard's size, modification time and header hash, for the manifest."""
    out = {}
    for name in sorted(set(files)):
        path = folder / name
        st = path.stat()
        out[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "header": _header_sha256(path)}
    return out


def check_shards(
    src: SafetensorsSource, recorded: Mapping[str, Any] | None, sources: Mapping[str, str], where: Path
) -> None:
    """Refuse to resume the journal at ``where`` when a shard of ``src`` no longer holds what
    the finished blocks were computed from (``recorded``: the manifest's shards, ``sources``:
    the state's tensor hashes). See the module's docstring for the rule."""
    now = shard_prints(src.folder, (entry[0] for entry in src.index.values()))
    for name, print_ in now.items():
        path = src.folder / name
        was = (recorded or {}).get(name)
        if was is None:
            raise JournalError(f"cannot resume {where}: the interrupted run did not read {path}; {_ADVICE}")
        changed = [part for part in ("size", "header") if was.get(part) != print_[part]]
        if changed:
            raise JournalError(
                f"cannot resume {where}: {path} was rewritten since the interrupted run (its "
                f"{' and '.join(changed)} differ); {_ADVICE}"
            )
        if was.get("mtime_ns") != print_["mtime_ns"]:
            _rehash(path, [k for k in sorted(sources) if src.index.get(k, ("",))[0] == name], sources, where)


def _rehash(path: Path, keys: list[str], sources: Mapping[str, str], where: Path) -> None:
    # The shard was written (or touched) since the run read it: compare what the journal needs.
    if not keys:
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                if tensor_sha256(f.get_tensor(key)) != sources[key]:
                    raise JournalError(
                        f"cannot resume {where}: {key} in {path} changed since the interrupted run read it; {_ADVICE}"
                    )
    except JournalError:
        raise
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise JournalError(f"cannot resume {where}: cannot read {path} ({exc}); {_ADVICE}") from None


def check_reads(src: SafetensorsSource, keys: Iterable[str], sources: Mapping[str, str], what: str) -> None:
    """Refuse when a tensor just read from ``src`` (its hash in ``src.digests``) differs from the
    one the journal recorded for it (``sources``); ``what`` says which step found it."""
    for key in keys:
        was, now = sources.get(key), src.digests.get(key)
        if was is not None and now is not None and was != now:
            path = src.folder / src.index[key][0]
            raise JournalError(f"{what}: {key} in {path} changed since the run read it for calibration; {_ADVICE}")
