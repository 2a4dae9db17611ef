"""Mixture-of-experts quantization on a random Mixtral-shaped model: routed vs all Hessians.

A random Mixtral (8 experts, top-2, hidden 1024, expert intermediate ``--inter``, ``--layers``
blocks) is quantized to 4 bits, group 128, on enwiki windows tokenized with SmolLM2's tokenizer
(real text, so routing is as skewed as text makes it; random token ids when the corpus or
tokenizer is not fetched). Each variant runs in a process of its own, so peak RSS is its own:

- ``rtn``: round to nearest;
- ``routed0``: each expert's H from its routed tokens only, no starved-expert fallback;
- ``routed``: starved experts (fewer routed tokens than their input width) get the all-token H;
- ``weighted``: ``routed`` with each token weighted by its squared routing weight;
- ``all`` (optq's default): every calibration token through every expert, for the Hessians;
- ``budget``: ``routed`` with ``max_hessian_memory`` set to three experts' Hessians, so each stage
  of 8 experts is collected in chunks (extra forwards), and must give the same weights.

Quality is measured on held-out windows the calibration never saw: the *held-out layer error*
Σ_e Σ_{x routed to e} |(W_e - Ŵ_e) x|² / tokens of every expert linear on the fp model's own
inputs, and the KL divergence of the quantized model's next-token distribution from the fp
model's. Prints tables and writes benchmarks/results/moe.json.

    python benchmarks/moe.py [--nsamples 32] [--seqlen 512] [--layers 2] [--inter 2048]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import ROOT, kl_per_token, weights_sha256

import optq
from optq.formats.experts import ExpertLinears, unfuse_experts

VARIANTS = ("rtn", "routed0", "routed", "weighted", "all", "budget")
VOCAB = 49152


def build(args: argparse.Namespace):
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).float().eval()


def token_sets(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Calibration windows and held-out windows (disjoint text), and where they came from."""
    try:
        from optq.data import tokens, zoo

        _, tok = zoo.load_model("smollm2-135m")
        calib = tokens.calibration_windows("enwiki", tok, args.nsamples, args.seqlen, 0)
        held = tokens.eval_windows(tokens.load_tokens("enwiki", tok, "eval"), args.seqlen, args.heldout)
        return calib, held, "enwiki (SmolLM2 tokenizer)"
    except Exception as exc:  # corpus or model not fetched: random ids
        print(f"note: enwiki/SmolLM2 unavailable ({exc}); random token ids", file=sys.stderr)
        g = torch.Generator().manual_seed(0)
        return (
            torch.randint(0, VOCAB, (args.nsamples, args.seqlen), generator=g),
            torch.randint(0, VOCAB, (args.heldout, args.seqlen), generator=g),
            "random ids",
        )


