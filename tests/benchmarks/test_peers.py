"""benchmarks/peers.py's own logic: the peer list, the JSON rows, resuming cell by cell, a failed
peer's row and the calibration ids file. Nothing here installs a virtualenv or runs a peer: the
cells are stood in for where main() would quantize and evaluate."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import peers  # noqa: E402


def test_peer_list_defaults_order_and_unknown_names():
    assert peers.parse_peers(None, quick=False) == list(peers.PEERS)
    assert len(peers.PEERS) == 13
    assert peers.parse_peers(None, quick=True) == ["optq", "optq-gptq", "gptqmodel", "llm-compressor"]
    assert peers.parse_peers(" auto-round, optq,auto-round ", quick=True) == ["auto-round", "optq"]
    with pytest.raises(ValueError, match="unknown peer.*gptq-model.*known: optq"):
        peers.parse_peers("optq,gptq-model", quick=False)
    with pytest.raises(ValueError, match="names no peer"):
        peers.parse_peers(" , ", quick=False)


def test_every_peer_has_its_child_script_and_venv():
    for p in peers.PEERS.values():
        assert (peers.CHILDREN / p.child).is_file(), p
        assert p.venv is None or p.venv in peers.VENVS


def test_the_command_line_rejects_an_unknown_peer(capsys):
    with pytest.raises(SystemExit) as exc:
        peers.main(["--model", "smollm2-135m", "--bits", "4", "--peers", "optq,nope"])
    assert exc.value.code == 2
    assert "unknown peer(s) nope" in capsys.readouterr().err


def _eval_json(reference: str | None, rows: list[tuple[str, float, float, float, float]]) -> dict:
    return {
        "reference": reference,
        "results": [
            {"corpus": c, "perplexity": p, "kl": kl, "kl_p99": p99, "top1": t, "windows": 8}
            for c, p, kl, p99, t in rows
        ],
    }


def test_a_row_carries_the_schema_and_averages_the_corpora():
    quant = {"quantize_s": 12.5, "peak_rss_mb": 900.0, "bytes": 1234, "notes": "sym", "version": "1.0"}
    ev = _eval_json("fp", [("enwiki", 20.0, 0.1, 0.5, 0.8), ("code", 5.0, 0.3, 0.9, 0.6)])
    row = peers.make_row("optq", 4, 64, quant, ev)
    assert set(peers.ROW_KEYS) <= set(row)
    assert row["kl"] == pytest.approx(0.2) and row["kl_p99"] == pytest.approx(0.7) and row["top1"] == pytest.approx(0.7)
    assert row["ppl"] == {"enwiki": 20.0, "code": 5.0}
    assert (row["peer"], row["bits"], row["group_size"], row["bytes"]) == ("optq", 4, 64, 1234)
    assert row["by_corpus"]["code"]["kl"] == 0.3
    json.dumps(row)  # JSON-clean
    fp = peers.make_row("fp", 16, 0, {}, _eval_json(None, [("enwiki", 18.0, None, None, None)]))
    assert fp["kl"] is None and fp["ppl"] == {"enwiki": 18.0}
    err = peers.error_row("gptqmodel", 3, 64, "boom")
    assert set(peers.ROW_KEYS) <= set(err) and err["error"] == "boom" and err["kl"] is None


def test_the_tables_list_the_best_kl_first_and_errors_last(tmp_path, capsys):
    corpora = [("enwiki", 20.0, 0.4, 1.0, 0.7), ("code", 5.0, 0.2, 0.8, 0.9)]
    worse = peers.make_row("optq-rtn", 4, 64, {"bytes": 1}, _eval_json("fp", corpora))
    better = peers.make_row(
        "optq", 4, 64, {"bytes": 1}, _eval_json("fp", [(c, p, k / 2, q, t) for c, p, k, q, t in corpora])
    )
    results = {"corpora": ["enwiki", "code"], "rows": [peers.error_row("gptqmodel", 4, 64, "boom"), worse, better]}
    lines = peers.table(results).splitlines()[2:]
    assert [ln.split(" | ")[0].strip("| ") for ln in lines] == ["optq", "optq-rtn", "gptqmodel"]
    assert "error: boom" in lines[2]
    by_corpus = peers.corpus_table(results).splitlines()
    assert by_corpus[0] == "| peer | enwiki | code |" and len(by_corpus) == 4  # head, rule, two rows
    assert by_corpus[2] == "| optq | 0.200 (70.0%) | 0.100 (90.0%) |"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    assert peers.main(["--model", "m", "--bits", "4", "--json", str(path), "--tables"]) == 0
    out = capsys.readouterr().out
    assert peers.table(results) in out and peers.corpus_table(results) in out


def test_calibration_ids_round_trip(tmp_path):
    ids = torch.randint(0, 50_000, (3, 7), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    f = tmp_path / "calib.safetensors"
    peers.write_calibration(f, ids)
    back = peers.read_calibration(f)
    assert back.dtype == torch.int64 and torch.equal(back, ids)
    with pytest.raises(ValueError, match="int64"):
        peers.write_calibration(f, ids.int())
    with pytest.raises(ValueError, match=r"\[nsamples, seqlen\]"):
        peers.write_calibration(f, ids.reshape(-1))


def test_a_failing_child_raises_with_its_stderr_tail(tmp_path, monkeypatch):
    bad = "import sys\nprint('line one', file=sys.stderr)\nsys.exit('no kernel for this CPU')\n"
    (tmp_path / "bad.py").write_text(bad)
    (tmp_path / "good.py").write_text('print("noise")\nprint(\'PEER_RESULT {"quantize_s": 1.5}\')\n')
    monkeypatch.setattr(peers, "CHILDREN", tmp_path)
    log = tmp_path / "log.txt"
    with pytest.raises(RuntimeError, match="(?s)bad.py exit 1.*line one.*no kernel for this CPU"):
        peers.run_child(Path(sys.executable), peers.Peer("x", None, "bad.py", "v"), [], log, False)
    assert "no kernel for this CPU" in log.read_text()
    good = peers.run_child(Path(sys.executable), peers.Peer("x", None, "good.py", "v"), [], log, False)
    assert good == {"quantize_s": 1.5}


def test_a_childs_output_reaches_its_log_while_it_runs(tmp_path, monkeypatch):
    # the child finds its own first line in the log before it ends, or fails
    child = """import sys, time
