"""``optq demo``: show GPTQ against round-to-nearest on one real-sized layer."""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="quantize one real-sized layer and compare GPTQ with round-to-nearest",
        description="Quantize a synthetic layer with transformer-like correlated inputs at several "
        "widths and print the relative output error of round-to-nearest and GPTQ.",
    )
    p.add_argument("--size", type=int, default=2048, help="layer width (in = out), default 2048")
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens, default 2048")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import optq
    from optq.synthetic import correlated_inputs

    from . import CliError

    if args.size < 8 or args.tokens < 1:
        raise CliError("--size must be at least 8 and --tokens at least 1")
    torch.manual_seed(args.seed)
    X = correlated_inputs(args.tokens, args.size, seed=args.seed)
    W = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(args.seed + 1)) * 0.02
    h = optq.Hessian(args.size)
    h.update(X)
    H = h.matrix()
    energy = optq.objective(W, torch.zeros_like(W), H)
    print(f"layer {args.size}x{args.size}, {args.tokens} correlated calibration tokens, group size {args.group_size}")
    print(f"{'bits':>4} {'act_order':>9} {'rtn rel.err':>12} {'gptq rel.err':>12} {'gptq/rtn':>9} {'solve s':>8}")
    for bits in (2, 3, 4, 8):
        for act_order in (False, True):
            cfg = optq.QuantConfig(bits=bits, group_size=args.group_size, act_order=act_order)
            t = time.perf_counter()
            sol = optq.gptq(W, H, cfg)
            dt = time.perf_counter() - t
            rtn = optq.objective(W, optq.rtn(W, cfg).weight, H)
            print(
                f"{bits:>4} {str(act_order):>9} {rtn / energy:12.3e} {sol.loss / energy:12.3e} "
                f"{sol.loss / rtn:9.3f} {dt:8.2f}"
            )
    print("rel.err = ||(W - Ŵ)X||² / ||WX||² on the calibration inputs (lower is better)")
    return 0
