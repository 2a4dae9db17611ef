"""Peak resident memory while loading a checkpoint, against the loaded model's resident size.

Each route runs in a fresh process: the imports first (torch, transformers, optq, and the
model's class, by building it once on the meta device), then the resident size is read
(``/proc/self/statm``), the kernel's high-water mark reset (``/proc/self/clear_refs``), the
checkpoint loaded, and the peak (``VmHWM``; ``ru_maxrss`` also holds the size of the process
that started the child, recorded at its exec) and the resident size read again. ``peak/loaded``
is the peak over the imports divided by the resident size over the imports: 1.0 would load
with nothing beyond the model.

Routes: ``optq.load(folder)`` (float32 model, bfloat16 embeddings: ``optq generate`` and
``optq eval``'s default) and the lean route ``load_model(folder, torch.bfloat16,
embeddings="int8")``.

    python -m optq quantize smollm2-135m -o /tmp/smol --method rtn --group-size 64 --nsamples 8 --seqlen 128
    python benchmarks/load_memory.py /tmp/smol [--label NAME]

The children import the optq that ``PYTHONPATH`` names (this tree when unset): run it with
another tree's path to measure that tree's loader.

Prints the table and writes ``benchmarks/results/load_memory.json`` (one section per ``--label``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "load_memory.json"
MB = 1e6
ROUTES = ("optq.load", "lean")

CHILD = r"""
import gc, json, os, sys, time
folder, route = sys.argv[1], sys.argv[2]
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM
import optq
from optq.data.zoo.load import load_model

def resident():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def high_water():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

config = json.load(open(os.path.join(folder, "config.json")))
config.pop("quantization_config", None)
with init_empty_weights():  # the model class's imports, as the loader will need them
    AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
gc.collect()
base = resident()
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
start = time.perf_counter()
if route == "lean":
    model, _ = load_model(folder, torch.bfloat16, embeddings="int8")
else:
    model = optq.load(folder)
peak = high_water()  # not ru_maxrss: that also holds the forking parent's size at exec
seconds = time.perf_counter() - start
print(json.dumps({"base": base, "peak": peak, "loaded": resident(), "seconds": seconds}))
"""


def measure(folder: Path, route: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """One fresh process loading ``folder`` by ``route``: bytes at base, peak and loaded.

    ``env``: variables added to the child's environment (the tests fix glibc's mmap threshold
    with ``MALLOC_MMAP_THRESHOLD_``: its dynamic growth makes the peak vary by up to 27 MB from
    run to run, whether one freed temporary went back to the system or stayed on the heap)."""
    path = os.environ.get("PYTHONPATH") or str(ROOT)  # which optq: PYTHONPATH's
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), route],
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # not this tree's optq by accident: ``-c`` puts the cwd first on the path
        env=env,
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["overhead"] = row["peak"] - row["base"]
    row["model"] = row["loaded"] - row["base"]
    row["ratio"] = row["overhead"] / row["model"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a checkpoint saved by optq")
    p.add_argument("--label", default="current", help="section of the JSON to write")
    p.add_argument("--repeat", type=int, default=1, help="runs per route (the table shows each)")
    args = p.parse_args()
    rows = []
    print(f"{'route':<10} {'imports MB':>10} {'peak +MB':>9} {'loaded +MB':>10} {'peak/loaded':>11} {'seconds':>7}")
    for route in ROUTES:
        for _ in range(args.repeat):
            row = {"route": route, **measure(args.folder, route)}
            rows.append(row)
            print(
                f"{route:<10} {row['base'] / MB:>10.0f} {row['overhead'] / MB:>9.0f} "
                f"{row['model'] / MB:>10.0f} {row['ratio']:>11.3f} {row['seconds']:>7.1f}"
            )
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[args.label] = {"folder": str(args.folder), "rows": rows}
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
