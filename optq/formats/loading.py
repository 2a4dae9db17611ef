"""Load a checkpoint written by :func:`optq.formats.checkpoint.save` (or any GPTQ /
pack-quantized one) as a model, one module at a time.

The model is built on the meta device first; then each module's tensors are read from the
safetensors files into memory of their own (:class:`~optq.formats.files.TensorReader`), checked, cast, assigned,
and, on the CPU, its fast path built (which frees the checkpoint codes it duplicates) before the
next module is read; the heap pages its temporaries took are handed back. The embedding table
and a float head come first, converted to their compact storage a block of rows at a time as
they are read (:mod:`optq.formats.compact`). So the memory a load needs beyond the loaded model
is one module's temporaries, whatever the model's depth (benchmarks/load_memory.py measures it).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optq.core.memory import heap_trimmer
from optq.formats import compressed_tensors as checkpoint_ct
from optq.formats.compact import EMBEDDINGS, compact_embeddings
from optq.formats.experts import checkpoint_namer, layer_namer, unfuse_experts
from optq.formats.files import TensorReader, read_config, read_index
from optq.formats.fused import build_fast_paths, fuse_siblings
from optq.formats.gptq_config import CheckpointError, check_gptq_config
from optq.formats.layout import Scheme, packed_layout
from optq.formats.qlinear import QuantLinear
from optq.formats.schemes import LayerSetting, layer_schemes

__all__ = ["load", "TRIM_EVERY"]

TRIM_EVERY = 1 << 20
"""Bytes read between two trims of the host heap. A module's temporaries (its codes unpacked to
int32, the fast path's planes being built) are about ten times the bytes read, and glibc keeps
the freed pages between live ones; on SmolLM2-135M trimming after every module cost a quarter
of the load's time, trimming every 4 MiB read let the peak reach 1.26 times the loaded size,
every 1 MiB 1.16 times, for about a tenth of the load's time."""


def _model_type(config: dict[str, Any], path: Path) -> str:
    model_type = config.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(
            f'{path} has no model_type field (the architecture, e.g. "llama"); re-save or re-download it'
        )
    return model_type


