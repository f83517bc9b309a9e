"""A value head dim unlike the query/key head dim (DeepSeek's MLA: 192/128 in prefill, 576/512
in decode) through the package: flash_attn_func and its gradients, the SDPA drop-in with
Ev != E (which torch's own CPU kernels refuse), flash_attn_varlen_func, flash_attn_with_kvcache
with MLA's shared latent cache (v_cache a view of k_cache's first 512 dims, new rows as k alone),
the custom op under opcheck; bad input.

Bounds: conftest.forward_bound (the derived fp32 forward bound against the fp64 oracle) for
outputs; for gradients test_autograd.py's rule (4x the error of the same attention in plain fp32
torch ops, plus a floor of 4 fp32 roundings per term of the longest sum).
"""

import math

import numpy as np
import pytest

import flashattn
import flashattn.torch as fat
from conftest import U32, forward_bound, reference_attention, requires_torch, to64, torch
from test_autograd import attention_math, check_gradients, leaves

pytestmark = requires_torch


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128), (59, 17)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_forward_and_gradients(d, dv, causal):
    torch.manual_seed(d * 3 + dv + causal)
    b, sq, skv, hq, hkv = 2, 70, 97, 4, 2
    q0, k0 = torch.randn(b, sq, hq, d), torch.randn(b, skv, hkv, d)
    v0, dout = torch.randn(b, skv, hkv, dv), torch.randn(b, sq, hq, dv)

    out = flashattn.flash_attn_func(q0, k0, v0, causal=causal)
    assert out.shape == (b, sq, hq, dv)
    want, _ = reference_attention(q0, k0, v0, causal=causal)
    assert float(np.abs(to64(out) - want).max()) <= forward_bound(q0, k0, v0)

    q, k, v = leaves(q0, k0, v0)
    flashattn.flash_attn_func(q, k, v, causal=causal).backward(dout)
    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    attention_math(q64, k64, v64, 1 / math.sqrt(d), causal).backward(dout.double())
    q32, k32, v32 = leaves(q0, k0, v0)
    attention_math(q32, k32, v32, 1 / math.sqrt(d), causal).backward(dout)
    assert v.grad.shape == (b, skv, hkv, dv)
    check_gradients([q.grad, k.grad, v.grad], [q32.grad, k32.grad, v32.grad],
                    [q64.grad, k64.grad, v64.grad], (sq, skv, max(d, dv)))


def test_numpy_and_bfloat16():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 33, 2, 192), dtype=np.float32)
    k = rng.standard_normal((1, 40, 2, 192), dtype=np.float32)
    v = rng.standard_normal((1, 40, 2, 128), dtype=np.float32)
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    want, _ = reference_attention(q, k, v, causal=True)
    assert out.shape == (1, 33, 2, 128)
    assert float(np.abs(out - want).max()) <= forward_bound(q, k, v)
    qb, kb, vb = (torch.from_numpy(x).bfloat16() for x in (q, k, v))
    out_bf16 = flashattn.flash_attn_func(qb, kb, vb, causal=True)
    want_bf16, _ = reference_attention(qb, kb, vb, causal=True)
    assert out_bf16.dtype == torch.bfloat16 and out_bf16.shape == (1, 33, 2, 128)
    assert float(np.abs(to64(out_bf16) - want_bf16).max()) <= forward_bound(
        qb, kb, vb, out_dtype="bfloat16", ref=want_bf16)


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_drop_in_takes_a_value_dim_of_its_own(is_causal):
    torch.manual_seed(11)
    q, k = torch.randn(2, 4, 37, 192), torch.randn(2, 4, 50, 192)
    v = torch.randn(2, 4, 50, 128)
    ours = fat.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert ours.shape == (2, 4, 37, 128) and ours.is_contiguous()
    # torch's SDPA semantics (top-left causal): its math written out in fp64.
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(192)
    if is_causal:
        s = s.masked_fill(torch.ones(37, 50, dtype=torch.bool).tril().logical_not(), -math.inf)
    want = torch.softmax(s, dim=-1) @ v.double()
    bound = 2 * forward_bound(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert float((ours.double() - want).abs().max()) <= bound
    # Gradients through autograd, value's included.
    leaves_ = [t.clone().requires_grad_() for t in (q, k, v)]
    fat.scaled_dot_product_attention(*leaves_, is_causal=is_causal).sum().backward()
    assert leaves_[2].grad.shape == v.shape and torch.isfinite(leaves_[0].grad).all()


def test_varlen_sequences_match_their_own_calls():
    torch.manual_seed(5)
    cu_q = torch.tensor([0, 30, 31, 80], dtype=torch.int32)
    cu_k = torch.tensor([0, 45, 90, 140], dtype=torch.int32)
    q, k, v = torch.randn(80, 4, 96), torch.randn(140, 2, 96), torch.randn(140, 2, 40)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 50, 50, causal=True)
    assert out.shape == (80, 4, 40)
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = flashattn.flash_attn_func(q[None, rows], k[None, keys], v[None, keys], causal=True)
        assert torch.equal(out[rows], alone[0])


