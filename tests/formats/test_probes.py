"""``optq_probes.json``: the expected outputs written beside a checkpoint (optq.formats.probes).

The record is checked against an independent decode: the checkpoint's packed codes unpacked here
with plain integer arithmetic, the dequantized weights put into a plain transformers model, and
greedy decoding by full forwards (no KV cache)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import build, tokens

import optq
from optq.formats import probes
from optq.formats.loading import load
from optq.formats.qlinear import QuantLinear

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(60)]
CFG4 = optq.QuantConfig(bits=4, group_size=16)


def word_tokenizer(text: str):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> Path:
    """A tiny Llama with a word tokenizer, quantized at 4 bits by quantize_pretrained."""
    root = tmp_path_factory.mktemp("probes")
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(400))
    build("llama").save_pretrained(root / "model")
    word_tokenizer(text).save_pretrained(root / "model")
    optq.quantize_pretrained(root / "model", root / "q", tokens(n=6, seqlen=16), CFG4, method="rtn", progress=False)
    return root / "q"


def _dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each GPTQ v1 4-bit layer's weight rebuilt by hand:
    W[n, k] = scales[g_idx[k], n] * (code[k, n] - (stored zero[g, n] + 1))."""
    state = load_file(str(folder / "model.safetensors"))
    out = {}
    shifts = torch.arange(8, dtype=torch.int64) * 4
    for key, t in state.items():
        if key.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        if not key.endswith(".qweight"):
            out[key] = t.float()
            continue
        name = key[: -len(".qweight")]
        q = t.to(torch.int64) & 0xFFFFFFFF
        codes = ((q.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(-1, q.shape[1])  # [K, N]
        z = state[f"{name}.qzeros"].to(torch.int64) & 0xFFFFFFFF
        zeros = ((z.unsqueeze(2) >> shifts.view(1, 1, 8)) & 15).reshape(z.shape[0], -1) + 1  # [G, N]
        g = state[f"{name}.g_idx"].long()
        scales = state[f"{name}.scales"].float()
        out[f"{name}.weight"] = (scales[g] * (codes - zeros[g]).float()).t().contiguous()
    return out


def _independent(folder: Path, prompt_ids: list[int], n: int, k: int) -> tuple[list[int], list[list]]:
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config.quantization_config = None
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(_dequantized(folder), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    ids, steps = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            values, top = lp.topk(k)
            steps.append(list(zip(top.tolist(), values.tolist())))
            ids.append(int(top[0]))
    return ids[len(prompt_ids) :], steps


def test_probes_match_an_independent_decode(streamed: Path) -> None:
    record = json.loads((streamed / probes.PROBES_FILE).read_text())
    assert record["format"] == probes.FORMAT and record["top_k"] == probes.TOP_K
    assert record["produced_by"]["dtype"] == "float32" and record["produced_by"]["optq"] == optq.__version__
    assert [p["text"] for p in record["prompts"]] == list(probes.PROMPTS)
    tok = transformers.AutoTokenizer.from_pretrained(str(streamed))
    for p in record["prompts"]:
        assert p["prompt_ids"] == tok(p["text"])["input_ids"]
        want_tokens, want_steps = _independent(streamed, p["prompt_ids"], record["new_tokens"], record["top_k"])
        assert p["tokens"] == want_tokens
        for got, want in zip(p["top_logprobs"], want_steps):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert max(abs(a[1] - b[1]) for a, b in zip(got, want)) < 1e-4


def test_probes_are_deterministic(streamed: Path, tmp_path: Path) -> None:
    first = (streamed / probes.PROBES_FILE).read_bytes()
    probes.write(tmp_path, probes.record(streamed))
    assert (tmp_path / probes.PROBES_FILE).read_bytes() == first


def test_exact_path_is_the_reference_forward(streamed: Path) -> None:
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    pinned = probes.exact(load(streamed, embeddings="model"))
    per_call = load(streamed, embeddings="model")
    for m in per_call.modules():
        if isinstance(m, QuantLinear):
            m.use_fast_path = False
    with torch.no_grad():
        assert torch.equal(pinned(ids).logits, per_call(ids).logits)


def test_save_with_a_tokenizer_records_probes(streamed: Path, tmp_path: Path) -> None:
    model = build("llama")
    report = optq.quantize(model, tokens(n=6, seqlen=16), CFG4, method="rtn", progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(streamed))
    optq.save(model, tmp_path / "with", solutions=report.solutions, tokenizer=tok)
    optq.save(model, tmp_path / "without", solutions=report.solutions)
    assert not (tmp_path / "without" / probes.PROBES_FILE).exists()
    saved = probes.read(tmp_path / "with")
    assert saved == probes.record(tmp_path / "with")  # what the written files compute, read back
    assert [p["text"] for p in saved["prompts"]] == list(probes.PROMPTS)


def test_streamed_without_probes_and_with_given_prompts(tmp_path: Path, streamed: Path) -> None:
    src = streamed.parent / "model"
    optq.quantize_pretrained(
        src, tmp_path / "none", tokens(n=6, seqlen=16), CFG4, method="rtn", progress=False, probes=False
    )
    assert not (tmp_path / "none" / probes.PROBES_FILE).exists()
    optq.load(tmp_path / "none")  # loadable without it
    optq.quantize_pretrained(
        src, tmp_path / "two", tokens(n=6, seqlen=16), CFG4, method="rtn", progress=False, probes=["w1 w2", "w3"]
    )
    assert [p["text"] for p in probes.read(tmp_path / "two")["prompts"]] == ["w1 w2", "w3"]


@pytest.mark.parametrize(
    "content, why",
    [(b"", "no prompt"), (b"\n \n", "no prompt"), (b"\xff\xfe bad", "not UTF-8"), (b"p\n" * 65, "at most 64")],
)
def test_bad_prompt_files_are_refused_naming_the_file(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why) as err:
        probes.read_prompts(path)
    assert str(path) in str(err.value)


def test_prompt_file_one_prompt_per_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt \n\n  second\n")
    assert probes.read_prompts(path) == ["first prompt", "second"]


def test_exact_dequantizes_bit_for_bit_like_quantlinear(streamed: Path) -> None:
    from optq.formats.probes import _dequantize

    layers = [m for m in load(streamed, embeddings="model", fast_path=False).modules() if isinstance(m, QuantLinear)]
    assert layers and all(torch.equal(_dequantize(q), q.dequantize(torch.float32)) for q in layers)


def test_exact_dequantizes_asymmetric_act_order_3_bit_layers_alike(tmp_path: Path) -> None:
    from optq.formats.probes import _dequantize

    model = build("llama")
    config = optq.QuantConfig(bits=3, group_size=16, sym=False, act_order=True, static_groups=False)
    report = optq.quantize(model, tokens(n=6, seqlen=16), config, method="gptq", progress=False)
    optq.save(model, tmp_path / "q", solutions=report.solutions, format="gptq_v2")
    layers = [
        m for m in load(tmp_path / "q", embeddings="model", fast_path=False).modules() if isinstance(m, QuantLinear)
    ]
    assert any(not torch.equal(q.g_idx.long().sort().values, q.g_idx.long()) for q in layers)  # act-order: unsorted
    assert all(torch.equal(_dequantize(q), q.dequantize(torch.float32)) for q in layers)
