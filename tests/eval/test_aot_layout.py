"""The ahead-of-time package is keyed by each tensor's layout, not only its shape and dtype
(issue 32, item 5): the compiled step reads the model's tensors in place with the strides and
storage offset it was compiled for, so the same weights laid out otherwise must get another
package, and a package built for one layout must refuse the other. The values are not part of
the key (the step reads them at each call)."""

from __future__ import annotations

import pytest
import torch
from tiny import llama

from optq.eval import aot

LENGTH = 32
NAME = "model.layers.0.mlp.down_proj.weight"  # 32 x 64: its transpose has other strides


def _model():
    return llama(layers=1, seed=0).eval()


def _relaid(model, how: str):
    """``model`` with ``NAME`` holding the same values in another layout."""
    w = dict(model.named_parameters())[NAME]
    before = w.detach().clone()
    if how == "strides":  # column-major storage: strides (1, 32) instead of (64, 1)
        w.data = w.data.t().contiguous().t()
    else:  # the same row-major strides, 8 elements into a larger storage
        store = torch.zeros(w.numel() + 8, dtype=w.dtype)
        store[8:].copy_(w.data.reshape(-1))
        w.data = store[8:].view(w.shape)
    assert torch.equal(w.detach(), before) and w.shape == before.shape and w.dtype == before.dtype
    return w


@pytest.mark.parametrize("how", ["strides", "offset"])
def test_the_same_weights_in_another_layout_get_another_package(how, tmp_path):
    model = _model()
    path = aot.package_path(model, LENGTH, tmp_path)
    w = _relaid(model, how)
    assert (w.stride(), w.storage_offset()) != ((64, 1), 0)
    assert aot.package_path(model, LENGTH, tmp_path) != path
    assert aot.package_path(_model(), LENGTH, tmp_path) == path  # a fresh load: the original layout again


def test_other_values_in_the_same_layout_share_the_package(tmp_path):
    model = _model()
    path = aot.package_path(model, LENGTH, tmp_path)
    with torch.no_grad():
        dict(model.named_parameters())[NAME].mul_(2)
    assert aot.package_path(model, LENGTH, tmp_path) == path


@pytest.mark.slow
def test_a_package_built_for_one_layout_refuses_the_other(tmp_path):
    model = _model()
    built = aot.build_package(model, LENGTH, aot.package_path(model, LENGTH, tmp_path))
    aot.AotDecoder(model, built).close()  # its own model: served
    other = _model()
    _relaid(other, "strides")
    with pytest.raises(ValueError, match="compiled for another model"):
        aot.AotDecoder(other, built)
    assert "forward" not in other.__dict__
