"""The decoding step compiled ahead of time (AOTInductor): compiled speed without the compiler.

``torch.compile`` in the serving process keeps its tracer's graphs, guards and generated code
resident (about 40 MB plus 2 MB per block on SmolLM2, measured: docs/serving.md, "Serving on CPU"). Here a
child process exports one decoding step of the same model (``torch.export``: one token in, its
logits out, writing its keys and values into a static cache at the position it is given) and
compiles it with AOTInductor into a package (a shared library and a manifest) under
``$OPTQ_CACHE/aot/``. The serving process loads only that library: the compiled step reads the
model's own tensors (the packed codes, scales, norms, embedding table; handed over without a
copy) and the serving cache's, so the weights are in memory once and nothing of the compiler is.

``generate`` still drives decoding: :class:`AotDecoder` puts itself in front of the model's
``forward`` and runs the compiled step for calls it was built for (one token of batch 1 on its
own cache, no padding, inside the cache's length); everything else (the prompt's prefill, other
caches) runs the model as it is. The package is keyed by a signature of everything its code
depends on (the model's config, every tensor's name, shape, dtype and strides, the cache length,
torch's and transformers' versions, a hash of optq's source), recomputed by the child and checked
when loading, so a package never serves a model it was not built for.

    >>> decoder = AotDecoder.for_model(model, "smollm2-135m", max_cache_len=512)  # doctest: +SKIP
    >>> model.generate(ids, max_new_tokens=64, **decoder.options())  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["AotDecoder", "build_package", "cache_length", "manifest_path", "model_tensors", "package_path", "signature"]

_FORMAT = 1  # of the package and manifest this module writes


def cache_length(tokens: int) -> int:
    """The static cache length for ``tokens`` (prompt and new ones): the next power of two from
    256, so that nearby lengths share one compiled package."""
    return max(256, 1 << max(0, tokens - 1).bit_length())


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the decoding step may read, by a name stable across loads of the same
    checkpoint with the same options: parameters and buffers by their names, and each
    QuantLinear's fast-path layout (and its fused group's, named after the group's first member)
    as ``NAME#fast.planes.P.codes`` and the like."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    for name, module in model.named_modules():
        fast = getattr(module, "fast_weight", None) if hasattr(module, "_fast_cache") else None
        if fast is None:
            continue
        layouts = [(f"{name}#fast", fast)]
        fused = getattr(module, "_fused", None)
        if fused is not None and fused[1] == 0:
            layouts.append((f"{name}#group", fused[0].fast))
        for key, layout in layouts:
            for p, (codes, scales) in enumerate(layout.planes):
                out[f"{key}.planes.{p}.codes"] = codes
                out[f"{key}.planes.{p}.scales"] = scales
            out[f"{key}.scale_zero"] = layout.scale_zero
            if layout.perm is not None:
                out[f"{key}.perm"] = layout.perm
    return out


@functools.cache
def _code_versions() -> dict[str, str]:
    """torch's and transformers' versions and a hash of optq's source: the code that is traced."""
    import transformers

    source = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        source.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return {"torch": torch.__version__, "transformers": transformers.__version__, "optq": source.hexdigest()}


def signature(model: nn.Module, max_cache_len: int) -> str:
    """A hash of what the compiled step's code depends on (not the weights' values, which it
    reads from the model at each call): the model's config, every tensor's name, shape, dtype and
    layout, the cache length, and the code that is traced (:func:`_code_versions`)."""
    h = hashlib.sha256()
    header = {"format": _FORMAT, **_code_versions(), "max_cache_len": max_cache_len}
    h.update(json.dumps([header, model.config.to_dict()], sort_keys=True, default=str).encode())
    for name, t in model_tensors(model).items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.stride()}:{t.storage_offset()};".encode())
    return h.hexdigest()


def package_path(model: nn.Module, max_cache_len: int, cache_dir: Path | None = None) -> Path:
    """Where the package for this model and cache length lives (``$OPTQ_CACHE/aot/`` by default)."""
    if cache_dir is None:
        from optq.data.corpora import cache_dir as default_cache

        cache_dir = default_cache() / "aot"
    return Path(cache_dir) / f"{signature(model, max_cache_len)[:24]}.pt2"


