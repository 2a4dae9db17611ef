"""GPTAQ's float twin (optq.pipeline.blocks.twin) costs one float block forward per block: its
children are replayed as soon as no later pass hooks a linear inside them, and its last pass runs
to the block's end in place of a separate pass for the float chain. Counted here with hooks on the
twin's linears, against the twin as it ran before (it mirrored the quantized block's passes), with
byte-identical weights."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from optq.pipeline.blocks import twin as twin_mod
from optq.pipeline.blocks.memo import Memo

pytest.importorskip("transformers")
from tiny import build, tokens  # noqa: E402
from tiny import run as _run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BATCHES = 2  # 6 windows in batches of 4 and 2


def _counting(monkeypatch) -> Counter:
    """Counts every completed forward of every linear of every twin, by the linear's name."""
    done: Counter = Counter()
    real = twin_mod.FloatTwin.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        for name, lin in self.linears.items():
            lin.register_forward_hook(lambda _m, _a, _o, name=name: done.update([name]))

    monkeypatch.setattr(twin_mod.FloatTwin, "__init__", init)
    return done


def _as_before(monkeypatch) -> None:
    """The twin as it was: its memo waits for the quantized block's children, and the float chain
    moves in a pass of its own after the block's last Hessian pass."""
    monkeypatch.setattr(twin_mod, "Memo", lambda *a, frozen=False: Memo(*a))
    real = twin_mod.FloatTwin.paired

    def paired(self, hessians, calls_per_forward=None, context=None, keep=None):
        return real(self, hessians, calls_per_forward, context, None)

    monkeypatch.setattr(twin_mod.FloatTwin, "paired", paired)


def _quantize(arch: str) -> dict[str, torch.Tensor]:
    model = build(arch)
    _run(model, calib=tokens(n=6, seqlen=16), method="gptaq", batch_size=4)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "arch, attention, mlp",
    [
        ("llama", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]),
        ("opt", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["fc1"]),
    ],
)
def test_every_twin_linear_runs_once_per_batch_with_the_same_weights(monkeypatch, arch, attention, mlp):
    with monkeypatch.context() as m:
        _as_before(m)
        before = _counting(m)
        want = _quantize(arch)
    now = _counting(monkeypatch)
    got = _quantize(arch)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    layers = [f"model.layers.{b}" if arch == "llama" else f"model.decoder.layers.{b}" for b in range(2)]
    assert set(now) == set(before) and len(now) == 2 * (len(attention) + len(mlp) + 2)
    # Now: every linear of every twin once per batch, one block forward.
    assert all(n == BATCHES for n in now.values()), now
    # Before: the attention's projections ran on the o pass and again on the pass after it; the
    # MLP's first linears on the last Hessian pass and again on the float chain's own pass.
    for p in layers:
        for name in attention + mlp:
            assert before[f"{p}.{name}"] == 2 * BATCHES, (name, before)
    assert sum(before.values()) > sum(now.values())


def test_a_frozen_memo_records_a_child_on_the_pass_that_hooks_its_last_target():
    block = torch.nn.Module()
    block.a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    block.b = torch.nn.Linear(4, 4)
    names = ["blk.a.0", "blk.a.1", "blk.b"]
    plain = Memo(block, "blk", names, names, names)
    frozen = Memo(block, "blk", names, names, names, frozen=True)
    for memo in (plain, frozen):
        memo.solved(["blk.a.0"])
        with memo.replay_pass(hooked=["blk.a.1"]) as at_batch:
            assert memo.finishing == ({"blk.a.1": block.a} if memo is frozen else {})
            at_batch(0)
            block.a(torch.ones(1, 4))
        assert memo.recorded == (["a"] if memo is frozen else [])
        memo.solved(["blk.a.1"])
    # The frozen memo replays it now (a pass hooking blk.b), and would run it for real on a
    # pass hooking one of its own linears.
    calls = Counter()
    block.a[0].register_forward_pre_hook(lambda *_: calls.update(["a.0"]))
    with frozen.replay_pass(hooked=["blk.b"]) as at_batch:
        at_batch(0)
        block.a(torch.ones(1, 4))
    with frozen.replay_pass(hooked=["blk.a.0"]) as at_batch:
        at_batch(0)
        block.a(torch.ones(1, 4))
    assert calls["a.0"] == 1
