"""Resuming a streaming run (``quantize_pretrained(..., resume=True)``) from ``OUT.partial/``:
after a crash injected at several points the output is byte-identical to an uninterrupted run's;
a journal of another run is refused naming what differs; existing partial and final folders
are not clobbered without ``overwrite``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import optq.pipeline.stream.journal as journal_mod
from optq.core import solver
from optq.formats import files
from optq.pipeline.stream import quantize as stream_mod
from optq.pipeline.stream.journal import Journal, JournalError
from optq.pipeline.stream.source import SafetensorsSource

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 3
OUT_SHARD = 8_000  # several output shards
LINEARS = 7  # per llama block
SOLVES = 4  # gptq calls per llama block: one per group of linears sharing an input (qkv, o, gate+up, down)


class Kill(BaseException):
    """Stands for a kill: not an Exception, so no `except Exception` in the library catches it."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory, kit_any_threads):
    """A 3-block bf16 sharded llama and its uninterrupted streamed output (one thread)."""
    kit = kit_any_threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("resume")
        src = kit.save_tiny(root / "src", "llama", dtype=torch.bfloat16, layers=LAYERS)
        report = kit.stream(src, root / "ref", max_shard_size=OUT_SHARD)
    finally:
        torch.set_num_threads(before)
    ref = kit.folder_bytes(root / "ref")
    assert len([k for k in ref if k.endswith(".safetensors")]) >= 3
    return src, ref, report


def _same_totals(report, ref) -> None:
    got = {k: v for k, v in report.totals.items() if k != "seconds"}
    want = {k: v for k, v in ref.totals.items() if k != "seconds"}
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def _state(out: Path) -> dict:
    return json.loads((out.parent / f"{out.name}.partial" / "state.json").read_text())


def _count_solves(monkeypatch) -> list[int]:
    calls = [0]
    orig = solver.gptq

    def gptq(*a, **k):
        calls[0] += 1
        return orig(*a, **k)

    monkeypatch.setattr(solver, "gptq", gptq)
    return calls


# Each crash point: (install the crash with monkeypatch, check the partial folder it leaves) ->
# the number of blocks the journal says are done.
def _in_solve_of_block_1(mp, partial):
    orig, calls = solver.gptq, [0]

    def gptq(*a, **k):
        calls[0] += 1
        if calls[0] == SOLVES + 2:  # the second solve of block 1
            raise Kill
        return orig(*a, **k)

    mp.setattr(solver, "gptq", gptq)
    return 1


def _after_write_block_1(mp, partial):
    orig = Journal.write_block

    def write_block(self, i, tensors):
        orig(self, i, tensors)
        if i == 1:
            raise Kill

    mp.setattr(Journal, "write_block", write_block)
    return 1


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
    pytest.param(_after_write_block_1, _expected(1, 2, (1,)), id="after-write-block-1-before-commit"),
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

    solves = _count_solves(monkeypatch)
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
        _after_write_block_1(mp, partial)
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
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert _state(out)["done"] == 1
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert not (tmp_path / "out.partial").exists()
    assert kit.folder_bytes(out) == ref


# ------------------------------------------------------------------- 5. another run's journal
def _crashed_run(kit, src, out, monkeypatch) -> bytes:
    with monkeypatch.context() as mp:
        _after_write_block_1(mp, None)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD)
    return (out.parent / f"{out.name}.partial" / "manifest.json").read_bytes()


def _retype_one_tensor(src: Path) -> None:
    """Store one (small) tensor of the source in float32 instead of bfloat16: same names."""
    shard = next(p for p in sorted(src.glob("model-*.safetensors")) if any(k.endswith("norm.weight") for k in load_file(str(p))))
    tensors = load_file(str(shard))
    key = next(k for k in sorted(tensors) if k.endswith("norm.weight"))
    tensors[key] = tensors[key].float()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _change_config(src: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 2
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, differ", [
    ({"config": True}, {"config"}),
    ({"calib": True}, {"calibration"}),
    ({"source": _change_config}, {"source"}),
    ({"source": _retype_one_tensor}, {"source"}),
    ({"shard": True}, {"options"}),
], ids=["bits", "calibration-tokens", "source-config.json", "source-tensor-dtype", "max-shard-size"])
def test_resuming_another_runs_journal_is_refused_naming_what_differs(change, differ, reference, kit, tmp_path,
                                                                      monkeypatch):
    src, ref, _ = reference
    src = Path(shutil.copytree(src, tmp_path / "src"))
    out = tmp_path / "out"
    manifest = _crashed_run(kit, src, out, monkeypatch)
    state = _state(out)
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
    found = re.search(r"the (.+?) differ", str(err.value))
    assert found, str(err.value)
    assert set(found.group(1).split(", ")) == differ, str(err.value)
    assert "--overwrite" in str(err.value)
    # The refusal leaves the journal as it was: the original run still resumes, to the same bytes.
    partial = tmp_path / "out.partial"
    assert (partial / "manifest.json").read_bytes() == manifest and _state(out) == state
    if change.get("source"):
        shutil.rmtree(src)
        shutil.copytree(original, src)
    kit.stream(src, out, max_shard_size=OUT_SHARD, resume=True)
    assert kit.folder_bytes(out) == ref


# ----------------------------------------------------------- 6. existing partial / final output
def test_an_unfinished_run_is_an_error_without_resume_and_restarts_with_overwrite(reference, kit, tmp_path,
                                                                                  monkeypatch):
    src, ref, _ = reference
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    manifest = _crashed_run(kit, src, out, monkeypatch)
    state = _state(out)
    with pytest.raises(JournalError, match="--resume") as err:
        kit.stream(src, out, max_shard_size=OUT_SHARD)
    assert "--overwrite" in str(err.value) and isinstance(err.value, ValueError)
    assert (partial / "manifest.json").read_bytes() == manifest and _state(out) == state  # untouched

    solves = _count_solves(monkeypatch)
    kit.stream(src, out, max_shard_size=OUT_SHARD, overwrite=True)
    assert solves[0] == SOLVES * LAYERS  # started over
    assert not partial.exists() and kit.folder_bytes(out) == ref


def test_an_existing_output_is_refused_before_any_work_and_replaced_with_overwrite(reference, kit, tmp_path,
                                                                                   monkeypatch):
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
    solves = _count_solves(monkeypatch)
    kit.stream(src, tmp_path / "out", max_shard_size=OUT_SHARD, resume=True)
    assert solves[0] == SOLVES * LAYERS
    assert kit.folder_bytes(tmp_path / "out") == ref


def test_resume_with_offloaded_activations_is_byte_identical(reference, kit, tmp_path, monkeypatch):
    """--offload-activations (memory-mapped activations in OUT.partial/): same bytes, crash or not."""
    src, ref, _ = reference
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with monkeypatch.context() as mp:
        _after_write_block_1(mp, partial)
        with pytest.raises(Kill):
            kit.stream(src, out, max_shard_size=OUT_SHARD, offload_activations=True)
    assert _state(out)["done"] == 1
    solves = _count_solves(monkeypatch)
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
