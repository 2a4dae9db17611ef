"""``target_bits``: each linear's bits and group size under a stored-bits budget.

The knapsack against brute force; the budget kept, on the packed tensors a streamed run writes;
the KL that chose the allocation recomputed here on whole models and compared with the
heuristics'; determinism; resume; the flag and the refusals."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from pipeline.resume_helpers import Kill, after_commit
from safetensors import safe_open
from tiny import llama

import optq
from optq.core import solver
from optq.core.hessian import Hessian
from optq.pipeline.allocation import knapsack
from optq.pipeline.settings import RunSettings

transformers = pytest.importorskip("transformers")

CFG = optq.QuantConfig(bits=4, group_size=16)
HEURISTICS = ("first-last-4", "attention-4-mlp-3", "down-4", "uniform-3")


def _model(seed: int = 0, layers: int = 4):
    return llama(hidden=64, inter=128, layers=layers, seed=seed)


def _calib() -> torch.Tensor:
    return torch.randint(0, 96, (8, 24), generator=torch.Generator().manual_seed(3))


def _quantize(model, target: float, **kw):
    return optq.quantize(model, _calib(), CFG, target_bits=target, batch_size=2, progress=False, **kw)


# --- the knapsack ---------------------------------------------------------------------------


def _brute(units, budget):
    best = None
    for choice in itertools.product(*[range(len(u)) for u in units]):
        size = sum(units[i][j][0] for i, j in enumerate(choice))
        err = sum(units[i][j][1] for i, j in enumerate(choice))
        if size <= budget and (best is None or err < best):
            best = err
    return best


def _err(units, choice):
    return sum(units[i][j][1] for i, j in enumerate(choice))


def _size(units, choice):
    return sum(units[i][j][0] for i, j in enumerate(choice))


def _problem(rng: random.Random, n: int):
    units = []
    for _ in range(n):
        k = rng.randint(2, 5)
        units.append([(rng.randint(1, 20), rng.uniform(0, 10)) for _ in range(k)])
    return units


def test_every_lagrangian_point_is_the_least_error_choice_of_its_size():
    rng = random.Random(0)
    for _ in range(40):
        units = _problem(rng, rng.randint(3, 5))
        for choice in knapsack.hull_path(units):
            assert _err(units, choice) == pytest.approx(_brute(units, _size(units, choice)))


def test_solve_keeps_the_budget_and_is_close_to_the_brute_force_optimum():
    rng = random.Random(1)
    gaps = []
    for _ in range(60):
        units = _problem(rng, rng.randint(3, 5))
        low = _size(units, knapsack.smallest(units))
        high = sum(max(s for s, _ in u) for u in units)
        budget = rng.uniform(low, high)
        choice = knapsack.solve(units, budget)
        best = _brute(units, budget)
        assert _size(units, choice) <= budget
        assert _err(units, choice) >= best - 1e-9
        # never worse than the largest Lagrangian point that fits
        fitting = [c for c in knapsack.hull_path(units) if _size(units, c) <= budget]
        assert _err(units, choice) <= _err(units, fitting[-1]) + 1e-9
        gaps.append(_err(units, choice) - best)
    assert sum(g < 1e-9 for g in gaps) >= 45  # exact on most small problems
    assert knapsack.solve([[(5, 1.0)], [(5, 1.0)]], 9) is None


# --- the run --------------------------------------------------------------------------------


def _quantized_model(model, allocation, fit_ids=None):
    """The model with every allocated layer at its setting: rounded, or (``fit_ids`` given)
    GPTQ-solved with the run's config on H from whole-model float forwards of ``fit_ids``
    (hooks on every layer: the library's block-wise streams recomputed independently)."""
    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    hess = {}
    if fit_ids is not None:
        handles = []
        for name in allocation:
            w = mods[name].weight
            hess[name] = Hessian(w.shape[1])
            handles.append(mods[name].register_forward_pre_hook(lambda _m, a, h=hess[name]: h.update(a[0])))
        with torch.no_grad():
            for b in range(0, len(fit_ids), 2):
                q(fit_ids[b : b + 2])
        for h in handles:
            h.remove()
    for name, (b, g) in allocation.items():
        w = mods[name].weight
        if fit_ids is None:
            cfg = optq.QuantConfig(bits=b, group_size=g, act_order=False)
            new = solver.rtn(w.data.float(), cfg).dequantize()
        else:
            cfg = dataclasses.replace(CFG, bits=b, group_size=g)
            new = solver.gptq(w.data.float(), hess[name].matrix(), cfg).weight
        w.data = new.to(w.dtype)
    return q


def _kl_of(model, allocation, ids, fit_ids=None) -> float:
    """KL(float || quantized model) per token on ``ids``, by whole-model forwards."""
    q = _quantized_model(model, allocation, fit_ids)
    with torch.no_grad():
        p = torch.log_softmax(model(ids).logits.float(), -1)
        r = torch.log_softmax(q(ids).logits.float(), -1)
    return float((p.exp() * (p - r)).sum(-1).mean())


@pytest.mark.parametrize("method", ["gptaq", "rtn"])
def test_the_chosen_allocation_has_the_least_kl_recomputed_on_the_whole_model(one_thread, method):
    # The proxy quantizes as the run does: GPTQ on the float model's H (GPTQ and GPTAQ runs),
    # rounding for round-to-nearest runs.
    target = 4.3
    report = _quantize(_model(), target, method=method, target_check=0)  # the proxy alone decides
    a = report.allocation
    fp = _model()
    held = torch.cat([_calib()[2 * b : 2 * b + 2] for b in a["windows"]["kl_batches"]])
    fit = torch.cat([_calib()[2 * b : 2 * b + 2] for b in a["windows"]["sensitivity_batches"]])
    fit = fit if method != "rtn" else None
    assert a["windows"]["kl_batches"] == [3] and a["windows"]["sensitivity_batches"] == [0, 1, 2]  # held out
    assert ("GPTQ on the float model's H" in a["proxy"]) == (method != "rtn")
    found = {k: v for k, v in a["candidates"].items() if "kl" in v}
    assert {k.rsplit("-g", 1)[0] for k in found} >= set(HEURISTICS)  # every heuristic fits and was checked
    chosen = {n: (r["bits"], r["group_size"]) for n, r in a["layers"].items()}
    chosen_kl = _kl_of(fp, chosen, held, fit)
    assert chosen_kl == pytest.approx(found[a["chosen"]]["kl"], rel=2e-3)
    from optq.pipeline.allocation.options import heuristics

    names = sorted(a["layers"])
    checked = 0
    for key, row in found.items():
        base = key.rsplit("-g", 1)
        if base[0] not in HEURISTICS or key.endswith("+fill"):
            continue
        bits = heuristics(names)[base[0]]
        group = int(base[1])
        alloc = {n: (bits[n], group) for n in names}  # 32 and 64 divide every width here
        kl = _kl_of(fp, alloc, held, fit)
        assert kl == pytest.approx(row["kl"], rel=2e-3)
        assert chosen_kl <= kl * (1 + 2e-3)
        checked += 1
    assert checked >= len(HEURISTICS)
    assert a["bits_per_weight"] <= target


def test_each_blocks_kl_is_that_block_alone_quantized(one_thread):
    # The block gains that scale the "+blocks" knapsacks: KL(float || the model with only block i
    # quantized at its base setting), recomputed on whole models.
    a = _quantize(_model(), 4.3).allocation
    g = a["gains"]
    fp = _model()
    ids = torch.cat([_calib()[2 * b : 2 * b + 2] for b in g["batches"]])
    fit = torch.cat([_calib()[2 * b : 2 * b + 2] for b in a["windows"]["sensitivity_batches"]])
    assert g["batches"] == [0] and len(g["block_kl"]) == 4  # a sensitivity batch, not the held-out one
    assert {tuple(s) for s in g["base"].values()} == {(4, 32)}  # the widest bits within 4.3, finest group
    for i in range(4):
        alone = {n: tuple(s) for n, s in g["base"].items() if n.startswith(f"model.layers.{i}.")}
        assert len(alone) == 7
        assert _kl_of(fp, alone, ids, fit) == pytest.approx(g["block_kl"][i], rel=2e-3)
    assert len({round(k, 6) for k in g["block_kl"]}) == 4 and min(g["block_kl"]) > 0


def test_layers_get_the_allocated_settings_and_reasons(one_thread):
    report = _quantize(_model(), 4.3)
    a = report.allocation
    for name, row in a["layers"].items():
        sol = report.solutions[name]
        assert (sol.config.bits, sol.config.group_size) == (row["bits"], row["group_size"])
        assert report.schemes[name]["why"].startswith("target-bits 4.3: allocation")
    assert len({(r["bits"], r["group_size"]) for r in a["layers"].values()}) > 1  # really mixed
    json.dumps(report.to_dict())  # the report stays JSON


def test_the_allocation_is_deterministic(one_thread):
    one = _quantize(_model(), 4.0).allocation
    two = _quantize(_model(), 4.0).allocation
    assert one["layers"] == two["layers"] and one["candidates"] == two["candidates"]


def _stored_bits(out: Path) -> tuple[float, int]:
    report = json.loads((out / "quantization_report.json").read_text())
    total_bits, weights = 0, 0
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                if key.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"):
                    t = st.get_tensor(key)
                    total_bits += t.numel() * t.element_size() * 8
    for row in report["layers"].values():
        weights += row["shape"][0] * row["shape"][1]
    return total_bits / weights, len(report["layers"])


def test_a_streamed_run_stores_at_most_the_budget_and_resumes_byte_identically(kit, tmp_path, monkeypatch):
    src = kit.save_tiny(tmp_path / "src", "llama", dtype=torch.bfloat16, layers=3)
    target = 4.6
    whole = tmp_path / "whole"
    report = kit.stream(src, whole, target_bits=target)
    bits, layers = _stored_bits(whole)
    assert layers == 21
    assert bits == pytest.approx(report.allocation["bits_per_weight"], rel=1e-9)
    assert target - 0.35 < bits <= target
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        after_commit(mp, 1)
        with pytest.raises(Kill):
            kit.stream(src, out, target_bits=target)
    calls = []
    from optq.pipeline.allocation import allocate

    monkeypatch.setattr(allocate, "measure", lambda *a, **k: calls.append(1))
    kit.stream(src, out, target_bits=target, resume=True)
    assert not calls  # the allocation came from the journal, not measured again
    assert kit.folder_bytes(out) == kit.folder_bytes(whole)


# --- settings and refusals ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [2, 1.5, 10.5, True, "3.5"])
def test_budgets_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="target_bits"):
        RunSettings(target_bits=bad)


