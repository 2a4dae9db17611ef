"""File plumbing for checkpoints: safetensors shards with their index, atomic folder writes,
and reading tensor headers (shapes and dtypes) without loading data. Never unpickles."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

__all__ = [
    "CheckpointError", "move_into_place", "parse_size", "write_safetensors", "read_header", "read_index", "read_tensors", "atomic_folder",
    "atomic_write", "write_json", "write_safetensors_lazily", "write_safetensors_file", "safetensors_header", "split_shards", "SAFETENSORS_DTYPES", "natural_key",
]


class CheckpointError(ValueError):
    """A checkpoint folder (or a model to save) does not match what the format requires."""


SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SAFETENSORS_DTYPES = {"I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64, "BOOL": torch.bool}


def parse_size(size: int | str, what: str = "max_shard_size") -> int:
    """``"2GB"`` / ``"500MiB"`` / a positive int of bytes -> bytes; ``what`` names the setting in errors."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"{what}={size!r} must be a positive number of bytes")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{what}={size!r} is not a size; write e.g. '2GB', '500MB' or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def natural_key(name: str) -> list[Any]:
    """Sort key that orders numbers as numbers: layers.2 before layers.10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys, trailing newline)."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_shard_size: int | str) -> list[str]:
    """Write ``tensors`` as one file or as shards plus index; returns the file names written."""
    specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    return write_safetensors_lazily(folder, specs, tensors.__getitem__, max_shard_size)


def split_shards(sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    """Names in the given order, cut into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors_lazily(folder: Path, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                             fetch: Callable[[str], torch.Tensor], max_shard_size: int | str) -> list[str]:
    """Like :func:`write_safetensors`, holding one tensor in memory at a time.

    ``specs``: tensor name -> (shape, dtype), in the order to shard; ``fetch(name)`` gives the
    tensor when it is written. The same specs give the same files as ``write_safetensors``.
    """
    limit = parse_size(max_shard_size)
    sizes = {name: _nbytes(shape, dtype) for name, (shape, dtype) in specs.items()}
    shards = split_shards(sizes, limit)
    meta = {"format": "pt"}
    if len(shards) == 1:
        write_safetensors_file(folder / SINGLE, {n: specs[n] for n in shards[0]}, fetch, meta)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        write_safetensors_file(folder / fname, {n: specs[n] for n in shard}, fetch, meta)
        weight_map.update({k: fname for k in shard})
    write_json(folder / INDEX, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    return [*names, INDEX]


# safetensors lays a file's data out by dtype, in the reverse order of its Dtype enum (8-byte
# kinds first), then by name; following it gives the bytes that ``safetensors.torch.save_file``
# writes (checked by the tests against the installed safetensors).
_ORDER = {torch.bool: 0, torch.uint8: 4, torch.int8: 5, torch.int16: 9, torch.float16: 11, torch.bfloat16: 12,
          torch.int32: 13, torch.float32: 15, torch.float64: 17, torch.int64: 18}
_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def safetensors_header(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                       metadata: dict[str, str] | None = None) -> tuple[list[str], bytes]:
    """The tensors' order in the file, and the file's first bytes: the 8-byte length, then the
    JSON header padded with spaces to a multiple of 8 (the layout ``save_file`` writes)."""
    for name, (_, dtype) in specs.items():
        if dtype not in _ORDER:
            raise CheckpointError(f"tensor {name}: dtype {dtype} cannot be written to safetensors here")
    order = sorted(specs, key=lambda n: (-_ORDER[specs[n][1]], n))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        shape, dtype = specs[name]
        end = offset + _nbytes(shape, dtype)
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return order, len(raw).to_bytes(8, "little") + raw


def write_safetensors_file(path: Path, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                           fetch: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, written one tensor at a time: the header from ``specs`` (name ->
    (shape, dtype)), then each tensor's bytes as ``fetch(name)`` gives it.

    ``save_file`` takes every tensor of the file at once, so its caller holds a whole shard (5 GB
    by default); this holds one tensor, and writes the same bytes.
    """
    if sys.byteorder != "little":
        raise CheckpointError("safetensors is little-endian; writing on a big-endian machine is not supported")
    order, raw = safetensors_header(specs, metadata)
    with open(path, "wb") as fh:
        fh.write(raw)
        for name in order:
            tensor = fetch(name)
            if tuple(tensor.shape) != tuple(specs[name][0]) or tensor.dtype != specs[name][1]:
                raise CheckpointError(f"tensor {name}: expected {tuple(specs[name][0])} {specs[name][1]}, "
                                      f"got {tuple(tensor.shape)} {tensor.dtype}")
            if tensor.numel():
                fh.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            del tensor


def _corrupt(path: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{path} is truncated or corrupt (safetensors: {exc}); re-save or re-download it"
    )


def read_index(folder: Path) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """tensor name -> (file, shape, dtype), from the safetensors headers only.

    Raises :class:`CheckpointError` naming the file when an index or a header cannot be read
    (truncated, corrupt, or a shard the index names is missing).
    """
    folder = Path(folder)
    if (folder / INDEX).exists():
        try:
            weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"{folder / INDEX} is not a safetensors index ({type(exc).__name__}: {exc}); "
                "re-save or re-download it"
            ) from None
    elif (folder / SINGLE).exists():
        files = [SINGLE]
    else:
        raise FileNotFoundError(
            f"{folder} holds neither {SINGLE} nor {INDEX}; optq reads safetensors checkpoints only"
        )
    out: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    for fname in files:
        path = folder / fname
        if not path.is_file():
            raise CheckpointError(f"{folder / INDEX} names {fname}, which is missing; re-save or re-download it")
        out.update({name: (fname, shape, dtype) for name, (shape, dtype) in read_header(path).items()})
    return out


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """tensor name -> (shape, dtype) of one safetensors file, from its header only."""
    out = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                out[name] = (tuple(sl.get_shape()), dtype)
    except SafetensorError as exc:
        raise _corrupt(path, exc) from None
    return out


def read_tensors(folder: Path, index: dict[str, tuple[str, tuple[int, ...], torch.dtype]],
                 names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for ``names``, opening each file once (CheckpointError when unreadable)."""
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(index[n][0], []).append(n)
    for fname, keys in sorted(by_file.items()):
        path = Path(folder) / fname
        try:
            with safe_open(str(path), framework="pt") as f:
                for k in keys:
                    try:
                        tensor = f.get_tensor(k)
                    except SafetensorError as exc:
                        raise _corrupt(path, exc) from None
                    yield k, tensor
        except SafetensorError as exc:
            raise _corrupt(path, exc) from None


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # renameat2 flags (linux/fs.h)
_AT_FDCWD = -100
_FILE_MODE, _DIR_MODE = 0o644, 0o755


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2(src, dst, flags)``; False where the libc, kernel or filesystem lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # the kernel or this filesystem cannot do it: the caller falls back
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _set_modes(folder: Path) -> None:
    """Every file 0644, every folder 0755 (``mkstemp`` writes 0600).

    Symbolic links are left alone: chmod would follow them, and a link may dangle (a Debian
    package unpacked here links into a package it depends on).
    """
    os.chmod(folder, _DIR_MODE)
    for root, dirs, files in os.walk(folder):
        for name, mode in [*((d, _DIR_MODE) for d in dirs), *((f, _FILE_MODE) for f in files)]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode)


def _clean_stale(target: Path) -> None:
    """Remove ``.NAME.optq-tmp-PID`` / ``.NAME.optq-old-PID`` left by runs that crashed.

    Only those whose PID is not a live process on this machine; our own PID's are removed too
    (left by an earlier crash of a process that had the same PID).
    """
    for p in target.parent.glob(f".{glob.escape(target.name)}.optq-*-*"):
        kind, _, pid = p.name[len(target.name) + 2:].rpartition("-")
        if kind not in ("optq-tmp", "optq-old") or not pid.isdigit():
            continue
        if int(pid) != os.getpid() and _alive(int(pid)):
            continue
        _remove(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


@contextlib.contextmanager
def atomic_folder(target: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``target``; on success it replaces ``target``.

    The temporary folder is ``.NAME.optq-tmp-PID`` beside ``target``. On any error it is removed
    and ``target`` is left as it was. On success every file gets mode 0644 and every folder
    0755. With ``overwrite`` an existing ``target`` is swapped with the new folder in one step
    (Linux ``renameat2(RENAME_EXCHANGE)``), so at every moment ``target`` is either the old
    folder or the new one; the old content (now at the temporary name) is then deleted. Where
    the exchange is unavailable the old folder is first renamed to ``.NAME.optq-old-PID``
    (``target`` is briefly absent), put back if the second rename fails, and deleted otherwise.
    A process killed mid-way can leave ``.NAME.optq-tmp-PID`` or ``-old-PID`` behind (``target``
    itself is always whole, or absent only in the fallback's gap); the next write to the same
    ``target`` removes such leftovers of processes that are no longer running.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True or choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(target)
    tmp = target.parent / f".{target.name}.optq-tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        move_into_place(tmp, target, overwrite)
    finally:
        _remove(tmp)  # the failed write, or the old content after an exchange


def move_into_place(folder: Path, target: Path, overwrite: bool) -> None:
    """Make the finished ``folder`` become ``target`` (files 0644, folders 0755).

    A new ``target`` is a plain rename that never clobbers one appearing meanwhile; with
    ``overwrite`` an existing ``target`` is exchanged with ``folder`` in one step where Linux
    allows it (the old content is then at ``folder``'s path: the caller removes it), else
    replaced by two renames as in :func:`atomic_folder`.
    """
    folder, target = Path(folder), Path(target)
    _set_modes(folder)
    if not target.exists():
        if not _renameat2(folder, target, _RENAME_NOREPLACE):
            folder.rename(target)
    elif not overwrite:
        raise FileExistsError(f"{target} appeared while writing; pass overwrite=True or choose another folder")
    elif not _renameat2(folder, target, _RENAME_EXCHANGE):
        _replace_by_renames(folder, target)


def _replace_by_renames(tmp: Path, target: Path) -> None:
    """The fallback: target -> .old, tmp -> target, delete .old (or put it back on failure)."""
    old = target.parent / f".{target.name}.optq-old-{os.getpid()}"
    _remove(old)
    target.rename(old)
    replaced = False
    try:
        tmp.rename(target)
        replaced = True
    finally:
        if replaced:
            _remove(old)
        else:
            old.rename(target)


def atomic_write(path: str | Path, data: str | bytes, *, mode: int = 0o644) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file renamed over it.

    Readers see the old file or the new one, never a part; on any error the temporary file is
    removed. The file gets ``mode`` (ordinary data is world-readable, unlike ``mkstemp``'s 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
