"""Perplexity of fp vs round-to-nearest vs GPTQ on a real model, with docs/results.md's protocol.

Calibration: 128 random windows x 512 tokens (seed 0) from the enwiki calibration part;
evaluation: the first N consecutive non-overlapping 512-token windows of the held-out part of
each corpus (no BOS for SmolLM2, BOS for Gemma). Only the decoder blocks' linears are quantized.
Writes benchmarks/results/quality_<model>.json and a PNG beside it; prints the table.

    python benchmarks/quality.py [--model smollm2-135m] [--windows 20]
        [--variants fp,rtn,gptq,gptq+plain,rtn+b3,gptq+b3] [--data enwiki,debref-en,debref-de]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optq.cli import main

RESULTS = Path(__file__).parent / "results"

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", default="20")
    ap.add_argument("--nsamples", default="128")
    ap.add_argument("--variants", default="fp,rtn,gptq,gptq+plain,rtn+b3,gptq+b3")
    ap.add_argument("--data", default="enwiki,debref-en,debref-de")
    ap.add_argument("--calib", default="enwiki")
    args = ap.parse_args()
    out = RESULTS / f"quality_{args.model}_{args.calib}.json"
    sys.exit(
        main(
            [
                "compare",
                args.model,
                "--variants",
                args.variants,
                "--data",
                args.data,
                "--calib",
                args.calib,
                "--windows",
                args.windows,
                "--nsamples",
                args.nsamples,
                "--json",
                str(out),
                "--no-progress",
            ]
        )
    )
