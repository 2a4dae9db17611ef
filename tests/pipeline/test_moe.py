"""Mixture-of-experts models through the pipeline: every expert quantized, routers in float,
the options checked, batch-order independence, the Hessian budget, the plan, the checkpoint,
streaming and the report page. Each expert's Hessian (routed, all tokens, starved, weighted)
is checked in test_moe_hessians.py.

Tiny random models (tests/tiny_moe.py): Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS and a custom
top-1 ModuleList MoE whose expert MARKED is routed only the marked token (last batch) and whose
expert NEVER is never routed."""

from __future__ import annotations

import html

import pytest
import torch

import optq

pytest.importorskip("transformers")
from tiny_moe import ALL, CFG, FUSED, build, expert_linears, quantize, tokens  # noqa: E402

from optq.formats.experts import ExpertLinears  # noqa: E402
from optq.formats.linears import find_linears  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- every expert
@pytest.mark.parametrize("arch", ALL)
def test_every_expert_is_quantized_and_routers_stay_float(arch):
    model, report, original = quantize(arch)
    experts = expert_linears(model)
    assert len(experts) == (4 * 3 * 2 if arch != "deepseek_v3" else 4 * 3), sorted(experts)[:5]
    for name, mod in experts.items():
        assert name in report.layers and name in report.solutions, name
        sol = report.solutions[name]
        # On its grid: the weight is what its codes, scales and zeros give, and it moved.
        assert torch.equal(mod.weight, sol.dequantize().to(mod.weight.dtype)), name
        assert not torch.equal(mod.weight, original[f"{name}.weight"]), name
        assert report.layers[name].hessian is not None
    routers = [k for k in original if k.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight"))]
    assert routers
    for key in routers:
        assert torch.equal(model.state_dict()[key], original[key]), key
        module = key[: -len(".weight")]
        assert key in report.skipped or module in report.skipped, key
    if arch in FUSED:  # fused experts became one nn.Linear per matrix, same names as the checkpoint
        assert any(isinstance(m, ExpertLinears) for m in model.modules())
        assert not any(p.dim() == 3 for p in model.parameters())
    # Shared experts (Qwen2-MoE, DeepSeek-V3) are ordinary linears, quantized too.
    for name in find_linears(model):
        if "shared_expert." in name or "shared_experts." in name:
            assert name in report.solutions, name


def test_include_can_force_routers_but_wildcards_over_the_mlp_do_not():
    _, report, _ = quantize("qwen2_moe", include=["*.shared_expert_gate", "*.experts.*"])
    assert "model.layers.0.mlp.shared_expert_gate" in report.solutions
    _, report, _ = quantize("custom", include=["*.mlp.*"])
    assert "model.layers.0.mlp.gate" not in report.solutions
    assert "model.layers.0.mlp.gate" in report.skipped


def test_bad_moe_options_are_refused():
    model = build("mixtral")
    for kw in (
        {"moe_calibration": "some"},
        {"moe_min_tokens": -1},
        {"max_hessian_memory": 0},
        {"moe_weighting": "x"},
        {"hessian_dtype": "float16"},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            optq.quantize(model, tokens(), CFG, progress=False, **kw)


# --------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("arch", ["mixtral", "custom"])
def test_same_bytes_whatever_the_batch_order_or_size(arch):
    ids = tokens(n=8, seqlen=16)
    kw = {"moe_min_tokens": 0, "hessian_dtype": "float64"}
    ref, _, _ = quantize(arch, ids, batch_size=4, **kw)
    ref_w = _weights(ref)
    for other_ids, bs in (
        (ids.flip(0), 4),
        (ids, 8),
        (ids[torch.randperm(8, generator=torch.Generator().manual_seed(3))], 2),
    ):
        model, _, _ = quantize(arch, other_ids, batch_size=bs, **kw)
        got = _weights(model)
        for key in ref_w:
            assert torch.equal(got[key], ref_w[key]), (key, bs)


def test_hessian_budget_chunks_experts_with_extra_forwards_and_the_same_weights():
    ids = tokens(n=8, seqlen=16)
    ref, ref_report, _ = quantize("mixtral", ids, moe_calibration="routed", moe_min_tokens=0)
    # Room for two gate/up Hessians (32 inputs; solver's + plain, float32): the 4 experts' gate/up
    # take 2 chunks, while their down projections (16 inputs, a quarter of the bytes) fit in one.
    small, report, _ = quantize(
        "mixtral", ids, moe_calibration="routed", moe_min_tokens=0, max_hessian_memory=2 * 32 * 32 * 4 * 2
    )
    for block, info in report.moe.items():
        assert info["stages"] == 2 and ref_report.moe[block]["chunks"] == 2
        assert info["chunks"] == 3
        assert info["extra_forwards"] == ref_report.moe[block]["extra_forwards"] + 1
    ref_w, got = _weights(ref), _weights(small)
    assert all(torch.equal(ref_w[k], got[k]) for k in ref_w)


def test_pause_strategy_replays_moe_blocks_with_the_same_weights():
    ids = tokens(n=8, seqlen=16)
    a, _, _ = quantize("custom", ids, moe_min_tokens=0)
    b, _, _ = quantize("custom", ids, moe_min_tokens=0, strategy="pause")
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# --------------------------------------------------------------------------- plan
@pytest.mark.parametrize("method, matrices", [("gptq", 2), ("gptaq", 3)])
def test_plan_lists_every_expert_and_bounds_the_stage_hessians_by_the_budget(method, matrices):
    from optq.pipeline.planning import plan

    cfg = build("mixtral").config.to_dict()
    cfg["num_local_experts"] = 64  # enough that an expert stage's Hessians outweigh any dense group
    speed = {"flops": 1e10, "solve_unit": 1e-9}
    big = plan(cfg, nsamples=4, seqlen=16, config=CFG, speed=speed, method=method)
    names = [r["name"] for b in big.blocks for r in b["linears"]]
    assert {f"model.layers.0.mlp.experts.{e}.{m}" for e in range(4) for m in ("w1", "w2", "w3")} <= set(names)
    quantized = {r["name"] for b in big.blocks for r in b["linears"] if r["quantized"]}
    assert "model.layers.0.mlp.experts.3.w2" in quantized
    # A stage of 64 experts' gate/up Hessians (32 inputs, solver's + plain, and GPTAQ's cross term,
    # float32) with a solve of 2 x 16 rows, against one of them within a budget of one Hessian.
    solve = (5 * 32 * 32 + 4 * 32 * 32) * 4
    one = 32 * 32 * 4 * matrices
    assert (big.ram["hessians"], big.ram["solve workspace"]) == (64 * one, solve)
    small = plan(cfg, nsamples=4, seqlen=16, config=CFG, speed=speed, max_hessian_memory=one, method=method)
    assert one <= small.ram["hessians"] < big.ram["hessians"]


# --------------------------------------------------------------------------- checkpoint
@pytest.mark.parametrize("arch", ALL)
def test_quantized_moe_saves_under_source_names_and_loads_to_the_same_logits(arch, tmp_path):
    from optq.formats.files import read_index
    from optq.formats.qlinear import QuantLinear, replace_linears

    ids = tokens(n=8, seqlen=16)
    model, report, _ = quantize(arch, ids)
    optq.save(model, tmp_path / "q", solutions=report.solutions, report=report)
    index = read_index(tmp_path / "q")
    layer = 1  # DeepSeek-V3's first layer is dense
    expert = "block_sparse_moe.experts.2.w1" if arch == "mixtral" else "mlp.experts.2.gate_proj"
    if arch == "gpt_oss":  # biases kept, float16 as GPTQ stores them
        assert index[f"model.layers.{layer}.{expert}.bias"][2] == torch.float16
    assert f"model.layers.{layer}.{expert}.qweight" in index
    assert not any(".mlp.experts." in k for k in index) or arch != "mixtral"
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in index)
    packed = {k.rsplit(".", 1)[0] for k in index if k.endswith(".qweight")}
    assert len([k for k in packed if ".experts." in k]) == len(expert_linears(model))
    routers = [k for k in index if k.endswith((".gate.weight", "shared_expert_gate.weight", ".router.weight"))]
    assert routers and all(index[k][2].is_floating_point for k in routers)
    if arch == "custom":  # its config.json is a plain Llama: load into the model's own structure
        return
    loaded = optq.load(tmp_path / "q", embeddings="model")
    for name in expert_linears(model):
        assert isinstance(loaded.get_submodule(name), QuantLinear), name
    replace_linears(model, report.solutions)  # the in-memory quantized model, packed as saved
    for m in [*loaded.modules(), *model.modules()]:
        if isinstance(m, QuantLinear):
            m.use_fast_path = False  # the exact path
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want), float((got - want).abs().max())