from pathlib import Path
print("calibrating block 1 of 30")
log = Path(sys.argv[-1])
for _ in range(200):
    if "calibrating block 1 of 30" in log.read_text():
        print('PEER_RESULT {"seen": true}')
        sys.exit(0)
    time.sleep(0.05)
sys.exit("the log was empty while the child ran")
"""
    (tmp_path / "slow.py").write_text(child)
    monkeypatch.setattr(peers, "CHILDREN", tmp_path)
    log = tmp_path / "quantize.log"
    got = peers.run_child(Path(sys.executable), peers.Peer("x", None, "slow.py", "v"), [str(log)], log, False)
    assert got == {"seen": True}
    assert log.read_text().startswith("$ ") and "calibrating block 1 of 30" in log.read_text()


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """main() with the model folder, calibration, evaluation and cells stood in for."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setattr(peers, "calibration_file", lambda work, folder, proto: work / "calib.safetensors")
    monkeypatch.setattr(peers, "evaluate", lambda *a, **k: _eval_json(None, [("enwiki", 18.0, None, None, None)]))
    ran: list[str] = []

    def run_cell(peer, args, folder, calib, work, proto):
        ran.append(peer.name)
        if peer.name == "gptqmodel":
            raise RuntimeError("gptqmodel_child.py exit 1:\nImportError: no module named pcre")
        quant = {"quantize_s": 2.0, "peak_rss_mb": 10.0, "bytes": 99, "notes": "", "version": "t"}
        ev = _eval_json("fp", [("enwiki", 19.0, 0.1, 0.2, 0.9)])
        return peers.make_row(peer.name, args.bits, args.group_size, quant, ev)

    monkeypatch.setattr(peers, "run_cell", run_cell)
    return folder, tmp_path / "out.json", ran


