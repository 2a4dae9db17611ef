"""benchmarks/isa_bytes.py's own logic: each setting's child gets exactly its environment, a
failed child becomes a row holding its error, and the results file keeps every machine. The
children are stood in for; nothing is quantized here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import isa_bytes  # noqa: E402


def _fake_children(monkeypatch, hashes: dict[str, str | None]) -> list[dict]:
    """Each child reports the hash its setting maps to (None: it fails); returns the envs seen."""
    seen, real_run = [], subprocess.run

    def run(cmd, env=None, **kw):
        if env is None:  # not a child (platform's own uname, say)
            return real_run(cmd, **kw)
        seen.append(env)
        controlled = {k: env[k] for k in isa_bytes._CONTROLLED if k in env}
        digest = hashes[next(n for n, e in isa_bytes.SETTINGS.items() if e == controlled)]
        if digest is None:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: boom\n")
        result = {"capability": "AVX2", "sha256": digest, "fp_nll_sum": 1.5, "quantize_s": 2.0}
        return subprocess.CompletedProcess(cmd, 0, "noise\nISA_RESULT " + json.dumps(result) + "\n", "")

    monkeypatch.setattr(isa_bytes.subprocess, "run", run)
    return seen


def test_each_setting_runs_with_its_environment_and_unsets_the_others(monkeypatch, tmp_path, capsys):
    # a variable the user set must not leak into the settings that leave it unset
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.setattr(isa_bytes, "RESULTS", tmp_path / "isa.json")
    hashes = {"native": "a" * 64, "aten-default": "b" * 64, "mkl-compatible": None, "pinned": "a" * 64}
    seen = _fake_children(monkeypatch, hashes)
    assert isa_bytes.main([]) == 0
    assert len(seen) == len(isa_bytes.SETTINGS)
    for env, (name, wanted) in zip(seen, isa_bytes.SETTINGS.items()):
        controlled = {k: env[k] for k in isa_bytes._CONTROLLED if k in env}
        assert controlled == wanted, name
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "| same |" in rows["pinned"] and "| differs |" in rows["aten-default"]
    assert "RuntimeError: boom" in rows["mkl-compatible"]

    saved = json.loads((tmp_path / "isa.json").read_text())
    (entry,) = saved["machines"].values()
    assert entry["runs"]["mkl-compatible"]["error"] == "RuntimeError: boom"
    assert entry["runs"]["pinned"]["sha256"] == "a" * 64
    assert entry["settings"] == {"blocks": 2, "nsamples": 8, "seqlen": 256}


def test_results_keep_other_machines(monkeypatch, tmp_path):
    path = tmp_path / "isa.json"
    other = {"cpu": {"name": "other"}, "settings": {"blocks": 2, "nsamples": 8, "seqlen": 256}, "runs": {}}
    path.write_text(json.dumps({"machines": {"other [avx512f]": other}}))
    monkeypatch.setattr(isa_bytes, "RESULTS", path)
    _fake_children(monkeypatch, dict.fromkeys(isa_bytes.SETTINGS, "c" * 64))
    isa_bytes.main([])
    machines = json.loads(path.read_text())["machines"]
    assert machines["other [avx512f]"] == other and len(machines) == 2
