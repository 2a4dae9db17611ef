"""The method and serving flags of ``optq quantize`` (``RunSettings.method`` and GPTAQ's settings;
``serve``, ``strict_groups``, ``target_bits`` and ``target_check``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from optq.pipeline import methods
from optq.pipeline.settings import RunSettings

__all__ = ["add_method_flags", "add_serving_flags"]


def add_method_flags(group: Any) -> None:
    """Add ``--method`` (the registered methods, ``optq.pipeline.methods``, and RunSettings'
    default), ``--gptaq-alpha`` and ``--gptaq-form`` to an argparse group (GPTAQ_FORMS and the
    defaults of ``optq.pipeline.settings`` restated)."""
    default = {f.name: f.default for f in dataclasses.fields(RunSettings)}["method"]
    group.add_argument(
        "--method",
        choices=methods.names(),
        default=default,
        help="; ".join(
            f"{name}{' (default)' if name == default else ''}: {methods.get(name).help}" for name in methods.names()
        ),
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
