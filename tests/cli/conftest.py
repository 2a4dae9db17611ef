"""A saved tiny Llama with a word-level tokenizer and a calibration text, for the CLI tests."""

from __future__ import annotations

import random

import pytest

WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``root/model`` (a tiny Llama, 64 positions, and its tokenizer) and ``root/calib.txt``."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tiny import build

    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(60))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    model = build("llama")
    model.save_pretrained(root / "model")
    fast.save_pretrained(root / "model")
    (root / "calib.txt").write_text(text)
    return root
