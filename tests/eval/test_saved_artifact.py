"""On the real SmolLM2-135M (skipped unless `optq fetch smollm2-135m enwiki` was run): the saved
4-bit checkpoint, loaded back, evaluates like the in-memory quantized model that the README's
quality table measures, on QuantLinear's exact path and on its fast int4 path, and `optq eval`
on the folder reports the same number."""

from __future__ import annotations

import json

import pytest

import optq
from optq.cli import main
from optq.formats.qlinear import QuantLinear

pytestmark = pytest.mark.real


def test_saved_checkpoint_evaluates_like_the_in_memory_model(smollm2, enwiki, gptq4, tmp_path):
    _, tokenizer = smollm2
    _, windows = enwiki
    n_windows, seqlen = windows.shape
    qmodel, report, memory_ppl = gptq4
    folder = tmp_path / "smollm2-4bit"
    optq.save(qmodel, folder, solutions=report.solutions, tokenizer=tokenizer, report=report)
    loaded = optq.load(folder, embeddings="model")
    qlinears = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert len(qlinears) == 210 and all(q.bits == 4 for q in qlinears)

    # optq.load built every layer's fast path (the int4 kernel's packed codes)
    assert all(q.fast_weight is not None for q in qlinears)
    for q in qlinears:
        q.use_fast_path = False  # unpack, dequantize in fp32, matmul
    exact_ppl = optq.perplexity(loaded, windows)
    for q in qlinears:
        q.use_fast_path = True  # PyTorch's int4 kernel and bfloat16 matmul
    fast_ppl = optq.perplexity(loaded, windows)
    print(
        f"4-bit enwiki perplexity: in memory {memory_ppl:.4f}, loaded exact {exact_ppl:.4f}, loaded fast {fast_ppl:.4f}"
    )
    # Measured: within 0.01% (exact: only the float16 rounding of the scales differs) and 0.03%
    # (fast: bfloat16 arithmetic); the bounds leave room for other CPUs' kernels.
    assert exact_ppl == pytest.approx(memory_ppl, rel=1e-3)
    assert fast_ppl == pytest.approx(memory_ppl, rel=5e-3)

    out = tmp_path / "eval.json"
    argv = ["eval", str(folder), "--data", "enwiki", "--windows", str(n_windows), "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    (row,) = result["results"]
    assert result["seqlen"] == seqlen and result["bos_id"] is None
    assert row["corpus"] == "enwiki" and row["windows"] == n_windows
    assert row["tokens"] == n_windows * (seqlen - 1)
    # the command loads the folder as optq.load does by default (fast path on, bfloat16
    # embeddings: measured +0.01% on this checkpoint with min/max ranges, -0.13% with the default's
    # searched ones: rounding the embeddings to bfloat16 moves 4 windows' perplexity by that much)
    # and reads the same windows
    served_ppl = optq.perplexity(optq.load(folder), windows)
    assert served_ppl == pytest.approx(fast_ppl, rel=4e-3)
    assert row["perplexity"] == pytest.approx(served_ppl, rel=1e-6)
