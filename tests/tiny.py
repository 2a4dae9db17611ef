"""Tiny randomly initialised causal LMs of several architectures, built in the tests (no
download), and the calibration tokens and quantize call the pipeline tests share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import optq

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _config(arch: str):
    t = transformers
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64)
    if arch in ("llama", "mistral", "qwen2"):
        cls = {"llama": t.LlamaConfig, "mistral": t.MistralConfig, "qwen2": t.Qwen2Config}[arch]
        return cls(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, **common)
    if arch == "gemma3":
        # Sliding window shorter than the calibration windows, and one layer of each kind, so
        # the two blocks receive different masks and rotary tables.
        return t.Gemma3TextConfig(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    if arch == "gpt2":
        return t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    if arch == "opt":
        return t.OPTConfig(hidden_size=32, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32, **common)
    if arch == "phi":
        return t.PhiConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, **common)
    raise KeyError(arch)


ARCHS = ["llama", "mistral", "qwen2", "gemma3", "gpt2", "opt", "phi"]


def build(arch: str, seed: int = 0) -> nn.Module:
    """A tiny randomly initialised causal LM of the given architecture (no download)."""
    torch.manual_seed(seed)
    cfg = _config(arch)
    if arch == "gemma3":
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.float().eval()


def llama(
    *, hidden: int = 32, inter: int = 64, heads: int = 4, kv: int = 2, layers: int = 2, seed: int = 0
) -> nn.Module:
    """A tiny randomly initialised Llama of chosen widths (``build("llama")`` is the default one)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def tokens(n: int = 4, seqlen: int = 16, seed: int = 1) -> torch.Tensor:
    """Random calibration token ids [n, seqlen]."""
    return torch.randint(0, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


CFG = optq.QuantConfig(bits=3, group_size=16)


def run(model: nn.Module, **kw):
    """``optq.quantize`` on 6 x 16 random tokens at 3 bits, group 16, without progress bars."""
    kw.setdefault("progress", False)
    return optq.quantize(model, kw.pop("calib", tokens(n=6, seqlen=16)), kw.pop("config", CFG), **kw)


def _codes_on_grid(name: str, weight: torch.Tensor, scale: torch.Tensor, bits: int, tol: float) -> torch.Tensor:
    """The integer codes q of weight = scale·(q - 2^(bits-1)) (``scale`` per column, [rows, cols]),
    checked: every weight within ``tol`` grid steps of one, every q in [0, 2^bits - 1]."""
    q = weight.double() / scale + 2 ** (bits - 1)
    codes = q.round()
    off = float((q - codes).abs().max())
    assert off < tol, f"{name}: a weight lies {off:.3g} grid steps off its grid"
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2**bits - 1, name
    return codes


def _natural_symmetric(name: str, sol, gidx: torch.Tensor, bits: int) -> None:
    """The solution's groups are the natural ones (static groups) and its zeros the symmetric one."""
    assert torch.equal(sol.g_idx.long(), gidx), name
    assert torch.equal(sol.zeros.long(), torch.full_like(sol.zeros.long(), 2 ** (bits - 1))), name


def assert_on_own_grid(name: str, weight: torch.Tensor, sol, bits: int, group_size: int, tol: float = 1e-4) -> None:
    """Check a quantized weight against the symmetric grid its solution names (GPTAQ, the default
    method, fits each static group's grid to its corrected weights, which the test cannot
    recompute): every weight is scale·(q - zero) with q an integer in [0, 2^bits - 1], the zero
    2^(bits-1), the groups the natural ones (static groups), and q the solution's codes."""
    gidx = torch.arange(weight.shape[1]) // group_size
    _natural_symmetric(name, sol, gidx, bits)
    codes = _codes_on_grid(name, weight, sol.scales.double()[:, gidx], bits, tol)
    assert torch.equal(sol.codes.long(), codes.long()), name


def assert_on_static_grid(
    name: str, original: torch.Tensor, weight: torch.Tensor, sol, bits: int, group_size: int, tol: float = 1e-4
) -> None:
    """Check a quantized weight against a symmetric grid computed here, independently of the
    library, from the ORIGINAL weight: with static groups each group's grid is fitted up front,
    so scale = 2·absmax/maxq over the row's group of original columns and zero = 2^(bits-1).

    Every weight must be scale·(q - zero) for an integer q in [0, maxq] (w/scale + zero within
    ``tol`` of an integer), and the solution's scales, zeros, codes and g_idx must be these.
    """
    w0 = original.double()
    gidx = torch.arange(w0.shape[1]) // group_size
    groups = int(gidx.max()) + 1
    absmax = torch.stack([w0[:, g * group_size : (g + 1) * group_size].abs().amax(1) for g in range(groups)], 1)
    assert bool((absmax > 0).all()), name
    scale = 2 * absmax / (2**bits - 1)  # [rows, groups]
    codes = _codes_on_grid(name, weight, scale[:, gidx], bits, tol)
    _natural_symmetric(name, sol, gidx, bits)
    torch.testing.assert_close(sol.scales.double(), scale, rtol=1e-6, atol=0, msg=name)
    assert torch.equal(sol.codes.long(), codes.long()), name


def stack_head(model: nn.Module, W: torch.Tensor) -> str:
    """The one linear of ``model`` whose (still unquantized) weight heads a stacked group weight
    ``W`` the pipeline hands its solver: same input width, W's first rows equal to its weight."""
    heads = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and m.weight.shape[1] == W.shape[1]
        and torch.equal(m.weight, W[: m.weight.shape[0]])
    ]
    assert len(heads) == 1, heads
    return heads[0]
