"""flash_attn_with_kvcache's rotary embedding, cache_leftpad and cache_batch_idx (FlashAttention
2.8's semantics): against a plain rotate-then-attend written here (numpy, and torch for the torch
path) over the fp64 oracle, against a cache sliced by hand, and their errors."""

import numpy as np
import pytest

import flashattn
from conftest import assert_close, forward_bound, reference_attention, torch


def rotate(x, cos, sin, positions, interleaved):
    """x [B, S, H, D] with its first rotary_dim dims rotated, row (b, i) at positions[b, i]:
    FlashAttention's apply_rotary_emb, in fp64, rounded once to x's dtype."""
    half = cos.shape[1]
    c = cos.astype(np.float64)[positions][:, :, None, :]  # [B, S, 1, half]
    s = sin.astype(np.float64)[positions][:, :, None, :]
    y = x.astype(np.float64)
    first = slice(0, 2 * half, 2) if interleaved else slice(0, half)
    second = slice(1, 2 * half, 2) if interleaved else slice(half, 2 * half)
    x1, x2 = y[..., first].copy(), y[..., second].copy()
    y[..., first] = x1 * c - x2 * s
    y[..., second] = x2 * c + x1 * s
    return y.astype(np.float32).astype(x.dtype)


def table(rng, positions, rotary_dim):
    angles = rng.uniform(0, 2 * np.pi, (positions, rotary_dim // 2))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_is_rotate_then_attend(rng, interleaved, rotary_dim, causal):
    batch, hq, hkv, d, capacity, snew, sq = 2, 4, 2, 32, 64, 3, 3
    lengths = np.array([5, 40], np.int32)
    k_cache = rng.standard_normal((batch, capacity, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((batch, capacity, hkv, d)).astype(np.float32)
    rows_k, rows_v = k_cache.copy(), v_cache.copy()
    q = rng.standard_normal((batch, sq, hq, d)).astype(np.float32)
    k_new = rng.standard_normal((batch, snew, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((batch, snew, hkv, d)).astype(np.float32)
    cos, sin = table(rng, capacity, rotary_dim)
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                            rotary_sin=sin, cache_seqlens=lengths, causal=causal,
                                            rotary_interleaved=interleaved)
    steps = np.arange(sq)[None, :] if causal else np.zeros((1, sq), int)
    q_rot = rotate(q, cos, sin, lengths[:, None] + steps, interleaved)
    k_rot = rotate(k_new, cos, sin, lengths[:, None] + np.arange(snew)[None, :], interleaved)
    for b in range(batch):
        total = lengths[b] + snew
        keys, values = rows_k[b, :total].copy(), rows_v[b, :total].copy()
        keys[lengths[b]:], values[lengths[b]:] = k_rot[b], v_new[b]
        assert np.array_equal(k_cache[b, :total], keys)  # the cache holds the rotated keys
        assert np.array_equal(k_cache[b, total:], rows_k[b, total:])
        ref, _ = reference_attention(q_rot[b:b + 1], keys[None], values[None], causal=causal)
        assert_close(out[b:b + 1], ref,
                     forward_bound(q_rot[b:b + 1], keys[None], values[None], ref=ref))


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_with_torch_tensors_is_torch_rotate_then_attend(interleaved, rotary_dim, causal):
    torch.manual_seed(0)
    batch, hq, hkv, d, capacity, snew, sq = 2, 4, 2, 16, 32, 2, 2
    lengths = torch.tensor([3, 20], dtype=torch.int32)
    k_cache, v_cache = torch.randn(batch, capacity, hkv, d), torch.randn(batch, capacity, hkv, d)
    rows_k, rows_v = k_cache.clone(), v_cache.clone()
    q, k_new, v_new = (torch.randn(batch, sq, hq, d), torch.randn(batch, snew, hkv, d),
                       torch.randn(batch, snew, hkv, d))
    angles = torch.rand(capacity, rotary_dim // 2, dtype=torch.float64) * 2 * torch.pi
    cos, sin = angles.cos().float(), angles.sin().float()
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                            rotary_sin=sin, cache_seqlens=lengths, causal=causal,
                                            rotary_interleaved=interleaved)

    def torch_rotate(x, positions):  # positions [B, S]
        c, s = cos.double()[positions][:, :, None], sin.double()[positions][:, :, None]
        y = x.double().clone()
        if interleaved:
            x1, x2 = y[..., 0:rotary_dim:2].clone(), y[..., 1:rotary_dim:2].clone()
            y[..., 0:rotary_dim:2], y[..., 1:rotary_dim:2] = x1 * c - x2 * s, x2 * c + x1 * s
        else:
            half = rotary_dim // 2
            x1, x2 = y[..., :half].clone(), y[..., half:rotary_dim].clone()
            y[..., :half], y[..., half:rotary_dim] = x1 * c - x2 * s, x2 * c + x1 * s
        return y.float()

    start = lengths.long()[:, None]
    q_rot = torch_rotate(q, start + (torch.arange(sq)[None] if causal else 0))
    k_rot = torch_rotate(k_new, start + torch.arange(snew)[None])
    for b in range(batch):
        total = int(lengths[b]) + snew
        keys, values = rows_k[b, :total].clone(), rows_v[b, :total].clone()
        keys[int(lengths[b]):], values[int(lengths[b]):] = k_rot[b], v_new[b]
        assert torch.equal(k_cache[b, :total], keys)
        keys64 = keys.double().repeat_interleave(hq // hkv, dim=1)
        values64 = values.double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q_rot[b].double(), keys64) / d ** 0.5
        if causal:
            visible = (torch.arange(total)[None] <= torch.arange(sq)[:, None] + total - sq)
            scores = scores.masked_fill(~visible, float("-inf"))
        want = torch.einsum("hij,jhd->ihd", scores.softmax(-1), values64)
        assert torch.allclose(out[b].double(), want, rtol=0, atol=2e-5)


def test_leftpad_and_batch_idx_equal_a_sliced_cache(rng):
    batch, hq, hkv, d, capacity, snew, sq = 3, 4, 2, 32, 40, 2, 2
    lengths = np.array([20, 9, 17], np.int32)
    leftpad = np.array([5, 0, 17], np.int32)
    batch_idx = np.array([2, 0, 3], np.int32)
    k_cache = rng.standard_normal((4, capacity, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((4, capacity, hkv, d)).astype(np.float32)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    q = rng.standard_normal((batch, sq, hq, d)).astype(np.float32)
    k_new = rng.standard_normal((batch, snew, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((batch, snew, hkv, d)).astype(np.float32)
    sliced_k, sliced_v = (np.zeros((batch, capacity, hkv, d), np.float32) for _ in range(2))
    for b in range(batch):
        n = lengths[b] - leftpad[b]
        sliced_k[b, :n] = k_cache[batch_idx[b], leftpad[b]:lengths[b]]
        sliced_v[b, :n] = v_cache[batch_idx[b], leftpad[b]:lengths[b]]
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    got = flashattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, cache_leftpad=leftpad,
        cache_batch_idx=batch_idx, causal=True, alibi_slopes=slopes, return_softmax_lse=True)
    want = flashattn.flash_attn_with_kvcache(
        q, sliced_k, sliced_v, k_new, v_new, cache_seqlens=lengths - leftpad, causal=True,
        alibi_slopes=slopes, return_softmax_lse=True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    for b in range(batch):  # the new rows in their cache rows, every other row as before
        before_k[batch_idx[b], lengths[b]:lengths[b] + snew] = k_new[b]
        before_v[batch_idx[b], lengths[b]:lengths[b] + snew] = v_new[b]
    assert np.array_equal(k_cache, before_k) and np.array_equal(v_cache, before_v)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_leftpad_and_batch_idx_with_torch_tensors():
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(3, 16, 1, 16), torch.randn(3, 16, 1, 16)
    q, k_new, v_new = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    lengths = torch.tensor([6, 3], dtype=torch.int32)
    leftpad, batch_idx = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([2, 0])
    # Sequence 0's keys from row 2 of cache row 2, sequence 1's from row 0 of cache row 0.
    sliced_k = torch.zeros(2, 16, 1, 16)
    sliced_v = torch.zeros(2, 16, 1, 16)
    sliced_k[0, :14], sliced_v[0, :14] = k_cache[2, 2:], v_cache[2, 2:]
    sliced_k[1], sliced_v[1] = k_cache[0], v_cache[0]
    got = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                            cache_seqlens=lengths, cache_leftpad=leftpad,
                                            cache_batch_idx=batch_idx)
    want = flashattn.flash_attn_with_kvcache(q, sliced_k, sliced_v, k_new, v_new,
                                             cache_seqlens=lengths - leftpad)
    assert torch.equal(got, want)
    assert torch.equal(k_cache[2, 6], k_new[0, 0]) and torch.equal(k_cache[0, 3], k_new[1, 0])


@pytest.mark.parametrize("change, message", [
    (dict(rotary_rows=9), "rotary_cos: expected more than 9 positions"),
    (dict(rotary_columns=10), r"rotary_dim \(2 · rotary_cos's columns\): expected an even "
                              r"number in \[2, head_dim = 16\], got 20"),
    (dict(no_new_rows=True), "rotary_cos: expected new rows k_new, v_new to rotate"),
    (dict(rotary_sin=None), "rotary_cos, rotary_sin: expected both tables, or neither"),
    (dict(cache_leftpad=[0, 10]), r"cache_leftpad\[1\]: expected in \[0, cache_seqlens\[1\] = 9\]"),
    (dict(cache_batch_idx=[0, 4]), r"cache_batch_idx\[1\]: expected a cache row in \[0, 4\), "
                                   r"got 4"),
    (dict(cache_batch_idx=[3, 3]), r"cache_batch_idx\[1\]: expected distinct rows when "
                                   r"appending, got 3 as cache_batch_idx\[0\] too"),
    (dict(cache_leftpad=[0, 0], paged=True), "cache_leftpad: expected null with a block_table"),
    (dict(cache_batch_idx=[0, 1], paged=True), "cache_batch_idx: expected null with a block"),
])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_bad_options_raise_value_error_and_write_nothing(change, message, framework):
    if framework == "torch" and torch is None:
        pytest.skip("torch is not installed")
    rows = 4 if "cache_batch_idx" in change or change.get("paged") else 2
    k_cache, v_cache = (np.zeros((rows, 12, 1, 16), np.float32) for _ in range(2))
    q, new = np.ones((2, 1, 2, 16), np.float32), np.ones((2, 1, 1, 16), np.float32)
    cos = np.ones((change.get("rotary_rows", 16), change.get("rotary_columns", 8)), np.float32)
    kwargs = dict(cache_seqlens=np.array([5, 9], np.int32))
    if "rotary_rows" in change or "rotary_columns" in change or "no_new_rows" in change:
        kwargs.update(rotary_cos=cos, rotary_sin=np.zeros_like(cos))
    if "rotary_sin" in change:
        kwargs.update(rotary_cos=cos, rotary_sin=None)
    for name in ("cache_leftpad", "cache_batch_idx"):
        if name in change:
            kwargs[name] = np.array(change[name], np.int32)
    if change.get("paged"):
        kwargs["block_table"] = np.array([[0, 1], [2, 3]], np.int32)
        k_cache, v_cache = k_cache[:, :8], v_cache[:, :8]
    k, v = (None, None) if change.get("no_new_rows") else (new, new)
    if framework == "torch":
        q, k_cache, v_cache = (torch.from_numpy(x) for x in (q, k_cache, v_cache))
        k, v = (None, None) if k is None else (torch.from_numpy(k), torch.from_numpy(v))
        kwargs = {key: None if value is None else torch.from_numpy(value)
                  for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert (k_cache == 0).all() and (v_cache == 0).all()
