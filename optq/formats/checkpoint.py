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

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optq.core.solver import Solution
from optq.formats import compressed_tensors as checkpoint_ct
from optq.formats.atomic import atomic_folder
from optq.formats.experts import checkpoint_namer, layer_namer, unfuse_experts
from optq.formats.files import write_json, write_safetensors
from optq.formats.gptq_config import CheckpointError, quantized_layers
from optq.formats.layout import CHECKPOINT_FORMATS, Scheme, quantization_config
from optq.formats.loading import load
from optq.formats.probes import record_into
from optq.formats.qlinear import QuantLinear

__all__ = ["save", "load", "CheckpointError", "quantized_layers", "layer_namer"]

log = logging.getLogger("optq.checkpoint")
SAVE_FORMATS = CHECKPOINT_FORMATS
REPORT_FILE = "quantization_report.json"


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
    ``max_shard_size``), tokenizer files and ``quantization_report.json`` when given; with a
    ``tokenizer``, ``optq_probes.json`` too (the outputs of the built-in probe prompts on the exact
    reference path, read back from the written files: :mod:`optq.formats.probes`; other prompts:
    ``probes.write(folder, probes.record(folder, tok, prompts))`` afterwards). Everything
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
        if tokenizer is not None:  # what the written files compute, read back from them
            record_into(tmp, tokenizer=tokenizer)
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
