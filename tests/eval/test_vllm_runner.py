"""optq.eval.vllm without vLLM: which interpreter it takes, how it reads the child's log (a fake
child stands in for vLLM's interpreter), and the errors it raises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from optq.eval import vllm
from optq.eval.vllm import EngineError, decode, decode_all, vllm_python


def test_the_flag_wins_then_the_variable_then_the_local_venv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPTQ_VLLM_PYTHON", raising=False)
    assert vllm_python() is None
    local = tmp_path / ".venv-vllm" / "bin" / "python"
    local.parent.mkdir(parents=True)
    local.write_text("")
    assert vllm_python() == str(local)
    monkeypatch.setenv("OPTQ_VLLM_PYTHON", "/opt/v/bin/python")
    assert vllm_python() == "/opt/v/bin/python"
    assert vllm_python("/x/python") == "/x/python"


def _checkpoint(folder: Path, method: str | None) -> Path:
    folder.mkdir()
    qc = {"quant_method": method} if method else None
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return folder


FAKE = """
import json, os, sys
job = json.loads(sys.stdin.read())
assert job["max_model_len"] % 16 == 0 and job["max_model_len"] >= len(job["prompts"][0]) + job["max_new_tokens"]
for i, item in enumerate(job["checkpoints"]):
    print(f"@@optq-vllm begin {i}", flush=True)
    assert item["dtype"] == "bfloat16"
    if item["path"].endswith("/c"):  # the compressed-tensors one: refused
        print("(EngineCore pid=1) ERROR 12-03 04:00:00 [core.py:1] ValueError: Output size (144) not supported")
        print("@@optq-vllm " + json.dumps({"error": "RuntimeError: Engine core initialization failed"}))
        continue
    print("(Worker pid=2) INFO 12-03 04:00:00 [auto_gptq.py:352] Using CPUWNA16LinearKernel for AutoGPTQLinearMethod")
    steps = [{"5": -0.5, "7": -1.5, "9": -0.1}] * job["max_new_tokens"]
    out = {"tokens": [9] * job["max_new_tokens"], "logprobs": steps}
    w4a8 = os.environ.get("VLLM_CPU_INT4_W4A8", "unset")  # what this child was told
    print("@@optq-vllm " + json.dumps({"kernels": [], "w4a8": w4a8 == "1", "load_s": 1.0, "decode_s": 2.0,
          "tokens_per_s": 3.0, "outputs": [out for _ in job["prompts"]]}))
"""


def test_results_errors_and_the_kernel_are_read_from_the_childs_log(tmp_path, monkeypatch):
    child = tmp_path / "fake_child.py"
    child.write_text(FAKE)
    monkeypatch.setattr(vllm, "CHILD", child)
    gptq = _checkpoint(tmp_path / "g", "gptq")
    ct = _checkpoint(tmp_path / "c", "compressed-tensors")
    first, second = decode_all([gptq, ct], [[1, 2, 3]], 4, 2, python=sys.executable)
    assert first["engine"] == "vllm" and first["kernel"] == "CPUWNA16LinearKernel"
    assert first["load_s"] == 1.0 and first["tokens_per_s"] == 3.0
    assert first["outputs"] == [{"tokens": [9] * 4, "logprobs": [{9: -0.1, 5: -0.5}] * 4}]  # top 2, best first
    assert isinstance(second, EngineError)
    assert "Output size (144) not supported" in str(second) and "initialization failed" in str(second)
    with pytest.raises(EngineError, match="Output size"):
        decode(ct, [[1]], 1, 1, python=sys.executable)


def test_w4a8_is_told_to_vllm_through_its_variable_and_read_back(tmp_path, monkeypatch):
    """``w4a8=False`` sets VLLM_CPU_INT4_W4A8=0 (the weight-only kernel), ``True`` sets 1, ``None``
    leaves the caller's environment; the result's ``w4a8`` is what the child reports."""
    child = tmp_path / "fake_child.py"
    child.write_text(FAKE.replace('"kernels": []', '"kernels": [w4a8]'))  # the kernel names what it was told
    monkeypatch.setattr(vllm, "CHILD", child)
    gptq = _checkpoint(tmp_path / "g", "gptq")
    monkeypatch.delenv("VLLM_CPU_INT4_W4A8", raising=False)
    told = {w: decode(gptq, [[1]], 1, 1, python=sys.executable, w4a8=w) for w in (False, True, None)}
    assert {w: (r["kernel"], r["w4a8"]) for w, r in told.items()} == {
        False: ("0", False),
        True: ("1", True),
        None: ("unset", False),
    }
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "1")
    assert decode(gptq, [[1]], 1, 1, python=sys.executable)["w4a8"] is True
    assert decode(gptq, [[1]], 1, 1, python=sys.executable, w4a8=False)["w4a8"] is False


def test_a_missing_or_dying_interpreter_is_an_engine_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPTQ_VLLM_PYTHON", raising=False)
    gptq = _checkpoint(tmp_path / "g", "gptq")
    with pytest.raises(EngineError, match="install-vllm"):
        decode(gptq, [[1]], 1, 1)
    with pytest.raises(EngineError, match="did not run"):
        decode(gptq, [[1]], 1, 1, python=str(tmp_path / "no-such-python"))
    child = tmp_path / "dies.py"
    child.write_text("import sys\nprint('@@optq-vllm begin 0')\nprint('MemoryError: out of memory')\nsys.exit(9)\n")
    monkeypatch.setattr(vllm, "CHILD", child)
    with pytest.raises(EngineError, match=r"MemoryError: out of memory; the vLLM process ended \(exit status 9\)"):
        decode(gptq, [[1]], 1, 1, python=sys.executable)
    child.write_text(
        "import os, signal\nprint('@@optq-vllm begin 0', flush=True)\nos.kill(os.getpid(), signal.SIGILL)\n"
    )
    with pytest.raises(EngineError, match=r"the vLLM process ended \(killed by SIGILL\)"):
        decode(gptq, [[1]], 1, 1, python=sys.executable)


def test_the_known_engines_are_the_default_ones_then_vllm_cpu():
    from optq.formats.engines import ENGINES, KNOWN_ENGINES, parse_engines

    assert KNOWN_ENGINES == (*ENGINES, "vllm-cpu")
    assert parse_engines("all") == ENGINES and parse_engines("all,vllm-cpu") == KNOWN_ENGINES
    with pytest.raises(ValueError, match="vllm-cpu"):
        parse_engines("vllm-gpu")
