"""Where the peak RSS of ``optq quantize`` goes: the resident size after each phase of a run.

Runs ``python -m optq quantize MODEL -o OUT`` (default: smollm2-135m at the defaults, 128 x 512
enwiki tokens) in a fresh process with hooks around its phases: the imports, loading the
tokenizer, reading the calibration text, tokenising it, preparing the run (drawing the windows),
building the skeleton, the capture of the first block's inputs, each block, the assembly. At the
end of each phase the child reads its ``VmRSS`` (resident now) and ``VmHWM`` (the highest
resident size since the previous phase ended: the kernel's high-water mark is reset between
phases by writing 5 to ``/proc/self/clear_refs``), so each row's peak is that phase's own. Python
objects (``--tracemalloc``: traced now and at most within the phase) are followed from the
imports to the end of the calibration phase, then tracing stops (it would slow the block loop);
the traces themselves take memory, so the RSS of such a run is not the run's. The peak
of the run is the largest phase peak, and that of any process the run starts (``RUSAGE_CHILDREN``).

    python benchmarks/scale_memory.py [--model smollm2-135m] [--nsamples 128] [--seqlen 512]
                                      [--label NAME] [-- extra quantize flags]

Prints the table, the peak against the dry-run plan's prediction, and writes
``benchmarks/results/scale_memory.json`` (one section per ``--label``).
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
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "scale_memory.json"
MB = 1e6


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Profile:
    """Phase rows: (name, rss after, peak during, python objects now, python peak)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.t = time.perf_counter()

    def mark(self, name: str) -> None:
        s = _status()
        row = {"phase": name, "rss": s["VmRSS"], "peak": s["VmHWM"], "seconds": time.perf_counter() - self.t}
        if tracemalloc.is_tracing():
            row["py_now"], row["py_peak"] = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
        self.rows.append(row)
        with open("/proc/self/clear_refs", "w") as fh:  # VmHWM := VmRSS: the next row's peak is its own
            fh.write("5")
        self.t = time.perf_counter()


def _wrap(owner: object, attr: str, before: str | None, after, profile: Profile, static: bool = False) -> None:
    original = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        if before:
            profile.mark(before)
        result = original(*args, **kwargs)
        profile.mark(after(result) if callable(after) else after)
        return result

    setattr(owner, attr, staticmethod(wrapped) if static else wrapped)


def child(out_json: str, argv: list[str], stop_after: int) -> int:
    profile = Profile()
    profile.mark("python started")
    if os.environ.get("OPTQ_TRACEMALLOC") == "1":  # inflates the RSS: its own run
        tracemalloc.start()
    import torch  # noqa: F401
    import transformers
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    import optq.data.tokens as tokens_mod
    import optq.pipeline.blocks.capture as capture_mod
    import optq.pipeline.stream.quantize as quantize_mod
    import optq.pipeline.stream.sink as sink_mod
    import optq.pipeline.stream.source as source_mod
    from optq.cli import main

    profile.mark("imports (torch, transformers, optq)")
    _wrap(transformers.AutoTokenizer, "from_pretrained", None, "tokenizer loaded", profile, static=True)
    _wrap(tokens_mod, "load_text", None, "calibration text read", profile)
    _wrap(tokens_mod, "tokenize", None, "calibration text tokenised", profile)
    if hasattr(tokens_mod, "calibration_in_subprocess"):  # tokenised in a child: its peak is children_peak
        _wrap(tokens_mod, "calibration_in_subprocess", None, "calibration tokenised (child process)", profile)

    def prepared(_):
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        return "run prepared (windows drawn, batches)"

    _wrap(quantize_mod, "prepare", "before prepare", prepared, profile)
    _wrap(source_mod.SafetensorsSource, "skeleton", None, "skeleton built (meta)", profile)
    _wrap(capture_mod, "capture_inputs", "embeddings + block 0 loaded", "capture of block 0's inputs", profile)
    count = iter(range(1, 10**6))

    def block(_):
        done = next(count)
        if done == stop_after:  # every block peaks alike: the first few show the blocks phase
            profile.mark(f"block {done - 1}")
            _dump(out_json, profile, 0)
            os._exit(0)
        return f"block {done - 1}"

    _wrap(sink_mod.JournalSink, "commit", None, block, profile)
    _wrap(quantize_mod, "assemble", "before assembly", "assembly", profile)
    code = main(argv)
    profile.mark("end")
    _dump(out_json, profile, code)
    return code


