"""Where the int4 kernel stops paying: QuantLinear's two CPU paths against fp32 matmul, by rows.

For SmolLM2-135M's layer shapes (576 -> 576, 576 -> 1536, 1536 -> 576) at 2, 4 and 8 bits,
group 64: microseconds per call of PyTorch's int4 kernel (the decode path), of dequantize +
bfloat16 matmul (the prefill path) and of float32 ``F.linear``, for 1 to 256 rows (tokens). The
crossover sets ``optq.formats.cpu_kernels.PREFILL_ROWS``. Median of ``--repeats`` timed
loops, all variants interleaved in one process. Note: a layer's weights fit this CPU's caches,
so fp32 looks better here than in a whole model, where it reads 4 bytes per weight from memory.

    python benchmarks/prefill_kernels.py [--rows 1,2,4,8,16,32,64,256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from common import ROOT

from optq.core.config import QuantConfig
from optq.core.solver import rtn
from optq.formats import cpu_kernels
from optq.formats.qlinear import QuantLinear

SHAPES = [(576, 576), (576, 1536), (1536, 576)]


def _time(fn, loops: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(loops):
        fn()
    return (time.perf_counter() - start) / loops * 1e6


def _paths(q: QuantLinear, fast: cpu_kernels.FastWeight, weight: torch.Tensor, x: torch.Tensor) -> dict:
    return {
        "int4": lambda: cpu_kernels.matmul(fast, x),
        "dequant": lambda: cpu_kernels.matmul(fast, x, q.dense_weight(fast)),
        "fp32": lambda: F.linear(x, weight),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--bits", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{'K':>5s} {'N':>5s} {'bits':>4s} {'rows':>5s} {'int4 us':>9s} {'dequant+bf16 us':>15s} {'fp32 us':>9s}")
    for k, n in SHAPES:
        weight = torch.randn(n, k)
        for bits in (int(b) for b in args.bits.split(",")):
            q = QuantLinear.from_solution(rtn(weight, QuantConfig(bits=bits, group_size=64)))
            fast = q._fast_layout(torch.zeros(1, k))
            assert fast is not None
            for m in rows:
                x = torch.randn(m, k)
                loops = max(3, 2000 // m)
                fns = _paths(q, fast, weight, x)
                times: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(args.repeats):
                    for name, fn in fns.items():
                        times[name].append(_time(fn, loops))
                row = {"k": k, "n": n, "bits": bits, "rows": m, **{f: statistics.median(t) for f, t in times.items()}}
                results.append(row)
                print(f"{k:5d} {n:5d} {bits:4d} {m:5d} {row['int4']:9.1f} {row['dequant']:15.1f} {row['fp32']:9.1f}")
    out = ROOT / "benchmarks" / "results" / "prefill_kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"prefill_rows": cpu_kernels.PREFILL_ROWS, "threads": torch.get_num_threads(), "results": results}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
