"""Atomic writes: a file or a whole folder appears complete under its name, or not at all.

A folder is written under a temporary name beside its target and renamed into place (exchanged
with an old one by ``renameat2(RENAME_EXCHANGE)`` where Linux has it, else two renames);
leftovers of killed writers are cleaned the next time, if their process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_folder", "atomic_write", "move_into_place"]


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # renameat2 flags (linux/fs.h)
_AT_FDCWD = -100
_FILE_MODE, _DIR_MODE = 0o644, 0o755


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2(src, dst, flags)``; False where the libc, kernel or filesystem lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # the kernel or this filesystem cannot do it: the caller falls back
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _set_modes(folder: Path) -> None:
    """Every file 0644, every folder 0755 (``mkstemp`` writes 0600).

    Symbolic links are left alone: chmod would follow them, and a link may dangle (a Debian
    package unpacked here links into a package it depends on).
    """
    os.chmod(folder, _DIR_MODE)
    for root, dirs, files in os.walk(folder):
        for name, mode in [*((d, _DIR_MODE) for d in dirs), *((f, _FILE_MODE) for f in files)]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode)


def _clean_stale(target: Path) -> None:
    """Remove ``.NAME.optq-tmp-PID`` / ``.NAME.optq-old-PID`` left by runs that crashed.

    Only those whose PID is not a live process on this machine; our own PID's are removed too
    (left by an earlier crash of a process that had the same PID).
    """
    for p in target.parent.glob(f".{glob.escape(target.name)}.optq-*-*"):
        kind, _, pid = p.name[len(target.name) + 2 :].rpartition("-")
        if kind not in ("optq-tmp", "optq-old") or not pid.isdigit():
            continue
        if int(pid) != os.getpid() and _alive(int(pid)):
            continue
        _remove(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


@contextlib.contextmanager
def atomic_folder(target: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``target``; on success it replaces ``target``.

    The temporary folder is ``.NAME.optq-tmp-PID`` beside ``target``. On any error it is removed
    and ``target`` is left as it was. On success every file gets mode 0644 and every folder
    0755. With ``overwrite`` an existing ``target`` is swapped with the new folder in one step
    (Linux ``renameat2(RENAME_EXCHANGE)``), so at every moment ``target`` is either the old
    folder or the new one; the old content (now at the temporary name) is then deleted. Where
    the exchange is unavailable the old folder is first renamed to ``.NAME.optq-old-PID``
    (``target`` is briefly absent), put back if the second rename fails, and deleted otherwise.
    A process killed mid-way can leave ``.NAME.optq-tmp-PID`` or ``-old-PID`` behind (``target``
    itself is always whole, or absent only in the fallback's gap); the next write to the same
    ``target`` removes such leftovers of processes that are no longer running.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True or choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(target)
    tmp = target.parent / f".{target.name}.optq-tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        move_into_place(tmp, target, overwrite)
    finally:
        _remove(tmp)  # the failed write, or the old content after an exchange


def move_into_place(folder: Path, target: Path, overwrite: bool) -> None:
    """Make the finished ``folder`` become ``target`` (files 0644, folders 0755).

    A new ``target`` is a plain rename that never clobbers one appearing meanwhile; with
    ``overwrite`` an existing ``target`` is exchanged with ``folder`` in one step where Linux
    allows it (the old content is then at ``folder``'s path: the caller removes it), else
    replaced by two renames as in :func:`atomic_folder`.
    """
    folder, target = Path(folder), Path(target)
    _set_modes(folder)
    if not target.exists():
        if not _renameat2(folder, target, _RENAME_NOREPLACE):
            folder.rename(target)
    elif not overwrite:
        raise FileExistsError(f"{target} appeared while writing; pass overwrite=True or choose another folder")
    elif not _renameat2(folder, target, _RENAME_EXCHANGE):
        _replace_by_renames(folder, target)


def _replace_by_renames(tmp: Path, target: Path) -> None:
    """The fallback: target -> .old, tmp -> target, delete .old (or put it back on failure)."""
    old = target.parent / f".{target.name}.optq-old-{os.getpid()}"
    _remove(old)
    target.rename(old)
    replaced = False
    try:
        tmp.rename(target)
        replaced = True
    finally:
        if replaced:
            _remove(old)
        else:
            old.rename(target)


def atomic_write(path: str | Path, data: str | bytes, *, mode: int = 0o644) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file renamed over it.

    Readers see the old file or the new one, never a part; on any error the temporary file is
    removed. The file gets ``mode`` (ordinary data is world-readable, unlike ``mkstemp``'s 0600).
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename != str(path):
            # The temporary name is ours, not the user's: say which file could not be written.
            raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    return path
