"""optq (this checkout) on the benchmark's calibration ids: the default (GPTAQ), GPTQ or RTN; a
variant ending in ``-mse`` also fits each group's range by least squared rounding error (``--mse``)."""

from __future__ import annotations

from _child import Clock, arguments, calibration_ids

args = arguments()
ids = calibration_ids(args.ids)
clock = Clock()  # optq's imports count, as the other peers' do after their own import
import optq  # noqa: E402

method, mse = args.variant.removesuffix("-mse"), args.variant.endswith("-mse")
config = optq.QuantConfig(bits=args.bits, group_size=args.group_size, sym=True, mse=mse)  # act_order: default on
optq.quantize_pretrained(args.model, args.out, ids, config, method=method, progress=False, overwrite=True, probes=False)
clock.finish(
    optq.__version__,
    f"method {method}{', mse range search' if mse else ''}, sym, act_order + static groups (optq's default), "
    "format gptq, no probe prompts",
)