def load(
    folder: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    embeddings: str = "bfloat16",
    fast_path: bool = True,
) -> nn.Module:
    """Load a checkpoint written by :func:`~optq.formats.checkpoint.save` (or any GPTQ /
    pack-quantized one) as a model.

    The architecture is built from ``config.json`` with transformers, its parameters on the meta
    device (no fp32 weights are materialised for quantized layers); layers with a ``qweight``
    (or ``weight_packed``) tensor become :class:`~optq.formats.qlinear.QuantLinear`. Every tensor is checked
    against the expected shape and dtype; missing, unexpected or mismatched tensors raise
    :class:`CheckpointError`. Other weights are cast to ``dtype``. ``embeddings`` stores the token
    embedding and a float head as ``"bfloat16"`` (default), ``"int8"`` or ``"model"`` (``dtype``;
    with ``use_fast_path = False`` on every QuantLinear, the exact model): see optq.formats.compact.
    ``fast_path=False``: no fast CPU layout is built (the load is faster, the codes are kept) and
    every QuantLinear runs its reference forward.

    Tensors are looked up under the original checkpoint's names (what ``save`` writes):
    a mixture-of-experts model's fused experts become
    :class:`~optq.formats.experts.ExpertLinears` whose per-expert linears are read from
    ``...experts.{e}.w1.qweight`` (or ``.gate_proj``...) as QuantLinear. Modules are read one at
    a time (see the module's description): the peak memory is the loaded model's plus a bound
    that does not grow with its depth.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from optq.formats.linears import get_weight, is_linear

    if embeddings not in EMBEDDINGS:
        raise ValueError(f"embeddings={embeddings!r}: choose one of {EMBEDDINGS}")
    folder = Path(folder)
    config_path = folder / "config.json"
    config = read_config(folder)
    qc = config.pop("quantization_config", None)
    if qc is None and (folder / "quantize_config.json").exists():
        qc = read_config_file(folder / "quantize_config.json")
    if qc is None:
        raise CheckpointError(f"{config_path} has no quantization_config; load it with transformers")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{config_path}: quantization_config is a {type(qc).__name__}, not an object")
    method = qc.get("quant_method", "gptq")
    model_type = _model_type(config, config_path)
    index = read_index(folder)
    if method == "compressed-tensors":
        fmt, marker = "gptq_v2", ".weight_packed"  # QuantLinear holds pack-quantized layers as gptq_v2
    elif method == "gptq":
        fmt, marker = check_gptq_config(qc)[2], ".qweight"
    else:
        raise CheckpointError(f"quant_method={method!r} is not supported; optq reads 'gptq' and 'compressed-tensors'")
    names = sorted(k[: -len(marker)] for k in index if k.endswith(marker))
    if not names:
        raise CheckpointError(f"{folder} declares {method} quantization but holds no {marker[1:]} tensor")
    settings = layer_schemes(qc, names)

    try:
        hf_config = AutoConfig.for_model(model_type, **config)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not one transformers knows ({exc})"
        ) from None
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) stay real
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.tie_weights()  # from_config leaves meta parameters untied; tying follows the config
    unfuse_experts(model)  # one linear per expert, as checkpoints store them
    tensor_name = checkpoint_namer(model)

    module_name = layer_namer(tensor_name)
    modules = {module_name(n): n for n, _ in model.named_modules() if n}  # checkpoint -> model name
    quantized: dict[str, str] = {}  # model name -> checkpoint name of the quantized layers
    for name in names:
        if name not in modules:
            raise CheckpointError(f"tensor {name}{marker} names no module of {type(model).__name__}")
        mname = modules[name]
        module = model.get_submodule(mname)
        if not is_linear(module):
            raise CheckpointError(f"tensor {name}{marker} names a {type(module).__name__}, not a linear layer")
        n_out, n_in = get_weight(module).shape
        s = settings[name]
        layer = QuantLinear(n_in, n_out, s.bits, s.group_size, f"{name}.bias" in index, fmt, device="meta")
        parent, _, child = mname.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        quantized[mname] = name

    own = model.state_dict(keep_vars=True)
    if method == "compressed-tensors":  # the packed tensors stand in for the QuantLinear buffers
        own = _pack_quantized_keys(own, quantized, settings, index)
    keys = _checkpoint_keys(own, tensor_name, quantized)  # model key -> checkpoint key
    expected = {keys[k]: t for k, t in own.items()}
    model_key = {v: k for k, v in keys.items()}
    tied = {keys[k] for k in _tied_keys(model, own)}
    missing = [k for k in expected if k not in index and k not in tied]
    unexpected = [k for k in index if k not in expected]
    if missing or unexpected:
        widths = sorted({s.bits for s in settings.values()})
        raise CheckpointError(
            f"{folder} does not match {type(model).__name__} quantized at {'/'.join(map(str, widths))} bits: "
            f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    quant_prefixes = tuple(f"{n}." for n in names)
    for key, (fname, shape, file_dtype) in index.items():
        want = expected[key]
        if shape != tuple(want.shape):
            raise CheckpointError(f"{fname}: tensor {key} has shape {list(shape)}, expected {list(want.shape)}")
        if key.startswith(quant_prefixes) and not key.endswith(".bias") and file_dtype != want.dtype:
            raise CheckpointError(f"{fname}: tensor {key} has dtype {file_dtype}, expected {want.dtype}")
        if file_dtype.is_floating_point != want.dtype.is_floating_point:
            raise CheckpointError(f"{fname}: tensor {key} has dtype {file_dtype}, expected {want.dtype}")
    del own

    plan = _Plan(folder, index, expected, model_key, quant_prefixes, quantized, settings, method)
    units: dict[str, list[str]] = {}  # module -> its tensors' checkpoint names, in the model's order
    for key in keys.values():
        if key in index and key not in tied:
            units.setdefault(model_key[key].rpartition(".")[0], []).append(key)
    on_cpu = torch.device(device).type == "cpu" and fast_path  # builds fast paths, fuses siblings
    reader = TensorReader(folder, index)
    try:
        tables = _table_keys(model, keys, units) if embeddings != "model" else {}
        owner = {id(m): n for n, m in model.named_modules()}
        head = model.get_output_embeddings()
        first = [owner.get(id(model.get_input_embeddings()))]
        first += [owner.get(id(head))] if head is not None and not isinstance(head, QuantLinear) else []
        del head  # the float head, once compacted below, must not outlive it here
        for mname in dict.fromkeys(first):
            if mname in units:
                plan.read(reader, model, mname, units.pop(mname), on_cpu)
        if getattr(hf_config, "tie_word_embeddings", False) and not isinstance(
            model.get_output_embeddings(), QuantLinear
        ):
            model.tie_weights()

        def rows(weight: torch.Tensor, a: int, b: int) -> torch.Tensor:  # a float table, straight from its file
            key = tables[id(weight)]
            block = reader.get(key, rows=(a, b))
            _check_values(folder / index[key][0], key, block, False, expected)
            return block.to(weight.dtype)

        model = compact_embeddings(model, embeddings, rows)  # before the rest is read
        trim, read = heap_trimmer(), 0
        trim()
        pending = Counter(mname.rpartition(".")[0] for mname in units)  # modules to read, by parent
        for mname, names in units.items():
            plan.read(reader, model, mname, names, on_cpu)
            parent = mname.rpartition(".")[0]
            pending[parent] -= 1
            if on_cpu and not pending[parent]:  # its siblings run as one call (fused.py) from now
                fuse_siblings(model.get_submodule(parent), recurse=False)
            read += sum(math.prod(index[k][1]) * index[k][2].itemsize for k in names)
            if read >= TRIM_EVERY:  # the temporaries' heap pages: back to the system
                trim()
                read = 0
    finally:
        reader.close()
    left = [keys.get(n, n) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{folder}: tensors {left[:8]} were never loaded")
    model.config.quantization_config = qc
    model = model.to(device).eval()
    for m in model.modules() if not fast_path else ():
        if isinstance(m, QuantLinear):
            m.use_fast_path = False
    build_fast_paths(model, fuse=False)  # on CPU: the layers left (none); then the load's garbage goes
    return model


class _Plan:
    """What the header pass found, for reading the modules one at a time."""

    def __init__(self, folder, index, expected, model_key, quant_prefixes, quantized, settings, method) -> None:  # noqa: ANN001
        self.folder, self.index, self.expected, self.model_key = folder, index, expected, model_key
        self.quant_prefixes, self.quantized, self.settings, self.method = quant_prefixes, quantized, settings, method

    def read(self, reader: TensorReader, model: nn.Module, mname: str, keys: list[str], on_cpu: bool) -> None:
        """Read module ``mname``'s tensors (checkpoint names ``keys``), check, cast and assign
        them; on the CPU build its QuantLinears' fast paths (freeing the codes they duplicate)."""
        tensors = {}
        for key in keys:
            tensor = reader.get(key)
            _check_values(
                self.folder / self.index[key][0], key, tensor, key.startswith(self.quant_prefixes), self.expected
            )
            tensors[self.model_key[key][len(mname) + 1 if mname else 0 :]] = tensor.to(self.expected[key].dtype)
            del tensor
        module = model.get_submodule(mname)
        if self.method == "compressed-tensors" and mname in self.quantized:
            name = self.quantized[mname]
            tensors = checkpoint_ct.import_layer(tensors, self.settings[name], name=name)
        module.load_state_dict(tensors, strict=False, assign=True)
        del tensors
        if on_cpu:
            for m in module.modules():
                if isinstance(m, QuantLinear):
                    m.build_fast_path(drop_codes=True)


