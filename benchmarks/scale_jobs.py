"""The jobs of benchmarks/scale.py: one quantization in a fresh process (``scale.py --worker``,
so that its peak RSS is its own), and what the phases build and compare around it: the
synthetic models, the plan's prediction, two checkpoints' tensors byte by byte.

Nothing here imports torch or optq at the top: a worker's runtime RSS is measured after its own
imports.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("scale.py")  # its --worker runs one job
WORK = Path(os.environ.get("OPTQ_SCALE_WORK", "/tmp/optq_scale"))
SYN = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------------------------ worker
def worker(job: dict) -> dict:
    """One quantization in this (fresh) process; returns its measurements."""
    import torch
    import transformers  # noqa: F401  (part of the runtime)

    import optq
    from optq.pipeline.stream.quantize import quantize_pretrained

    runtime = _status("VmRSS")
    calib = _calibration(job)
    from optq.core.memory import fix_mmap_threshold, release_host_memory

    release_host_memory()  # the tokenizer and tokenising's heap, as `optq quantize` frees them
    fix_mmap_threshold()  # as `optq quantize` does on the CPU (the library leaves it alone)
    config = optq.QuantConfig(**job.get("config", {}))
    t0 = time.perf_counter()
    if job["kind"] == "stream":
        report = quantize_pretrained(
            job["source"],
            job["out"],
            calib,
            config,
            max_shard_size=job["shard"],
            resume=job.get("resume", False),
            progress=False,
        )
    else:
        from optq.data.zoo import load_model

        model, _ = load_model(job["source"])
        report = optq.quantize(model, calib, config, progress=False)
        optq.save(model, job["out"], solutions=report.solutions, report=report, max_shard_size=job["shard"])
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "peak_rss": _status("VmHWM"),
        "runtime_rss": runtime,
        "block_s": report.block_seconds,
        "threads": torch.get_num_threads(),
    }


def _calibration(job: dict):
    import torch

    if job["calib"] == "random":
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, SYN["vocab_size"], (job["nsamples"], job["seqlen"]), generator=g)
    from transformers import AutoTokenizer

    from optq.data.tokens import calibration_tokens, load_tokens

    tok = AutoTokenizer.from_pretrained(job["source"])
    return calibration_tokens(
        load_tokens("enwiki", tok, "calib"), nsamples=job["nsamples"], seqlen=job["seqlen"], seed=0
    )


def spawn(job: dict, cgroup: Path | None = None, kill_at: tuple[Path, int] | None = None) -> dict:
    """Run ``job`` in a fresh process, ``scale.py --worker`` (optionally inside ``cgroup``, or
    SIGKILLed once the journal's state.json reports ``kill_at[1]`` blocks done)."""
    cmd = [sys.executable, str(SCRIPT), "--worker", json.dumps(job)]
    pre = (lambda: Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pre)  # noqa: PLW1509 (no threads in this parent)
    if kill_at:
        state, n = kill_at
        while proc.poll() is None:
            try:
                if json.loads(state.read_text())["done"] >= n:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
    out, err = proc.communicate()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child's, killed or not: it was reaped
    result = {
        "rc": proc.returncode,
        "elapsed_s": time.perf_counter() - t0,
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    }
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if proc.returncode == 0 and lines:
        result.update(json.loads(lines[-1]))
    else:
        result["stderr_tail"] = err[-1500:]
    return result


# ------------------------------------------------------------------------------------ helpers
def synthetic(layers: int) -> Path:
    """A random Llama-shaped bf16 model with ``layers`` blocks, saved once as 500 MB shards."""
    folder = WORK / f"llama-{layers}"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=layers, **SYN), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="500MB")
    return folder


def tensors_identical(a: Path, b: Path) -> dict:
    """Compare two checkpoint folders' tensors byte by byte (and the safetensors files)."""
    import torch
    from safetensors import safe_open

    from optq.formats.files import read_index

    ia, ib = read_index(a), read_index(b)
    differ = sorted(k for k in ia.keys() | ib.keys() if k not in ia or k not in ib)
    for k in sorted(ia.keys() & ib.keys()):
        with safe_open(str(a / ia[k][0]), "pt") as fa, safe_open(str(b / ib[k][0]), "pt") as fb:
            ta, tb = fa.get_tensor(k), fb.get_tensor(k)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)):
            differ.append(k)
    files = sorted(p.name for p in a.glob("*.safetensors"))
    same_files = files == sorted(p.name for p in b.glob("*.safetensors")) and all(
        (a / f).read_bytes() == (b / f).read_bytes() for f in files
    )
    return {"tensors": len(ia), "differing": differ[:10], "n_differing": len(differ), "files_identical": same_files}


def predicted(source: Path, nsamples: int, seqlen: int, shard: str) -> dict:
    import optq
    from optq.pipeline.planning import plan

    p = plan(source, nsamples=nsamples, seqlen=seqlen, config=optq.QuantConfig(), max_shard_size=shard)
    return {
        "peak_ram": p.peak_ram,
        "capture": p.capture,
        "ram": p.ram,
        "assembly": p.assembly,
        "output": p.output_bytes,
        "seconds": sum(p.seconds.values()),
    }


def clear_output(path: Path) -> None:
    """Remove an output folder and its journal (``.partial``), if there."""
    import shutil

    for p in (path, path.with_name(path.name + ".partial")):
        shutil.rmtree(p, ignore_errors=True)
