"""auto-round on the benchmark's calibration ids: its default recipe (200 iterations of signed
gradient descent per block) or its fastest tuning preset, ``light`` (50 iterations, lr 5e-3,
as ``auto-round-light``), written in the GPTQ format (``auto_gptq``)."""

from __future__ import annotations

from _child import Clock, arguments, calibration_ids

args = arguments()
ids = calibration_ids(args.ids)
clock = Clock()
import auto_round  # noqa: E402
import torch  # noqa: E402
from auto_round import AutoRound  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

preset = {"iters": 50, "lr": 5e-3} if args.variant == "fast" else {}
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(args.model)
data = [{"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]} for row in ids]
rounder = AutoRound(
    model,
    tokenizer,
    scheme="W4A16",
    bits=args.bits,
    group_size=args.group_size,
    sym=True,
    dataset=data,
    nsamples=ids.shape[0],
    seqlen=ids.shape[1],
    device_map="cpu",
    **preset,
)
rounder.quantize_and_save(args.out, format="auto_gptq")
asked = f"{'light preset: ' if preset else 'default: '}{preset or 'iters 200'}, batch 8, sym"
clock.finish(auto_round.__version__, f"{asked}, format auto_gptq")
