"""A rank that stops answering (SIGSTOP: every thread frozen, no connection closed) is named by
the others within ``OPTQ_DIST_PEER_TIMEOUT`` seconds, in one line; a rank that is only slow (a
long solve, during which the others wait in a collective) is not."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipeline.spawned import leave

import optq

pytest.importorskip("transformers")

TIMEOUT = 4.0  # seconds without a heartbeat: the test's short OPTQ_DIST_PEER_TIMEOUT


def _stop_worker(rank: int, store: str, out: str) -> None:
    os.environ["OPTQ_DIST_PEER_TIMEOUT"] = str(TIMEOUT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if rank == 1:
        import optq.pipeline.blocks.groups as groups

        def slow_then_stopped(work, unit, *args, **kwargs):
            # Rank 0 waits in the collective after the solves all along: first for a rank that
            # is busy (alive, beating) for twice the timeout, then for one that is stopped.
            Path(f"{out}/busy").write_text(str(time.time()))
            time.sleep(2 * TIMEOUT)
            Path(f"{out}/stopped").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

        groups.solve_group = slow_then_stopped
    from tiny import build
    from tiny_moe import tokens

    try:
        optq.quantize(build("llama"), tokens(n=8, seqlen=16), optq.QuantConfig(bits=3, group_size=16), progress=False)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test to read
        Path(f"{out}/error{rank}.tmp").write_text(f"{type(exc).__name__}: {exc}")
        Path(f"{out}/error{rank}.tmp").rename(f"{out}/error{rank}.txt")
    finally:
        leave()


def test_a_stopped_rank_is_named_within_the_peer_timeout_and_a_busy_one_is_not(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ctx = mp.start_processes(
        _stop_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=False, start_method="spawn"
    )
    first, stopped = ctx.processes
    try:
        deadline = time.time() + 240  # two interpreters importing transformers on a busy machine
        while time.time() < deadline and not (out / "error0.txt").exists():
            if (out / "stopped").exists():  # from here, a minute at most (the default is 60 s)
                deadline = min(deadline, float((out / "stopped").read_text()) + TIMEOUT + 60)
            time.sleep(0.2)
        error = out / "error0.txt"
        assert error.exists(), "rank 0 still waits for the stopped rank"
        text = error.read_text()
        assert text.startswith("DistributedError: rank 1 of 2 stopped answering") and "\n" not in text, text
        assert "OPTQ_DIST_PEER_TIMEOUT=4 s" in text
        busy, halted = float((out / "busy").read_text()), float((out / "stopped").read_text())
        noticed = error.stat().st_mtime
        assert noticed > halted  # not while rank 1 was busy but beating
        assert noticed - halted < TIMEOUT + 15, (noticed - halted, noticed - busy)
    finally:
        os.kill(stopped.pid, signal.SIGKILL)  # a stopped process ignores everything else
        stopped.join(30)
        first.join(60)  # gloo's thread ends once the stopped rank's connections close
        if first.is_alive():
            first.kill()
    assert first.exitcode == 0
