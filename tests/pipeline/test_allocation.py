"""``target_bits``: each linear's bits and group size under a stored-bits budget.

The knapsack against brute force; the budget kept, on the packed tensors a streamed run writes;
the KL that chose the allocation recomputed here on whole models and compared with the
heuristics'; determinism; resume; the flag and the refusals."""

from __future__ import annotations

import copy
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


def _kl_of(model, allocation, ids) -> float:
    """KL(float || RTN model) per token on ``ids``, by whole-model forwards (the library's
    block-wise KL recomputed independently)."""
    q = copy.deepcopy(model)
    for name, mod in q.named_modules():
        if name in allocation:
            b, g = allocation[name]
            cfg = optq.QuantConfig(bits=b, group_size=g, act_order=False)
            mod.weight.data = solver.rtn(mod.weight.data.float(), cfg).dequantize()
    with torch.no_grad():
        p = torch.log_softmax(model(ids).logits.float(), -1)
        r = torch.log_softmax(q(ids).logits.float(), -1)
    return float((p.exp() * (p - r)).sum(-1).mean())


def test_the_chosen_allocation_has_the_least_kl_recomputed_on_the_whole_model(one_thread):
    target = 4.3
    report = _quantize(_model(), target)
    a = report.allocation
    fp = _model()
    held = torch.cat([_calib()[2 * b : 2 * b + 2] for b in a["windows"]["kl_batches"]])
    assert a["windows"]["kl_batches"] == [3] and a["windows"]["sensitivity_batches"] == [0, 1, 2]  # held out
    found = {k: v for k, v in a["candidates"].items() if "kl" in v}
    assert {k.rsplit("-g", 1)[0] for k in found} >= set(HEURISTICS)  # every heuristic fits and was checked
    allocations = {}
    for key in found:
        if key == a["chosen"]:
            allocations[key] = {n: (r["bits"], r["group_size"]) for n, r in a["layers"].items()}
    chosen_kl = _kl_of(fp, allocations[a["chosen"]], held)
    assert chosen_kl == pytest.approx(found[a["chosen"]]["kl"], rel=1e-3)
    from optq.pipeline.allocation.options import heuristics

    names = sorted(a["layers"])
    for key, row in found.items():
        base = key.rsplit("-g", 1)
        if base[0] not in HEURISTICS:
            continue
        bits = heuristics(names)[base[0]]
        group = int(base[1])
        alloc = {n: (bits[n], group) for n in names}  # 32 and 64 divide every width here
        kl = _kl_of(fp, alloc, held)
        assert kl == pytest.approx(row["kl"], rel=1e-3)
        assert chosen_kl <= kl
    assert a["bits_per_weight"] <= target


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
