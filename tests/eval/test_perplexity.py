"""Perplexity against a brute-force NLL, windows/BOS bookkeeping, and a real-model sanity check."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from optq.eval.perplexity import perplexity, perplexity_detail


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _brute_force_mean_nll(model, windows):
    """Predict every token from its own prefix, one forward pass per token: no shared logic."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            for t in range(1, len(row)):
                logits = model(input_ids=row[:t].unsqueeze(0)).logits[0, -1].double()
                total -= torch.log_softmax(logits, -1)[row[t]].item()
                count += 1
    return total / count, count


def test_perplexity_equals_brute_force(model):
    tokens = torch.randint(0, 50, (70,), generator=torch.Generator().manual_seed(1))
    detail = perplexity_detail(model, tokens, seqlen=12, windows=5)
    mean_nll, count = _brute_force_mean_nll(model, tokens[:60].view(5, 12))
    assert detail.tokens == count == 5 * 11 and detail.windows == 5 and detail.seqlen == 12
    assert detail.mean_nll == pytest.approx(mean_nll, rel=1e-5)
    assert detail.perplexity == pytest.approx(math.exp(mean_nll), rel=1e-5)
    assert perplexity(model, tokens, seqlen=12, windows=5) == pytest.approx(detail.perplexity, rel=1e-6)


def test_bos_windows_predict_every_text_token(model):
    tokens = torch.randint(3, 50, (40,), generator=torch.Generator().manual_seed(2))
    detail = perplexity_detail(model, tokens, seqlen=8, windows=4, bos_id=1)
    windows = torch.cat([torch.ones(4, 1, dtype=torch.long), tokens[:28].view(4, 7)], dim=1)
    mean_nll, count = _brute_force_mean_nll(model, windows)
    assert detail.tokens == count == 28 and detail.bos_id == 1
    assert detail.mean_nll == pytest.approx(mean_nll, rel=1e-5)
    assert detail.perplexity != pytest.approx(perplexity(model, tokens, seqlen=8, windows=4), rel=1e-3)


def test_batching_all_windows_and_ready_windows_agree(model):
    tokens = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(3))
    one = perplexity_detail(model, tokens, seqlen=16)
    assert one.windows == 6  # every complete window by default
    assert perplexity(model, tokens, seqlen=16, batch_size=4) == pytest.approx(one.perplexity, rel=1e-5)
    ready = tokens[:96].view(6, 16)
    assert perplexity(model, ready) == pytest.approx(one.perplexity, rel=1e-6)


def test_mode_is_restored_and_bare_modules_work(model):
    model.train()
    try:
        perplexity(model, torch.arange(40) % 50, seqlen=10)
        assert model.training
    finally:
        model.eval()

    class Uniform(torch.nn.Module):
        def forward(self, input_ids, use_cache=None):
            return torch.zeros(*input_ids.shape, 7)

    # Uniform logits over 7 classes: perplexity is exactly 7.
    assert perplexity(Uniform(), torch.arange(30) % 7, seqlen=10) == pytest.approx(7.0, rel=1e-6)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="enough for 1 windows"):
        perplexity(model, torch.arange(20) % 50, seqlen=16, windows=2)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        perplexity(model, torch.arange(20) % 50, seqlen=16, batch_size=0)


def test_windows_longer_than_the_models_positions_are_refused_up_front(model):
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"^seqlen=65 is out of range: the model's positions allow 1\.\.64$"):
            perplexity(model, torch.arange(200) % 50, seqlen=65)
        with pytest.raises(ValueError, match="seqlen=70 is out of range"):
            perplexity(model, (torch.arange(140) % 50).view(2, 70))  # ready windows too
    finally:
        hook.remove()
    assert calls == []
    assert perplexity(model, torch.arange(200) % 50, seqlen=64) > 1.0


def test_non_finite_logits_are_refused():
    from optq.eval.perplexity import NonFiniteLogitsError

    class Broken(torch.nn.Module):
        def __init__(self, bad_window, value):
            super().__init__()
            self.bad_window, self.value, self.seen = bad_window, value, 0

        def forward(self, input_ids, use_cache=None):
            logits = torch.zeros(*input_ids.shape, 7)
            for row in range(input_ids.shape[0]):
                if self.seen == self.bad_window:
                    logits[row, 2, 3] = self.value
                self.seen += 1
            return logits

    tokens = torch.arange(40) % 7
    with pytest.raises(
        NonFiniteLogitsError,
        match=r"^the model produced non-finite logits \(NaN/Inf\) "
        r"in window 3 of 4; the checkpoint may be corrupt$",
    ) as info:
        perplexity(Broken(2, float("nan")), tokens, seqlen=10)
    assert math.isnan(info.value.value) and info.value.window == 2
    with pytest.raises(NonFiniteLogitsError, match="in windows 3..4 of 4") as info:
        perplexity(Broken(3, float("inf")), tokens, seqlen=10, batch_size=2)
    assert isinstance(info.value, ValueError) and math.isnan(info.value.value)
    assert perplexity(Broken(99, float("nan")), tokens, seqlen=10) == pytest.approx(7.0)


@pytest.mark.real
def test_smollm2_perplexity_on_enwiki_is_sane():
    from optq.data.zoo import model_available

    if not model_available("smollm2-135m"):
        pytest.skip("SmolLM2-135M not fetched (optq fetch smollm2-135m)")
    from optq.data.corpora import _cache_file
    from optq.data.tokens import load_tokens
    from optq.data.zoo import load_model

    if not _cache_file("enwiki").exists():
        pytest.skip("enwiki corpus not cached (optq fetch enwiki)")
    model, tokenizer = load_model("smollm2-135m")
    tokens = load_tokens("enwiki", tokenizer, "eval")
    assert 5.0 < perplexity(model, tokens, seqlen=512, windows=4) < 60.0
