"""Which ranks still answer: a heartbeat per rank in the process group's store.

A rank that is stopped (SIGSTOP, a frozen machine, a debugger) neither fails nor closes its
connections, so the others would wait in their next collective for the process group's timeout
(``OPTQ_DIST_TIMEOUT``, 600 s). The time a rank waits in a collective says nothing by itself:
the ranks reach each collective at different times, and one of them may be solving a large
linear for minutes. What tells a busy rank from a stopped one is liveness, so each rank runs a
daemon thread that, every ``interval`` seconds, adds one to its own counter in the store
(``optq/heartbeat/<rank>``) and reads the others'. SIGSTOP freezes every thread of a process, so
its counter stops. A rank waiting in one of the run's collectives (:meth:`Dist._wait`) fails,
naming the rank, once that rank's counter has not moved for ``OPTQ_DIST_PEER_TIMEOUT`` seconds
(default 60) as seen on its own monotonic clock (so clocks need not agree between machines).

A rank that has not yet beaten once is not judged (it may still be loading its model before its
first collective); the process group's own timeout still covers it.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from typing import Any

from optq.core import environment

__all__ = ["Heartbeat", "peer_timeout", "ENV", "DEFAULT_TIMEOUT"]

log = logging.getLogger("optq.pipeline")

ENV = "OPTQ_DIST_PEER_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


def peer_timeout() -> float:
    """Seconds without a heartbeat after which a peer counts as stopped (``OPTQ_DIST_PEER_TIMEOUT``)."""
    raw = environment.get(ENV) or ""
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{ENV}={raw!r}: give a positive number of seconds")
    return value


class Heartbeat:
    """This rank's heartbeat thread over ``store`` (a c10d Store shared by the ``world`` ranks)."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float) -> None:
        import torch.distributed as dist

        self.base = store
        self.store = dist.PrefixStore("optq/heartbeat/", store)
        self.rank, self.world, self.timeout = rank, world, timeout
        self.interval = min(5.0, timeout / 6)  # beats and reads per timeout: at least six
        self.poll = min(1.0, timeout / 6)  # how often a waiting rank looks at the others
        now = time.monotonic()
        self.beats = [0] * world  # each peer's counter as last read
        self.seen = [now] * world  # when (this clock) each peer's counter last moved
        self.round_at = now  # when this thread last finished a round
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="optq-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # not a daemon thread inside the store when the interpreter ends

    def _loop(self) -> None:
        import torch.distributed as dist

        while not self._stop.is_set():
            if not dist.is_initialized():  # the group was destroyed: nothing left to answer for
                return
            try:
                self.store.add(str(self.rank), 1)
                for r in range(self.world):
                    if r != self.rank:
                        n = self.store.add(str(r), 0)  # a read that never blocks on a missing key
                        if n != self.beats[r]:
                            self.beats[r], self.seen[r] = n, time.monotonic()
                self.round_at = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the store is gone (group destroyed) or flaky
                log.debug("heartbeat: %s", exc)
            self._stop.wait(self.interval)

    def silent(self) -> list[tuple[int, float]]:
        """(rank, seconds) of each peer whose heartbeat has not moved for longer than the timeout."""
        now = time.monotonic()
        return [
            (r, now - self.seen[r])
            for r in range(self.world)
            if r != self.rank and self.beats[r] > 0 and now - self.seen[r] > self.timeout
        ]

    def message(self, silent: list[tuple[int, float]]) -> str:
        """One line naming the silent ranks."""
        names = ", ".join(f"rank {r}" for r, _ in silent)
        age = max(s for _, s in silent)
        text = (
            f"{names} of {self.world} stopped answering: no heartbeat for {age:.0f} s while rank "
            f"{self.rank} waited for it in a collective ({ENV}={self.timeout:g} s); every rank stops"
        )
        if time.monotonic() - self.round_at > self.timeout:  # our own reads hang: the store's host
            text += " (the rendezvous store did not answer either: its host may be the stopped one)"
        return text

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1.0)
