"""The serving entry points from Python: packed batches (varlen), the KV cache appended in
place, dense and paged, and merging attention states; against the numpy fp64 oracle."""

import numpy as np
import pytest

import flashattn
from conftest import (assert_close, forward_bound, reference_attention, requires_ml_dtypes,
                      requires_torch, torch, ml_dtypes)


def test_varlen_equals_each_sequence_alone(rng):
    lengths_q, lengths_k = [3, 0, 129, 64, 1], [7, 5, 129, 200, 0]
    hq, hkv, d = 4, 2, 64
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d), dtype=np.float32)
    k = rng.standard_normal((cu_k[-1], hkv, d), dtype=np.float32)
    v = rng.standard_normal((cu_k[-1], hkv, d), dtype=np.float32)
    out, lse = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True,
                                                return_lse=True)
    assert out.shape == q.shape and lse.shape == (hq, cu_q[-1])
    for b in range(len(lengths_q)):
        qs, ks, vs = (q[cu_q[b]:cu_q[b + 1]][None], k[cu_k[b]:cu_k[b + 1]][None],
                      v[cu_k[b]:cu_k[b + 1]][None])
        if qs.shape[1] == 0:
            continue
        alone, alone_lse = flashattn.flash_attn_func(qs, ks, vs, causal=True, return_lse=True)
        assert np.array_equal(out[cu_q[b]:cu_q[b + 1]], alone[0])
        assert np.array_equal(lse[:, cu_q[b]:cu_q[b + 1]], alone_lse[0])
        if ks.shape[1] == 0:
            assert np.all(alone == 0) and np.all(alone_lse == -np.inf)
            continue
        ref, _ = reference_attention(qs, ks, vs, causal=True)
        assert_close(alone, ref, forward_bound(qs, ks, vs, ref=ref))


def paged_copy(rng, k, v, cu_k, page_size, spare_pages=3):
    """k, v [total_k, Hkv, D] scattered into shuffled pages [num_pages, page_size, Hkv, D] (the
    unused rows random), and the block table [B, pages_per_sequence] that reads them back."""
    lengths = np.diff(cu_k)
    per_sequence = max(1, int(-(-lengths.max() // page_size)))
    num_pages = len(lengths) * per_sequence + spare_pages
    k_pages, v_pages = (rng.standard_normal((num_pages, page_size, *k.shape[1:])).astype(k.dtype)
                        for _ in range(2))
    table = rng.permutation(num_pages)[:len(lengths) * per_sequence]
    table = table.reshape(len(lengths), per_sequence)
    for b, length in enumerate(lengths):
        for j in range(length):
            row = (table[b, j // page_size], j % page_size)
            k_pages[row], v_pages[row] = k[cu_k[b] + j], v[cu_k[b] + j]
    return k_pages, v_pages, table.astype(np.int32)


@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_varlen_with_block_table_equals_packed_varlen(rng, page_size, framework):
    if framework == "torch" and torch is None:
        pytest.skip("torch is not installed")
    lengths_q, lengths_k = [3, 0, 40, 1, 5], [7, 5, 45, 0, 33]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 4, 32), dtype=np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 32), dtype=np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 32), dtype=np.float32)
    k_pages, v_pages, table = paged_copy(rng, k, v, cu_k, page_size)
    expected, expected_lse = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True,
                                                              return_lse=True)
    args = (q, k_pages, v_pages, cu_q, cu_k, 45, 45)
    if framework == "torch":
        args = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in args[:5]) + args[5:]
        table = torch.from_numpy(table)
    out, lse = flashattn.flash_attn_varlen_func(*args, causal=True, block_table=table,
                                                return_lse=True)
    assert np.array_equal(np.asarray(out), expected)
    assert np.array_equal(np.asarray(lse), expected_lse)


@requires_torch
def test_varlen_with_block_table_is_forward_only_and_checks_its_table():
    q = torch.randn(4, 2, 16, requires_grad=True)
    pages = torch.randn(3, 4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    table = torch.tensor([[2]], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table: the paged varlen call is a "
                                                  "forward only"):
        flashattn.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4, block_table=table)
    with torch.no_grad():
        flashattn.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4, block_table=table)
        with pytest.raises(ValueError, match="block_table"):
            flashattn.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4,
                                             block_table=torch.tensor([[3]], dtype=torch.int32))
        with pytest.raises(ValueError, match="block_table"):
            flashattn.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4,
                                             block_table=torch.tensor([[0, 1]] * 2,
                                                                      dtype=torch.int32))


def test_varlen_takes_int64_offsets_and_lists(rng):
    q = rng.standard_normal((10, 2, 32), dtype=np.float32)
    a = flashattn.flash_attn_varlen_func(q, q, q, [0, 4, 10], np.array([0, 4, 10]))
    b = flashattn.flash_attn_varlen_func(q, q, q, np.array([0, 4, 10], np.int32),
                                         np.array([0, 4, 10], np.int32))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("page_size", [None, 1, 7, 16])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16",
                                         pytest.param("bfloat16", marks=requires_ml_dtypes)])
