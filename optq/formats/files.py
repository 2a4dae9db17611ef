"""File plumbing for checkpoints: safetensors shards with their index, atomic folder writes,
and reading tensor headers (shapes and dtypes) without loading data. Never unpickles."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

__all__ = [
    "CheckpointError",
    "parse_size",
    "write_safetensors",
    "read_header",
    "read_config",
    "read_index",
    "read_tensors",
    "TensorReader",
    "write_json",
    "write_safetensors_lazily",
    "write_safetensors_file",
    "safetensors_header",
    "split_shards",
    "tensor_nbytes",
    "SAFETENSORS_DTYPES",
    "natural_key",
]


log = logging.getLogger("optq.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint folder (or a model to save) does not match what the format requires."""


SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
SAFETENSORS_DTYPES = {
    "I32": torch.int32,
    "I64": torch.int64,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "BOOL": torch.bool,
}


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


def write_safetensors_lazily(
    folder: Path,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    fetch: Callable[[str], torch.Tensor],
    max_shard_size: int | str,
) -> list[str]:
    """Like :func:`write_safetensors`, holding one tensor in memory at a time.

    ``specs``: tensor name -> (shape, dtype), in the order to shard; ``fetch(name)`` gives the
    tensor when it is written. The same specs give the same files as ``write_safetensors``.
    """
    limit = parse_size(max_shard_size)
    sizes = {name: tensor_nbytes(shape, dtype) for name, (shape, dtype) in specs.items()}
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
_ORDER = {
    torch.bool: 0,
    torch.uint8: 4,
    torch.int8: 5,
    torch.int16: 9,
    torch.float16: 11,
    torch.bfloat16: 12,
    torch.int32: 13,
    torch.float32: 15,
    torch.float64: 17,
    torch.int64: 18,
}
_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype in a safetensors file (or in memory)."""
    return int(torch.Size(shape).numel()) * dtype.itemsize


def safetensors_header(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict[str, str] | None = None
) -> tuple[list[str], bytes]:
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
        end = offset + tensor_nbytes(shape, dtype)
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return order, len(raw).to_bytes(8, "little") + raw


def write_safetensors_file(
    path: Path,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    fetch: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
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
                raise CheckpointError(
                    f"tensor {name}: expected {tuple(specs[name][0])} {specs[name][1]}, "
                    f"got {tuple(tensor.shape)} {tensor.dtype}"
                )
            if tensor.numel():
                fh.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            del tensor


def _corrupt(path: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"{path} is truncated or corrupt (safetensors: {exc}); re-save or re-download it")


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
                f"{folder / INDEX} is not a safetensors index ({type(exc).__name__}: {exc}); re-save or re-download it"
            ) from None
    elif (folder / SINGLE).exists():
        files = [SINGLE]
    else:
        files = _shards_without_index(folder)
    out: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    for fname in files:
        path = folder / fname
        if not path.is_file():
            raise CheckpointError(f"{folder / INDEX} names {fname}, which is missing; re-save or re-download it")
        out.update({name: (fname, shape, dtype) for name, (shape, dtype) in read_header(path).items()})
    return out


_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _shards_without_index(folder: Path) -> list[str]:
    """The shards of a folder whose index is gone: every ``model-i-of-n.safetensors`` of one
    complete set (each names its tensors in its header, so the index adds nothing the loader
    needs); a folder with none raises FileNotFoundError, an incomplete set CheckpointError."""
    found = sorted(p.name for p in folder.glob("model-*-of-*.safetensors") if _SHARD.fullmatch(p.name))
    if not found:
        raise FileNotFoundError(f"{folder} holds neither {SINGLE} nor {INDEX}; optq reads safetensors checkpoints only")
    counts = {int(_SHARD.fullmatch(n).group(2)) for n in found}
    total = max(counts)
    want = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    if len(counts) > 1 or found != want:
        missing = [n for n in want if n not in found]
        raise CheckpointError(
            f"{folder} has no {INDEX} and its shards do not form one set: found {', '.join(found)}"
            f"{'; missing ' + ', '.join(missing) if missing else ''}; re-save or re-download the checkpoint"
        )
    log.warning("%s has no %s; reading its %d shards %s ... %s", folder, INDEX, total, want[0], want[-1])
    return want


def read_config(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict: FileNotFoundError when it is absent, CheckpointError
    naming the file when it is not a JSON object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; is it a saved checkpoint folder?")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno}); re-save or re-download it"
        ) from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object; re-save or re-download it")
    return config


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


def read_tensors(
    folder: Path, index: dict[str, tuple[str, tuple[int, ...], torch.dtype]], names: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
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


class TensorReader:
    """Tensors of a checkpoint's safetensors files, each read into memory of its own.

    ``safe_open`` maps the file, and every page a tensor read from it touched counts as
    resident until the file is closed and no view is left; this reads the bytes with plain
    file reads instead (the headers, checked by :func:`read_index`, give the offsets), so that
    a loader holds nothing of the files beyond what it copies. ``rows`` reads a block of rows."""

    def __init__(self, folder: Path, index: Mapping[str, tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        if sys.byteorder != "little":
            raise CheckpointError("safetensors is little-endian; reading on a big-endian machine is not supported")
        self.folder, self.index = Path(folder), index
        self._files: dict[str, tuple[Any, int, dict[str, list[int]]]] = {}

    def _file(self, fname: str) -> tuple[Any, int, dict[str, list[int]]]:
        if fname not in self._files:
            path = self.folder / fname
            fh = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
            try:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
                offsets = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                fh.close()
                raise _corrupt(path, exc) from None
            self._files[fname] = (fh, 8 + size, offsets)
        return self._files[fname]

    def get(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``key`` (rows ``a:b`` of it when ``rows=(a, b)``), in the file's dtype."""
        fname, shape, dtype = self.index[key]
        fh, start, offsets = self._file(fname)
        begin, end = offsets[key]
        if end - begin != tensor_nbytes(shape, dtype):
            raise _corrupt(self.folder / fname, ValueError(f"tensor {key}'s offsets do not fit its shape"))
        if rows is not None:
            row = tensor_nbytes(shape[1:], dtype)
            begin, end, shape = begin + rows[0] * row, begin + rows[1] * row, (rows[1] - rows[0], *shape[1:])
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        fh.seek(start + begin)
        done = 0
        while done < end - begin:
            n = fh.readinto(view[done:])
            if not n:
                raise _corrupt(self.folder / fname, EOFError(f"the file ends inside tensor {key}"))
            done += n
        return out

    def close(self) -> None:
        for fh, _, _ in self._files.values():
            fh.close()
        self._files.clear()
