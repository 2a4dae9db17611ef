"""The two ways of running a block (pause / replay), unusual blocks, and cleanup on failure.

The pause strategy is GPTQ's: GPTAQ (the default method) pairs every batch with the float
block's and always replays, so the pause-vs-replay tests ask for method="gptq"."""

from __future__ import annotations

import threading

import pytest
import torch

import optq
from optq.core import gptaq, solver

pytest.importorskip("transformers")
from tiny import build  # noqa: E402
from tiny import run as _run  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi", "gemma3"])
@pytest.mark.parametrize("propagate", ["quantized", "original"])
def test_pause_and_replay_strategies_give_the_same_weights(arch, propagate):
    a, b = build(arch), build(arch)
    ra = _run(a, strategy="pause", propagate=propagate, batch_size=2, method="gptq")
    rb = _run(b, strategy="replay", propagate=propagate, batch_size=2, method="gptq")
    for name in ra.solutions:
        assert torch.equal(ra.solutions[name].weight, rb.solutions[name].weight), name
    assert ra.options["strategy"] == "pause" and rb.options["strategy"] == "replay"


class _TwiceBlock(torch.nn.Module):
    """A block that applies one linear twice (shared weights), plus an unused linear."""

    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.shared = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, d)
        self.unused = torch.nn.Linear(d, d)

    def forward(self, h, scale=None):
        x = self.shared(self.norm(h))
        return h + self.out(torch.relu(self.shared(x)) * scale)


class _TwiceModel(torch.nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([_TwiceBlock(d) for _ in range(2)])

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h, scale=torch.tensor(0.5))
        return h


def test_custom_model_with_a_linear_called_twice(caplog):
    torch.manual_seed(0)
    model = _TwiceModel()
    calib = torch.randint(0, 32, (4, 8))
    shared_before = model.layers[0].shared.weight.detach().clone()
    report = _run(model, calib=calib, config=optq.QuantConfig(bits=4, group_size=-1))
    # the shared linear's Hessian covers both of its calls: 2 x tokens
    assert report.layers["layers.0.shared"].tokens == 2 * 32
    assert report.layers["layers.0.out"].tokens == 32
    assert set(report.skipped) == {"layers.0.unused", "layers.1.unused"}
    assert "never called" in caplog.text
    assert not torch.equal(model.layers[0].shared.weight, shared_before)


@pytest.mark.parametrize("method, strategy", [("gptaq", "replay"), ("gptq", "replay"), ("gptq", "pause")])
def test_a_failure_midway_leaves_no_threads_or_hooks(monkeypatch, method, strategy):
    before = threading.active_count()
    calls = []

    def fail_second(W, H, *args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        sol = optq.rtn(W, args[-1])  # GPTAQ's solve also takes the cross term, and returns its floor
        return (sol, W) if method == "gptaq" else sol

    owner, fn = (gptaq, "gptaq_with_floor") if method == "gptaq" else (solver, "gptq")
    monkeypatch.setattr(owner, fn, fail_second)
    model = build("llama")  # GPTAQ's hooks on the float twin are checked too
    with pytest.raises(KeyboardInterrupt):
        _run(model, method=method, strategy=strategy)
    assert len(calls) == 2
    assert threading.active_count() == before
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


class _Fragile(_TwiceBlock):
    """Fails inside its forward, after the first group, on the second calibration batch."""

    seen = 0

    def forward(self, h, scale=None):
        x = self.out(self.norm(h))
        type(self).seen += 1
        if type(self).seen > 2 + 1:  # discovery pass and batch 0 pass, then batch 1 fails
            raise ValueError("boom in the block")
        return h + self.shared(x)


def test_an_error_inside_a_paused_forward_reaches_the_caller():
    torch.manual_seed(0)
    model = _TwiceModel()
    model.layers = torch.nn.ModuleList([_Fragile(16) for _ in range(2)])
    before = threading.active_count()
    with pytest.raises(ValueError, match="boom in the block"):
        _run(model, calib=torch.randint(0, 32, (4, 8)), batch_size=1, config=optq.QuantConfig(bits=4, group_size=-1))
    assert threading.active_count() == before


@pytest.mark.parametrize("mode", ["inference_mode", "autocast"])
def test_pause_and_replay_agree_under_the_callers_torch_modes(mode):
    # Inference mode and autocast are per thread: the paused forwards (worker threads) must
    # run as the caller's thread would; and under autocast, casts of weights cached before
    # they were quantized must not be reused.
    results = []
    for strategy in ("pause", "replay"):
        model = build("llama")
        ctx = torch.inference_mode() if mode == "inference_mode" else torch.autocast("cpu", dtype=torch.bfloat16)
        with ctx:
            report = _run(model, strategy=strategy, batch_size=2, method="gptq")
        results.append(report)
    pause, replay = results
    for name in pause.solutions:
        assert torch.equal(pause.solutions[name].weight, replay.solutions[name].weight), name


def test_a_failure_while_starting_the_paused_forwards_leaves_nothing_behind(monkeypatch):
    real_start = threading.Thread.start
    started = []

    def start(self):
        started.append(self)
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    model = build("llama")
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        _run(model, strategy="pause", batch_size=1, method="gptq")
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert threading.active_count() == before
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
