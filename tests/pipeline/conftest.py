"""Shared fixtures of the streaming tests (test_stream.py, test_resume.py, test_resume_guards.py):
tiny models saved as safetensors shards, a streaming run with small defaults, a folder's bytes,
and the resume tests' source with its uninterrupted output.

Nothing here is autouse: the other tests of this folder are unaffected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import optq

# Small enough that a 2-3 block tiny model is written as several shards (source and output).
SHARD = 20_000
CFG = optq.QuantConfig(bits=3, group_size=16)
REPORT = "quantization_report.json"


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny matmuls are ~30x faster than with 2 threads on a busy 2-core
    machine, and every run of a test uses the same thread count (byte-identity needs it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_tiny(
    folder: Path,
    arch: str = "llama",
    *,
    dtype: torch.dtype = torch.bfloat16,
    layers: int | None = None,
    shard: int = SHARD,
    seed: int = 0,
) -> Path:
    """A tiny random model of ``arch`` saved with ``save_pretrained`` (safetensors shards + index
    when ``shard`` is small). ``layers`` rebuilds it with that many blocks."""
    from tiny import build

    model = build(arch, seed=seed)
    if layers is not None:
        from transformers import AutoModelForCausalLM

        config = model.config
        config.num_hidden_layers = layers
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
    model.to(dtype).save_pretrained(folder, max_shard_size=shard)
    return Path(folder)


def tokens(*a, **kw) -> torch.Tensor:
    """``tiny.tokens`` (imported here so that this conftest needs no transformers)."""
    from tiny import tokens as tiny_tokens

    return tiny_tokens(*a, **kw)


def stream(src: Path, out: Path, **kw):
    """``quantize_pretrained`` on 6 x 16 random tokens, 3 bits, group 16, small output shards."""
    from optq.pipeline.stream.quantize import quantize_pretrained

    kw.setdefault("progress", False)
    kw.setdefault("max_shard_size", SHARD)
    return quantize_pretrained(src, out, kw.pop("calib", tokens(n=6, seqlen=16)), kw.pop("config", CFG), **kw)


def _untimed(obj):
    # totals are sums over the layer rows (compared exactly), in the rows' order: a resumed run
    # may add them in another order (last-bit differences); tests compare them separately.
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if k not in ("seconds", "block_seconds", "totals")}
    if isinstance(obj, list):
        return [_untimed(v) for v in obj]
    return obj


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes, hidden files included), with the
    report's timings and totals removed (see ``_untimed``)."""
    folder = Path(folder)
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            rel = str(path.relative_to(folder))
            data = path.read_bytes()
            if rel == REPORT:
                data = json.dumps(_untimed(json.loads(data)), sort_keys=True).encode()
            out[rel] = data
    return out


class Kit:
    """The helpers above, as a fixture (test modules do not import conftest)."""

    SHARD, CFG, REPORT = SHARD, CFG, REPORT
    save_tiny = staticmethod(save_tiny)
    stream = staticmethod(stream)
    folder_bytes = staticmethod(folder_bytes)
    tokens = staticmethod(tokens)


@pytest.fixture(scope="session")
def kit_any_threads():
    """The helpers, for fixtures broader than a test (which set the thread count themselves)."""
    return Kit


@pytest.fixture
def kit(one_thread):
    """The helpers, in a test run with one thread."""
    return Kit


@pytest.fixture(scope="module")
def reference(tmp_path_factory, kit_any_threads):
    """The resume tests' 3-block bf16 sharded llama and its uninterrupted streamed output (one
    thread): (source folder, the output's ``folder_bytes``, its report). Built once per module."""
    from pipeline.resume_helpers import LAYERS, OUT_SHARD

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
