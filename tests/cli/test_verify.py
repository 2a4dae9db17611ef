"""``optq verify``: a checkpoint written by ``optq quantize`` agrees with its own record on optq's
two paths; one whose scales were changed after writing does not (exit 1, naming the engine and
the prompt); a near-tie is not a disagreement; engines not installed are skipped with the
command that installs them; usage errors exit 2."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from cli_args import quantize_args
from safetensors.torch import load_file, save_file

from optq.cli import main
from optq.formats.probes import PROBES_FILE


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "q"
    prompts = model_dir / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw7 w8\n")
    assert (
        main(quantize_args(model_dir, out, "--bits", "4", "--group-size", "32", "--probe-prompts", str(prompts))) == 0
    )
    return out


def _verify(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _copy(checkpoint, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(checkpoint, folder)
    return folder


def test_untouched_checkpoint_agrees_on_both_optq_paths(checkpoint, capsys, tmp_path):
    record = json.loads((checkpoint / PROBES_FILE).read_text())
    assert [p["text"] for p in record["prompts"]] == ["w1 w2 w3", "w7 w8"]
    code, out, _ = _verify(capsys, str(checkpoint), "--engines", "optq,optq-exact", "--json", str(tmp_path / "v.json"))
    assert code == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("optq")}
    assert rows["optq"][1] == "agree" and rows["optq-exact"][1] == "agree"
    assert rows["optq-exact"][2] == "2/2"
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["ok"] and [e["status"] for e in doc["engines"]] == ["agree", "agree"]
    exact = doc["engines"][1]
    assert exact["max_logprob_diff"] < 1e-5 and all(p["steps"] == 16 for p in exact["prompts"])


def test_changed_scales_of_one_layer_disagree(checkpoint, capsys, tmp_path):
    folder = _copy(checkpoint, tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    key = "model.layers.0.mlp.down_proj.scales"
    tensors[key] = tensors[key] * 4
    save_file(tensors, str(path), metadata={"format": "pt"})
    code, out, _ = _verify(capsys, str(folder), "--engines", "optq,optq-exact")
    assert code == 1, out
    assert "optq-exact: DISAGREES on prompt 0 'w1 w2 w3'" in out
    assert "optq-exact: DISAGREES on prompt 1 'w7 w8'" in out
    assert "FAILED:" in out and "optq-exact" in out.splitlines()[-1]


@pytest.mark.parametrize("gap, agrees", [(1e-4, True), (0.5, False)])
def test_a_near_tie_is_not_a_disagreement(checkpoint, capsys, tmp_path, gap, agrees):
    """The record is edited so that at step 2 of prompt 0 it took the runner-up, ``gap`` below
    the engine's top: within optq-exact's tie tolerance (1e-3) a tie, beyond it a disagreement."""
    folder = _copy(checkpoint, tmp_path)
    record = json.loads((folder / PROBES_FILE).read_text())
    prompt = record["prompts"][0]
    (a, lp), (b, _) = prompt["top_logprobs"][2][:2]
    prompt["top_logprobs"][2][:2] = [[b, lp], [a, lp - gap]]
    prompt["tokens"][2] = b
    (folder / PROBES_FILE).write_text(json.dumps(record))
    code, out, _ = _verify(capsys, str(folder), "--engines", "optq-exact")
    if agrees:
        assert code == 0, out
        assert "optq-exact: prompt 0 'w1 w2 w3': took the other token at near-tie step 2" in out
    else:
        assert code == 1, out
        assert f"optq-exact: DISAGREES on prompt 0 'w1 w2 w3': step 2: token {a} where the record has {b}" in out


def test_engines_not_installed_are_skipped_with_their_install_command(checkpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("OPTQ_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./.venv-vllm here
    code, out, _ = _verify(capsys, str(checkpoint), "--engines", "transformers,vllm")
    assert code == 0, out
    assert "vllm: skipped:" in out and "optq install-vllm" in out
    if importlib.util.find_spec("gptqmodel") is None:
        assert "transformers: skipped: gptqmodel is not installed: pip install gptqmodel" in out
    assert "nothing was compared" in out or "agree" in out


def test_vllms_w4a8_path_is_skipped_on_a_cpu_where_vllm_never_takes_it(checkpoint, capsys, monkeypatch, tmp_path):
    from optq.eval import vllm
    from optq.eval.verify import NO_W4A8

    monkeypatch.delenv("OPTQ_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./.venv-vllm here
    monkeypatch.setattr(vllm, "takes_w4a8_here", lambda: False)
    code, out, _ = _verify(capsys, str(checkpoint), "--engines", "vllm-w4a8")
    assert code == 0 and f"vllm-w4a8: skipped: {NO_W4A8}" in out, out
    monkeypatch.setattr(vllm, "takes_w4a8_here", lambda: True)  # an AMX CPU without vLLM installed
    code, out, _ = _verify(capsys, str(checkpoint), "--engines", "vllm-w4a8")
    assert code == 0 and "vllm-w4a8: skipped: no vLLM interpreter found: optq install-vllm" in out, out


def test_vllm_is_skipped_on_a_cpu_its_build_has_no_4bit_kernel_for(checkpoint, capsys, monkeypatch, tmp_path):
    from optq.eval import vllm

    never = tmp_path / "never-run-python"  # an interpreter that must not be started
    monkeypatch.setenv("OPTQ_VLLM_PYTHON", str(never))
    monkeypatch.setattr(vllm, "has_int4_kernel_here", lambda: False)  # an x86 CPU with AVX2 only
    code, out, _ = _verify(capsys, str(checkpoint), "--engines", "vllm")
    assert code == 0 and f"vllm: skipped: {vllm.NO_INT4_KERNEL}" in out, out
    monkeypatch.setattr(vllm, "has_int4_kernel_here", lambda: True)  # the kernel is there: vLLM is started
    code, out, _ = _verify(capsys, str(checkpoint), "--engines", "vllm")
    assert code == 1 and "vllm: failed" in out and "never-run-python" in out, out


def test_usage_errors_exit_2_naming_the_file(checkpoint, model_dir, capsys, tmp_path):
    code, _, err = _verify(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere: no such folder" in err
    code, _, err = _verify(capsys, str(model_dir / "model"))  # a float model folder: no probes
    assert code == 2 and f"{PROBES_FILE}: not found, so there is nothing to compare" in err
    code, _, err = _verify(capsys, str(checkpoint), "--engines", "optq,tensorrt")
    assert code == 2 and "tensorrt is not an engine" in err
    folder = _copy(checkpoint, tmp_path)
    (folder / PROBES_FILE).write_text("{not json")
    code, _, err = _verify(capsys, str(folder))
    assert code == 2 and f"{folder / PROBES_FILE}: not JSON" in err


def test_inspect_lists_the_probes(checkpoint, capsys):
    capsys.readouterr()
    assert main(["inspect", str(checkpoint)]) == 0
    assert f"expected outputs: {PROBES_FILE}, 2 prompts x 16 greedy tokens, top-5 logprobs" in capsys.readouterr().out


def test_a_bad_probe_prompts_file_is_refused_before_work(model_dir, capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\n\n")
    code = main(quantize_args(model_dir, tmp_path / "out", "--probe-prompts", str(bad)))
    assert code == 2 and f"{bad}: no prompt in it" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_transformers_with_compressed_tensors_agrees(model_dir, capsys, tmp_path):
    out = tmp_path / "ct"
    assert (
        main(quantize_args(model_dir, out, "--bits", "4", "--group-size", "16", "--format", "compressed-tensors")) == 0
    )
    code, text, _ = _verify(capsys, str(out), "--engines", "transformers")
    if importlib.util.find_spec("compressed_tensors") is None:
        assert (
            code == 0
            and "transformers: skipped: compressed_tensors is not installed: pip install compressed-tensors" in text
        )
        return
    assert code == 0, text
    row = next(line.split() for line in text.splitlines() if line.startswith("transformers "))
    assert row[1] == "agree" and row[2] == "4/4"  # the 4 built-in prompts
    assert "transformers: kernel: compressed-tensors:" in text
