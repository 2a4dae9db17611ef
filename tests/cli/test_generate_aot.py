"""The decoding step compiled ahead of time (optq.eval.aot, ``optq generate --aot``): the same
logits and text as the model's own decoding, only for the calls it was built for, never for a
model it was not built for."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from cli_args import quantize_args

from optq.cli import main
from optq.data.zoo import load_model
from optq.eval import aot
from optq.formats.qlinear import QuantLinear

pytestmark = pytest.mark.slow

PROMPT = "w1 w2 w3 w4"
LENGTH = 32  # the tests' static cache: the prompt and up to 28 new tokens


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "q"
    # 4-bit, group 32: every layer of the tiny Llama fits the fast CPU kernels
    assert main(quantize_args(model_dir, out, "--bits", "4", "--group-size", "32")) == 0
    return out


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    return tmp_path_factory.mktemp("packages")


def _load(checkpoint):
    return load_model(checkpoint, dtype=torch.float32)


def _greedy(model, ids: torch.Tensor, n: int, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens [n] and each step's logits [n, vocab]."""
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, **options,
        )  # fmt: skip
    return out.sequences[0, ids.shape[1] :], torch.cat(out.logits).float()


@pytest.mark.parametrize("exact", [True, False], ids=["float model", "quantized, fast path"])
def test_compiled_steps_give_the_models_own_logits(model_dir, checkpoint, packages, exact):
    """Greedy decoding through the package: every step after the prompt runs compiled, with the
    eager model's logits on the same static cache (a float32 model to float rounding; the fast
    path's bfloat16 kernels to a bound below) and so its tokens."""
    source = model_dir / "model" if exact else checkpoint
    model, tok = _load(source)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    n = 12
    want, want_logits = _greedy(model, ids, n, cache=aot._static_cache(model, LENGTH))
    decoder = aot.AotDecoder.for_model(model, source, LENGTH, load={"dtype": "float32"}, cache_dir=packages)
    got, logits = _greedy(model, ids, n, **decoder.options())
    assert decoder.steps == n - 1  # the first token comes from the prompt's eager forward
    assert torch.equal(got, want)
    scale = want_logits.abs().max()
    # float: float32 throughout, only the order of sums differs. fast: both sides run the same
    # bfloat16 kernels on activations rounded to bfloat16 (relative 2^-8) at places that differ
    # between the compiled and the eager graph, through two blocks.
    bound = 1e-4 * scale if exact else 4 * 2**-8 * scale
    assert (logits - want_logits).abs().max() <= bound
    # a second call starts from an emptied cache: the same tokens again
    again, _ = _greedy(model, ids, n, **decoder.options())
    assert torch.equal(again, want) and decoder.steps == 2 * (n - 1)
    decoder.close()
    assert "forward" not in model.__dict__


def test_other_calls_run_the_model_itself(checkpoint, packages):
    """A batch, a padded mask or another cache is not what the step was built for: those calls
    run eagerly (no compiled step) and give the eager model's tokens."""
    model, tok = _load(checkpoint)
    decoder = aot.AotDecoder.for_model(model, checkpoint, LENGTH, load={"dtype": "float32"}, cache_dir=packages)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    alone, _ = _greedy(model, ids, 5, **decoder.options())
    steps = decoder.steps
    assert steps == 4
    dynamic, _ = _greedy(model, ids, 5)  # transformers' own cache
    assert decoder.steps == steps and torch.equal(dynamic, alone)
    pad = torch.zeros(1, 2, dtype=ids.dtype)
    padded = torch.cat([pad, ids], dim=1)
    mask = torch.cat([torch.zeros_like(pad), torch.ones_like(ids)], dim=1)
    got, _ = _greedy(model, padded, 5, attention_mask=mask, **decoder.options())
    assert decoder.steps == steps  # the padded prompt's steps ran eagerly
    decoder.close()
    want, _ = _greedy(model, padded, 5, attention_mask=mask, cache=aot._static_cache(model, LENGTH))
    assert torch.equal(got, want)


