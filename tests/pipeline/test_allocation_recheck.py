"""``target_check``: the best allocations by the proxy, quantized as the run does and compared again.

Each rechecked candidate's KL is recomputed here by quantizing a copy of the float model with the
whole library run (``optq.quantize`` with that candidate's per-layer overrides) on the sensitivity
windows and scoring the held-out windows by whole-model forwards; the final model is the one a
plain run with the chosen allocation makes (the recheck leaves no weight or scheme changed)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tiny import llama

import optq
from optq.pipeline.settings import RunSettings

pytest.importorskip("transformers")

CFG = optq.QuantConfig(bits=4, group_size=16)


def _model():
    return llama(hidden=64, inter=128, layers=4, seed=0)


def _calib() -> torch.Tensor:
    return torch.randint(0, 96, (8, 24), generator=torch.Generator().manual_seed(3))


def _windows(batches) -> torch.Tensor:
    return torch.cat([_calib()[2 * b : 2 * b + 2] for b in batches])


def _run(model, calib, **kw):
    return optq.quantize(model, calib, CFG, batch_size=2, progress=False, **kw)


def _overrides(allocation):
    return [(n, {"bits": b, "group_size": g}) for n, (b, g) in sorted(allocation.items())]


def _kl(fp, q, ids) -> float:
    with torch.no_grad():
        p = torch.log_softmax(fp(ids).logits.float(), -1)
        r = torch.log_softmax(q(ids).logits.float(), -1)
    return float((p.exp() * (p - r)).sum(-1).mean())


@pytest.mark.parametrize("method", ["gptaq", "gptq"])
def test_each_rechecked_kl_is_the_run_quantizing_that_candidate(one_thread, method):
    allocations = {}
    from optq.pipeline.allocation import allocate

    real = allocate.divergence

    def keep(run, source, streams, candidates, logits, **kw):
        allocations.update(copy.deepcopy(dict(candidates)))
        return real(run, source, streams, candidates, logits, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(allocate, "divergence", keep)
        report = _run(_model(), _calib(), target_bits=4.3, method=method, target_check=2)
    a = report.allocation
    checked = {k: r for k, r in a["candidates"].items() if "kl" in r}
    again = {k: r["run_kl"] for k, r in checked.items() if "run_kl" in r}
    by_proxy = sorted(checked, key=lambda k: checked[k]["kl"])
    assert set(again) == set(by_proxy[:2]) and a["check"]["candidates"] == 2 and a["check"]["skipped"] is None
    assert a["chosen"] == min(again, key=again.get)
    assert f"quantized as the run does ({method})" in next(iter(a["layers"].values()))["why"]
    fit, held = _windows(a["windows"]["sensitivity_batches"]), _windows(a["windows"]["kl_batches"])
    fp = _model()
    for key, kl in again.items():
        q = _model()
        _run(q, fit, overrides=_overrides(allocations[key]), method=method)
        assert _kl(fp, q, held) == pytest.approx(kl, rel=2e-3), key
    assert len({round(v, 6) for v in again.values()}) == 2  # two different models, told apart


def test_the_model_is_what_a_plain_run_with_the_chosen_allocation_makes(one_thread):
    # The recheck quantizes every block once per candidate: each must leave the weights and the
    # run's schemes as they were, or the run that follows quantizes something else.
    model = _model()
    report = _run(model, _calib(), target_bits=4.3, target_check=3)
    assert report.allocation["check"]["candidates"] == 3
    chosen = {n: (r["bits"], r["group_size"]) for n, r in report.allocation["layers"].items()}
    plain = _model()
    _run(plain, _calib(), overrides=_overrides(chosen))
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kw", [{"method": "rtn"}, {"method": "gptq", "propagate": "original"}])
def test_no_recheck_where_the_proxy_quantizes_as_the_run_does(one_thread, kw):
    a = _run(_model(), _calib(), target_bits=4.3, **kw).allocation
    assert a["check"]["candidates"] == 0 and "not needed" in a["check"]["skipped"]
    assert not [k for k, r in a["candidates"].items() if "run_kl" in r]
    checked = {k: r["kl"] for k, r in a["candidates"].items() if "kl" in r}
    assert a["chosen"] == min(checked, key=checked.get)


def test_off_the_proxy_decides(one_thread):
    # (Past the memory budget the same candidates are rechecked, in more passes:
    # test_allocation_budget.py.)
    off = _run(_model(), _calib(), target_bits=4.3, target_check=0).allocation
    assert off["check"] == {"wanted": 0, "candidates": 0, "skipped": None, "seconds": 0.0}
    assert not [k for k, r in off["candidates"].items() if "run_kl" in r]
    checked = {k: r["kl"] for k, r in off["candidates"].items() if "kl" in r}
    assert off["chosen"] == min(checked, key=checked.get)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="target_check"):
        RunSettings(target_check=bad)


def test_the_command_line_flag():
    from cli_args import quantize_args

    from optq.cli import build_parser
    from optq.cli.quantize import settings_from_args

    flags = ("--target-bits", "3.5", "--serve", "vllm,optq")
    args = build_parser().parse_args(quantize_args(Path("r"), Path("o"), *flags, "--target-check", "0"))
    assert settings_from_args(args).target_check == 0
    args = build_parser().parse_args(quantize_args(Path("r"), Path("o"), *flags))
    assert settings_from_args(args).target_check == RunSettings().target_check == 3