def test_a_filled_heuristic_keeps_every_layer_at_least_as_stored_and_costs_no_more():
    # "+fill": a heuristic whose unused budget the knapsack spends, no layer below the
    # heuristic's bits or coarser than its group; under the weighting it minimises, it can only
    # lower the heuristic's cost (the heuristic itself is among its choices).
    from optq.pipeline.allocation import allocate
    from optq.pipeline.allocation.options import layer_settings, stored_bits, units_of

    model = _model()
    names = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n)
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in names}
    options = {n: layer_settings(shapes[n], CFG, (), "gptq") for n in names}
    units = units_of(names)
    unit_options = {u[0]: options[u[0]] for u in units}
    rng = random.Random(0)
    errors = {n: {o: rng.uniform(0.5, 2.0) * 2.0 ** -(o[0] * 2) for o in options[n]} for n in names}
    energy = dict.fromkeys(names, 1.0)
    factors = {k: {n: rng.uniform(0.5, 4.0) for n in names} for k in allocate.WEIGHTINGS}
    sizes = {(n, o): stored_bits(shapes[n], o, CFG, "gptq") for n in names for o in options[n]}
    weights = sum(a * b for a, b in shapes.values())
    budget = 3.5 * weights
    found = allocate._candidates(names, units, unit_options, (errors, energy, factors), sizes, budget)
    fills = [k for k in found if k.endswith("+fill")]
    assert fills

    def cost(allocation):
        return sum(errors[n][o] * factors["geometric"][n] for n, o in allocation.items())  # energy 1: err / 1

    order = (32, 64, 128, -1)
    for key in fills:
        base = found[key.removesuffix("+fill")]
        fill = found[key]
        assert sum(sizes[(n, o)] for n, o in fill.items()) <= budget
        assert all(fill[n][0] >= base[n][0] and order.index(fill[n][1]) <= order.index(base[n][1]) for n in names)
        assert cost(fill) <= cost(base) + 1e-12
        assert fill != base  # the budget left bought something


