"""A scaling model for N GPUs under torch.distributed: what parallelises, and predicted times.

Per decoder block, with T calibration tokens shared by N ranks (optq.pipeline.distributed.ranks):

    time(N) = (forwards + Hessian products) / N          data-parallel calibration
            + sum over stages of the most loaded rank's solves   parallel solves (Dist.assign)
            + all-reduce of each group's Hessians            2 (N-1)/N x 2 K^2 x 4 bytes / ring bandwidth
            + broadcasting the stage's solutions from their ranks   (1 + 8/group) bytes per weight
                                                             + 12 per input column / bandwidth,
                                                             + one latency per linear

FLOPs, the stages and the solve work units (K^3 / group size + rows x K^2 per linear) come from
the dry-run plan (optq.pipeline.planning.runplan) of each model's config; the rates below are ASSUMED for
one H100/H200-class GPU, not measured (no GPU was lent to the session that wrote this): bf16
forwards at 300 TFLOP/s, float32 Hessian products at 50 TFLOP/s, a solve unit at 5e-13 s (this
CPU's measured 9.8e-12 s, 20 times faster), NCCL ring all-reduce at 150 GB/s, and NCCL
broadcasts of each linear's codes (uint8), scales, zeros, g_idx and perm from the rank that
solved it at 150 GB/s plus 50 us each. (Until solutions were broadcast as tensors they went
through ``all_gather_object``, pickled through host memory: about 5 bytes per weight at an
assumed 2 GB/s; ``--gather object`` prints that model, for comparison.) Prints the table in
docs/scale.md and writes benchmarks/results/scaling.json.

    python benchmarks/scaling.py [--nsamples 128] [--seqlen 2048] [--gather {tensors,object}]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import ROOT

RATES = {
    "forward_flops": 300e12,
    "hessian_flops": 50e12,
    "solve_unit_s": 5e-13,
    "allreduce_Bps": 150e9,
    "broadcast_Bps": 150e9,
    "broadcast_latency_s": 50e-6,
    "gather_Bps": 2e9,  # the former all_gather_object, --gather object
}
GROUP = 128  # the group size of the modelled runs (4-bit g128)
ANCHORS = {
    "Llama-3-8B": "llm-compressor GPTQ: 745 / 372 / 264 s on 1 / 2 / 4 GPUs",
    "DeepSeek-V3 (671B MoE)": "MoE-Quant: about 2 hours on 8 H100s",
}


def stages(listing: list[dict]) -> list[list[dict]]:
    """The block's stages: a dense group of linears sharing an input, or one matrix of every expert."""
    from optq.pipeline.discovery import expert_parts

    out: dict[tuple, list[dict]] = {}
    for row in listing:
        if not row["quantized"]:
            continue
        parts = expert_parts(row["name"])
        key = (parts[0], row["in"]) if parts else (row["name"].rpartition(".")[0], row["in"])
        out.setdefault(key, []).append(row)
    return list(out.values())


def block_time(listing: list[dict], n: int, fwd_hess: float, gather_mode: str = "tensors") -> dict[str, float]:
    from optq.pipeline.discovery import expert_parts
    from optq.pipeline.distributed.ranks import Dist

    solve = allreduce = gather = 0.0
    for stage in stages(listing):
        groups: dict[str, list[dict]] = {}
        for row in stage:  # linears sharing one H: an expert's gate and up, or q/k/v
            parts = expert_parts(row["name"])
            groups.setdefault(f"{parts[0]}.{parts[1]}" if parts else "dense", []).append(row)
        costs = [
            (r["in"] ** 3 / len(g) + r["out"] * r["in"] ** 2) * RATES["solve_unit_s"]
            for g in groups.values()
            for r in g
        ]
        load = [0.0] * n
        for c, r in zip(costs, Dist(n, 0).assign(costs)):
            load[r] += c
        solve += max(load)
        if n > 1:
            allreduce += len(groups) * 2 * (n - 1) / n * 2 * stage[0]["in"] ** 2 * 4 / RATES["allreduce_Bps"]
            if gather_mode == "object":
                gather += (n - 1) / n * 5 * sum(r["in"] * r["out"] for r in stage) / RATES["gather_Bps"]
            else:
                sent = sum(r["in"] * r["out"] * (1 + 8 / GROUP) + 12 * r["in"] for r in stage)
                gather += sent / RATES["broadcast_Bps"] + len(stage) * RATES["broadcast_latency_s"]
    return {"forward + hessians": fwd_hess / n, "solves": solve, "all-reduce": allreduce, "gather": gather}


def main() -> None:
    from plan_table import MODELS

    import optq
    from optq.pipeline.planning import plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--gather", choices=("tensors", "object"), default="tensors", help="how solutions travel")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scaling.json"))
    args = ap.parse_args()
    config = optq.QuantConfig(bits=4, group_size=GROUP)
    results = {}
    print(f"{args.nsamples} x {args.seqlen} calibration tokens, 4-bit g128; assumed rates {RATES}")
    print("| model | N=1 | N=2 | N=4 | N=8 | parallel fraction at N=1 | anchor |\n|---|---|---|---|---|---|---|")
    for name in ("Llama-3-8B", "Llama-3-70B", "DeepSeek-V3 (671B MoE)"):
        p = plan(
            MODELS[name],
            nsamples=args.nsamples,
            seqlen=args.seqlen,
            config=config,
            speed={"flops": 1.0, "solve_unit": 1.0},
        )
        n_blocks = len(p.blocks)
        fwd = p.seconds["forwards"] / RATES["forward_flops"] + p.seconds["hessians"] / RATES["hessian_flops"]
        times = {}
        for n in (1, 2, 4, 8):
            per = [block_time(b["linears"], n, fwd / n_blocks, args.gather) for b in p.blocks]
            parts = {k: sum(x[k] for x in per) for k in per[0]}
            times[n] = {"total_s": sum(parts.values()), **parts}
        frac = times[1]["forward + hessians"] / times[1]["total_s"]
        results[name] = {"times": times, "parallel_fraction": frac}
        cells = " | ".join(f"{times[n]['total_s'] / 60:.0f} min" for n in (1, 2, 4, 8))
        print(f"| {name} | {cells} | {frac:.2f} | {ANCHORS.get(name, '')} |")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rates": RATES, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
