"""flash_attn_func and attention_reference against the numpy fp64 oracle of conftest.py, on
numpy arrays and torch tensors, every dtype, shapes that break the library's tiles, strided
views, GQA, masks and the score modifiers."""

import tracemalloc

import numpy as np
import pytest

import flashattn
from conftest import (assert_close, dtype_name, forward_bound, reference_attention,
                      requires_ml_dtypes, requires_torch, torch, ml_dtypes)

# (batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim): seqlens around the 64- and
# 128-row tiles, Sq != Skv both ways, head dims that are not a multiple of the vector width.
SHAPES = [
    (1, 1, 1, 1, 1, 32),
    (2, 3, 7, 4, 2, 40),
    (1, 113, 203, 4, 4, 64),
    (2, 129, 127, 8, 2, 59),
    (1, 1, 239, 8, 2, 128),
    (1, 255, 3, 2, 1, 96),
]


def make(rng, framework, dtype, *shape):
    x = rng.standard_normal(shape).astype(np.float32)
    if framework == "torch":
        return torch.from_numpy(x).to(getattr(torch, dtype))
    if dtype == "bfloat16":
        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def qkv(rng, framework, dtype, shape):
    b, sq, skv, hq, hkv, d = shape
    return (make(rng, framework, dtype, b, sq, hq, d), make(rng, framework, dtype, b, skv, hkv, d),
            make(rng, framework, dtype, b, skv, hkv, d))


FRAMEWORKS = ["numpy", pytest.param("torch", marks=requires_torch)]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", ["flash", "standard", "reference"])
def test_every_path_matches_the_oracle(rng, framework, shape, causal, impl):
    q, k, v = qkv(rng, framework, "float32", shape)
    out, lse = flashattn.flash_attn_func(q, k, v, causal=causal, return_lse=True, impl=impl)
    ref, ref_lse = reference_attention(q, k, v, causal=causal)
    assert type(out) is type(q) and type(lse) is type(q)
    assert tuple(lse.shape) == (shape[0], shape[3], shape[1])
    bound = forward_bound(q, k, v, ref=ref)
    assert_close(out, ref, bound)
    assert_close(lse, ref_lse, bound + 4 * 2.0 ** -24 * np.abs(ref_lse[np.isfinite(ref_lse)])
                 .max(initial=0.0), "lse")


@pytest.mark.parametrize("framework", ["numpy", pytest.param("torch", marks=requires_torch)])
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=requires_ml_dtypes)])
def test_16_bit_inputs_round_once(rng, framework, dtype):
    q, k, v = qkv(rng, framework, dtype, (2, 65, 130, 4, 2, 64))
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    assert dtype_name(out) == dtype
    ref, _ = reference_attention(q, k, v, causal=True)
    assert_close(out, ref, forward_bound(q, k, v, out_dtype=dtype, ref=ref))


@requires_torch
def test_a_heads_first_tensor_is_read_in_place(rng):
    # The seed's [B, H, S, D] seen as [B, S, H, D] by a transpose: a view, read with its strides.
    q = torch.randn(2, 4, 97, 64).transpose(1, 2)
    k = torch.randn(2, 2, 131, 64).transpose(1, 2)
    v = torch.randn(2, 2, 131, 64).transpose(1, 2)
    out = flashattn.flash_attn_func(q, k, v, window_size=(17, 5))
    ref, _ = reference_attention(q, k, v, window=(17, 5))
    assert_close(out, ref, forward_bound(q, k, v, ref=ref))


