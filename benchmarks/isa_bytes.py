"""Do a quantization's bytes depend on the CPU's instruction set? One small real quantization,
repeated in a child process under settings that change which vector kernels torch and MKL run.

    python benchmarks/isa_bytes.py [--blocks 2] [--nsamples 8] [--seqlen 256]

Each child quantizes the first ``--blocks`` decoder blocks of SmolLM2-135M with the default
method (4 bits, group 64) on ``--nsamples`` x ``--seqlen`` enwiki calibration tokens, and prints
the sha256 of the quantized blocks' state dict and the float model's summed NLL on 4 windows of
512 enwiki tokens. The settings:

- ``native``: nothing set (torch and MKL pick this CPU's best kernels);
- ``aten-default``: ``ATEN_CPU_CAPABILITY=default``, ATen's own kernels without vector units;
- ``mkl-compatible``: ``MKL_CBWR=COMPATIBLE``, MKL's code path that every x86 CPU runs;
- ``pinned``: ``MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2``, both held to AVX2 (where the CPU has
  it): the candidate for the same bytes on every x86 CPU with AVX2, AVX-512 ones included.

A setting whose hash differs from ``native``'s changes the bytes on this machine, so a CPU that
picks other kernels by itself can too. Whether ``pinned`` gives the same bytes on two machines is
answered by running this on both: the results are kept in benchmarks/results/isa_bytes.json
under each CPU's name and vector flags.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time

from common import ROOT, md_table, weights_sha256

RESULTS = ROOT / "benchmarks" / "results" / "isa_bytes.json"
SETTINGS = {
    "native": {},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "pinned": {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
_CONTROLLED = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")


def child(blocks: int, nsamples: int, seqlen: int) -> dict:
    import torch

    import optq
    from optq.data.tokens import calibration_tokens, eval_windows, load_tokens
    from optq.data.zoo import load_model
    from optq.eval.perplexity import perplexity_detail

    model, tokenizer = load_model("smollm2-135m")
    calib = calibration_tokens(load_tokens("enwiki", tokenizer, "calib"), nsamples, seqlen, seed=0)
    windows = eval_windows(load_tokens("enwiki", tokenizer, "eval"), 512, 4)
    head = copy.deepcopy(model)
    head.model.layers = head.model.layers[:blocks]
    head.config.num_hidden_layers = blocks
    t0 = time.perf_counter()
    optq.quantize(head, calib, optq.QuantConfig(bits=4, group_size=64), batch_size=8, progress=False)
    seconds = time.perf_counter() - t0
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "sha256": weights_sha256(head.model.layers),
        "fp_nll_sum": perplexity_detail(model, windows).nll_sum,
        "quantize_s": round(seconds, 1),
    }


def cpu() -> dict:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return {"name": name, "vector_flags": vector, "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("ISA_RESULT " + json.dumps(child(args.blocks, args.nsamples, args.seqlen)))
        return 0
    runs = {}
    base = {k: v for k, v in os.environ.items() if k not in _CONTROLLED}
    for name, env in SETTINGS.items():
        cmd = [sys.executable, __file__, "--child", f"--blocks={args.blocks}"]
        cmd += [f"--nsamples={args.nsamples}", f"--seqlen={args.seqlen}"]
        proc = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ISA_RESULT ")]
        if proc.returncode or not lines:
            runs[name] = {"env": env, "error": (proc.stderr.strip().splitlines() or ["no result"])[-1]}
        else:
            runs[name] = {"env": env, **json.loads(lines[-1].split(" ", 1)[1])}
        print(f"{name}: {runs[name]['sha256'][:16] if 'sha256' in runs[name] else runs[name]['error']}", flush=True)
    native = runs["native"].get("sha256")
    rows = [
        [
            name,
            " ".join(f"{k}={v}" for k, v in r["env"].items()) or "-",
            r.get("capability", "-"),
            r["sha256"][:16] if "sha256" in r else r["error"],
            "-" if "sha256" not in r else ("same" if r["sha256"] == native else "differs"),
            r.get("fp_nll_sum", "-"),
            r.get("quantize_s", "-"),
        ]
        for name, r in runs.items()
    ]
    print(md_table(["setting", "environment", "ATen", "sha256", "bytes vs native", "fp NLL sum", "s"], rows))
    machine = cpu()
    entry = {
        "cpu": machine,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "runs": runs,
    }
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"machines": {}}
    key = machine["name"] + " [" + " ".join(machine["vector_flags"]) + "]"
    results["machines"][key] = entry
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS} under {key!r}")
    across = [  # every machine measured so far, same settings only
        [name, *(e["runs"].get(s, {}).get("sha256", "-")[:16] for s in SETTINGS)]
        for name, e in results["machines"].items()
        if e["settings"] == entry["settings"]
    ]
    print("\nEvery machine in the results, sha256 by setting:\n")
    print(md_table(["cpu", *SETTINGS], across))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
