"""Handing freed host memory back to the operating system during calibration.

glibc's allocator keeps freed memory for reuse, and after the first large ``free`` it serves
allocations of up to 32 MB (one calibration batch's activations) from its heaps instead of
fresh mappings. A block forward over a batch allocates and frees a few hundred MB this way, so
without help the resident size grows by the largest forward's garbage, once per thread arena.
``malloc_trim(0)`` returns those free pages; calling it between batches bounds the resident size
by what is alive, for a few percent more time (pages are faulted in again by the next batch).
Inside a batch the same holds for each freed temporary: a program that owns its process can
fix glibc's mmap threshold at 4 MiB (:func:`fix_mmap_threshold`, ``mallopt(M_MMAP_THRESHOLD)``,
which stops its growth to 32 MB), so every larger buffer is mapped on its own and returned when
freed. On SmolLM2 at 128 x 512 tokens this took the streamed run's peak from 0.97-1.01 GB to
0.85 GB (``benchmarks/scale_memory.py``).

The threshold is a setting of the whole process, and glibc has no way to read it back nor to
turn its dynamic growth on again once it is fixed: the library's calls (``optq.quantize``,
``quantize_pretrained``) therefore never set it; the CLI (``optq quantize`` on the CPU) does,
once, for the process it owns. ``malloc_trim`` changes no setting: the library trims freely.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["releaser", "release_host_memory", "heap_trimmer", "fix_mmap_threshold", "MMAP_THRESHOLD"]


def _noop() -> None:
    return None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 << 20  # buffers above it are mapped apart and unmapped when freed


def _libc() -> Any:
    """glibc through ctypes, or None where there is none (another OS, musl, ...)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (an AttributeError here: not glibc)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def _malloc_trim() -> Callable[[], None] | None:
    libc = _libc()
    if libc is None:
        return None  # nothing to trim
    fn = libc.malloc_trim

    def trim() -> None:
        fn(0)

    return trim


def releaser(device: torch.device | str) -> Callable[[], None]:
    """A function to call between calibration batches: trims the host heap when computing on
    the CPU under glibc, does nothing otherwise (device memory is torch's caching allocator's).
    It changes no setting of the process (see :func:`fix_mmap_threshold`)."""
    if torch.device(device).type != "cpu":
        return _noop
    return _malloc_trim() or _noop


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` for the rest of the process, so that
    every freed buffer above it goes back to the system at once; True where it was set.

    For a program that owns its process (``optq quantize`` calls it before a CPU run): it cannot
    be undone, since glibc can neither report the threshold it had nor resume growing it."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def release_host_memory() -> None:
    """Collect garbage and trim the host heap now: after work whose objects are gone but whose
    freed pages glibc would keep (tokenising the calibration text leaves about 0.2 GB so).

    It leaves glibc's mmap threshold alone: a process that serves a model (optq.load calls
    this) has no calibration batches for the fixed threshold to help, and
    allocates and frees many buffers below 4 MB per token (one side-by-side run: 202 MB resident
    after 128 tokens of the 4-bit SmolLM2 without it, 225 MB with it; repeated runs vary by
    about 20 MB, so that effect is uncertain)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim()


def heap_trimmer() -> Callable[[], None]:
    """``malloc_trim(0)`` as a function (a no-op off glibc), leaving the mmap threshold and the
    garbage collector alone: cheap enough for a loader to call after each module it reads, so
    that the temporaries' heap pages go back before the next module's are taken."""
    return _malloc_trim() or _noop
