"""Checkpoint files: atomic replacement, file modes, truncated or corrupt data, ``optq inspect``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from formats.test_checkpoint import _quantize, _tiny_llama
from safetensors.torch import load_file, save_file

import optq
from optq.formats import atomic, files
from optq.formats.atomic import atomic_folder
from optq.formats.checkpoint import CheckpointError
from optq.formats.files import read_index, read_tensors


def _write(folder: Path, text: str) -> None:
    (folder / "a.txt").write_text(text)
    (folder / "sub").mkdir()
    (folder / "sub" / "b.txt").write_text(text)


def _siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir())


@pytest.fixture(params=["exchange", "renames"])
def replace_mode(request, monkeypatch) -> str:
    """Run with renameat2 (where the system has it) and with the two-rename fallback."""
    if request.param == "renames":
        monkeypatch.setattr(atomic, "_renameat2", lambda src, dst, flags: False, raising=False)
    return request.param


def test_overwrite_replaces_contents_and_leaves_no_siblings(tmp_path: Path, replace_mode: str) -> None:
    target = tmp_path / "out"
    with atomic_folder(target, overwrite=False) as tmp:
        _write(tmp, "old")
        (tmp / "only-old.txt").write_text("x")
    with atomic_folder(target, overwrite=True) as tmp:
        _write(tmp, "new")
    assert sorted(p.name for p in target.iterdir()) == ["a.txt", "sub"]
    assert (target / "a.txt").read_text() == (target / "sub" / "b.txt").read_text() == "new"
    assert _siblings(target) == ["out"]
    with pytest.raises(FileExistsError, match="overwrite=True"), atomic_folder(target, overwrite=False):
        pass
    assert _siblings(target) == ["out"]


def test_error_during_write_keeps_old_folder(tmp_path: Path, replace_mode: str) -> None:
    target = tmp_path / "out"
    with atomic_folder(target, overwrite=False) as tmp:
        _write(tmp, "old")
    with pytest.raises(RuntimeError, match="boom"), atomic_folder(target, overwrite=True) as tmp:
        _write(tmp, "new")
        raise RuntimeError("boom")
    assert (target / "a.txt").read_text() == "old" and _siblings(target) == ["out"]


def test_failed_final_rename_puts_old_folder_back(tmp_path: Path, monkeypatch) -> None:
    """The fallback: if moving the new folder into place fails, the old one is restored."""
    target = tmp_path / "out"
    with atomic_folder(target, overwrite=False) as tmp:
        _write(tmp, "old")
    monkeypatch.setattr(atomic, "_renameat2", lambda src, dst, flags: False, raising=False)
    real_rename = Path.rename

    def rename(self: Path, dst):
        if ".optq-tmp-" in self.name and Path(dst) == target:
            raise OSError(28, "No space left on device", str(dst))
        return real_rename(self, dst)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space"), atomic_folder(target, overwrite=True) as tmp:
        _write(tmp, "new")
    assert (target / "a.txt").read_text() == "old" and _siblings(target) == ["out"]


def test_exchange_swaps_atomically(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not atomic._renameat2(a, b, atomic._RENAME_EXCHANGE):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this system or filesystem")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_stale_leftovers_of_dead_processes_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "out"
    dead = 2**22 + 12345  # above Linux's pid_max default: no such process
    for kind in ("tmp", "old"):
        (tmp_path / f".out.optq-{kind}-{dead}").mkdir()
    (tmp_path / ".other.optq-tmp-1").mkdir()  # another target's: not ours to touch
    with atomic_folder(target, overwrite=False) as tmp:
        _write(tmp, "new")
    assert _siblings(target) == [".other.optq-tmp-1", "out"]


@pytest.fixture(scope="module")
def model_and_solutions():
    model = _tiny_llama()
    return model, _quantize(model, optq.QuantConfig(bits=4, group_size=32))


@pytest.fixture()
def saved(tmp_path: Path, model_and_solutions) -> Path:
    model, sols = model_and_solutions
    optq.save(model, tmp_path / "q", solutions=sols, max_shard_size="40KB")
    return tmp_path / "q"


def test_saved_checkpoint_modes(tmp_path: Path, model_and_solutions) -> None:
    model, sols = model_and_solutions
    for folder, shard in ((tmp_path / "one", "2GB"), (tmp_path / "sharded", "40KB")):
        optq.save(model, folder, solutions=sols, max_shard_size=shard)
        optq.save(model, folder, solutions=sols, max_shard_size=shard, overwrite=True)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in folder.rglob("*")}
        assert any(n.endswith(".safetensors") for n in modes)
        assert set(modes.values()) == {oct(0o644)}, modes


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_file_is_named(tmp_path: Path, model_and_solutions) -> None:
    model, sols = model_and_solutions
    optq.save(model, tmp_path / "q", solutions=sols)
    path = tmp_path / "q" / "model.safetensors"
    _truncate(path)
    with pytest.raises(CheckpointError, match=rf"{path} is truncated or corrupt \(safetensors: .*re-save"):
        read_index(tmp_path / "q")
    with pytest.raises(CheckpointError, match=rf"{path} is truncated or corrupt"):
        optq.load(tmp_path / "q", embeddings="model")
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json header}")
    with pytest.raises(CheckpointError, match=rf"{path} is truncated or corrupt"):
        optq.load(tmp_path / "q", embeddings="model")


def test_truncated_shard_is_named_by_read_tensors(saved: Path) -> None:
    index = read_index(saved)
    shard = max(f for f, _, _ in index.values())
    _truncate(saved / shard)
    names = [k for k, v in index.items() if v[0] == shard]
    with pytest.raises(CheckpointError, match=rf"{saved / shard} is truncated or corrupt"):
        list(read_tensors(saved, index, names))
    (saved / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"names {shard}, which is missing"):
        read_index(saved)
    (saved / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a safetensors index"):
        optq.load(saved, embeddings="model")


def _poke(folder: Path, key: str, value: float) -> Path:
    """Overwrite the first element of tensor ``key`` in its file, in place (as corruption would)."""
    index = read_index(folder)
    fname, _, dtype = index[key]
    path = folder / fname
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    start = 8 + header + json.loads(data[8 : 8 + header])[key]["data_offsets"][0]
    raw = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    data[start : start + len(raw)] = raw
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    "key,value,what",
    [
        ("model.layers.1.mlp.up_proj.scales", float("nan"), "scales that are not finite and nonzero"),
        ("model.layers.0.self_attn.q_proj.scales", float("inf"), "scales that are not finite and nonzero"),
        ("model.layers.0.self_attn.q_proj.scales", 0.0, "scales that are not finite and nonzero"),
        ("model.embed_tokens.weight", float("nan"), "NaN or infinite values"),
        ("model.norm.weight", float("-inf"), "NaN or infinite values"),
        ("model.layers.0.mlp.down_proj.g_idx", 7, r"group indices outside \[0, 4\)"),
    ],
)
def test_corrupt_values_are_refused(saved: Path, key: str, value: float, what: str) -> None:
    assert torch.isfinite(optq.load(saved, embeddings="model").model.embed_tokens.weight).all()  # loads before the poke
    path = _poke(saved, key, value)
    with pytest.raises(CheckpointError, match=rf"{path}: tensor {key} has {what}; .*re-save"):
        optq.load(saved, embeddings="model")


def test_negative_scales_load_and_negate_the_layer(saved: Path) -> None:
    # auto-round's symmetric GPTQ checkpoints hold negative scales (about half of them): valid,
    # since W = scale * (q - z) holds for either sign. Negating every scale of a layer must load
    # and negate that layer's output, nothing else.
    key = "model.layers.0.self_attn.q_proj.scales"
    model = optq.load(saved, embeddings="model")
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = model.model.layers[0].self_attn.q_proj(x)
    fname, _, _ = read_index(saved)[key]
    tensors = load_file(saved / fname)
    tensors[key] = -tensors[key]
    save_file(tensors, saved / fname, metadata={"format": "pt"})
    after = optq.load(saved, embeddings="model").model.layers[0].self_attn.q_proj(x)
    torch.testing.assert_close(after, -before)
    assert before.abs().max() > 0


def test_inspect_summary_first_and_natural_order(tmp_path: Path, capsys) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from optq.cli import main

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=11,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(cfg).eval()
    sols = _quantize(model, optq.QuantConfig(bits=4, group_size=32))
    optq.save(model, tmp_path / "q", solutions=sols)
    assert main(["inspect", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{tmp_path / 'q'}: GPTQ (checkpoint_format gptq), 4-bit, group size 32, symmetric")
    assert out[0].endswith("act-order: yes, static groups (g_idx natural, no reordering)")  # QuantConfig's default
    quantized = sum(s.weight.numel() for s in sols.values())
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    floats = sum(t.numel() for k, t in tensors.items() if t.is_floating_point() and not k.endswith(".scales"))
    assert out[1] == (
        f"quantized layers: {len(sols)}; parameters: {quantized / 1e6:.2f} M quantized, {floats / 1e6:.2f} M float"
    )
    disk = (tmp_path / "q" / "model.safetensors").stat().st_size
    assert out[2].startswith(f"size on disk: {disk / 1e6:.1f} MB")
    assert (
        out[3].startswith("engines (")
        and out[4] == "  vllm          77 layers, all on Marlin  (CUDA, tensor parallel 1)"
    )
    # GPTQModel's AVX512 kernel, when present, takes no 16-wide output (k_proj, v_proj)
    assert out[5].startswith("  transformers  55 of 77 layers run") and "refused 22" in out[5]
    layers = [line.split()[0] for line in out if line.startswith("  model.")]
    blocks = [int(n.split(".")[2]) for n in layers]
    assert blocks == sorted(blocks) and blocks[-1] == 10 and len(layers) == len(sols)
    assert set(layers) == set(sols)


def test_inspect_truncated_file_is_one_line(tmp_path: Path, model_and_solutions, capsys) -> None:
    from optq.cli import main

    model, sols = model_and_solutions
    optq.save(model, tmp_path / "q", solutions=sols)
    _truncate(tmp_path / "q" / "model.safetensors")
    assert main(["inspect", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "model.safetensors is truncated or corrupt" in err


def test_atomic_folder_leaves_links_alone(tmp_path: Path) -> None:
    # A Debian package unpacked into the cache holds links into packages it depends on, which
    # dangle here; setting modes must neither follow them nor fail on them.
    from optq.formats.atomic import atomic_folder

    outside = tmp_path / "outside.txt"
    outside.write_text("not ours")
    os.chmod(outside, 0o600)
    with atomic_folder(tmp_path / "pkg", overwrite=False) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "data.txt").write_text("ours")
        os.chmod(tmp / "sub" / "data.txt", 0o600)
        os.symlink("../missing/README.md.gz", tmp / "sub" / "README.md.gz")
        os.symlink(outside, tmp / "link.txt")
    folder = tmp_path / "pkg"
    assert stat.S_IMODE((folder / "sub" / "data.txt").stat().st_mode) == 0o644
    assert (folder / "sub" / "README.md.gz").is_symlink()
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600


def _mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "z.qweight": torch.randint(-(2**31), 2**31 - 1, (6, 4), dtype=torch.int32, generator=g),
        "a.scales": torch.randn(3, 5, generator=g).half(),
        "m.weight": torch.randn(4, 7, generator=g).t(),  # not contiguous
        "b.bf": torch.randn(9, generator=g).bfloat16(),
        "c.ids": torch.arange(5, dtype=torch.int64),
        "d.flag": torch.tensor([True, False, True]),
        "e.bytes": torch.arange(7, dtype=torch.uint8),
        "f.i8": torch.arange(-3, 3, dtype=torch.int8),
        "g.scalar": torch.tensor(2.5),
        "h.empty": torch.zeros(0, 3),
        "i.f64": torch.randn(2, dtype=torch.float64, generator=g),
        "j.i16": torch.arange(4, dtype=torch.int16),
    }


def test_streamed_file_has_save_files_bytes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = _mixed_tensors()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"}
    )
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    files.write_safetensors_file(tmp_path / "ours.safetensors", specs, tensors.__getitem__, {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    back = load_file(str(tmp_path / "ours.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_streamed_file_holds_one_tensor_at_a_time(tmp_path: Path) -> None:
    import weakref

    specs = {f"t{i}": ((64, 64), torch.float32) for i in range(5)}
    alive: list[weakref.ref] = []

    def fetch(name: str) -> torch.Tensor:
        assert all(r() is None for r in alive), "the previous tensor is still held"
        t = torch.full((64, 64), float(name[1:]))
        alive.append(weakref.ref(t))
        return t

    files.write_safetensors_file(tmp_path / "x.safetensors", specs, fetch)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert [float(back[f"t{i}"][0, 0]) for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_streamed_file_refuses_a_tensor_unlike_its_spec(tmp_path: Path) -> None:
    specs = {"a": ((2, 3), torch.float32)}
    with pytest.raises(CheckpointError, match=r"tensor a: expected \(2, 3\) torch.float32, got \(3, 2\)"):
        files.write_safetensors_file(tmp_path / "x.safetensors", specs, lambda n: torch.zeros(3, 2))
    with pytest.raises(CheckpointError, match="complex64 cannot be written"):
        files.write_safetensors_file(tmp_path / "y.safetensors", {"c": ((1,), torch.complex64)}, lambda n: None)


def test_output_into_a_closed_pipe_is_quiet(saved: Path) -> None:
    # `optq inspect out | head -1`: the reader leaves early. The command's output is made far
    # larger than a pipe's buffer, so the writes after the reader left do fail.
    import subprocess
    import sys

    script = (
        "import optq.cli.inspect as m, sys\n"
        "real = m.run\n"
        "def run(args):\n"
        "    real(args)\n"
        "    for i in range(200_000):\n"
        "        print('more output', i)\n"
        "m.run = run\n"
        "from optq.cli import main\n"
        f"sys.exit(main(['inspect', {str(saved)!r}]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert first.startswith(str(saved).encode()) and err == "", err


def test_a_failed_atomic_write_names_the_file_asked_for_not_its_temporary(tmp_path, monkeypatch):
    # A read-only folder (root ignores modes, so the refusal is planted where mkstemp asks): the
    # error must name report.html, which the user gave, not ".report.html.x1y2.tmp".
    def refuse(dir, prefix, suffix):
        raise PermissionError(13, "Permission denied", f"{dir}/{prefix}x1y2{suffix}")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    target = tmp_path / "report.html"
    with pytest.raises(PermissionError) as info:
        atomic.atomic_write(target, "<html>")
    assert info.value.filename == str(target) and info.value.strerror == "Permission denied"
    assert not list(tmp_path.iterdir())
