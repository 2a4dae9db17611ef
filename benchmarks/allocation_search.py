"""How far can a search over allocations go? An EvoPress-style search on ``--target-bits``' proxy.

Research, not the library: ``optq quantize --target-bits`` picks among a few candidates
(knapsacks and filled heuristics) by their KL on held-out windows. This script asks whether a
much larger search under the same proxy would find a better allocation, and whether what the
proxy gains survives the run's own quantization (GPTAQ, sequential):

1. H = 2XᵀX/n (plain: tokens not normalised) of every linear from ``--nsamples`` windows of
   enwiki calibration through the float model; every linear quantized by GPTQ on it at every
   (bits, group) setting the engines take (bits ``--bits``), all held in memory (a few GB for a
   135M model: memory grows with the model, which is why this is a script). A model stitched
   from these variants is the proxy's model: each layer quantized on float inputs, as the KL
   check assumes (whose H is token-normalised, the run's default: the search's is not).
2. From the allocation that ``benchmarks/allocation.py`` chose (``--start``), a (1 + λ)
   evolution: each child moves one to three random units (layers that must share a setting) one
   setting up and then random units down until it fits the budget; the children are ranked by KL
   to the float model on the first search window, the best two scored on all ``--search``
   windows, and the best replaces the parent if it is lower.
3. The start and the result scored on ``--holdout`` other windows (never searched), their
   stitched models' perplexity, and the result quantized as the run does (default method, every
   layer at its allocated setting) and measured like ``benchmarks/allocation.py``'s rows, beside
   the start's row of that benchmark's result.

Calibration windows are consecutive 512-token windows of enwiki's calibration part: the first
``--nsamples`` for H, the next ``--search``, then ``--holdout``. Prints a table and writes
benchmarks/results/allocation_search.json.

    python benchmarks/allocation_search.py [--generations 70] [--children 6] [--search 3]
        [--holdout 6] [--start benchmarks/results/allocation.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import time
from pathlib import Path

import torch
from common import kl_per_token

import optq
from optq.core import solver
from optq.core.config import QuantConfig
from optq.core.hessian import Hessian
from optq.data import zoo
from optq.data.tokens import load_text, tokenize
from optq.eval.perplexity import perplexity
from optq.pipeline.allocation import options

RESULTS = Path(__file__).resolve().parent / "results"
SERVE = ("vllm", "transformers", "optq")
T0 = time.perf_counter()


def log(*parts) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s]", *parts, flush=True)


def hessians(model, linears: dict, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """2XᵀX/n of every linear's input over ``windows``, from the float model (the paper's plain H:
    tokens not normalised, unlike the run's default)."""
    acc = {n: Hessian(m.in_features, normalize_tokens=False) for n, m in linears.items()}
    handles = [m.register_forward_pre_hook(lambda _m, args, h=acc[n]: h.update(args[0])) for n, m in linears.items()]
    try:
        with torch.inference_mode():
            for i in range(0, len(windows), 4):
                model(windows[i : i + 4])
    finally:
        for h in handles:
            h.remove()
    return {n: h.matrix() for n, h in acc.items()}


