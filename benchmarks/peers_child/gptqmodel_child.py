"""GPTQModel on the benchmark's calibration ids: GPTQ (its defaults) or GPTAQ (alpha 0.25, its
default), written in the GPTQ format."""

from __future__ import annotations

from _child import Clock, arguments, calibration_ids

args = arguments()
ids = calibration_ids(args.ids)
clock = Clock()
import os  # noqa: E402

# its default CPU pool is (cores + 1) // 2 = 1 worker here, less than its model loader's 2: refused
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
import gptqmodel  # noqa: E402
import torch  # noqa: E402
from gptqmodel import GPTQModel, QuantizeConfig  # noqa: E402
from gptqmodel.quantization.config import GPTAQConfig  # noqa: E402

gptaq = GPTAQConfig(device="cpu") if args.variant == "gptaq" else None
config = QuantizeConfig(bits=args.bits, group_size=args.group_size, sym=True, gptaq=gptaq, offload_to_disk=False)
model = GPTQModel.load(args.model, config, device="cpu", dtype=torch.float32)
model.quantize([{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids])
model.save(args.out)
asked = f"desc_act {config.desc_act}, act_group_aware {config.act_group_aware}, damp {config.damp_percent}"
clock.finish(
    gptqmodel.__version__,
    f"{args.variant}, sym, {asked}, calibration batch 1 (its defaults), 2 CPU workers, format gptq",
)
