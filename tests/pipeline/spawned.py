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


def stream_worker(rank: int, world: int, store: str, src: str, dst: str, out: str, kill: bool, method: str) -> None:
    """One rank of a streamed run of ``src`` into ``dst`` (the tiny models' tokens, 3-bit g16,
    float64 Hessians, small shards); with ``kill``, rank 0 dies right after journaling block 1
    (``os._exit``: no exception, no clean-up, the other rank left waiting), else the run resumes.
    A failure's traceback goes to ``out/error<rank>.txt``."""
    import datetime
    import traceback

    import torch
    import torch.distributed as dist
    from tiny_moe import tokens

    import optq
    from optq.pipeline.stream.journal import Journal
    from optq.pipeline.stream.quantize import quantize_pretrained

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=180 if method == "gptaq" else 30)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    if kill and rank == 0:
        real = Journal.write_block

        def write_block(self, i, tensors):
            real(self, i, tensors)
            if i == 1:
                os._exit(1)

        Journal.write_block = write_block
    try:
        quantize_pretrained(
            src, dst, tokens(n=8, seqlen=16), optq.QuantConfig(bits=3, group_size=16), progress=False,
            batch_size=2, hessian_dtype="float64", resume=not kill, max_shard_size=20_000, method=method,
        )  # fmt: skip
    except BaseException:  # noqa: BLE001 - recorded for the test to read
        with open(f"{out}/error{rank}.txt", "w") as fh:
            fh.write(traceback.format_exc())
    finally:
        leave()


def folder_tensors(folder) -> dict:
    """Every tensor of a checkpoint folder's safetensors files, by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    got = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        got.update(load_file(str(f)))
    return got
