"""``optq generate``: text, speed and memory from a checkpoint, an fp folder, or errors."""

from __future__ import annotations

import pytest
from cli_args import quantize_args

from optq.cli import main

PROMPT = "w1 w2 w3 w4"


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "q"
    # 4-bit, group 32: every layer of the tiny Llama fits the fast CPU kernels
    args = quantize_args(model_dir, out, "--bits", "4", "--group-size", "32")
    assert main(args) == 0
    return out


def _generate(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_generates_text_and_prints_speed_and_memory(checkpoint, capsys):
    code, out, err = _generate(capsys, str(checkpoint), PROMPT, "-n", "6")
    assert code == 0
    assert out.startswith(PROMPT) and len(out.strip()) > len(PROMPT)  # the prompt, then new words
    assert "14 quantized layers: 14 on the fast CPU kernels, 0 exact" in err
    assert "prefill: 4 tokens in " in err and "decode: 5 tokens in " in err
    assert "MB resident for the model and its run, peak RSS" in err
    # the exact path: same command, every layer off the kernels
    code, _, err = _generate(capsys, str(checkpoint), PROMPT, "-n", "3", "--reference", "--embeddings", "int8")
    assert code == 0 and "14 on the fast CPU kernels" not in err and "0 on the fast CPU kernels, 14 exact" in err
    assert "embeddings: int8" in err


def test_sampling_is_seeded_and_fp_folders_work(model_dir, checkpoint, capsys):
    runs = [_generate(capsys, str(checkpoint), PROMPT, "-n", "8", "--sample", "--seed", str(s))[1] for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    code, out, err = _generate(capsys, str(model_dir / "model"), PROMPT, "-n", "2", "--embeddings", "bfloat16")
    assert code == 0 and "no quantized layers; float32, embeddings: bfloat16" in err


def test_a_bfloat16_model_generates(checkpoint, capsys):
    import torch

    from optq.data.zoo import load_model
    from optq.formats.qlinear import QuantLinear

    code, out, err = _generate(capsys, str(checkpoint), PROMPT, "-n", "4", "--dtype", "bfloat16")
    assert code == 0 and out.startswith(PROMPT) and "bfloat16, embeddings: bfloat16" in err
    model = load_model(str(checkpoint), dtype=torch.bfloat16)[0]  # what --dtype asks for reaches the checkpoint
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.bfloat16 for p in norms)
    assert any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.parametrize(
    "args,message",
    [
        (["-n", "0"], "--max-new-tokens must be at least 1"),
        (["--sample", "--temperature", "0"], "--temperature must be > 0"),
        (["--threads", "0"], "--threads must be at least 1"),
    ],
)
def test_bad_arguments_are_refused(checkpoint, capsys, args, message):
    code, _, err = _generate(capsys, str(checkpoint), PROMPT, *args)
    assert code == 2 and message in err


def test_a_missing_model_is_refused(tmp_path, capsys):
    code, _, err = _generate(capsys, str(tmp_path / "nothing"), PROMPT)
    assert code == 2 and "nothing" in err


@pytest.mark.slow
def test_compiled_decoding_generates_the_same_text(checkpoint, capsys):
    _, eager, _ = _generate(capsys, str(checkpoint), PROMPT, "-n", "6")
    code, compiled, err = _generate(capsys, str(checkpoint), PROMPT, "-n", "6", "--compile")
    assert code == 0 and "compiled in " in err
    assert compiled == eager
    # sampled: the seed is set after the compiling warm-up, so the same seed gives the same text
    sampled = [
        _generate(capsys, str(checkpoint), PROMPT, "-n", "6", "--sample", "--seed", "3", *extra)[1]
        for extra in ((), ("--compile",))
    ]
    assert sampled[0] == sampled[1]
