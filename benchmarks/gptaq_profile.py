"""Where GPTAQ's time goes, against GPTQ's: both quantize the first ``--blocks`` decoder blocks of
SmolLM2-135M (the rest cut off) on the same ``--nsamples`` x ``--seqlen`` enwiki windows, each
under cProfile, one after the other in this process. Prints each method's wall and CPU time and
the functions with the most own time (``--top``), side by side; writes
benchmarks/results/gptaq_profile.json. Compare the two as ratios: the machine is noisy.

``--flops`` runs each method once more under torch's ``FlopCounterMode`` and prints the
floating-point operations of its matrix products (linears, attention, the Hessian sums, the
solver's), by operator: the arithmetic each method asks for, which no machine changes, beside the
time it took. Where the products take all of the time and run at one speed, the time ratio is
their ratio; work that is not a product (the range search, the sweep's column steps) lowers it
where GPTQ has as much of it as GPTAQ.

    python benchmarks/gptaq_profile.py [--blocks 4] [--nsamples 32] [--seqlen 512] [--top 25] [--flops]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import time
from collections.abc import Callable

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


def _quantizing(model: torch.nn.Module, method: str, calib: torch.Tensor) -> Callable[[], object]:
    """Quantizing a copy of ``model`` with ``method`` (4 bits, group 64), to call: the one run both
    the profile and the operation count measure."""
    work = copy.deepcopy(model)
    config, settings = optq.QuantConfig(bits=4, group_size=64), optq.RunSettings(method=method)
    return lambda: optq.quantize(work, calib, config, settings=settings, progress=False)


def profile(model: torch.nn.Module, method: str, calib: torch.Tensor) -> tuple[dict, dict[str, float]]:
    run = _quantizing(model, method, calib)
    prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), os.times()
    prof.enable()
    run()
    prof.disable()
    c1 = os.times()
    cost = {"wall_s": time.perf_counter() - t0, "user_s": c1.user - c0.user, "system_s": c1.system - c0.system}
    cost["cpu_s"] = cost["user_s"] + cost["system_s"]
    stats = pstats.Stats(prof).stats  # key -> (calls, primitive calls, own time, cumulative, callers)
    own = {_label(k): v[2] for k, v in stats.items()}
    return cost, own


def _addmm_(_acc, a, b, *_args, out_shape=None, **_kw) -> int:  # noqa: ANN001 (shapes, by FlopCounterMode)
    return 2 * a[0] * a[1] * b[1]


def _baddbmm_(_acc, a, b, *_args, out_shape=None, **_kw) -> int:  # noqa: ANN001
    return 2 * a[0] * a[1] * a[2] * b[2]


def _sdpa_cpu(q, k, v, *_args, out_shape=None, **_kw) -> int:  # noqa: ANN001
    # q kᵀ and the product with v, every position pair counted (as torch counts attention elsewhere)
    batch, heads, sq, d = q
    return 2 * batch * heads * sq * k[-2] * (d + v[-1])


def product_flops(run: Callable[[], object]) -> dict[str, int]:
    """The floating-point operations of the matrix products ``run()`` calls, by torch operator,
    and "total". torch's counter knows the allocating products; the in-place ones (the Hessian
    sums, the solver's lazy updates) and the CPU's attention kernel are counted here."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    custom = {aten.addmm_: _addmm_, aten.baddbmm_: _baddbmm_}
    custom[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        run()
    ops = {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    ops["total"] = int(counter.get_total_flops())
    return ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--flops", action="store_true", help="also count each method's matrix-product operations")
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
    flops = {m: product_flops(_quantizing(model, m, calib)) for m in ("gptq", "gptaq")} if args.flops else None
    if flops:
        print(f"\n{'matrix-product GFLOP':30s} {'gptq':>10s} {'gptaq':>10s} {'ratio':>7s}")
        for op in sorted(set(flops["gptq"]) | set(flops["gptaq"]), key=lambda o: -flops["gptaq"].get(o, 0)):
            a, b = flops["gptq"].get(op, 0), flops["gptaq"].get(op, 0)
            print(f"{op:30s} {a / 1e9:10.1f} {b / 1e9:10.1f} {b / a if a else float('nan'):7.2f}")
    names = sorted(set(gq) | set(ga), key=lambda n: -max(gq.get(n, 0.0), ga.get(n, 0.0)))[: args.top]
    print(f"\n{'own time (s)':70s} {'gptq':>8s} {'gptaq':>8s}")
    for n in names:
        print(f"{n[:70]:70s} {gq.get(n, 0.0):8.2f} {ga.get(n, 0.0):8.2f}")
    RESULTS.write_text(
        json.dumps(
            {
                "settings": vars(args),
                "cost": {"gptq": gq_cost, "gptaq": ga_cost},
                "flops": flops,
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
