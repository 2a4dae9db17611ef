"""The dry-run plan of large models, as a markdown table for docs/scale.md.

Predicted peak RAM and disk of ``quantize_pretrained`` (``optq.pipeline.planning.predict``; no weights
needed: the configs below are the models' config.json values) for Llama-3-8B, Llama-3-70B,
Llama-3.1-405B and DeepSeek-V3 at 128 x 2048 calibration tokens, bf16 source, 4-bit g128,
strategy replay, 5 GB output shards. Peak RAM is given for float32 block compute (the CPU
default) and for bfloat16 compute (the CUDA default, where the block itself sits on the GPU but
the host still holds activations, embeddings and the solve's Hessian in this accounting).

    python benchmarks/plan_table.py [--json benchmarks/results/scale_plan_table.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import ROOT, md_table

import optq
from optq.pipeline.planning import plan
from optq.pipeline.planning.runplan import GB

LLAMA = {
    "model_type": "llama",
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
MODELS = {
    "Llama-3-8B": dict(
        LLAMA,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "Llama-3-70B": dict(
        LLAMA,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "Llama-3.1-405B": dict(
        LLAMA,
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
    ),
    "DeepSeek-V3 (671B MoE)": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
    },
}


def _brief(plan_dict: dict) -> dict:
    # Every block's linears listed would be 20 MB for DeepSeek-V3 (47k expert linears): counts only.
    for b in plan_dict["blocks"]:
        lin = b.pop("linears")
        b["linears"] = len(lin)
        b["quantized"] = sum(x["quantized"] for x in lin)
    return plan_dict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "scale_plan_table.json"))
    args = p.parse_args()
    config = optq.QuantConfig(bits=4, group_size=128)
    rows, out, notes = [], {}, []
    for name, cfg in MODELS.items():
        kw = {"nsamples": args.nsamples, "seqlen": args.seqlen, "config": config, "source_dtype": torch.bfloat16}
        fp32 = plan(cfg, compute_dtype=torch.float32, **kw)
        bf16 = plan(cfg, compute_dtype=torch.bfloat16, **kw)
        r, d = fp32.ram, fp32.disk
        params = sum(b["params"] for b in fp32.blocks)
        q = sum(x["in"] * x["out"] for b in fp32.blocks for x in b["linears"] if x["quantized"])
        out[name] = {"float32": _brief(fp32.to_dict()), "bfloat16": _brief(bf16.to_dict()), "quantized_weights": q}
        rows.append(
            [
                name,
                f"{params / 1e9:.0f}B in {len(fp32.blocks)} blocks",
                f"{r['one block'] / GB:.1f}",
                f"{fp32.capture['embeddings (+ norm)'] / GB:.1f}",
                f"{r['activations'] / GB:.1f}",
                f"{(r['hessians'] + r['solve workspace']) / GB:.1f}",
                f"**{fp32.peak_ram / GB:.1f}**",
                f"{bf16.peak_ram / GB:.1f}",
                f"{fp32.output_bytes / GB:.0f}",
                (
                    f"{d['journal: packed blocks'] / GB:.0f} + "
                    f"{d['journal: activations (2 files while replaced)'] / GB:.1f}"
                ),
                f"{fp32.disk_peak / GB:.0f}",
            ]
        )
        notes += [f"{name}: {n}" for n in fp32.notes]
    head = [
        "model",
        "block params",
        "one block (fp32)",
        "embeddings (fp32)",
        "activations T·h·4",
        "Hessian + solve",
        "peak RAM, fp32 compute",
        "peak RAM, bf16 compute",
        "output",
        "journal (blocks + activations)",
        "disk at peak",
    ]
    print(
        f"Predicted by `optq quantize --dry-run` (optq.pipeline.planning.predict) at {args.nsamples} x {args.seqlen} "
        "calibration tokens, bf16 source, 4-bit g128, strategy replay; GB = 1e9 bytes.\n"
    )
    print(md_table(head, rows))
    for n in notes:
        print(f"\n{n}")
    Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
