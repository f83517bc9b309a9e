"""Attention dropout from Python: against the numpy oracle on the library's own mask
(flashattn's dropout_mask, read back through S_dmask's signs), reproducible from the seed or from
torch's generator, the backward against torch's autograd of the same masked attention, the packed
and varlen forms, the SDPA drop-in, torch.compile, S_dmask as FlashAttention's tests decode it,
and bad input.

Bounds: conftest's forward bound with max|v| scaled by 1 / (1 - p) (each term of P.V is that much
larger where kept); gradients against torch's fp64 autograd of the same masked attention within
the forward bound's relative size times the gradient's scale (as test_torch.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flashattn
from conftest import U32, assert_close, forward_bound, reference_attention, requires_torch, torch
from flashattn import _flashattn


def keep_mask(p, seed, offset, batch, heads, seqlen_q, seqlen_kv):
    """The library's mask, [B, Hq, Sq, Skv] bool."""
    keep = np.empty((batch, heads, seqlen_q, seqlen_kv), dtype=np.uint8)
    for b in range(batch):
        _flashattn.dropout_mask(p, seed, offset, b, keep[b])
    return keep.astype(bool)


SHAPES = [(1, 1, 1, 1, 1, 16), (2, 37, 53, 4, 2, 32), (1, 130, 129, 2, 1, 64),
          (2, 200, 70, 3, 3, 40), (1, 1, 300, 8, 2, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.17, 0.6])
def test_numpy_matches_the_oracle_on_the_librarys_mask(rng, shape, causal, dropout_p):
    batch, seqlen_q, seqlen_kv, heads_q, heads_kv, dim = shape
    q = rng.standard_normal((batch, seqlen_q, heads_q, dim)).astype(np.float32)
    k = rng.standard_normal((batch, seqlen_kv, heads_kv, dim)).astype(np.float32)
    v = rng.standard_normal((batch, seqlen_kv, heads_kv, dim)).astype(np.float32)
    seed, offset = int(rng.integers(0, 2 ** 63)) * 2 + 1, int(rng.integers(0, 2 ** 32))
    keep = keep_mask(dropout_p, seed, offset, batch, heads_q, seqlen_q, seqlen_kv)
    want, want_lse = reference_attention(q, k, v, causal=causal, dropout=(keep, dropout_p))
    bound = forward_bound(q, k, v / (1.0 - dropout_p), ref=want)
    for impl in ("flash", "standard", "reference"):
        out, lse = flashattn.flash_attn_func(q, k, v, dropout_p, causal=causal, return_lse=True,
                                             dropout_seed=seed, dropout_offset=offset, impl=impl)
        assert_close(out, want, bound, f"{impl} out")
        assert_close(lse, want_lse, bound + 4 * U32 * np.abs(want_lse[np.isfinite(want_lse)]).max(
            initial=0.0), f"{impl} lse")


def test_numpy_draws_from_numpys_generator(rng):
    q = rng.standard_normal((1, 50, 2, 16)).astype(np.float32)
    np.random.seed(3)
    first = flashattn.flash_attn_func(q, q, q, 0.5)
    np.random.seed(3)
    again = flashattn.flash_attn_func(q, q, q, 0.5)
    other = flashattn.flash_attn_func(q, q, q, 0.5)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_keep_fraction_is_one_minus_p():
    # 2^20 pairs: within 6 standard deviations of p.
    for p in (0.1, 0.17, 0.5):
        keep = keep_mask(p, 12345, 6, 2, 4, 256, 512)
        n = keep.size
        assert abs((~keep).mean() - p) <= 6 * math.sqrt(p * (1 - p) / n) + 2 ** -17, p


