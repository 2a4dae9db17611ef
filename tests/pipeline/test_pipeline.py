"""optq.quantize end to end on tiny random models of several architectures."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import optq
from optq.core import gptaq, solver
from optq.formats.linears import find_linears, get_weight
from optq.pipeline.discovery import find_blocks

pytest.importorskip("transformers")
from tiny import ARCHS, CFG, VOCAB, assert_on_own_grid, assert_on_static_grid, build, tokens  # noqa: E402
from tiny import run as _run  # noqa: E402


def _block_linears(model):
    name, blocks = find_blocks(model)
    return {n: m for i, b in enumerate(blocks) for n, m in find_linears(b, f"{name}.{i}").items()}


def _outside_blocks(model):
    inside = {id(p) for n, b in [find_blocks(model)] for p in b.parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in inside}


@pytest.mark.parametrize("arch, normalize_tokens", [(a, True) for a in ARCHS] + [("llama", False), ("gpt2", False)])
def test_quantize_puts_every_linear_on_the_grid(arch, normalize_tokens):
    model = build(arch)
    before = {n: get_weight(m).clone() for n, m in _block_linears(model).items()}
    untouched = _outside_blocks(model)
    # min/max ranges (no search), the grid computed independently below; the default's searched
    # ranges are checked in the next test
    cfg = dataclasses.replace(CFG, normalize_tokens=normalize_tokens, mse=False, mse_hessian=False)
    report = _run(model, config=cfg, method="gptq")  # GPTAQ fits its grid to corrected weights: below
    linears = _block_linears(model)
    assert cfg.act_order and cfg.static_groups and cfg.sym  # the grid checked below
    assert report.config["normalize_tokens"] is normalize_tokens
    assert set(report.layers) == set(linears) == set(report.solutions)
    for name, mod in linears.items():
        w, sol = get_weight(mod), report.solutions[name]
        assert not torch.equal(w, before[name]), name
        assert torch.equal(w, sol.weight), name
        # The grid is computed here from the ORIGINAL weights (static groups fit it up front),
        # not read back from the solution: every weight must lie on it, codes and scales included.
        assert_on_static_grid(name, before[name], w, sol, CFG.bits, CFG.group_size)
        assert report.layers[name].shape == tuple(w.shape)
        assert report.layers[name].tokens == 6 * 16
    for n, p in _outside_blocks(model).items():  # embeddings, norms, head
        assert torch.equal(p, untouched[n]), n
    t = report.totals
    assert t["objective"] < t["rtn_objective"]
    assert t["mean_objective_ratio"] < 1.0
    assert report.fallbacks == {} and report.skipped == {}


def test_the_default_method_gptaq_puts_every_linear_on_a_grid_and_is_gptq_where_inputs_agree():
    """GPTAQ (the default) fits each static group's grid to its corrected weights W(I + P), so the
    grid is read from the solution here, but checked: every weight is scale·(q - zero) with integer
    q in range and the symmetric zero. Where the quantized and float models' inputs agree (block
    0's first group) the correction is zero and the layer is GPTQ's, on a grid fitted to the
    original weights by the default range search: each range within the min/max one, and some
    strictly inside it; after that group the two methods differ."""
    model, twin = build("llama"), build("llama")
    before = {n: get_weight(m).clone() for n, m in _block_linears(model).items()}
    report = _run(model)
    plain = _run(twin, method="gptq")
    assert report.options["method"] == "gptaq"
    for name, mod in _block_linears(model).items():
        assert_on_own_grid(name, get_weight(mod), report.solutions[name], CFG.bits, CFG.group_size)
    first = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    for name in first:
        sol = report.solutions[name]
        assert torch.equal(sol.weight, plain.solutions[name].weight), name
        w0 = before[name].double()
        absmax = w0.abs().reshape(w0.shape[0], -1, CFG.group_size).amax(2)  # static groups: original columns
        minmax = 2 * absmax / (2**CFG.bits - 1)
        assert bool((sol.scales.double() <= minmax * (1 + 1e-6)).all()), name
        assert bool((sol.scales.double() < minmax * (1 - 1e-3)).any()), name  # the search did shrink some
    later = [n for n in report.solutions if n not in first]
    assert all(not torch.equal(report.solutions[n].weight, plain.solutions[n].weight) for n in later)


def test_report_numbers_are_consistent_and_serialise(tmp_path):
    model = build("llama")
    originals = {n: get_weight(m).clone() for n, m in _block_linears(model).items()}
    report = _run(model)
    row = report.layers["model.layers.0.self_attn.q_proj"]
    assert row.damp == CFG.damp and row.seconds >= 0 and row.subset == 0
    assert 0 < row.relative_error < 1 and row.gain > 1
    path = report.save_json(tmp_path / "report.json")
    data = json.loads(path.read_text())
    assert data["config"] == CFG.to_dict()
    assert set(data["versions"]) >= {"torch", "transformers", "optq"}
    assert data["totals"]["layers"] == len(originals) == 14
    assert (
        data["layers"]["model.layers.1.mlp.down_proj"]["objective"]
        == report.layers["model.layers.1.mlp.down_proj"].objective
    )
    assert "solutions" not in data


def test_layer_objective_matches_the_first_block_hessian():
    fp = build("llama")
    calib = tokens(n=6, seqlen=16)
    q_proj = fp.model.layers[0].self_attn.q_proj
    H = optq.Hessian(q_proj.in_features, normalize_tokens=CFG.normalize_tokens)
    handle = q_proj.register_forward_pre_hook(lambda m, a: H.update(a[0]))
    with torch.no_grad():
        fp(input_ids=calib, use_cache=False)
    handle.remove()
    W = q_proj.weight.detach().clone()
    report = _run(build("llama"), calib=calib)
    row = report.layers["model.layers.0.self_attn.q_proj"]
    Wq = report.solutions["model.layers.0.self_attn.q_proj"].weight
    assert row.objective == pytest.approx(optq.objective(W, Wq, H.matrix()), rel=1e-4)
    assert row.rtn_objective == pytest.approx(optq.objective(W, optq.rtn(W, CFG).weight, H.matrix()), rel=1e-4)


def _state_bytes(model) -> dict[str, bytes]:
    return {k: v.detach().contiguous().numpy().tobytes() for k, v in model.state_dict().items()}


def test_deterministic(one_thread, tmp_path):
    """The same run, once here and once in a fresh process with another hash seed, another global
    RNG state and another batch size, gives the same bytes: with float64 Hessians the result is
    promised to depend on the model, data and settings alone (and one thread on both sides, for
    the same float32 forwards). An unseeded draw anywhere (the calibration windows, the solver)
    differs between the two, and so does the iteration order of a set of strings."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    stream = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(5))
    torch.save(stream, tmp_path / "stream.pt")
    kw = {"nsamples": 6, "seqlen": 16, "hessian_dtype": "float64"}
    tests = Path(__file__).resolve().parent.parent
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(tests.parent)!r}, {str(tests)!r}]
        import torch
        from tiny import build, run
        torch.set_num_threads(1)
        model = build("qwen2")
        torch.manual_seed(987)  # not the parent's global RNG state
        torch.rand(11)
        run(model, calib=torch.load({str(tmp_path / "stream.pt")!r}), batch_size=3, **{kw!r})
        torch.save(model.state_dict(), {str(tmp_path / "other.pt")!r})
    """)
    )
    seed = "54321" if os.environ.get("PYTHONHASHSEED") == "12345" else "12345"  # not this process's
    env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    model = build("qwen2")
    torch.manual_seed(123)
    _run(model, calib=stream, batch_size=2, **kw)
    here = _state_bytes(model)
    other = torch.load(tmp_path / "other.pt")
    assert other.keys() == here.keys()
    differ = [k for k in here if other[k].contiguous().numpy().tobytes() != here[k]]
    assert not differ, differ[:5]
    assert here != _state_bytes(build("qwen2"))  # the run changed the weights


def test_propagate_original_and_quantized_differ_after_the_first_block():
    q, o = build("llama"), build("llama")  # GPTQ: GPTAQ (the default) needs the quantized chain
    rq, ro = _run(q, propagate="quantized", method="gptq"), _run(o, propagate="original", method="gptq")
    for name in rq.layers:
        same = torch.equal(rq.solutions[name].weight, ro.solutions[name].weight)
        # block 0 sees identical inputs in both modes; block 1 sees quantized vs original ones
        assert same == name.startswith("model.layers.0."), name
    assert ro.options["propagate"] == "original"


@pytest.mark.parametrize("method", ["gptaq", "gptq"])
def test_one_factorisation_per_shared_input(monkeypatch, method):
    calls, factorisations = [], []
    owner, fn = (gptaq, "gptaq_with_floor") if method == "gptaq" else (solver, "gptq")
    real = getattr(owner, fn)
    monkeypatch.setattr(owner, fn, lambda W, *a, **k: calls.append(tuple(W.shape)) or real(W, *a, **k))
    for module in (solver, gptaq):  # GPTAQ's solve and its floor share one factorisation
        monkeypatch.setattr(
            module, "factored", lambda W, *a, _f=module.factored, **k: factorisations.append(W.shape) or _f(W, *a, **k)
        )
    _run(build("llama"), method=method)
    # per block: q/k/v stacked (32+16+16 rows), o, gate/up stacked, down
    assert calls == [(64, 32), (32, 32), (128, 32), (32, 64)] * 2
    assert len(factorisations) == len(calls)


def test_stacked_solve_equals_separate_solves():
    torch.manual_seed(0)
    X = torch.randn(2048, 48) * torch.rand(48) * 3
    h = optq.Hessian(48)
    h.update(X)
    Ws = [torch.randn(n, 48) for n in (48, 16, 16)]
    for cfg in (CFG, optq.QuantConfig(bits=4, group_size=-1, act_order=True, sym=False)):
        stacked = optq.gptq(torch.cat(Ws), h.matrix(), cfg)
        separate = torch.cat([optq.gptq(w, h.matrix(), cfg).weight for w in Ws])
        assert torch.equal(stacked.weight, separate)


def test_include_exclude():
    model = build("llama")
    before = {n: get_weight(m).clone() for n, m in _block_linears(model).items()}
    report = _run(model, include="*.mlp.*", exclude="re:layers\\.1\\.mlp\\.down")
    assert set(report.layers) == {
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    }
    for n, m in _block_linears(model).items():
        assert torch.equal(get_weight(m), before[n]) == (n not in report.layers), n


def test_rtn_method_rounds_to_nearest():
    model = build("opt")
    before = {n: get_weight(m).clone() for n, m in _block_linears(model).items()}
    report = _run(model, method="rtn")
    for n, m in _block_linears(model).items():
        assert torch.equal(get_weight(m), optq.rtn(before[n], CFG).weight), n
        # from the weights alone: no Hessian to measure errors on (tests/pipeline/test_weights_only.py)
        assert report.layers[n].objective is None and report.layers[n].rtn_objective is None
    assert report.unmeasured is not None


def test_text_calibration_with_a_tokenizer():
    class CharTokenizer:
        def __call__(self, text, **kw):
            return {"input_ids": [ord(c) % VOCAB for c in text]}

    text = ["the quick brown fox jumps over the lazy dog"] * 10
    report = _run(build("llama"), calib=text, tokenizer=CharTokenizer(), nsamples=5, seqlen=12)
    assert report.options["nsamples"] == 5 and report.options["tokens"] == 60
    with pytest.raises(ValueError, match="has 43 tokens, fewer than nsamples x seqlen = 4 x 12"):
        _run(build("llama"), calib=text[0], tokenizer=CharTokenizer(), nsamples=4, seqlen=12)
    with pytest.raises(ValueError, match="tokenizer"):
        _run(build("llama"), calib=text)


def test_list_of_samples_and_stream():
    report = _run(build("mistral"), calib=[torch.randint(0, VOCAB, (n,)) for n in (16, 16, 12)])
    assert report.options["tokens"] == 44
    stream = torch.randint(0, VOCAB, (500,))
    report = _run(build("mistral"), calib=stream, nsamples=3, seqlen=20)
    assert report.options["tokens"] == 60


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(nsamples=7), "nsamples=7 is out of range"),
        (dict(nsamples=0), "nsamples=0 is out of range"),
        (dict(seqlen=17), "seqlen=17 is out of range"),
        (dict(seqlen=65), "seqlen=65 is out of range"),
        (dict(propagate="both"), "propagate"),
        (dict(method="awq"), "method"),
        (dict(batch_size=0), "batch_size"),
        (dict(calib=torch.full((2, 8), VOCAB)), "outside the model's vocabulary"),
        (dict(calib=torch.randn(2, 8)), "token ids"),
        (dict(include="nope"), "matches none"),
        (dict(strategy="fast"), "strategy"),
        (dict(device="gpu0"), "not a torch device"),
        pytest.param(
            dict(device="cuda"),
            "no usable CUDA",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present"),
        ),
    ],
)
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        _run(build("llama"), **kw)


def test_model_without_blocks_or_linears():
    class NoLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.layers = torch.nn.ModuleList([torch.nn.LayerNorm(4) for _ in range(2)])

    with pytest.raises(ValueError, match="no decoder blocks"):
        _run(NoLinear())


def test_factorisation_failure_names_the_layer(monkeypatch):
    def fail(W, H, c):
        raise solver.FactorizationError("not positive definite")

    monkeypatch.setattr(gptaq, "factored", fail)  # the default method's (GPTAQ's) factorisation
    with pytest.raises(optq.FactorizationError, match=r"model\.layers\.0\.self_attn\.q_proj.*damp"):
        _run(build("llama"))


def test_progress_bar_and_device_option(capsys):
    report = _run(build("phi"), progress=True, device="cpu")
    assert "optq" in capsys.readouterr().err
    assert report.options["device"] == "cpu" and len(report.block_seconds) == 2
