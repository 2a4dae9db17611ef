"""``target_bits`` on SmolLM2-135M: the allocation against the fixed heuristics at the same size.

Runs ``optq.quantize(..., method="rtn", target_bits=B)`` once, keeps every candidate allocation
the KL check compared (knapsacks and heuristics), then measures each candidate's perplexity as a
round-to-nearest model (the proxy's own setting; GPTQ runs of every candidate are left to a
longer benchmark) on held-out enwiki (and other corpora), beside its RTN KL and stored bits.
Prints a table and writes benchmarks/results/allocation.json. ``--gptq NAMES`` also quantizes the
named candidates (``chosen`` for the KL's pick) with GPTQ, each layer at its allocated bits and
group size, on the same calibration, and adds their perplexity (``gptq_<corpus>``).

    python benchmarks/allocation.py [--target-bits 3.5] [--nsamples 16] [--seqlen 256] [--windows 8]
        [--gptq chosen,uniform-3-g64,first-last-4-g64,attention-4-mlp-3-g128,down-4-g128]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import optq
from optq.core import solver
from optq.data import zoo
from optq.data.tokens import load_text, tokenize
from optq.eval.perplexity import perplexity
from optq.pipeline.allocation import allocate

OUT = Path(__file__).resolve().parent / "results" / "allocation.json"


def rtn_model(model, allocation):
    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    for name, (bits, group) in allocation.items():
        w = mods[name].weight
        cfg = optq.QuantConfig(bits=bits, group_size=group, act_order=False)
        w.data = solver.rtn(w.data.float(), cfg).dequantize().to(w.dtype)
    return q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-bits", type=float, default=3.5)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens per corpus")
    ap.add_argument("--corpora", default="enwiki")
    ap.add_argument("--gptq", default="", help="candidates to quantize with GPTQ too (comma-separated; 'chosen')")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = zoo.load_model("smollm2-135m")
    calib = tokenize(load_text("enwiki", "calib"), tok)
    seen: dict = {}
    real = allocate.divergence

    def keep(run, source, streams, allocations, logits):
        seen.update(allocations)
        return real(run, source, streams, allocations, logits)

    allocate.divergence = keep
    t0 = time.perf_counter()
    report = optq.quantize(
        copy.deepcopy(model),
        calib,
        optq.QuantConfig(bits=4, group_size=128),
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        method="rtn",
        target_bits=args.target_bits,
        progress=False,
    )
    seconds = time.perf_counter() - t0
    a = report.allocation
    evals = {c: tokenize(load_text(c, "eval"), tok) for c in args.corpora.split(",")}
    ppl = lambda m, c: perplexity(m, evals[c], seqlen=512, windows=args.windows)  # noqa: E731
    rows = {"float": {"bits_per_weight": 32.0, "kl": 0.0, **{c: ppl(model, c) for c in evals}}}
    for key, allocation in seen.items():
        q = rtn_model(model, allocation)
        rows[key] = {**a["candidates"][key], **{c: ppl(q, c) for c in evals}}
        del q
    for key in [k.strip() for k in args.gptq.split(",") if k.strip()]:
        key = a["chosen"] if key == "chosen" else key
        t = time.perf_counter()
        q = copy.deepcopy(model)
        optq.quantize(
            q,
            calib,
            optq.QuantConfig(bits=4, group_size=128),
            nsamples=args.nsamples,
            seqlen=args.seqlen,
            overrides=[(name, {"bits": b, "group_size": g}) for name, (b, g) in seen[key].items()],
            progress=False,
        )
        rows[key].update({f"gptq_{c}": ppl(q, c) for c in evals}, gptq_seconds=time.perf_counter() - t)
        del q
    result = {
        "target_bits": args.target_bits,
        "calibration": f"{args.nsamples} x {args.seqlen} enwiki",
        "eval": f"{args.windows} x 512 per corpus, RTN models",
        "allocation_seconds": a["seconds"],
        "run_seconds": seconds,
        "chosen": a["chosen"],
        "rows": rows,
        "refused": {k: v for k, v in a["candidates"].items() if "refused" in v},
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(f"allocation {a['seconds']:.1f} s of a {seconds:.1f} s RTN run; chosen {a['chosen']}")
    cols = [*evals, *(f"gptq_{c}" for c in evals if args.gptq)]
    print(f"{'candidate':28} {'bits/w':>7} {'KL (rtn)':>9} " + " ".join(f"{c:>12}" for c in cols))
    for key, row in rows.items():
        mark = " *" if key == a["chosen"] else ""
        values = " ".join(f"{row[c]:12.3f}" if c in row else f"{'-':>12}" for c in cols)
        print(f"{key + mark:28} {row['bits_per_weight']:7.3f} {row['kl']:9.5f} {values}")


if __name__ == "__main__":
    main()
