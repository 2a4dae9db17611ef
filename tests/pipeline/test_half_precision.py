"""bfloat16 and float16 models through the whole pipeline: quantize, the grid, the report, and
a checkpoint round trip."""

from __future__ import annotations

import math

import pytest
import torch

import optq
from optq.formats.linears import find_linears, get_weight
from optq.formats.qlinear import QuantLinear

pytest.importorskip("transformers")
from tiny import assert_on_own_grid, assert_on_static_grid, build, tokens  # noqa: E402

CFG4 = optq.QuantConfig(bits=4, group_size=16, mse=False)  # act-order, static groups; min/max ranges (the grid checked)


def _linears(model):
    return {n: m for i, b in enumerate(model.model.layers) for n, m in find_linears(b, f"model.layers.{i}").items()}


@pytest.mark.parametrize("method", ["gptaq", "gptq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_model_quantizes_saves_and_loads(dtype, method, tmp_path):
    model = build("llama").to(dtype)
    calib = tokens(n=6, seqlen=16)
    before = {n: get_weight(m).clone() for n, m in _linears(model).items()}
    report = optq.quantize(model, calib, CFG4, progress=False, batch_size=2, method=method)

    # Every weight keeps its dtype and lies on the grid fitted from the original weights (GPTQ;
    # GPTAQ's grid is fitted to its corrected weights, so there the solution's own grid): the
    # solver works in float32 and the weight is scale·(q - zero) rounded once to the model's
    # dtype, at most half an ulp of |scale·(q - zero)| <= 2^(bits-1)·scale off the grid point.
    tol = 2 ** (CFG4.bits - 1) * torch.finfo(dtype).eps / 2 + 1e-5
    assert set(report.solutions) == set(before) and len(before) == 14
    for name, mod in _linears(model).items():
        w, sol = get_weight(mod), report.solutions[name]
        assert w.dtype == dtype and sol.weight.dtype == dtype, name
        assert not torch.equal(w, before[name]), name
        if method == "gptq":
            assert_on_static_grid(name, before[name], w, sol, CFG4.bits, CFG4.group_size, tol=tol)
        else:
            assert_on_own_grid(name, w, sol, CFG4.bits, CFG4.group_size, tol=tol)
    for p in model.parameters():
        assert p.dtype == dtype

    # The report is finite, and GPTQ beats round-to-nearest on the layer objectives.
    for name, row in report.layers.items():
        for field in ("objective", "rtn_objective", "relative_error"):
            assert math.isfinite(getattr(row, field)), (name, field)
    t = report.totals
    assert math.isfinite(t["objective"]) and t["objective"] < t["rtn_objective"]

    # Saved and loaded in the same dtype: the same codes, and the same logits up to the
    # rounding of the float16 scales and of the half-precision forward.
    optq.save(model, tmp_path / "q", solutions=report.solutions)
    loaded = optq.load(tmp_path / "q", dtype=dtype, embeddings="model")
    qlinears = {n: m for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    assert set(qlinears) == set(before)
    for name, q in qlinears.items():
        q.use_fast_path = False
        assert torch.equal(q.codes(), report.solutions[name].codes), name
        assert torch.equal(q.g_idx, report.solutions[name].g_idx), name
    probe = tokens(n=2, seqlen=16, seed=5)
    with torch.no_grad():
        ref = model(input_ids=probe, use_cache=False).logits
        got = loaded(input_ids=probe, use_cache=False).logits
    assert got.dtype == dtype and torch.isfinite(ref).all()
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=3 * torch.finfo(dtype).eps * scale)
