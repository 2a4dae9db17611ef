"""The guards around resuming a streaming run: a journal of another run is refused naming what
differs, and left as it was; existing partial and final folders are not clobbered without
``overwrite``; and resume without a journal starts from the first block."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from pipeline.resume_helpers import LAYERS, OUT_SHARD, SOLVES, Kill, after_write_block_1, count_solves, journal_state
from safetensors.torch import load_file, save_file

from optq.pipeline.stream.journal import JournalError
from optq.pipeline.stream.records import sealed, unsealed
from optq.pipeline.stream.source import SafetensorsSource

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- another run's journal
def _crashed_run(kit, src, out, monkeypatch) -> bytes:
    with monkeypatch.context() as mp:
        after_write_block_1(mp, None)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    return (out.parent / f"{out.name}.partial" / "manifest.json").read_bytes()


def _retype_one_tensor(src: Path) -> None:
    """Store one (small) tensor of the source in float32 instead of bfloat16: same names."""
    shard = next(
        p for p in sorted(src.glob("model-*.safetensors")) if any(k.endswith("norm.weight") for k in load_file(str(p)))
    )
    tensors = load_file(str(shard))
    key = next(k for k in sorted(tensors) if k.endswith("norm.weight"))
    tensors[key] = tensors[key].float()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _change_config(src: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 2
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "change, differ",
    [
        ({"config": True}, {"config"}),
        ({"calib": True}, {"calibration"}),
        ({"source": _change_config}, {"source"}),
        ({"source": _retype_one_tensor}, {"source"}),
        ({"shard": True}, {"settings"}),
    ],
    ids=["bits", "calibration-tokens", "source-config.json", "source-tensor-dtype", "max-shard-size"],
)
def test_resuming_another_runs_journal_is_refused_naming_what_differs(
    change, differ, reference, kit, tmp_path, monkeypatch
):
    src, ref, _ = reference
    src = Path(shutil.copytree(src, tmp_path / "src"))
    out = tmp_path / "out"
    manifest = _crashed_run(kit, src, out, monkeypatch)
    state = journal_state(out)
    kw = {}
    if change.get("config"):
        kw["config"] = kit.CFG.__class__(bits=4, group_size=16)
    if change.get("calib"):
        kw["calib"] = kit.tokens(n=6, seqlen=16, seed=2)
    if change.get("source"):
        original = tmp_path / "original"
        shutil.copytree(src, original)
        change["source"](src)
    with pytest.raises(JournalError) as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD + 1 if change.get("shard") else OUT_SHARD, resume=True, **kw)
    assert isinstance(err.value, ValueError)
    found = re.search(r"the (.+?) differ from", str(err.value))
    assert found, str(err.value)
    parts = re.sub(r" \([^()]*\)", "", found.group(1))  # "options (max_shard_size 1 then, 2 now)"
    assert set(parts.split(", ")) == differ, str(err.value)
    assert "pass --overwrite" in str(err.value)
    detail = {"config": "bits 3 then, 4 now", "settings": "max_shard_size"}
    assert all(detail[p] in str(err.value) for p in differ if p in detail), str(err.value)
    # The refusal leaves the journal as it was: the original run still resumes, to the same bytes.
    partial = tmp_path / "out.partial"
    assert (partial / "manifest.json").read_bytes() == manifest and journal_state(out) == state
    if change.get("source"):
        shutil.rmtree(src)
        shutil.copytree(original, src)
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert kit.folder_bytes(out) == ref


# ------------------------------------------------------------------- existing partial / final output
def test_an_unfinished_run_is_an_error_without_resume_and_restarts_with_overwrite(
    reference, kit, tmp_path, monkeypatch
):
    src, ref, _ = reference
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    manifest = _crashed_run(kit, src, out, monkeypatch)
    state = journal_state(out)
    with pytest.raises(JournalError, match="--resume") as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD)
    assert "--overwrite" in str(err.value) and isinstance(err.value, ValueError)
    assert (partial / "manifest.json").read_bytes() == manifest and journal_state(out) == state  # untouched

    solves = count_solves(monkeypatch)
    kit.stream(src, out, max_shard_size=OUT_SHARD, overwrite=True)
    assert solves[0] == SOLVES * LAYERS  # started over
    assert not partial.exists() and kit.folder_bytes(out) == ref


def test_an_existing_output_is_refused_before_any_work_and_replaced_with_overwrite(
    reference, kit, tmp_path, monkeypatch
):
    src, ref, _ = reference
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier result")
    with monkeypatch.context() as mp:

        def read(self, name):
            raise AssertionError(f"read {name} before refusing")

        mp.setattr(SafetensorsSource, "read", read)
        with pytest.raises(JournalError, match="overwrite") as err:
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    assert "already exists" in str(err.value) and isinstance(err.value, ValueError)
    assert not partial.exists() and [p.name for p in out.iterdir()] == ["keep.txt"]

    kit.stream(src, out, max_shard_size=OUT_SHARD, overwrite=True)
    assert not partial.exists() and kit.folder_bytes(out) == ref


def test_resume_without_a_partial_folder_starts_from_the_first_block(reference, kit, tmp_path, monkeypatch):
    src, ref, _ = reference
    solves = count_solves(monkeypatch)
    kit.stream(src, tmp_path / "out", max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * LAYERS
    assert kit.folder_bytes(tmp_path / "out") == ref


def test_a_refused_resume_names_the_world_size_and_the_right_flag(reference, kit, tmp_path, monkeypatch):
    # A torchrun journal (2 ranks) resumed by one process, and --resume given with --overwrite.
    src, _, _ = reference
    out = tmp_path / "out"
    _crashed_run(kit, src, out, monkeypatch)
    path = tmp_path / "out.partial" / "manifest.json"
    manifest = unsealed(path.read_text())
    manifest["options"]["world_size"] = 2
    path.write_text(sealed(manifest))  # as such a run writes it
    with pytest.raises(JournalError, match=r"world_size 2 then, 1 now.*pass --overwrite to start again"):
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    with pytest.raises(JournalError, match=r"drop --resume to start again") as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True, overwrite=True)
    assert "pass --overwrite" not in str(err.value)  # it was passed
