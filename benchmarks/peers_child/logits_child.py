"""A checkpoint's logits through its own library's loader, in that library's virtualenv:
``gptqmodel`` (GPTQModel.load, its CPU kernels) or ``transformers`` (from_pretrained; for
compressed-tensors it decompresses with the compressed-tensors package)."""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file, save_file

ap = argparse.ArgumentParser()
ap.add_argument("--variant", help="unused: run_child passes it to every child")
ap.add_argument("--loader", choices=["gptqmodel", "transformers"], required=True)
ap.add_argument("--model", required=True)
ap.add_argument("--ids", required=True)
ap.add_argument("--out", required=True)
args = ap.parse_args()
ids = load_file(args.ids)["ids"]
if args.loader == "gptqmodel":
    from gptqmodel import GPTQModel

    model = GPTQModel.load(args.model, device="cpu", dtype=torch.bfloat16).model  # its CPU kernels' dtype
else:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
with torch.no_grad():
    logits = model(ids).logits.float()
save_file({"logits": logits.contiguous()}, args.out)
print(f'PEER_RESULT {{"loader": "{args.loader}", "class": "{type(model).__name__}"}}')
