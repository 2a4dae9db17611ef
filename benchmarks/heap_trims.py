"""What the calibration's heap trims cost on the CPU: ``optq.quantize`` with and without them.

``optq.core.memory.releaser`` calls glibc's ``malloc_trim(0)`` after every batch's forward of a
block; issue 34 counted about a quarter of a run's CPU time as kernel time. Each variant runs
in a fresh process on the same random Llama (SmolLM2-135M's widths, fewer layers) and
calibration tokens, method gptq, and reports its user and system CPU time, wall time, minor
page faults and peak resident size; "trim" also reports the number of trims and the CPU time
spent inside them (this thread's rusage around each call). Variants:

- ``trim``: the library's default (trims, glibc's dynamic mmap threshold);
- ``none``: the releaser replaced by a no-op (no trims);
- ``trim+fixed`` / ``none+fixed``: the same after ``fix_mmap_threshold()`` (what ``optq
  quantize`` sets on the CPU).

The weights are hashed in each variant: trims change no result, and the script checks that.

    python benchmarks/heap_trims.py [--layers 4] [--nsamples 32] [--seqlen 256] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from common import ROOT, md_table, weights_sha256

VARIANTS = ("trim", "none", "trim+fixed", "none+fixed")


def _cpu(who: int) -> tuple[float, float, int]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def worker(variant: str, layers: int, nsamples: int, seqlen: int) -> dict:
    import torch
    import transformers

    import optq
    from optq.core import memory

    torch.set_num_threads(1)  # the column loop is serial anyway; one thread keeps the runs comparable
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=layers,
        max_position_embeddings=seqlen,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    calib = torch.randint(0, 4096, (nsamples, seqlen), generator=torch.Generator().manual_seed(1))
    if variant.endswith("+fixed"):
        assert memory.fix_mmap_threshold()
    trims = {"n": 0, "user": 0.0, "sys": 0.0}
    real = memory.releaser

    def counted(device):
        fn = real(device)

        def trim():
            u0, s0, _ = _cpu(resource.RUSAGE_THREAD)
            fn()
            u1, s1, _ = _cpu(resource.RUSAGE_THREAD)
            trims["n"] += 1
            trims["user"] += u1 - u0
            trims["sys"] += s1 - s0

        return trim

    memory.releaser = counted if variant.startswith("trim") else (lambda device: memory._noop)
    memory.release_host_memory()
    u0, s0, f0 = _cpu(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    optq.quantize(model, calib, optq.QuantConfig(bits=4, group_size=128), method="gptq", progress=False)
    wall = time.perf_counter() - t0
    u1, s1, f1 = _cpu(resource.RUSAGE_SELF)
    return {
        "variant": variant,
        "wall_s": round(wall, 2),
        "user_s": round(u1 - u0, 2),
        "sys_s": round(s1 - s0, 2),
        "minor_faults": f1 - f0,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "trims": trims["n"] if variant.startswith("trim") else 0,
        "trim_user_s": round(trims["user"], 3),
        "trim_sys_s": round(trims["sys"], 3),
        "weights_sha256": weights_sha256(model)[:16],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.nsamples, args.seqlen)))
        return
    rows = []
    for _ in range(args.repeat):
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--worker", variant]
            cmd += ["--layers", str(args.layers), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    assert len({r["weights_sha256"] for r in rows}) == 1, "the trims changed the weights"
    keys = ["variant", "wall_s", "user_s", "sys_s", "minor_faults", "peak_rss_mb", "trims", "trim_user_s", "trim_sys_s"]
    print(md_table(keys, [[r[k] for k in keys] for r in rows]))
    result = {"settings": vars(args) | {"worker": None}, "rows": rows}
    (ROOT / "benchmarks" / "results" / "heap_trims.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
