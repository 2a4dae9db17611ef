"""One process with 2 threads against 2 processes with 1 thread each (torch.distributed, gloo) on
SmolLM2-135M: wall time, peak RSS per rank, and where each block's time goes.

Every run quantizes SmolLM2-135M (fp32) to 4 bits, group 128, on ``--nsamples`` x ``--seqlen``
enwiki tokens with optq's defaults and float64 Hessians in both runs (so the two give the same
bytes, which is checked). Each rank is a process of its own, started by
``torch.multiprocessing.spawn``; a 1-process run is not in a process group at all. Per rank,
the block loop's time splits into ``forward`` (block forwards and Hessian accumulation, the
rest), ``all-reduce`` (Hessian sums and token statistics), ``solve`` (this rank's share of the
GPTQ solves) and ``broadcast`` (the other ranks' solutions, broadcast as tensors from the rank
that solved each linear, with waiting for it, and the failure checks).
Prints a table and writes benchmarks/results/distributed.json.

    python benchmarks/distributed.py [--nsamples 32] [--seqlen 512] [--hessian-cost]

``--hessian-cost`` instead measures what the deterministic mode costs: one process, float32
against float64 Hessians (benchmarks/results/hessian_dtype_cost.json).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import ROOT, weights_sha256


def worker(
    rank: int,
    world: int,
    threads: int,
    store: str,
    out: str,
    nsamples: int,
    seqlen: int,
    hessian_dtype: str = "float64",
) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import optq
    from optq.data import tokens, zoo
    from optq.pipeline.distributed.ranks import current

    model, tok = zoo.load_model("smollm2-135m")
    calib = tokens.calibration_windows("enwiki", tok, nsamples, seqlen, 0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    report = optq.quantize(
        model, calib, optq.QuantConfig(bits=4, group_size=128), progress=False, hessian_dtype=hessian_dtype
    )
    wall = time.perf_counter() - t0
    s = current().seconds
    blocks = sum(report.block_seconds)
    split = {"all-reduce": s["all_reduce"], "solve": s["solve"], "broadcast": s["gather"] + s["check"]}
    split = {"forward": blocks - sum(split.values()), **split}
    Path(f"{out}/rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "wall_s": wall,
                "blocks_s": blocks,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "start_rss_mb": base,
                "split_s": split,
                "per_block_s": {k: v / len(report.block_seconds) for k, v in split.items()},
                "weights_sha256": weights_sha256(model),
                "layers_solved": sum(1 for r in report.solved_by.values() if r == rank)
                if world > 1
                else len(report.layers),
            }
        )
    )
    if world > 1:
        dist.destroy_process_group()


def run(world: int, threads: int, args: argparse.Namespace, hessian_dtype: str = "float64") -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            worker, args=(world, threads, f"{tmp}/store", tmp, args.nsamples, args.seqlen, hessian_dtype), nprocs=world
        )
        return [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "distributed.json"))
    ap.add_argument(
        "--hessian-cost",
        action="store_true",
        help="only: the cost of float64 Hessians, 1 process x 2 threads, float32 vs float64",
    )
    args = ap.parse_args()
    if args.hessian_cost:
        f32, f64 = run(1, 2, args, "float32")[0], run(1, 2, args, "float64")[0]
        print(
            f"float32 Hessians: {f32['wall_s']:.1f} s, {f32['peak_rss_mb']:.0f} MB; float64: "
            f"{f64['wall_s']:.1f} s, {f64['peak_rss_mb']:.0f} MB; ratio {f64['wall_s'] / f32['wall_s']:.2f}"
        )
        path = Path(args.out).with_name("hessian_dtype_cost.json")
        path.write_text(json.dumps({"args": vars(args), "float32": f32, "float64": f64}, indent=1) + "\n")
        return
    runs = {"1 process x 2 threads": run(1, 2, args), "2 processes x 1 thread": run(2, 1, args)}
    print(f"SmolLM2-135M, 4-bit g128, {args.nsamples} x {args.seqlen} enwiki tokens, float64 Hessians")
    print(
        f"{'run':24s} {'rank':>4s} {'wall s':>7s} {'peak MB':>8s} {'layers':>6s}   per block (s): "
        f"{'forward':>8s} {'all-red':>8s} {'solve':>8s} {'bcast':>8s}"
    )
    for name, ranks in runs.items():
        for r in ranks:
            p = r["per_block_s"]
            print(
                f"{name:24s} {r['rank']:4d} {r['wall_s']:7.1f} {r['peak_rss_mb']:8.0f} {r['layers_solved']:6d}   "
                f"{'':15s}{p['forward']:8.2f} {p['all-reduce']:8.2f} {p['solve']:8.2f} {p['broadcast']:8.2f}"
            )
    one, two = runs.values()
    same = len({r["weights_sha256"] for r in [*one, *two]}) == 1
    speedup = one[0]["wall_s"] / max(r["wall_s"] for r in two)
    print(f"\nspeed-up {speedup:.2f}x; identical weights on every rank and in both runs: {same}")
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "runs": runs, "speedup": speedup, "identical": same}, indent=1) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
