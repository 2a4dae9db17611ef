"""The method and serving flags of ``optq quantize`` (``RunSettings.method`` and GPTAQ's settings;
``serve``, ``strict_groups``, ``target_bits`` and ``target_check``)."""

from __future__ import annotations

from typing import Any

__all__ = ["add_method_flags", "add_serving_flags"]


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


def add_serving_flags(group: Any, engines: Any) -> None:
    """Add ``--serve`` (from ``engines``), ``--strict-groups``, ``--target-bits`` and
    ``--target-check`` to an argparse group (``RunSettings.target_check``'s default restated:
    a test holds them equal)."""
    group.add_argument(
        "--serve",
        default=",".join(engines),
        metavar="ENGINES",
        help=f"engines every layer must run on, from {','.join(engines)} (default all; 'none': no check)",
    )
    group.add_argument(
        "--strict-groups",
        action="store_true",
        help="refuse layers whose width the group size does not divide (default: a smaller group for those layers)",
    )
    group.add_argument(
        "--target-bits",
        type=float,
        metavar="B",
        help="average stored bits per weight (scales and zeros included): each linear's bits and group size "
        "chosen under it from measured sensitivity, checked by KL to the float model; needs --serve without "
        "transformers, or --format compressed-tensors",
    )
    group.add_argument(
        "--target-check",
        type=int,
        default=3,
        metavar="K",
        help="with --target-bits: the K allocations with the lowest KL by the quick check are quantized as the "
        "run does and compared again (about one run each; default %(default)s; 0: the quick check decides)",
    )