def heldout_inputs(model, held: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Every expert linear's inputs on the held-out windows, in the fp model."""
    got: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".experts." in name:
            handles.append(
                mod.register_forward_pre_hook(lambda _m, a, n=name: got.setdefault(n, []).append(a[0].detach().clone()))
            )
    with torch.no_grad():
        for b in range(0, len(held), 4):
            model(input_ids=held[b : b + 4], use_cache=False)
    for h in handles:
        h.remove()
    return got


def logits(model, held: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=held[b : b + 4], use_cache=False).logits for b in range(0, len(held), 4)]


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    fp = build(args)
    calib, held, source = token_sets(args)
    model = copy.deepcopy(fp)
    cfg = optq.QuantConfig(bits=4, group_size=128)
    kw = {"progress": False, "batch_size": 4}
    v = args.variant
    if v == "rtn":
        kw["method"] = "rtn"
    elif v == "routed0":
        kw.update(moe_calibration="routed", moe_min_tokens=0)
    elif v == "routed":
        kw["moe_calibration"] = "routed"
    elif v == "all":
        kw["moe_calibration"] = "all"
    elif v == "weighted":
        kw.update(moe_calibration="routed", moe_weighting="routing")
    elif v == "budget":
        kw["moe_calibration"] = "routed"
        kw["max_hessian_memory"] = 3 * 2 * 4 * max(1024, args.inter) ** 2  # three of the largest Hessians
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0, c0 = time.perf_counter(), time.process_time()
    report = optq.quantize(model, calib, cfg, **kw)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    digest = weights_sha256(model)
    unfuse_experts(fp)
    inputs = heldout_inputs(fp, held)
    n_tokens = held.numel()
    err = 0.0
    per_layer = {}
    for name, xs in inputs.items():
        delta = (fp.get_submodule(name).weight - model.get_submodule(name).weight).double()
        e = sum(float(((x.reshape(-1, x.shape[-1]).double() @ delta.T) ** 2).sum()) for x in xs)
        per_layer[name] = {
            "error": e / n_tokens,
            "heldout_tokens": sum(x.reshape(-1, x.shape[-1]).shape[0] for x in xs),
            "calib_tokens": report.layers[name].tokens if name in report.layers else None,
            "hessian": report.layers[name].hessian if name in report.layers else None,
        }
        err += e / n_tokens
    kl = kl_per_token(logits(fp, held), logits(model, held))
    expert_linears = sum(isinstance(m, ExpertLinears) for m in model.modules())
    out = {
        "variant": v,
        "source": source,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_rss_mb": peak,
        "start_rss_mb": base,
        "heldout_layer_error": err,
        "kl": kl,
        "moe": report.moe,
        "weights_sha256": digest,
        "fallbacks": len(report.fallbacks),
        "experts_modules": expert_linears,
        "layers": per_layer,
        "options": {k: report.options[k] for k in ("moe_calibration", "moe_min_tokens", "max_hessian_memory")},
    }
    Path(args.json_out).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--heldout", type=int, default=8, help="held-out windows")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--inter", type=int, default=2048, help="each expert's intermediate size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe.json"))
    args = ap.parse_args()
    if args.variant:
        child(args)
        return
    rows = []
    tmp = Path(args.out).with_suffix(".part.json")
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", v, "--json-out", str(tmp)] + [
            f"--{k}={getattr(args, k)}" for k in ("nsamples", "seqlen", "heldout", "layers", "inter", "threads")
        ]
        subprocess.run(cmd, check=True)
        rows.append(json.loads(tmp.read_text()))
        tmp.unlink()
        r = rows[-1]
        print(f"{v}: {r['seconds']:.1f} s, peak {r['peak_rss_mb']:.0f} MB", flush=True)
    by = {r["variant"]: r for r in rows}
    print(
        f"\nrandom Mixtral, hidden 1024, 8 experts top-2, inter {args.inter}, {args.layers} blocks; "
        f"4-bit g128; calibration {args.nsamples} x {args.seqlen} ({rows[0]['source']}); "
        f"held-out {args.heldout} x {args.seqlen}"
    )
    print(
        f"{'variant':9s} {'time s':>7s} {'cpu s':>7s} {'peak MB':>8s} {'fwd/blk':>8s} {'extra':>6s} {'chunks':>7s} "
        f"{'held-out err':>13s} {'KL':>10s} {'fallbacks':>9s}"
    )
    for r in rows:
        moe = list(r["moe"].values())
        fwd = sum(m["forwards"] + m["discovery_forwards"] for m in moe) / max(1, len(moe))
        extra = sum(m["extra_forwards"] for m in moe) / max(1, len(moe))
        chunks = sum(m["chunks"] for m in moe) / max(1, len(moe))
        print(
            f"{r['variant']:9s} {r['seconds']:7.1f} {r.get('cpu_seconds', float('nan')):7.1f} "
            f"{r['peak_rss_mb']:8.0f} {fwd:8.1f} {extra:6.1f} {chunks:7.1f} "
            f"{r['heldout_layer_error']:13.5g} {r['kl']:10.4g} {r['fallbacks']:9d}"
        )
    if "budget" in by and "routed" in by:
        same = by["budget"]["weights_sha256"] == by["routed"]["weights_sha256"]
        print(
            f"\nbudget ({by['budget']['options']['max_hessian_memory'] / 1e6:.0f} MB) vs unlimited: "
            f"identical weights: {same}"
        )
    if "routed0" in by and "all" in by:
        print("\nper expert linear, held-out error routed-only / all-token H, by calibration tokens routed:")
        buckets: dict[str, list[float]] = {}
        for name, row in by["routed0"]["layers"].items():
            other = by["all"]["layers"][name]["error"]
            n = row["calib_tokens"] or 0
            key = next(f"<{b}" for b in (64, 256, 1024, 4096, 16384, 1 << 30) if n < b)
            buckets.setdefault(key, []).append(row["error"] / other if other else float("nan"))
        for key, vals in buckets.items():
            print(
                f"  tokens {key:>8s}: {len(vals):3d} linears, mean ratio {sum(vals) / len(vals):.3f}, "
                f"routed better in {sum(v < 1 for v in vals)}"
            )
    Path(args.out).write_text(
        json.dumps(
            {
                "args": {k: getattr(args, k) for k in ("nsamples", "seqlen", "heldout", "layers", "inter", "threads")},
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
