"""What the vLLM tests compare against: optq's exact reference path (``optq.load`` in float32,
every QuantLinear on its dequantize forward, float embeddings), decoded greedily with the top
log-probabilities of each step, and the comparison of two such decodings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import optq
from optq.formats.qlinear import QuantLinear


def reference(folder: str | Path, prompts: list[list[int]], max_new_tokens: int, top_k: int) -> list[dict]:
    """Greedy decoding by optq's exact path: per prompt ``{"tokens", "logprobs", "gaps"}`` (gaps:
    each step's top-two log-probability gap)."""
    model = optq.load(folder, dtype=torch.float32, embeddings="model")
    for m in model.modules():
        if isinstance(m, QuantLinear):  # forward_reference's numbers, the weight dequantized once
            weight, bias = m.dequantize(torch.float32), None if m.bias is None else m.bias.float()
            m.forward = lambda x, w=weight, b=bias: torch.nn.functional.linear(x, w, b)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            step = model(torch.tensor([prompt]), use_cache=True)
            tokens, logprobs, gaps = [], [], []
            for _ in range(max_new_tokens):
                top = torch.log_softmax(step.logits[0, -1].float(), -1).topk(top_k)
                tokens.append(int(top.indices[0]))
                logprobs.append({int(i): float(v) for i, v in zip(top.indices, top.values)})
                gaps.append(float(top.values[0] - top.values[1]))
                step = model(top.indices[:1].view(1, 1), past_key_values=step.past_key_values, use_cache=True)
            out.append({"tokens": tokens, "logprobs": logprobs, "gaps": gaps})
    return out


@dataclass
class Agreement:
    """How far an engine's greedy decoding follows the reference: ``steps`` compared (up to the
    first step where the tokens differ, which must be a near-tie), the largest and mean absolute
    log-probability difference over the tokens both top-k lists hold on those steps, and the
    steps where the tokens differed at a gap above ``tie`` (must be empty)."""

    steps: int
    max_diff: float
    mean_diff: float
    disagreements: list[str]


def agree(engine: list[dict], ref: list[dict], tie: float) -> Agreement:
    """Compare ``engine``'s outputs with :func:`reference`'s, prompt by prompt."""
    diffs, steps, bad = [], 0, []
    for p, (e, r) in enumerate(zip(engine, ref, strict=True)):
        for s, (te, tr) in enumerate(zip(e["tokens"], r["tokens"])):
            common = set(e["logprobs"][s]) & set(r["logprobs"][s])
            diffs += [abs(e["logprobs"][s][t] - r["logprobs"][s][t]) for t in common]
            steps += 1
            if te != tr:
                if r["gaps"][s] >= tie:
                    bad.append(f"prompt {p} step {s}: {te} != {tr} (reference gap {r['gaps'][s]:.3f})")
                break
    return Agreement(steps, max(diffs, default=0.0), sum(diffs) / max(len(diffs), 1), bad)
