"""flashattn.torch.scaled_dot_product_attention against torch's own, on the same inputs, with
torch's semantics: [..., H, S, E], top-left causal when L != S, bool and float masks that
broadcast, GQA, gradients; and routing a module's calls through it.

Bound: both are fp32 implementations of the same function, so each is within the derived
forward bound of the fp64 oracle (conftest.py) and they differ by at most twice it.
"""

import math

import pytest

import flashattn.torch as fat
from conftest import U32, forward_bound, requires_torch, torch

pytestmark = requires_torch
F = torch.nn.functional if torch is not None else None


def bound_of(q, k, v):
    # The bound takes [B, S, H, D]; transposing leaves the maxima and the lengths as they are.
    return 2 * forward_bound(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2))


@pytest.mark.parametrize("lq,ls", [(64, 64), (37, 101), (101, 37), (1, 129)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch(lq, ls, is_causal):
    torch.manual_seed(lq * 7 + ls)
    q, k, v = torch.randn(2, 4, lq, 64), torch.randn(2, 4, ls, 64), torch.randn(2, 4, ls, 64)
    ours = fat.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert ours.shape == theirs.shape and ours.is_contiguous()
    assert float((ours - theirs).abs().max()) <= bound_of(q, k, v)


@pytest.mark.parametrize("mask_shape", [(70, 90), (2, 1, 1, 90), (1, 4, 70, 90)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast_as_in_torch(mask_shape, kind):
    torch.manual_seed(len(mask_shape))
    q, k, v = torch.randn(2, 4, 70, 32), torch.randn(2, 4, 90, 32), torch.randn(2, 4, 90, 32)
    if kind == "bool":
        mask = torch.rand(mask_shape) < 0.7
        mask[..., 0] = True  # no row without a key (torch gives NaN there, flashattn 0)
    else:
        mask = torch.randn(mask_shape)
    ours = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert float((ours - theirs).abs().max()) <= bound_of(q, k, v) + 4 * U32 * 4


def test_gqa_and_three_dims():
    torch.manual_seed(2)
    q, k, v = torch.randn(8, 33, 40), torch.randn(2, 33, 40), torch.randn(2, 33, 40)
    ours = fat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert ours.shape == (8, 33, 40)
    assert float((ours - theirs).abs().max()) <= bound_of(q[None], k[None], v[None])
    with pytest.raises(ValueError, match="enable_gqa"):
        fat.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_tensors(dtype):
    torch.manual_seed(4)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(1, 2, 50, 64).to(dt) for _ in range(3))
    ours = fat.scaled_dot_product_attention(q, k, v, is_causal=True)
    theirs = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert ours.dtype == dt
    # One rounding of the output to the 16-bit type on top of the fp32 bound.
    unit = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    bound = bound_of(q.float(), k.float(), v.float()) + unit * float(theirs.abs().max())
    assert float((ours.float() - theirs).abs().max()) <= bound


def test_gradients_match_torch_including_a_float_mask():
    torch.manual_seed(9)
    q0, k0, v0 = torch.randn(2, 2, 40, 32), torch.randn(2, 2, 60, 32), torch.randn(2, 2, 60, 32)
    m0, dout = torch.randn(2, 1, 40, 60), torch.randn(2, 2, 40, 32)
    grads = []
    for sdpa, dtype in ((fat.scaled_dot_product_attention, torch.float32),
                        (F.scaled_dot_product_attention, torch.float32),
                        (F.scaled_dot_product_attention, torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q0, k0, v0, m0)]
        sdpa(*leaves[:3], attn_mask=leaves[3]).backward(dout.to(dtype))
        grads.append([t.grad.double() for t in leaves])
    for name, ours, torch32, truth in zip(("dq", "dk", "dv", "dmask"), *grads):
        floor = 4 * U32 * (40 + 60 + 32) * float(truth.abs().max())
        bound = 4 * float((torch32 - truth).abs().max()) + floor
        err = float((ours - truth).abs().max())
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


def test_unsupported_arguments_say_so():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        fat.scaled_dot_product_attention(q, q, q, dropout_p=1.0)
    # A value head dim of its own is taken (test_head_dim_v.py); a value of other keys is not.
    with pytest.raises(ValueError, match=r"v: expected shape"):
        fat.scaled_dot_product_attention(q, q, torch.randn(1, 1, 5, 16))
    with pytest.raises(ValueError, match="is_causal"):
        fat.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool),
                                         is_causal=True)
    with pytest.raises(TypeError, match="query"):
        fat.scaled_dot_product_attention(q.numpy(), q, q)


class TinyAttention(torch.nn.Module if torch is not None else object):
    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_sdpa_replaced_routes_a_module_and_restores_torch():
    original = torch.nn.functional.scaled_dot_product_attention
    x = torch.randn(1, 2, 16, 8)
    expected = fat.scaled_dot_product_attention(x, x, x, is_causal=True)
    with fat.sdpa_replaced():
        assert torch.nn.functional.scaled_dot_product_attention is fat.scaled_dot_product_attention
        assert torch.equal(TinyAttention()(x), expected)
    assert torch.nn.functional.scaled_dot_product_attention is original


def test_the_default_scale_is_one_over_sqrt_e():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, 5, 16) for _ in range(3))
    a = fat.scaled_dot_product_attention(q, k, v)
    b = fat.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(16))
    assert torch.equal(a, b)
