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

__all__ = ["TokenClock", "rss_mb", "peak_rss_mb"]


def rss_mb() -> float:
    """This process's resident memory now, in MB (NaN where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


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
