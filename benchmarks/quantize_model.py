"""End-to-end quantization of SmolLM2-135M (fp32): wall time, time per block, peak RSS, quality.

Protocol (as the peers in shared/baseline.md): 4-bit, group 128, symmetric, damp 0.01, no
act-order; 128 random windows x 512 tokens (seed 0) from the first 2,000,000 characters of the
cleaned enwiki text. Prints a table and writes benchmarks/results/quantize_model.json.

    python benchmarks/quantize_model.py [--nsamples 128] [--seqlen 512] [--determinism]

``--determinism`` quantizes a second, freshly loaded copy and compares the weights byte by byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optq  # noqa: E402

CALIB_CHARS = 2_000_000


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def calibration(tokenizer, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """The peers' windows: random, seeded, from the first 2M characters of enwiki."""
    from optq.corpora import corpus_text
    from optq.data import calibration_tokens, tokenize

    stream = tokenize(corpus_text("enwiki")[:CALIB_CHARS], tokenizer)
    return calibration_tokens(stream, nsamples, seqlen, seed)


def run_once(args: argparse.Namespace) -> dict:
    from optq.zoo import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    calib = calibration(tokenizer, args.nsamples, args.seqlen, args.seed)
    config = optq.QuantConfig(bits=args.bits, group_size=args.group_size, sym=True, damp=0.01)
    t1 = time.perf_counter()
    report = optq.quantize(model, calib, config, propagate=args.propagate, batch_size=args.batch_size,
                           strategy=args.strategy,
                           progress=not args.no_progress)
    quant_s = time.perf_counter() - t1
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    hidden = model.config.hidden_size
    activations = 2 * args.nsamples * args.seqlen * hidden * 4
    t = report.totals
    return {
        "load_s": load_s,
        "quantize_s": quant_s,
        "wall_s": load_s + quant_s,
        "block_s": report.block_seconds,
        "mean_block_s": sum(report.block_seconds) / len(report.block_seconds),
        "peak_rss_mb": peak_rss_mb(),
        "model_mb": params / 2**20,
        "activations_mb": activations / 2**20,
        "mean_objective_ratio": t["mean_objective_ratio"],
        "objective": t["objective"],
        "rtn_objective": t["rtn_objective"],
        "layers_worse_than_rtn": t["layers_worse_than_rtn"],
        "layers": t["layers"],
        "max_damp": t["max_damp"],
        "digest": weights_digest(model),
        "report": report.to_dict(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--strategy", default="pause", choices=("pause", "replay"))
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
        ("peak RSS", f"{first['peak_rss_mb']:.0f} MB"),
        ("fp32 model + activations", f"{first['model_mb']:.0f} MB + {first['activations_mb']:.0f} MB"),
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
