"""Calibration and evaluation token sets from named corpora, text/JSON-lines files or HF datasets.

Example::

    >>> import torch
    >>> tokens = torch.arange(1000)
    >>> calibration_tokens(tokens, nsamples=4, seqlen=16, seed=0).shape
    torch.Size([4, 16])
    >>> eval_windows(tokens, seqlen=16, windows=2, bos_id=7)[:, :3].tolist()
    [[7, 0, 1], [7, 15, 16]]
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from optq.core import environment
from optq.data.corpora import CorpusError, Split, corpus_parts, is_corpus_name, known_corpora, split_text

__all__ = [
    "load_text",
    "tokenize",
    "load_tokens",
    "calibration_tokens",
    "mixed_calibration",
    "split_sources",
    "calibration_windows",
    "calibration_in_subprocess",
    "eval_windows",
    "FILE_SPLIT",
]

log = logging.getLogger("optq.data")

PARTS = ("calib", "eval", "all")
# Files have no fixed size: calibrate on the first two thirds, evaluate on the last third.
FILE_SPLIT = 2 / 3
HF_PREFIX = "hf:"


def load_text(name_or_path: str | Path, part: str = "calib", *, field: str = "text") -> str:
    """The text of one part ("calib", "eval" or "all") of a corpus, file or HF dataset.

    Accepts a named corpus (see ``optq.data.corpora``), a ``.txt`` file, a ``.jsonl`` file (the
    string ``field`` of each line, joined by blank lines), or ``hf:PATH[:CONFIG]`` for a Hugging
    Face dataset when ``datasets`` is installed ("calib" = its train split, "eval" = its test
    split, else validation). Files are split at two thirds of their characters.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    key = str(name_or_path)
    if key.startswith(HF_PREFIX):
        return _hf_text(key[len(HF_PREFIX) :], part, field)
    if is_corpus_name(key):
        calib, evaluation = corpus_parts(key)
        if part == "all":
            raise ValueError(f"corpus {key!r} has only 'calib' and 'eval' parts (they never overlap)")
        return calib if part == "calib" else evaluation
    path = Path(key).expanduser()
    if not path.is_file():
        raise CorpusError(
            f"{key!r} is not a known corpus or a file; known corpora: {', '.join(known_corpora())}; "
            "or give a .txt or .jsonl file, or hf:DATASET[:CONFIG]"
        )
    try:
        text = _jsonl_text(path, field) if path.suffix in (".jsonl", ".ndjson") else path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from None
    if not text.strip():
        use = {"calib": "calibrate on", "eval": "evaluate on", "all": "read"}[part]
        what = "is empty" if not text else "holds only whitespace"
        raise CorpusError(f"{path} {what}: there is no text to {use}; give a file with text")
    cut = Split(calib_chars=max(1, int(len(text) * FILE_SPLIT)))
    if part != "eval":  # the calibration part needs no evaluation part after it
        return text if part == "all" else text[: cut.calib_chars]
    return split_text(text, cut, what=str(path))[1]


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> CorpusError:
    """The first byte of ``path`` that is not UTF-8, by its offset in the whole file (a text
    stream's error counts from the chunk it was decoding)."""
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as whole:
        exc = whole
    byte = exc.object[exc.start]
    return CorpusError(
        f"{path} is not UTF-8 text: byte 0x{byte:02x} at offset {exc.start:,} ({exc.reason}); "
        "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )


def _jsonl_text(path: Path, field: str) -> str:
    texts = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{lineno} is not JSON ({exc.msg} at column {exc.colno})") from None
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                raise CorpusError(f"{path}:{lineno} has no string field {field!r}; name the text field to use")
            texts.append(value)
    return "\n\n".join(texts)


def _hf_text(spec: str, part: str, field: str) -> str:
    if importlib.util.find_spec("datasets") is None:
        raise CorpusError(
            f"hf:{spec} needs the Hugging Face `datasets` library (pip install datasets) and "
            "access to the hub; offline, use a named corpus or a .txt/.jsonl file"
        )
    import datasets

    path, _, config = spec.partition(":")
    splits = {"calib": ["train"], "eval": ["test", "validation"], "all": ["train"]}[part]
    available = datasets.get_dataset_split_names(path, config or None)
    for split in splits:
        if split in available:
            data = datasets.load_dataset(path, config or None, split=split)
            return "\n\n".join(str(x) for x in data[field])
    raise CorpusError(f"dataset {spec!r} has splits {available}; part {part!r} needs one of {splits}")


def tokenize(text: str, tokenizer: Any) -> torch.Tensor:
    """Token ids of ``text`` as a 1-D LongTensor, without special tokens (no BOS/EOS added)."""
    # verbose=False: the whole corpus is far longer than model_max_length on purpose.
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def load_tokens(name_or_path: str | Path, tokenizer: Any, part: str = "calib", *, field: str = "text") -> torch.Tensor:
    """:func:`load_text` followed by :func:`tokenize`."""
    tokens = tokenize(load_text(name_or_path, part, field=field), tokenizer)
    log.info("%s (%s): %s tokens", name_or_path, part, f"{tokens.numel():,}")
    return tokens


def _as_1d(tokens: torch.Tensor | Any) -> torch.Tensor:
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.dim() != 1:
        raise ValueError(f"expected a 1-D token sequence, got shape {tuple(tokens.shape)}")
    return tokens


def calibration_tokens(tokens_1d: torch.Tensor, nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``nsamples`` random windows of ``seqlen`` tokens: LongTensor ``[nsamples, seqlen]``.

    Start positions are drawn uniformly (with replacement) from ``0 .. n - seqlen - 1`` by a
    ``torch.Generator`` seeded with ``seed``, so the same tokens and seed give the same windows on
    every machine. The text needs at least ``seqlen + 1`` tokens (as in the GPTQ reference).
    """
    tokens = _as_1d(tokens_1d)
    if nsamples <= 0 or seqlen <= 0:
        raise ValueError(f"nsamples and seqlen must be positive, got {nsamples} and {seqlen}")
    n = tokens.numel()
    if n < seqlen + 1:
        raise ValueError(
            f"the calibration text has {n:,} tokens; windows of {seqlen} need at least {seqlen + 1:,}; "
            "give more text or a smaller seqlen"
        )
    generator = torch.Generator().manual_seed(int(seed))
    starts = torch.randint(0, n - seqlen, (nsamples,), generator=generator)
    offsets = torch.arange(seqlen)
    return tokens[starts[:, None] + offsets[None, :]]


def mixed_calibration(streams: list[torch.Tensor], nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``nsamples`` windows drawn from several token streams in equal shares: ``[nsamples, seqlen]``.

    Stream ``i`` of ``k`` gives ``nsamples // k`` windows, one more for the first
    ``nsamples % k`` streams, drawn by :func:`calibration_tokens` with seed ``seed + i``; the rows
    come stream by stream. With one stream this is ``calibration_tokens`` itself.
    """
    if not streams:
        raise ValueError("mixed calibration needs at least one token stream")
    if nsamples < len(streams):
        raise ValueError(
            f"nsamples={nsamples} cannot be shared by {len(streams)} calibration sources; give at least {len(streams)}"
        )
    shares = [nsamples // len(streams) + (i < nsamples % len(streams)) for i in range(len(streams))]
    return torch.cat([calibration_tokens(t, n, seqlen, seed + i) for i, (t, n) in enumerate(zip(streams, shares))])


def split_sources(spec: str) -> list[str]:
    """``"enwiki,debref-de,code"`` -> its calibration sources (a file whose name holds a comma stays whole)."""
    if Path(spec).expanduser().is_file():
        return [spec]
    sources = [p.strip() for p in spec.split(",") if p.strip()]
    if not sources:
        raise ValueError(f"{spec!r} names no calibration source")
    return sources


def calibration_windows(spec: str, tokenizer: Any, nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """The calibration windows of a ``--calib`` value: one source (corpus, file or ``hf:``), or
    several joined by commas, sharing ``nsamples`` equally (:func:`mixed_calibration`)."""
    streams = [load_tokens(source, tokenizer, "calib") for source in split_sources(spec)]
    return mixed_calibration(streams, nsamples, seqlen, seed)


def calibration_in_subprocess(folder: str | Path, spec: str, nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """What ``optq quantize`` calibrates on, tokenised in a child process with the tokenizer of
    the model in ``folder``: one source's token stream (:func:`load_tokens`), or several sources'
    windows (:func:`calibration_windows`), the same ids as in this process.

    Loading a tokenizer imports a few hundred modules and keeps about 0.1 GB, and tokenising a
    2 MB text leaves about 0.2 GB of freed heap: in a child that ends, none of it stays in the
    process that then holds the model's blocks (``benchmarks/scale_memory.py``). A user error
    there (an unknown corpus, too short a text) is raised here as ValueError with its message.
    """
    package_root = str(Path(__file__).resolve().parents[2])  # this optq, whatever the child's path
    env = environment.child_environment(package_root)
    with tempfile.TemporaryDirectory(prefix="optq-tokens-") as tmp:
        out = Path(tmp) / "tokens.safetensors"
        code = "import sys; from optq.data.tokens import _child; sys.exit(_child(sys.argv[1:]))"
        args = [str(folder), spec, str(nsamples), str(seqlen), str(seed), str(out)]
        proc = subprocess.run([sys.executable, "-c", code, *args], env=env, stdout=subprocess.DEVNULL)
        error = out.with_suffix(".error")
        if error.exists():
            raise ValueError(error.read_text())
        if proc.returncode != 0:
            raise RuntimeError(f"tokenising the calibration text failed in its process (exit {proc.returncode})")
        from safetensors.torch import load_file

        tokens = load_file(str(out))["tokens"]
    log.info("%s (calib): %s tokens", spec, f"{tokens.numel():,}")
    return tokens


def _child(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    folder, spec, nsamples, seqlen, seed, out = argv
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        sources = split_sources(spec)
        if len(sources) == 1:
            tokens = load_tokens(sources[0], tokenizer, "calib")
        else:
            tokens = calibration_windows(spec, tokenizer, int(nsamples), int(seqlen), int(seed))
    except (OSError, ValueError, RuntimeError) as exc:
        Path(out).with_suffix(".error").write_text(str(exc))
        return 2
    from safetensors.torch import save_file  # optq never unpickles, not even its own files

    save_file({"tokens": tokens.contiguous()}, out)
    return 0


def eval_windows(
    tokens_1d: torch.Tensor, seqlen: int, windows: int | None = None, bos_id: int | None = None
) -> torch.Tensor:
    """Consecutive non-overlapping windows from the start: LongTensor ``[windows, seqlen]``.

    Without ``bos_id`` each window holds ``seqlen`` text tokens; with it, each window is
    ``bos_id`` followed by the next ``seqlen - 1`` text tokens. ``windows=None`` takes every
    complete window; asking for more than the text holds is an error.
    """
    tokens = _as_1d(tokens_1d)
    if seqlen < 2:
        raise ValueError(f"seqlen must be at least 2 (one context token, one predicted), got {seqlen}")
    stride = seqlen - 1 if bos_id is not None else seqlen
    available = tokens.numel() // stride
    if windows is None:
        windows = available
    if windows <= 0 or windows > available:
        raise ValueError(
            f"the evaluation text has {tokens.numel():,} tokens, enough for {available} windows of "
            f"{stride} text tokens; {windows} windows need {max(windows, 1) * stride:,}; give more "
            "text or fewer windows"
        )
    body = tokens[: windows * stride].reshape(windows, stride)
    if bos_id is None:
        return body.clone()
    return torch.cat([torch.full((windows, 1), int(bos_id), dtype=torch.long), body], dim=1)
