"""Resuming a streaming run (``quantize_pretrained(..., resume=True)``) from ``OUT.partial/``:
after a crash injected at several points the output is byte-identical to an uninterrupted run's.
What resume and overwrite do with another run's journal or existing folders: test_resume_guards.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pipeline.resume_helpers import (
    LAYERS,
    LINEARS,
    OUT_SHARD,
    SOLVES,
    Kill,
    after_write_block_1,
    count_solves,
    journal_state,
    on_solve,
)

import optq.pipeline.stream.journal as journal_mod
from optq.formats import files
from optq.pipeline.stream import quantize as stream_mod
from optq.pipeline.stream.journal import Journal

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_totals(report, ref) -> None:
    got = {k: v for k, v in report.totals.items() if k != "seconds"}
    want = {k: v for k, v in ref.totals.items() if k != "seconds"}
    assert got == pytest.approx(want, rel=1e-12, abs=0)


# Each crash point: (install the crash with monkeypatch, check the partial folder it leaves) ->
# the number of blocks the journal says are done.
def _in_solve_of_block_1(mp, partial):
    def kill(n):
        if n == SOLVES + 2:  # the second solve of block 1
            raise Kill

    on_solve(mp, kill)
    return 1


# after_write_block_1 is in resume_helpers.py: test_resume_guards.py crashes there too.


def _in_commit_after_activations(mp, partial):
    orig = Journal._save

    def save(self, path, tensors):
        orig(self, path, tensors)
        if path.name == "activations-00002.safetensors":
            raise Kill  # written, but state.json still says 1 block done

    mp.setattr(Journal, "_save", save)
    return 1


def _before_assembly(mp, partial):
    def assemble(*a, **k):
        raise Kill

    mp.setattr(stream_mod, "assemble", assemble)
    return LAYERS


def _mid_assembly(mp, partial):
    orig_write = files.write_safetensors_file
    written = [0]

    def write(path, specs, fetch, *a, **k):
        if written[0] == 1:  # the first shard is on disk; the second dies half written
            half = len(specs) // 2
            fetched = [0]

            def dying(name):
                if fetched[0] == half:
                    raise Kill
                fetched[0] += 1
                return fetch(name)

            return orig_write(path, specs, dying, *a, **k)
        written[0] += 1
        return orig_write(path, specs, fetch, *a, **k)

    mp.setattr(files, "write_safetensors_file", write)
    return LAYERS


def _before_rename(mp, partial):
    def move(*a, **k):
        raise Kill  # the checkpoint assembled in OUT.partial/final, not yet renamed to OUT

    mp.setattr(journal_mod, "move_into_place", move)
    return LAYERS


def _left(partial: Path) -> dict:
    """What a crash left in OUT.partial/ besides final/: state.json's blocks done, activations
    file and report rows, and the files of the journal. No guard: a crash must leave a journal."""
    assert (partial / "state.json").is_file(), f"the crash left no journal state: {sorted(partial.rglob('*'))}"
    state = json.loads((partial / "state.json").read_text())
    names = sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file() and p.parts[-2] != "final")
    rows = len(state["report"]["layers"]) if state["report"] else 0
    return {"done": state["done"], "activations": state["activations"], "rows": rows, "files": names}


def _expected(done: int, blocks: int, activations: tuple[int, ...]) -> dict:
    """The journal after ``done`` committed blocks, ``blocks`` block files written and these
    activation files on disk (the state names the one entering block ``done``, none after the last)."""
    acts = [f"activations-{i:05d}.safetensors" for i in activations]
    files_ = ["manifest.json", "state.json", *acts, *(f"blocks/{i:05d}.safetensors" for i in range(blocks))]
    named = None if done == LAYERS else f"activations-{done:05d}.safetensors"
    return {"done": done, "activations": named, "rows": LINEARS * done, "files": sorted(files_)}


# Each crash point with the journal it must leave: blocks committed, block files written (one
# more than committed when the kill follows write_block), activation files on disk.
CRASHES = [
    pytest.param(_in_solve_of_block_1, _expected(1, 1, (1,)), id="in-solve-of-block-1"),
    pytest.param(after_write_block_1, _expected(1, 2, (1,)), id="after-write-block-1-before-commit"),
    pytest.param(_in_commit_after_activations, _expected(1, 2, (1, 2)), id="in-commit-after-activations-before-state"),
    pytest.param(_before_assembly, _expected(LAYERS, LAYERS, ()), id="after-last-commit-before-assembly"),
    pytest.param(_mid_assembly, _expected(LAYERS, LAYERS, ()), id="mid-assembly-after-first-shard"),
    pytest.param(_before_rename, _expected(LAYERS, LAYERS, ()), id="in-finish-before-rename"),
]


@pytest.mark.parametrize("crash, left", CRASHES)
def test_resume_after_a_crash_is_byte_identical(crash, left, reference, kit, tmp_path, monkeypatch):
    src, ref, ref_report = reference
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    with monkeypatch.context() as mp:
        done = crash(mp, partial)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    assert partial.is_dir() and not out.exists()
    assert done == left["done"] and _left(partial) == left  # the crash happened where intended
    shards = sorted(k for k in ref if k.endswith(".safetensors"))
    final = sorted(p.name for p in (partial / "final").glob("*")) if (partial / "final").exists() else None
    if crash is _mid_assembly:  # one shard whole, the second cut short, nothing after it
        assert final == shards[:2]
        assert (partial / "final" / shards[0]).read_bytes() == ref[shards[0]]
        assert (partial / "final" / shards[1]).read_bytes() != ref[shards[1]]
    elif crash is _before_rename:  # the checkpoint complete in final/, only the rename missing
        assert kit.folder_bytes(partial / "final") == ref
    else:
        assert final is None

    solves = count_solves(monkeypatch)
    report = kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert not partial.exists()
    assert kit.folder_bytes(out) == ref
    assert solves[0] == SOLVES * (LAYERS - done)  # resumed, not started again
    assert len(report.block_seconds) == LAYERS and len(report.layers) == LINEARS * LAYERS
    _same_totals(report, ref_report)


def test_a_resumed_report_keeps_the_rows_in_the_runs_order(reference, kit, tmp_path, monkeypatch):
    src, _, ref_report = reference
    with monkeypatch.context() as mp:
        _before_assembly(mp, None)
        with pytest.raises(Kill):
            kit.stream(src, tmp_path / "out", max_shard_size=OUT_SHARD)
    report = kit.stream(src, tmp_path / "out", max_shard_size=OUT_SHARD, resume=True)
    assert list(report.layers) == list(ref_report.layers)
    assert report.totals["mean_output_error_ratio"] == ref_report.totals["mean_output_error_ratio"]


def test_resume_ignores_temporary_files_a_kill_leaves(reference, kit, tmp_path, monkeypatch):
    """kill -9 inside atomic_write (mkstemp'd ``.state.json.XXXX.tmp``) or inside ``_save``
    leaves temporary files that no cleanup handler removed; they must not reach OUT."""
    src, ref, _ = reference
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with monkeypatch.context() as mp:
        after_write_block_1(mp, partial)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    (partial / ".state.json.k9x2mq.tmp").write_text('{"done": ')
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert not partial.exists()
    assert sorted(kit.folder_bytes(out)) == sorted(ref)


_KILLER = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r}); sys.path.insert(0, {here!r})
torch.set_num_threads(1)
from conftest import stream
from optq.pipeline.stream.journal import Journal
orig = Journal._save
def save(self, path, tensors):
    orig(self, path, tensors)
    if path.name == "activations-00002.safetensors":
        os.kill(os.getpid(), signal.SIGKILL)
Journal._save = save
stream({src!r}, {out!r}, max_shard_size={shard})
"""


def test_resume_after_a_real_sigkill(reference, kit, tmp_path):
    """A real kill -9 (no finally, no except BaseException runs) in the middle of a commit."""
    src, ref, _ = reference
    out = tmp_path / "out"
    here = Path(__file__).parent
    code = _KILLER.format(tests=str(here.parent), here=str(here), src=str(src), out=str(out), shard=OUT_SHARD)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert journal_state(out)["done"] == 1
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert not (tmp_path / "out.partial").exists()
    assert kit.folder_bytes(out) == ref


def test_resume_with_offloaded_activations_is_byte_identical(reference, kit, tmp_path, monkeypatch):
    """--offload-activations (memory-mapped activations in OUT.partial/): same bytes, crash or not."""
    src, ref, _ = reference
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with monkeypatch.context() as mp:
        after_write_block_1(mp, partial)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD, offload_activations=True)
    assert journal_state(out)["done"] == 1
    solves = count_solves(monkeypatch)
    kit.stream(src, out, max_shard_size=OUT_SHARD, offload_activations=True, resume=True)
    assert solves[0] == SOLVES * (LAYERS - 1)
    assert json.loads((out / "quantization_report.json").read_text())["options"]["offload_activations"] is True
    ref = {k: v for k, v in ref.items() if k != "quantization_report.json"}
    got = kit.folder_bytes(out)
    ref_report = json.loads(reference[1]["quantization_report.json"])
    ref_report["options"].pop("offload_activations")
    got_report = json.loads(got.pop("quantization_report.json"))
    got_report["options"].pop("offload_activations")
    assert not partial.exists() and got == ref and got_report == ref_report
