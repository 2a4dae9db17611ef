"""method="gptaq" through the ways a run goes: streamed (byte-identical to the in-memory run),
killed and resumed (the journal keeps both activation chains: the same bytes, with activations
in RAM or offloaded), a streamed mixture of experts, and two processes under torch.distributed
(the cross term all-reduced like H: the same weights as one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipeline.resume_helpers import Kill, after_write_block, journal_state
from pipeline.spawned import folder_tensors, leave, stream_worker
from safetensors.torch import load_file

import optq

pytest.importorskip("transformers")

CFG = optq.QuantConfig(bits=3, group_size=16)
WORLD = 2


def _chains(partial: Path, done: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    acts = load_file(str(partial / f"activations-{done:05d}.safetensors"))
    return [acts[k] for k in sorted(acts) if not k.startswith("fp.")], [
        acts[k] for k in sorted(acts) if k.startswith("fp.")
    ]


def test_streamed_gptaq_equals_quantize_and_save(kit, tmp_path):
    from transformers import AutoModelForCausalLM

    src = kit.save_tiny(tmp_path / "src", "llama", dtype=torch.float32)
    kit.stream(src, tmp_path / "streamed", method="gptaq")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    report = optq.quantize(model, kit.tokens(n=6, seqlen=16), kit.CFG, progress=False, method="gptaq")
    optq.save(model, tmp_path / "saved", solutions=report.solutions, max_shard_size=kit.SHARD)
    streamed, saved = kit.folder_bytes(tmp_path / "streamed"), kit.folder_bytes(tmp_path / "saved")
    weights = sorted(k for k in saved if k.endswith(".safetensors"))
    assert weights and all(streamed[k] == saved[k] for k in weights)
    rows = json.loads(streamed[kit.REPORT])["layers"]
    assert all(rows[n]["objective"] == row.objective for n, row in report.layers.items())
    # and it is not GPTQ's checkpoint
    kit.stream(src, tmp_path / "gptq", method="gptq")
    plain = kit.folder_bytes(tmp_path / "gptq")
    assert any(plain[k] != streamed[k] for k in weights)


@pytest.mark.parametrize("offload", [False, True])
def test_gptaq_killed_after_block_1_resumes_to_the_same_bytes(offload, kit, tmp_path, monkeypatch):
    src = kit.save_tiny(tmp_path / "src", "llama", dtype=torch.bfloat16, layers=3)
    kw = dict(method="gptaq", offload_activations=offload)
    kit.stream(src, tmp_path / "ref", **kw)
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with monkeypatch.context() as m:
        after_write_block(m, 1)
        with pytest.raises(Kill):
            kit.stream(src, out, **kw)
    assert journal_state(out)["done"] == 1
    # The journal holds both chains entering block 1, and they differ (block 0 is quantized).
    quantized, float_ = _chains(partial, 1)
    assert len(quantized) == len(float_) == 1
    assert not torch.equal(quantized[0], float_[0])
    kit.stream(src, out, resume=True, **kw)
    assert not partial.exists() and kit.folder_bytes(out) == kit.folder_bytes(tmp_path / "ref")


def test_a_journal_without_the_float_chain_is_refused(kit, tmp_path, monkeypatch):
    # A damaged or foreign activations file without the float chain cannot resume GPTAQ exactly.
    from optq.pipeline.stream import journal as journal_mod

    src = kit.save_tiny(tmp_path / "src", "llama", dtype=torch.bfloat16, layers=3)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        after_write_block(m, 1)
        with pytest.raises(Kill):
            kit.stream(src, out, method="gptaq")
    real = journal_mod.load_file
    monkeypatch.setattr(journal_mod, "load_file", lambda p: {k: v for k, v in real(p).items() if "fp." not in k})
    with pytest.raises(journal_mod.JournalError, match="no float-model activations to resume GPTAQ"):
        kit.stream(src, out, method="gptaq", resume=True)


def test_streamed_mixtral_gptaq_killed_after_block_0_resumes_to_the_same_bytes(kit, tmp_path, monkeypatch):
    from tiny_moe import build

    build("mixtral").to(torch.bfloat16).save_pretrained(tmp_path / "src", max_shard_size=20_000)
    ref = kit.stream(tmp_path / "src", tmp_path / "ref", method="gptaq")
    assert ref.moe and all(row.hessian == "all" for n, row in ref.layers.items() if ".experts." in n)
    with monkeypatch.context() as m:
        after_write_block(m, 0)
        with pytest.raises(Kill):
            kit.stream(tmp_path / "src", tmp_path / "out", method="gptaq")
    kit.stream(tmp_path / "src", tmp_path / "out", method="gptaq", resume=True)
    assert kit.folder_bytes(tmp_path / "out") == kit.folder_bytes(tmp_path / "ref")


# --------------------------------------------------------------------------- torch.distributed
def _model(arch: str):
    if arch == "mixtral":
        from tiny_moe import build
    else:
        from tiny import build
    return build(arch)


def _ids() -> torch.Tensor:
    from tiny_moe import tokens

    return tokens(n=8, seqlen=16)


def _run(arch: str):
    model = _model(arch)
    report = optq.quantize(
        model, _ids(), CFG, method="gptaq", progress=False, batch_size=2, hessian_dtype="float64", gptaq_alpha=1.0
    )
    return model, report


def _worker(rank: int, store: str, out: str, arch: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        model, report = _run(arch)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}/weights{rank}.pt")
        Path(f"{out}/report{rank}.json").write_text(json.dumps(report.to_dict()))
    except BaseException as exc:  # noqa: BLE001 - recorded for the test to read
        Path(f"{out}/error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        leave()


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_two_processes_equal_one(arch, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(out), arch), nprocs=WORLD)
    errors = sorted(out.glob("error*.txt"))
    assert not errors, [e.read_text() for e in errors]
    w0, w1 = torch.load(out / "weights0.pt"), torch.load(out / "weights1.pt")
    torch.set_num_threads(1)
    model, report = _run(arch)
    single = model.state_dict()
    assert all(torch.equal(w0[k], w1[k]) and torch.equal(w0[k], single[k]) for k in single)
    r0 = json.loads((out / "report0.json").read_text())
    assert r0["distributed"]["world_size"] == 2
    for name, row in report.to_dict()["layers"].items():
        assert r0["layers"][name]["tokens"] == row["tokens"]  # every rank's tokens reached H and C
        assert r0["layers"][name]["objective"] == pytest.approx(row["objective"], rel=1e-6)


def test_streaming_over_two_ranks_killed_mid_run_resumes_to_one_process_bytes(tmp_path):
    from transformers import AutoModelForCausalLM

    from optq.pipeline.stream.quantize import quantize_pretrained

    config = _model("llama").config
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(tmp_path / "src")
    torch.set_num_threads(1)
    quantize_pretrained(
        tmp_path / "src", tmp_path / "one", _ids(), CFG, progress=False, batch_size=2, hessian_dtype="float64",
        max_shard_size=20_000, method="gptaq",
    )  # fmt: skip
    # Each launch logs to its own folder: rank 1 of the killed launch may record its failed
    # collective before the launcher stops it.
    killed, resumed = tmp_path / "log-killed", tmp_path / "log-resumed"
    killed.mkdir(), resumed.mkdir()
    src, dst = str(tmp_path / "src"), str(tmp_path / "two")
    with pytest.raises(mp.ProcessExitedException, match="process 0 terminated with exit code 1"):
        mp.spawn(
            stream_worker, args=(WORLD, str(tmp_path / "store1"), src, dst, str(killed), True, "gptaq"), nprocs=WORLD
        )
    partial = tmp_path / "two.partial"
    for rank in range(WORLD):  # each rank journaled its own share of both chains
        acts = load_file(str(partial / f"activations-00001.rank{rank}.safetensors"))
        assert sorted(acts) == ["000000", "000001", "fp.000000", "fp.000001"]
    mp.spawn(
        stream_worker, args=(WORLD, str(tmp_path / "store2"), src, dst, str(resumed), False, "gptaq"), nprocs=WORLD
    )
    assert not list(resumed.glob("error*.txt")), [e.read_text() for e in resumed.glob("error*.txt")]
    a, b = folder_tensors(tmp_path / "one"), folder_tensors(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
