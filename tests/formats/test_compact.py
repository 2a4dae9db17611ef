"""optq.load(embeddings=...): the embedding table and float head held in bfloat16 or int8."""

from __future__ import annotations

import pytest
import torch

import optq
from optq.formats.compact import CompactEmbedding, CompactHead, compact_embeddings
from optq.formats.linears import find_linears, get_weight
from optq.formats.qlinear import QuantLinear

tiny = pytest.importorskip("tiny")


def _saved(tmp_path, arch: str = "llama"):
    model = tiny.build(arch)
    cfg = optq.QuantConfig(bits=4, group_size=16)
    sols = {n: optq.rtn(get_weight(m).detach(), cfg) for n, m in find_linears(model).items() if ".layers." in n}
    optq.save(model, tmp_path / arch, solutions=sols)
    return tmp_path / arch


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", ["llama", "gemma3", "opt"])
def test_compact_tables_match_the_float_model_to_their_precision(tmp_path, arch):
    folder = _saved(tmp_path, arch)
    ids = tiny.tokens(n=2, seqlen=12)
    ref_model = optq.load(folder, embeddings="model")
    assert isinstance(optq.load(folder).get_input_embeddings(), CompactEmbedding)  # bfloat16 by default
    assert optq.load(folder).get_input_embeddings().weight.dtype == torch.bfloat16
    ref = _logits(ref_model, ids)
    embed_fp = ref_model.get_input_embeddings().weight.detach()
    tied = ref_model.get_output_embeddings().weight is ref_model.get_input_embeddings().weight
    for kind, bits in (("bfloat16", 8), ("int8", 7)):
        model = optq.load(folder, embeddings=kind)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(embed, CompactEmbedding) and isinstance(head, CompactHead)
        assert embed.weight.dtype == (torch.bfloat16 if kind == "bfloat16" else torch.int8)
        assert (head.table is embed.table) == tied  # a tied table is stored once
        # the lookups: each row within its storage's rounding (bf16: 2^-8 relative per value;
        # int8: half a step of |row max| / 127), scaled as the original embedding scales it
        rows = embed(ids).float()
        want = ref_model.get_input_embeddings()(ids)
        step = embed_fp.abs().amax(1)[ids].unsqueeze(-1) * (2.0**-8 if kind == "bfloat16" else 0.5 / 127)
        scale = float(getattr(ref_model.get_input_embeddings(), "embed_scale", 1.0))
        assert ((rows - want).abs() <= step * scale * 1.01 + 1e-6).all()
        assert not torch.equal(rows, want)  # the storage did change
        out = _logits(model, ids)
        rel = float((out - ref).norm() / ref.norm())
        assert rel < 2.0 ** -(bits - 2), (kind, rel)
        assert out.dtype == torch.float32


def test_int8_head_is_the_per_row_quantized_matmul():
    torch.manual_seed(0)
    head = torch.nn.Linear(48, 80, bias=False)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(80, 48)
    model.embed.weight = head.weight  # tied
    model.get_input_embeddings = lambda: model.embed
    model.get_output_embeddings = lambda: model.head
    model.head = head
    model.set_input_embeddings = lambda m: setattr(model, "embed", m)
    model.set_output_embeddings = lambda m: setattr(model, "head", m)
    W = head.weight.detach().clone()
    compact_embeddings(model, "int8")
    x = torch.randn(5, 48)
    scale = W.abs().amax(1) / 127
    Wq = torch.round(W / scale[:, None]).clamp(-127, 127) * scale[:, None]
    assert torch.equal(model.embed(torch.arange(80)), Wq)  # lookups: exactly the dequantized rows
    y = model.head(x)
    ref = x @ Wq.t()
    # bfloat16 activations and scales inside the kernel (unit roundoff 2^-8 each on every
    # product), and the result rounded to bfloat16 (2^-8 of |y|)
    bound = 2.0**-7 * (x.abs() @ Wq.abs().t()) * 1.01 + 2.0**-8 * ref.abs()
    assert ((y - ref).abs() <= bound).all()


class _Products(torch.overrides.TorchFunctionMode):
    """Records the operand dtypes of every matrix product (``@`` or ``F.linear``) called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("matmul", "__matmul__", "linear"):
            self.dtypes.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_bf16_head_on_a_cpu_without_bf16_units_multiplies_long_inputs_in_float32(monkeypatch):
    from optq.formats import compact, cpu_kernels

    torch.manual_seed(0)
    monkeypatch.setattr(compact, "_HEAD_SLICE", 32)  # 80 rows: slices of 32, 32, 16
    table = compact._Table(torch.randn(80, 48), "bfloat16")
    head = CompactHead(table)
    W = table.weight.float()
    monkeypatch.setattr(cpu_kernels, "BF16_MATMUL_NATIVE", False)  # an x86 CPU with AVX2 only
    for rows, want in (
        (compact.HEAD_FLOAT32_ROWS - 1, [(torch.bfloat16,) * 2]),
        (compact.HEAD_FLOAT32_ROWS, [(torch.float32,) * 2] * 3),
    ):
        x = torch.randn(rows, 48)
        with _Products() as seen:
            y = head(x)
        assert seen.dtypes == want, rows
        assert y.dtype == torch.float32 and y.shape == (rows, 80)
        # the same bfloat16 operands, the product rounded to bfloat16 (one rounding: 2^-8 of |y|)
        exact = x.bfloat16().float() @ W.t()
        assert ((y - exact).abs() <= 2.0**-8 * exact.abs() * 1.01 + 1e-6).all()
    monkeypatch.setattr(cpu_kernels, "BF16_MATMUL_NATIVE", True)
    with _Products() as seen:
        head(x)
    assert seen.dtypes == [(torch.bfloat16, torch.bfloat16)]  # native units: bfloat16 at any length


def test_quantized_head_and_bad_names():
    model = tiny.build("llama")
    cfg = optq.QuantConfig(bits=4, group_size=16)
    sols = {n: optq.rtn(get_weight(m).detach(), cfg) for n, m in find_linears(model).items()}
    from optq.formats.qlinear import replace_linears

    replace_linears(model, sols)  # the head too
    compact_embeddings(model, "bfloat16")
    assert isinstance(model.get_output_embeddings(), QuantLinear)
    assert isinstance(model.get_input_embeddings(), CompactEmbedding)
    with pytest.raises(ValueError, match="embeddings='fp8'"):
        compact_embeddings(model, "fp8")
    with pytest.raises(ValueError, match="embeddings='half'"):
        optq.load("/nonexistent", embeddings="half")
