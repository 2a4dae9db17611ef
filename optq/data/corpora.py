"""Named offline text corpora, their calibration/evaluation split, and the optq cache folder.

Every named corpus comes from a package registry (PyPI or Debian) or from the machine itself, so
it works where no model/data hub is reachable. The cleaned plain text is cached once under
``cache_dir() / "corpora"``.

Split rules (calibration and evaluation never overlap; the first two follow the peers'
protocol in shared/baseline.md so perplexities compare):

==============  =====================================  =======================================
corpus          calibration part                       evaluation part
==============  =====================================  =======================================
enwiki          first 2,000,000 characters             last 1,000,000 characters (*)
debref-<lang>   first 100,000 characters               everything after the first 100,000
news            first 200,000 characters               everything after the first 200,000
pydoc, code     first 2,000,000 characters             last 1,000,000 characters
==============  =====================================  =======================================

(*) the evaluation part never starts before the calibration part ends: our cleaned enwiki text
has 2,905,933 characters, so its evaluation part is everything after the first 2,000,000.

Example::

    >>> calib, evaluation = corpus_parts("debref-de")   # doctest: +SKIP
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import logging
import re
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

from optq.core import environment
from optq.data.wiki import dump_to_text

__all__ = [
    "CorpusError",
    "Split",
    "cache_dir",
    "known_corpora",
    "is_corpus_name",
    "corpus_text",
    "corpus_parts",
    "fetch_corpus",
    "split_text",
    "cached_wheel",
    "download_wheel",
]

log = logging.getLogger("optq.corpora")

GENSIM_WHEEL = "gensim==4.4.0"
_ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"
_PYDOC_PACKAGE = "python3.11-doc"
_PYDOC_ROOT = "usr/share/doc/python3.11/html/_sources"
DEBREF_LANGUAGES = ("en", "de", "fr", "es", "it", "ja", "pt", "zh-cn", "zh-tw")


class CorpusError(ValueError):
    """A corpus is unknown, cannot be fetched, or is too short for the requested split."""


@dataclass(frozen=True, kw_only=True)
class Split:
    """Where calibration and evaluation text come from, in characters of the cleaned text.

    ``calib_chars``: the calibration part is the first ``calib_chars`` characters.
    ``eval_chars``: the evaluation part is the last ``eval_chars`` characters; ``None`` means
    everything after the calibration part.
    """

    calib_chars: int
    eval_chars: int | None = None

    def __post_init__(self) -> None:
        if self.calib_chars <= 0 or (self.eval_chars is not None and self.eval_chars <= 0):
            raise ValueError(f"split sizes must be positive, got {self}")


_SPLITS = {
    "enwiki": Split(calib_chars=2_000_000, eval_chars=1_000_000),
    "news": Split(calib_chars=200_000),
    "pydoc": Split(calib_chars=2_000_000, eval_chars=1_000_000),
    "code": Split(calib_chars=2_000_000, eval_chars=1_000_000),
    "debref": Split(calib_chars=100_000),
}


def cache_dir() -> Path:
    """The optq cache folder: ``$OPTQ_CACHE``, else ``$XDG_CACHE_HOME/optq``, else ``~/.cache/optq``."""
    if mine := environment.get("OPTQ_CACHE"):
        return Path(mine).expanduser()
    if xdg := environment.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "optq"
    return Path.home() / ".cache" / "optq"


def known_corpora() -> list[str]:
    """Names accepted by :func:`corpus_text` (``debref-<lang>`` listed per known language)."""
    return ["enwiki", "news", "pydoc", "code", *(f"debref-{lang}" for lang in DEBREF_LANGUAGES)]


def is_corpus_name(name: str) -> bool:
    """Whether ``name`` is a named corpus (any ``debref-<lang>`` counts; Debian decides)."""
    return (name in _SPLITS and name != "debref") or (name.startswith("debref-") and len(name) > 7)


def _split_for(name: str) -> Split:
    return _SPLITS["debref"] if name.startswith("debref-") else _SPLITS[name]


def split_text(text: str, split: Split, *, what: str = "text") -> tuple[str, str]:
    """Cut ``text`` into non-overlapping (calibration, evaluation) parts by ``split``.

    When the text is shorter than calibration + evaluation, the evaluation part starts where
    calibration ends (it is shorter, never overlapping); no evaluation text left is an error.
    """
    calib_end = min(split.calib_chars, len(text))
    eval_start = calib_end if split.eval_chars is None else max(len(text) - split.eval_chars, calib_end)
    if eval_start >= len(text):
        raise CorpusError(
            f"{what} has {len(text):,} characters, all taken by the first {split.calib_chars:,} "
            "for calibration; nothing is left to evaluate on. Give a longer text"
        )
    if split.eval_chars is not None and len(text) - eval_start < split.eval_chars:
        log.debug(
            "%s: evaluation part shortened to %s characters to stay clear of calibration",
            what,
            f"{len(text) - eval_start:,}",
        )
    return text[:calib_end], text[eval_start:]


def corpus_parts(name: str) -> tuple[str, str]:
    """The (calibration, evaluation) texts of a named corpus, fetching it if needed."""
    return split_text(corpus_text(name), _split_for(name), what=f"corpus {name!r}")


def corpus_text(name: str) -> str:
    """The whole cleaned text of a named corpus, from the cache or fetched now."""
    path = fetch_corpus(name)
    return path.read_text(encoding="utf-8")


def fetch_corpus(name: str) -> Path:
    """Make sure the cleaned text of ``name`` is in the cache and return its path."""
    if not is_corpus_name(name):
        raise CorpusError(
            f"unknown corpus {name!r}; known: {', '.join(known_corpora())} "
            "(debref-<lang> takes any Debian language code), or give a .txt/.jsonl file"
        )
    path = _cache_file(name)
    if path.exists():
        return path
    if name in ("enwiki", "news"):
        wheel = download_wheel(GENSIM_WHEEL, why="its test data holds the enwiki and news text")
        with zipfile.ZipFile(wheel) as zf:
            if name == "enwiki":
                log.info("extracting and cleaning the Wikipedia dump from %s", wheel.name)
                text = dump_to_text(bz2.decompress(zf.read(_ENWIKI_MEMBER)))
            else:
                text = zf.read(_NEWS_MEMBER).decode("utf-8")
    elif name.startswith("debref-"):
        text = _debref_text(name[len("debref-") :])
    elif name == "pydoc":
        text = _pydoc_text()
    else:
        text = _stdlib_code_text()
    from optq.formats.atomic import atomic_write  # imports torch: only when writing

    atomic_write(path, text)
    log.info("cached corpus %s (%s characters) at %s", name, f"{len(text):,}", path)
    return path


def _cache_file(name: str) -> Path:
    if name == "code":
        # The stdlib differs between Python builds: key the cache by where it lives and version.
        key = f"{sysconfig.get_paths()['stdlib']}|{sys.version}".encode()
        return (
            cache_dir()
            / "corpora"
            / f"code-py{sys.version_info[0]}{sys.version_info[1]}-{hashlib.sha256(key).hexdigest()[:10]}.txt"
        )
    return cache_dir() / "corpora" / f"{name}.txt"


def _run(cmd: list[str], *, cwd: Path, what: str, offline_hint: str, error: type[Exception] = CorpusError) -> None:
    log.info("running: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise error(f"{what} needs the program {cmd[0]!r}, which is not installed. {offline_hint}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise error(f"{what} failed ({' '.join(cmd)}): {' | '.join(detail)}. {offline_hint}")


def _downloads() -> Path:
    path = cache_dir() / "downloads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wheel_key(name: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', name.strip()).lower()}-{version.strip()}"


def _pinned(requirement: str) -> tuple[str, str]:
    name, sep, version = requirement.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise ValueError(f"{requirement!r} is not a pinned requirement NAME==VERSION")
    return name, version


def cached_wheel(requirement: str) -> Path | None:
    """The wheel of the pinned ``requirement`` (``NAME==VERSION``) in ``cache_dir() / "downloads"``, or None.

    Wheel file names spell the name with runs of ``-_.`` as ``_``, in any case (PEP 427).
    """
    key = _wheel_key(*_pinned(requirement))
    folder = cache_dir() / "downloads"
    wheels = []
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        parts = path.name[: -len(".whl")].split("-")  # name-version[-build]-python-abi-platform
        if len(parts) >= 5 and _wheel_key(parts[0], parts[1]) == key:
            wheels.append(path)
    return wheels[0] if wheels else None


def download_wheel(requirement: str, *, why: str = "", error: type[Exception] = CorpusError) -> Path:
    """The wheel of ``requirement`` (``NAME==VERSION``) in the cache, downloaded once.

    ``pip download --no-deps``: the wheel is only read as a zip file, never installed, and its
    dependencies are not fetched. ``error`` is the exception type raised on failure.
    """
    found = cached_wheel(requirement)
    if found is not None:
        return found
    folder = _downloads()
    log.info("downloading the %s wheel%s", requirement, f" ({why})" if why else "")
    hint = (
        f"Without network, on a connected machine run `pip download {requirement} --no-deps "
        f"--only-binary=:all: -d DIR` and copy the wheel into {folder}"
    )
    _run(
        [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary=:all:", "-d", str(folder)],
        cwd=folder,
        what=f"downloading {requirement}",
        offline_hint=hint,
        error=error,
    )
    found = cached_wheel(requirement)
    if found is None:
        raise error(f"pip reported success but no wheel of {requirement} is in {folder}. {hint}")
    return found


def _debian_unpack(package: str) -> Path:
    """``apt-get download`` + ``dpkg-deb -x`` into the cache (no root install); the unpack root."""
    folder = _downloads()
    root = folder / package
    if root.exists():
        return root
    hint = (
        f"Without network, on a Debian machine run `apt-get download {package}` and copy the "
        f".deb into {folder}, then rerun `optq fetch`"
    )
    debs = sorted(folder.glob(f"{package}_*.deb"))
    if not debs:
        log.info("downloading the Debian package %s", package)
        _run(["apt-get", "download", package], cwd=folder, what=f"downloading {package}", offline_hint=hint)
        debs = sorted(folder.glob(f"{package}_*.deb"))
        if not debs:
            raise CorpusError(f"apt-get reported success but no {package}_*.deb is in {folder}. {hint}")
    from optq.formats.atomic import atomic_folder

    with atomic_folder(root, overwrite=True) as tmp:
        _run(
            ["dpkg-deb", "-x", str(debs[-1]), str(tmp)],
            cwd=folder,
            what=f"unpacking {debs[-1].name}",
            offline_hint=hint,
        )
    return root


def _debref_text(lang: str) -> str:
    root = _debian_unpack(f"debian-reference-{lang}")
    path = root / "usr/share/debian-reference" / f"debian-reference.{lang}.txt.gz"
    if not path.exists():
        raise CorpusError(f"debian-reference-{lang} does not contain {path.relative_to(root)}")
    return gzip.decompress(path.read_bytes()).decode("utf-8")


def _pydoc_text() -> str:
    root = _debian_unpack(_PYDOC_PACKAGE) / _PYDOC_ROOT
    files = sorted(p for p in root.rglob("*.rst.txt") if p.is_file())
    if not files:
        raise CorpusError(f"{_PYDOC_PACKAGE} has no .rst.txt sources under {root}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in files) + "\n"


def _stdlib_code_text() -> str:
    """All ``*.py`` files of this Python's stdlib in sorted path order, installed packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if p.is_file() and not skip.intersection(p.relative_to(root).parts))
    log.info("reading %d stdlib source files under %s", len(files), root)
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in files) + "\n"
