"""``--target-bits`` chooses the same allocation under any memory budget (issue 32, item 3).

``max_hessian_memory`` (by default a quarter of the RAM) decides how many block-gain streams and
rechecked candidates are held at once, so how many passes over the model the allocation makes;
never what it measures or chooses. The machine's RAM is faked through ``os.sysconf`` (what the
default reads), so a quarter of it holds every stream and candidate and a sixteenth does not."""

from __future__ import annotations

import os

import pytest
import torch
from tiny import llama

import optq
from optq.pipeline.allocation import passes, recheck

pytest.importorskip("transformers")

CFG = optq.QuantConfig(bits=4, group_size=16)
HIDDEN, LAYERS, WINDOWS, SEQLEN, BATCH = 64, 4, 8, 24, 2


def _calib() -> torch.Tensor:
    return torch.randint(0, 96, (WINDOWS, SEQLEN), generator=torch.Generator().manual_seed(3))


def _fake_ram(monkeypatch, total: int) -> None:
    real = os.sysconf
    monkeypatch.setattr(
        os, "sysconf", lambda name: total // real("SC_PAGE_SIZE") if name == "SC_PHYS_PAGES" else real(name)
    )


def _counted(monkeypatch) -> dict[str, list]:
    """The passes the allocation makes: measure's over the model (block streams started in each)
    and the recheck's (candidates in each)."""
    seen = {"gains": [], "recheck": []}
    real_pass, real_recheck = passes._pass, recheck.recheck

    def one_pass(run, source, streams, options, how):
        seen["gains"].append(list(how[2]))
        return real_pass(run, source, streams, options, how)

    def one_recheck(run, source, streams, schemes, logits):
        seen["recheck"].append(len(schemes))
        return real_recheck(run, source, streams, schemes, logits)

    monkeypatch.setattr(passes, "_pass", one_pass)
    monkeypatch.setattr(recheck, "recheck", one_recheck)
    return seen


def _untimed(obj):
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if k != "seconds"}
    return obj


def _run(monkeypatch, **kw):
    seen = _counted(monkeypatch)
    model = llama(hidden=HIDDEN, inter=128, layers=LAYERS, seed=0)
    report = optq.quantize(model, _calib(), CFG, target_bits=4.3, batch_size=BATCH, progress=False, **kw)
    weights = {n: s.weight.clone() for n, s in sorted(report.solutions.items())}
    monkeypatch.undo()
    return _untimed(report.allocation), weights, seen


def test_the_same_allocation_and_weights_at_a_quarter_and_a_sixteenth_of_the_ram(one_thread, monkeypatch):
    # One gains stream: a batch of windows entering a block; one candidate's chains: the three
    # sensitivity batches and the held-out one. Fake RAM: a quarter holds all 4 streams and all
    # 3 candidates (one pass each), a sixteenth 3 streams and no whole candidate.
    stream = BATCH * SEQLEN * HIDDEN * 4
    ram = 48 * stream + 64
    _fake_ram(monkeypatch, ram)
    quarter, q_weights, q_seen = _run(monkeypatch)  # the default: a quarter of the RAM
    _fake_ram(monkeypatch, ram)
    sixteenth, s_weights, s_seen = _run(monkeypatch, max_hessian_memory=ram // 16)
    tiny, t_weights, t_seen = _run(monkeypatch, max_hessian_memory=1)  # below one stream: one at a time
    # The schedules differ ...
    assert q_seen == {"gains": [[0, 1, 2, 3]], "recheck": [3]}
    assert s_seen == {"gains": [[0, 1, 2], [3]], "recheck": [1, 1, 1]}
    assert t_seen == {"gains": [[0], [1], [2], [3]], "recheck": [1, 1, 1]}
    # ... and nothing that comes out does: every gain, KL, rechecked KL, the choice and the weights.
    assert quarter["gains"]["skipped"] is None and None not in quarter["gains"]["block_kl"]
    assert [k for k in quarter["candidates"] if k.endswith("+blocks")]
    assert quarter["check"]["candidates"] == 3 and quarter["check"]["skipped"] is None
    assert len([r for r in quarter["candidates"].values() if "run_kl" in r]) == 3
    assert sixteenth == quarter and tiny == quarter
    for other in (s_weights, t_weights):
        assert other.keys() == q_weights.keys()
        assert all(torch.equal(other[n], q_weights[n]) for n in q_weights)
