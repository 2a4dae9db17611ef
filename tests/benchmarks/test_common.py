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


def _folders_put_on_the_path(root: Path) -> list[Path]:
    # the folders scripts put first on sys.path, and those pytest's default "prepend" import mode
    # puts there (tests/ and its subfolders hold no __init__.py)
    folders = [root / "benchmarks", root / "benchmarks" / "peers_child", root / "tests"]
    return folders + [p for p in (root / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_no_module_put_on_the_path_shadows_an_installed_or_standard_one():
    # transformers 5.25 imports the `kernels` package once it is installed; a benchmarks/kernels.py
    # first on the path made every model import fail in CI. Any such name shadows silently.
    import importlib.machinery

    root = BENCH.parent.resolve()
    ours = _folders_put_on_the_path(root)
    # the checkout's root is on the path too (optq itself), but holds no loose module to check
    elsewhere = [p for p in sys.path if p and Path(p).resolve() not in (root, *ours)]
    clashes = {
        str(f.relative_to(root)): f.stem
        for folder in ours
        for f in folder.glob("*.py")
        if f.stem != "conftest"
        and (f.stem in sys.stdlib_module_names or importlib.machinery.PathFinder.find_spec(f.stem, elsewhere))
    }
    assert not clashes, f"rename these: they hide an installed or standard module of the same name: {clashes}"


def test_the_shadow_check_sees_a_clash(tmp_path, monkeypatch):
    # the check above must be able to fail: a planted installed module named like a benchmark
    (tmp_path / "common.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AssertionError, match="common"):
        test_no_module_put_on_the_path_shadows_an_installed_or_standard_one()