@requires_torch
def test_torch_seed_reproduces_and_the_backward_regenerates_the_mask():
    torch.manual_seed(0)
    batch, seqlen_q, seqlen_kv, heads_q, heads_kv, dim, p = 2, 67, 90, 4, 2, 32, 0.25
    q = torch.randn(batch, seqlen_q, heads_q, dim, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(batch, seqlen_kv, heads_kv, dim).requires_grad_()
    v = torch.randn(batch, seqlen_kv, heads_kv, dim).requires_grad_()
    dout = torch.randn(batch, seqlen_q, heads_q, dim)

    torch.manual_seed(7)
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    again = flashattn.flash_attn_func(q, k, v, p, causal=True)
    assert torch.equal(out, again)
    assert not torch.equal(out, flashattn.flash_attn_func(q, k, v, p, causal=True))

    # The mask FlashAttention's way: S_dmask >= 0 where kept (its padding and hidden keys 0).
    keep = (s_dmask[:, :, :seqlen_q, :seqlen_kv] >= 0)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scale = 1.0 / math.sqrt(dim)
    k_rep = k64.repeat_interleave(heads_q // heads_kv, dim=2)
    v_rep = v64.repeat_interleave(heads_q // heads_kv, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q64, k_rep) * scale
    rows = torch.arange(seqlen_q)[:, None] + seqlen_kv - seqlen_q
    scores = scores.masked_fill(torch.arange(seqlen_kv)[None, :] > rows, -math.inf)
    probabilities = scores.softmax(-1)
    dropped = probabilities * keep / (1 - p)
    want = torch.einsum("bhij,bjhd->bihd", dropped, v_rep)
    grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())

    bound = forward_bound(q, k, v / (1 - p), ref=want.detach().numpy())
    assert_close(out, want.detach().numpy(), bound)
    max_v = float(v.detach().abs().max()) / (1 - p)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        scale_g = float(ref.abs().max()) + float(dout.abs().max()) * max_v
        relative = bound / max_v
        assert_close(got, ref.numpy(), 4 * relative * scale_g * seqlen_kv ** 0.5, name)


@requires_torch
def test_s_dmask_decodes_as_flashattentions_tests_decode_it():
    # FlashAttention's normalize_flash_attn_S: |S| blocks of _get_block_size_n keys times
    # exp(m_block - lse), m_block the running max from the last block back, gives P.
    torch.manual_seed(1)
    q = torch.randn(1, 40, 2, 16)
    k = torch.randn(1, 300, 2, 16)
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, k, 0.3, return_attn_probs=True)
    assert s_dmask.shape == (1, 2, 128, 384)
    assert not s_dmask[:, :, 40:].any() and not s_dmask[..., 300:].any()
    block = flashattn._get_block_size_n(None, 16, True, False)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / 4.0
    block_max = torch.stack([s.amax(-1) for s in scores.split(block, -1)], -1)
    running = block_max.flip(-1).cummax(-1).values.flip(-1)
    unnormalized = s_dmask[:, :, :40, :300].abs().double()
    probabilities = torch.cat([a * torch.exp(m[..., None] - lse.double()[..., None])
                               for a, m in zip(unnormalized.split(block, -1), running.unbind(-1))],
                              -1)
    assert torch.allclose(probabilities, scores.softmax(-1), rtol=1e-5, atol=1e-7)
    dropped = (s_dmask[:, :, :40, :300] < 0).double().mean().item()
    assert abs(dropped - 0.3) < 0.03


@requires_torch
def test_packed_variants_equal_the_unpacked_call_bit_for_bit():
    qkv = torch.randn(2, 33, 3, 4, 16, requires_grad=True)
    torch.manual_seed(5)
    packed = flashattn.flash_attn_qkvpacked_func(qkv, 0.2, causal=True)
    torch.manual_seed(5)
    unpacked = flashattn.flash_attn_func(*qkv.unbind(2), 0.2, causal=True)
    assert torch.equal(packed, unpacked)
    g = torch.randn_like(packed)
    (dqkv,) = torch.autograd.grad(packed, qkv, g)
    (want,) = torch.autograd.grad(unpacked, qkv, g)
    assert torch.equal(dqkv, want)


@requires_torch
def test_varlen_sequences_take_the_masks_of_batch_entries():
    # Two sequences of equal length packed: the dense call's outputs and gradients, whose batch
    # entry b has sequence b's mask.
    torch.manual_seed(2)
    q = torch.randn(2, 45, 4, 32, requires_grad=True)
    k = torch.randn(2, 45, 2, 32, requires_grad=True)
    v = torch.randn(2, 45, 2, 32, requires_grad=True)
    cu = torch.tensor([0, 45, 90], dtype=torch.int32)
    dense = flashattn.flash_attn_func(q, k, v, 0.3, causal=True, dropout_seed=99)
    packed = flashattn.flash_attn_varlen_func(q.reshape(90, 4, 32), k.reshape(90, 2, 32),
                                              v.reshape(90, 2, 32), cu, cu, 45, 45, 0.3,
                                              causal=True, dropout_seed=99)
    assert torch.allclose(packed.reshape(2, 45, 4, 32), dense, rtol=0, atol=1e-6)
    g = torch.randn_like(dense)
    want = torch.autograd.grad(dense, (q, k, v), g)
    got = torch.autograd.grad(packed, (q, k, v), g.reshape(90, 4, 32))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)


@requires_torch
def test_sdpa_drop_in_draws_as_flash_attn_func_does():
    from flashattn import torch as fat
    query = torch.randn(2, 4, 50, 16)
    key = torch.randn(2, 4, 60, 16)
    torch.manual_seed(11)
    sdpa = fat.scaled_dot_product_attention(query, key, key, dropout_p=0.4)
    torch.manual_seed(11)
    direct = flashattn.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2),
                                       key.transpose(1, 2), 0.4)
    assert torch.allclose(sdpa, direct.transpose(1, 2), rtol=0, atol=1e-6)


@requires_torch
def test_compiles_with_dropout_in_the_graph():
    # The seed is drawn inside the graph (torch.randint): fullgraph compiles, and a compiled
    # step gives the eager step's value where inductor draws as eager does (fallback_random).
    import torch._inductor.config as inductor_config

    q = torch.randn(1, 30, 2, 16, requires_grad=True)

    def step(q):
        return flashattn.flash_attn_func(q, q, q, 0.3, causal=True).square().sum()

    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(step, fullgraph=True)
        torch.manual_seed(4)
        got = compiled(q)
        (grad,) = torch.autograd.grad(got, q)
    torch.manual_seed(4)
    want = step(q)
    (want_grad,) = torch.autograd.grad(want, q)
    assert torch.allclose(got, want, rtol=1e-6)
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_bad_dropout_is_a_clear_error(rng):
    q = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
    for p in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match=r"dropout_p: expected a value in \[0, 1\)"):
            flashattn.flash_attn_func(q, q, q, p)
    with pytest.raises(ValueError, match="dropout_seed"):
        flashattn.flash_attn_func(q, q, q, 0.1, dropout_seed=-1)
    with pytest.raises(ValueError, match="dropout_offset"):
        flashattn.flash_attn_func(q, q, q, 0.1, dropout_seed=1, dropout_offset=2 ** 32)
    cu = np.array([0, 8], dtype=np.int32)
    pages = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="dropout_p: expected 0 with block_table"):
        flashattn.flash_attn_varlen_func(q[0], pages, pages, cu, cu, dropout_p=0.1,
                                         block_table=np.zeros((1, 1), np.int32))
    cache = np.zeros((1, 16, 2, 16), np.float32)
    with pytest.raises(TypeError):
        flashattn.flash_attn_with_kvcache(q, cache, cache, dropout_p=0.1)
