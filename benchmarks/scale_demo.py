"""Peak RSS of ``optq demo``: the whole main job (fp, round-to-nearest and GPTQ on SmolLM2-135M).

Runs ``python -m optq demo -o OUT [flags]`` in a fresh process with this checkout's optq and
reads its peak resident size (``RUSAGE_CHILDREN``'s ``ru_maxrss``: the demo starts no process
of its own) and its perplexities (``OUT/compare.json``).

    python benchmarks/scale_demo.py [--label NAME] [-- --nsamples 16 --windows 4]

Prints the table and writes ``benchmarks/results/scale_demo.json`` (one section per ``--label``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "scale_demo.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="current")
    args, flags = p.parse_known_args()
    flags = [x for x in flags if x != "--"]
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="optq-demo-") as tmp:
        out = Path(tmp) / "demo"
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "optq", "demo", "-o", str(out), "--no-progress", *flags]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        result = json.loads((out / "compare.json").read_text())
    rows = {v["name"]: v["perplexity"] for v in result["variants"]}
    corpora = result["corpora"]
    print(f"{'variant':<8} " + " ".join(f"{c:>12}" for c in corpora))
    for name, ppl in rows.items():
        print(f"{name:<8} " + " ".join(f"{ppl[c]:12.6f}" for c in corpora))
    print(f"peak RSS {peak / 1e9:.3f} GB, {seconds / 60:.1f} min")
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved[args.label] = {"flags": flags, "peak_rss": peak, "seconds": seconds, "perplexity": rows}
    RESULTS.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"wrote {RESULTS} [{args.label}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
