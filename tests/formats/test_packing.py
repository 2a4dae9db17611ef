"""Bit packing: exact round trips, the spec's word layouts, both zero-point conventions."""

from __future__ import annotations

import pytest
import torch

from optq.formats.packing import pack, pack_qweight, pack_qzeros, packed_length, unpack, unpack_qweight, unpack_qzeros

BITS = (2, 3, 4, 8)


def _u32(x: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFFFFFF for v in x.flatten().tolist()]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape,dim", [((64, 7), 0), ((5, 96), 1), ((33, 3), 0), ((1, 13), 1)])
def test_round_trip_random_codes(bits: int, shape: tuple[int, int], dim: int) -> None:
    g = torch.Generator().manual_seed(bits * 100 + shape[0])
    codes = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.int64)
    packed = pack(codes, bits, dim)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == packed_length(shape[dim], bits)
    assert packed.shape[1 - dim] == shape[1 - dim]
    assert torch.equal(unpack(packed, bits, shape[dim], dim).long(), codes)


@pytest.mark.parametrize("bits", BITS)
def test_extreme_codes_use_every_bit(bits: int) -> None:
    # All-ones codes set every bit of a full block: the sign bit of int32 must survive.
    maxq = (1 << bits) - 1
    codes = torch.full((32, 2), maxq)
    packed = pack(codes, bits, 0)
    assert all(v == 0xFFFFFFFF for v in _u32(packed))
    assert torch.equal(unpack(packed, bits, 32, 0), codes.int())


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_aligned_layout_lowest_bits_first(bits: int) -> None:
    pf = 32 // bits
    codes = torch.arange(pf) % (1 << bits)
    expected = sum(int(codes[j]) << (bits * j) for j in range(pf))
    assert _u32(pack(codes.unsqueeze(1), bits, 0)) == [expected]


def test_three_bit_layout_matches_spec_word_by_word() -> None:
    v = [(7 * i + 3) % 8 for i in range(32)]
    w0 = sum(v[i] << (3 * i) for i in range(10)) | ((v[10] & 0b11) << 30)
    w1 = (v[10] >> 2) | sum(v[11 + i] << (1 + 3 * i) for i in range(10)) | ((v[21] & 1) << 31)
    w2 = (v[21] >> 1) | sum(v[22 + i] << (2 + 3 * i) for i in range(10))
    packed = pack(torch.tensor(v).unsqueeze(1), 3, 0)
    assert _u32(packed) == [w0, w1, w2]
    # Along dim 1 (the qzeros direction) the same words appear.
    assert _u32(pack(torch.tensor(v).unsqueeze(0), 3, 1)) == [w0, w1, w2]


def test_symmetric_4bit_v1_qzeros_are_0x77777777() -> None:
    zeros = torch.full((64, 3), 8, dtype=torch.int32)  # [N, G], z = 2^(b-1)
    qzeros = pack_qzeros(zeros, 4, "gptq")
    assert qzeros.shape == (3, 8)
    assert (qzeros == 0x77777777).all() and int(qzeros[0, 0]) == 2004318071
    v2 = pack_qzeros(zeros, 4, "gptq_v2")
    assert (v2 == int(0x88888888 - 2**32)).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_qzeros_round_trip_both_conventions(bits: int, fmt: str) -> None:
    g = torch.Generator().manual_seed(bits)
    low = 1 if fmt == "gptq" else 0
    zeros = torch.randint(low, 1 << bits, (96, 5), generator=g, dtype=torch.int32)
    qzeros = pack_qzeros(zeros, bits, fmt)
    assert qzeros.shape == (5, 96 * bits // 32)
    assert torch.equal(unpack_qzeros(qzeros, bits, 96, fmt), zeros)
    # The conventions differ by exactly one in every stored field.
    other = "gptq_v2" if fmt == "gptq" else "gptq"
    shifted = unpack_qzeros(qzeros, bits, 96, other)
    assert torch.equal(shifted - zeros, torch.full_like(zeros, -1 if fmt == "gptq" else 1))


def test_v1_refuses_zero_point_zero() -> None:
    zeros = torch.tensor([[3], [0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="gptq_v2"):
        pack_qzeros(zeros, 4, "gptq")
    assert torch.equal(unpack_qzeros(pack_qzeros(zeros, 4, "gptq_v2"), 4, 2, "gptq_v2"), zeros)


@pytest.mark.parametrize("bits", BITS)
def test_qweight_shape_and_round_trip(bits: int) -> None:
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 1 << bits, (24, 64), generator=g, dtype=torch.uint8)  # [N, K]
    qweight = pack_qweight(codes, bits)
    assert qweight.shape == (64 * bits // 32, 24)
    assert torch.equal(unpack_qweight(qweight, bits, 64), codes.int())


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="supported widths"):
        pack(torch.zeros(8, 1, dtype=torch.int32), 5)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack(torch.tensor([[16]]), 4)
    with pytest.raises(TypeError, match="integer"):
        pack(torch.zeros(8, 1), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(torch.zeros(2, 1, dtype=torch.int32), 3, 32)
    with pytest.raises(ValueError, match="checkpoint_format"):
        pack_qzeros(torch.ones(8, 1, dtype=torch.int32), 4, "awq")
