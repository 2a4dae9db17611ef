"""A peer's allocation beside ours: auto-round's AutoScheme at the same average bits.

auto-round (0.16) chooses each layer's scheme under an average-bits target by its "delta loss"
(gradients of the model's loss through fake-quantized layers). Its allocation is taken here and
quantized by optq as ``--target-bits``' candidates are (the default method, every layer at its
allocated bits and group size, 32 x 512 enwiki calibration), so the two allocations differ only
in how they were chosen. Its stored bits are counted by optq's checkpoint layout, as ours are.

auto-round needs its own environment with this torch (its dependencies would replace ours):

    python -m venv /tmp/arvenv && /tmp/arvenv/bin/pip install torch==2.13.0 transformers==5.24.0 auto-round==0.16.1
    python benchmarks/autoscheme.py --python /tmp/arvenv/bin/python [--target-bits 3.5] [--nsamples 16]

AutoScheme's options: symmetric 2-, 3- and 4-bit at groups 64 and 32 (group 128 does not divide
SmolLM2's 576-wide inputs), q/k/v and gate/up sharing a scheme as vLLM needs; its calibration:
enwiki's calibration text in chunks of about 4000 characters, ``--nsamples`` x 512 tokens. Adds
the row to benchmarks/results/autoscheme.json and prints it beside ``benchmarks/allocation.py``'s
rows for the same budget.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import optq
from optq.core.config import QuantConfig
from optq.data import zoo
from optq.data.tokens import load_text, tokenize
from optq.eval.perplexity import perplexity
from optq.pipeline.allocation import options

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OPTIONS = ["W2A16G64", "W3A16G64", "W3A16G32", "W4A16G64", "W4A16G32"]

CHILD = """
import json, sys, time, torch
from optq.data import zoo
from optq.data.tokens import load_text
from auto_round.auto_scheme.gen_auto_scheme import AutoScheme, GenScheme
model_name, bits, nsamples, options, data, out = sys.argv[1:]
model, tok = zoo.load_model(model_name)
chunks, cur = [], ""
for line in load_text("enwiki", "calib").split("\\n"):
    cur += line + "\\n"
    if len(cur) > 4000:
        chunks.append(cur)
        cur = ""
with open(data, "w") as fh:
    fh.writelines(json.dumps({"text": c}) + "\\n" for c in chunks)
names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
shared = []
for i in range(model.config.num_hidden_layers):
    b = f"model.layers.{i}."
    shared += [[b + f"self_attn.{p}_proj" for p in "qkv"], [b + "mlp.gate_proj", b + "mlp.up_proj"]]
scheme = AutoScheme(avg_bits=float(bits), options=options.split(","), shared_layers=shared, nsamples=int(nsamples),
                    seqlen=512, batch_size=4, device_map="cpu")
t = time.perf_counter()
cfg = GenScheme(scheme, model, names, {}, dataset=data, tokenizer=tok, device_map="cpu",
                enable_torch_compile=False).get_layer_config()
alloc = {n: [c["bits"], c["group_size"]] for n, c in cfg.items() if n in names}
json.dump({"alloc": alloc, "seconds": time.perf_counter() - t}, open(out, "w"))
"""


def autoscheme(python: str, model: str, bits: float, nsamples: int) -> dict:
    """AutoScheme's allocation ({linear: [bits, group]}) and its time, from ``python``'s auto-round."""
    with tempfile.TemporaryDirectory() as tmp:
        out, data = Path(tmp) / "alloc.json", Path(tmp) / "calib.jsonl"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        args = [model, str(bits), str(nsamples), ",".join(OPTIONS), str(data), str(out)]
        subprocess.run([python, "-c", CHILD, *args], env=env, check=True)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", required=True, help="an interpreter with auto-round installed (see above)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--target-bits", type=float, default=3.5)
    ap.add_argument("--nsamples", type=int, default=16, help="AutoScheme's calibration sequences of 512 tokens")
    ap.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens per corpus")
    ap.add_argument("--corpora", default="enwiki,debref-de,code")
    args = ap.parse_args()
    found = autoscheme(args.python, args.model, args.target_bits, args.nsamples)
    allocation = {n: tuple(s) for n, s in found["alloc"].items()}
    torch.manual_seed(0)
    model, tok = zoo.load_model(args.model)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if n in allocation}
    stored = sum(options.stored_bits(shapes[n], s, QuantConfig(), "gptq") for n, s in allocation.items())
    bpw = stored / sum(a * b for a, b in shapes.values())
    calib = tokenize(load_text("enwiki", "calib"), tok)
    t = time.perf_counter()
    q = copy.deepcopy(model)
    overrides = [(n, {"bits": b, "group_size": g}) for n, (b, g) in allocation.items()]
    report = optq.quantize(q, calib, QuantConfig(), overrides=overrides, nsamples=32, seqlen=512, progress=False)
    run_s = time.perf_counter() - t
    evals = {c: tokenize(load_text(c, "eval"), tok) for c in args.corpora.split(",")}
    ppl = {c: perplexity(q, evals[c], seqlen=512, windows=args.windows) for c in evals}
    method = (report.to_dict().get("options") or {}).get("method")
    row = {
        "model": args.model,
        "target_bits": args.target_bits,
        "bits_per_weight": bpw,
        "options": OPTIONS,
        "autoscheme_nsamples": args.nsamples,
        "autoscheme_seconds": found["seconds"],
        "method": method,
        "calibration": "32 x 512 enwiki",
        "eval": f"{args.windows} x 512 per corpus",
        "quantized": ppl,
        "run_seconds": run_s,
        "layers": {n: list(s) for n, s in allocation.items()},
    }
    path = RESULTS / "autoscheme.json"
    rows = json.loads(path.read_text()) if path.exists() else {}
    rows[f"{args.model}-{args.target_bits:g}"] = row
    path.write_text(json.dumps(rows, indent=1))
    print(f"AutoScheme at {args.target_bits} bits: {bpw:.3f} bits/weight stored, chosen in {found['seconds']:.0f} s")
    print("  quantized by optq (" + str(method) + "): " + ", ".join(f"{c} {v:.2f}" for c, v in ppl.items()))
    name = "allocation.json" if args.target_bits == 3.5 else f"allocation-{args.model}-{args.target_bits:g}.json"
    ours = RESULTS / name
    if ours.exists():
        d = json.loads(ours.read_text())
        for key, r in d["rows"].items():
            if "quantized" in r:
                text = ", ".join(f"{c} {r['quantized'][c]:.2f}" for c in ppl if c in r["quantized"])
                print(f"  {key:32} {r['bits_per_weight']:.3f}: {text}")


if __name__ == "__main__":
    sys.exit(main())
