"""Serving speed and memory on CPU: fp32 against optq's 2-, 3-, 4- and 8-bit checkpoints.

Each checkpoint is what `optq quantize MODEL --bits B` writes at the default settings (the
engines' group sizes: 64 on SmolLM2; ``--nsamples`` may cut the calibration, which changes the
codes, not the layout or the speed), made once into ``--work`` and reused. Each measurement
runs in its own child process (so its RSS is that variant's alone), the variants alternating,
``--repeats`` rounds; each number is the best of the rounds (highest speed, lowest memory):

- prefill: tokens/s of the first new token after a ``--prompt``-token prompt, through ``generate``
- decode: tokens/s of the next ``--decode`` - 1 tokens (greedy, no early stop)
- unless ``--no-compile``: each variant of fp32 and optq again with the decoding step
  compiled (``optq generate --compile``: torch.compile, a static KV cache), after a warm-up of
  the same shapes (its time: ``warmup_s``), whose freed memory is then handed back to the system
  as ``optq generate --compile`` does
- unless ``--no-aot``: each variant of fp32 and optq again decoding with the step compiled ahead
  of time (``optq generate --aot``: AOTInductor, a static KV cache; the package is built by a
  child process once and cached: ``aot_ready_s``, the slowest round's, is that build), after a
  warm-up of the same shapes; the package loader is imported before the baseline, the loaded
  package's code and buffers are counted
- RSS: the process's resident memory after the run minus before loading (the loaded model,
  its kernels' caches, the run's activations and what the allocator kept of them; the model
  alone: ``optq.load`` or ``from_pretrained``, no tokenizer); tensors: the model's parameters
  and buffers plus the fast path's packed codes

optq's checkpoints load with the embedding table and head in bfloat16 (``optq.load``'s default);
the 4-bit one is also measured at its leanest (``optq generate --embeddings int8 --dtype
bfloat16``: int8 table and head, bfloat16 norms, activations and KV cache), with the table and
head in fp32 and int8 alone (unless ``--no-storage``), with the perplexity of each storage on
every corpus (``--quality-windows`` windows of 512 tokens of each of ``--quality-texts``), and
through
transformers + GPTQModel 7.7's CPU kernel (bfloat16) where the tests' GPTQModel site is cached
(``--no-gptqmodel`` skips it). The libraries (torch, transformers, optq, the model's code, and
for compiled variants torch's compiler) are imported before the baseline RSS: the model, not
the runtime, is measured; what compiling the model leaves resident is counted.

``--batch 1,16`` measures every variant at each batch size (B prompts of the same length;
tokens/s count every sequence's tokens). Unless ``--no-vllm``, vLLM's CPU engine (in its own
interpreter: ``optq install-vllm``) runs the float model and the 4-bit checkpoint, both in
bfloat16, at each batch size (benchmarks/inference_vllm.py says how).

    python benchmarks/inference.py [--model smollm2-135m] [--bits 4,3,2,8] [--repeats 3]
    python benchmarks/inference.py --bits 4 --batch 1,16 --no-compile --no-aot --no-storage \
        --quality-windows 0 --json benchmarks/results/inference_vllm.json   # the README's serving table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import inference_vllm
from common import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def _checkpoint(model: str, bits: int, work: Path, extra: list[str]) -> Path:
    out = work / f"{model}-{bits}bit"
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "optq", "quantize", model, "-o", str(out), "--bits", str(bits), *extra]
        print(f"making {out.name}: {' '.join(cmd[2:])}", flush=True)
        subprocess.run([*cmd, "--no-progress", "--overwrite"], check=True)
    return out


CHILD = """
import json, sys, time, torch
from optq.eval.speed import TokenClock, rss_mb
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
# the libraries are not the model: import them (and the model's code) before the baseline
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
import optq
MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(spec["folder"]))]
if spec.get("compile"):  # the compiler is a library too (112 MB resident once imported)
    import torch._dynamo, torch._inductor.compile_fx  # noqa: F401
if spec.get("aot"):  # the package loader is a library; the package's code and what it holds are counted
    import torch._inductor.package, optq.eval.aot  # noqa: F401
