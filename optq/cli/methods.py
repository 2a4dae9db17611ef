"""The method flags of ``optq quantize`` (``RunSettings.method`` and GPTAQ's settings)."""

from __future__ import annotations

from typing import Any

__all__ = ["add_method_flags"]


def add_method_flags(group: Any) -> None:
    """Add ``--method``, ``--gptaq-alpha`` and ``--gptaq-form`` to an argparse group (the values
    of ``optq.pipeline.settings``: METHODS, GPTAQ_FORMS and their defaults, not imported here
    so that building the parser loads no torch)."""
    group.add_argument(
        "--method",
        choices=("gptq", "gptaq", "rtn"),
        default="gptaq",
        help="gptaq (default): fit each layer to the float model's outputs (GPTAQ, Li et al. 2025; a float copy "
        "of each block runs beside it: about 2-3x GPTQ's time, the activations twice; chosen on the shift "
        "matrix, docs/lab.md section 8); gptq: GPTQ on the quantized model's inputs alone; rtn: round to nearest",
    )
    group.add_argument(
        "--gptaq-alpha",
        type=float,
        default=0.25,
        metavar="A",
        help="scale of GPTAQ's correction: 0 is GPTQ, 1 the paper's closed form (default 0.25, as the authors' code)",
    )
    group.add_argument(
        "--gptaq-form",
        choices=("paper", "full"),
        default="paper",
        help="paper: each input channel's shift absorbed by the later columns as it is rounded (default); "
        "full: start GPTQ from the least-squares optimum",
    )
