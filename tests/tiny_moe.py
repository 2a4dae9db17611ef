"""Tiny randomly initialised mixture-of-experts causal LMs, built in the tests (no download):
Mixtral, Qwen2-MoE (shared expert + shared_expert_gate), Qwen3-MoE, DeepSeek-V3 (a dense first
layer, shared + routed experts, MLA attention), GPT-OSS (transposed experts with biases, gate and
up interleaved, a clamped SwiGLU; a biased ``mlp.router``), and a custom Llama whose MLPs are top-1
``nn.ModuleList`` experts where one expert is routed only the marked token and one never; and
the quantize call the MoE pipeline tests share."""

from __future__ import annotations

import re

import pytest
import torch
from tiny import CFG
from torch import nn

import optq
from optq.formats.experts import unfuse_experts
from optq.formats.linears import find_linears

transformers = pytest.importorskip("transformers")

VOCAB = 96
MARK = VOCAB - 1  # the token that alone routes to the custom model's expert MARKED
EXPERTS = 4
MARKED, NEVER = 2, 3  # the custom model's experts: routed only MARK, and never routed

FUSED = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]
ALL = [*FUSED, "custom"]


def _config(arch: str):
    t = transformers
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_hidden_layers=2,
    )
    if arch == "mixtral":
        return t.MixtralConfig(intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=2, **common)
    if arch == "qwen2_moe":
        return t.Qwen2MoeConfig(
            intermediate_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            **common,
        )
    if arch == "qwen3_moe":
        return t.Qwen3MoeConfig(
            intermediate_size=32,
            moe_intermediate_size=16,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            head_dim=8,
            **common,
        )
    if arch == "deepseek_v3":
        return t.DeepseekV3Config(
            intermediate_size=32,
            moe_intermediate_size=16,
            n_routed_experts=EXPERTS,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **{**common, "num_key_value_heads": 4},
        )
    if arch == "gpt_oss":
        return t.GptOssConfig(
            intermediate_size=16,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
            # no YaRN: its factor does not fit a 64-position model (transformers warns)
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
            **common,
        )
    if arch == "custom":
        return t.LlamaConfig(intermediate_size=16, **common)
    raise KeyError(arch)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Top1MoE(nn.Module):
    """Top-1 routing over an ``nn.ModuleList`` of experts (as older or custom MoE code does).

    The router favours expert MARKED only for hidden states whose first feature is large (the
    marked token's embedding makes it so) and never picks expert NEVER."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, EXPERTS, bias=True)
        self.experts = nn.ModuleList(Expert(hidden, inter) for _ in range(EXPERTS))
        with torch.no_grad():
            self.gate.weight.mul_(0.1)
            self.gate.weight[MARKED] = 0.0
            self.gate.weight[MARKED, 0] = 10.0
            self.gate.bias.zero_()
            self.gate.bias[MARKED] = -30.0
            self.gate.bias[NEVER] = -1e4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.gate(flat).softmax(dim=-1)
        weight, idx = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            sel = (idx == e).nonzero().squeeze(1)
            if sel.numel():
                out.index_add_(0, sel, expert(flat[sel]) * weight[sel, None])
        return out.reshape(shape)


def build(arch: str, seed: int = 0) -> nn.Module:
    """A tiny random MoE causal LM (fp32, eval mode)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch))
    if arch == "custom":
        cfg = model.config
        for layer in model.model.layers:
            layer.mlp = Top1MoE(cfg.hidden_size, cfg.intermediate_size)
        with torch.no_grad():  # the marked token: a large first feature that survives the norms
            model.model.embed_tokens.weight[MARK] = 0.0
            model.model.embed_tokens.weight[MARK, 0] = 50.0
    if arch == "gpt_oss":  # biases and sinks that count (the router's stays small: tokens pick experts)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("bias", "sinks")) and ".router." not in name:
                    p.normal_(0.0, 0.02)  # as the weights: hidden states still vary by token
    return model.float().eval()


def tokens(n: int = 6, seqlen: int = 16, seed: int = 1, mark_last: bool = True) -> torch.Tensor:
    """Random calibration ids [n, seqlen] without MARK, except (``mark_last``) in the last sample."""
    ids = torch.randint(0, MARK, (n, seqlen), generator=torch.Generator().manual_seed(seed))
    if mark_last:
        ids[-1, seqlen // 2] = MARK
    return ids


def quantize(arch: str, ids: torch.Tensor | None = None, **kw):
    """A tiny ``arch`` model quantized at ``CFG`` (on 16 x 32 ``tokens`` unless ``ids``, batches of
    4, no progress bars) with GPTQ unless ``method`` says otherwise: (model, report, its weights
    before, under the quantized names). The routed, starved and weighted Hessians and the custom
    ModuleList experts tested with it are GPTQ's (GPTAQ, the default method, refuses routed
    calibration and experts in a model's own code; its MoE runs: tests/pipeline/test_gptaq_*.py)."""
    model = build(arch)
    unfuse_experts(model)  # as quantize does first, so the original weights have the same names
    original = {k: v.clone() for k, v in model.state_dict().items()}
    kw.setdefault("progress", False)
    kw.setdefault("batch_size", 4)
    kw.setdefault("method", "gptq")
    report = optq.quantize(model, tokens(n=16, seqlen=32) if ids is None else ids, CFG, **kw)
    return model, report, original


def expert_linears(model) -> dict[str, nn.Module]:
    """The model's expert linears (``....experts.<e>.<leaf>``) by name."""
    return {n: m for n, m in find_linears(model).items() if re.search(r"\.experts\.\d+\.", n)}