def test_strided_inputs_are_not_copied():
    # k and v are 8 MiB views with the heads first; out and lse are a few KiB. numpy reports
    # its allocations to tracemalloc: a copy of k or v would show as a peak of megabytes.
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 8, 4096, 64), dtype=np.float32).transpose(0, 2, 1, 3)
    v = rng.standard_normal((1, 8, 4096, 64), dtype=np.float32).transpose(0, 2, 1, 3)
    q = rng.standard_normal((1, 8, 2, 64), dtype=np.float32).transpose(0, 2, 1, 3)
    assert not k.flags.c_contiguous
    tracemalloc.start()
    flashattn.flash_attn_func(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < k.nbytes // 16, f"peak {peak} bytes traced for {k.nbytes}-byte inputs"


def test_a_non_contiguous_last_dim_is_copied_and_correct(rng):
    q = rng.standard_normal((1, 9, 2, 32, 2), dtype=np.float32)[..., 0]
    k = rng.standard_normal((1, 11, 2, 32), dtype=np.float32)
    v = rng.standard_normal((1, 11, 2, 32), dtype=np.float32)
    out = flashattn.flash_attn_func(q, k, v)
    ref, _ = reference_attention(q, k, v)
    assert_close(out, ref, forward_bound(q, k, v, ref=ref))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_score_modifiers(rng, framework):
    b, sq, skv, hq, hkv, d = 2, 70, 150, 4, 2, 64
    q, k, v = qkv(rng, framework, "float32", (b, sq, skv, hq, hkv, d))
    slopes = rng.uniform(0.01, 0.2, size=hq).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    bias = rng.standard_normal((1, hq, sq, skv)).astype(np.float32)
    bias[0, 1, :, 10:40] = -np.inf
    mask = rng.random((b, 1, sq, skv)) < 0.8
    if framework == "torch":
        bias_in, mask_in = torch.from_numpy(bias), torch.from_numpy(mask)
    else:
        bias_in, mask_in = bias, mask
    out, lse = flashattn.flash_attn_func(q, k, v, causal=True, softcap=20.0, alibi_slopes=slopes,
                                         sinks=sinks, attn_bias=bias_in, attn_mask=mask_in,
                                         return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, causal=True, softcap=20.0, alibi=slopes,
                                       bias=bias, mask=mask, sinks=sinks)
    bound = forward_bound(q, k, v, ref=ref) * 4
    assert_close(out, ref, bound)
    assert_close(lse, ref_lse, bound * 16, "lse")
    oracle = flashattn.attention_reference(q, k, v, causal=True, softcap=20.0,
                                           alibi_slopes=slopes, sinks=sinks, attn_bias=bias_in,
                                           attn_mask=mask_in)
    assert_close(oracle, ref, forward_bound(q, k, v, ref=ref))


def test_a_row_with_every_key_masked_gives_zero(rng):
    q, k, v = qkv(rng, "numpy", "float32", (1, 4, 8, 2, 2, 32))
    mask = np.ones((1, 1, 4, 8), dtype=bool)
    mask[0, 0, 2, :] = False
    out, lse = flashattn.flash_attn_func(q, k, v, attn_mask=mask, return_lse=True)
    assert np.all(out[0, 2] == 0.0)
    assert np.all(lse[0, :, 2] == -np.inf)


def test_thread_counts_give_the_same_bits(rng):
    q, k, v = qkv(rng, "numpy", "float32", (1, 300, 300, 4, 4, 64))
    outs = [flashattn.flash_attn_func(q, k, v, causal=True, num_threads=t) for t in (1, 2, 3)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_the_worked_example_of_seed_002():
    # Two tokens, three dims, S = QK^T (scale 1) and the causal mask M = [[0, -inf], [0, 0]]:
    # O_1 = v_1 exactly, O_2 = P_21 v_1 + P_22 v_2 with P_2 = softmax(q_2 k_1, q_2 k_2).
    q = np.array([[1, 0, 1], [0, 2, 1]], np.float32).reshape(1, 2, 1, 3)
    k = np.array([[1, 1, 0], [0, 1, 1]], np.float32).reshape(1, 2, 1, 3)
    v = np.array([[1, 2, 3], [4, 5, 6]], np.float32).reshape(1, 2, 1, 3)
    out = flashattn.flash_attn_func(q, k, v, softmax_scale=1.0, causal=True).reshape(2, 3)
    assert np.array_equal(out[0], [1, 2, 3])
    p21 = np.exp(2.0) / (np.exp(2.0) + np.exp(3.0))  # scores q_2 k_1 = 2, q_2 k_2 = 3
    expected = p21 * np.array([1, 2, 3]) + (1 - p21) * np.array([4, 5, 6])
    np.testing.assert_allclose(out[1], expected, rtol=4 * 2.0 ** -24 * 16, atol=0)


def test_visible_pairs_counts_the_causal_triangle():
    assert flashattn.visible_pairs(4, 4, causal=True) == 10
    assert flashattn.visible_pairs(2, 5, causal=True) == 4 + 5


def test_the_gil_is_released_during_a_call():
    # While one thread computes a ~0.1 s call, another Python thread keeps running: it would
    # be stopped for the whole call if the extension held the GIL.
    import threading
    import time

    q = np.ones((1, 2048, 8, 128), np.float32)
    flashattn.flash_attn_func(q[:, :64], q[:, :64], q[:, :64])
    done = threading.Event()
    ticks = []

    def count():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.01)
    start = time.perf_counter()
    flashattn.flash_attn_func(q, q, q, num_threads=1)
    end = time.perf_counter()
    done.set()
    counter.join()
    during = [t for t in ticks if start < t < end]
    assert end - start > 0.02, "the call was too short to tell"
    assert len(during) >= 3, f"{len(during)} ticks of the other thread in {end - start:.3f} s"
