"""Does a checkpoint still compute what it computed when optq wrote it, on each engine?

``verify(folder, engines)`` decodes the prompts recorded in the checkpoint's ``optq_probes.json``
(:mod:`optq.formats.probes`) on each engine of :data:`ENGINES` and compares with the record:

- greedy tokens equal up to the first near-tie: a step whose recorded top-two log-probability
  gap is below the engine's ``tie`` may pick the other token (the engine's own numerical error
  can swap them); the rest of that prompt is then conditioned on another prefix and is not
  compared. A different token where the gap is larger is a disagreement.
- on the agreeing steps, the log-probabilities of the tokens in both top-k lists: the largest
  difference must stay within the engine's ``logprob`` tolerance, the mean is reported.

Every engine's decoder returns the same dict: ``{"engine", "kernel", "load_s", "decode_s",
"tokens_per_s", "outputs": [{"tokens": [...], "logprobs": [{token_id: logprob}, ...]}]}``
(vLLM's, in ``optq.eval.vllm``, in its own interpreter). An engine that is not installed is
skipped with the command that installs it; one that fails to load is a failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Engine", "ENGINES", "EngineResult", "PromptResult", "EngineSkipped", "compare", "verify", "DEFAULT_ENGINES"]


class EngineSkipped(Exception):
    """The engine is not installed here: the message says how to install it."""


@dataclass(frozen=True)
class Engine:
    """One way to run a checkpoint. ``tie``: the recorded top-two gap (nats) below which the
    engine may pick the other token; ``logprob``: the largest log-probability difference from
    the record allowed on agreeing steps; both from measurement (docs/verify.md)."""

    name: str
    description: str
    tie: float
    logprob: float
    decode: Callable[[Path, list[list[int]], int, int, dict[str, Any]], dict[str, Any]]


@dataclass
class PromptResult:
    """One recorded prompt on one engine."""

    index: int
    text: str | None
    steps: int = 0  # steps compared (agreeing tokens)
    tie_at: int | None = None  # the near-tie step where the engine took the other token
    mismatch: str | None = None  # why it disagrees (None: agrees)
    max_diff: float = 0.0
    diffs: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatch is None


@dataclass
class EngineResult:
    """What one engine did: ``status`` is "agree", "disagree", "failed" or "skipped"."""

    engine: str
    status: str
    detail: str = ""
    kernel: str | None = None
    load_s: float | None = None
    tokens_per_s: float | None = None
    prompts: list[PromptResult] = field(default_factory=list)

    @property
    def max_diff(self) -> float | None:
        return max((p.max_diff for p in self.prompts), default=None) if self.prompts else None

    @property
    def mean_diff(self) -> float | None:
        diffs = [d for p in self.prompts for d in p.diffs]
        return sum(diffs) / len(diffs) if diffs else None

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("engine", "status", "detail", "kernel", "load_s", "tokens_per_s")}
        out.update(max_logprob_diff=self.max_diff, mean_logprob_diff=self.mean_diff)
        out["prompts"] = [
            {"index": p.index, "text": p.text, "steps": p.steps, "tie_at": p.tie_at, "mismatch": p.mismatch}
            for p in self.prompts
        ]
        return out


# Log-probabilities below this (a probability under 0.7%) are not compared: in bfloat16 the logits
# round to steps of 0.125-0.25 at their usual size, and a tail token's log-probability then moves
# by up to 2 (vLLM's CPU engine on SmolLM2: -8.6 recorded, -7.8 served) while its share of the
# distribution stays negligible. Tokens are still compared at every step.
LOGPROB_FLOOR = -5.0


def compare(index: int, recorded: dict[str, Any], output: dict[str, Any], engine: Engine) -> PromptResult:
    """Compare one engine's ``output`` (``{"tokens", "logprobs"}``) with the ``recorded`` prompt
    of the probes file (``tokens``, ``top_logprobs`` as [[id, logprob], ...] per step)."""
    result = PromptResult(index, recorded.get("text"))
    got_tokens, got_lps = list(output.get("tokens") or []), list(output.get("logprobs") or [])
    for step, (want, top) in enumerate(zip(recorded["tokens"], recorded["top_logprobs"])):
        if step >= len(got_tokens):
            result.mismatch = f"stopped after {len(got_tokens)} of {len(recorded['tokens'])} tokens"
            return result
        got = int(got_tokens[step])
        ranked = [(int(t), float(lp)) for t, lp in top]
        gap = ranked[0][1] - ranked[1][1] if len(ranked) > 1 else float("inf")
        if got != want:
            if gap < engine.tie:
                result.tie_at = step
                return result
            result.mismatch = (
                f"step {step}: token {got} where the record has {want} (recorded top-two gap {gap:.3g} "
                f">= tie tolerance {engine.tie:g})"
            )
            return result
        mine = {int(t): float(lp) for t, lp in (got_lps[step] if step < len(got_lps) else {}).items()}
        diffs = [abs(mine[t] - lp) for t, lp in ranked if t in mine and lp >= LOGPROB_FLOOR]
        result.steps += 1
        result.diffs.extend(diffs)
        worst = max(diffs, default=0.0)
        result.max_diff = max(result.max_diff, worst)
        if worst > engine.logprob and result.mismatch is None:
            result.mismatch = f"step {step}: log-probability off by {worst:.3g} > tolerance {engine.logprob:g}"
    return result


# ----------------------------------------------------------------- the engines


def _timed_greedy(model: Any, prompts: list[list[int]], n: int, k: int) -> tuple[list[dict], float]:
    from optq.formats.probes import greedy

    start = time.perf_counter()
    outputs = [greedy(model, p, n, k) for p in prompts]
    return outputs, time.perf_counter() - start


def _result(engine: str, kernel: str, load_s: float, outputs: list[dict], decode_s: float) -> dict[str, Any]:
    tokens = sum(len(o["tokens"]) for o in outputs)
    return {
        "engine": engine,
        "kernel": kernel,
        "load_s": load_s,
        "decode_s": decode_s,
        "tokens_per_s": tokens / decode_s if decode_s > 0 else 0.0,
        "outputs": outputs,
    }


def _decode_optq(exact: bool) -> Callable[..., dict[str, Any]]:
    def decode(folder: Path, prompts: list[list[int]], n: int, k: int, options: dict[str, Any]) -> dict[str, Any]:
        import torch

        from optq.formats.loading import load
        from optq.formats.probes import exact as exact_path
        from optq.formats.qlinear import QuantLinear

        start = time.perf_counter()
        if exact:
            model = exact_path(load(folder, dtype=torch.float32, embeddings="model", fast_path=False))
            kernel = "reference dequantize, float32"
        else:
            model = load(folder)  # the default: float32 activations, bfloat16 embeddings, fast CPU kernels
            layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
            fast = sum(m.build_fast_path() for m in layers)
            kernel = f"fast CPU kernels on {fast}/{len(layers)} layers, reference on the rest"
        load_s = time.perf_counter() - start
        outputs, decode_s = _timed_greedy(model, prompts, n, k)
        return _result("optq-exact" if exact else "optq", kernel, load_s, outputs, decode_s)

    return decode


# quant_method -> the module transformers loads it with, and the command that installs it.
TRANSFORMERS_LOADERS = (
    ("gptq", "gptqmodel", "pip install gptqmodel optimum  (GPTQModel's wheel needs a CUDA torch; see docs/verify.md)"),
    ("compressed-tensors", "compressed_tensors", "pip install compressed-tensors"),
)


def _decode_transformers(folder: Path, prompts: list[list[int]], n: int, k: int, options: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    method = qc.get("quant_method", "gptq")
    loader = next((entry for entry in TRANSFORMERS_LOADERS if entry[0] == method), None)
    if loader is None:
        raise EngineSkipped(f"transformers has no loader optq knows for quant_method {method!r}")
    if importlib.util.find_spec(loader[1]) is None:
        raise EngineSkipped(f"{loader[1]} is not installed: {loader[2]}")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    kinds = sorted({type(m).__name__ for name, m in model.named_modules() if name.endswith("q_proj")})
    outputs, decode_s = _timed_greedy(model, prompts, n, k)
    return _result("transformers", f"{method}: {', '.join(kinds) or '?'}", load_s, outputs, decode_s)


VLLM_INSTALL = "optq install-vllm (then --vllm-python PATH, $OPTQ_VLLM_PYTHON, or ./.venv-vllm)"


def _decode_vllm(w4a8: bool) -> Callable[..., dict[str, Any]]:
    """vLLM's weight-only kernel (``w4a8=False``, on every CPU), or its W4A8 path, which it takes
    by default on CPUs with AMX tiles (``optq.eval.vllm``'s text); skipped where vLLM never does."""

    def decode(folder: Path, prompts: list[list[int]], n: int, k: int, options: dict[str, Any]) -> dict[str, Any]:
        try:
            vllm = importlib.import_module("optq.eval.vllm")
        except ModuleNotFoundError as exc:
            if exc.name != "optq.eval.vllm":
                raise
            raise EngineSkipped(f"this optq has no vLLM runner (optq.eval.vllm): {VLLM_INSTALL}") from None
        if w4a8 and not vllm.takes_w4a8_here():
            raise EngineSkipped(NO_W4A8)
        python = vllm.vllm_python(options.get("vllm_python"))
        if python is None:
            raise EngineSkipped(f"no vLLM interpreter found: {VLLM_INSTALL}")
        if not vllm.has_int4_kernel_here():
            raise EngineSkipped(vllm.NO_INT4_KERNEL)
        out = vllm.decode(folder, prompts, n, k, python=python, w4a8=w4a8)
        if w4a8 and not out.get("w4a8"):
            raise EngineSkipped(f"vLLM ran no layer as W4A8 (kernel {out.get('kernel')}): engine vllm covers it")
        if out.get("w4a8") and out.get("kernel"):
            out["kernel"] += " as W4A8 (8-bit activations)"
        return out

    return decode


NO_W4A8 = "this CPU has no AMX tiles: vLLM runs 4-bit layers weight-only here (engine vllm), never as W4A8"


# Tolerances from SmolLM2-135M, 4-bit rtn checkpoints, the built-in prompts (docs/verify.md,
# "Tolerances"): optq-exact recomputes the record (measured 5e-7: its 6-decimal rounding);
# the fast path computes in bfloat16 (measured at most 0.20, mean 0.043-0.046); transformers with
# compressed-tensors decompresses to float32 (measured 1e-5; GPTQModel not measured here).
# vLLM's weight-only CPU kernel computes in bfloat16 like the fast path (measured 0.28 / 0.053
# on a CPU without AMX, 0.28-0.30 / 0.05 on one with AMX; on optq's default checkpoint with
# H-weighted ranges, CI 2026-12-06, without AMX: 1.04 / 0.059 and 0.98 / 0.06, at step 13 of 16
# of one prompt, both formats: logprob 1.5 keeps 1.4x of that, the mean is unchanged; a broken
# layout moves the mean by nats). Its W4A8 path (vLLM's default on CPUs
# with AMX) also rounds every linear's input to 8 bits: measured on the built-in probes up to
# 0.73 (mean 0.25), the runner-up taken at recorded gaps up to 0.58 (SmolLM2-135M at optq's
# defaults, both formats): tie 1.0 and 1.5 keep about 2x of that; a broken layout is off by
# several nats.
ENGINES: dict[str, Engine] = {
    "optq": Engine("optq", "optq.load's fast CPU path (bfloat16 kernels)", 0.5, 0.5, _decode_optq(False)),
    "optq-exact": Engine("optq-exact", "optq's exact reference path (float32)", 1e-3, 1e-3, _decode_optq(True)),
    "transformers": Engine(
        "transformers", "transformers with GPTQModel or compressed-tensors", 0.1, 0.1, _decode_transformers
    ),
    "vllm": Engine("vllm", "vLLM's weight-only CPU kernel (bfloat16 activations)", 0.5, 1.5, _decode_vllm(False)),
    "vllm-w4a8": Engine(
        "vllm-w4a8", "vLLM's W4A8 CPU path (8-bit activations; its default with AMX)", 1.0, 1.5, _decode_vllm(True)
    ),
}
DEFAULT_ENGINES = ("optq", "optq-exact", "transformers", "vllm", "vllm-w4a8")


def _engine_result(engine: Engine, folder: Path, probes: dict[str, Any], options: dict[str, Any]) -> EngineResult:
    recorded = probes["prompts"]
    prompts = [list(p["prompt_ids"]) for p in recorded]
    try:
        out = engine.decode(folder, prompts, int(probes["new_tokens"]), int(probes["top_k"]), options)
    except EngineSkipped as exc:
        return EngineResult(engine.name, "skipped", str(exc))
    except Exception as exc:  # a load or decode failure of the engine: reported, exit status 1
        return EngineResult(engine.name, "failed", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    outputs = list(out.get("outputs") or [])
    if len(outputs) != len(recorded):
        return EngineResult(engine.name, "failed", f"returned {len(outputs)} outputs for {len(recorded)} prompts")
    results = [compare(i, r, o, engine) for i, (r, o) in enumerate(zip(recorded, outputs))]
    bad = [p for p in results if not p.ok]
    status = "disagree" if bad else "agree"
    return EngineResult(engine.name, status, "", out.get("kernel"), out.get("load_s"), out.get("tokens_per_s"), results)


def verify(
    folder: str | Path, probes: dict[str, Any], engines: Sequence[str] = DEFAULT_ENGINES, **options: Any
) -> list[EngineResult]:
    """Each engine's :class:`EngineResult` on the checkpoint ``folder`` against its ``probes``
    (:func:`optq.formats.probes.read`). ``options``: ``vllm_python`` (the vLLM interpreter)."""
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine {unknown[0]!r}; choose from {', '.join(ENGINES)}")
    return [_engine_result(ENGINES[e], Path(folder), probes, options) for e in engines]
