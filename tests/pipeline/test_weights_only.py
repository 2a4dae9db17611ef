"""A run whose method reads no Hessian (round-to-nearest) and that needs no calibration activation
otherwise (``Run.weights_only``) quantizes each linear from its weight alone: no capture, no block
forward, no Hessian; the report's errors are null with the reason, in memory and streamed, and a
streamed run still resumes to the same bytes."""

from __future__ import annotations

import json

import pytest
import torch
from pipeline.resume_helpers import Kill, after_commit, journal_state
from torch import nn

import optq
from optq.eval.compare import round_to_nearest
from optq.formats.linears import find_linears, get_weight
from optq.pipeline.discovery import find_blocks

transformers = pytest.importorskip("transformers")
from tiny import build, tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = optq.QuantConfig(bits=3, group_size=16)


class Forward(RuntimeError):
    """Raised by a forward that must not run."""


def _forbid(*_: object, **__: object) -> None:
    raise Forward("a forward ran")


def _block_linears(model: nn.Module) -> dict[str, nn.Module]:
    prefix, blocks = find_blocks(model)
    return {n: m for i, b in enumerate(blocks) for n, m in find_linears(b, f"{prefix}.{i}").items()}


def _with_unused_linear(model: nn.Module) -> nn.Module:
    # A linear of block 0 its forward never calls: a forward-driven run leaves it float.
    torch.manual_seed(5)
    model.model.layers[0].mlp.spare = nn.Linear(32, 32, bias=False)
    return model


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_rtn_run_equals_round_to_nearest_with_null_errors(arch):
    model, ref = build(arch), build(arch)
    if arch == "llama":
        model, ref = _with_unused_linear(model), _with_unused_linear(ref)
    report = optq.quantize(model, tokens(), CFG, method="rtn", progress=False)
    before = {n: get_weight(m).clone() for n, m in _block_linears(ref).items()}
    assert round_to_nearest(ref, CFG)["layers"] == len(report.layers) == len(before)
    for name, module in _block_linears(model).items():
        assert torch.equal(get_weight(module), get_weight(ref.get_submodule(name))), name
        assert torch.equal(get_weight(module), optq.rtn(before[name], CFG).weight), name
        assert not torch.equal(get_weight(module), before[name]), name
    if arch == "llama":  # quantized like every other target: no forward said it is unused
        assert "model.layers.0.mlp.spare" in report.layers and not report.skipped
    rows = report.to_dict()
    assert report.unmeasured and "no calibration forward" in report.unmeasured
    assert rows["unmeasured"] == report.unmeasured
    assert rows["definitions"]["objective"] == f"null: {report.unmeasured}"
    for row in rows["layers"].values():
        for key in ("tokens", "objective", "rtn_objective", "relative_error", "gain", "output_error", "calibration"):
            assert row[key] is None, (row["name"], key)
    assert rows["totals"]["objective"] is None and rows["totals"]["mean_objective_ratio"] is None
    assert rows["totals"]["layers"] == len(before) and rows["totals"]["blocks"] == 2


def test_no_block_forward_runs_in_memory():
    model = build("llama")
    before = {n: get_weight(m).clone() for n, m in _block_linears(model).items()}
    _, blocks = find_blocks(model)
    hooks = [m.register_forward_pre_hook(_forbid) for m in (*blocks, model.get_input_embeddings())]
    report = optq.quantize(model, tokens(), CFG, method="rtn", progress=False)
    assert len(report.layers) == 14 and report.block_seconds and len(report.block_seconds) == 2
    for name, module in _block_linears(model).items():
        assert torch.equal(get_weight(module), optq.rtn(before[name], CFG).weight), name
    # The same hooks stop a method that reads the Hessian, and rtn under target_bits (its
    # allocation measures every layer on calibration data).
    for h in hooks:
        h.remove()
    for kw in ({"method": "gptq"}, {"method": "rtn", "target_bits": 3.5}):
        fresh = build("llama")
        _, fresh_blocks = find_blocks(fresh)
        for m in (*fresh_blocks, fresh.get_input_embeddings()):
            m.register_forward_pre_hook(_forbid)
        with pytest.raises(Forward):
            optq.quantize(fresh, tokens(), CFG, progress=False, **kw)


def test_streamed_rtn_runs_no_forward_and_resumes_to_the_same_bytes(kit, tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    src = kit.save_tiny(tmp_path / "src", "llama", layers=3)
    ref = kit.stream(src, tmp_path / "ref", method="rtn")  # no forward is forbidden here
    want = kit.folder_bytes(tmp_path / "ref")
    with monkeypatch.context() as mp:
        mp.setattr(modeling_llama.LlamaDecoderLayer, "forward", _forbid)
        mp.setattr(nn.Embedding, "forward", _forbid)
        with pytest.raises(Forward):  # the forbidden forwards stop a run that reads the Hessian
            kit.stream(src, tmp_path / "gptq", method="gptq")
        out = tmp_path / "out"
        with monkeypatch.context() as kill:
            after_commit(kill, 1)
            with pytest.raises(Kill):
                kit.stream(src, out, method="rtn")
        state = journal_state(out)
        assert state["done"] == 1 and state["activations"] is None
        assert not list((tmp_path / "out.partial").glob("activations*"))
        assert all(row["objective"] is None for row in state["report"]["layers"])
        report = kit.stream(src, out, method="rtn", resume=True)
    assert kit.folder_bytes(out) == want
    assert list(report.layers) == list(ref.layers) and len(report.layers) == 21
    saved = json.loads((out / kit.REPORT).read_text())
    assert saved["unmeasured"] == ref.unmeasured and saved["totals"]["objective"] is None