class Stitched:
    """The model with each linear's weight taken from its variant at the allocated setting."""

    def __init__(self, model, linears: dict, variants: dict, units: list[list[str]]):
        self.model, self.linears, self.variants, self.units = model, linears, variants, units
        self.current: dict[str, tuple[int, int]] = {}

    def set(self, allocation: list[tuple[int, int]]) -> None:
        with torch.no_grad():
            for unit, setting in zip(self.units, allocation):
                for name in unit:
                    if self.current.get(name) != setting:
                        self.linears[name].weight.copy_(self.variants[name, setting])
                        self.current[name] = setting

    def kl(self, allocation, ref: torch.Tensor, ids: torch.Tensor) -> float:
        """Mean KL(float || stitched) per token; ``ref`` the float model's logits."""
        self.set(allocation)
        with torch.inference_mode():
            return kl_per_token(ref, self.model(ids).logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--target-bits", type=float, default=3.5)
    ap.add_argument("--start", type=Path, default=RESULTS / "allocation.json")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--search", type=int, default=3, help="search windows of 512 tokens")
    ap.add_argument("--holdout", type=int, default=6, help="held-out windows of 512 tokens")
    ap.add_argument("--generations", type=int, default=70)
    ap.add_argument("--children", type=int, default=6)
    ap.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens per corpus")
    ap.add_argument("--corpora", default="enwiki,debref-de,code")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start_result = json.loads(args.start.read_text())
    if (start_result["model"], start_result["target_bits"]) != (args.model, args.target_bits):
        raise SystemExit(f"{args.start} is for {start_result['model']} at {start_result['target_bits']} bits")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tok = zoo.load_model(args.model)
    model.eval()
    calib = tokenize(load_text("enwiki", "calib"), tok)
    win = calib[: calib.numel() // 512 * 512].view(-1, 512)
    fit, search = win[: args.nsamples], win[args.nsamples : args.nsamples + args.search]
    holdout = win[args.nsamples + args.search : args.nsamples + args.search + args.holdout]
    float_model = copy.deepcopy(model)
    chosen = start_result["chosen_layers"]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n in chosen}
    H = hessians(model, linears, fit)
    log(f"H of {len(H)} linears from {fit.numel()} tokens")
    config, bits = QuantConfig(), [int(b) for b in args.bits.split(",")]
    variants, sizes, menu = {}, {}, {}
    for name, module in linears.items():
        W = module.weight.detach().float()
        menu[name] = options.layer_settings(tuple(W.shape), config, SERVE, "gptq", bits=bits)
        factors = solver.factored(W, H[name], config)
        for s in menu[name]:
            cfg = dataclasses.replace(config, bits=s[0], group_size=s[1])
            variants[name, s] = solver.sweep(W, factors, cfg, torch.float32).weight
            sizes[name, s] = options.stored_bits(tuple(W.shape), s, config, "gptq")
    del H
    log(f"{len(variants)} variants")
    units = options.units_of(sorted(linears))
    choices = []
    for unit in units:
        common = [s for s in menu[unit[0]] if all(s in menu[n] for n in unit)]
        choices.append(sorted(common, key=lambda s, u=unit: sum(sizes[n, s] for n in u)))
    weights = sum(m.weight.numel() for m in linears.values())
    budget = args.target_bits * weights

    def size(allocation) -> int:
        return sum(sizes[n, s] for unit, s in zip(units, allocation) for n in unit)

    def mutate(parent):
        child = list(parent)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(units))
            k = choices[i].index(child[i])
            child[i] = choices[i][min(k + 1, len(choices[i]) - 1)]
        while size(child) > budget:
            i = rng.randrange(len(units))
            child[i] = choices[i][max(choices[i].index(child[i]) - 1, 0)]
        return child

    with torch.inference_mode():
        ref_search = model(search).logits
        ref_hold = model(holdout).logits
    stitched = Stitched(model, linears, variants, units)
    start = [tuple(chosen[unit[0]]) for unit in units]
    outside = [u[0] for u, s, c in zip(units, start, choices) if s not in c]
    if outside:
        raise SystemExit(f"the start allocation has settings outside --bits {args.bits}: {', '.join(outside[:5])}")
    parent, parent_kl = start, stitched.kl(start, ref_search, search)
    history = [parent_kl]
    for g in range(args.generations):
        kids = [mutate(parent) for _ in range(args.children)]
        first = sorted(range(len(kids)), key=lambda j: stitched.kl(kids[j], ref_search[:1], search[:1]))
        scored = [(stitched.kl(kids[j], ref_search, search), j) for j in first[:2]]
        best_kl, j = min(scored)
        if best_kl < parent_kl:
            parent, parent_kl = kids[j], best_kl
        history.append(parent_kl)
        if (g + 1) % 10 == 0:
            log(f"generation {g + 1}: search KL {parent_kl:.4f}")
    evals = {c: tokenize(load_text(c, "eval"), tok) for c in args.corpora.split(",")}

    def ppl(m) -> dict[str, float]:
        return {c: perplexity(m, evals[c], seqlen=512, windows=args.windows) for c in evals}

    rows = {}
    for label, allocation in (("start", start), ("searched", parent)):
        rows[label] = {
            "bits_per_weight": size(allocation) / weights,
            "search_kl": stitched.kl(allocation, ref_search, search),
            "holdout_kl": stitched.kl(allocation, ref_hold, holdout),
            "stitched": ppl(model),
        }
    changed = sum(a != b for a, b in zip(start, parent))
    rows["start"]["quantized"] = start_result["rows"][start_result["chosen"]]["quantized"]
    t = time.perf_counter()
    run = copy.deepcopy(float_model)
    overrides = [(n, {"bits": s[0], "group_size": s[1]}) for unit, s in zip(units, parent) for n in unit]
    optq.quantize(run, calib, QuantConfig(), overrides=overrides, nsamples=args.nsamples, seqlen=512, progress=False)
    rows["searched"]["quantized"] = ppl(run)
    rows["searched"]["run_seconds"] = time.perf_counter() - t
    result = {
        "model": args.model,
        "target_bits": args.target_bits,
        "start": f"{args.start.name}: {start_result['chosen']}",
        "generations": args.generations,
        "children": args.children,
        "windows": {"fit": args.nsamples, "search": args.search, "holdout": args.holdout},
        "units_changed": changed,
        "seconds": time.perf_counter() - T0,
        "history": history,
        "float": ppl(float_model),
        "rows": rows,
        "searched_layers": {n: list(s) for unit, s in zip(units, parent) for n in unit},
    }
    (RESULTS / "allocation_search.json").write_text(json.dumps(result, indent=1))
    print(f"{len(units)} units, {changed} changed by the search; float: {result['float']}")
    print(f"{'':10} {'bits/w':>7} {'search KL':>10} {'holdout KL':>11}  stitched ppl | quantized (run) ppl")
    for label, r in rows.items():
        fmt = lambda d: " ".join(f"{d[c]:7.2f}" for c in evals)  # noqa: E731
        print(
            f"{label:10} {r['bits_per_weight']:7.3f} {r['search_kl']:10.4f} {r['holdout_kl']:11.4f}  "
            f"{fmt(r['stitched'])} | {fmt(r['quantized'])}"
        )


if __name__ == "__main__":
    main()
