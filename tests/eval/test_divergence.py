"""KL(float || quantized) and top-token agreement (optq.eval.divergence): against a brute-force
computation over the whole set in float64 with numpy, and held one window's logits at a time."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import pytest
import torch
from tiny import llama, tokens

import optq
from optq.data.tokens import eval_windows
from optq.eval import divergence
from optq.eval import perplexity as ppl
from optq.eval.compare import compare, parse_variant
from optq.eval.divergence import DivergenceResult, divergence_detail, perplexity_and_divergence, quantile
from optq.eval.perplexity import NonFiniteLogitsError, perplexity_detail


def _pair(noise: float = 0.3):
    """A tiny float Llama and a copy with every decoder weight perturbed (the "quantized" one)."""
    fp = llama(layers=2)
    with torch.no_grad():  # peaked next-token distributions, as a trained model's
        fp.lm_head.weight.mul_(30)
    q = copy.deepcopy(fp)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in q.named_parameters():
            if "layers." in name and p.dim() == 2:
                p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=g))
    return fp, q


def _brute(fp, q, windows) -> tuple[float, float, float, int]:
    """Mean KL, its 99th percentile and the top-1 share from both models' full logits over the
    whole set at once, softmax in float64 by numpy; positions 0..L-2 of each window."""
    with torch.no_grad():
        a = fp(input_ids=windows).logits[:, :-1].double().numpy().reshape(-1, fp.config.vocab_size)
        b = q(input_ids=windows).logits[:, :-1].double().numpy().reshape(-1, fp.config.vocab_size)

    def log_softmax(x):
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    la, lb = log_softmax(a), log_softmax(b)
    kl = (np.exp(la) * (la - lb)).sum(-1)
    return float(kl.mean()), float(np.percentile(kl, 99)), float((a.argmax(-1) == b.argmax(-1)).mean()), kl.size


def _check(result: DivergenceResult, brute) -> None:
    kl, p99, top1, n = brute
    assert result.tokens == n
    assert result.kl == pytest.approx(kl, rel=1e-4)
    assert result.kl_p99 == pytest.approx(p99, rel=1e-4)
    assert result.top1 == pytest.approx(top1, abs=0.5 / n)  # the same count of agreements


def test_kl_p99_and_top1_match_a_brute_force_computation(monkeypatch):
    fp, q = _pair()
    windows = tokens(n=6, seqlen=24, seed=5)
    brute = _brute(fp, q, windows)
    assert 0 < brute[2] < 1 and brute[0] > 1e-3  # the perturbation moves distributions and top tokens
    _check(divergence_detail(fp, q, windows), brute)
    _check(divergence_detail(fp, q, windows, batch_size=4), brute)  # a last batch of 2
    monkeypatch.setattr(divergence, "_HEAD_ROWS", 7)  # head slices cutting across windows
    _check(divergence_detail(fp, q, windows, batch_size=3), brute)
    # a head that is not plain (soft-capping, ...): whole logits per batch, for one model or both
    monkeypatch.setattr(divergence, "_plain_head", lambda m: None if m is q else "lm_head")
    _check(divergence_detail(fp, q, windows, batch_size=2), brute)
    monkeypatch.setattr(divergence, "_plain_head", lambda m: None)
    _check(divergence_detail(fp, q, windows, batch_size=2), brute)


def test_a_model_against_itself_and_the_windows_of_a_text():
    fp, _ = _pair()
    same = divergence_detail(fp, fp, tokens(n=3, seqlen=16))
    assert same.top1 == 1.0 and abs(same.kl) < 1e-6 and same.tokens == 3 * 15
    # text cut as perplexity cuts it: 2 windows of 16, each with BOS first
    fp, q = _pair()
    text = tokens(n=1, seqlen=40).flatten()
    cut = divergence_detail(fp, q, eval_windows(text, 16, 2, bos_id=1))
    windows = torch.stack([torch.cat([torch.tensor([1]), text[i * 15 : (i + 1) * 15]]) for i in range(2)])
    _check(cut, _brute(fp, q, windows))


@pytest.mark.parametrize(
    ("batch_size", "head_rows", "plain"), [(1, 512, True), (4, 512, True), (3, 7, True), (2, 512, False), (5, 7, False)]
)
def test_one_pass_gives_perplexitys_and_kls_own_bits(monkeypatch, batch_size, head_rows, plain):
    """perplexity_and_divergence equals perplexity_detail and divergence_detail run apart, to the
    bit (==, not approx), for batches that do not divide the windows, head slices that cut across
    windows, and heads that are not plain (whole logits); and runs each model once per batch."""
    fp, q = _pair()
    text = tokens(n=1, seqlen=200, seed=11).flatten()
    windows = eval_windows(text, 24, None, bos_id=1)  # 8 windows of 24, each with BOS first
    monkeypatch.setattr(divergence, "_HEAD_ROWS", head_rows)
    monkeypatch.setattr(ppl, "_HEAD_ROWS", head_rows)
    if not plain:
        monkeypatch.setattr(divergence, "_plain_head", lambda m: None)
        monkeypatch.setattr(ppl, "_plain_head", lambda m: None)
    apart = (
        perplexity_detail(q, text, seqlen=24, bos_id=1, batch_size=batch_size),
        divergence_detail(fp, q, windows, batch_size=batch_size),
    )
    calls = {"fp": 0, "q": 0}
    fp.model.register_forward_hook(lambda *a: calls.__setitem__("fp", calls["fp"] + 1))
    q.model.register_forward_hook(lambda *a: calls.__setitem__("q", calls["q"] + 1))
    together = perplexity_and_divergence(fp, q, windows, bos_id=1, batch_size=batch_size)
    assert together == apart
    assert calls == {"fp": -(-8 // batch_size), "q": -(-8 // batch_size)}  # one forward of each per batch
    assert together[0].perplexity > 1.0 and together[1].kl > 1e-3  # measured, not a default
    _check(together[1], _brute(fp, q, windows))


def test_one_pass_refuses_what_perplexity_refuses():
    fp, q = _pair()
    with torch.no_grad():
        q.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="window 1 of 2"):
        perplexity_and_divergence(fp, q, tokens(n=2, seqlen=16), batch_size=1)
    long = tokens(n=1, seqlen=fp.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="position"):
        perplexity_and_divergence(fp, fp, long)
    with pytest.raises(ValueError, match="batch_size"):
        perplexity_and_divergence(fp, fp, tokens(n=2, seqlen=16), batch_size=0)


def test_quantile_is_numpys_linear_percentile():
    values = torch.tensor([3.0, -1.0, 7.5, 2.0, 0.25, 9.0, 4.0])
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert quantile(values, q) == pytest.approx(float(np.percentile(values.numpy(), 100 * q)))


@pytest.mark.parametrize(("batch_size", "head_rows"), [(1, 512), (3, 10)])
def test_at_most_one_slice_of_logits_per_model_is_alive_at_a_time(monkeypatch, batch_size, head_rows):
    """Every logits tensor a head makes is recorded (weakly): when the next is made, at most one
    of each model's is still alive, each at most ``head_rows`` rows; with batch_size 1, at most
    one window's."""
    monkeypatch.setattr(divergence, "_HEAD_ROWS", head_rows)
    fp, q = _pair()
    seqlen, vocab = 16, fp.config.vocab_size
    made: list[weakref.ref] = []
    most = {"alive": 0, "rows": 0}

    def hook(_module, _args, out):
        made.append(weakref.ref(out))
        most["alive"] = max(most["alive"], sum(r() is not None for r in made))
        most["rows"] = max(most["rows"], out.numel() // vocab)

    for m in (fp, q):
        m.lm_head.register_forward_hook(hook)
    result = divergence_detail(fp, q, tokens(n=7, seqlen=seqlen), batch_size=batch_size)
    assert result.tokens == 7 * (seqlen - 1)
    assert len(made) >= 2 * 7 * (seqlen - 1) // head_rows  # the hook saw every slice of both models
    assert most["alive"] <= 2
    assert most["rows"] <= (seqlen - 1 if batch_size == 1 else head_rows)


def test_vocabularies_that_differ_are_refused():
    fp, _ = _pair()
    other = llama(layers=1)
    other.resize_token_embeddings(fp.config.vocab_size + 8)
    with pytest.raises(ValueError, match="vocabulary"):
        divergence_detail(fp, other, tokens(n=2, seqlen=16))


def test_compare_rows_carry_kl_against_fp_on_the_same_windows():
    fp = llama(layers=2)
    variants = [parse_variant(v, optq.QuantConfig(bits=2, group_size=16)) for v in ("fp", "rtn")]
    windows = tokens(n=3, seqlen=16, seed=9)
    models = {}
    results = compare(
        fp,
        variants,
        tokens(n=4, seqlen=16),
        {"t": windows},
        batch_size=2,
        progress=False,
        on_result=lambda r, m: models.setdefault(r.variant.name, copy.deepcopy(m)),
    )
    rows = {r.variant.name: r.to_dict() for r in results}
    assert (rows["fp"]["kl"], rows["fp"]["kl_p99"], rows["fp"]["top1"]) == ({"t": 0.0}, {"t": 0.0}, {"t": 1.0})
    kl, p99, top1, _ = _brute(fp, models["rtn"], windows)
    assert rows["rtn"]["kl"]["t"] == pytest.approx(kl, rel=1e-4) and kl > 0
    assert rows["rtn"]["kl_p99"]["t"] == pytest.approx(p99, rel=1e-4)
    assert rows["rtn"]["top1"]["t"] == pytest.approx(top1)
    # a loader keeps no fp model in memory: nothing is measured, and the fields say so
    (res,) = compare(lambda: copy.deepcopy(fp), variants[1:], tokens(n=4, seqlen=16), {"t": windows}, progress=False)
    assert res.to_dict()["kl"] is None and res.to_dict()["top1"] is None
