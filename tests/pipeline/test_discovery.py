"""Discovery of blocks and linears, name selection, and the capture of block inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optq.formats.linears import find_linears, get_weight, set_weight
from optq.pipeline.blocks import capture
from optq.pipeline.discovery import find_blocks, select_names

transformers = pytest.importorskip("transformers")
from tiny import ARCHS, build, tokens  # noqa: E402

EXPECTED_BLOCKS = {"gpt2": "transformer.h", "opt": "model.decoder.layers"}


@pytest.mark.parametrize("arch", ARCHS)
def test_find_blocks_and_linears(arch):
    model = build(arch)
    name, blocks = find_blocks(model)
    assert name == EXPECTED_BLOCKS.get(arch, "model.layers")
    assert len(blocks) == 2
    linears = find_linears(blocks[0], f"{name}.0")
    # every linear of the block, none of the embeddings or the head
    expected = {m for m in blocks[0].modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
    assert set(linears.values()) == expected and len(expected) >= 4
    assert all(n.startswith(f"{name}.0.") for n in linears)


def test_conv1d_weight_is_transposed_both_ways():
    model = build("gpt2")
    c_fc = model.transformer.h[0].mlp.c_fc
    assert type(c_fc).__name__ == "Conv1D"
    w = get_weight(c_fc)
    assert tuple(w.shape) == (c_fc.nf, c_fc.weight.shape[0])  # [out, in]
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(c_fc(x), x @ w.T + c_fc.bias)
    new = torch.randn_like(w)
    set_weight(c_fc, new)
    assert torch.equal(get_weight(c_fc), new)


def test_find_blocks_errors_on_models_without_blocks():
    with pytest.raises(ValueError, match="no decoder blocks"):
        find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    # a ModuleList of blocks without any linear layer is not a decoder
    with pytest.raises(ValueError, match="no decoder blocks"):
        find_blocks(nn.ModuleList([nn.LayerNorm(4) for _ in range(3)]))


def test_find_blocks_prefers_longest_list_of_identical_blocks():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(3)])
            self.mixed = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)), nn.ReLU(), nn.ReLU(), nn.ReLU()])

    name, blocks = find_blocks(Net())
    assert name == "layers" and len(blocks) == 3


NAMES = [
    "m.layers.0.attn.q_proj",
    "m.layers.0.attn.k_proj",
    "m.layers.0.mlp.down_proj",
    "m.layers.1.attn.q_proj",
    "m.layers.1.mlp.down_proj",
]


def test_select_names_patterns():
    assert select_names(NAMES) == NAMES
    assert select_names(NAMES, include="q_proj") == [NAMES[0], NAMES[3]]
    assert select_names(NAMES, include=["*.mlp.*"]) == [NAMES[2], NAMES[4]]
    assert select_names(NAMES, exclude="re:layers\\.0\\.") == NAMES[3:]
    assert select_names(NAMES, include="*.attn.*", exclude="k_proj") == [NAMES[0], NAMES[3]]


@pytest.mark.parametrize("bad", ["qproj", "re:nothing_here", "re:("])
def test_select_names_rejects_patterns_matching_nothing(bad):
    with pytest.raises(ValueError, match="pattern"):
        select_names(NAMES, include=bad)


def _last_block_output(model, blocks, ids):
    seen = []
    handle = blocks[-1].register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    out = seen[0]
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_captured_inputs_reproduces_the_model(arch):
    model = build(arch)
    _, blocks = find_blocks(model)
    ids = tokens(n=4, seqlen=16)
    batches = [ids[:3], ids[3:]]  # unequal batches on purpose
    with torch.no_grad():
        hidden, calls = capture.capture_inputs(model, blocks, batches, torch.device("cpu"))
        assert len(hidden) == 2 and all(len(c) == 2 for c in calls)
        for i, block in enumerate(blocks):
            hidden = [capture.run_block(block, h, c) for h, c in zip(hidden, calls[i])]
    expected = _last_block_output(model, blocks, ids)
    torch.testing.assert_close(torch.cat(hidden), expected, rtol=1e-5, atol=1e-5)


def test_gemma3_blocks_get_their_own_masks():
    # Replaying block 1 (full attention) with block 0's arguments (sliding window) must differ,
    # otherwise the per-block capture above proves nothing for Gemma 3.
    model = build("gemma3")
    _, blocks = find_blocks(model)
    with torch.no_grad():
        hidden, calls = capture.capture_inputs(model, blocks, [tokens(seqlen=16)], torch.device("cpu"))
        right = capture.run_block(blocks[1], hidden[0], calls[1][0])
        wrong = capture.run_block(blocks[1], hidden[0], calls[0][0])
    assert not torch.allclose(right, wrong, atol=1e-4)


def test_capture_leaves_the_model_as_it_was():
    model = build("llama")
    _, blocks = find_blocks(model)
    ids = tokens()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        capture.capture_inputs(model, blocks, [ids], torch.device("cpu"))
        after = model(input_ids=ids).logits
    assert all("forward" not in b.__dict__ for b in blocks)
    assert torch.equal(before, after)


SUBSETS = {
    "llama": [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ],
    "gpt2": [["attn.c_attn"], ["attn.c_proj"], ["mlp.c_fc"], ["mlp.c_proj"]],
    "opt": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.out_proj"], ["fc1"], ["fc2"]],
    # Phi runs attention and MLP in parallel on one normalised input.
    "phi": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"], ["self_attn.dense"], ["mlp.fc2"]],
}


@pytest.mark.parametrize("arch", sorted(SUBSETS))
def test_subsets_group_linears_by_shared_input(arch):
    model = build(arch)
    name, blocks = find_blocks(model)
    linears = find_linears(blocks[0], f"{name}.0")
    with torch.no_grad():
        hidden, calls = capture.capture_inputs(model, blocks, [tokens()], torch.device("cpu"))
        plan = capture.discover_subsets(blocks[0], linears, list(linears), hidden[0], calls[0][0])
    got = [[n[len(name) + 3 :] for n in s] for s in plan.subsets]
    assert got == SUBSETS[arch]
    assert plan.unused == [] and plan.repeated == [] and set(plan.order) == set(linears)
