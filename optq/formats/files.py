"""File plumbing for checkpoints: safetensors shards with their index, atomic folder writes,
and reading tensor headers (shapes and dtypes) without loading data. Never unpickles."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "parse_size", "write_safetensors", "read_index", "read_tensors", "atomic_folder", "atomic_write", "write_json",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DTYPES = {"I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64, "BOOL": torch.bool}


def parse_size(size: int | str) -> int:
    """``"2GB"`` / ``"500MiB"`` / an int of bytes -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"max_shard_size={size!r} is not a size; write e.g. '2GB', '500MB' or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys, trailing newline)."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_shard_size: int | str) -> list[str]:
    """Write ``tensors`` as one file or as shards plus index; returns the file names written."""
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE), metadata=meta)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*names, INDEX]


def read_index(folder: Path) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """tensor name -> (file, shape, dtype), from the safetensors headers only."""
    if (folder / INDEX).exists():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE).exists():
        files = [SINGLE]
    else:
        raise FileNotFoundError(
            f"{folder} holds neither {SINGLE} nor {INDEX}; optq reads safetensors checkpoints only"
        )
    out: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = _DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ValueError(f"{fname}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                out[name] = (fname, tuple(sl.get_shape()), dtype)
    return out


def read_tensors(folder: Path, index: dict[str, tuple[str, tuple[int, ...], torch.dtype]],
                 names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for ``names``, opening each file once."""
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(index[n][0], []).append(n)
    for fname, keys in sorted(by_file.items()):
        with safe_open(str(folder / fname), framework="pt") as f:
            for k in keys:
                yield k, f.get_tensor(k)


@contextlib.contextmanager
def atomic_folder(target: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``target``; on success it replaces ``target``.

    On any error the temporary folder is removed and ``target`` is left as it was.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True or choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.optq-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if target.exists():
            old = target.parent / f".{target.name}.optq-old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