def test_kvcache_append_then_attend(rng, page_size, cache_dtype):
    batch, hq, hkv, d, capacity, snew, sq = 3, 8, 2, 64, 96, 2, 3
    lengths = np.array([0, 40, 93], np.int32)
    dtype = ml_dtypes.bfloat16 if cache_dtype == "bfloat16" else np.dtype(cache_dtype)
    rows_k = rng.standard_normal((batch, capacity, hkv, d)).astype(dtype)
    rows_v = rng.standard_normal((batch, capacity, hkv, d)).astype(dtype)
    k_new = rng.standard_normal((batch, snew, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((batch, snew, hkv, d)).astype(np.float32)
    q = rng.standard_normal((batch, sq, hq, d)).astype(np.float32)
    if page_size is None:
        k_cache, v_cache, table = rows_k.copy(), rows_v.copy(), None
    else:
        pages = -(-capacity // page_size)
        order = rng.permutation(batch * pages)  # pages handed out in shuffled order
        table = order.reshape(batch, pages).astype(np.int32)
        k_cache = np.zeros((batch * pages, page_size, hkv, d), dtype)
        v_cache = np.zeros_like(k_cache)
        for b in range(batch):
            for j in range(capacity):
                page, row = table[b, j // page_size], j % page_size
                k_cache[page, row], v_cache[page, row] = rows_k[b, j], rows_v[b, j]
    out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                 cache_seqlens=lengths, block_table=table,
                                                 causal=True, return_softmax_lse=True)
    for b in range(batch):
        total = lengths[b] + snew
        keys = rows_k[b, :total].astype(np.float32)
        values = rows_v[b, :total].astype(np.float32)
        keys[lengths[b]:] = k_new[b].astype(dtype).astype(np.float32)  # rounded to the cache
        values[lengths[b]:] = v_new[b].astype(dtype).astype(np.float32)
        ref, ref_lse = reference_attention(q[b:b + 1], keys[None], values[None], causal=True)
        assert_close(out[b:b + 1], ref, forward_bound(q[b:b + 1], keys[None], values[None],
                                                      ref=ref))
        # The new rows landed in the cache, in place.
        for i in range(snew):
            j = lengths[b] + i
            where = (b, j) if table is None else (table[b, j // page_size], j % page_size)
            assert np.array_equal(k_cache[where].astype(np.float32), keys[j])


@requires_torch
def test_kvcache_with_torch_tensors_appends_into_the_tensor():
    torch.manual_seed(0)
    k_cache, v_cache = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    k_new, v_new = torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    q = torch.randn(2, 1, 2, 16)
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                            cache_seqlens=torch.tensor([0, 3], dtype=torch.int32))
    assert torch.equal(k_cache[0, 0], k_new[0, 0]) and torch.equal(k_cache[1, 3], k_new[1, 0])
    # The first sequence has one key, the new one: its output is that value row.
    assert torch.allclose(out[0, 0], v_new[0, 0].expand(2, 16), rtol=0, atol=1e-6)


def test_kvcache_head_major_pages_read_through_strides(rng):
    # Pages that keep each KV head's rows together ([pages, Hkv, page_size, D], FlashInfer's HND)
    # go in as a transposed view: the same bits as the row-major pages, appends in place.
    batch, hq, hkv, d, page_size, pages = 2, 4, 2, 32, 5, 4
    lengths = np.array([7, 13], np.int32)
    table = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32)
    head_major = rng.standard_normal((batch * pages, hkv, page_size, d)).astype(np.float32)
    row_major = np.ascontiguousarray(head_major.transpose(0, 2, 1, 3))
    k_hnd, v_hnd = head_major.copy(), head_major[::-1].copy()
    k_nhd, v_nhd = row_major.copy(), np.ascontiguousarray(head_major[::-1].transpose(0, 2, 1, 3))
    q = rng.standard_normal((batch, 1, hq, d)).astype(np.float32)
    k_new = rng.standard_normal((batch, 1, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((batch, 1, hkv, d)).astype(np.float32)
    want = flashattn.flash_attn_with_kvcache(q, k_nhd, v_nhd, k_new, v_new, cache_seqlens=lengths,
                                             block_table=table)
    got = flashattn.flash_attn_with_kvcache(q, k_hnd.transpose(0, 2, 1, 3),
                                            v_hnd.transpose(0, 2, 1, 3), k_new, v_new,
                                            cache_seqlens=lengths, block_table=table)
    assert np.array_equal(got, want)
    assert np.array_equal(k_hnd.transpose(0, 2, 1, 3), k_nhd)
    assert np.array_equal(v_hnd.transpose(0, 2, 1, 3), v_nhd)


def test_merge_attention_states_equals_attending_to_the_union(rng):
    q = rng.standard_normal((2, 5, 4, 32), dtype=np.float32)
    k = rng.standard_normal((2, 90, 4, 32), dtype=np.float32)
    v = rng.standard_normal((2, 90, 4, 32), dtype=np.float32)
    out_a, lse_a = flashattn.flash_attn_func(q, k[:, :37], v[:, :37], return_lse=True)
    out_b, lse_b = flashattn.flash_attn_func(q, k[:, 37:], v[:, 37:], return_lse=True)
    out, lse = flashattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref, ref_lse = reference_attention(q, k, v)
    bound = 2 * forward_bound(q, k, v, ref=ref)
    assert_close(out, ref, bound)
    assert_close(lse, ref_lse, bound + 8 * 2.0 ** -24 * np.abs(ref_lse).max(), "lse")
    # An empty side (lse -inf) weighs nothing.
    empty_lse = np.full_like(lse_b, -np.inf)
    same, same_lse = flashattn.merge_attention_states(out_a, lse_a, np.zeros_like(out_a),
                                                      empty_lse, out_dtype=np.float16)
    assert same.dtype == np.float16
    assert np.array_equal(same, out_a.astype(np.float16)) and np.array_equal(same_lse, lse_a)