base = rss_mb()
t0 = time.perf_counter()
extra = 0
if spec["kind"] == "gptqmodel":
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.bfloat16, device_map="cpu").eval()
elif spec["kind"] == "hf":
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32).eval()
else:
    from optq.formats.qlinear import QuantLinear
    dtype = getattr(torch, spec.get("dtype") or "float32")  # of the float parts (optq generate --dtype)
    model = optq.load(spec["folder"], embeddings=spec["embeddings"] or "bfloat16", dtype=dtype)  # builds fast paths
    qs = [m for m in model.modules() if isinstance(m, QuantLinear)]
    fast = sum(q.build_fast_path() for q in qs)
    assert fast == len(qs), f"{len(qs) - fast} layers off the fast path"
    groups = {id(q._fused[0]): q._fused[0] for q in qs if q._fused is not None}  # fused siblings' scales
    extra = sum(q.fast_weight.nbytes() for q in qs) + sum(g.nbytes() for g in groups.values())
load_s, rss_load = time.perf_counter() - t0, rss_mb() - base
batch = spec.get("batch", 1)
ids = torch.randint(0, model.config.vocab_size, (batch, spec["prompt"]))
opts = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
n = spec["decode"]
t0 = time.perf_counter()
decoder = None
if spec.get("aot"):  # the package is built by a child process when not cached (its time: warmup_s)
    from optq.eval.aot import AotDecoder, cache_length
    # load_model's defaults for embeddings=None (bfloat16 for checkpoints, none for float models) are the above's
    load = {"dtype": spec.get("dtype") or "float32", "embeddings": spec["embeddings"]}
    decoder = AotDecoder.for_model(model, spec["folder"], cache_length(spec["prompt"] + n), load=load)
    opts.update(decoder.options())
aot_ready_s = time.perf_counter() - t0
with torch.inference_mode():
    if spec.get("compile"):  # the decoding step compiled; the warm-up has the run's shapes: one compilation
        from optq.eval.speed import compiled_decoding
        opts.update(compiled_decoding())
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **opts)
        from optq.core.memory import release_host_memory
        release_host_memory()  # as optq generate --compile does after its warm-up
    elif decoder is not None:  # the run's shapes, as for compiled variants
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **opts)
    else:
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **opts)
    warmup_s = time.perf_counter() - t0
    clock = TokenClock()
    if decoder is not None:
        opts.update(decoder.options())  # its cache emptied
    model.generate(ids, max_new_tokens=spec["decode"], min_new_tokens=spec["decode"], streamer=clock, **opts)
    if decoder is not None:
        assert decoder.steps >= 2 * (n - 1), decoder.steps  # the warm-up's steps and the run's were compiled
tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
print(json.dumps({
    "load_s": load_s,
    "warmup_s": warmup_s,
    "prefill_tok_s": batch * clock.prefill_tokens_per_s(spec["prompt"]),
    "decode_tok_s": batch * clock.decode_tokens_per_s(),
    "rss_load_mb": rss_load,
    "rss_mb": rss_mb() - base,
    "tensors_mb": (sum(t.numel() * t.element_size() for t in tensors.values()) + extra) / 1e6,
    "aot_steps": decoder.steps if decoder is not None else 0,
    "aot_ready_s": aot_ready_s if decoder is not None else 0.0,
    "kinds": sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}),
}))
"""


def _measure(spec: dict, site: Path | None) -> dict:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"{spec['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


QUALITY = """
import json, sys, torch
from optq.data.tokens import load_tokens
from optq.data.zoo import eval_bos_id, load_model
from optq.eval.perplexity import perplexity_detail
folder, windows, texts = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
out = {}
for kind in ("model", "bfloat16", "int8"):
    model, tok = load_model(folder, embeddings=kind)  # fp32, optq.load's default, int8
    bos = eval_bos_id(folder, tok, model.config)
    out[kind] = {
        text: perplexity_detail(
            model, load_tokens(text, tok, "eval"), seqlen=512, windows=windows, bos_id=bos, progress=False
        ).perplexity
        for text in texts
    }
