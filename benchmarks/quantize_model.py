"""End-to-end quantization of SmolLM2-135M (fp32): wall time, time per block, peak RSS, quality.

Protocol (calibration as the peers in shared/baseline.md): optq's default settings at 4-bit,
group 128, symmetric, damp 0.01 (act-order with static groups, token-normalised Hessians,
strategy "replay"); 128 random windows x 512 tokens (seed 0) from the first 2,000,000
characters of the cleaned enwiki text. Prints a table and writes
benchmarks/results/quantize_model.json.

    python benchmarks/quantize_model.py [--nsamples 128] [--seqlen 512] [--strategy pause] [--determinism]

Memory: after loading, the model's weights are read once so that they are resident (a lazily
mapped model otherwise pages in during the run); the process's RSS at that point is the
baseline (runtime + model). The peak while quantizing is then compared with the baseline plus
the terms of the formula in optq/pipeline.py, and with the target "model plus calibration
activations" (inputs and outputs, 2 x tokens x hidden x 4 bytes) beyond the runtime.

``--determinism`` quantizes a second, freshly loaded copy and compares the weights byte by byte.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import torch
from common import ROOT, weights_sha256

import optq
from optq.eval.speed import peak_rss_mb, reset_peak, status_mb

CALIB_CHARS = 2_000_000
importlib.import_module("transformers")  # up front: part of the runtime baseline


def rss_mb() -> float | None:
    """Current resident set size (Linux /proc), else None."""
    return status_mb("VmRSS")


def trim_heap() -> None:
    """Return the heap's free pages so the next phase starts from what is alive."""
    import gc

    from optq.core.memory import releaser

    gc.collect()
    releaser("cpu")()


