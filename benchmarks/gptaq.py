"""GPTAQ against GPTQ on SmolLM2-135M: perplexity on four corpora at 4 and 3 bits, time and memory.

Every variant quantizes a fresh copy of the float model, calibrated on the same ``--nsamples`` x
``--seqlen`` enwiki windows (seed 0), and is evaluated on the same ``--windows`` held-out windows
of 512 tokens (BOS first) of enwiki, debref-de, code and debref-ja. For each corpus the table
gives the perplexity and the ratio (method - fp) / (RTN - fp): below 1 the method beats
round-to-nearest, 0 would be the float model. Variants: rtn, gptq, gptaq (the authors' α = 0.25),
gptaq at α = 1 (the paper's closed form), and gptaq α = 1 from the least-squares optimum ("full",
not the paper's). Wall time, CPU time (this process's, all threads: less disturbed by other load
than wall time) and the quantization's peak RSS (the kernel's high-water mark, reset before each
run; above the RSS at its start) come from the same process, one run after another: on a shared
machine compare them as ratios.

Results go to benchmarks/results/gptaq.json; runs already there are not repeated (delete the
file to start over).

    nice -n 19 python benchmarks/gptaq.py [--bits 4,3] [--nsamples 32] [--seqlen 512] [--windows 8]
    python benchmarks/gptaq.py --timing 2     # on a quiet machine: gptq and gptaq at 4 bits in
                                              # turn, twice, quantization only (no evaluation)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from typing import Any

import torch
from common import ROOT

import optq
from optq.core.memory import release_host_memory
from optq.eval.speed import reset_peak, status_mb

RESULTS = ROOT / "benchmarks" / "results" / "gptaq.json"
MODEL = "smollm2-135m"
CORPORA = ["enwiki", "debref-de", "code", "debref-ja"]
# name -> RunSettings options (method and GPTAQ's settings)
VARIANTS = {
    "rtn": {"method": "rtn"},
    "gptq": {"method": "gptq"},
    "gptaq": {"method": "gptaq"},
    "gptaq+alpha1": {"method": "gptaq", "gptaq_alpha": 1.0},
    "gptaq+alpha1+full": {"method": "gptaq", "gptaq_alpha": 1.0, "gptaq_form": "full"},
}


def _reset_peak() -> None:
    release_host_memory()  # collects garbage, trims the heap
    reset_peak()  # the high-water mark restarts at the current RSS


def quantize(model: torch.nn.Module, variant: str, bits: int, calib: torch.Tensor) -> tuple[Any, dict[str, Any]]:
    """A quantized copy of ``model`` and the run's cost."""
    from optq.eval.compare import round_to_nearest

    config = optq.QuantConfig(bits=bits, group_size=128)
    q = copy.deepcopy(model)
    _reset_peak()
    before = status_mb("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    if variant == "rtn":
        round_to_nearest(q, config)
        totals: dict[str, Any] = {}
    else:
        report = optq.quantize(q, calib, config, progress=False, **VARIANTS[variant])
        totals = report.totals
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = status_mb("VmHWM")
    cost = {"quantize_s": seconds, "quantize_cpu_s": cpu, "rss_before_mb": before, "peak_rss_mb": peak}
    cost["peak_over_start_mb"] = None if peak is None or before is None else peak - before
    cost["mean_objective_ratio"] = totals.get("mean_objective_ratio")
    return q, cost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", default="4,3")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timing", type=int, default=0, help="rounds of gptq and gptaq in turn, timed only")
    args = ap.parse_args()

    from optq.data import corpora, tokens, zoo
    from optq.eval.perplexity import perplexity

    for name in CORPORA:
        corpora.fetch_corpus(name)
    model, tok = zoo.load_model(MODEL)
    bos = zoo.eval_bos_id(MODEL, tok, model.config)
    evaluation = {
        c: tokens.eval_windows(tokens.load_tokens(c, tok, "eval"), 512, args.windows, bos_id=bos) for c in CORPORA
    }
    calib = tokens.calibration_windows("enwiki", tok, args.nsamples, args.seqlen, 0)
    settings = {"model": MODEL, "calib": "enwiki", "nsamples": args.nsamples, "seqlen": args.seqlen,
                "windows": args.windows, "eval_seqlen": 512, "group_size": 128, "corpora": CORPORA}  # fmt: skip
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if data.get("settings", settings) != settings:
        raise SystemExit(f"{RESULTS} was made with {data['settings']}; delete it or use those settings")
    data["settings"] = settings
    data["machine"] = {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    runs = data.setdefault("runs", {})

    def ppl(m: torch.nn.Module) -> dict[str, float]:
        return {c: perplexity(m, w, seqlen=512, progress=False) for c, w in evaluation.items()}

    def save() -> None:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")

    if args.timing:
        rounds = data.setdefault("timing", [])
        for _ in range(args.timing):
            for variant in ("gptq", "gptaq"):
                q, cost = quantize(model, variant, 4, calib)
                del q
                rounds.append({"variant": variant, "bits": 4, "load_average": os.getloadavg()[0], **cost})
                save()
                print(f"  {json.dumps(rounds[-1])}", flush=True)
        return 0
    if "fp" not in runs:
        runs["fp"] = {"perplexity": ppl(model)}
        save()
    # Variant by variant (both widths of one before the next): the comparisons that matter most
    # are done first if a run is cut short.
    for variant in args.variants.split(","):
        for bits in [int(b) for b in args.bits.split(",")]:
            key = f"{variant}|{bits}"
            if key in runs:
                continue
            print(f"run {key}", flush=True)
            q, cost = quantize(model, variant, bits, calib)
            runs[key] = {"variant": variant, "bits": bits, **VARIANTS[variant], **cost, "perplexity": ppl(q)}
            del q
            save()
            print(f"  {json.dumps(runs[key])}", flush=True)
    print(table(data))
    return 0


def table(data: dict[str, Any]) -> str:
    """The perplexity table (with (method - fp) / (RTN - fp) per corpus), time and memory."""
    runs, fp = data["runs"], data["runs"]["fp"]["perplexity"]
    lines = [
        f"SmolLM2-135M, group 128, calibrated on enwiki {data['settings']['nsamples']} x "
        f"{data['settings']['seqlen']}, {data['settings']['windows']} x 512-token windows per corpus",
        f"{'variant':<20} {'bits':>4} "
        + " ".join(f"{c:>17}" for c in CORPORA)
        + f" {'wall s':>7} {'cpu s':>7} {'MB':>5}",
        f"{'fp':<20} {'':>4} " + " ".join(f"{fp[c]:>17.3f}" for c in CORPORA),
    ]
    for bits in sorted({r["bits"] for k, r in runs.items() if k != "fp"}, reverse=True):
        rtn = runs.get(f"rtn|{bits}")
        for key, r in runs.items():
            if key == "fp" or r["bits"] != bits:
                continue
            cells = []
            for c in CORPORA:
                p = r["perplexity"][c]
                ratio = (p - fp[c]) / (rtn["perplexity"][c] - fp[c]) if rtn else float("nan")
                cells.append(f"{p:>9.3f} ({ratio:5.3f})")
            peak, cpu = r.get("peak_over_start_mb"), r.get("quantize_cpu_s")
            lines.append(
                f"{r['variant']:<20} {bits:>4} " + " ".join(cells) + f" {r['quantize_s']:>7.0f} "
                f"{'n/a' if cpu is None else f'{cpu:.0f}':>7} {'n/a' if peak is None else f'{peak:.0f}':>5}"
            )
    lines.append("(ratio) = (method - fp) / (RTN - fp); MB: the quantization's peak RSS above its start")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
