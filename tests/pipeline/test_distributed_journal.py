"""The journal over two processes (torch.distributed, gloo, CPU): a fresh run is not a resume on
any rank, and a resume is one on every rank."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipeline.spawned import leave

WORLD = 2
MANIFEST = {"config": {"bits": 3}, "source": "s"}


def _worker(rank: int, store: str, out: str, resume: bool) -> None:
    from optq.pipeline.distributed.ranks import Dist
    from optq.pipeline.stream.journal import Journal

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    handler = logging.FileHandler(f"{out}/log{rank}.txt")
    logger = logging.getLogger("optq")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        journal = Journal(f"{out}/q", MANIFEST, resume=resume, overwrite=False, dist=Dist(WORLD, rank))
        Path(f"{out}/done{rank}.txt").write_text(str(journal.done))
    except BaseException as exc:  # noqa: BLE001 - recorded for the test to read
        Path(f"{out}/error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        handler.close()
        leave()


def _spawn(tmp_path: Path, out: Path, resume: bool, store: str) -> list[str]:
    mp.spawn(_worker, args=(str(tmp_path / store), str(out), resume), nprocs=WORLD)
    for r in range(WORLD):
        assert not (out / f"error{r}.txt").exists(), (out / f"error{r}.txt").read_text()
        assert (out / f"done{r}.txt").read_text() == "0"
    return [(out / f"log{r}.txt").read_text() for r in range(WORLD)]


def test_a_fresh_run_says_resuming_on_no_rank_and_a_resume_on_every_rank(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    logs = _spawn(tmp_path, out, resume=False, store="store1")
    assert (out / "q.partial" / "state.json").is_file()  # rank 0 opened the journal
    assert not [r for r, text in enumerate(logs) if "resuming" in text], logs
    # The same journal resumed (nothing finished yet): every rank reads it, and says so.
    logs = _spawn(tmp_path, out, resume=True, store="store2")
    assert all("resuming" in text and "after 0 finished blocks" in text for text in logs), logs
