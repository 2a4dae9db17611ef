"""Run a block's forward for every calibration batch, pausing each at chosen linear layers.

True-sequential GPTQ needs, for each group of linears in a block (q/k/v, then o, then gate/up,
then down), the inputs they receive once the earlier groups are quantized. Re-running the block
from its input for every group (strategy="replay", the default) costs about two block forwards;
pausing every batch's forward at the group's first linear, solving, and resuming costs one
(strategy="pause"). Python cannot suspend a call stack inside ``nn.Module.__call__`` by itself,
so each batch's forward runs on its own thread, and the threads take turns: exactly one runs at
a time, in batch order, handing control back at every pause. The result is deterministic and
uses the torch threads as a plain loop would.

The price is memory: while paused, every batch keeps the block's intermediate tensors alive
(e.g. the MLP's intermediate activations while the down projection is being solved). On glibc,
every thread also gets its own malloc arena, which keeps what its forward freed; returning those
free pages after each step (``optq.core.memory``) halves the peak RSS for about 15% more time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from optq.core.hessian import Hessian
from optq.pipeline.blocks.capture import Call, run_block
from optq.pipeline.blocks.hessians import LayerHessians

__all__ = ["PausedForwards"]


def _thread_state() -> list[Callable[[], contextlib.AbstractContextManager]]:
    """Context managers that re-create the calling thread's torch state on a worker thread.

    Grad and inference mode, autocast, the default device and the current CUDA stream are
    per thread in PyTorch; a worker must run the block exactly as the caller's thread would
    (as strategy="replay" does), or the two strategies would give different weights.
    """
    state: list[Callable[[], contextlib.AbstractContextManager]] = []
    grad = torch.is_grad_enabled()
    state.append(lambda: torch.set_grad_enabled(grad))
    if torch.is_inference_mode_enabled():
        state.append(lambda: torch.inference_mode(True))
    for kind in ("cpu", "cuda"):
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            state.append(lambda kind=kind, dtype=dtype: torch.autocast(kind, dtype=dtype))
    default = torch.get_default_device()
    if default != torch.device("cpu"):
        state.append(lambda: torch.device(default))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stream = torch.cuda.current_stream()
        state.append(lambda: torch.cuda.stream(stream))
    return state


class _Abort(BaseException):
    """Unwinds a paused forward that will not be finished (BaseException: no model catches it)."""


class _Worker:
    def __init__(self, owner: PausedForwards, hidden: torch.Tensor, call: Call) -> None:
        self.go = threading.Semaphore(0)
        self.abort = False
        self.paused_at: int | None = None
        self.output: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.thread = threading.Thread(target=self._body, args=(owner, hidden, call), daemon=True)
        self.thread.start()

    def _body(self, owner: PausedForwards, hidden: torch.Tensor, call: Call) -> None:
        self.go.acquire()
        try:
            if not self.abort:
                with contextlib.ExitStack() as stack:
                    for enter in owner.thread_state:  # the caller's per-thread torch state
                        stack.enter_context(enter())
                    self.output = run_block(owner.block, hidden, call)
        except _Abort:
            pass
        except BaseException as exc:  # handed to the main thread, which re-raises it
            self.error = exc
        finally:
            self.finished = True
            owner.done.release()


class PausedForwards:
    """Forwards of ``block`` over all batches, pausing at the first call of each ``stops`` module.

    ``advance(j, hessian)`` lets every batch run up to ``stops[j]``, adding that module's input to
    ``hessian``; ``finish()`` runs every batch to the end and returns the block outputs;
    ``close()`` abandons the paused forwards. Use as a context manager so threads never leak.
    ``release``: called after every step (``optq.core.memory.releaser``: trims the host heap).
    """

    def __init__(
        self,
        block: nn.Module,
        stops: Sequence[nn.Module],
        hidden: Sequence[torch.Tensor],
        calls: Sequence[Call],
        *,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.block = block
        self.release = release
        self.done = threading.Semaphore(0)
        self.current: _Worker | None = None
        self.hessian: Hessian | LayerHessians | None = None
        self.stop_index = {id(m): j for j, m in enumerate(stops)}
        self.thread_state = _thread_state()
        self.handles = [m.register_forward_pre_hook(self._hook) for m in stops]
        self.workers: list[_Worker] = []
        try:
            for h, c in zip(hidden, calls):
                self.workers.append(_Worker(self, h, c))
        except BaseException:
            self.close()  # the threads already started, and the hooks
            raise

    def _hook(self, module: nn.Module, args: tuple) -> None:
        w = self.current
        if w is None or threading.current_thread() is not w.thread:
            return  # a forward of this module outside the paused ones
        j = self.stop_index[id(module)]
        if w.abort:
            raise _Abort
        if w.paused_at is not None and j <= w.paused_at:
            return  # a later call of an already passed stop: no second pause
        if self.hessian is not None:
            self.hessian.update(args[0])
        w.paused_at = j
        self.done.release()
        w.go.acquire()
        if w.abort:
            raise _Abort

    def _step(self, w: _Worker) -> None:
        self.current = w
        w.go.release()
        self.done.acquire()
        self.current = None
        if self.release is not None:
            self.release()
        if w.error is not None:
            raise w.error

    def advance(self, j: int, hessian: Hessian | LayerHessians) -> None:
        """Run every batch to its pause at ``stops[j]``, accumulating the input into ``hessian``."""
        self.hessian = hessian
        try:
            for w in self.workers:
                self._step(w)
                if w.finished or w.paused_at != j:
                    raise RuntimeError(
                        f"a calibration batch's block forward did not reach stop {j} in the order "
                        "seen on the first batch; pass strategy='replay' for this model"
                    )
        finally:
            self.hessian = None

    def finish(self) -> list[torch.Tensor]:
        """Run every batch to the end of the block; the outputs, in batch order."""
        for w in self.workers:
            self._step(w)
            if not w.finished or w.output is None:
                raise RuntimeError("a paused block forward did not run to its end")
        return [w.output for w in self.workers]

    def close(self) -> None:
        """Abandon paused forwards, join every thread and remove the hooks."""
        try:
            for w in self.workers:
                w.abort = True  # a worker that is resumed by anything from now on unwinds
            for w in self.workers:
                if not w.finished:
                    self.current = w
                    w.go.release()
                    self.done.acquire()
                w.thread.join()
        finally:
            # Even if interrupted again while unwinding: no hook may outlive this object.
            self.current = None
            for h in self.handles:
                h.remove()
            self.handles = []

    def __enter__(self) -> PausedForwards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
