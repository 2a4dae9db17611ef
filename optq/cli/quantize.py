"""``optq quantize MODEL -o OUT``: quantize a model end to end and write it with its report.

Every model (a folder, a built-in name, a .gguf file converted once, a hub id's snapshot) is
streamed: one decoder block in memory at a time, written as it finishes into ``OUT.partial/``
(``--resume`` continues a killed run there), renamed to OUT when complete.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from . import CliError, check_text_source
from ._inputs import _calibration_tokens, _hf_config, _model_folder, check_output
from ._leftover import raise_with_leftover
from .methods import add_method_flags, add_serving_flags
from .summary import summary

__all__ = ["register", "run", "config_from_args", "settings_from_args"]

DEFAULT_CALIB = "enwiki"
BITS = (2, 3, 4, 8)  # the code widths the checkpoint formats pack


def register(subparsers: Any) -> None:
    """Add the ``quantize`` subcommand."""
    from optq.core.config import QuantConfig
    from optq.formats.engines import ENGINES

    p = subparsers.add_parser(
        "quantize",
        help="quantize a causal LM with GPTQ and write it with its report",
        description="Quantize the linear layers of a causal LM's decoder blocks with GPTQ, one "
        "block at a time, and write the quantized model and its quantization_report.json to OUT. "
        "Blocks are read from the model's safetensors files one at a time and written as they "
        "finish into OUT.partial/, which --resume continues after a crash.",
    )
    p.add_argument("model", metavar="MODEL", help="hub id, local folder, .gguf file or built-in name")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output folder")
    g = p.add_argument_group("quantization (one flag per QuantConfig field)")
    g.add_argument("--bits", type=int, choices=BITS, default=4, help="code width (default 4)")
    g.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="input channels per scale/zero; -1 = per output channel (default 128)",
    )
    sym = g.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True, help="symmetric grid (default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric grid")
    g.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="quantize columns by descending H diagonal (default on)",
    )
    g.add_argument(
        "--static-groups",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --act-order, fit group grids up front so g_idx stays k // group size (default: on with --act-order)",
    )
    g.add_argument(
        "--normalize-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every calibration token at unit RMS in the Hessian (default on)",
    )
    g.add_argument("--damp", type=float, default=0.01, help="damping, fraction of mean diag(H)")
    g.add_argument(
        "--diag-shrink",
        type=float,
        default=QuantConfig().diag_shrink,
        metavar="S",
        help=f"shrink H toward its diagonal, (1-S)H + S diag(H) (default {QuantConfig().diag_shrink:g}): 0 plain "
        "GPTQ, 1 round-to-nearest; guards against calibration text unlike the served text (docs/lab.md, section 8)",
    )
    g.add_argument(
        "--damp-max", type=float, default=1.0, help="largest damping tried when H cannot be factorised (default 1.0)"
    )
    g.add_argument("--block-size", type=int, default=128, help="GPTQ lazy-update block width")
    g.add_argument(
        "--mse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit each group's range by searching shrunken ranges for the least rounding error (default on; "
        "--no-mse: plain min/max)",
    )
    g.add_argument("--mse-grid", type=int, default=100, help="shrink steps of the --mse search")
    g.add_argument("--mse-maxshrink", type=float, default=0.8, help="largest range cut by --mse")
    g.add_argument("--mse-norm", type=float, default=2.0, help="error exponent of --mse")
    g.add_argument(
        "--mse-hessian",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="weight each column's rounding error in the --mse search by the Hessian's diagonal (its mean squared "
        "activation; llm-compressor's imatrix_mse) (default: on with --mse; --no-mse-hessian: the plain search); "
        "--method rtn reads no Hessian: by default its ranges stay min/max",
    )
    c = p.add_argument_group("calibration and run")
    c.add_argument(
        "--calib",
        default=DEFAULT_CALIB,
        metavar="NAME|FILE",
        help=f"built-in corpus name, .txt or .jsonl file, or several joined by commas "
        f"(e.g. enwiki,debref-de,code: equal shares of --nsamples) (default {DEFAULT_CALIB})",
    )
    c.add_argument("--nsamples", type=int, default=128, help="calibration windows (default 128)")
    c.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    c.add_argument("--seed", type=int, default=0, help="seed of the window draw (default 0)")
    c.add_argument(
        "--propagate",
        choices=("quantized", "original"),
        default="quantized",
        help="next block's inputs from the quantized (default) or original model",
    )
    add_method_flags(c)
    c.add_argument(
        "--strategy",
        choices=("pause", "replay"),
        default="replay",
        help="replay: re-run the block per group, least memory (default); "
        "pause: pause every batch's forward per group, ~13%% less time, several x the memory",
    )
    c.add_argument("--device", default="cpu", help="compute device, e.g. cpu or cuda (default cpu)")
    c.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="dtype of the block forwards (default: float32 on CPU, the model's on CUDA)",
    )
    c.add_argument("--batch-size", type=int, default=8, help="windows per block forward (default 8)")
    c.add_argument(
        "--include",
        action="append",
        metavar="PATTERN",
        help="quantize only matching linears (wildcards or re:REGEX; repeatable)",
    )
    c.add_argument("--exclude", action="append", metavar="PATTERN", help="skip matching linears")
    c.add_argument(
        "--override",
        dest="overrides",
        action="append",
        type=_override,
        metavar="PATTERN:FIELD=VALUE[,...]",
        help="per-layer settings, e.g. '*.down_proj:bits=8' (repeatable; the first matching pattern decides)",
    )
    add_serving_flags(p.add_argument_group("serving (every layer checked before any work)"), ENGINES)
    m = p.add_argument_group("mixture of experts (see docs/moe.md)")
    m.add_argument(
        "--moe-calibration",
        choices=("routed", "all"),
        default="all",
        help="each expert's Hessian from every calibration token (default; the block's "
        "output keeps the true routing), or from the tokens routed to it",
    )
    m.add_argument(
        "--moe-min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with routed: an expert routed fewer tokens is starved and takes the all-token "
        "Hessian (default: the layer's input width)",
    )
    m.add_argument(
        "--moe-weighting", choices=("none", "routing"), default="none", help="tokens weighed by squared routing weight"
    )
    m.add_argument(
        "--max-hessian-memory",
        default=None,
        metavar="SIZE",
        help="memory for one stage of experts' Hessians and for --target-bits' streams, e.g. 8GB; more are "
        "collected in chunks, one pass each, to the same weights (default: a quarter of RAM)",
    )
    c.add_argument(
        "--hessian-dtype",
        choices=("float32", "float64"),
        default="float32",
        help="float64 sums Hessians exactly enough that batch order and size do not change "
        "the weights (slower Hessian products)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--format",
        choices=("gptq", "gptq_v2", "compressed-tensors"),
        default="gptq",
        help="gptq (v1, what most loaders read; default), gptq_v2, or compressed-tensors "
        "(pack-quantized, as llm-compressor writes and vLLM reads)",
    )
    o.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest output file, e.g. 2GB (default 5GB; one shard is held in memory while it is written)",
    )
    c.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep the calibration activations in a memory-mapped file in OUT.partial/ "
        "instead of RAM (for nsamples x seqlen x hidden larger than memory; CPU only)",
    )
    o.add_argument("--probe-prompts", type=Path, metavar="FILE", help="probe prompts, one a line (docs/verify.md)")
    o.add_argument("--resume", action="store_true", help="continue the interrupted run in OUT.partial/ (same flags)")
    o.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it exists, and start an unfinished OUT.partial/ again"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--dry-run", action="store_true", help="print the plan (linears, peak RAM by term, disk, time) and stop"
    )
    p.set_defaults(func=run)


def _override(text: str) -> Any:
    from optq.pipeline.schemes import parse_override_text

    try:
        return parse_override_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fields_from_args(cls: Any, args: argparse.Namespace) -> Any:
    # Each flag's dest is the field's name (one flag per field): the object is built from exactly
    # its fields, so a new field without a flag fails here, in every test that parses a command.
    import dataclasses

    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def config_from_args(args: argparse.Namespace) -> Any:
    """The QuantConfig the flags describe (a user error becomes a CliError)."""
    from optq.core.config import QuantConfig

    if args.mse_hessian:  # asked for by name (the default, None, follows --mse)
        from optq.pipeline import methods

        method = getattr(args, "method", None)
        if method in methods.names() and not methods.get(method).reads_hessian:
            raise CliError(
                f"--mse-hessian weights the --mse search by the Hessian, which --method {method} never reads: drop "
                "it (its ranges are then min/max; --no-mse-hessian searches them unweighted), or choose a method that "
                "reads one (gptq, gptaq)"
            )
    try:
        return _fields_from_args(QuantConfig, args)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def settings_from_args(args: argparse.Namespace) -> Any:
    """The RunSettings the flags describe, one flag per field (a user error becomes a CliError)."""
    from optq.pipeline.settings import RunSettings

    try:
        return _fields_from_args(RunSettings, args)
    except ValueError as exc:
        field = str(exc).split("=")[0]
        raise CliError(f"--{field.replace('_', '-')}: {exc}" if "=" in str(exc) else str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit code."""
    out = Path(args.output)
    config = config_from_args(args)
    if not args.dry_run:
        check_output(out, args.overwrite)
    from optq.data.tokens import split_sources
    from optq.formats.probes import read_prompts

    for source in split_sources(args.calib):
        check_text_source(source)
    probes = True if args.probe_prompts is None else read_prompts(args.probe_prompts)  # a bad file: exit 2

    import torch

    from optq.core.memory import fix_mmap_threshold
    from optq.pipeline.blocks.calibration import check_seqlen, max_positions
    from optq.pipeline.distributed.ranks import init_from_env
    from optq.pipeline.stream.quantize import quantize_pretrained
    from optq.pipeline.stream.records import check_resume

    t0 = time.perf_counter()
    if args.dry_run:
        settings = settings_from_args(args)
        folder = _model_folder(args.model)
        _check_seqlen(args, _hf_config(folder), check_seqlen, max_positions)
        return _dry_run(folder, config, settings)
    # Under torchrun (WORLD_SIZE > 1): one process group, gloo on CPU, NCCL and cuda:LOCAL_RANK on GPUs.
    dist, args.device = init_from_env(args.device)
    settings = settings_from_args(args)
    folder = _model_folder(args.model)
    provenance = {"model": args.model, "calib": args.calib}
    check_resume(out, config, settings, provenance, resume=args.resume, overwrite=args.overwrite)  # before tokenising
    _check_seqlen(args, _hf_config(folder), check_seqlen, max_positions)
    tokens = _calibration_tokens(args.calib, folder, args)
    if torch.device(args.device).type == "cpu":  # the CLI owns the process: fixed from the start
        fix_mmap_threshold()
    load_s = time.perf_counter() - t0
    try:
        report = quantize_pretrained(
            folder,
            out,
            tokens,
            config,
            settings=settings,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            provenance=provenance,
            probes=probes,
        )
    except Exception as exc:
        raise_with_leftover(exc, out)  # when OUT.partial/ stays, the error says so
        raise
    if dist.rank != 0:  # rank 0 speaks for the run
        return 0
    print(summary(report))
    print(f"wrote {out} ({time.perf_counter() - t0:.1f} s in all, {load_s:.1f} s preparing)")
    return 0


def _check_seqlen(args: argparse.Namespace, hf_config: Any, check: Any, positions: Any) -> None:
    try:  # before the calibration text is read and tokenized
        check(args.seqlen, positions(hf_config))
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _dry_run(folder: Path, config: Any, settings: Any) -> int:
    from optq.pipeline.planning import plan

    try:
        the_plan = plan(folder, config, settings)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(the_plan.format())
    return 0