@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_kvcache_shared_latent_cache(seqlen_q):
    """MLA's absorbed decode: 16 query heads on one latent KV head of 576 dims whose first 512
    are the values; the new latent rows appended once (k alone). The same output, bit for bit,
    as with the values in a cache of their own."""
    torch.manual_seed(seqlen_q)
    b, capacity, hq = 2, 256, 16
    latent = torch.randn(b, capacity, 1, 576, dtype=torch.bfloat16)
    keys, values = latent.clone(), latent[..., :512].clone()
    q = torch.randn(b, seqlen_q, hq, 576, dtype=torch.bfloat16)
    new = torch.randn(b, seqlen_q, 1, 576, dtype=torch.bfloat16)
    lengths = torch.tensor([100, 7], dtype=torch.int32)
    causal = seqlen_q > 1
    shared = flashattn.flash_attn_with_kvcache(q, latent, latent[..., :512], k=new,
                                               cache_seqlens=lengths, causal=causal)
    separate = flashattn.flash_attn_with_kvcache(q, keys, values, k=new, v=new[..., :512],
                                                 cache_seqlens=lengths, causal=causal)
    assert shared.shape == (b, seqlen_q, hq, 512)
    assert torch.equal(shared, separate)
    assert torch.equal(latent, keys)
    for i in range(b):
        length = int(lengths[i]) + seqlen_q
        want, _ = reference_attention(q[i:i + 1], latent[i:i + 1, :length],
                                      latent[i:i + 1, :length, :, :512], causal=causal)
        assert float(np.abs(to64(shared[i:i + 1]) - want).max()) <= forward_bound(
            q[i:i + 1], latent[i:i + 1, :length], latent[i:i + 1, :length, :, :512],
            out_dtype="bfloat16", ref=want)


def test_custom_op_passes_opcheck():
    from flashattn import _torch_ops
    q, k, v = torch.randn(1, 9, 2, 24), torch.randn(1, 11, 2, 24), torch.randn(1, 11, 2, 40)
    args = (q, k, v, None, None, None, None, None, True, -1, -1, 0.0, 0, "flash", False)
    torch.library.opcheck(_torch_ops.fwd, args)


def test_bad_input_names_both_dims():
    q, k = torch.randn(1, 4, 2, 32), torch.randn(1, 6, 2, 32)
    with pytest.raises(ValueError, match=r"v: expected shape \[1, 6, 2, head_dim_v\]"):
        flashattn.flash_attn_func(q, k, torch.randn(1, 5, 2, 16))
    cache = torch.randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match=r"v_cache: expected a view of k_cache's first head_dim_v"):
        flashattn.flash_attn_with_kvcache(q[:, :1], cache, torch.randn(1, 8, 2, 16),
                                          k=torch.randn(1, 1, 2, 32), cache_seqlens=3)
    with pytest.raises(ValueError, match=r"v: expected new K rows k beside the new V rows"):
        flashattn.flash_attn_with_kvcache(q[:, :1], cache, cache[..., :16],
                                          v=torch.randn(1, 1, 2, 16), cache_seqlens=3)


def test_layers_take_a_value_head_dim():
    """flashattn.nn.MultiHeadAttention (torch) and flashattn.MultiHeadAttention (the C++ layer)
    with value_head_dim: weights shaped by it, outputs as their projections and attention in
    float64 say, within 2^-13 of the largest output (three fp32 stages of sums of at most 80
    terms: (48 + 80 + 9)·4·2^-24 < 2^-14 relative, doubled)."""
    from flashattn.nn import MultiHeadAttention
    torch.manual_seed(3)
    layer = MultiHeadAttention(48, 4, num_kv_heads=2, value_head_dim=20, bias=True)
    assert layer.v_proj.weight.shape == (40, 48) and layer.o_proj.weight.shape == (48, 80)
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        y = layer(x, causal=True)
    with torch.no_grad():
        q = torch.nn.functional.linear(x.double(), layer.q_proj.weight.double(),
                                       layer.q_proj.bias.double()).view(2, 9, 4, 12)
        k = torch.nn.functional.linear(x.double(), layer.k_proj.weight.double(),
                                       layer.k_proj.bias.double()).view(2, 9, 2, 12)
        v = torch.nn.functional.linear(x.double(), layer.v_proj.weight.double(),
                                       layer.v_proj.bias.double()).view(2, 9, 2, 20)
        att = attention_math(q, k, v, 1 / math.sqrt(12), True).reshape(2, 9, 80)
        want = torch.nn.functional.linear(att, layer.o_proj.weight.double(),
                                          layer.o_proj.bias.double())
    assert float((y.double() - want).abs().max()) <= 2 ** -13 * float(want.abs().max())

    native = flashattn.MultiHeadAttention(48, 4, num_kv_heads=2, value_head_dim=20, seed=5)
    assert native.value_head_dim == 20
    assert native.w_v.shape == (48, 40) and native.w_o.shape == (80, 48)
    x_np = x.numpy()
    y_np = native(x_np, causal=True)
    q = torch.from_numpy(x_np @ native.w_q).double().view(2, 9, 4, 12)
    k = torch.from_numpy(x_np @ native.w_k).double().view(2, 9, 2, 12)
    v = torch.from_numpy(x_np @ native.w_v).double().view(2, 9, 2, 20)
    att = attention_math(q, k, v, 1 / math.sqrt(12), True).reshape(2, 9, 80)
    want = att @ torch.from_numpy(native.w_o).double()
    assert float(np.abs(y_np - want.numpy()).max()) <= 2 ** -13 * float(want.abs().max())
