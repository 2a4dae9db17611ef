"""optq (this checkout) on the benchmark's calibration ids: the default (GPTAQ), GPTQ or RTN.

A variant is a method with an optional suffix saying how each group's range is fitted: none
(optq's default: searched for the least rounding error weighted by the Hessian's diagonal; RTN,
which reads no Hessian: min/max, the rounding baseline every cell has had), ``-mse`` (the same
search unweighted, ``--no-mse-hessian``) or ``-minmax`` (min/max, ``--no-mse``: optq's default
before 2026-12-06)."""

from __future__ import annotations

from _child import Clock, arguments, calibration_ids

args = arguments()
ids = calibration_ids(args.ids)
clock = Clock()  # optq's imports count, as the other peers' do after their own import
import optq  # noqa: E402

method, _, search = args.variant.partition("-")
if method == "rtn" and not search:
    search = "minmax"
fields = {"": {}, "mse": {"mse": True, "mse_hessian": False}, "minmax": {"mse": False}}[search]
config = optq.QuantConfig(bits=args.bits, group_size=args.group_size, sym=True, **fields)  # act_order: default on
optq.quantize_pretrained(args.model, args.out, ids, config, method=method, progress=False, overwrite=True, probes=False)
ranges = {
    "": "ranges searched, weighted by H's diagonal (optq's default)",
    "mse": "ranges searched, unweighted (--no-mse-hessian)",
    "minmax": "min/max ranges (--no-mse)",
}[search]
clock.finish(
    optq.__version__,
    f"method {method}, {ranges}, sym, act_order + static groups (optq's default), format gptq, no probe prompts",
)