def manifest_path(package: Path) -> Path:
    """A package's manifest, written last: its presence marks a whole package."""
    return Path(f"{package}.json")


def _static_cache(model: nn.Module, max_cache_len: int) -> Any:
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    config = model.config.get_text_config()
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer}
    if kinds:  # sliding windows (Gemma-3) and the like
        raise ValueError(f"ahead-of-time decoding takes full-attention layers only; this model has {sorted(kinds)}")
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    cache.early_initialization(1, heads, head_dim, dtype, torch.device("cpu"))
    return cache


def _positioned(cache: Any) -> None:
    """Make ``cache``'s layers write at, and report as their length, the position the step is
    given, instead of the counter they keep (the serving side keeps that counter)."""
    from transformers.cache_utils import StaticLayer

    class _StepLayer(StaticLayer):
        position: torch.Tensor

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.keys.index_copy_(2, self.position, key_states)
            self.values.index_copy_(2, self.position, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> Any:
            return self.position[0]

    for layer in cache.layers:  # all StaticLayer (:func:`_static_cache` checks)
        layer.__class__ = _StepLayer


class _Step(nn.Module):
    """One decoding step: token [1, 1] at position [1, 1] -> logits. Every tensor it reads is a
    registered buffer (so the exported program names it, and the names map back to
    :func:`model_tensors` and the cache)."""

    def __init__(self, model: nn.Module, max_cache_len: int) -> None:
        super().__init__()
        self.model = model
        self.cache = _static_cache(model, max_cache_len)
        _positioned(self.cache)
        self.names: dict[str, str] = {}
        for i, layer in enumerate(self.cache.layers):
            for kind, t in (("keys", layer.keys), ("values", layer.values)):
                self.register_buffer(f"cache_{kind}_{i}", t, persistent=False)
                self.names[f"cache_{kind}_{i}"] = f"cache:{kind}.{i}"
        own = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        for j, (name, t) in enumerate(model_tensors(model).items()):
            if id(t) not in own:  # the fast layouts' tensors: not parameters or buffers of any module
                self.register_buffer(f"fast_{j}", t, persistent=False)
                self.names[f"fast_{j}"] = name
                own.add(id(t))
        for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.names[f"model.{name}"] = name

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        for layer in self.cache.layers:
            layer.position = position_ids[0]
        return self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True).logits


