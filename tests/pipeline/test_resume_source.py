"""The source model changed under a resume (issue 21, item 1): a streamed 4-block model killed
after 2 blocks, its safetensors rewritten, then ``--resume``. Today the run ends with exit 0 and
a checkpoint that mixes the old blocks 0-1 with the new blocks 2-3 and the new embeddings.

Now the manifest holds each shard's size, modification time and header hash and the state the
sha256 of every tensor read; a resume whose source differs in what the finished blocks were
computed from is refused in one line naming the file, before any work; a touched but unchanged
source resumes; and the assembly refuses embeddings that differ from those calibrated with."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from pipeline.resume_helpers import OUT_SHARD, SOLVES, Kill, after_commit, count_solves, journal_state, one_line
from safetensors.torch import load_file, save_file

from optq.pipeline.stream.journal import JournalError

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCKS, DONE = 4, 2
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def four(tmp_path_factory, kit_any_threads):
    """A 4-block bf16 sharded llama and its uninterrupted output's bytes (one thread)."""
    kit = kit_any_threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("four")
        src = kit.save_tiny(root / "src", "llama", dtype=torch.bfloat16, layers=BLOCKS)
        kit.stream(src, root / "ref", max_shard_size=OUT_SHARD)
    finally:
        torch.set_num_threads(before)
    return src, kit.folder_bytes(root / "ref")


def _killed_after_two_blocks(kit, four, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A copy of the source (its own times), and the output of a run killed after 2 of 4 blocks."""
    src = Path(shutil.copytree(four[0], tmp_path / "src", copy_function=shutil.copyfile))
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        after_commit(mp, DONE)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    assert journal_state(out)["done"] == DONE
    return src, out


def _shard_of(src: Path, key: str) -> Path:
    return src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]


def _rewrite(shard: Path, change) -> None:
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _refused(kit, src, out, monkeypatch, *names: str) -> str:
    """Resume, expecting a refusal before any solve that names ``names``; the journal is kept."""
    state = journal_state(out)
    solves = count_solves(monkeypatch)
    with pytest.raises(JournalError) as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == 0 and journal_state(out) == state
    return one_line(err, *names, "restore the source")


def test_a_source_rewritten_with_other_values_of_the_same_shapes_is_refused(four, kit, tmp_path, monkeypatch):
    src, out = _killed_after_two_blocks(kit, four, tmp_path, monkeypatch)
    shards = {p.name: p.stat().st_size for p in src.glob("model-*.safetensors")}
    kit.save_tiny(src, "llama", dtype=torch.bfloat16, layers=BLOCKS, seed=1)  # the repro: new values
    assert {p.name: p.stat().st_size for p in src.glob("model-*.safetensors")} == shards  # same names, sizes
    text = _refused(kit, src, out, monkeypatch, str(src))
    assert any(name in text for name in shards), text
    # Restored, the source resumes after its 2 blocks to the uninterrupted run's bytes.
    shutil.rmtree(src)
    shutil.copytree(four[0], src)
    solves = count_solves(monkeypatch)
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * (BLOCKS - DONE) and kit.folder_bytes(out) == four[1]


@pytest.mark.parametrize("keep_time", [False, True], ids=["new-time", "time-kept"])
def test_a_change_of_only_the_embeddings_is_refused(keep_time, four, kit, tmp_path, monkeypatch):
    """With a new modification time the shard's tensors are hashed again on resume; with the old
    one kept (``touch -r``) the capture, which reads the embeddings again, compares them."""
    src, out = _killed_after_two_blocks(kit, four, tmp_path, monkeypatch)
    shard = _shard_of(src, EMBED)
    st = shard.stat()
    _rewrite(shard, lambda t: t.__setitem__(EMBED, t[EMBED] * 2))
    if keep_time:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    _refused(kit, src, out, monkeypatch, EMBED, str(shard))


def test_a_touched_source_resumes_to_the_same_bytes(four, kit, tmp_path, monkeypatch):
    """Newer modification times but the same bytes (``touch``, a copy): the tensors the journal
    depends on are hashed again and match, so the resume goes on."""
    src, out = _killed_after_two_blocks(kit, four, tmp_path, monkeypatch)
    for shard in src.glob("model-*.safetensors"):
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    solves = count_solves(monkeypatch)
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * (BLOCKS - DONE) and kit.folder_bytes(out) == four[1]


def test_the_assembly_refuses_embeddings_other_than_those_calibrated_with(four, kit, tmp_path, monkeypatch):
    """Killed after the last block, the embeddings rewritten with their modification time kept
    (``touch -r``): no block is left to run, and the shard's size, time and header are the
    same; the assembly, which copies them, compares them with the capture's hash."""
    src = Path(shutil.copytree(four[0], tmp_path / "src", copy_function=shutil.copyfile))
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        after_commit(mp, BLOCKS)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    shard = _shard_of(src, EMBED)
    st = shard.stat()
    _rewrite(shard, lambda t: t.__setitem__(EMBED, -t[EMBED]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(JournalError) as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    one_line(err, EMBED, str(shard), "restore the source")
    assert not out.exists()
