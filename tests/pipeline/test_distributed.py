"""Two processes over torch.distributed (gloo, CPU): data-parallel calibration and parallel
solves give every rank the same weights, equal to one process's (byte for byte with float64
Hessians, to 99.9% of codes and logits to float tolerance without), on a dense and a
mixture-of-experts model; a rank that fails stops both, naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipeline.spawned import folder_tensors, leave, stream_worker

import optq

pytest.importorskip("transformers")

CFG = optq.QuantConfig(bits=3, group_size=16)
WORLD = 2


def _model(arch: str):
    if arch == "mixtral":
        from tiny_moe import build
    else:
        from tiny import build
    return build(arch)


def _ids() -> torch.Tensor:
    from tiny_moe import tokens

    return tokens(n=8, seqlen=16)


def _run(arch: str, hessian_dtype: str, fail: bool = False, device: str | None = None):
    model = _model(arch)
    # GPTQ, routed experts included (GPTAQ over ranks, the default method: test_gptaq_runs.py)
    kw = {"progress": False, "batch_size": 2, "hessian_dtype": hessian_dtype, "method": "gptq"}
    if device is not None:
        kw["device"] = device
    if arch == "mixtral":
        kw["moe_calibration"] = "routed"
        kw["moe_min_tokens"] = 0
    if fail and dist.get_rank() == 1:
        import optq.pipeline.blocks.groups as solve

        real = solve.solve_group

        def broken(work, unit, *a, **k):
            if "mlp" in unit.subset[0]:
                raise RuntimeError("injected failure on rank 1")
            return real(work, unit, *a, **k)

        solve.solve_group = broken
    report = optq.quantize(model, _ids(), CFG, **kw)
    return model, report


def _worker(rank: int, store: str, out: str, arch: str, hessian_dtype: str, fail: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        model, report = _run(arch, hessian_dtype, fail)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}/weights{rank}.pt")
        Path(f"{out}/report{rank}.json").write_text(json.dumps(report.to_dict()))
    except BaseException as exc:  # noqa: BLE001 - recorded for the test to read
        Path(f"{out}/error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        leave()


def _spawn(tmp_path: Path, arch: str, hessian_dtype: str = "float32", fail: bool = False) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(out), arch, hessian_dtype, fail), nprocs=WORLD)
    return out


def _single(arch: str, hessian_dtype: str, device: str | None = None):
    torch.set_num_threads(1)
    return _run(arch, hessian_dtype, device=device)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_two_processes_equal_one(arch, tmp_path):
    out = _spawn(tmp_path, arch, "float64")
    errors = sorted(out.glob("error*.txt"))
    assert not errors, [e.read_text() for e in errors]
    w0, w1 = torch.load(out / "weights0.pt"), torch.load(out / "weights1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # every rank ends with the same weights
    model, report = _single(arch, "float64")
    single = model.state_dict()
    assert all(torch.equal(w0[k], single[k]) for k in single), [k for k in single if not torch.equal(w0[k], single[k])][
        :3
    ]
    r0 = json.loads((out / "report0.json").read_text())
    d = r0["distributed"]
    assert d["world_size"] == 2 and [r["calibration_samples"] for r in d["ranks"]] == [[0, 4], [4, 8]]
    solved = [set(r["layers_solved"]) for r in d["ranks"]]
    assert solved[0] and solved[1] and not solved[0] & solved[1]
    assert solved[0] | solved[1] == set(report.layers)  # every layer solved, once
    assert list(r0["layers"]) == list(report.to_dict()["layers"])  # the same rows, in the same order
    for name, row in report.to_dict()["layers"].items():
        assert r0["layers"][name]["tokens"] == row["tokens"]  # all ranks' tokens reached each Hessian
        assert r0["layers"][name]["objective"] == pytest.approx(row["objective"], rel=1e-6)


def test_float32_hessians_agree_to_the_last_bits(tmp_path):
    out = _spawn(tmp_path, "llama", "float32")
    assert not list(out.glob("error*.txt"))
    w0 = torch.load(out / "weights0.pt")
    model, _ = _single("llama", "float32")
    single = model.state_dict()
    total = sum(v.numel() for v in single.values())
    same = sum(int((w0[k] == single[k]).sum()) for k in single)
    assert same >= 0.999 * total
    ids = _ids()
    fresh = _model("llama")
    fresh.load_state_dict(w0)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-3, atol=1e-3)


def test_a_failing_rank_stops_every_rank_and_is_named(tmp_path):
    out = _spawn(tmp_path, "llama", fail=True)
    assert (out / "error1.txt").read_text().startswith("RuntimeError: injected failure on rank 1")
    assert "rank 1 of 2 failed: RuntimeError: injected failure on rank 1" in (out / "error0.txt").read_text()
    assert not list(out.glob("weights*.pt"))


def _mismatch_worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        # Rank 1 was started with other settings: refused on both, before any work.
        optq.quantize(_model("llama"), _ids(), optq.QuantConfig(bits=3 + rank, group_size=16), progress=False)
    except BaseException as exc:  # noqa: BLE001
        Path(f"{out}/error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        leave()


def test_arguments_that_differ_between_ranks_are_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_mismatch_worker, args=(str(tmp_path / "store"), str(out)), nprocs=WORLD)
    for r in range(WORLD):
        text = (out / f"error{r}.txt").read_text()
        assert text.startswith("DistributedError: the arguments") and "rank(s) [1]" in text


def _traffic_worker(rank: int, store: str, out: str) -> None:
    import pickle

    from optq.pipeline.distributed.ranks import Dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    sent = {"objects": 0, "tensors": 0, "pickled_solutions": 0}
    gather, broadcast = Dist.all_gather, Dist.broadcast_

    def counted_gather(self, value, kind="gather"):
        data = pickle.dumps(value)
        sent["objects"] += len(data)
        sent["pickled_solutions"] += data.count(b"Solution")  # the class, by name, in the stream
        return gather(self, value, kind)

    def counted_broadcast(self, tensor, src, kind="gather"):
        sent["tensors"] += tensor.numel() * tensor.element_size()
        return broadcast(self, tensor, src, kind)

    Dist.all_gather, Dist.broadcast_ = counted_gather, counted_broadcast
    try:
        model, report = _run("llama", "float64")
        weights = sum(s.weight.numel() for s in report.solutions.values())
        Path(f"{out}/traffic{rank}.json").write_text(json.dumps({**sent, "weights": weights}))
    except BaseException as exc:  # noqa: BLE001
        Path(f"{out}/error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        leave()


def test_solutions_travel_as_tensors_from_their_rank_not_as_pickled_objects(tmp_path):
    """Codes, scales, zeros, g_idx and perm are broadcast as tensors (one byte per 3-bit code);
    what is pickled (report rows, schedules, token statistics, checks) is small beside them."""
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_traffic_worker, args=(str(tmp_path / "store"), str(out)), nprocs=WORLD)
    assert not list(out.glob("error*.txt")), [e.read_text() for e in out.glob("error*.txt")]
    for r in range(WORLD):
        t = json.loads((out / f"traffic{r}.json").read_text())
        # Every solution crosses once (its rank sends, the other receives): codes are one byte a
        # weight, the rest (scales, zeros per group of 16, g_idx, perm) under two more.
        assert t["weights"] <= t["tensors"] <= 3 * t["weights"], t
        assert t["pickled_solutions"] == 0 and t["objects"] < t["weights"], t  # rows, not weights


def test_streaming_over_two_ranks_killed_mid_run_resumes_to_one_process_bytes(tmp_path):
    from optq.pipeline.stream.quantize import quantize_pretrained

    model = _model("llama")
    model.config.num_hidden_layers = 3
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(model.config).float().eval().save_pretrained(tmp_path / "src")
    torch.set_num_threads(1)
    quantize_pretrained(
        tmp_path / "src",
        tmp_path / "one",
        _ids(),
        CFG,
        progress=False,
        batch_size=2,
        hessian_dtype="float64",
        max_shard_size=20_000,
        method="gptq",  # as stream_worker is told below
    )
    out = tmp_path / "log"
    out.mkdir()
    args = (str(tmp_path / "src"), str(tmp_path / "two"), str(out))
    # Rank 0 dies after writing block 1; the launcher (spawn here, torchrun alike) stops rank 1.
    with pytest.raises(mp.ProcessExitedException, match="process 0 terminated with exit code 1"):
        mp.spawn(stream_worker, args=(WORLD, str(tmp_path / "store1"), *args, True, "gptq"), nprocs=WORLD)
    assert not (tmp_path / "two").exists() and (tmp_path / "two.partial").is_dir()
    left = {p.name for p in (tmp_path / "two.partial").glob("activations-*")}
    assert {"activations-00001.rank0.safetensors", "activations-00001.rank1.safetensors"} <= left
    assert json.loads((tmp_path / "two.partial" / "state.json").read_text())["done"] == 1
    mp.spawn(stream_worker, args=(WORLD, str(tmp_path / "store2"), *args, False, "gptq"), nprocs=WORLD)
    assert not (out / "error0.txt").exists()
    a, b = folder_tensors(tmp_path / "one"), folder_tensors(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="the NCCL path needs two CUDA GPUs"
)
def test_nccl_two_gpus_equal_one(tmp_path):  # pragma: no cover - runs where GPUs are
    """Two ranks on two GPUs (torchrun, NCCL) against one process on one GPU: the same run as
    test_two_processes_equal_one (_run: batches of 2, so each rank's 4 samples are forwarded in
    the same batches as the single process's; float64 Hessians, so the sums' order does not
    reach the float32 solve), so every rank's weights equal the single process's byte for byte."""
    import subprocess
    import sys
    import textwrap

    here = Path(__file__).resolve().parent
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        sys.path[:0] = [{str(here.parent.parent)!r}, {str(here.parent)!r}, {str(here)!r}]
        import torch
        from optq.pipeline.distributed.ranks import init_from_env
        from test_distributed import _run
        torch.set_num_threads(1)
        d, device = init_from_env("cuda")
        model, report = _run("llama", "float64", device=device)
        torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, f"{out}/weights{{d.rank}}.pt")
        Path(f"{out}/report{{d.rank}}.json").write_text(json.dumps(report.to_dict()))
    """)
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPTQ_DIST_TIMEOUT": "120"}
    res = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", "29582", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    model, report = _single("llama", "float64", device="cuda:0")
    single, rows = {k: v.cpu() for k, v in model.state_dict().items()}, report.to_dict()["layers"]
    for rank in range(WORLD):
        w = torch.load(out / f"weights{rank}.pt", map_location="cpu")
        assert w.keys() == single.keys(), rank
        differ = [k for k in single if not torch.equal(w[k], single[k])]
        assert not differ, (rank, differ[:3])
        r = json.loads((out / f"report{rank}.json").read_text())
        d = r["distributed"]
        assert d["world_size"] == 2 and [x["calibration_samples"] for x in d["ranks"]] == [[0, 4], [4, 8]]
        solved = [set(x["layers_solved"]) for x in d["ranks"]]
        assert solved[0] and solved[1] and not solved[0] & solved[1] and solved[0] | solved[1] == set(rows)
        assert list(r["layers"]) == list(rows), rank  # the same rows, in the same order
        for name, row in rows.items():
            assert r["layers"][name]["tokens"] == row["tokens"], (rank, name)  # every rank's tokens
            assert r["layers"][name]["objective"] == pytest.approx(row["objective"], rel=1e-6), (rank, name)


def test_shares_cover_the_samples_once_and_work_goes_largest_first_to_the_least_loaded():
    from optq.pipeline.distributed.ranks import Dist

    for n, world in ((8, 2), (7, 3), (3, 3), (128, 8)):
        shares = [Dist(world, r).share(n) for r in range(world)]
        assert shares[0][0] == 0 and shares[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))  # contiguous, no overlap
        assert max(hi - lo for lo, hi in shares) - min(hi - lo for lo, hi in shares) <= 1
    # Greedy by hand: 9 -> r0; 7 -> r1; 5 -> r1 (7 < 9)... loads end 9+3, 7+5, and 4 ties go low.
    owners = Dist(2, 0).assign([3.0, 9.0, 5.0, 7.0])
    assert owners == [0, 0, 1, 1]
    assert Dist(3, 0).assign([1.0, 1.0, 1.0, 1.0]) == [0, 1, 2, 0]
    assert Dist().assign([5.0, 1.0]) == [0, 0]