def _dump(out_json: str, profile: Profile, code: int) -> None:
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    Path(out_json).write_text(json.dumps({"rows": profile.rows, "children_peak": children, "code": code}))


def _predicted(args: argparse.Namespace, extra: list[str]) -> int:
    cmd = [sys.executable, "-c", _PLAN, args.model, str(args.nsamples), str(args.seqlen), *extra]
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
    return int(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, env=env).stdout.split()[-1])


_PLAN = """
import sys
from optq.cli import build_parser
from optq.cli.quantize import config_from_args, settings_from_args, _model_folder
from optq.pipeline.planning import plan
a = build_parser().parse_args(["quantize", sys.argv[1], "-o", "x", "--nsamples", sys.argv[2],
                               "--seqlen", sys.argv[3], *sys.argv[4:]])
speed = {"flops": 1e9, "solve_unit": 1}
print(plan(_model_folder(a.model), config_from_args(a), settings_from_args(a), speed=speed).peak_ram)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--label", default="current")
    p.add_argument("--tracemalloc", action="store_true", help="follow Python objects too (their traces add to the RSS)")
    p.add_argument("--blocks", type=int, default=0, help="stop after this many blocks (0: the whole run)")
    p.add_argument("--keep", type=Path, default=None, help="write the checkpoint here (kept, for byte comparisons)")
    p.add_argument("--child", nargs=2, metavar=("JSON", "ARGV"), help=argparse.SUPPRESS)
    args, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if args.child:
        return child(args.child[0], json.loads(args.child[1]), args.blocks)
    with tempfile.TemporaryDirectory(prefix="optq-memory-") as tmp:
        out = args.keep or Path(tmp) / "out"
        argv = ["quantize", args.model, "-o", str(out), "--nsamples", str(args.nsamples)]
        argv += ["--seqlen", str(args.seqlen), "--no-progress", "--overwrite", *extra]
        data = Path(tmp) / "profile.json"
        cmd = [sys.executable, __file__, "--child", str(data), json.dumps(argv), "--blocks", str(args.blocks)]
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}  # this checkout's optq
        env["OPTQ_TRACEMALLOC"] = "1" if args.tracemalloc else "0"
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
        result = json.loads(data.read_text())
    rows = result["rows"]
    peak = max(max(r["peak"] for r in rows), result["children_peak"])
    predicted = _predicted(args, extra)
    print(
        f"{'phase':<40} {'RSS after MB':>12} {'peak in phase MB':>16} {'py objects MB':>13} {'py peak MB':>10} {'s':>6}"
    )
    for r in rows:
        py = f"{r['py_now'] / MB:13.1f} {r['py_peak'] / MB:10.1f}" if "py_now" in r else f"{'':>13} {'':>10}"
        print(f"{r['phase']:<40} {r['rss'] / MB:12.0f} {r['peak'] / MB:16.0f} {py} {r['seconds']:6.1f}")
    print(
        f"peak RSS {peak / 1e9:.3f} GB (children {result['children_peak'] / 1e9:.3f} GB); "
        f"the plan predicts {predicted / 1e9:.3f} GB ({predicted / peak - 1:+.1%})"
    )
    section = {
        "model": args.model,
        "nsamples": args.nsamples,
        "seqlen": args.seqlen,
        "flags": extra,
        "blocks_run": args.blocks or "all",
        "rows": rows,
        "children_peak": result["children_peak"],
        "peak_rss": peak,
        "predicted_peak": predicted,
        "prediction_error": predicted / peak - 1,
    }
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved[args.label] = section
    RESULTS.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"wrote {RESULTS} [{args.label}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
