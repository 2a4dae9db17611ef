"""vLLM CPU rows of benchmarks/inference.py: one child process of vLLM's interpreter per variant
and round, measuring every batch size in turn.

The child imports only vLLM and the standard library (vLLM's virtualenv has no optq: ``optq
install-vllm``). vLLM's engine runs inside the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
the child's resident memory is the engine's. For each batch size B, on B prompts of P random
token ids (the same ids for every variant), after a warm-up of those shapes:

- prefill: B * P / the seconds of a ``generate`` asking for one token per prompt
- decode: B * (D - 1) / (the seconds of a ``generate`` asking for D tokens, EOS ignored, minus
  the one-token call's seconds)
- RSS: the child's resident memory after that batch size's runs minus before loading the model
  (vLLM and torch already imported); it holds the key-value cache vLLM reserves
  (``kv_cache_bytes``, sized for the largest batch: reported)

``enforce_eager`` (vLLM's CPU graph capture is not measured), activations in bfloat16 (the only
dtype its CPU GPTQ kernel takes; the float model is run in it too).
"""

from __future__ import annotations

import json
import os
import random
import subprocess

CHILD = r"""
import json, os, sys, time
spec = json.loads(sys.argv[1])
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
base = rss_mb()
t0 = time.perf_counter()
llm = LLM(model=spec["folder"], dtype="bfloat16", max_model_len=spec["prompt"] + spec["decode"],
          enforce_eager=True, gpu_memory_utilization=0.1, kv_cache_memory_bytes=spec["kv_cache_bytes"],
          max_num_seqs=max(spec["batches"]), max_num_batched_tokens=max(spec["batches"]) * spec["prompt"],
          seed=0, skip_tokenizer_init=True)
load_s = time.perf_counter() - t0
rss_load = rss_mb() - base
def run(prompts, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == n for o in out), "vLLM stopped early"
    return seconds
rows = []
for b in spec["batches"]:
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["ids"][:b]]
    t = time.perf_counter()
    run(prompts, 4)
    warmup_s = time.perf_counter() - t
    first = run(prompts, 1)
    whole = run(prompts, spec["decode"])
    rows.append({
        "batch": b,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "prefill_tok_s": b * spec["prompt"] / first,
        "decode_tok_s": b * (spec["decode"] - 1) / max(whole - first, 1e-9),
        "rss_load_mb": rss_load,
        "rss_mb": rss_mb() - base,
        "kv_cache_mb": spec["kv_cache_bytes"] / 1e6,
    })
print(json.dumps(rows))
"""


def kv_cache_bytes(folder: str, batch: int, tokens: int) -> int:
    """Bytes of a bfloat16 key-value cache holding ``batch`` sequences of ``tokens``, plus a quarter
    (vLLM allocates whole blocks), at least 64 MiB."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * 2
    return max(64 << 20, int(batch * tokens * per_token * 1.25))


def prompt_ids(vocab: int, batch: int, prompt: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``prompt`` random token ids (the same for every variant)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(batch)]


def measure(spec: dict, python: str) -> list[dict]:
    """One round of one vLLM variant: a row per batch size in ``spec["batches"]``."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": ""}
    proc = subprocess.run([python, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{spec['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
