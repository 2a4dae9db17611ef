"""What the benchmark scripts share: this checkout on the import path, the KL they compare
models by, a digest of a model's weights, and Markdown tables.

Each script runs from the repository root as ``python benchmarks/NAME.py``. Python puts
benchmarks/ first on the path, so ``import common`` finds this module; importing it puts the
repository root first (the checkout's optq is what is measured, whichever optq is installed)
and keeps benchmarks/ on the path (the scripts import each other). Nothing here imports torch or
optq at the top: scale.py's workers measure their RSS after their own imports.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["ROOT", "kl_per_token", "weights_sha256", "md_row", "md_table"]

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def kl_per_token(
    p_logits: torch.Tensor | Sequence[torch.Tensor], q_logits: torch.Tensor | Sequence[torch.Tensor]
) -> float:
    """Mean KL(p || q) per token between two models' logits on the same tokens: each a tensor
    [windows, tokens, vocab] or a list of such batches. The library's own computation
    (``optq.pipeline.allocation.passes.mean_kl``, by which ``--target-bits`` compares
    allocations): log-softmax in float32, one window at a time."""
    import torch

    from optq.pipeline.allocation.passes import mean_kl

    if isinstance(p_logits, torch.Tensor):
        p_logits, q_logits = [p_logits], [q_logits]
    p, q = list(p_logits), list(q_logits)
    if [t.shape for t in p] != [t.shape for t in q]:
        raise ValueError("kl_per_token: the two models' logits differ in shape")
    return mean_kl(p, {"q": q}, lambda logits: logits)["q"]


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over the model's state dict in name order: each tensor's name, then its bytes
    (any dtype, any device)."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def md_row(cells: Sequence[Any]) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(head: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table: the head, its rule, the rows."""
    return "\n".join([md_row(head), md_row(["---"] * len(head)), *(md_row(r) for r in rows)])