def test_a_budget_below_every_allocation_says_what_is_achievable(one_thread):
    with pytest.raises(ValueError, match=r"achievable: \d\.\d+ to \d\.\d+") as err:
        _quantize(_model(), 2.05)
    assert "no weight was changed" in str(err.value)


def test_transformers_with_a_gptq_format_and_overrides_are_refused():
    with pytest.raises(ValueError, match="--serve vllm,optq"):
        RunSettings(target_bits=3.5, serve="all")
    RunSettings(target_bits=3.5, serve="all", format="compressed-tensors")
    RunSettings(target_bits=3.5, serve="vllm,optq")
    with pytest.raises(ValueError, match="without overrides"):
        RunSettings(target_bits=3.5, overrides={"*": {"bits": 8}})


def test_the_command_line_flag():
    from cli_args import quantize_args

    from optq.cli import CliError, build_parser
    from optq.cli.quantize import settings_from_args

    args = build_parser().parse_args(quantize_args(Path("r"), Path("o"), "--target-bits", "3.5"))
    assert settings_from_args(args).target_bits == 3.5
    args = build_parser().parse_args(quantize_args(Path("r"), Path("o"), "--target-bits", "3.5", "--serve", "all"))
    with pytest.raises(CliError, match="--format compressed-tensors"):
        settings_from_args(args)
    args = build_parser().parse_args(quantize_args(Path("r"), Path("o"), "--target-bits", "1"))
    with pytest.raises(CliError, match="--target-bits"):
        settings_from_args(args)
