"""--offload-activations: the calibration activations live in a memory-mapped file, same bytes."""

from __future__ import annotations

import pytest

import optq
from optq.pipeline.blocks import loop
from optq.pipeline.stream import quantize as stream

transformers = pytest.importorskip("transformers")
from tiny import build, tokens  # noqa: E402

CFG = optq.QuantConfig(bits=4, group_size=16)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload") / "src"
    build("llama").save_pretrained(folder)
    return folder


def test_offloaded_activations_are_file_backed_and_give_the_same_bytes(source, tmp_path, monkeypatch):
    calib = tokens(n=6, seqlen=16)
    stream.quantize_pretrained(source, tmp_path / "ram", calib, CFG, progress=False)
    seen = []
    real = loop.quantize_block

    def spy(run, prefix, block, inputs, *args, **kwargs):
        seen.append({h.untyped_storage().filename for h in inputs[0]})
        return real(run, prefix, block, inputs, *args, **kwargs)

    monkeypatch.setattr(loop, "quantize_block", spy)
    stream.quantize_pretrained(source, tmp_path / "disk", calib, CFG, progress=False, offload_activations=True)
    mapped = str(tmp_path / "disk.partial" / "activations.mmap")
    assert seen and all(files == {mapped} for files in seen)  # every block's inputs, one file
    assert not (tmp_path / "disk.partial").exists()
    ram = sorted(p.name for p in (tmp_path / "ram").iterdir())
    assert ram == sorted(p.name for p in (tmp_path / "disk").iterdir())
    for name in ram:
        if name.endswith(".safetensors"):
            assert (tmp_path / "ram" / name).read_bytes() == (tmp_path / "disk" / name).read_bytes(), name


def test_offload_is_refused_off_the_cpu(source, tmp_path):
    with pytest.raises(ValueError, match="CPU only"):
        stream.quantize_pretrained(
            source, tmp_path / "q", tokens(n=2, seqlen=16), CFG, progress=False, offload_activations=True, device="cuda"
        )