def test_resume_skips_finished_cells_and_records_failures(stand_ins, tmp_path, capsys):
    folder, out, ran = stand_ins
    argv = ["--model", str(folder), "--bits", "4", "--group-size", "64", "--quick", "--json", str(out)]
    argv += ["--work", str(tmp_path / "work")]
    assert peers.main([*argv, "--peers", "optq,gptqmodel"]) == 0
    assert ran == ["optq", "gptqmodel"]
    saved = json.loads(out.read_text())
    assert (saved["bits"], saved["group_size"], saved["nsamples"], saved["seqlen"]) == (4, 64, 16, 256)
    rows = {r["peer"]: r for r in saved["rows"]}
    assert rows["optq"]["kl"] == 0.1 and not rows["optq"].get("error")
    assert "no module named pcre" in rows["gptqmodel"]["error"] and rows["gptqmodel"]["kl"] is None
    assert "error: gptqmodel_child.py exit 1" in capsys.readouterr().out  # the table row
    # a rerun: optq is finished and skipped, the failed gptqmodel is tried again, optq-rtn is new
    ran.clear()
    assert peers.main([*argv, "--peers", "optq,gptqmodel,optq-rtn"]) == 0
    assert ran == ["gptqmodel", "optq-rtn"]
    saved = json.loads(out.read_text())
    assert [r["peer"] for r in saved["rows"]] == ["optq", "gptqmodel", "optq-rtn"]
    # another protocol into the same file is refused, the file kept
    with pytest.raises(SystemExit):
        peers.main([a for a in argv if a != "--quick"] + ["--peers", "optq"])
    assert json.loads(out.read_text()) == saved


def test_default_json_names_model_bits_and_quick(tmp_path):
    assert peers.default_json("smollm2-135m", 3, False).name == "peers-smollm2-135m-3.json"
    assert peers.default_json(str(tmp_path), 4, True).name == f"peers-{tmp_path.name}-4-quick.json"


def test_child_helper_prints_one_result_line(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(peers.CHILDREN)!r})
        from _child import Clock
        Clock().finish("9.9", "asked for sym", bytes_hint=3)
        """
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("PEER_RESULT ")]
    got = json.loads(line.removeprefix("PEER_RESULT "))
    assert got["version"] == "9.9" and got["notes"] == "asked for sym" and got["bytes_hint"] == 3
    assert got["peak_rss_mb"] > 1 and got["quantize_s"] >= 0


def test_the_checkpoint_is_found_in_out_or_its_one_subfolder(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.json").write_text("{}")
    assert peers.model_folder(flat) == flat
    nested = tmp_path / "nested"  # auto-round 0.16: OUT/<model>-w4g64/
    (nested / "smol-w4g64").mkdir(parents=True)
    (nested / "smol-w4g64" / "config.json").write_text("{}")
    (nested / "logs").mkdir()
    assert peers.model_folder(nested) == nested / "smol-w4g64"
    (nested / "other").mkdir()
    (nested / "other" / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=r"holds 2 checkpoints \(other, smol-w4g64\)"):
        peers.model_folder(nested)
    (tmp_path / "logs-only" / "logs").mkdir(parents=True)
    for bad in (tmp_path / "missing", tmp_path / "logs-only"):
        with pytest.raises(RuntimeError, match="holds no checkpoint"):
            peers.model_folder(bad)


def test_optq_child_variants_fit_the_ranges_they_name(tmp_path):
    """optq's child on a tiny Llama: the default searches each range weighted by H, ``-mse``
    unweighted, ``-minmax`` and rtn take min/max; the checkpoint's report records which."""
    import subprocess

    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import build

    build("llama").save_pretrained(tmp_path / "model")
    ids = tmp_path / "ids.safetensors"
    save_file({"ids": torch.randint(0, 90, (4, 16), generator=torch.Generator().manual_seed(0))}, str(ids))
    expected = {"gptaq": (True, True), "gptq-mse": (True, False), "gptq-minmax": (False, False), "rtn": (False, False)}
    for variant, (mse, weighted) in expected.items():
        out = tmp_path / variant
        args = ["--variant", variant, "--model", str(tmp_path / "model"), "--ids", str(ids), "--out", str(out)]
        done = subprocess.run(
            [sys.executable, str(peers.CHILDREN / "optq_child.py"), *args, "--bits", "4", "--group-size", "16"],
            capture_output=True,
            text=True,
            env=peers._env(optq_on_path=True),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        config = json.loads((out / "quantization_report.json").read_text())["config"]
        assert (config["mse"], config["mse_hessian"]) == (mse, weighted), variant
        assert config["sym"] and config["bits"] == 4 and config["group_size"] == 16
        result = json.loads(done.stdout.split("PEER_RESULT ", 1)[1])
        assert variant.split("-")[0] in result["notes"]