def calibration(tokenizer, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """The peers' windows: random, seeded, from the first 2M characters of enwiki."""
    from optq.data.corpora import corpus_text
    from optq.data.tokens import calibration_tokens, tokenize

    stream = tokenize(corpus_text("enwiki")[:CALIB_CHARS], tokenizer)
    return calibration_tokens(stream, nsamples, seqlen, seed)


def memory_terms(model: torch.nn.Module, report: optq.Report, args: argparse.Namespace) -> dict:
    """The quantizer's terms of the peak-memory formula in optq/pipeline.py, in MB, for this run."""
    cfg = model.config
    h, i = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    tokens = args.nsamples * args.seqlen
    batch_tokens = min(args.batch_size, args.nsamples) * args.seqlen
    act = tokens * h * 4
    groups: dict[tuple[str, int], tuple[int, int]] = {}  # (rows, cols) of each stacked solve
    for name, layer in report.layers.items():
        key = (name.rsplit(".", 2)[0], layer.subset)
        rows, cols = groups.get(key, (0, layer.shape[1]))
        groups[key] = (rows + layer.shape[0], cols)
    largest = max(rows * cols for rows, cols in groups.values())
    widest = max(cols for _, cols in groups.values())
    terms = {
        "activations": act,
        "recorded_outputs": act if args.strategy == "replay" else 0,  # the attention's, replayed
        "original_outputs": act if args.propagate == "original" else 0,
        "batch_temporaries": batch_tokens * (3 * i + 3 * h) * 4,
        "solve": 6 * largest * 4 + widest**2 * 4,
    }
    if args.strategy == "pause":
        terms["paused_forwards"] = tokens * (i + 2 * h) * 4
    return {k: v / 2**20 for k, v in terms.items()}


def run_once(args: argparse.Namespace) -> dict:
    from optq.data.zoo import load_model

    trim_heap()
    runtime_mb = rss_mb()  # python, torch, transformers, optq: before any model or data
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    calib = calibration(tokenizer, args.nsamples, args.seqlen, args.seed)
    config = optq.QuantConfig(bits=args.bits, group_size=args.group_size, sym=True, damp=0.01)
    with torch.no_grad():
        for p in model.parameters():
            p.sum()  # page the whole model in: the baseline is runtime + resident model
    trim_heap()  # the tokenizer's garbage is not the quantizer's
    loaded_mb = rss_mb()
    quantize_peak = reset_peak()
    t1 = time.perf_counter()
    report = optq.quantize(
        model,
        calib,
        config,
        propagate=args.propagate,
        batch_size=args.batch_size,
        strategy=args.strategy,
        progress=not args.no_progress,
    )
    quant_s = time.perf_counter() - t1
    quantize_peak_mb = status_mb("VmHWM") if quantize_peak else None
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = memory_terms(model, report, args)
    t = report.totals
    return {
        "load_s": load_s,
        "quantize_s": quant_s,
        "wall_s": load_s + quant_s,
        "block_s": report.block_seconds,
        "mean_block_s": sum(report.block_seconds) / len(report.block_seconds),
        "peak_rss_mb": peak_rss_mb(),
        "quantize_peak_rss_mb": quantize_peak_mb,
        "runtime_rss_mb": runtime_mb,
        "loaded_rss_mb": loaded_mb,
        "model_mb": params / 2**20,
        "memory_terms_mb": memory,
        "mean_objective_ratio": t["mean_objective_ratio"],
        "objective": t["objective"],
        "rtn_objective": t["rtn_objective"],
        "layers_worse_than_rtn": t["layers_worse_than_rtn"],
        "layers": t["layers"],
        "max_damp": t["max_damp"],
        "digest": weights_sha256(model),
        "report": report.to_dict(),
    }


def memory_rows(run: dict) -> list[tuple[str, str]]:
    """The measured quantization peak against the formula's prediction and the target."""
    terms, loaded, peak = run["memory_terms_mb"], run["loaded_rss_mb"], run["quantize_peak_rss_mb"]
    rows = [
        (
            "  RSS before loading (runtime)",
            f"{run['runtime_rss_mb']:.0f} MB" if run["runtime_rss_mb"] is not None else "n/a",
        )
    ]
    if loaded is None:
        return rows
    predicted = loaded + sum(terms.values())
    target = loaded + 2 * terms["activations"]
    rows += [
        ("  RSS with the model loaded (baseline)", f"{loaded:.0f} MB (model {run['model_mb']:.0f} MB)"),
        ("  formula terms beyond the baseline", ", ".join(f"{k} {v:.0f}" for k, v in terms.items()) + " MB"),
        ("  predicted peak", f"{predicted:.0f} MB"),
    ]
    if peak is not None:
        rows += [
            (
                "  measured peak while quantizing",
                f"{peak:.0f} MB (+{peak - loaded:.0f} MB over the baseline, "
                f"{(peak - loaded) / (predicted - loaded):.2f}x the formula's)",
            ),
            ("  target: baseline + 2 x activations", f"{target:.0f} MB ({'met' if peak <= target else 'NOT met'})"),
        ]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--strategy", default="replay", choices=("pause", "replay"))
    p.add_argument("--propagate", default="quantized", choices=("quantized", "original"))
    p.add_argument("--determinism", action="store_true", help="quantize twice, compare bytes")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantize_model.json"))
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())  # explicit: the run's thread count is recorded
    first = run_once(args)
    second = run_once(args) if args.determinism else None

    rows = [
        ("model", args.model),
        ("calibration", f"{args.nsamples} x {args.seqlen} tokens, seed {args.seed}, enwiki"),
        ("config", f"{args.bits}-bit g{args.group_size} sym, damp 0.01, {args.propagate}, {args.strategy}"),
        ("load time", f"{first['load_s']:.1f} s"),
        ("quantize time", f"{first['quantize_s']:.1f} s"),
        ("wall time (load + quantize)", f"{first['wall_s']:.1f} s"),
        ("time per block (mean / max)", f"{first['mean_block_s']:.2f} s / {max(first['block_s']):.2f} s"),
        ("peak RSS (whole process)", f"{first['peak_rss_mb']:.0f} MB"),
        *memory_rows(first),
        ("mean GPTQ / RTN objective", f"{first['mean_objective_ratio']:.4f}"),
        ("layers worse than RTN", f"{first['layers_worse_than_rtn']} of {first['layers']}"),
        ("largest damping used", f"{first['max_damp']}"),
    ]
    if second is not None:
        rows.append(("byte-identical rerun", str(first["digest"] == second["digest"])))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")

    result = {
        "benchmark": "quantize_model",
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "versions": first["report"]["versions"],
        **{k: v for k, v in first.items() if k != "report"},
        "layers_detail": first["report"]["layers"],
        "deterministic": None if second is None else first["digest"] == second["digest"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
