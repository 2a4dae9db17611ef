"""Save and load quantized models in the GPTQ checkpoint format (shared/spec/gptq-checkpoint.md)
and compressed-tensors "pack-quantized". Safetensors only; nothing is ever unpickled.

Where the quantized layers come from, either:

- ``save(model, folder, solutions=report.solutions)``: a model whose linears hold the
  dequantized weights (as the pipeline leaves them) plus ``{module name: Solution}``; or
- ``optq.formats.qlinear.replace_linears(model, solutions)`` first, then ``save(model, folder)``: every
  :class:`~optq.formats.qlinear.QuantLinear` in the model is written.

Tensors are written under the names the model's original checkpoint uses
(:func:`optq.formats.experts.checkpoint_namer`): a mixture-of-experts model's routed experts one
2-D matrix per expert, as Mixtral's ``block_sparse_moe.experts.3.w1``, each packed like any
linear (docs/moe-checkpoints.md); :func:`load` reads those names back.

Example::

    >>> optq.save(model, "out/llama-4bit", solutions=report.solutions, tokenizer=tok)  # doctest: +SKIP
    >>> model = optq.load("out/llama-4bit")                                            # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optq.core.solver import Solution
from optq.formats import compressed_tensors as checkpoint_ct
from optq.formats.atomic import atomic_folder
from optq.formats.compact import EMBEDDINGS, compact_embeddings
from optq.formats.experts import checkpoint_namer, unfuse_experts
from optq.formats.files import read_index, read_tensors, write_json, write_safetensors
from optq.formats.fused import build_fast_paths
from optq.formats.gptq_config import CheckpointError, check_gptq_config, quantized_layers
from optq.formats.layout import CHECKPOINT_FORMATS, Scheme, packed_layout, quantization_config
from optq.formats.qlinear import QuantLinear
from optq.formats.schemes import LayerSetting, layer_schemes

__all__ = ["save", "load", "CheckpointError", "quantized_layers", "layer_namer"]

log = logging.getLogger("optq.checkpoint")
SAVE_FORMATS = CHECKPOINT_FORMATS
REPORT_FILE = "quantization_report.json"


def layer_namer(names: Callable[[str], str]) -> Callable[[str], str]:
    """Module names from a tensor namer (:func:`checkpoint_namer`'s): a module ``m`` is named as
    its weight ``m.weight`` is, so that the packed tensors ``m.qweight``... sit where it did."""

    def name(module: str) -> str:
        full = names(f"{module}.weight")
        return full[: -len(".weight")] if full.endswith(".weight") else names(module)

    return name


def _state_dict(
    model: nn.Module, layers: Mapping[str, Mapping[str, torch.Tensor]], names: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """Model tensors with quantized layers replaced, under checkpoint names (``names``); tied
    duplicates (lm_head) dropped."""
    prefixes = tuple(f"{n}." for n in layers)
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # checkpoint name -> model name, to catch two tensors given one name

    def put(key: str, model_key: str, t: torch.Tensor) -> None:
        if key in out:
            raise CheckpointError(f"{source[key]} and {model_key} would both be written as {key}")
        source[key] = model_key
        out[key] = t.detach().contiguous()

    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for key, t in model.state_dict().items():
        if key.startswith(prefixes):
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident in seen:
            continue  # tied to an earlier tensor (lm_head <- embed_tokens); loaders re-tie
        seen[ident] = key
        put(names(key), key, t)
    module_name = layer_namer(names)
    for name, tensors in layers.items():
        for k, t in tensors.items():
            put(f"{module_name(name)}.{k}", f"{name}.{k}", t)
    # safetensors refuses tensors sharing memory: copy the (rare) views of one storage.
    storages: set[int] = set()
    for key, t in out.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            out[key] = t.clone()
        storages.add(ptr)
    return dict(sorted(out.items()))


def save(
    model: nn.Module,
    folder: str | Path,
    *,
    solutions: Mapping[str, Solution] | None = None,
    format: str = "gptq",
    tokenizer: Any = None,
    report: Any = None,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
) -> Path:
    """Write a quantized Hugging Face model as a loadable checkpoint folder; returns its path.

    ``format``: "gptq" (v1, zero points stored minus one; what most loaders expect),
    "gptq_v2" (zero points as is; needed for asymmetric zero points of 0) or
    "compressed-tensors" (pack-quantized). Writes ``config.json`` with ``quantization_config``,
    ``quantize_config.json`` (GPTQ formats), safetensors (sharded with an index above
    ``max_shard_size``), tokenizer files and ``quantization_report.json`` when given. Everything
    is written to a temporary folder beside ``folder`` and renamed at the end.

    Tensor names, and the module names in ``quantization_config`` (compressed-tensors'
    ``ignore``), are those of the model's original checkpoint. Fused experts (transformers 5's
    3-D ``experts.gate_up_proj``) are first split into one linear per expert, in ``model``
    itself (:func:`~optq.formats.experts.unfuse_experts`; the same function, now per expert);
    those that cannot be split are written as they are, in float.
    """
    if format not in SAVE_FORMATS:
        raise CheckpointError(f"format={format!r} is unknown; choose one of {SAVE_FORMATS}")
    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} already exists; pass overwrite=True or choose another folder")
    unfuse_experts(model)
    names = checkpoint_namer(model)
    layers = quantized_layers(model, solutions, format)
    module_name = layer_namer(names)
    scheme = Scheme.of_layers({module_name(n): q for n, q in layers.items()})  # settings by checkpoint name
    if format == "compressed-tensors":
        qconfig = quantization_config(scheme, format, checkpoint_ct.ignored(model, layers, module_name))
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        tensors = {
            n: checkpoint_ct.export_layer(n, q, sym=scheme.for_layer(module_name(n)).sym, dtype=dtype)
            for n, q in layers.items()
        }
    else:
        qconfig = quantization_config(scheme, format)
        tensors = {n: q.state_dict() for n, q in layers.items()}
    state = _state_dict(model, tensors, names)
    config = model.config.to_dict()
    if not config.get("architectures"):  # as save_pretrained does; loaders pick the class from it
        config["architectures"] = [type(model).__name__]
    config.pop("quantization_config", None)
    config["quantization_config"] = qconfig
    with atomic_folder(folder, overwrite) as tmp:
        write_safetensors(tmp, state, max_shard_size)
        write_json(tmp / "config.json", config)
        if format != "compressed-tensors":
            write_json(tmp / "quantize_config.json", qconfig)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if report is not None:
            write_json(tmp / REPORT_FILE, report if isinstance(report, dict) else report.to_dict())
    log.info("saved %d quantized layers (%s) to %s", len(layers), format, folder)
    _warn_refused(layers, scheme, module_name, format, folder)
    return folder


def _warn_refused(
    layers: Mapping[str, QuantLinear], scheme: Scheme, name: Callable[[str], str], fmt: str, folder: Path
) -> None:
    """One warning per engine of ``optq.formats.engines`` that refuses some saved layer (the
    pipeline checks ``serve`` before work; a checkpoint saved from elsewhere is told here), each
    layer as ``scheme`` writes it (under its checkpoint name, ``name``)."""
    from optq.formats.engines import ENGINES, LayerShape, check_engines

    shapes = {}
    for n, q in layers.items():
        s = scheme.for_layer(name(n))
        shapes[n] = LayerShape(q.in_features, q.out_features, s.bits, s.group_size, s.sym, not s.natural)
    for engine, verdicts in check_engines(shapes, ENGINES, fmt).items():
        refused = [(n, v) for n, v in verdicts.items() if v.refused]
        if refused:
            n, v = refused[0]
            log.warning(
                "%s: %s refuses %d of %d layers, e.g. %s (%s); `optq inspect %s` lists them",
                folder,
                engine,
                len(refused),
                len(verdicts),
                n,
                "; ".join(f"{k}: {why}" for k, why in v.refusals[-1:]),
                folder,
            )


def load(
    folder: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    embeddings: str = "bfloat16",
) -> nn.Module:
    """Load a checkpoint written by :func:`save` (or any GPTQ / pack-quantized one) as a model.

    The architecture is built from ``config.json`` with transformers, its parameters on the meta
    device (no fp32 weights are materialised for quantized layers); layers with a ``qweight``
    (or ``weight_packed``) tensor become :class:`~optq.formats.qlinear.QuantLinear`. Every tensor is checked
    against the expected shape and dtype; missing, unexpected or mismatched tensors raise
    :class:`CheckpointError`. Other weights are cast to ``dtype``. ``embeddings`` stores the token
    embedding and a float head as ``"bfloat16"`` (default), ``"int8"`` or ``"model"`` (``dtype``;
    with ``use_fast_path = False`` on every QuantLinear, the exact model): see optq.formats.compact.

    Tensors are looked up under the original checkpoint's names (what :func:`save` writes):
    a mixture-of-experts model's fused experts become
    :class:`~optq.formats.experts.ExpertLinears` whose per-expert linears are read from
    ``...experts.{e}.w1.qweight`` (or ``.gate_proj``...) as QuantLinear.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from optq.formats.linears import get_weight, is_linear

    if embeddings not in EMBEDDINGS:
        raise ValueError(f"embeddings={embeddings!r}: choose one of {EMBEDDINGS}")
    config_path = (folder := Path(folder)) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} has no config.json; is it a saved checkpoint folder?")
    config = json.loads(config_path.read_text())
    qc = config.pop("quantization_config", None)
    if qc is None and (folder / "quantize_config.json").exists():
        qc = json.loads((folder / "quantize_config.json").read_text())
    if qc is None:
        raise CheckpointError(f"{config_path} has no quantization_config; load it with transformers")
    method = qc.get("quant_method", "gptq")
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

    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
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

    state = {}
    for key, tensor in read_tensors(folder, index, [k for k in index if k not in tied]):
        _check_values(folder / index[key][0], key, tensor, key.startswith(quant_prefixes), expected)
        want = expected[key]
        state[model_key[key]] = tensor.to(want.dtype, copy=True)  # own memory: no view keeps the file mapped
    if method == "compressed-tensors":
        for mname, name in quantized.items():
            packed = {k[len(mname) + 1 :]: state.pop(k) for k in list(state) if k.startswith(f"{mname}.")}
            layer = checkpoint_ct.import_layer(packed, settings[name], name=name)
            state.update({f"{mname}.{k}": t for k, t in layer.items()})
    model.load_state_dict(state, strict=False, assign=True)
    del state  # else a float32 table replaced below would outlive build_fast_paths' heap trim
    if getattr(hf_config, "tie_word_embeddings", False) and not isinstance(model.get_output_embeddings(), QuantLinear):
        model.tie_weights()
    left = [keys.get(n, n) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{folder}: tensors {left[:8]} were never loaded")
    model.config.quantization_config = qc
    model = compact_embeddings(model, embeddings).to(device).eval()
    build_fast_paths(model)  # on CPU: the kernels' packed codes now; then the load's garbage goes
    return model


_SCALES = (".scales", ".weight_scale")


def _check_values(
    path: Path, key: str, tensor: torch.Tensor, quantized: bool, expected: Mapping[str, torch.Tensor]
) -> None:
    """Catch corrupt data before it turns into NaN logits: one reduction per tensor.

    Scales of quantized layers must be finite and > 0 (the grids always give a positive scale,
    also for all-zero groups); every other float tensor finite; g_idx within the groups.
    """
    bad = None
    if quantized and key.endswith(_SCALES) and tensor.is_floating_point():
        if not bool(((tensor > 0) & (tensor < float("inf"))).all()):
            bad = "scales that are not finite and positive"
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
