"""Streaming quantization at scale: peak RSS against depth, SmolLM2 against the in-memory path,
resume after kill -9, and a model larger than a cgroup memory limit.

Every quantization runs in a fresh subprocess (this script re-invoked with ``--worker``), so its
peak RSS (the kernel's VmHWM, read at the end) is its own. Phases (``--phases``):

- ``depth``: random Llama-shaped bf16 models (hidden 1024, intermediate 2816, 16 heads, 8 KV
  heads, vocab 32000, untied head) with 4 / 16 / 24 layers (``--layers``), saved as 500 MB
  shards, quantized by ``quantize_pretrained`` on 32 x 512 random tokens, 4-bit g128. Prints
  peak RSS, seconds per block and the plan's predicted peak. Target (issue 10): 4 -> 24 layers
  raises peak RSS by at most 0.25 x the bytes of the 20 added layers.
- ``smollm``: SmolLM2-135M (the cached fp32 folder), 128 x 512 enwiki tokens, default config:
  ``quantize_pretrained`` against ``optq.quantize`` + ``optq.save`` (same max_shard_size):
  peak RSS, wall time, byte-identical tensors. Targets: peak <= 0.9 GB, time within 10%.
- ``resume``: a whole streaming SmolLM2 run at ``--resume-nsamples`` x 512 tokens, then the same
  run SIGKILLed once the journal says >= 60% of the blocks are done and resumed in a new
  process: the remainder's wall and CPU time against the whole run's, and the output against
  the uninterrupted one (byte-identical).
- ``cgroup``: a deeper model whose bf16 weights exceed a cgroup v1 memory limit, quantized by
  streaming inside that limit (and the in-memory path in the same limit, for contrast).

    python benchmarks/scale.py [--phases depth,smollm,resume,cgroup] [--layers 4,16,24]

Writes benchmarks/results/scale.json (each phase's section replaced as it finishes).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from common import ROOT, md_row
from scale_jobs import WORK, clear_output, predicted, spawn, synthetic, tensors_identical, worker

RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
GB = 1e9


# ------------------------------------------------------------------------------------ results
def save(section: str, data: dict) -> None:
    import torch

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.update(
        {
            "benchmark": "scale",
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            section: data,
        }
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


# ------------------------------------------------------------------------------------ phases
def phase_depth(layers: list[int], nsamples: int, seqlen: int) -> dict:
    rows, out = [], {}
    for n in layers:
        src = synthetic(n)
        weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        dst = WORK / f"out-{n}"
        clear_output(dst)
        job = {
            "kind": "stream",
            "source": str(src),
            "out": str(dst),
            "shard": "500MB",
            "calib": "random",
            "nsamples": nsamples,
            "seqlen": seqlen,
        }
        r = spawn(job)
        r.update(layers=n, source_bytes=weights, plan=predicted(src, nsamples, seqlen, "500MB"))
        out[str(n)] = r
        if r["rc"] != 0:
            print(f"{n} layers: failed rc={r['rc']}\n{r.get('stderr_tail')}")
            continue
        bs = r["block_s"]
        rows.append(
            md_row(
                [
                    str(n),
                    f"{weights / GB:.2f}",
                    f"{r['peak_rss'] / GB:.3f}",
                    f"{r['plan']['peak_ram'] / GB:.3f}",
                    f"{r['runtime_rss'] / GB:.3f}",
                    f"{sum(bs) / len(bs):.2f}",
                    f"{r['wall_s']:.0f}",
                ]
            )
        )
        clear_output(dst)
    if "4" in out and "24" in out and out["4"]["rc"] == 0 and out["24"]["rc"] == 0:
        layer_bytes = out["24"]["source_bytes"] - out["4"]["source_bytes"]
        rise = out["24"]["peak_rss"] - out["4"]["peak_rss"]
        out["target"] = {
            "added_layer_bytes": layer_bytes,
            "peak_rise": rise,
            "ratio": rise / layer_bytes,
            "met": rise <= 0.25 * layer_bytes,
        }
    print(f"\ndepth scaling: {nsamples} x {seqlen} random tokens, 4-bit g128, bf16 source, float32 compute")
    print(md_row(["layers", "source GB", "peak RSS GB", "plan peak GB", "runtime RSS GB", "s/block", "wall s"]))
    print(md_row(["---"] * 7))
    print("\n".join(rows))
    if "target" in out:
        t = out["target"]
        print(
            f"4 -> 24 layers: peak RSS +{t['peak_rise'] / GB:.3f} GB for {t['added_layer_bytes'] / GB:.3f} GB of "
            f"added layers = {t['ratio']:.3f}x (target <= 0.25x: {'met' if t['met'] else 'NOT met'})"
        )
    return out


def phase_smollm() -> dict:
    from optq.data.zoo import resolve_model

    src = resolve_model("smollm2-135m")
    out = {}
    for kind in ("stream", "memory"):
        dst = WORK / f"smol-{kind}"
        clear_output(dst)
        out[kind] = spawn(
            {
                "kind": kind,
                "source": str(src),
                "out": str(dst),
                "shard": "5GB",
                "calib": "enwiki",
                "nsamples": 128,
                "seqlen": 512,
            }
        )
    out["plan"] = predicted(Path(src), 128, 512, "5GB")
    ok = all(out[k]["rc"] == 0 for k in ("stream", "memory"))
    if ok:
        out["identical"] = tensors_identical(WORK / "smol-stream", WORK / "smol-memory")
        s, m = out["stream"], out["memory"]
        out["targets"] = {
            "peak_le_0.9GB": s["peak_rss"] <= 0.9 * GB,
            "time_ratio": s["wall_s"] / m["wall_s"],
            "time_within_10pct": s["wall_s"] <= 1.1 * m["wall_s"],
        }
        print("\nSmolLM2-135M (fp32 source), 128 x 512 enwiki tokens, default config")
        print(md_row(["path", "peak RSS GB", "wall s", "s/block"]))
        print(md_row(["---"] * 4))
        for k, label in (("stream", "quantize_pretrained"), ("memory", "load + optq.quantize + optq.save")):
            r = out[k]
            print(
                md_row(
                    [
                        label,
                        f"{r['peak_rss'] / GB:.3f}",
                        f"{r['wall_s']:.1f}",
                        f"{sum(r['block_s']) / len(r['block_s']):.2f}",
                    ]
                )
            )
        print(
            f"plan's predicted peak: {out['plan']['peak_ram'] / GB:.3f} GB; stream/in-memory time "
            f"{out['targets']['time_ratio']:.3f}; identical tensors: {out['identical']['n_differing'] == 0} "
            f"(files identical: {out['identical']['files_identical']})"
        )
    else:
        print("smollm phase failed:", {k: out[k].get("stderr_tail") for k in ("stream", "memory")})
    return out


def phase_resume(nsamples: int, seqlen: int) -> dict:
    """A whole streaming run of SmolLM2, then the same run SIGKILLed once 60% of the blocks are
    done and resumed; the remainder's time against the whole run's, in wall and CPU seconds (CPU
    time is the fair ratio on a machine shared with other work), and the bytes compared."""
    from optq.data.zoo import resolve_model

    src = resolve_model("smollm2-135m")
    job = {
        "kind": "stream",
        "source": str(src),
        "shard": "5GB",
        "calib": "enwiki",
        "nsamples": nsamples,
        "seqlen": seqlen,
    }
    whole_dst, dst = WORK / "smol-whole", WORK / "smol-resume"
    for d in (whole_dst, dst):
        clear_output(d)
        clear_output(d.with_name(d.name + ".partial"))
    whole = spawn({**job, "out": str(whole_dst)})
    n_blocks = 30
    at = -(-6 * n_blocks // 10)
    killed = spawn({**job, "out": str(dst)}, kill_at=(dst.with_name(dst.name + ".partial") / "state.json", at))
    state = json.loads((dst.with_name(dst.name + ".partial") / "state.json").read_text())
    resumed = spawn({**job, "out": str(dst), "resume": True})
    out = {
        "nsamples": nsamples,
        "seqlen": seqlen,
        "whole": whole,
        "killed": {k: v for k, v in killed.items() if k != "stderr_tail"},
        "done_at_kill": state["done"],
        "resumed": resumed,
    }
    if resumed["rc"] == 0 and whole.get("rc") == 0:
        out["remainder_ratio_wall"] = resumed["elapsed_s"] / whole["elapsed_s"]
        out["remainder_ratio_cpu"] = resumed["cpu_s"] / whole["cpu_s"]
        out["identical"] = tensors_identical(dst, whole_dst)
        print(
            f"\nresume ({nsamples} x {seqlen} tokens): killed after {state['done']}/{n_blocks} blocks; the resumed "
            f"remainder took {out['remainder_ratio_cpu']:.3f}x the CPU time of a whole run "
            f"({out['remainder_ratio_wall']:.3f}x its wall time; target <= 0.8x); identical to the "
            f"uninterrupted output: {out['identical']['n_differing'] == 0} (files "
            f"{out['identical']['files_identical']}); peak RSS of the resumed run {resumed['peak_rss'] / GB:.3f} GB"
        )
    else:
        print("resume phase failed:", resumed.get("stderr_tail"), whole.get("stderr_tail"))
    return out


def phase_cgroup(layers: int, limit: float, nsamples: int, seqlen: int) -> dict:
    group = Path("/sys/fs/cgroup/memory/optq_scale")
    try:
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(int(limit)))
    except OSError as exc:
        print(f"cgroup phase skipped: cannot create a memory cgroup ({exc})")
        return {"skipped": str(exc)}
    try:
        src = synthetic(layers)
        weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        out = {"layers": layers, "source_bytes": weights, "limit": int(limit), "nsamples": nsamples, "seqlen": seqlen}
        dst = WORK / f"out-cg-{layers}"
        for kind in ("stream", "memory"):
            clear_output(dst)
            job = {
                "kind": kind,
                "source": str(src),
                "out": str(dst),
                "shard": "200MB",
                "calib": "random",
                "nsamples": nsamples,
                "seqlen": seqlen,
            }
            out[kind] = spawn(job, cgroup=group)
            out[kind]["stderr_tail"] = out[kind].get("stderr_tail", "")[-300:]
        out["max_usage"] = int((group / "memory.max_usage_in_bytes").read_text())
        out["plan"] = predicted(src, nsamples, seqlen, "200MB")
        clear_output(dst)
        s, m = out["stream"], out["memory"]
        print(
            f"\ncgroup v1 memory limit {limit / GB:.2f} GB; model {layers} layers, {weights / GB:.2f} GB bf16 "
            f"({2 * weights / GB:.2f} GB in float32)"
        )
        print(
            f"  streaming: rc {s['rc']}"
            + (f", peak RSS {s['peak_rss'] / GB:.3f} GB, {s['wall_s']:.0f} s" if s["rc"] == 0 else "")
            + f"; plan's peak {out['plan']['peak_ram'] / GB:.3f} GB"
        )
        print(f"  in-memory (load + optq.quantize): rc {m['rc']}" + (" (killed by the limit)" if m["rc"] == -9 else ""))
        return out
    finally:  # our workers have exited: the group is empty
        try:
            group.rmdir()
        except OSError:
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker")
    p.add_argument("--phases", default="depth,smollm,resume,cgroup")
    p.add_argument("--layers", default="4,16,24")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--resume-nsamples", type=int, default=32, help="calibration windows of the resume phase")
    p.add_argument("--cgroup-layers", type=int, default=48)
    p.add_argument("--cgroup-limit-gb", type=float, default=1.1)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    WORK.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    prior = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if "depth" in phases:
        save(
            "depth",
            {
                "nsamples": args.nsamples,
                "seqlen": args.seqlen,
                **phase_depth([int(x) for x in args.layers.split(",")], args.nsamples, args.seqlen),
            },
        )
    if "smollm" in phases:
        prior["smollm"] = phase_smollm()
        save("smollm", prior["smollm"])
    if "resume" in phases:
        save("resume", phase_resume(args.resume_nsamples, 512))
    if "cgroup" in phases:
        save("cgroup", phase_cgroup(args.cgroup_layers, args.cgroup_limit_gb * GB, 8, 256))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
