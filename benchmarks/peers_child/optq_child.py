"""optq (this checkout) on the benchmark's calibration ids: the default (GPTAQ), GPTQ or RTN."""

from __future__ import annotations

from _child import Clock, arguments, calibration_ids

args = arguments()
ids = calibration_ids(args.ids)
clock = Clock()  # optq's imports count, as the other peers' do after their own import
import optq  # noqa: E402

config = optq.QuantConfig(bits=args.bits, group_size=args.group_size, sym=True)  # act_order: default on
optq.quantize_pretrained(
    args.model, args.out, ids, config, method=args.variant, progress=False, overwrite=True, probes=False
)
clock.finish(
    optq.__version__,
    f"method {args.variant}, sym, act_order + static groups (optq's default), format gptq, no probe prompts",
)
