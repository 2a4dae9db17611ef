"""Seam 1, where a block's weights come from: a safetensors model folder read one module at a time.

The model is built on the meta device from its ``config.json`` (no weights materialised); a
module's tensors are read from the shards only when :meth:`SafetensorsSource.load` asks for
them, cast to the compute dtype and placed on the compute device, and :meth:`release` turns them
back into meta tensors once the module is done. Peak memory is then one block, whatever the
depth. Pickled ``*.bin`` weights are refused: optq never unpickles.

A source that stores experts fused (GPT-OSS as ``save_pretrained`` writes it) fills each
expert's linears from slices of the fused tensors (:meth:`SafetensorsSource.use_slices`,
``optq.formats.expert_slices``): each fused tensor is read (and hashed) once per block, its
slices cut out, and freed before the next fused tensor is read.

Example::

    >>> src = SafetensorsSource("out/llama")                       # doctest: +SKIP
    >>> model = src.skeleton()                                      # meta tensors only
    >>> src.load(model.model.layers[0], "model.layers.0", "cpu", torch.float32)
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from optq.formats.expert_slices import FusedSlice
from optq.formats.files import INDEX, SINGLE, CheckpointError, read_index

__all__ = ["SafetensorsSource", "SourceError", "tensor_sha256"]

log = logging.getLogger("optq.pipeline")


class SourceError(ValueError):
    """A model folder that cannot be streamed (no safetensors, missing tensors, bad config)."""


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes (its dtype and shape are the shard header's business)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def _check_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise SourceError(f"{folder} has no config.json; give a Hugging Face model folder")
    if (folder / SINGLE).is_file() or (folder / INDEX).is_file():
        return
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickled:
        raise SourceError(
            f"{folder} holds only pickled weights ({', '.join(pickled[:3])}); optq never unpickles. "
            "Convert them once to safetensors (e.g. load with transformers and save_pretrained("
            "safe_serialization=True)) and quantize that folder"
        )
    raise SourceError(f"{folder} holds no {SINGLE} or {INDEX}")


class SafetensorsSource:
    """A Hugging Face model folder whose weights are safetensors (one file or shards + index).

    ``loaded`` counts how often each tensor was read (tests use it to prove that nothing is
    read twice or before it is needed); ``digests`` holds the sha256 of each tensor's bytes as
    last read, which a resume compares with what its journal recorded
    (``optq.pipeline.stream.fingerprint``). ``names`` maps a tensor name of the model to the key the
    checkpoint stores it under (the identity until :meth:`use_names`); :meth:`tensor_names` and
    :meth:`load` look model tensors up through it, :meth:`read` takes checkpoint keys.
    ``slices`` (:meth:`use_slices`): checkpoint names the folder does not store, each a slice of
    a fused stored tensor; :meth:`tensor` and :meth:`load` take those names too.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        _check_folder(self.folder)
        try:
            self.config_dict: dict[str, Any] = json.loads((self.folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SourceError(f"{self.folder / 'config.json'} is not readable JSON ({exc})") from None
        if not isinstance(self.config_dict, dict) or "model_type" not in self.config_dict:
            raise SourceError(f"{self.folder / 'config.json'} has no model_type; is it a transformers model?")
        if self.config_dict.get("quantization_config"):
            method = self.config_dict["quantization_config"].get("quant_method")
            raise SourceError(f"{self.folder} is already quantized ({method}); quantize the original model")
        self.index = read_index(self.folder)
        self.loaded: Counter[str] = Counter()
        self.digests: dict[str, str] = {}
        self.names: Callable[[str], str] = _same
        self.slices: dict[str, FusedSlice] = {}
        self._fused: dict[str, torch.Tensor] = {}  # fused tensors read, of one experts module

    def use_names(self, names: Callable[[str], str]) -> None:
        """Look model tensors up under ``names(model name)``: the checkpoint's own names, for
        models transformers renames at load time (``optq.formats.experts.checkpoint_namer``)."""
        self.names = names

    def use_slices(self, slices: Mapping[str, FusedSlice]) -> None:
        """Fill these tensors (checkpoint name -> where it lies in a fused stored tensor, see
        ``optq.formats.expert_slices.fused_slices``) from slices of the fused tensors."""
        self.slices = dict(slices)

    def stored(self, key: str) -> str:
        """The stored key that holds ``key``: itself, or the fused tensor it is a slice of."""
        s = self.slices.get(key)
        return key if s is None else s.key

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every tensor the source gives the model, by checkpoint name: the
        stored tensors, those consumed by :attr:`slices` replaced by the slices."""
        consumed = {s.key for s in self.slices.values()}
        out = {k: (tuple(shape), dt) for k, (_, shape, dt) in self.index.items() if k not in consumed}
        for key, s in self.slices.items():
            _, shape, dt = self.index[s.key]
            out[key] = (s.shape(shape), dt)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The source dtype: that of most floating-point tensors (by element count)."""
        sizes: Counter[torch.dtype] = Counter()
        for _, shape, dtype in self.index.values():
            if dtype.is_floating_point:
                sizes[dtype] += int(torch.Size(shape).numel())
        return sizes.most_common(1)[0][0] if sizes else torch.float32

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes of the given tensors (all by default) as stored."""
        keys = self.index if names is None else names
        return sum(int(torch.Size(self.index[k][1]).numel()) * self.index[k][2].itemsize for k in keys)

    def hf_config(self) -> Any:
        """The transformers config object."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self.folder))

    def skeleton(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model with every parameter (and persistent buffer) on the meta device.

        Non-persistent buffers such as rotary tables are real: they are computed from the config,
        not read from the checkpoint.
        """
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(self.hf_config(), dtype=dtype)
        model.tie_weights()
        return model.eval()

    # ------------------------------------------------------------------------------- tensors
    def read(self, name: str) -> torch.Tensor:
        """One tensor as stored (source dtype, CPU), in memory of its own.

        The file is opened for this read only and the tensor copied out of its mapping: a
        handle kept open would keep every page ever read resident, so memory would grow with
        the model instead of staying at one block.
        """
        try:
            fname = self.index[name][0]
        except KeyError:
            raise SourceError(f"{self.folder} has no tensor {name}") from None
        try:
            with safe_open(str(self.folder / fname), framework="pt") as f:
                tensor = f.get_tensor(name).clone()
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise CheckpointError(
                f"{self.folder / fname}: cannot read {name} ({exc}); the file is truncated or corrupt"
            ) from None
        self.loaded[name] += 1
        self.digests[name] = tensor_sha256(tensor)  # the bytes are in memory now: one more pass over them
        return tensor

    def tensor(self, key: str) -> torch.Tensor:
        """A tensor by checkpoint name: as stored (:meth:`read`), or cut out of the fused tensor
        it is a slice of. Fused tensors are read once and kept while the slices asked for are of
        the same experts module (its other fused tensors kept with it), until :meth:`drop_fused`."""
        s = self.slices.get(key)
        if s is None:
            return self.read(key)
        owner = s.key.rsplit(".", 1)[0]
        if any(k.rsplit(".", 1)[0] != owner for k in self._fused):
            self._fused.clear()
        if s.key not in self._fused:
            self._fused[s.key] = self.read(s.key)
        return s.take(self._fused[s.key])

    def drop_fused(self, key: str | None = None) -> None:
        """Free the fused tensor ``key`` kept by :meth:`tensor` (all of them by default)."""
        if key is None:
            self._fused.clear()
        else:
            self._fused.pop(key, None)

    def tensor_names(self, module: nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
        """Checkpoint key -> the module's tensor names that hold it (tied parameters share one key).

        The key of a tensor is ``names(prefix.name)`` (see :meth:`use_names`). Tensors all of
        whose names start with one of ``skip`` (module-relative prefixes such as
        ``"model.layers."``) are left out. Raises SourceError naming a tensor the module needs
        that the checkpoint lacks.
        """
        groups: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for name, t in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]:
            if not _persistent(module, name):
                continue
            groups.setdefault(id(t), []).append(name)
            tensors[id(t)] = t
        out: dict[str, list[str]] = {}
        for names in groups.values():
            if skip and all(n.startswith(skip) for n in names):
                continue
            full = [self.names(f"{prefix}.{n}" if prefix else n) for n in names]
            found = [f for f in full if f in self.index or f in self.slices]
            if not found:
                own = f"{prefix}.{names[0]}" if prefix else names[0]
                mine = "" if full[0] == own else f" as {own}"
                raise SourceError(
                    f"{self.folder} has no tensor {full[0]} (needed by {type(module).__name__}{mine}); "
                    "is the checkpoint complete and written under transformers' names?"
                )
            out[found[0]] = names
        return out

    def load(
        self,
        module: nn.Module,
        prefix: str,
        device: torch.device | str,
        dtype: torch.dtype | None,
        skip: tuple[str, ...] = (),
    ) -> None:
        """Read ``module``'s tensors (checkpoint keys ``names(prefix.<name>)``) onto ``device``.

        Floating-point tensors are cast to ``dtype`` (None keeps the source dtype); ``skip`` as
        in :meth:`tensor_names`. Tied tensors are read once and stay tied. Slices of one fused
        tensor are taken one after the other, so it is read once and freed after its last slice.
        """
        groups = self.tensor_names(module, prefix, skip)
        keys = sorted(groups, key=lambda k: "" if k not in self.slices else self.slices[k].key)  # stable
        left = Counter(self.slices[k].key for k in keys if k in self.slices)
        for key in keys:
            names = groups[key]
            value = self.tensor(key)
            if key in self.slices:
                left[self.slices[key].key] -= 1
                if not left[self.slices[key].key]:
                    self.drop_fused(self.slices[key].key)
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            value = value.to(device)
            shared = None
            for name in names:
                current = module.get_parameter(name) if _is_parameter(module, name) else module.get_buffer(name)
                if tuple(current.shape) != tuple(value.shape):
                    raise SourceError(
                        f"{self.folder}: tensor {key} has shape {list(value.shape)}, the model "
                        f"expects {list(current.shape)} for {prefix}.{name}"
                    )
                if shared is None:
                    shared = nn.Parameter(value, requires_grad=False) if _is_parameter(module, name) else value
                _assign(module, name, shared)

    def release(self, module: nn.Module, skip: tuple[str, ...] = ()) -> None:
        """Turn ``module``'s persistent tensors back into meta tensors (frees their memory)."""
        self.drop_fused()
        done: dict[int, Any] = {}
        for name, t in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]:
            if not _persistent(module, name) or (skip and name.startswith(skip)):
                continue
            if id(t) not in done:
                meta = torch.empty_like(t, device="meta")
                done[id(t)] = nn.Parameter(meta, requires_grad=False) if _is_parameter(module, name) else meta
            _assign(module, name, done[id(t)])


def _same(name: str) -> str:
    return name


def _split(name: str) -> tuple[str, str]:
    owner, _, leaf = name.rpartition(".")
    return owner, leaf


def _is_parameter(module: nn.Module, name: str) -> bool:
    owner, leaf = _split(name)
    return leaf in (module.get_submodule(owner) if owner else module)._parameters


def _persistent(module: nn.Module, name: str) -> bool:
    owner, leaf = _split(name)
    sub = module.get_submodule(owner) if owner else module
    return leaf in sub._parameters or leaf not in sub._non_persistent_buffers_set


def _assign(module: nn.Module, name: str, value: Any) -> None:
    owner, leaf = _split(name)
    sub = module.get_submodule(owner) if owner else module
    if leaf in sub._parameters:
        sub._parameters[leaf] = value
    else:
        sub._buffers[leaf] = value