# --------------------------------------------------------------------------- streaming
def test_streamed_mixtral_killed_after_block_0_resumes_to_the_same_bytes(kit, tmp_path, monkeypatch):
    from pipeline.resume_helpers import Kill, after_write_block

    model = build("mixtral")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src", max_shard_size=20_000)
    ref = kit.stream(tmp_path / "src", tmp_path / "ref")
    assert ref.moe and all(row.hessian for n, row in ref.layers.items() if ".experts." in n)
    with monkeypatch.context() as mp:
        after_write_block(mp, 0)
        with pytest.raises(Kill):
            kit.stream(tmp_path / "src", tmp_path / "out")
    resumed = kit.stream(tmp_path / "src", tmp_path / "out", resume=True)
    assert kit.folder_bytes(tmp_path / "out") == kit.folder_bytes(tmp_path / "ref")
    assert resumed.moe == ref.moe


def test_report_page_lists_every_expert_with_its_tokens_and_hessian(tmp_path):
    from optq.eval.page import build_page

    ids = tokens(n=4, seqlen=16)
    model, report, _ = quantize("mixtral", ids, moe_calibration="routed", moe_min_tokens=30)
    optq.save(model, tmp_path / "q", solutions=report.solutions, report=report)
    page = build_page(tmp_path / "q", figures=False)
    assert 'id="experts"' in page
    for layer in (0, 1):
        for e in range(4):
            row = report.layers[f"model.layers.{layer}.mlp.experts.{e}.w1"]
            cells = (
                f"<td>model.layers.{layer}.mlp.experts.{e}</td><td>{row.tokens}</td><td>{html.escape(row.hessian)}</td>"
            )
            assert cells in page, cells
    extra = sum(b["extra_forwards"] for b in report.moe.values())
    assert f"{extra} block forwards beyond" in page
    # A dense model's page has no such section.
    from tiny import build as build_dense

    dense = build_dense("llama")
    r = optq.quantize(dense, tokens(), CFG, progress=False)
    optq.save(dense, tmp_path / "d", solutions=r.solutions, report=r)
    assert 'id="experts"' not in build_page(tmp_path / "d", figures=False)
