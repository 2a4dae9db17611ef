"""The command line the CLI tests quantize their tiny model with (``tests/cli/conftest.py``'s
``model_dir``): 4 x 16 calibration tokens from its text, 3 bits, group 16, no progress bar, and no
serving engine named (``--serve none``: vLLM refuses its 16-wide projections at 3 bits; the engine
checks have their own tests)."""

from __future__ import annotations

from pathlib import Path


def quantize_args(root: Path, out: Path | None, *extra: str) -> list[str]:
    """``optq quantize ROOT/model [-o OUT] ...`` with the tests' small settings, then ``extra``."""
    output = ["-o", str(out)] if out is not None else []
    small = ["--nsamples", "4", "--seqlen", "16", "--bits", "3", "--group-size", "16", "--no-progress"]
    small += ["--serve", "none"]
    return ["quantize", str(root / "model"), *output, "--calib", str(root / "calib.txt"), *small, *extra]
