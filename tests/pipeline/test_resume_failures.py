"""A streaming run that fails with an error before its first block is finished (issue 21, item
8): today it leaves an ``OUT.partial/`` holding nothing, so the next plain run is refused until
it is given --overwrite. The journal is now removed when it holds no finished block, and kept
whenever it holds one (an error later, or any interrupt)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pipeline.resume_helpers import LAYERS, OUT_SHARD, SOLVES, Kill, count_solves, journal_state, on_solve
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def _nan_in(block: int):
    def change(src: Path) -> None:
        key = f"model.layers.{block}.self_attn.q_proj.weight"
        shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]
        tensors = load_file(str(shard))
        tensors[key][0, 0] = float("nan")
        save_file(tensors, str(shard), metadata={"format": "pt"})

    return change


def _mismatched_config(src: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] *= 2  # the weights on disk keep the old shapes
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "break_source, match",
    [(_nan_in(0), "finite|NaN|nan"), (_mismatched_config, "shape")],
    ids=["nan-weight-in-block-0", "config-weights-mismatch"],
)
def test_an_error_before_the_first_block_leaves_no_journal(break_source, match, reference, kit, tmp_path):
    src, ref, _ = reference
    broken = Path(shutil.copytree(src, tmp_path / "broken"))
    break_source(broken)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        kit.stream(broken, out, max_shard_size=OUT_SHARD)
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    kit.stream(src, out, max_shard_size=OUT_SHARD)  # the fixed run needs no --overwrite
    assert kit.folder_bytes(out) == ref


def test_an_error_after_a_finished_block_keeps_the_journal_and_resumes(reference, kit, tmp_path, monkeypatch):
    """NaN in block 1: block 0 is finished and kept. The source fixed (its shard rewritten, a
    new modification time, block 0's tensors unchanged), the run resumes after block 0."""
    src, ref, _ = reference
    broken = Path(shutil.copytree(src, tmp_path / "src"))
    _nan_in(1)(broken)
    out = tmp_path / "out"
    # Found as block 1 is read from the shards, before any of its weights changes.
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight has NaN/Inf values"):
        kit.stream(broken, out, max_shard_size=OUT_SHARD)
    assert journal_state(out)["done"] == 1
    shutil.rmtree(broken)
    shutil.copytree(src, broken, copy_function=shutil.copyfile)
    solves = count_solves(monkeypatch)
    kit.stream(broken, out, max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * (LAYERS - 1) and kit.folder_bytes(out) == ref


def test_an_interrupt_in_block_0_keeps_the_journal(reference, kit, tmp_path, monkeypatch):
    """Ctrl-C or a kill is not an error: the user means to --resume, which the journal serves."""
    src, _, _ = reference

    def interrupted(n):
        raise Kill

    with monkeypatch.context() as mp:
        on_solve(mp, interrupted)
        with pytest.raises(Kill):
            kit.stream(src, tmp_path / "out", max_shard_size=OUT_SHARD)
    assert journal_state(tmp_path / "out")["done"] == 0