def test_a_package_serves_only_the_model_it_was_built_for(checkpoint, packages):
    model, _ = _load(checkpoint)
    path = aot.AotDecoder.for_model(model, checkpoint, LENGTH, load={"dtype": "float32"}, cache_dir=packages)
    path.close()
    built = aot.package_path(model, LENGTH, packages)
    assert built.exists() and aot.manifest_path(built).exists()
    other, _ = load_model(checkpoint, dtype=torch.float32, embeddings="int8")  # another head and table
    assert aot.package_path(other, LENGTH, packages) != built
    with pytest.raises(ValueError, match="compiled for another model"):
        aot.AotDecoder(other, built)
    assert "forward" not in other.__dict__  # nothing installed
    # the model's tensors are not in the package (read from the model when served): what is
    # left of its weights are the compiler's own scalars (the kernels' group sizes)
    served = json.loads(aot.manifest_path(built).read_text())["tensors"]
    with zipfile.ZipFile(built) as archive:
        weight_files = aot._weight_files(archive)
        files = {i.filename: i.file_size for i in archive.infolist() if "/data/weights/" in i.filename}
    used = [n for n in served if n in weight_files]  # the package reads these (not every exported tensor)
    assert used and not any(weight_files[n] in files for n in used)
    assert files and max(files.values()) < 4096


def test_sliding_window_models_are_refused_before_compiling(tmp_path):
    from tiny import build

    model = build("gemma3")
    with pytest.raises(ValueError, match="full-attention layers only"):
        aot.AotDecoder.for_model(model, "unused", LENGTH, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_cache_lengths_are_powers_of_two_from_256():
    assert [aot.cache_length(n) for n in (1, 200, 256, 257, 600)] == [256, 256, 256, 512, 1024]


def test_generate_aot_on_the_command_line(checkpoint, capsys):
    capsys.readouterr()
    assert main(["generate", str(checkpoint), PROMPT, "-n", "6", "--aot"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT) and "ahead-of-time step ready in" in err
    assert "decoding steps run ahead-of-time compiled: 5" in err
    for other in ("--compile", "--reference"):
        assert main(["generate", str(checkpoint), PROMPT, "--aot", other]) == 2
        assert "choose one" in capsys.readouterr().err


def test_the_exact_path_is_refused(checkpoint, packages):
    model, _ = _load(checkpoint)
    next(q for q in model.modules() if isinstance(q, QuantLinear)).use_fast_path = False
    with pytest.raises(ValueError, match="fast path"):
        aot.AotDecoder.for_model(model, checkpoint, LENGTH, cache_dir=packages)


def test_a_failed_build_says_why_and_leaves_no_package(checkpoint, tmp_path):
    model, _ = _load(checkpoint)
    packages = tmp_path / "packages"
    with pytest.raises(RuntimeError, match="compiling the decoding step failed") as failed:
        aot.AotDecoder.for_model(model, tmp_path / "missing", LENGTH, cache_dir=packages)
    assert "missing" in str(failed.value)  # the child's own error, not only its status
    assert not packages.exists() or not list(packages.glob("*.json"))
    assert "forward" not in model.__dict__


def test_load_options_that_give_another_model_are_refused(checkpoint, tmp_path):
    """The child loads the checkpoint as told; told wrong (int8 tables where the model has
    bfloat16 ones), what it builds is not for this model: refused, and nothing left cached."""
    model, _ = _load(checkpoint)
    packages = tmp_path / "packages"
    with pytest.raises(ValueError, match="pass the options the model was loaded with"):
        aot.AotDecoder.for_model(model, checkpoint, LENGTH, load={"embeddings": "int8"}, cache_dir=packages)
    assert not list(packages.iterdir())
    assert "forward" not in model.__dict__
