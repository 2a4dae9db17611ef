"""How a rank spawned by a test ends.

A spawned rank writes its results to files, then leaves through :func:`leave`: optq's close
(heartbeat stopped and joined, process group destroyed, the interpreter still alive), the
standard streams flushed, and ``os._exit`` without interpreter finalization. Gloo's worker
threads can still hold the last collective's tensors for a moment after its ``wait`` returns;
when a rank ends right after a collective (a refusal, a failure), releasing those tensors during
finalization needs the GIL of an interpreter being torn down, and the process aborts ("terminate
called without an active exception", SIGABRT; discussed upstream in pytorch/pytorch#179291).
That abort is not optq's behaviour under test, so the ranks do not go through finalization.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(code: int = 0) -> NoReturn:
    from optq.pipeline.distributed.ranks import close

    try:
        close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
