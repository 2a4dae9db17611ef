"""Behaviour the suite once let through (issue 32, item 5), each checked where a user meets it:

- ``target_bits`` on a whole number: the block gains' base setting is the widest bits *not
  above* the target, so a target of exactly 4 measures the gains at 4 bits, not 3;
- the resume journal records the method: a GPTAQ run killed after block 1 is not resumed as
  GPTQ, and resumed as GPTAQ it writes the uninterrupted run's bytes."""

from __future__ import annotations

import pytest
import torch
from pipeline.resume_helpers import Kill, after_write_block, journal_state
from tiny import llama

import optq
from optq.pipeline.stream.journal import JournalError

pytest.importorskip("transformers")


# --- target_bits on a whole number ----------------------------------------------------------


def _allocation(target: float) -> dict:
    model = llama(hidden=64, inter=128, layers=2, seed=0)
    calib = torch.randint(0, 96, (8, 24), generator=torch.Generator().manual_seed(3))
    cfg = optq.QuantConfig(bits=4, group_size=16)
    report = optq.quantize(model, calib, cfg, target_bits=target, batch_size=2, progress=False, target_check=0)
    return report.allocation


def test_a_whole_number_target_measures_the_block_gains_at_that_many_bits(one_thread):
    # The base is the widest bits b with b <= target (allocate.py's step 2): 4 itself for a
    # target of 4, at the finest group every layer takes (32 divides 64 and 128).
    gains = _allocation(4.0)["gains"]
    assert gains["skipped"] is None and all(k is not None and k > 0 for k in gains["block_kl"])
    assert {tuple(s) for s in gains["base"].values()} == {(4, 32)}


# --- the method in the resume journal -------------------------------------------------------


def test_a_killed_gptaq_run_resumes_only_as_gptaq_to_the_uninterrupted_bytes(kit, tmp_path, monkeypatch):
    src = kit.save_tiny(tmp_path / "src", "llama", dtype=torch.bfloat16, layers=3)
    kit.stream(src, tmp_path / "ref", method="gptaq")
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with monkeypatch.context() as m:
        after_write_block(m, 1)
        with pytest.raises(Kill):
            kit.stream(src, out, method="gptaq")
    state = journal_state(out)
    assert state["done"] == 1
    # GPTQ would write other weights for blocks 1 and 2 next to GPTAQ's block 0: refused, saying why.
    with pytest.raises(JournalError, match="method"):
        kit.stream(src, out, method="gptq", resume=True)
    assert journal_state(out) == state and not out.exists()  # nothing written, the journal as it was
    kit.stream(src, out, method="gptaq", resume=True)
    assert not partial.exists() and kit.folder_bytes(out) == kit.folder_bytes(tmp_path / "ref")
