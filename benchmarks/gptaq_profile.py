"""Where GPTAQ's time goes, against GPTQ's: both quantize the first ``--blocks`` decoder blocks of
SmolLM2-135M (the rest cut off) on the same ``--nsamples`` x ``--seqlen`` enwiki windows, each
under cProfile, one after the other in this process. Prints each method's wall and CPU time and
the functions with the most own time (``--top``), side by side; writes
benchmarks/results/gptaq_profile.json. Compare the two as ratios: the machine is noisy.

    python benchmarks/gptaq_profile.py [--blocks 4] [--nsamples 32] [--seqlen 512] [--top 25]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import time

import torch
from common import ROOT

import optq

RESULTS = ROOT / "benchmarks" / "results" / "gptaq_profile.json"


def _label(key: tuple[str, int, str]) -> str:
    file, line, name = key
    if file == "~":
        return name  # a built-in (torch's C functions among them)
    parts = file.split("/")
    short = "/".join(parts[parts.index("optq") :]) if "optq" in parts else "/".join(parts[-2:])
    return f"{short}:{line}({name})"


def profile(model: torch.nn.Module, method: str, calib: torch.Tensor) -> tuple[dict, dict[str, float]]:
    work = copy.deepcopy(model)
    prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), os.times()
    prof.enable()
    optq.quantize(
        work, calib, optq.QuantConfig(bits=4, group_size=64), settings=optq.RunSettings(method=method), progress=False
    )
    prof.disable()
    c1 = os.times()
    cost = {"wall_s": time.perf_counter() - t0, "user_s": c1.user - c0.user, "system_s": c1.system - c0.system}
    cost["cpu_s"] = cost["user_s"] + cost["system_s"]
    stats = pstats.Stats(prof).stats  # key -> (calls, primitive calls, own time, cumulative, callers)
    own = {_label(k): v[2] for k, v in stats.items()}
    return cost, own


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()  # recorded in the results
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optq.data.tokens import calibration_windows
    from optq.data.zoo import resolve_model

    folder = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.model.layers = model.model.layers[: args.blocks]
    model.config.num_hidden_layers = args.blocks
    calib = calibration_windows("enwiki", AutoTokenizer.from_pretrained(folder), args.nsamples, args.seqlen)
    runs = {m: profile(model, m, calib) for m in ("gptq", "gptaq")}
    (gq_cost, gq), (ga_cost, ga) = runs["gptq"], runs["gptaq"]
    print(f"{args.blocks} blocks, {args.nsamples} x {args.seqlen} tokens")
    for m, (cost, _) in runs.items():
        print(f"{m:6s} wall {cost['wall_s']:7.1f} s  cpu {cost['cpu_s']:7.1f} s (system {cost['system_s']:.1f} s)")
    print(
        f"gptaq / gptq: wall {ga_cost['wall_s'] / gq_cost['wall_s']:.2f}x, "
        f"cpu {ga_cost['cpu_s'] / gq_cost['cpu_s']:.2f}x"
    )
    names = sorted(set(gq) | set(ga), key=lambda n: -max(gq.get(n, 0.0), ga.get(n, 0.0)))[: args.top]
    print(f"\n{'own time (s)':70s} {'gptq':>8s} {'gptaq':>8s}")
    for n in names:
        print(f"{n[:70]:70s} {gq.get(n, 0.0):8.2f} {ga.get(n, 0.0):8.2f}")
    RESULTS.write_text(
        json.dumps(
            {
                "settings": vars(args),
                "cost": {"gptq": gq_cost, "gptaq": ga_cost},
                "top": {n: {"gptq": gq.get(n, 0.0), "gptaq": ga.get(n, 0.0)} for n in names},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
