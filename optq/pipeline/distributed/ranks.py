"""Many processes, one result: data-parallel calibration and parallel solves on torch.distributed.

Launched by ``torchrun --nproc-per-node N -m optq quantize ...`` (or any run where a process
group is initialised before ``optq.quantize`` / ``quantize_pretrained``), every rank runs the
same block loop on its own share of the calibration samples:

- Each rank captures and forwards only its contiguous share of the samples, so activation
  memory divides by N.
- Where a group's Hessian is complete (seam 2 of the block loop), the sums and token counts are
  ``all_reduce``d, so every rank holds the Hessian of all N shares. It equals the
  single-process Hessian up to float summation order; with ``hessian_dtype="float64"`` the
  order no longer shows in the float32 solve.
- The linears of a group, and the experts of an expert stage, are assigned to ranks by
  estimated cost, largest first, to the least loaded rank. Each rank solves its share; the
  solutions and report rows are then gathered by every rank, which writes them into its copy of
  the block, so every rank continues with the same quantized block.
- A rank that raises tells the others at the next collective, and every rank stops, naming it.
  A rank that dies is noticed by the launcher (torchrun stops the others) or by its closed
  connections. A rank that stops answering (SIGSTOP, a frozen host) is named by the others
  once its heartbeat has not moved for ``OPTQ_DIST_PEER_TIMEOUT`` seconds (default 60; see
  :mod:`optq.pipeline.distributed.liveness`); the process group's own timeout
  (``OPTQ_DIST_TIMEOUT``, default 600) remains the last resort.

One process without a process group is exactly the single-process run: every function here is
then a no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import logging
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from optq.core import environment
from optq.pipeline.distributed.liveness import Heartbeat, peer_timeout

__all__ = ["Dist", "current", "init_from_env", "close", "DistributedError"]

log = logging.getLogger("optq.pipeline")


class DistributedError(RuntimeError):
    """Another rank failed, or the ranks disagree."""


class Dist:
    """The process group a run belongs to (``world_size`` 1: no group, every method a no-op)."""

    def __init__(self, world_size: int = 1, rank: int = 0, heartbeat: Heartbeat | None = None) -> None:
        self.world_size = world_size
        self.rank = rank
        self.heartbeat = heartbeat  # None: collectives wait as long as the process group lets them
        self.abandoned = False  # a collective was left waiting for a stopped rank
        # Seconds spent in each kind of work this process (benchmarks/distributed.py prints them).
        self.seconds: dict[str, float] = {"all_reduce": 0.0, "gather": 0.0, "check": 0.0, "solve": 0.0}

    def _timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        except DistributedError:
            raise
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the timeout
            raise DistributedError(
                f"rank {self.rank}: a collective with the other ranks failed ({exc}); another "
                "rank died or timed out (OPTQ_DIST_TIMEOUT)"
            ) from exc
        finally:
            self.seconds[kind] += time.perf_counter() - t0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def _wait(self, work: Any) -> None:
        """Wait for an asynchronous collective; with a heartbeat, fail naming a rank that stopped
        answering meanwhile instead of waiting for the process group's timeout."""
        hb = self.heartbeat
        if hb is None:
            work.wait()
            return
        gloo = _backend() == "gloo"
        pause = 1e-4
        while True:
            if gloo:  # gloo's wait takes a timeout, and the work carries on after it
                try:
                    work.wait(datetime.timedelta(seconds=hb.poll))
                    return
                except RuntimeError:
                    if work.is_completed():  # the collective itself failed
                        raise
            else:  # NCCL: poll, leaving its own timeout handling alone
                deadline = time.monotonic() + hb.poll
                while not work.is_completed() and time.monotonic() < deadline:
                    time.sleep(pause)
                    pause = min(2 * pause, 0.02)
                if work.is_completed():
                    work.wait()
                    return
            silent = hb.silent()
            if silent:
                self.abandoned = True
                raise DistributedError(hb.message(silent))

    # ----------------------------------------------------------------------- calibration
    def share(self, n: int) -> tuple[int, int]:
        """This rank's contiguous share ``[lo, hi)`` of ``n`` samples (sizes differ by at most one)."""
        base, extra = divmod(n, self.world_size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def all_reduce_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum each tensor over the ranks, in place."""
        if not self.active:
            return
        import torch.distributed as dist

        def reduce() -> None:
            for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
                self._wait(work)

        self._timed("all_reduce", reduce)

    def device(self) -> torch.device:
        """Where this group's collectives take tensors: the current GPU under NCCL, else the CPU."""
        if self.active and _backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast_(self, tensor: torch.Tensor, src: int, kind: str = "gather") -> None:
        """Rank ``src``'s ``tensor`` into every rank's ``tensor`` (same shape and dtype everywhere)."""
        if self.active:
            import torch.distributed as dist

            self._timed(kind, lambda: self._wait(dist.broadcast(tensor, src, async_op=True)))

    def all_gather(self, value: Any, kind: str = "gather") -> list[Any]:
        """Every rank's ``value`` (pickled), in rank order (``[value]`` without a group)."""
        if not self.active:
            return [value]
        return self._timed(kind, lambda: self._gather_objects(value))

    def _gather_objects(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        device = self.device()
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        self._wait(dist.all_gather(sizes, torch.tensor([data.numel()], device=device), async_op=True))
        counts = [int(n) for n in torch.cat(sizes).tolist()]
        mine = torch.zeros(max(counts), dtype=torch.uint8, device=device)
        mine[: data.numel()] = data.to(device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(dist.all_gather(parts, mine, async_op=True))
        return [pickle.loads(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, counts)]

    # ----------------------------------------------------------------------- solves
    def assign(self, costs: Sequence[float]) -> list[int]:
        """The rank of each work item: largest first, each to the least loaded rank (ties: lowest)."""
        load = [0.0] * self.world_size
        owner = [0] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
            r = min(range(self.world_size), key=lambda r: (load[r], r))
            owner[i] = r
            load[r] += costs[i]
        return owner

    def gather(self, mine: dict[str, Any]) -> dict[str, Any]:
        """Every rank's ``mine`` merged (keys are disjoint); ``mine`` itself without a group."""
        if not self.active:
            return mine
        out: dict[str, Any] = {}
        for part in self.all_gather(mine):
            out.update(part)
        return out

    # ----------------------------------------------------------------------- failures
    def check(self, error: BaseException | None = None) -> None:
        """A collective every rank reaches: raise on every rank if any rank brings an error."""
        if not self.active:
            if error is not None:
                raise error
            return
        msg = None if error is None else f"{type(error).__name__}: {error}"
        gathered = self.all_gather(msg, "check")
        failed = [(r, m) for r, m in enumerate(gathered) if m is not None]
        if failed:
            if error is not None:
                raise error
            r, m = failed[0]
            raise DistributedError(f"rank {r} of {self.world_size} failed: {m}; every rank stops")

    @contextlib.contextmanager
    def failing_together(self) -> Iterator[None]:
        """Run the body on every rank; an exception in it is raised on every rank (the others get
        a DistributedError naming the failed rank) once all ranks have reached the end of it, so
        no rank waits forever in a collective that a failed rank will never join."""
        error = None
        try:
            yield
        except Exception as exc:
            error = exc
        self.check(error)

    def same_everywhere(self, what: str, value: Any) -> None:
        """Refuse to run when ``value`` (arguments, settings) differs between ranks."""
        if not self.active:
            return
        digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
        gathered = self.all_gather(digest, "check")
        differ = [r for r, d in enumerate(gathered) if d != gathered[0]]
        if differ:
            raise DistributedError(
                f"{what} differ between ranks (rank 0 and rank(s) {differ}); start every rank with the same arguments"
            )

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            self._timed("check", lambda: self._wait(dist.barrier(async_op=True)))


def _backend() -> str:
    import torch.distributed as dist

    return str(dist.get_backend()).lower()


def current() -> Dist:
    """The run's process group: the initialised default group, else one process. A group's
    first call starts this rank's heartbeat in the group's store."""
    try:
        import torch.distributed as dist
    except ImportError:  # a torch built without distributed
        return Dist()
    key: tuple[int, int, Any] = (1, 0, None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        key = (dist.get_world_size(), dist.get_rank(), dist.distributed_c10d._get_default_store())
    old = _CURRENT.get("key")
    if old is None or old[:2] != key[:2] or old[2] is not key[2]:  # one object per group: its timers add up
        if "dist" in _CURRENT and _CURRENT["dist"].heartbeat is not None:
            _CURRENT["dist"].heartbeat.stop()
        world, rank, store = key
        beat = Heartbeat(store, rank, world, peer_timeout()) if store is not None else None
        _CURRENT.update(key=key, dist=Dist(world, rank, beat))
    return _CURRENT["dist"]


_CURRENT: dict[str, Any] = {}


def init_from_env(device: str | None = None) -> tuple[Dist, str | None]:
    """Initialise the default process group when launched by torchrun (``WORLD_SIZE`` > 1).

    The backend is NCCL for a CUDA device, with one GPU per rank from ``LOCAL_RANK`` (the
    returned device is ``cuda:LOCAL_RANK``), else gloo. Returns (the group, the device to use).
    """
    world = int(environment.get("WORLD_SIZE") or "1")
    if world <= 1:
        return Dist(), device
    import torch.distributed as dist

    cuda = device is not None and str(device).startswith("cuda")
    if cuda:
        device = f"cuda:{int(environment.get('LOCAL_RANK') or '0')}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(environment.get("OPTQ_DIST_TIMEOUT") or "600"))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        atexit.register(_close)
    return current(), device


def _close() -> None:
    run = _CURRENT.get("dist")
    if run is not None and run.abandoned:
        # A collective still waits for a stopped rank in gloo's/NCCL's own thread, which the
        # process cannot join before the process group's timeout: leave now, with the CLI's
        # status for this error (2), the error line already printed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    close()


def close() -> None:
    """End this rank's part in the process group: stop its heartbeat (joined, so that no thread
    of ours is inside the store afterwards), then destroy the group while the interpreter is
    fully alive. The CLI does this at exit; a script that calls ``optq.quantize`` under its own
    process group should call it instead of ``dist.destroy_process_group()``."""
    import torch.distributed as dist

    run = _CURRENT.pop("dist", None)
    _CURRENT.pop("key", None)
    if run is not None and run.heartbeat is not None:
        run.heartbeat.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
