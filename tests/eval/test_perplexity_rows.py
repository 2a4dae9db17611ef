"""The perplexity's row-sliced head and loss give the same bits as the loss of the whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from optq.eval import perplexity as ppl


def _model(model_type: str = "llama"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=3000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config.model_type = model_type
    return model


def _whole(model, batch):
    logits = model(input_ids=batch, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")


@pytest.mark.parametrize("rows", [7, 64, 10_000])
def test_sliced_rows_give_the_bits_of_the_whole_loss(monkeypatch, rows):
    model = _model()
    batch = torch.randint(0, 3000, (3, 50), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(ppl, "_HEAD_ROWS", rows)
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    with torch.no_grad():
        assert ppl._plain_head(model) == "lm_head"
        got = ppl._batch_nll(model, batch)
        assert max(s[0] for s in seen) == min(rows, 3 * 49)  # the head saw slices of rows, never the whole
        assert torch.equal(got, _whole(model, batch))
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head is back


def test_other_heads_take_the_whole_logits():
    model = _model("cohere")  # a logit scale after the head: not a plain head
    assert ppl._plain_head(model) is None
    model = _model()
    model.config.final_logit_softcapping = 30.0
    assert ppl._plain_head(model) is None


def test_the_head_is_restored_when_the_forward_fails():
    model = _model()
    with pytest.raises(IndexError), torch.no_grad():
        ppl._batch_nll(model, torch.full((1, 5), 10**6))
    assert isinstance(model.lm_head, torch.nn.Linear)
