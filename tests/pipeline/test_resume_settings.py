"""What a resume compares, and when (issues 32 and 35).

A resume with other settings is refused before the model is loaded, the calibration prepared
or anything hashed (stand-ins for those fail the test if reached); the manifest is sealed by a
checksum, so one edited by hand is refused, never used; and what only schedules the work (the
Hessian memory budget, the RAM it defaults from) is not recorded, so a resume with another
budget, or on a machine with other RAM, continues to the bytes of an uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from pipeline.resume_helpers import OUT_SHARD, Kill, after_write_block_1, journal_state

from optq.pipeline.stream import quantize as stream_quantize
from optq.pipeline.stream import records
from optq.pipeline.stream.journal import JournalError

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def _crashed(kit, src, out, monkeypatch, **kw) -> bytes:
    """A run killed once block 1 is written; the manifest's bytes."""
    with monkeypatch.context() as mp:
        after_write_block_1(mp, None)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD, **kw)
    return (out.parent / f"{out.name}.partial" / "manifest.json").read_bytes()


def _nothing_loaded(mp) -> None:
    """Loading the source, preparing the run (tokenised windows, batches) or hashing the
    calibration fails the test: the refusal must come first."""

    def reached(what):
        def stand_in(*a, **k):
            raise AssertionError(f"{what} was reached before the settings were compared")

        return stand_in

    mp.setattr(stream_quantize, "SafetensorsSource", reached("loading the model"))
    mp.setattr(stream_quantize, "prepare", reached("preparing the calibration"))
    mp.setattr(stream_quantize, "_source_digest", reached("hashing the source"))
    mp.setattr(stream_quantize, "shard_prints", reached("fingerprinting the shards"))


CHANGES = [
    ("config", "bits", 4),
    ("config", "group_size", 32),
    ("config", "damp", 0.02),
    ("config", "sym", False),
    ("settings", "nsamples", 4),
    ("settings", "seqlen", 8),
    ("settings", "seed", 1),
    ("settings", "batch_size", 2),
    ("settings", "format", "compressed-tensors"),
    ("settings", "hessian_dtype", "float64"),
    ("settings", "method", "gptq"),
    ("settings", "max_shard_size", OUT_SHARD + 1),
]


@pytest.mark.parametrize("part, field, value", CHANGES, ids=[c[1] for c in CHANGES])
def test_other_settings_are_refused_before_anything_is_loaded(
    part, field, value, reference, kit, tmp_path, monkeypatch
):
    src, _, _ = reference
    out = tmp_path / "out"
    manifest = _crashed(kit, src, out, monkeypatch)
    state = journal_state(out)
    kw = {"max_shard_size": OUT_SHARD}
    if part == "config":
        kw["config"] = dataclasses.replace(kit.CFG, **{field: value})
    else:
        kw[field] = value
    with monkeypatch.context() as mp:
        _nothing_loaded(mp)
        with pytest.raises(JournalError) as err:
            kit.stream(src, out, resume=True, **kw)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"cannot resume {tmp_path / 'out.partial'}: the {part} (")
    assert f"{field} " in msg and f"{value!r}"[:20] in msg and "pass --overwrite" in msg, msg
    # Untouched: the interrupted run still resumes.
    assert (tmp_path / "out.partial" / "manifest.json").read_bytes() == manifest and journal_state(out) == state


def test_an_edited_manifest_is_refused_naming_it_never_used(reference, kit, tmp_path, monkeypatch):
    # Issue 35's case: killed after a block of a 4-bit run, config.bits edited 4 -> 3 in the
    # manifest, resumed with bits 3. Used, it would pack blocks 0-1 at 4 bits and the rest at 3.
    src, _, _ = reference
    out = tmp_path / "out"
    four = dataclasses.replace(kit.CFG, bits=4)
    _crashed(kit, src, out, monkeypatch, config=four)
    path = tmp_path / "out.partial" / "manifest.json"
    edited = json.loads(path.read_text())
    assert edited["config"]["bits"] == 4 and "checksum" in edited
    edited["config"]["bits"] = 3
    path.write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")
    with monkeypatch.context() as mp:
        _nothing_loaded(mp)
        with pytest.raises(JournalError) as err:
            kit.stream(src, out, resume=True, config=dataclasses.replace(kit.CFG, bits=3), max_shard_size=OUT_SHARD)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "checksum does not match" in msg and "--overwrite" in msg, msg
    assert not out.exists() and json.loads(path.read_text()) == edited  # nothing written


def _fake_ram(monkeypatch, total: int) -> None:
    """This machine as one with ``total`` bytes of RAM, for whatever reads it through sysconf."""
    real = os.sysconf

    def sysconf(name):
        if name == "SC_PHYS_PAGES":
            return total // real("SC_PAGE_SIZE")
        return real(name)

    monkeypatch.setattr(os, "sysconf", sysconf)


@pytest.mark.parametrize("ram", [False, True], ids=["another-max-hessian-memory", "another-machines-ram"])
def test_a_resume_with_another_memory_budget_writes_the_same_bytes(ram, reference, kit, tmp_path, monkeypatch):
    src, ref, _ = reference
    out = tmp_path / "out"
    if ram:
        with monkeypatch.context() as mp:
            _fake_ram(mp, 64 << 30)
            _crashed(kit, src, out, monkeypatch)
        _fake_ram(monkeypatch, 1 << 30)
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
        budget = 1 << 28  # a quarter of the resuming machine's RAM
    else:
        _crashed(kit, src, out, monkeypatch, max_hessian_memory="2GB")
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True, max_hessian_memory="64MB")
        budget = 64_000_000
    got = kit.folder_bytes(out)
    report = json.loads(got.pop(kit.REPORT))
    assert report["options"].pop("max_hessian_memory") == budget  # the resumed run's (its report only)
    want = dict(ref)
    want_report = json.loads(want.pop(kit.REPORT))
    assert want_report["options"].pop("max_hessian_memory") != budget
    assert got == want and report == want_report  # every weight, config and shard byte


def test_the_manifest_records_no_memory_budget(reference, kit, tmp_path, monkeypatch):
    src, _, _ = reference
    out = tmp_path / "out"
    _crashed(kit, src, out, monkeypatch, max_hessian_memory="2GB", offload_activations=True)
    manifest = records.unsealed((tmp_path / "out.partial" / "manifest.json").read_text())
    for part in ("options", "settings"):
        assert not set(records.SCHEDULING) & set(manifest[part]), part
    assert manifest["settings"]["method"] == "gptaq" and manifest["config"]["bits"] == 3


def test_the_journal_and_its_file_check_do_not_import_each_other_at_any_depth():
    # Issue 32: journal.py imported verify.py inside a function, verify.py imported journal.py.
    # Every import (top level, in functions, under TYPE_CHECKING) now goes down: journal ->
    # verify -> records.
    import ast
    from pathlib import Path

    folder = Path(records.__file__).parent

    def imported(name: str) -> set[str]:
        tree = ast.parse((folder / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        return {m.removeprefix("optq.pipeline.stream.") for m in found if m.startswith("optq.pipeline.stream")}

    assert imported("records") == set()
    assert imported("verify") <= {"records", *(f"records.{n}" for n in dir(records))}
    assert "verify" in imported("journal") and not {"journal", "quantize", "sink"} & imported("verify")