def _table_keys(model: nn.Module, keys: Mapping[str, str], units: dict[str, list[str]]) -> dict[int, str]:
    """id(weight) -> checkpoint name of the embedding table and an untied float head, which
    :func:`compact_embeddings` then reads from the file a block of rows at a time (taken out of
    ``units``); empty when it would not compact them (an input embedding that is not
    ``nn.Embedding``)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding):
        return {}
    tables = [embed.weight] + ([head.weight] if isinstance(head, nn.Linear) and head.weight is not embed.weight else [])
    names = {id(t): n for n, t in model.named_parameters()}  # a tied weight: its first name
    out = {}
    for weight in tables:
        key = keys[names[id(weight)]]
        owner = names[id(weight)].rpartition(".")[0]
        if key in units.get(owner, []):
            units[owner].remove(key)
            out[id(weight)] = key
    return out


def read_config_file(path: Path) -> Any:
    """A JSON file of the checkpoint (``quantize_config.json``), CheckpointError naming it when unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save or re-download it") from None


_SCALES = (".scales", ".weight_scale")


def _check_values(
    path: Path, key: str, tensor: torch.Tensor, quantized: bool, expected: Mapping[str, torch.Tensor]
) -> None:
    """Catch corrupt data before it turns into NaN logits: one reduction per tensor.

    Scales of quantized layers must be finite and nonzero (optq's grids give positive scales,
    also for all-zero groups; auto-round's symmetric checkpoints give negative ones too, so that
    the code 0 reaches the group's larger-magnitude extreme); every other float tensor finite;
    g_idx within the groups.
    """
    bad = None
    if quantized and key.endswith(_SCALES) and tensor.is_floating_point():
        if not bool((torch.isfinite(tensor) & (tensor != 0)).all()):
            bad = "scales that are not finite and nonzero"
    elif tensor.is_floating_point():
        if not bool(torch.isfinite(tensor).all()):
            bad = "NaN or infinite values"
    elif quantized and key.endswith(".g_idx") and tensor.numel():
        groups = expected[key[: -len("g_idx")] + "scales"].shape[0]
        low, high = torch.aminmax(tensor)
        if int(low) < 0 or int(high) >= groups:
            bad = f"group indices outside [0, {groups})"
    if bad is not None:
        raise CheckpointError(f"{path}: tensor {key} has {bad}; the file is corrupt, re-save or re-download it")


