"""What keeps quantization lean: replayed children, early-stopping replays, codes held once."""

from __future__ import annotations

import pytest
import torch

import optq
from optq.core import memory, solver
from optq.formats.linears import find_linears
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.memo import Memo

pytest.importorskip("transformers")
from tiny import build, tokens  # noqa: E402
from tiny import run as _run  # noqa: E402


def _count_calls(module, counter, key):
    def hook(_m, _args, _out):
        counter[key] = counter.get(key, 0) + 1

    return module.register_forward_hook(hook)


def _both_strategies(make_model, **kw):
    """Quantize a fresh ``make_model()`` with strategy pause, then replay: (models, reports).
    GPTQ: GPTAQ (the default method) always replays."""
    models, reports = [], []
    for strategy in ("pause", "replay"):
        models.append(make_model())
        reports.append(_run(models[-1], strategy=strategy, batch_size=2, method="gptq", **kw))
    return models, reports


def _assert_same_weights(a, b):
    assert set(a.solutions) == set(b.solutions)
    for name in a.solutions:
        assert torch.equal(a.solutions[name].weight, b.solutions[name].weight), name


def test_replay_reuses_the_finished_attention_and_matches_pause():
    a, b = build("llama"), build("llama")
    counts: dict[str, int] = {}
    handles = [_count_calls(blk.self_attn.q_proj, counts, i) for i, blk in enumerate(b.model.layers)]
    calib = tokens(n=6, seqlen=16)
    ra = _run(a, calib=calib, strategy="pause", batch_size=2, method="gptq")  # GPTAQ never pauses
    rb = _run(b, calib=calib, strategy="replay", batch_size=2, method="gptq")
    for h in handles:
        h.remove()
    _assert_same_weights(ra, rb)
    # Per block, 3 batches: one discovery forward, then q_proj runs in the o_proj pass and in
    # the gate/up pass (which records the attention's output); the down_proj pass and the final
    # pass replay the recorded output instead. Without the memo it would run 1 + 3 x 4 times.
    # (Block 0 also runs once while the inputs are captured.)
    assert counts == {0: 1 + 1 + 3 * 2, 1: 1 + 3 * 2}


class _InPlaceBlock(torch.nn.Module):
    """Modifies its attention-like child's output in place; a memo must hand out copies."""

    def __init__(self, d):
        super().__init__()
        self.attn = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, d))
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, h):
        a = self.attn(h)
        a.mul_(0.5)  # in place on the child's output
        x = h + a
        return x + self.down(torch.relu(self.up(x)))


