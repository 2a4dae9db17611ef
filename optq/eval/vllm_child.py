"""The script :mod:`optq.eval.vllm` runs with vLLM's interpreter (a virtualenv without optq): it
imports only vLLM and the standard library. It reads one JSON job on stdin, ``{"checkpoints":
[{"path", "dtype"}, ...], "prompts": [[token ids]], "max_new_tokens", "top_k", "max_model_len",
"kv_cache_bytes"}``, loads each checkpoint in turn and decodes the prompts greedily, and writes
one JSON line per checkpoint after the marker :data:`MARK` on stdout. Before each checkpoint it
writes ``MARK begin <index>`` to stderr, so that the caller can cut vLLM's log per checkpoint.
"""

import json
import os
import sys
import time

# This script's folder holds optq's vllm.py: keep it off the path so that `import vllm` is vLLM.
sys.path = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]
MARK = "@@optq-vllm"


def _kernels(model) -> list:
    """The class names of the quantized-linear kernels (and MoE methods) in a loaded model."""
    found = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        holder = getattr(module, "scheme", None) or method
        kernel = getattr(holder, "kernel", None)
        name = type(kernel).__name__ if kernel is not None else None
        if name is None and method is not None and "MoE" in type(method).__name__:
            name = type(method).__name__
        if name and name not in found:
            found.append(name)
    return found


def _w4a8(model) -> bool:
    """Whether any quantized linear runs vLLM's W4A8 CPU path (8-bit activations): vLLM takes it
    on CPUs with AMX (or RISC-V) unless ``VLLM_CPU_INT4_W4A8=0``."""
    return any(getattr(module, "use_w4a8", False) is True for module in model.modules())


def _allow_amx() -> None:
    """Ask Linux for AMX tile permission before vLLM loads anything. vLLM's weight-only CPU kernel
    (``cpu_gemm_wna16``) takes its AMX micro-kernel on CPUs with AMX but never asks for it; where
    nothing else in the process asked first (oneDNN does, for large enough bfloat16 products),
    its first AMX instruction kills the process with SIGILL: measured on a tiny Llama with
    ``VLLM_CPU_INT4_W4A8=0`` (SmolLM2-135M ran, its float products had asked)."""
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        init()


def _one(job: dict, item: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _allow_amx()
    start = time.perf_counter()
    llm = LLM(
        model=item["path"],
        dtype=item["dtype"],
        max_model_len=job["max_model_len"],
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        max_num_seqs=max(1, len(job["prompts"])),
        seed=0,
        skip_tokenizer_init=True,
    )
    load_s = time.perf_counter() - start
    try:
        kernels, w4a8 = llm.apply_model(lambda model: (_kernels(model), _w4a8(model)))[0]
    except Exception as exc:  # noqa: BLE001 - the log still names the kernel
        print(f"{MARK} apply_model failed: {type(exc).__name__}: {exc}", flush=True)
        kernels, w4a8 = [], None
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_new_tokens"], logprobs=job["top_k"], ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    decode_s = time.perf_counter() - start
    outputs = []
    for r in results:
        c = r.outputs[0]
        steps = [{str(t): float(lp.logprob) for t, lp in (step or {}).items()} for step in (c.logprobs or [])]
        outputs.append({"tokens": list(c.token_ids), "logprobs": steps})
    generated = sum(len(o["tokens"]) for o in outputs)
    del llm
    return {
        "kernels": kernels,
        "w4a8": w4a8,
        "load_s": load_s,
        "decode_s": decode_s,
        "tokens_per_s": generated / decode_s if decode_s > 0 else 0.0,
        "outputs": outputs,
    }


def main() -> None:
    job = json.loads(sys.stdin.read())
    for i, item in enumerate(job["checkpoints"]):
        print(f"{MARK} begin {i}", flush=True)
        try:
            result = _one(job, item)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which raises
            result = {"error": f"{type(exc).__name__}: {exc}"}
        import gc

        gc.collect()
        print(MARK, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
