"""FlashAttention 2.8's flash_attn_interface as upstream calls it: the return arity of
return_attn_probs, the four packed variants (views of the packed tensor, the gradient in one
tensor), against the unpacked calls bit for bit: the same kernel reads the same memory."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import flashattn
from conftest import requires_torch, torch


def upstream_parameters(function):
    """The positional-or-keyword parameters (FlashAttention's), in order, with defaults."""
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD]


COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
          ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
          ("deterministic", False), ("return_attn_probs", False)]
EMPTY = inspect.Parameter.empty


def test_signatures_are_flashattentions():
    # Names, order and defaults of flash_attn_interface (FlashAttention 2.8).
    assert upstream_parameters(flashattn.flash_attn_func) == [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY)] + COMMON
    assert upstream_parameters(flashattn.flash_attn_qkvpacked_func) == [("qkv", EMPTY)] + COMMON
    assert upstream_parameters(flashattn.flash_attn_kvpacked_func) == [
        ("q", EMPTY), ("kv", EMPTY)] + COMMON
    varlen = [("cu_seqlens_q", EMPTY), ("cu_seqlens_k", EMPTY), ("max_seqlen_q", None),
              ("max_seqlen_k", None)]
    assert upstream_parameters(flashattn.flash_attn_varlen_func) == [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY)] + varlen + COMMON + [("block_table", None)]
    assert upstream_parameters(flashattn.flash_attn_varlen_kvpacked_func) == [
        ("q", EMPTY), ("kv", EMPTY)] + varlen + COMMON
    assert upstream_parameters(flashattn.flash_attn_varlen_qkvpacked_func) == [
        ("qkv", EMPTY), ("cu_seqlens", EMPTY), ("max_seqlen", None)] + COMMON


def frameworks():
    return ["numpy"] + (["torch"] if torch is not None else [])


def make(rng, shape, framework):
    array = rng.standard_normal(shape, dtype=np.float32)
    return torch.from_numpy(array) if framework == "torch" else array


def same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("framework", frameworks())
def test_return_attn_probs_returns_out_lse_and_no_probabilities(rng, framework):
    q = make(rng, (2, 9, 4, 16), framework)
    kv = make(rng, (2, 11, 2, 16), framework)
    out, lse = flashattn.flash_attn_func(q, kv, kv, causal=True, return_lse=True)
    result = flashattn.flash_attn_func(q, kv, kv, causal=True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3
    assert same(result[0], out) and same(result[1], lse) and result[2] is None
    cu = np.array([0, 4, 9], np.int32)
    packed_q = make(rng, (9, 4, 16), framework)
    packed_kv = make(rng, (9, 2, 16), framework)
    out, lse = flashattn.flash_attn_varlen_func(packed_q, packed_kv, packed_kv, cu, cu, 5, 5,
                                                return_lse=True)
    result = flashattn.flash_attn_varlen_func(packed_q, packed_kv, packed_kv, cu, cu, 5, 5,
                                              return_attn_probs=True)
    assert len(result) == 3 and same(result[0], out) and same(result[1], lse)
    assert result[2] is None


@pytest.mark.parametrize("framework", frameworks())
def test_packed_variants_equal_the_unpacked_calls(rng, framework):
    qkv = make(rng, (2, 13, 3, 4, 32), framework)
    q = make(rng, (2, 13, 4, 32), framework)
    kv = make(rng, (2, 17, 2, 2, 32), framework)
    options = dict(causal=True, window_size=(5, 0), softcap=10.0)
    assert same(flashattn.flash_attn_qkvpacked_func(qkv, **options),
                flashattn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], **options))
    assert same(flashattn.flash_attn_kvpacked_func(q, kv, **options),
                flashattn.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], **options))
    cu = np.array([0, 3, 3, 13], np.int32)
    cu_k = np.array([0, 5, 9, 17], np.int32)
    qkv_v = make(rng, (13, 3, 4, 32), framework)
    q_v = make(rng, (13, 4, 32), framework)
    kv_v = make(rng, (17, 2, 2, 32), framework)
    assert same(flashattn.flash_attn_varlen_qkvpacked_func(qkv_v, cu, 10, **options),
                flashattn.flash_attn_varlen_func(qkv_v[:, 0], qkv_v[:, 1], qkv_v[:, 2], cu, cu,
                                                 10, 10, **options))
    assert same(flashattn.flash_attn_varlen_kvpacked_func(q_v, kv_v, cu, cu_k, 10, 8, **options),
                flashattn.flash_attn_varlen_func(q_v, kv_v[:, 0], kv_v[:, 1], cu, cu_k, 10, 8,
                                                 **options))


@requires_torch
def test_packed_gradients_arrive_in_the_packed_tensor():
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 13, 3, 4, 32, generator=generator, requires_grad=True)
    dout = torch.randn(2, 13, 4, 32, generator=generator)
    flashattn.flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    flashattn.flash_attn_func(q, k, v, causal=True).backward(dout)
    assert qkv.grad.shape == qkv.shape
    for i, part in enumerate((q, k, v)):
        assert torch.equal(qkv.grad[:, :, i], part.grad)

    q = torch.randn(9, 4, 16, generator=generator, requires_grad=True)
    kv = torch.randn(12, 2, 2, 16, generator=generator, requires_grad=True)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 12], dtype=torch.int32)
    flashattn.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 5, 7, causal=True).sum().backward()
    k, v = (kv.detach()[:, i].clone().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    flashattn.flash_attn_varlen_func(q2, k, v, cu_q, cu_k, 5, 7, causal=True).sum().backward()
    assert torch.equal(q.grad, q2.grad)
    assert torch.equal(kv.grad[:, 0], k.grad) and torch.equal(kv.grad[:, 1], v.grad)


@requires_torch
def test_packed_inputs_are_read_in_place():
    # A packed tensor whose head_dim is contiguous is never copied: the call's q, k, v are views
    # of it (their last dim contiguous), which the library reads with their strides.
    qkv = torch.randn(1, 5, 3, 2, 16)
    views = flashattn._api._unpacked(qkv, "qkv", 5, 3)
    for i, view in enumerate(views):
        assert view.data_ptr() == qkv[:, :, i].data_ptr() and view.stride(-1) == 1


@pytest.mark.parametrize("framework", frameworks())
def test_packed_variants_name_a_wrong_layout(rng, framework):
    with pytest.raises(ValueError, match=r"qkv: expected \[batch, seqlen, 3, heads, head_dim\], "
                                         r"got shape \[2, 9, 2, 4, 16\]"):
        flashattn.flash_attn_qkvpacked_func(make(rng, (2, 9, 2, 4, 16), framework))
    with pytest.raises(ValueError, match=r"kv: expected \[batch, seqlen_k, 2, heads_k, "
                                         r"head_dim\], got shape \[2, 9, 2, 16\]"):
        flashattn.flash_attn_kvpacked_func(make(rng, (2, 9, 2, 16), framework),
                                           make(rng, (2, 9, 2, 16), framework))
    with pytest.raises(ValueError, match=r"qkv: expected \[total, 3, heads, head_dim\]"):
        flashattn.flash_attn_varlen_qkvpacked_func(make(rng, (9, 4, 16), framework), [0, 9], 9)
    with pytest.raises(ValueError, match="dropout_p"):
        flashattn.flash_attn_qkvpacked_func(make(rng, (2, 9, 3, 4, 16), framework), -0.1)
    with pytest.raises(TypeError, match="qkv: expected a numpy.ndarray or a torch.Tensor"):
        flashattn.flash_attn_qkvpacked_func([[1.0]])
