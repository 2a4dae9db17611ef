"""Running a stretch of CPU work on one intra-op thread, restored however it ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["single_threaded"]


@contextmanager
def single_threaded(enabled: bool = True) -> Iterator[None]:
    """Set ``torch.set_num_threads(1)`` for the body and restore the previous count on exit,
    also when the body raises (KeyboardInterrupt included). ``enabled=False`` changes nothing.

    The solver uses it where threads cost more than they give (thousands of tiny ops) or where
    the thread count would change the result (MKL's Cholesky rounds differently on 1 and 2
    threads).
    """
    threads = torch.get_num_threads()
    if not enabled or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
