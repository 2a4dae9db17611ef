"""A journal damaged between a kill and ``--resume`` (issue 21, items 2 and 3): every file the
state relies on is checked, by the sha256 written with it, when the resume starts and before any
work. A damaged block 0 is recomputed from the calibration (its inputs are always available);
any other damage is one line saying what to restore or to start again with --overwrite, and
leaves the journal as it was, so restoring the file resumes to the uninterrupted run's bytes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from pipeline.resume_helpers import (
    LAYERS,
    OUT_SHARD,
    SOLVES,
    Kill,
    after_commit,
    count_solves,
    journal_state,
    one_line,
    scribble,
    truncate,
)

from optq.pipeline.stream.journal import JournalError

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

DONE = 2  # the kill comes after 2 of the 3 blocks are committed


def _killed_after_two_blocks(kit, src, out: Path, monkeypatch) -> Path:
    with monkeypatch.context() as mp:
        after_commit(mp, DONE)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    partial = out.parent / f"{out.name}.partial"
    assert journal_state(out)["done"] == DONE
    assert (partial / "blocks" / "00001.safetensors").is_file()
    assert (partial / f"activations-{DONE:05d}.safetensors").is_file()
    return partial


def test_random_bytes_inside_block_0_are_found_and_block_0_recomputed(reference, kit, tmp_path, monkeypatch, caplog):
    """Today: exit 0 and a checkpoint with block 0's garbage (NaN scales). Block 0's inputs are
    the calibration's own, so the run recomputes every block and ends with the same bytes."""
    src, ref, _ = reference
    out = tmp_path / "out"
    partial = _killed_after_two_blocks(kit, src, out, monkeypatch)
    scribble(partial / "blocks" / "00000.safetensors")
    solves = count_solves(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="optq"):
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * LAYERS  # from block 0
    assert not partial.exists() and kit.folder_bytes(out) == ref
    assert any("blocks/00000.safetensors is damaged" in r.getMessage() for r in caplog.records)


def test_a_deleted_blocks_folder_is_recomputed_from_block_0(reference, kit, tmp_path, monkeypatch):
    """Today: a traceback. Every block is missing, block 0 first: recomputed from the calibration."""
    src, ref, _ = reference
    out = tmp_path / "out"
    partial = _killed_after_two_blocks(kit, src, out, monkeypatch)
    shutil.rmtree(partial / "blocks")
    solves = count_solves(monkeypatch)
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * LAYERS
    assert not partial.exists() and kit.folder_bytes(out) == ref


def _unlink(path: Path) -> None:
    path.unlink()


# Each damage (item of issue 21, what today does): the file, how it is damaged.
DAMAGES = [
    # 2: exit 0, a checkpoint whose block 1 holds the random bytes.
    pytest.param("blocks/00001.safetensors", scribble, id="random-bytes-in-block-1"),
    # 2: exit 0, blocks 2.. computed from garbage inputs.
    pytest.param(f"activations-{DONE:05d}.safetensors", scribble, id="random-bytes-in-activations"),
    # 3: a SafetensorError traceback.
    pytest.param(f"activations-{DONE:05d}.safetensors", truncate, id="truncated-activations"),
    # 3: found after the remaining block is solved, with advice ("--resume") that loops.
    pytest.param("blocks/00001.safetensors", _unlink, id="deleted-block-1"),
    # 3: found at assembly, after the remaining block is solved ("re-download it").
    pytest.param("blocks/00001.safetensors", truncate, id="truncated-block-1"),
]


@pytest.mark.parametrize("name, damage", DAMAGES)
def test_a_damaged_journal_file_is_refused_before_any_work_naming_it(
    name, damage, reference, kit, tmp_path, monkeypatch
):
    src, ref, _ = reference
    out = tmp_path / "out"
    partial = _killed_after_two_blocks(kit, src, out, monkeypatch)
    path = partial / name
    original, state = path.read_bytes(), (partial / "state.json").read_bytes()
    damage(path)
    solves = count_solves(monkeypatch)
    with pytest.raises(JournalError) as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    text = one_line(err, str(partial), name)
    assert "--resume" not in text and "re-download" not in text  # advice that cannot help
    assert solves[0] == 0 and (partial / "state.json").read_bytes() == state
    # The advice holds: with the file restored, the run resumes after its 2 blocks, to the same bytes.
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(original)
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * (LAYERS - DONE)
    assert not partial.exists() and kit.folder_bytes(out) == ref


def test_an_edited_state_json_is_refused(reference, kit, tmp_path, monkeypatch):
    """Today: the state's word is taken, and block 1 is recomputed from block 2's inputs (exit 0,
    wrong bytes). Its checksum shows that it was changed after it was written."""
    src, _, _ = reference
    out = tmp_path / "out"
    partial = _killed_after_two_blocks(kit, src, out, monkeypatch)
    text = (partial / "state.json").read_text()
    assert f'"done": {DONE},' in text
    (partial / "state.json").write_text(text.replace(f'"done": {DONE},', f'"done": {DONE - 1},'))
    solves = count_solves(monkeypatch)
    with pytest.raises(JournalError) as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    one_line(err, "state.json", "damaged")
    assert solves[0] == 0
