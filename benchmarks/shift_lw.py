"""What shrinkage toward the diagonal would a per-layer rule pick? Ledoit-Wolf intensities on SmolLM2.

For a Hessian estimated as a mean of independent units, the shrinkage toward its diagonal that
minimises the expected squared (Frobenius) error of the off-diagonal entries is (Ledoit & Wolf
2004; Schäfer & Strimmer 2005, target "D")

    λ = Σ_{i≠j} Var(h̄_ij) / Σ_{i≠j} h̄_ij²

with Var(h̄_ij) estimated from the units. Two choices of unit, per linear input (tokens at unit
RMS, as optq's Hessians):

- ``window``: the calibration windows of one source. λ then measures how noisy H is as an
  estimate of that source's own H (windows are the independent draws; tokens inside a window
  are not).
- ``source``: the calibration sources of a mixture (each source's mean H one unit). λ then
  measures how much the sources disagree: shrinkage for the H of a population of texts of which
  the calibration saw a few.

Every linear goes into benchmarks/results/shift_lw.json; the table shows blocks 0, 5, ..., 25 and
the last. The math is benchmarks/shift_rules.py's, as used by shift.py's ``+lw`` candidate.

    python benchmarks/shift_lw.py [--sources enwiki,debref-de,code] [--per-source 11]
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import ROOT
from shift_rules import layer_shrinks, units_of

RESULTS = ROOT / "benchmarks" / "results" / "shift_lw.json"
INPUTS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")  # one per distinct input


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sources", default="enwiki,debref-de,code")
    ap.add_argument("--per-source", type=int, default=11, help="windows of each source")
    ap.add_argument("--seqlen", type=int, default=512)
    args = ap.parse_args()
    from optq.data import tokens, zoo

    model, tok = zoo.load_model(args.model)
    sources = args.sources.split(",")
    windows = {s: tokens.calibration_windows(s, tok, args.per_source, args.seqlen, 0) for s in sources}
    by = {"source": layer_shrinks(model, list(windows.values()))}
    for s in sources:
        by[f"window:{s}"] = layer_shrinks(model, units_of(windows[s], 1))
    layers = {name: {col: by[col][name] for col in by} for name in by["source"]}
    out = {"model": args.model, "sources": sources, "per_source": args.per_source, "seqlen": args.seqlen}
    RESULTS.write_text(json.dumps({**out, "layers": layers}, indent=1) + "\n")
    shown = [n for n in layers if n.endswith(INPUTS) and int(n.split(".")[-3]) in _picked(layers)]
    print("| linear | λ between sources | " + " | ".join(f"λ windows of {s}" for s in sources) + " |")
    print("|---" * (len(by) + 1) + "|")
    for name in shown:
        print(f"| {name} | " + " | ".join(f"{layers[name][c]:.3f}" for c in by) + " |")
    print(
        "| median, all linears | "
        + " | ".join(f"{statistics.median(r[c] for r in layers.values()):.3f}" for c in by)
        + " |"
    )
    return 0


def _picked(layers: dict) -> set[int]:
    blocks = {int(n.split(".")[-3]) for n in layers}
    return {*range(0, max(blocks) + 1, 5), max(blocks)}


if __name__ == "__main__":
    raise SystemExit(main())
