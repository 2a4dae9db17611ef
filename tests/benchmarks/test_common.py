"""benchmarks/common.py: the checkout on the path, the KL (the library's), the weights' digest
and Markdown tables, each against an independent computation."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import common  # noqa: E402


def _logits(*shape: int, seed: int) -> torch.Tensor:
    return 3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_kl_per_token_is_the_mean_over_tokens_of_kl_between_the_softmaxes():
    p, q = _logits(3, 5, 11, seed=0), _logits(3, 5, 11, seed=1)
    want = torch.nn.functional.kl_div(
        torch.log_softmax(q.double(), -1), torch.log_softmax(p.double(), -1), log_target=True, reduction="sum"
    ) / (3 * 5)
    assert common.kl_per_token(p, q) == pytest.approx(float(want), rel=1e-5)
    # batches in a list: the same mean over every token
    assert common.kl_per_token([p[:2], p[2:]], [q[:2], q[2:]]) == pytest.approx(float(want), rel=1e-5)
    assert common.kl_per_token(p, p) == pytest.approx(0.0, abs=1e-6)
    assert common.kl_per_token(q, p) != pytest.approx(float(want), rel=1e-3)  # KL is not symmetric
    with pytest.raises(ValueError, match="shape"):
        common.kl_per_token(p, q[:2])


def test_weights_sha256_hashes_names_and_raw_bytes_in_name_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    h = hashlib.sha256()
    for name in sorted(model.state_dict()):
        t = model.state_dict()[name]
        raw = t.detach().float().numpy().tobytes() if t.dtype == torch.float32 else None
        if raw is None:  # bfloat16: numpy has no such dtype, take the 16-bit words
            raw = t.detach().view(torch.int16).numpy().tobytes()
        h.update(name.encode() + raw)
    assert common.weights_sha256(model) == h.hexdigest()
    before = common.weights_sha256(model)
    with torch.no_grad():
        model[1].bias[0] += 1
    assert common.weights_sha256(model) != before


def test_md_table():
    assert common.md_table(["a", "b"], [[1, 2.5], ["x", None]]) == (
        "| a | b |\n| --- | --- |\n| 1 | 2.5 |\n| x | None |"
    )


def test_a_script_run_from_the_root_imports_this_checkouts_optq():
    # as `python benchmarks/X.py` starts: benchmarks/ first on the path, no PYTHONPATH (the
    # optq installed in the environment may be another checkout's)
    root = BENCH.parent
    code = "import sys; sys.path.insert(0, 'benchmarks'); import common, optq; print(optq.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    assert Path(out.stdout.strip()).resolve().parent == (root / "optq").resolve()
