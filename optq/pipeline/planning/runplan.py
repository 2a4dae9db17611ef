"""What a run will need, predicted before it starts: ``optq quantize --dry-run``.

:class:`RunPlan` holds the predicted terms (peak RAM per phase, disk, a rough time) and prints
them; :func:`optq.pipeline.planning.predict.plan` computes one without reading a weight;
:func:`machine_speed` measures the rates the time estimate scales from.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from optq.core.config import QuantConfig

__all__ = ["RUNTIME_BYTES", "GB", "RunPlan", "machine_speed"]

GB = 1e9
# RSS after importing torch, transformers, safetensors, optq and building a skeleton, once the
# calibration text is tokenised (in a child process: no tokenizer here): 0.37-0.38 GB measured
# by benchmarks/scale_memory.py (its "run prepared" row) on SmolLM2.
RUNTIME_BYTES = int(0.38 * GB)


@dataclass
class RunPlan:
    """What a run will need; byte values are bytes, ``seconds`` a rough estimate."""

    model: str
    blocks_name: str
    blocks: list[dict[str, Any]]  # per block: name, params, linears [{name, in, out, group, quantized}]
    settings: dict[str, Any]
    capture: dict[str, int]  # the capture's terms (the embeddings are released after it)
    ram: dict[str, int]  # the blocks phase's terms
    assembly: dict[str, int]  # the assembly phase's terms
    disk: dict[str, int]
    seconds: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_ram(self) -> int:
        return max(sum(self.capture.values()), sum(self.ram.values()), sum(self.assembly.values()))

    @property
    def output_bytes(self) -> int:
        """The finished checkpoint folder's size."""
        return sum(v for k, v in self.disk.items() if k.startswith("output"))

    @property
    def journal_bytes(self) -> tuple[int, int]:
        """(packed blocks, activation files) of the journal at its largest."""
        return tuple(v for k, v in self.disk.items() if k.startswith("journal"))  # type: ignore[return-value]

    @property
    def disk_peak(self) -> int:
        # The activations are gone before the output is assembled beside the packed blocks.
        blocks, acts = self.journal_bytes
        return max(blocks + acts, self.output_bytes + blocks)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            peak_ram=self.peak_ram,
            output_bytes=self.output_bytes,
            disk_peak=self.disk_peak,
            total_seconds=sum(self.seconds.values()),
        )
        return out

    def format(self, max_blocks: int = 2) -> str:
        """A readable table for ``optq quantize --dry-run``."""
        s = self.settings
        n_lin = sum(len(b["linears"]) for b in self.blocks)
        n_q = sum(x["quantized"] for b in self.blocks for x in b["linears"])
        head = (
            f"model {self.model}: {len(self.blocks)} blocks in {self.blocks_name}, {n_lin} linears ({n_q} to quantize)"
        )
        calib = (
            f"calibration {s['nsamples']} x {s['seqlen']} tokens, batch {s['batch_size']}, "
            f"compute {s['compute_dtype']}, source {s['source_dtype']}, {s['bits']}-bit g{s['group_size']}, "
            f"{s['strategy']}, propagate {s['propagate']}, hessians {s['hessian_dtype']}"
        )
        lines = [head, calib, ""]
        kinds: dict[tuple, list[dict[str, Any]]] = {}
        for b in self.blocks:
            sig = tuple((x["name"][len(b["name"]) + 1 :], x["in"], x["out"], x["quantized"]) for x in b["linears"])
            kinds.setdefault(sig, []).append(b)
        for sig, members in list(kinds.items())[:max_blocks]:
            b = members[0]
            lines.append(f"{b['name']} and {len(members) - 1} more like it ({b['params'] / 1e6:.1f}M params each)")
            for rel, k, n, q in sig:
                lines.append(f"  {rel:<40} {k:>7} -> {n:<7}{'' if q else '  (kept)'}")
        if len(kinds) > max_blocks:
            lines.append(f"  ... {len(kinds) - max_blocks} more kinds of block")
        lines.append("")

        def table(title: str, terms: dict[str, int]) -> None:
            lines.append(title)
            for k, v in terms.items():
                lines.append(f"  {k:<32} {_size(v)}")
            lines.append(f"  {'total':<32} {_size(sum(terms.values()))}")

        if self.capture:  # a run from the weights alone captures nothing
            table("peak RAM while capturing the first block's inputs", self.capture)
        table("peak RAM while quantizing blocks", self.ram)
        table("peak RAM while assembling the output", self.assembly)
        lines.append(f"predicted peak RAM {self.peak_ram / GB:.2f} GB")
        lines.append("")
        lines.append("disk")
        for k, v in self.disk.items():
            lines.append(f"  {k:<48} {_size(v)}")
        lines.append(
            f"output {self.output_bytes / GB:.3f} GB; needed at the peak (output + packed blocks, "
            f"or the journal while running) {self.disk_peak / GB:.3f} GB"
        )
        lines.append("")
        total = sum(self.seconds.values())
        lines.append(
            "time (rough, +-50%): "
            + ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
            + f"; total {total:.0f} s = {total / 3600:.2f} h"
        )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


_SPEED: dict[str, float] = {}


def machine_speed() -> dict[str, float]:
    """This machine's float32 matmul rate (FLOP/s) and GPTQ solve rate, measured once (~1 s)."""
    if _SPEED:
        return dict(_SPEED)
    from optq.core.solver import gptq

    a, b = torch.randn(1024, 1024), torch.randn(1024, 2048)
    best = math.inf
    for _ in range(4):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
    H, W = x.T @ x / 4096, torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    solve = math.inf
    for _ in range(2):
        t = time.perf_counter()
        gptq(W, H, QuantConfig())
        solve = min(solve, time.perf_counter() - t)
    _SPEED.update(flops=2 * 1024 * 1024 * 2048 / best, solve_unit=solve / (2 * 1024**3))
    return dict(_SPEED)


def _size(n: float) -> str:
    """Bytes in the largest unit that keeps a digit before the point (small models plan in kB)."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:10.3f} {unit}"
    return f"{n:10.0f} B"