print(json.dumps(out))
"""
TEXTS = "enwiki,debref-de,code,debref-en,debref-fr,debref-ja,debref-zh-cn,news"


def _gptqmodel_site() -> Path | None:
    from optq.data.corpora import cache_dir

    site = cache_dir() / "test-packages" / "gptqmodel-7.7.0" / "site"
    return site if (site / ".complete").exists() else None


def _named(name: str, batch: int) -> str:
    return name if batch == 1 else f"{name}, batch {batch}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="built-in name or fp folder (default smollm2-135m)")
    ap.add_argument("--bits", default="4,3,2,8", help="checkpoint widths (default 4,3,2,8)")
    ap.add_argument("--work", type=Path, default=None, help="where checkpoints are made and kept")
    ap.add_argument("--nsamples", type=int, default=None, help="calibration sequences of new checkpoints")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quality-windows", type=int, default=8, help="0: skip the perplexity of the memory options")
    ap.add_argument("--quality-texts", default=TEXTS, help=f"corpora for it (default {TEXTS})")
    ap.add_argument("--no-gptqmodel", action="store_true", help="skip transformers + GPTQModel")
    ap.add_argument("--batch", default="1", help="batch sizes, each a row of every variant (default 1; e.g. 1,16)")
    ap.add_argument("--vllm-python", help="vLLM's interpreter (default: as optq verify finds it)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's CPU engine")
    ap.add_argument("--json", type=Path, default=RESULTS / "inference.json", help="results file (default %(default)s)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled variants")
    ap.add_argument("--no-aot", dest="aot", action="store_false", help="skip the ahead-of-time compiled variants")
    ap.add_argument(
        "--no-storage",
        dest="storage",
        action="store_false",
        help="skip the fp32 and int8 embedding variants and their perplexity",
    )
    args = ap.parse_args()
    from optq.data.corpora import cache_dir
    from optq.data.zoo import resolve_model

    work = args.work or cache_dir() / "bench" / "inference"
    work.mkdir(parents=True, exist_ok=True)
    fp = str(resolve_model(args.model))
    bits = [int(b) for b in args.bits.split(",")]
    extra = [] if args.nsamples is None else ["--nsamples", str(args.nsamples)]
    folders = {b: str(_checkpoint(args.model, b, work, extra)) for b in bits}
    variants = [{"name": "fp32", "kind": "hf", "folder": fp, "embeddings": None}]
    variants += [{"name": f"optq {b}-bit", "kind": "optq", "folder": folders[b], "embeddings": None} for b in bits]
    if 4 in bits:  # the leanest loading: int8 embedding table and head, bfloat16 float parts
        lean = {"kind": "optq", "folder": folders[4], "embeddings": "int8", "dtype": "bfloat16"}
        variants.append({"name": "optq 4-bit, int8 embed, bf16", **lean})
    if args.compile:  # the same, with the decoding step compiled (optq generate --compile)
        compiled = [v for v in variants if v["kind"] in ("hf", "optq")]
        variants += [{**v, "name": f"{v['name']}, compiled", "compile": True} for v in compiled]
    if args.aot:  # the same, decoding with the step compiled ahead of time (optq generate --aot)
        plain = [v for v in variants if v["kind"] in ("hf", "optq") and not v.get("compile")]
        variants += [{**v, "name": f"{v['name']}, aot", "aot": True} for v in plain]
    if 4 in bits and args.storage:  # the embedding storage optq.load does not choose by default (bfloat16)
        for kind in ("model", "int8"):
            name = f"optq 4-bit, {'fp32' if kind == 'model' else kind} embed"
            variants.append({"name": name, "kind": "optq", "folder": folders[4], "embeddings": kind})
    site = None if args.no_gptqmodel or 4 not in bits else _gptqmodel_site()
    if site is not None:
        variants.append({"name": "GPTQModel 4-bit (bf16)", "kind": "gptqmodel", "folder": folders[4], "embeddings": ""})
    batches = [int(b) for b in args.batch.split(",")]
    if len(batches) > 1 or batches[0] != 1:  # every variant at every batch size
        variants = [{**v, "name": _named(v["name"], b), "batch": b} for v in variants for b in batches]
    from optq.eval.vllm import vllm_python

    python = None if args.no_vllm or 4 not in bits else vllm_python(args.vllm_python)
    if python is not None:  # one child per variant and round runs every batch size
        fp_config = json.loads((Path(fp) / "config.json").read_text())
        ids = inference_vllm.prompt_ids(fp_config["vocab_size"], max(batches), args.prompt)
        kv = inference_vllm.kv_cache_bytes(fp, max(batches), args.prompt + args.decode)
        for name, folder in (("vLLM fp (bf16)", fp), ("vLLM 4-bit (bf16)", folders[4])):
            variants.append(
                {"name": name, "kind": "vllm", "folder": folder, "batches": batches, "ids": ids, "kv_cache_bytes": kv}
            )
    elif not args.no_vllm:
        print("vLLM's interpreter not found (optq install-vllm, or --vllm-python): no vLLM rows", file=sys.stderr)
    best: dict[str, dict] = {}
    started = time.perf_counter()
    for r in range(args.repeats):
        for v in variants:
            spec = {**v, "prompt": args.prompt, "decode": args.decode}
            try:
                if v["kind"] == "vllm":
                    rows = {_named(v["name"], row["batch"]): row for row in inference_vllm.measure(spec, python)}
                else:
                    rows = {v["name"]: _measure(spec, site if v["kind"] == "gptqmodel" else None)}
            except RuntimeError as exc:
                print(f"round {r + 1}: {exc}", file=sys.stderr)
                continue
            for name, res in rows.items():
                res = {"aot_ready_s": 0.0, "tensors_mb": float("nan"), **res}
                shown = {k: round(x, 1) for k, x in res.items() if isinstance(x, float)}
                print(f"round {r + 1}: {name:28s} {json.dumps(shown)}")
                b = best.setdefault(name, {**res, "folder": v["folder"]})
                for k in ("prefill_tok_s", "decode_tok_s"):
                    b[k] = max(b[k], res[k])
                for k in ("rss_mb", "rss_load_mb", "load_s", "warmup_s", "tensors_mb"):
                    b[k] = min(b[k], res[k])
                b["aot_ready_s"] = max(b["aot_ready_s"], res["aot_ready_s"])  # the round that built the package
    quality = {}
    if args.quality_windows and 4 in bits and args.storage:
        proc = subprocess.run(
            [sys.executable, "-c", QUALITY, folders[4], str(args.quality_windows), args.quality_texts],
            capture_output=True,
            text=True,
        )
        quality = (
            json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
        )
    ref = best.get("fp32")  # the ratios of every row are against fp32 at batch 1 (transformers)
    print(f"\n{args.model}: prompt {args.prompt}, decode {args.decode} tokens, best of {args.repeats}")
    print(
        f"{'variant':40s} {'disk MB':>8s} {'tensors MB':>10s} {'RSS MB':>8s} {'x fp32':>6s} "
        f"{'prefill tok/s':>13s} {'x fp32':>6s} {'decode tok/s':>12s} {'x fp32':>6s}"
    )
    for name, b in best.items():
        b["disk_mb"] = sum(p.stat().st_size for p in Path(b["folder"]).glob("*.safetensors")) / 1e6
        report = Path(b["folder"]) / "quantization_report.json"
        if report.exists():  # how the checkpoint was calibrated
            b["calibration_nsamples"] = json.loads(report.read_text()).get("options", {}).get("nsamples")
        if ref:
            b["rss_x"], b["prefill_x"] = b["rss_mb"] / ref["rss_mb"], b["prefill_tok_s"] / ref["prefill_tok_s"]
            b["decode_x"] = b["decode_tok_s"] / ref["decode_tok_s"]
        size = f"{b['disk_mb']:8.1f} {b['tensors_mb']:10.1f} {b['rss_mb']:8.0f} {b.get('rss_x', 0):6.2f}"
        speed = f"{b['prefill_tok_s']:13.1f} {b.get('prefill_x', 0):6.2f} {b['decode_tok_s']:12.1f}"
        print(f"{name:40s} {size} {speed} {b.get('decode_x', 0):6.2f}")
    if quality and "error" not in quality:
        print(f"\n4-bit perplexity ({args.quality_windows} x 512 tokens per text) by embedding and head storage")
        print(f"{'text':14s} {'fp32':>9s} {'bfloat16':>17s} {'int8':>17s}")
        for text, base in quality["model"].items():
            ppl = [quality[k][text] for k in ("bfloat16", "int8")]
            cells = [f"{p:9.3f} ({100 * (p / base - 1):+.2f}%)" for p in ppl]
            print(f"{text:14s} {base:9.3f} {' '.join(cells)}")
    out = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": args.model,
        "prompt": args.prompt,
        "decode": args.decode,
        "repeats": args.repeats,
        "batches": batches,
        "seconds": round(time.perf_counter() - started, 1),
        "results": best,
        "quality": quality,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