def build_package(model: nn.Module, max_cache_len: int, out: Path) -> Path:
    """Export and compile ``model``'s decoding step for a static cache of ``max_cache_len`` into
    ``out`` (``.pt2``) and its manifest (``out`` + ``.json``), written atomically; the model's
    tensors are left out of the package (read from the model when it is served). Costs the
    compiler's time and memory: :meth:`AotDecoder.for_model` runs it in a child process."""
    import torch._inductor

    step = _Step(model, max_cache_len).eval()
    example = (torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    with torch.no_grad():
        program = torch.export.export(step, example, strict=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / "step.pt2"
        options = {
            "aot_inductor.package_constants_in_so": False,
            "aot_inductor.package_constants_on_disk_format": "pickle_weights",
        }
        torch._inductor.aoti_compile_and_package(program, package_path=str(built), inductor_configs=options)
        tensors = {**dict(program.state_dict), **dict(program.constants)}
        served = {name: step.names[name] for name in tensors if name in step.names}
        _strip_weights(built, set(served), Path(tmp) / "lean.pt2")
        manifest = {
            "format": _FORMAT,
            "signature": signature(model, max_cache_len),
            "max_cache_len": max_cache_len,
            "tensors": {n: [a, list(tensors[n].shape), str(tensors[n].dtype)] for n, a in served.items()},
        }
        Path(tmp, "manifest.json").write_text(json.dumps(manifest, indent=0) + "\n")
        os.replace(Path(tmp) / "lean.pt2", out)
        os.replace(Path(tmp, "manifest.json"), manifest_path(out))  # last: its presence marks a whole package
    return out


def _weight_files(archive: zipfile.ZipFile) -> dict[str, str]:
    """Each constant's weight file in a package (the archive's member name), by constant name."""
    name = next(n for n in archive.namelist() if n.endswith("weights_config.json"))
    root = name.split("/data/")[0]
    entries = json.loads(archive.read(name)).items()
    return {n: f"{root}/data/weights/{e[0] if isinstance(e, list) else e['path_name']}" for n, e in entries}


def _strip_weights(path: Path, served: set[str], out: Path) -> None:
    """Copy the package without the weight files of tensors the model provides when served."""
    with zipfile.ZipFile(path) as src:
        files = _weight_files(src)
        drop = {files[n] for n in served if n in files}
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                if info.filename not in drop:
                    dst.writestr(info, src.read(info.filename))


def _plain_step(kwargs: Mapping[str, Any], length: int) -> bool:
    """Whether a call's position and attention mask are those of the next token after ``length``
    unpadded ones, as the compiled step computes them: position ``length``, and a mask (2-D
    [1, L]: ones up to it; 4-D [1, 1, 1, L], as ``generate`` prepares for a static cache: exactly
    the positions up to it visible, True or 0.0) that hides nothing before it."""
    position = kwargs.get("position_ids")
    if position is not None and (position.shape != (1, 1) or int(position) != length):
        return False
    mask = kwargs.get("attention_mask")
    if mask is None:
        return True
    if mask.shape[-1] <= length or mask.dim() not in (2, 4):
        return False
    visible = mask.bool() if mask.dtype == torch.bool or mask.dim() == 2 else mask == 0
    return bool(visible[..., : length + 1].all()) and (mask.dim() == 2 or not bool(visible[..., length + 1 :].any()))


class AotDecoder:
    """A loaded package serving ``model``'s decoding steps inside ``generate`` (see the module's
    description). Pass :meth:`options` to each ``generate`` call; :meth:`close` gives the model
    its own ``forward`` back."""

    def __init__(self, model: nn.Module, package: Path) -> None:
        import torch._inductor

        package = Path(package)
        manifest = json.loads(manifest_path(package).read_text())
        self.max_cache_len = int(manifest["max_cache_len"])
        if manifest.get("format") != _FORMAT or manifest["signature"] != signature(model, self.max_cache_len):
            raise ValueError(f"{package} was compiled for another model, torch or optq; build it again")
        self.cache = _static_cache(model, self.max_cache_len)
        self.runner = torch._inductor.aoti_load_package(str(package))
        constants = self._constants(model, package, manifest["tensors"])
        self.runner.load_constants(constants, check_full_update=True, user_managed=True)
        self._lengths = [layer.cumulative_length for layer in self.cache.layers]
        self.model = model
        self._eager = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._forward(*args, **kwargs)

        # generate passes options (logits_to_keep: the prompt's last logits only) by forward's signature
        model.forward = functools.update_wrapper(forward, self._eager)
        self.steps = 0  # decoding steps the package ran
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self._output = CausalLMOutputWithPast

    def _constants(self, model: nn.Module, package: Path, tensors: Mapping[str, list]) -> dict[str, torch.Tensor]:
        """Every constant the package reads: the model's and the cache's tensors by the manifest
        (checked against the shapes and dtypes it was compiled for), the compiler's own (a few
        scalars) from the package."""
        own = model_tensors(model)
        cache = {
            f"{kind}.{i}": getattr(layer, kind)
            for i, layer in enumerate(self.cache.layers)
            for kind in ("keys", "values")
        }
        out = {}
        for name in self.runner.get_constant_fqns():
            if name not in tensors:
                continue
            address, shape, dtype = tensors[name]
            t = cache.get(address[6:]) if address.startswith("cache:") else own.get(address)
            if t is None or list(t.shape) != shape or str(t.dtype) != dtype:
                raise ValueError(f"{package}: the model has no tensor {address} of shape {shape} and {dtype}")
            out[name] = t
        missing = set(self.runner.get_constant_fqns()) - set(out)
        if missing:
            with zipfile.ZipFile(package) as archive:
                files, present = _weight_files(archive), set(archive.namelist())
                for name in missing:
                    file = files.get(name)
                    if file not in present:
                        raise ValueError(f"{package} has no value for its constant {name}; build it again")
                    out[name] = torch.load(io.BytesIO(archive.read(file)), weights_only=True)
        return out

    def options(self) -> dict[str, Any]:
        """``generate`` options for one call: the decoder's cache, emptied."""
        self.cache.reset()
        return {"cache": self.cache}

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids")
        if (
            not args
            and kwargs.get("cache") is self.cache
            and ids is not None
            and ids.shape == (1, 1)
            and kwargs.get("inputs_embeds") is None
        ):
            position = self._lengths[0]
            length = int(position)
            if length < self.max_cache_len and _plain_step(kwargs, length):
                logits = self.runner(ids, position.view(1, 1))  # the step's output as exported: one tensor
                torch._foreach_add_(self._lengths, 1)
                self.steps += 1
                return self._output(logits=logits, cache=self.cache)
        return self._eager(*args, **kwargs)

    def close(self) -> None:
        """Give the model its own ``forward`` back."""
        if getattr(self.model.__dict__.get("forward"), "__wrapped__", None) == self._eager:
            del self.model.forward

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        source: str | Path,
        max_cache_len: int,
        *,
        load: Mapping[str, Any] | None = None,
        cache_dir: Path | None = None,
    ) -> AotDecoder:
        """The decoder for ``model``, loaded as ``optq.data.zoo.load_model(source, **load)`` loads
        it (``dtype`` as a name, ``embeddings``; its QuantLinears on the fast path, with their
        layouts built), its package built first by a child process when none is cached (tens of
        seconds; the child's output is shown only when it fails). ValueError for a model whose
        cache is not full attention throughout (sliding windows), with a QuantLinear on the exact
        path, or that the package does not match; RuntimeError when the child fails."""
        from optq.formats.qlinear import QuantLinear

        _static_cache(model, 1)  # refuses unsupported caches here, not in the child
        if any(not q.use_fast_path for q in model.modules() if isinstance(q, QuantLinear)):
            raise ValueError("ahead-of-time decoding runs quantized layers on their fast path (use_fast_path)")
        path = package_path(model, max_cache_len, cache_dir)
        if not manifest_path(path).exists():
            spec = {"source": str(source), "load": dict(load or {}), "max_cache_len": max_cache_len, "out": str(path)}
            cmd = [sys.executable, "-m", "optq.eval.aot", json.dumps(spec)]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)  # the compiler's warnings
            if proc.returncode:
                tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
                raise RuntimeError(f"compiling the decoding step failed (exit status {proc.returncode}):\n{tail}")
            built = json.loads(manifest_path(path).read_text())["signature"]
            if built != signature(model, max_cache_len):  # the child's model is not this one
                for stale in (path, manifest_path(path)):
                    stale.unlink(missing_ok=True)
                raise ValueError(
                    f"{source} loaded with {dict(load or {})} is not the model given (another dtype, "
                    "embedding storage or checkpoint?): pass the options the model was loaded with"
                )
        return cls(model, path)


def _build_from_spec(spec: Mapping[str, Any]) -> Path:
    from optq.data.zoo import load_model
    from optq.formats.qlinear import QuantLinear

    load = dict(spec["load"])
    if isinstance(load.get("dtype"), str):
        load["dtype"] = getattr(torch, load["dtype"])
    model, _ = load_model(spec["source"], **load)
    for q in model.modules():
        if isinstance(q, QuantLinear):
            q.build_fast_path()
    return build_package(model, int(spec["max_cache_len"]), Path(spec["out"]))


if __name__ == "__main__":  # the child of AotDecoder.for_model (silent: its parent reports)
    _build_from_spec(json.loads(sys.argv[1]))