def _checkpoint_keys(
    own: Mapping[str, torch.Tensor], tensor_name: Callable[[str], str], quantized: Mapping[str, str]
) -> dict[str, str]:
    """Model key -> checkpoint key of every tensor in ``own`` (the model's state dict).

    A quantized layer's tensors (qweight, ..., bias) sit under its checkpoint name
    (``quantized``: model name -> checkpoint name); every other tensor is named by
    ``tensor_name``. Two keys given one checkpoint name are refused.
    """
    out: dict[str, str] = {}
    for key in own:
        owner, _, leaf = key.rpartition(".")
        out[key] = f"{quantized[owner]}.{leaf}" if owner in quantized else tensor_name(key)
    if len(set(out.values())) != len(out):
        clash = sorted(k for k in out if list(out.values()).count(out[k]) > 1)
        raise CheckpointError(f"tensors {clash[:4]} would be read from one checkpoint name")
    return out


def _pack_quantized_keys(
    own: Mapping[str, torch.Tensor],
    quantized: Mapping[str, str],
    settings: Mapping[str, LayerSetting],
    index: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """The model's state dict with each quantized layer's buffers replaced by the
    pack-quantized tensors it is read from (meta tensors of the expected shapes; scales and
    bias in the file's float dtype, the model's when written)."""
    out = {k: t for k, t in own.items() if k.rpartition(".")[0] not in quantized}
    for mname, name in quantized.items():
        s = settings[name]
        n_out, n_in = own[f"{mname}.scales"].shape[1], own[f"{mname}.g_idx"].shape[0]
        scale = index.get(f"{name}.weight_scale")
        float_dtype = scale[2] if scale is not None and scale[2].is_floating_point else torch.float16
        scheme = Scheme(s.bits, s.group_size, s.sym, False, 0.0, not s.desc_act)
        layout = packed_layout(
            "compressed-tensors", (n_out, n_in), bias=f"{mname}.bias" in own, scheme=scheme, float_dtype=float_dtype
        )
        for leaf, (shape, dtype) in layout.items():
            out[f"{mname}.{leaf}"] = torch.empty(shape, dtype=dtype, device="meta")
    return out


def _tied_keys(model: nn.Module, expected: Mapping[str, torch.Tensor]) -> set[str]:
    """Keys that are the same Parameter as an earlier key (e.g. lm_head.weight when tied)."""
    seen: set[int] = set()
    tied = set()
    for key, t in expected.items():
        if id(t) in seen:
            tied.add(key)
        seen.add(id(t))
    return tied
