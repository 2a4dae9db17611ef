"""QuantLinear: buffers, dequantization, reference vs fast int4 path, replace_linears."""

from __future__ import annotations

import pytest
import torch
from formats.bounds import bf16_bound
from torch import nn

import optq
from optq.formats.qlinear import QuantLinear, replace_linears


def _solution(n: int, k: int, seed: int = 0, **cfg) -> optq.Solution:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, k, generator=g)
    X = torch.randn(4 * k, k, generator=g)
    H = optq.Hessian(k)
    H.update(X)
    return optq.gptq(W, H.matrix(), optq.QuantConfig(**cfg))


def test_buffers_are_exactly_the_format() -> None:
    sol = _solution(64, 96, bits=4, group_size=32)
    q = QuantLinear.from_solution(sol, bias=torch.randn(64))
    sd = q.state_dict()
    assert set(sd) == {"qweight", "qzeros", "scales", "g_idx", "bias"}
    assert sd["qweight"].shape == (96 * 4 // 32, 64) and sd["qweight"].dtype == torch.int32
    assert sd["qzeros"].shape == (3, 64 * 4 // 32) and sd["qzeros"].dtype == torch.int32
    assert sd["scales"].shape == (3, 64) and sd["scales"].dtype == torch.float16
    assert sd["g_idx"].dtype == torch.int32 and sd["bias"].dtype == torch.float16
    assert (sd["qzeros"] == 0x77777777).all()  # symmetric 4-bit v1
    q(torch.randn(2, 96))  # building the fast-path cache must not add state
    assert set(q.state_dict()) == set(sd)
    assert set(QuantLinear(96, 64, 4, 32).state_dict()) == {"qweight", "qzeros", "scales", "g_idx"}


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_dequantize_matches_solution_up_to_fp16_scales(bits: int, fmt: str) -> None:
    sol = _solution(32, 128, seed=bits, bits=bits, group_size=32, sym=fmt == "gptq")
    q = QuantLinear.from_solution(sol, checkpoint_format=fmt)
    assert torch.equal(q.codes().to(torch.uint8), sol.codes)  # codes survive fp16 scales
    assert torch.equal(q.zeros(), sol.zeros)
    rel = 2.0**-11  # float16 rounding of a scale
    tol = (sol.scales.abs().max() * rel * (1 << bits)).item()
    assert (q.dequantize() - sol.weight).abs().max().item() <= tol
    x = torch.randn(3, 128)
    ref = x @ sol.weight.T
    assert torch.allclose(q.forward_reference(x), ref, atol=tol * 128**0.5 * 4)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rows", [1, 3, 96])  # 1 and 3: the int4 kernel; 96: dequantize + matmul
@pytest.mark.parametrize("n", [48, 128])  # 128: prefill reads the packed planes; 48 (not 64k): the codes
@pytest.mark.parametrize(
    "k,group_size,act_order,static",
    [
        (576, 64, False, False),
        (256, -1, False, False),
        (256, 64, True, False),
        (256, 64, True, True),
        (128, 32, False, False),
    ],
)
def test_fast_path_equals_reference_to_bf16_precision(
    bits: int, rows: int, n: int, k: int, group_size: int, act_order: bool, static: bool
) -> None:
    sol = _solution(n, k, bits=bits, group_size=group_size, act_order=act_order, static_groups=static, sym=False)
    q = QuantLinear.from_solution(sol, bias=torch.randn(n), checkpoint_format="gptq_v2")
    x = torch.randn(rows, k)
    ref = q.forward_reference(x)
    fast = q(x)
    assert q.fast_weight is not None
    assert ((fast - ref).abs() <= bf16_bound(x, q, ref)).all(), (fast - ref).abs().max()
    assert ((fast - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(q(x.view(1, rows, k)), fast.view(1, rows, n))  # leading dims are flattened
    # fp32 compute (scalar kernels, exact layout check): agrees to float32 rounding
    q.fast_dtype = torch.float32
    assert torch.allclose(q(x), ref, atol=1e-4, rtol=1e-4)


class _MatmulDtypes(torch.overrides.TorchFunctionMode):
    """Records the operand dtypes of every ``@`` (matmul) called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("matmul", "__matmul__"):
            self.dtypes.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_prefill_on_a_cpu_without_bf16_units_multiplies_the_same_operands_in_float32(monkeypatch) -> None:
    from optq.formats import cpu_kernels

    sol = _solution(64, 256, bits=4, group_size=64)
    q = QuantLinear.from_solution(sol, checkpoint_format="gptq_v2")
    x = torch.randn(cpu_kernels.PREFILL_ROWS[4] + 3, 256)  # the prefill kernel: dequantize + matmul
    q(x)
    assert q.fast_weight is not None and q.fast_weight.perm is None
    dense = q.dense_weight(q.fast_weight)  # [256, 64] in bfloat16
    assert dense.dtype == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "BF16_MATMUL_NATIVE", False)  # an x86 CPU with AVX2 only
    emulated = q(x)
    with _MatmulDtypes() as seen:
        cpu_kernels.matmul(q.fast_weight, x, dense)
    assert seen.dtypes == [(torch.float32, torch.float32)]  # one product, in float32 (not bfloat16)
    monkeypatch.setattr(cpu_kernels, "BF16_MATMUL_NATIVE", True)
    with _MatmulDtypes() as seen:
        cpu_kernels.matmul(q.fast_weight, x, dense)
    assert seen.dtypes == [(torch.bfloat16, torch.bfloat16)]
    expected = (x.bfloat16().float() @ dense.float()).bfloat16().float()
    assert torch.equal(emulated, expected)
    ref = q.forward_reference(x)
    assert ((emulated - ref).abs() <= bf16_bound(x, q, ref)).all()


def test_fast_path_holds_half_a_byte_per_weight_below_8_bits() -> None:
    for bits, planes in ((2, 1), (3, 1), (4, 1), (8, 2)):
        q = QuantLinear.from_solution(_solution(64, 256, bits=bits, group_size=64))
        fast = q._fast_layout(torch.zeros(1, 256))
        assert fast is not None and len(fast.planes) == planes
        assert sum(p[0].numel() * p[0].element_size() for p in fast.planes) == planes * 64 * 256 // 2
        scales = (256 // fast.group) * 64 * 2 * 2  # S and M per kernel group and output, bfloat16
        assert fast.nbytes() == planes * 64 * 256 // 2 + scales * (1 if planes == 1 else 3)


@pytest.mark.parametrize("n,k,bits,group_size", [(40, 128, 4, 32), (48, 96, 4, 48), (48, 96, 3, 48)])
def test_fast_path_refused_when_layout_does_not_allow(n: int, k: int, bits: int, group_size: int) -> None:
    q = QuantLinear.from_solution(_solution(n, k, bits=bits, group_size=group_size))
    x = torch.randn(2, k)
    assert torch.equal(q(x), q.forward_reference(x))
    assert q.fast_weight is None


def test_fast_cache_follows_buffer_changes() -> None:
    a = QuantLinear.from_solution(_solution(32, 128, seed=1, bits=4, group_size=32))
    b = QuantLinear.from_solution(_solution(32, 128, seed=2, bits=4, group_size=32))
    x = torch.randn(2, 128)
    a(x)
    a.load_state_dict(b.state_dict())
    assert torch.allclose(a(x), b(x))


def test_replace_linears_llama_and_gpt2_conv1d() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from optq.formats.linears import find_linears, get_weight, set_weight

    for model in (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=64,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ),
        GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=64, n_layer=1, n_head=4, n_positions=32)),
    ):
        model.eval()
        cfg = optq.QuantConfig(bits=4, group_size=32)
        linears = {n: m for n, m in find_linears(model).items() if "lm_head" not in n}
        sols = {n: optq.rtn(get_weight(m).detach(), cfg) for n, m in linears.items()}
        for n, m in linears.items():
            set_weight(m, sols[n].weight)
            if m.bias is not None:  # the format stores biases in float16
                m.bias.data = m.bias.data.half().float()
        ids = torch.randint(0, 64, (1, 8))
        with torch.no_grad():
            ref = model(ids).logits
            replace_linears(model, sols)
            for m in model.modules():
                if isinstance(m, QuantLinear):
                    m.use_fast_path = False
            out = model(ids).logits
        assert sum(isinstance(m, QuantLinear) for m in model.modules()) == len(sols)
        assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()
    with pytest.raises(ValueError, match="shape"):
        replace_linears(nn.Sequential(nn.Linear(8, 4)), {"0": sols[next(iter(sols))]})


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_word_aligned_unpacking_matches_the_general_unpacker(bits: int) -> None:
    from optq.formats.cpu_kernels import unpack_codes
    from optq.formats.packing import pack_qweight, unpack_qweight

    codes = torch.randint(0, 1 << bits, (48, 96), generator=torch.Generator().manual_seed(bits))
    qweight = pack_qweight(codes, bits)
    assert torch.equal(unpack_codes(qweight, bits, 96), unpack_qweight(qweight, bits, 96))
    assert torch.equal(unpack_codes(qweight, bits, 96), codes.to(torch.int32))
    with pytest.raises(ValueError, match="straddle"):
        unpack_codes(pack_qweight(codes % 8, 3), 3, 96)


def test_build_fast_paths_builds_every_layer_and_counts_them() -> None:
    from optq.formats.fused import build_fast_paths

    model = nn.Sequential(
        QuantLinear.from_solution(_solution(32, 128, bits=4, group_size=32)),
        QuantLinear.from_solution(_solution(40, 128, bits=4, group_size=32)),  # 40 % 16: no kernel layout
    )
    assert all(m.fast_weight is None for m in model)
    assert build_fast_paths(model) == (1, 2)
    assert model[0].fast_weight is not None
    assert model[1].fast_weight is None
