"""Handing freed host memory back to the operating system during calibration.

glibc's allocator keeps freed memory for reuse, and after the first large ``free`` it serves
allocations of up to 32 MB (one calibration batch's activations) from its heaps instead of
fresh mappings. A block forward over a batch allocates and frees a few hundred MB this way, so
without help the resident size grows by the largest forward's garbage, once per thread arena.
``malloc_trim(0)`` returns those free pages; calling it between batches bounds the resident size
by what is alive, for a few percent more time (pages are faulted in again by the next batch).
Inside a batch the same holds for each freed temporary: ``releaser`` therefore also fixes
glibc's mmap threshold at 4 MiB (``mallopt(M_MMAP_THRESHOLD)``, which stops its growth to
32 MB), so every larger buffer is mapped on its own and returned when freed. On SmolLM2 at
128 x 512 tokens this took the streamed run's peak from 0.97-1.01 GB to 0.85 GB
(``benchmarks/scale_memory.py``).
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable

import torch

__all__ = ["releaser", "release_host_memory", "heap_trimmer"]


def _noop() -> None:
    return None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 << 20  # buffers above it are mapped apart and unmapped when freed


def _malloc_trim(threshold: bool) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.malloc_trim
        if threshold:
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        return None  # not glibc (musl, ...): nothing to trim

    def trim() -> None:
        fn(0)

    return trim


def releaser(device: torch.device | str) -> Callable[[], None]:
    """A function to call between calibration batches: trims the host heap when computing on
    the CPU under glibc (and from now on maps buffers above ``MMAP_THRESHOLD`` apart), does
    nothing otherwise (device memory is torch's caching allocator's)."""
    if torch.device(device).type != "cpu":
        return _noop
    return _malloc_trim(threshold=True) or _noop


def release_host_memory() -> None:
    """Collect garbage and trim the host heap now: after work whose objects are gone but whose
    freed pages glibc would keep (tokenising the calibration text leaves about 0.2 GB so).

    Unlike :func:`releaser` it leaves glibc's mmap threshold alone: a process that serves a
    model (optq.load calls this) has no calibration batches for the fixed threshold to help, and
    allocates and frees many buffers below 4 MB per token (one side-by-side run: 202 MB resident
    after 128 tokens of the 4-bit SmolLM2 without it, 225 MB with it; repeated runs vary by
    about 20 MB, so that effect is uncertain)."""
    gc.collect()
    trim = _malloc_trim(threshold=False)
    if trim is not None:
        trim()


def heap_trimmer() -> Callable[[], None]:
    """``malloc_trim(0)`` as a function (a no-op off glibc), leaving the mmap threshold and the
    garbage collector alone: cheap enough for a loader to call after each module it reads, so
    that the temporaries' heap pages go back before the next module's are taken."""
    return _malloc_trim(threshold=False) or _noop
