"""Timing ``generate``: prefill and decode speed from a streamer, and the process's memory.

``generate`` hands its streamer the prompt first, then each new token as it is chosen, so the
time to the first new token is the prefill (one forward over the prompt, plus choosing one
token) and the time between the first and the last new token is the decode of the others.

    >>> clock = TokenClock()
    >>> model.generate(ids, max_new_tokens=128, min_new_tokens=128, streamer=clock)  # doctest: +SKIP
    >>> clock.prefill_tokens_per_s(ids.shape[1]), clock.decode_tokens_per_s()  # doctest: +SKIP
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["TokenClock", "compiled_decoding", "peak_rss_mb", "reset_peak", "rss_mb", "status_mb"]


def compiled_decoding() -> dict[str, Any]:
    """``generate`` options that compile the decoding step with torch.compile: a static KV cache
    (fixed shapes: one compilation per prompt length + new tokens) and transformers' own
    compiled decoding, asked for on the CPU too (it compiles on accelerators only unless its
    ``CompileConfig`` is flagged). The first call compiles (tens of seconds on 2 cores); later
    calls of the same lengths reuse it. Mode "default": transformers' "reduce-overhead" means
    CUDA graphs. QuantLinear traces without breaks (its compiled path runs each layer alone)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, mode="default")
    config._compile_all_devices = True  # transformers' flag for compiling off accelerators
    return {"cache_implementation": "static", "compile_config": config}


def status_mb(field: str) -> float | None:
    """A size field of /proc/self/status (``VmRSS``: resident now; ``VmHWM``: its high-water
    mark) in MB, or None where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """This process's resident memory now, in MB (NaN where /proc is missing)."""
    now = status_mb("VmRSS")
    return float("nan") if now is None else now


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def reset_peak() -> bool:
    """Restart the kernel's peak counter (VmHWM) at the current RSS (Linux >= 4.0); False where
    it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class TokenClock:
    """A ``generate`` streamer that stamps each new token (and passes everything to ``inner``).

    The clock starts when it is built or at :meth:`restart`; call that right before
    ``generate``. Reusable: :meth:`restart` forgets the last run.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.restart()

    def restart(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False
        self.start = time.perf_counter()

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()

    @property
    def new_tokens(self) -> int:
        return len(self.times)

    def prefill_seconds(self) -> float:
        if not self.times:
            raise ValueError("no token was generated")
        return self.times[0] - self.start

    def prefill_tokens_per_s(self, prompt_tokens: int) -> float:
        return prompt_tokens / self.prefill_seconds()

    def decode_seconds(self) -> float:
        if len(self.times) < 2:
            raise ValueError("decode speed needs at least two new tokens")
        return self.times[-1] - self.times[0]

    def decode_tokens_per_s(self) -> float:
        return (len(self.times) - 1) / self.decode_seconds()

    def summary(self, prompt_tokens: int) -> str:
        """One line for people: prefill and decode tokens and speeds."""
        if not self.times:
            return "no token was generated"
        prefill = self.prefill_seconds()
        line = f"prefill: {prompt_tokens} tokens in {prefill:.2f} s ({prompt_tokens / prefill:.1f} tokens/s)"
        if len(self.times) > 1:
            n = len(self.times) - 1
            line += f"; decode: {n} tokens in {self.decode_seconds():.2f} s ({self.decode_tokens_per_s():.1f} tokens/s)"
        return line
