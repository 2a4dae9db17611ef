"""``target_bits`` on SmolLM2-135M: the allocation against the fixed heuristics at the same size.

Runs ``optq.quantize(..., target_bits=B)`` with the default method (GPTAQ; its proxy is GPTQ on
the float model's Hessians) and keeps every candidate allocation its KL check compared
(knapsacks and heuristics). The chosen one is that run's model. Then each candidate named by
``--quantize`` is quantized with the same method and calibration, every layer at its allocated
bits and group size (``overrides``), and every model's perplexity is measured on held-out
windows of each corpus, beside its proxy KL, stored bits and time. ``--rtn`` also measures every
candidate as a round-to-nearest model (cheap: no quantization run). ``--reuse`` takes the
heuristics' quantized rows from an earlier result of the same model, budget, method, calibration
and evaluation (a heuristic's layout does not depend on the measurements, and runs are
deterministic). Prints a table and writes benchmarks/results/allocation[-<model>-<bits>].json.

    python benchmarks/allocation.py [--model smollm2-135m] [--target-bits 3.5] [--nsamples 32]
        [--seqlen 512] [--windows 8] [--corpora enwiki,debref-de,code]
        [--quantize uniform-3-g64,first-last-4-g64,attention-4-mlp-3-g128,down-4-g128] [--rtn]
        [--target-check K] [--rechecked]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from lab_report_allocation import heuristic  # one rule for what a fixed heuristic's row is

import optq
from optq.core import solver
from optq.data import zoo
from optq.data.tokens import load_text, tokenize
from optq.eval.perplexity import perplexity
from optq.pipeline.allocation import allocate

RESULTS = Path(__file__).resolve().parent / "results"


def rtn_model(model, allocation):
    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    for name, (bits, group) in allocation.items():
        w = mods[name].weight
        cfg = optq.QuantConfig(bits=bits, group_size=group, act_order=False)
        w.data = solver.rtn(w.data.float(), cfg).dequantize().to(w.dtype)
    return q


def out_path(model: str, bits: float) -> Path:
    if model == "smollm2-135m" and bits == 3.5:
        return RESULTS / "allocation.json"
    return RESULTS / f"allocation-{model}-{bits:g}.json"


def _reusable(path: Path, setup: tuple, evals) -> dict:
    """Rows with a quantized model's perplexity of an earlier result made the same way."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if (old.get("method"), old.get("calibration"), old.get("eval")) != setup:
        return {}
    keep = ("quantized", "seconds")
    return {
        k: {f: r[f] for f in keep}
        for k, r in old["rows"].items()
        if "quantized" in r and set(evals) <= set(r["quantized"])
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--target-bits", type=float, default=3.5)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens per corpus")
    ap.add_argument("--corpora", default="enwiki,debref-de,code")
    ap.add_argument(
        "--quantize",
        default="uniform-3-g64,first-last-4-g64,attention-4-mlp-3-g128,down-4-g128",
        help="candidates to quantize too (comma-separated; names as the run's report gives them; "
        "'heuristics': every fixed heuristic the run checked within 0.5 bits per weight of the budget)",
    )
    ap.add_argument(
        "--target-check",
        type=int,
        default=optq.RunSettings().target_check,
        help="the run's target_check (the best candidates by the proxy quantized as the run does)",
    )
    ap.add_argument("--rechecked", action="store_true", help="also quantize every candidate the run rechecked")
    ap.add_argument("--rtn", action="store_true", help="also measure every candidate as a round-to-nearest model")
    ap.add_argument("--reuse", action="store_true", help="reuse the heuristics' rows of the last result (see above)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = zoo.load_model(args.model)
    calib = tokenize(load_text("enwiki", "calib"), tok)
    seen: dict = {}
    real = allocate.divergence

    def keep(run, source, streams, allocations, logits, **kw):
        seen.update(allocations)
        return real(run, source, streams, allocations, logits, **kw)

    allocate.divergence = keep
    kw = dict(nsamples=args.nsamples, seqlen=args.seqlen, progress=False)
    t0 = time.perf_counter()
    chosen_model = copy.deepcopy(model)
    report = optq.quantize(
        chosen_model, calib, optq.QuantConfig(), target_bits=args.target_bits, target_check=args.target_check, **kw
    )
    seconds = time.perf_counter() - t0
    a = report.allocation
    method = (report.to_dict().get("options") or {}).get("method")
    print(f"allocation {a['seconds']:.1f} s of a {seconds:.1f} s run; chosen {a['chosen']}", flush=True)
    check = a.get("check") or {}
    print(f"  {check.get('candidates', 0)} rechecked as the run quantizes in {check.get('seconds', 0):.1f} s")
    for key, row in a["candidates"].items():
        again = f" run {row['run_kl']:.4f}" if "run_kl" in row else ""
        print(f"  {key:32} {row.get('bits_per_weight', float('nan')):7.3f} {row.get('kl', row.get('refused'))}{again}")
    evals = {c: tokenize(load_text(c, "eval"), tok) for c in args.corpora.split(",")}

    def ppl(m) -> dict[str, float]:
        return {c: perplexity(m, evals[c], seqlen=512, windows=args.windows) for c in evals}

    rows = {"float": {"bits_per_weight": 32.0, "kl": 0.0, **ppl(model)}}
    rows[a["chosen"]] = {**a["candidates"][a["chosen"]], "quantized": ppl(chosen_model), "seconds": seconds}
    del chosen_model
    calibration, evaluation = f"{args.nsamples} x {args.seqlen} enwiki", f"{args.windows} x 512 per corpus"
    setup = (method, calibration, evaluation)
    old = _reusable(out_path(args.model, args.target_bits), setup, evals) if args.reuse else {}
    names = [k.strip() for k in args.quantize.split(",") if k.strip()]
    if "heuristics" in names:
        names = [k for k in seen if heuristic(k) and a["candidates"][k]["bits_per_weight"] >= args.target_bits - 0.5]
    if args.rechecked:
        names += [k for k, r in a["candidates"].items() if "run_kl" in r and k not in names]
    for key in [k for k in names if k != a["chosen"]]:
        if key in old and heuristic(key):  # knapsacks and filled heuristics depend on the measurements
            rows[key] = {**a["candidates"][key], **old[key], "reused": True}
            print(f"  {key}: reused {rows[key]['quantized']}", flush=True)
            continue
        if key not in seen:
            print(f"  {key}: not among the candidates ({', '.join(seen)}); skipped")
            continue
        t = time.perf_counter()
        q = copy.deepcopy(model)
        overrides = [(name, {"bits": b, "group_size": g}) for name, (b, g) in seen[key].items()]
        optq.quantize(q, calib, optq.QuantConfig(), overrides=overrides, **kw)
        rows[key] = {**a["candidates"][key], "quantized": ppl(q), "seconds": time.perf_counter() - t}
        print(f"  {key}: {rows[key]['quantized']}", flush=True)
        del q
    if args.rtn:
        for key, allocation in seen.items():
            rows.setdefault(key, dict(a["candidates"][key]))["rtn"] = ppl(rtn_model(model, allocation))
    result = {
        "model": args.model,
        "target_bits": args.target_bits,
        "method": method,
        "proxy": a["proxy"],
        "calibration": calibration,
        "eval": evaluation,
        "allocation_seconds": a["seconds"],
        "run_seconds": seconds,
        "chosen": a["chosen"],
        "check": {k: check.get(k) for k in ("wanted", "candidates", "skipped", "seconds")},
        "block_kl": a["gains"]["block_kl"],
        "chosen_layers": {n: [r["bits"], r["group_size"]] for n, r in a["layers"].items()},
        "rows": rows,
        "refused": {k: v for k, v in a["candidates"].items() if "refused" in v},
    }
    path = out_path(args.model, args.target_bits)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    fp = rows["float"]
    print(f"{'candidate':30} {'bits/w':>7} {'KL':>8} " + " ".join(f"{c:>16}" for c in evals) + f" {'s':>6}")
    for key, row in rows.items():
        got = row.get("quantized", row if key == "float" else {})
        cells = " ".join(f"{got[c]:8.2f} ({got[c] - fp[c]:+6.2f})" if c in got else f"{'-':>16}" for c in evals)
        mark = " *" if key == a["chosen"] else ""
        size, kl, took = row["bits_per_weight"], row.get("kl", 0), row.get("seconds", 0)
        again = f" run KL {row['run_kl']:.4f}" if "run_kl" in row else ""
        print(f"{key + mark:30} {size:7.3f} {kl:8.4f} {cells} {took:6.0f}{again}")


if __name__ == "__main__":
    main()
