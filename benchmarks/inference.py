"""fp32 vs a 4-bit g128 optq checkpoint: size on disk, resident memory, prefill and decode speed.

Each variant runs in its own subprocess (so RSS is that variant's alone), fp32 and 4-bit
alternating, best of ``--repeats``. The 4-bit model is quantized with round-to-nearest (speed
does not depend on how the codes were chosen), saved with optq.save and loaded with optq.load.

    python benchmarks/inference.py [--model PATH] [--prompt 256] [--decode 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/optq/models/smollm2-135m"
RESULTS = Path(__file__).parent / "results"


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _tiny(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)


def _quantize(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import optq
    from optq.formats.linears import find_linears, get_weight
    from optq.pipeline.blocks.discovery import find_blocks

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prefix, _ = find_blocks(model)
    cfg = optq.QuantConfig(bits=4, group_size=128)
    sols = {
        n: optq.rtn(get_weight(m).detach(), cfg) for n, m in find_linears(model).items() if n.startswith(prefix + ".")
    }
    optq.save(model, dst, solutions=sols, overwrite=True)


def _measure(variant: str, folder: str, prompt: int, decode: int) -> dict:
    """Run in a child process: load, prefill ``prompt`` tokens, decode ``decode`` tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    import optq

    torch.manual_seed(0)
    base = _rss_mb()
    t0 = time.perf_counter()
    if variant == "fp32":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        model = optq.load(folder)
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt))
    with torch.inference_mode():
        model(ids[:, :8], use_cache=True)  # warm-up (kernel caches, allocator)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill_s = time.perf_counter() - t0
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t0
    tensors = sum(
        t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    )
    return {
        "variant": variant,
        "load_s": load_s,
        "prefill_tok_s": prompt / prefill_s,
        "decode_tok_s": decode / decode_s,
        "rss_mb": _rss_mb(),
        "rss_model_mb": _rss_mb() - base,
        "model_tensors_mb": tensors / 1e6,
    }


def _disk_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="fp32 HF folder (default: smollm2-135m cache, else tiny)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child[0], args.child[1], args.prompt, args.decode)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="optq-bench-"))
    src = args.model or (DEFAULT_MODEL if (DEFAULT_MODEL / "config.json").exists() else None)
    if src is None:
        src = work / "tiny-fp32"
        _tiny(src)
    q4 = work / "q4-g128"
    _quantize(src, q4)
    folders = {"fp32": src, "optq 4-bit g128": q4}
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for variant, folder in folders.items():
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "fp32" if variant == "fp32" else "q4",
                str(folder),
                "--prompt",
                str(args.prompt),
                "--decode",
                str(args.decode),
            ]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            prev = best.get(variant)
            if prev is None or r["decode_tok_s"] > prev["decode_tok_s"]:
                r["prefill_tok_s"] = max(r["prefill_tok_s"], prev["prefill_tok_s"]) if prev else r["prefill_tok_s"]
                best[variant] = r
            elif r["prefill_tok_s"] > prev["prefill_tok_s"]:
                prev["prefill_tok_s"] = r["prefill_tok_s"]
    print(f"model: {src}  prompt {args.prompt} tokens, decode {args.decode} tokens, best of {args.repeats}")
    print(
        f"{'variant':18s} {'disk MB':>8s} {'tensors MB':>10s} {'RSS MB':>8s} "
        f"{'prefill tok/s':>14s} {'decode tok/s':>13s}"
    )
    for variant, r in best.items():
        r["disk_mb"] = _disk_mb(folders[variant])
        print(
            f"{variant:18s} {r['disk_mb']:8.1f} {r['model_tensors_mb']:10.1f} {r['rss_mb']:8.0f} "
            f"{r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "inference.json"
    out.write_text(
        json.dumps({"model": str(src), "prompt": args.prompt, "decode": args.decode, "results": best}, indent=2) + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