class _Model(torch.nn.Module):
    def __init__(self, block, d=16, vocab=32, n=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([block(d) for _ in range(n)])

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h


def _seeded(cls, *args, **kw):
    torch.manual_seed(0)
    return cls(*args, **kw)


def test_memo_hands_out_copies_to_blocks_that_write_in_place():
    calib = torch.randint(0, 32, (6, 8), generator=torch.Generator().manual_seed(0))
    (pause_model, replay_model), (pause, replay) = _both_strategies(
        lambda: _seeded(_Model, _InPlaceBlock), calib=calib, config=optq.QuantConfig(bits=4, group_size=-1)
    )
    _assert_same_weights(pause, replay)
    assert torch.equal(pause_model(calib), replay_model(calib))


def test_memo_records_only_finished_children_called_once():
    block = torch.nn.Module()
    block.a = torch.nn.Linear(4, 4)
    block.b = torch.nn.Linear(4, 4)
    order = ["blk.a", "blk.b", "blk.b"]  # b runs twice per forward: never a candidate
    memo = Memo(block, "blk", ["blk.a", "blk.b"], order, ["blk.a", "blk.b"])
    assert [c.name for c in memo.children] == ["a"]
    with memo.replay_pass() as at_batch:  # a is not solved yet: nothing is recorded
        at_batch(0)
        block.a(torch.ones(1, 4))
    assert memo.recorded == []
    memo.solved(["blk.a"])
    x = torch.randn(2, 4)
    with memo.replay_pass() as at_batch:
        for b in range(2):
            at_batch(b)
            expected = block.a(x[b : b + 1])
    assert memo.recorded == ["a"]
    with torch.no_grad():
        block.a.weight.zero_()  # a replayed child is not recomputed
    with memo.replay_pass(last=True) as at_batch:
        at_batch(1)
        assert torch.equal(block.a(x[1:2]), expected)
    assert memo.recorded == [] and "forward" not in block.a.__dict__


def test_an_incomplete_recording_is_dropped():
    block = torch.nn.Module()
    block.a = torch.nn.Linear(4, 4)
    memo = Memo(block, "blk", ["blk.a"], ["blk.a"], [])
    with memo.replay_pass() as at_batch:
        at_batch(0)
        block.a(torch.ones(1, 4))
        at_batch(1)  # batch 1 never reaches the child (e.g. a replay stopped before it)
    assert memo.recorded == []


def test_replays_stop_right_after_the_groups_input():
    model = build("llama")
    blk = model.model.layers[0]
    linears = find_linears(blk, "b")
    calib = tokens(n=2, seqlen=8)
    hidden, calls = capture.capture_inputs(model, model.model.layers, [calib], torch.device("cpu"))
    plan = capture.discover_subsets(blk, linears, list(linears), hidden[0], calls[0][0])
    ran: dict[str, int] = {}
    handles = [_count_calls(m, ran, n) for n, m in linears.items()]
    hess = optq.Hessian(blk.mlp.down_proj.in_features)
    with torch.no_grad():
        capture.collect_hessian(
            blk,
            linears,
            ["b.mlp.gate_proj", "b.mlp.up_proj"],
            plan.order,
            hidden,
            calls[0],
            optq.Hessian(blk.mlp.gate_proj.in_features),
        )
        assert "b.mlp.gate_proj" not in ran and "b.mlp.up_proj" not in ran  # stopped at the input
        assert ran["b.self_attn.o_proj"] == 1
        capture.collect_hessian(blk, linears, ["b.mlp.down_proj"], plan.order, hidden, calls[0], hess)
    for h in handles:
        h.remove()
    assert "b.mlp.down_proj" not in ran and ran["b.mlp.up_proj"] == 1
    assert hess.count == 2 * 8


def test_pipeline_solutions_recompute_their_codes_exactly(monkeypatch):
    # The solver's own codes, copied before the pipeline slices the stacked solutions per layer
    # and drops their codes: what a checkpoint gets must be these, not codes re-derived from a
    # weight that might have drifted off them.
    solved = []
    real = solver.gptq

    def keep_codes(W, H, config):
        sol = real(W, H, config)
        solved.append((W.shape[0], sol.codes.clone(), sol.weight.clone()))
        return sol

    monkeypatch.setattr(solver, "gptq", keep_codes)
    model = build("llama")
    fresh = real(torch.randn(8, 64), torch.eye(64), optq.QuantConfig(bits=4, group_size=16))
    assert fresh.__dict__["_codes"] is not None  # a direct solve keeps its codes
    report = _run(model, config=optq.QuantConfig(bits=4, group_size=16), method="gptq")
    names = list(report.solutions)  # in solve order; a group's layers are its stacked rows
    assert len(solved) == 8
    for rows, codes, weight in solved:
        row = 0
        while row < rows:
            name = names.pop(0)
            sol = report.solutions[name]
            n = sol.weight.shape[0]
            assert torch.equal(sol.weight, weight[row : row + n]), name  # the rows are this layer's
            assert sol.__dict__["_codes"] is None, name  # the pipeline holds no second copy
            assert sol.codes.dtype == torch.uint8
            assert torch.equal(sol.codes, codes[row : row + n]), name
            row += n
        assert row == rows
    assert names == []


def test_drop_codes_refuses_when_the_weight_no_longer_matches():
    sol = optq.gptq(torch.randn(8, 64), torch.eye(64), optq.QuantConfig(bits=4, group_size=16))
    codes = sol.codes.clone()
    sol.weight = sol.weight.clone()
    sol.weight[0, 0] += sol.scales[0, 0]  # one step up the grid: no longer the solver's code
    assert not sol.drop_codes()
    assert torch.equal(sol.codes, codes)  # kept, unchanged
    sol.weight[0, 0] -= sol.scales[0, 0]
    assert sol.drop_codes() and torch.equal(sol.codes, codes)


def test_releaser_is_a_noop_off_cpu():
    assert memory.releaser("meta")() is None
    memory.releaser("cpu")()  # trims, or does nothing where there is no glibc


class _EmbBlock(torch.nn.Module):
    """Reads the model's embeddings on every layer (passed as a keyword, as Zamba does)."""

    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, d)
        self.gate = torch.nn.Linear(d, d)

    def forward(self, h, emb=None):
        return h + self.fc(self.norm(h)) + self.gate(emb)


class _EmbModel(_Model):
    def forward(self, input_ids):
        e = self.emb(input_ids)
        h = e
        for layer in self.layers:
            h = layer(h, emb=e)
        return h


def test_block_outputs_never_overwrite_tensors_the_model_passes_on():
    # The first block's input IS the embeddings tensor also passed to every block as `emb`:
    # block outputs must never be written into a tensor the model still holds.
    calib = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    _, (pause, replay) = _both_strategies(
        lambda: _seeded(_EmbModel, _EmbBlock, n=3), calib=calib, config=optq.QuantConfig(bits=4, group_size=-1)
    )
    _assert_same_weights(pause, replay)


def test_a_childs_own_forward_hooks_run_once_when_its_output_is_replayed():
    def hooked():
        model = build("llama")
        for layer in model.model.layers:  # e.g. a steering hook rescaling the attention output
            layer.self_attn.register_forward_hook(lambda m, a, out: (out[0] * 0.5,) + tuple(out[1:]))
        return model

    _, (pause, replay) = _both_strategies(hooked)
    _assert_same_weights(pause, replay)


def test_dropped_codes_refuse_to_follow_a_modified_model():
    model = build("llama")
    report = _run(model, config=optq.QuantConfig(bits=4, group_size=16), method="gptq")
    name = next(iter(report.solutions))
    codes = report.solutions[name].codes.clone()
    model.load_state_dict(build("llama", seed=1).state_dict())  # the model changes in place
    with pytest.raises(RuntimeError, match="modified in place"):
        _ = report.solutions[name].codes  # the read raises: dropped codes would come from the changed weight
    assert codes.dtype == torch.uint8
