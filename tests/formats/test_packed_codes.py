"""The codes held once: the fast path's packed planes reproduce the checkpoint's ``qweight``
exactly, so QuantLinear can drop it (optq.load does) and rebuild it wherever it is asked for."""

from __future__ import annotations

import pytest
import torch

import optq
from optq.formats import cpu_kernels
from optq.formats.fused import build_fast_paths
from optq.formats.packing import pack_qweight
from optq.formats.qlinear import QuantLinear


def _layer(n: int, k: int, bits: int, seed: int = 0, **cfg) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, k, generator=g)
    H = optq.Hessian(k)
    H.update(torch.randn(4 * k, k, generator=g))
    sol = optq.gptq(W, H.matrix(), optq.QuantConfig(bits=bits, **cfg))
    return QuantLinear.from_solution(sol, bias=torch.randn(n), checkpoint_format="gptq_v2")


def test_this_torch_packs_the_layout_the_reader_expects() -> None:
    assert cpu_kernels.packed_layout_known()  # else nothing is dropped, and the tests below would fail


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("act_order,static", [(False, False), (True, False), (True, True)])
def test_codes_read_back_from_the_planes_are_the_checkpoints(bits: int, act_order: bool, static: bool) -> None:
    q = _layer(128, 256, bits, seed=bits, group_size=64, act_order=act_order, static_groups=static, sym=False)
    fast = q._fast_layout(torch.zeros(1, 256))
    assert fast is not None and cpu_kernels.from_packed(fast, 128)
    codes = q.codes()
    assert torch.equal(cpu_kernels.codes_from_packed(fast, bits, 128), codes)
    # the centred codes, in the kernels' channel order, are q - 2^(b-1) with g_idx's sort applied
    order = torch.arange(256) if fast.perm is None else fast.perm
    centred = cpu_kernels.centred_codes(fast, 128)
    assert centred.dtype == torch.int8
    assert torch.equal(centred.to(torch.int32), (codes[:, order] - (1 << (bits - 1))).t())


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_dropping_the_codes_changes_nothing_but_memory(bits: int) -> None:
    q = _layer(128, 192, bits, group_size=64)
    state = {k: v.clone() for k, v in q.state_dict().items()}
    x1, x96 = torch.randn(1, 192), torch.randn(96, 192)
    before = (q(x1), q(x96), q.forward_reference(x1))
    assert q.build_fast_path(drop_codes=True)
    assert q._buffers["qweight"] is None  # freed
    assert [n for n, _ in q.named_buffers()] == ["qzeros", "scales", "g_idx", "bias"]
    after = (q(x1), q(x96), q.forward_reference(x1))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(q.codes(), pack_and_unpack(state["qweight"], bits))
    assert q._buffers["qweight"] is None  # codes() and the reference path do not bring it back
    saved = q.state_dict()
    assert list(saved) == list(state) and all(torch.equal(saved[k], state[k]) for k in state)
    assert q._buffers["qweight"] is None  # nor does a state_dict
    assert q.float()._buffers["qweight"] is None  # nor a dtype change (qweight is integer)
    assert torch.equal(q.qweight, state["qweight"])  # reading it does: then it is a real buffer again
    assert q._buffers["qweight"] is q.qweight and q.fast_weight is not None
    assert torch.equal(q(x1), before[0])


def pack_and_unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    from optq.formats.packing import unpack_qweight

    codes = unpack_qweight(qweight, bits, 192)
    assert torch.equal(pack_qweight(codes, bits), qweight)
    return codes


def test_a_dropped_layer_loads_another_state_and_moves_devices() -> None:
    a, b = _layer(128, 192, 4, seed=1, group_size=64), _layer(128, 192, 4, seed=2, group_size=64)
    x = torch.randn(3, 192)
    a.build_fast_path(drop_codes=True)
    a.load_state_dict(b.state_dict())  # copied into a rebuilt buffer; the fast path follows
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a(x), b(x))
    a.build_fast_path(drop_codes=True)
    a.qweight.add_(0)  # an in-place write (a version bump) after a read: the fast path is rebuilt
    assert torch.equal(a(x), b(x))
    a.build_fast_path(drop_codes=True)
    meta = a.to("meta")  # another device takes the codes along
    assert meta.qweight.device.type == "meta" and meta.qweight.shape == b.qweight.shape


def test_build_fast_paths_drops_codes_only_where_the_planes_hold_them() -> None:
    model = torch.nn.Sequential(_layer(128, 192, 4, group_size=64), _layer(48, 192, 4, group_size=64))
    assert build_fast_paths(model) == (2, 2)
    assert model[0]._buffers["qweight"] is None
    assert model[1]._buffers["qweight"] is not None  # 48 output channels: not the packer's 64-blocks
    kept = torch.nn.Sequential(_layer(128, 192, 4, group_size=64))
    build_fast_paths(kept, drop_codes=False)
    assert kept[0]._buffers["qweight"] is not None
