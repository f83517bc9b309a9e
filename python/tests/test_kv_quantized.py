"""Quantized KV caches from Python (docs/python.md, "Quantized KV caches"): quantize_kv against
plain numpy / ml_dtypes / torch quantizers bit for bit, flash_attn_with_kvcache over int8 and fp8
caches (torch and numpy, dense and paged, appends quantized in place, zero-copy) against fp64
attention over the dequantized cache, and bad input.

Tolerance of the attention: as test_kvcache_options.py's for an fp32 q, u32 · max|v| ·
(4 · scale · D · max|q| · max|k| + 2L + 16), on top of the dequantized values' one fp32 rounding
(inside the scores' term)."""

import ml_dtypes
import numpy as np
import pytest
import torch

import flashattn

U32 = 2.0 ** -24
# Over an int8 cache with a scale per row the decode may round q's rows to 16-bit codes for its
# integer products (docs/semantics.md, "Quantized KV caches"): each element by at most this much
# of its row's largest.
QUERY_CODES = 0.5 / 32767
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
       "fp8_e5m2": (torch.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0)}


def int8_oracle(x, group):
    """Plain numpy: per group, scale = max|x| / 127 in float32, code = round half to even."""
    b, s, h, d = x.shape
    g = x.reshape(b, s, h, d // group, group)
    largest = np.abs(g).max(axis=-1)
    scale = (largest / np.float32(127)).astype(np.float32)
    finite = np.isfinite(g).all(axis=-1)
    safe = np.where((scale > 0) & finite, scale, np.float32(1))
    codes = np.clip(np.rint(g / safe[..., None]), -127, 127)
    codes = np.where(((scale > 0) & finite)[..., None], codes, 0).astype(np.int8)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    return codes.reshape(b, s, h, d), scale


@pytest.mark.parametrize("group", [None, 32, 16])
def test_int8_quantizer_is_the_numpy_one_bit_for_bit(group):
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 17, 2, 64)) * np.exp(rng.standard_normal((3, 17, 2, 1)) * 3)
         ).astype(np.float32)
    x[0, 0] = 0.0
    x[1, 2, 1, 5] = np.nan
    x[2, 3, 0, 0] = np.inf
    codes, scales = flashattn.quantize_kv(x, group_size=group)
    want_codes, want_scales = int8_oracle(x, group or 64)
    np.testing.assert_array_equal(codes, want_codes)
    got_scales = scales if group else scales[..., None]
    np.testing.assert_array_equal(got_scales, want_scales)
    # torch in, torch out: the same bits.
    t_codes, t_scales = flashattn.quantize_kv(torch.from_numpy(x), group_size=group)
    assert t_codes.dtype == torch.int8
    np.testing.assert_array_equal(t_codes.numpy(), want_codes)
    np.testing.assert_array_equal(t_scales.numpy(), scales)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_quantizer_is_ml_dtypes_and_torch_after_saturation(fmt):
    torch_dtype, np_dtype, largest = FP8[fmt]
    rng = np.random.default_rng()
    x = (rng.standard_normal((2, 9, 4, 32)) * 300).astype(np.float32)
    x[0, 0, 0, :4] = [np.inf, -np.inf, 1e30, np.nan]
    scale = np.array([0.5, 1.0, 0.125, 3.0], dtype=np.float32)  # per KV head
    cache = np.empty(x.shape, dtype=np_dtype)
    flashattn.quantize_kv(x, cache, scale)
    scaled = np.clip(x / scale[:, None], -largest, largest)  # saturation, NaN kept
    np.testing.assert_array_equal(cache.view(np.uint8), scaled.astype(np_dtype).view(np.uint8))
    t_cache = torch.empty(x.shape, dtype=torch_dtype)
    flashattn.quantize_kv(torch.from_numpy(x), t_cache, torch.from_numpy(scale))
    want = torch.from_numpy(scaled).to(torch_dtype)
    nan = torch.from_numpy(np.isnan(scaled))  # NaN codes may differ in payload
    assert torch.equal(t_cache.float().isnan(), nan)
    assert torch.equal(t_cache.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def reference(q, keys, values, causal=False):
    """fp64 attention of q [Sq, Hq, D] over keys, values [L, Hkv, D], bottom-right causal."""
    q, keys, values = (np.asarray(t, dtype=np.float64) for t in (q, keys, values))
    sq, hq, d = q.shape
    length, hkv, _ = keys.shape
    group = hq // hkv
    out = np.zeros_like(q)
    for h in range(hq):
        s = q[:, h] @ keys[:, h // group].T / np.sqrt(d)
        if causal:
            rows = np.arange(sq)[:, None] + length - sq
            s = np.where(np.arange(length)[None, :] <= rows, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = p @ values[:, h // group] / p.sum(axis=1, keepdims=True)
    return out


def dequantized(codes, scales):
    """code * scale in float64, scales [.., Hkv] or [.., Hkv, groups]."""
    c = np.asarray(torch.as_tensor(codes).float() if torch.is_tensor(codes) else
                   codes.astype(np.float32), dtype=np.float64)
    s = np.asarray(scales, dtype=np.float64)
    if s.ndim == c.ndim - 1:
        s = s[..., None]
    return (c.reshape(*c.shape[:-1], s.shape[-1], -1) * s[..., None]).reshape(c.shape)


def tolerance(q, keys, values, rounded_q=0.0):
    """The f32 cache's bound, plus what rounding q by `rounded_q` of its largest moves the output
    (each score by rounded_q · scores, the output by twice that times max|v|)."""
    d = q.shape[-1]
    scores = np.sqrt(d) * np.abs(q).max() * np.abs(keys).max()
    max_v = np.abs(values).max()
    return U32 * max_v * (4 * scores + 2 * keys.shape[0] + 16) + 2 * rounded_q * max_v * scores


@pytest.mark.parametrize("fmt", ["int8", "int8_group32", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page_size", [None, 7, 16])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_attention_over_a_quantized_cache_matches_fp64(fmt, page_size, framework):
    rng = np.random.default_rng()
    B, cap, hkv, hq, d, sq, snew = 3, 48, 2, 8, 64, 2, 2
    lengths = np.array([5, 30, 0], dtype=np.int32)
    values_k = rng.standard_normal((B, cap, hkv, d)).astype(np.float32)
    values_v = rng.standard_normal((B, cap, hkv, d)).astype(np.float32)
    if fmt.startswith("int8"):
        group = 32 if fmt.endswith("32") else None
        k_codes, k_scale = flashattn.quantize_kv(values_k, group_size=group)
        v_codes, v_scale = flashattn.quantize_kv(values_v, group_size=group)
    else:
        np_dtype, largest = FP8[fmt][1], FP8[fmt][2]
        k_scale = np.float32(4.0 / largest)
        v_scale = np.float32(3.0 / largest)
        k_codes = np.empty(values_k.shape, dtype=np_dtype)
        v_codes = np.empty(values_v.shape, dtype=np_dtype)
        flashattn.quantize_kv(values_k, k_codes, k_scale)
        flashattn.quantize_kv(values_v, v_codes, v_scale)
    q = rng.standard_normal((B, sq, hq, d)).astype(np.float32)
    k_new = rng.standard_normal((B, snew, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((B, snew, hkv, d)).astype(np.float32)
    per_row = np.ndim(k_scale) > 0

    # The paged copy: pages of page_size rows in shuffled order, scales alongside.
    table = None
    caches = [k_codes, v_codes, k_scale, v_scale]
    if page_size is not None:
        pages = -(-cap // page_size)
        order = rng.permutation(B * pages)
        table = order.reshape(B, pages).astype(np.int32)
        paged = []
        for array in caches:
            if np.ndim(array) == 0:
                paged.append(array)
                continue
            padded = np.zeros((B, pages * page_size) + array.shape[2:], dtype=array.dtype)
            padded[:, :cap] = array
            shaped = padded.reshape(B * pages, page_size, *array.shape[2:])
            out = np.empty_like(shaped)
            out[order] = shaped
            paged.append(out)
        caches = paged
    if framework == "torch":
        caches = [torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(
            FP8[fmt][0]) if fmt in FP8 and np.ndim(a) > 0 and a.dtype != np.float32 else
            (torch.from_numpy(np.ascontiguousarray(a)) if np.ndim(a) > 0 else float(a))
            for a in caches]
        args = [torch.from_numpy(t) for t in (q, k_new, v_new)]
        seqlens = torch.from_numpy(lengths)
        table_arg = None if table is None else torch.from_numpy(table)
    else:
        args, seqlens, table_arg = [q, k_new, v_new], lengths, table
    kc, vc, ks, vs = caches
    address = kc.data_ptr() if framework == "torch" else kc.__array_interface__["data"][0]
    out = flashattn.flash_attn_with_kvcache(
        args[0], kc, vc, args[1], args[2], cache_seqlens=seqlens, block_table=table_arg,
        causal=True, k_scale=ks, v_scale=vs)
    assert (kc.data_ptr() if framework == "torch" else kc.__array_interface__["data"][0]) == address
    out = np.asarray(out)

    def rows(array, b, count):
        """Sequence b's first `count` rows of a (dense or paged) cache or per-row scales."""
        array = array.numpy() if torch.is_tensor(array) else array
        if torch.is_tensor(array) or array.dtype.name.startswith("float8"):
            array = np.asarray(array)
        if page_size is None:
            return array[b, :count]
        idx = np.arange(count)
        return array[table[b, idx // page_size], idx % page_size]

    def codes_np(a):
        if torch.is_tensor(a):
            return a.float().numpy() if a.dtype != torch.int8 else a.numpy()
        return a.astype(np.float32) if a.dtype.name.startswith("float8") else a

    for b in range(B):
        length = lengths[b] + snew
        if per_row:
            keys = dequantized(rows(codes_np(kc), b, length), rows(ks, b, length))
            vals = dequantized(rows(codes_np(vc), b, length), rows(vs, b, length))
        else:
            keys = rows(codes_np(kc), b, length).astype(np.float64) * float(ks)
            vals = rows(codes_np(vc), b, length).astype(np.float64) * float(vs)
        want = reference(q[b], keys, vals, causal=True)
        np.testing.assert_allclose(out[b], want, rtol=0, atol=tolerance(
            q[b], keys, vals, QUERY_CODES if fmt == "int8" else 0.0))
        # The appended rows hold the quantizer's codes of the new rows.
        if fmt.startswith("int8"):
            new_codes, new_scales = flashattn.quantize_kv(k_new[b:b + 1], group_size=(
                32 if fmt.endswith("32") else None))
            got = rows(codes_np(kc), b, length)[lengths[b]:]
            np.testing.assert_array_equal(got, new_codes[0])


def test_bad_input_names_the_argument():
    q = torch.randn(1, 1, 4, 32)
    k = torch.zeros(1, 8, 2, 32, dtype=torch.int8)
    scales = torch.ones(1, 8, 2)
    lengths = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale: expected fp32 scales for the int8 cache"):
        flashattn.flash_attn_with_kvcache(q, k, k.clone(), cache_seqlens=lengths)
    with pytest.raises(ValueError, match=r"k_scale: expected a number, \[2\] \(per KV head\)"):
        flashattn.flash_attn_with_kvcache(q, k, k.clone(), cache_seqlens=lengths,
                                          k_scale=torch.ones(3), v_scale=scales)
    with pytest.raises(ValueError, match="k_scale: expected dtype float32, got torch.float64"):
        flashattn.flash_attn_with_kvcache(q, k, k.clone(), cache_seqlens=lengths,
                                          k_scale=scales.double(), v_scale=scales)
    with pytest.raises(TypeError, match="k_scale: expected a number or a torch.Tensor"):
        flashattn.flash_attn_with_kvcache(q, k, k.clone(), cache_seqlens=lengths,
                                          k_scale=scales.numpy(), v_scale=scales)
    with pytest.raises(ValueError, match="name it with cache_dtype"):
        flashattn.flash_attn_with_kvcache(q, k.view(torch.uint8), k.view(torch.uint8),
                                          cache_seqlens=lengths, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="k_scale: expected None for a float32 cache"):
        flashattn.flash_attn_with_kvcache(q, torch.zeros(1, 8, 2, 32), torch.zeros(1, 8, 2, 32),
                                          cache_seqlens=lengths, k_scale=scales)
    # int8 appends write per-row scales: a broadcast numpy scale cannot take them.
    with pytest.raises(ValueError, match="k_scale: expected a writable float32 array"):
        flashattn.flash_attn_with_kvcache(q.numpy(), k.numpy(), k.numpy().copy(),
                                          k=np.ones((1, 1, 2, 32), np.float32),
                                          v=np.ones((1, 1, 2, 32), np.float32),
                                          cache_seqlens=np.array([3], np.int32), k_scale=1.0,
                                          v_scale=1.0)
    # The library's own checks reach Python as ValueError with its message.
    with pytest.raises(ValueError, match="k_scale: expected one element per"):
        flashattn.flash_attn_with_kvcache(q, k, k.clone(), torch.ones(1, 1, 2, 32),
                                          torch.ones(1, 1, 2, 32), cache_seqlens=lengths,
                                          k_scale=torch.ones(2), v_scale=scales)
    with pytest.raises(ValueError, match="scales: expected the fp8_e4m3 cache's scales"):
        flashattn.quantize_kv(torch.randn(1, 2, 2, 32), dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="group_size: expected a divisor of head_dim = 32"):
        flashattn.quantize_kv(torch.randn(1, 2, 2, 32), group_size=5)


def test_the_op_passes_opcheck_with_an_int8_cache():
    from flashattn import _torch_ops
    q = torch.randn(1, 1, 4, 32)
    k, ks = flashattn.quantize_kv(torch.randn(1, 8, 2, 32))
    v, vs = flashattn.quantize_kv(torch.randn(1, 8, 2, 32))
    args = (q, k, v, torch.tensor([3], dtype=torch.int32), None, torch.randn(1, 1, 2, 32),
            torch.randn(1, 1, 2, 32), None, None, False, -1, -1, 0.0, 1, "flash", None, None,
            None, None, True, ks.unsqueeze(-1), vs.unsqueeze(-1), None)
    torch.library.opcheck(_torch_ops.kvcache_fwd, args)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_paged_varlen_over_a_quantized_pool_is_the_kvcache_call(framework, fmt):
    """flash_attn_varlen_func(block_table=) over an int8 / fp8 pool: each sequence bit for bit
    what flash_attn_with_kvcache gives it alone (the same C++ step)."""
    rng = np.random.default_rng()
    pages, page, hkv, hq, d = 12, 16, 2, 8, 64
    values = rng.standard_normal((pages, page, hkv, d)).astype(np.float32)
    if fmt == "int8":
        k, k_scale = flashattn.quantize_kv(values)
        v, v_scale = flashattn.quantize_kv(values[::-1].copy())
    else:
        k = np.empty(values.shape, dtype=FP8[fmt][1])
        v = np.empty(values.shape, dtype=FP8[fmt][1])
        k_scale = v_scale = np.float32(4.0 / FP8[fmt][2])
        flashattn.quantize_kv(values, k, k_scale)
        flashattn.quantize_kv(values[::-1].copy(), v, v_scale)
    table = rng.permutation(pages).reshape(3, 4).astype(np.int32)
    lengths = [40, 7, 64]
    q = rng.standard_normal((3, hq, d)).astype(np.float32)  # one decode row per sequence
    cu_q = np.arange(4, dtype=np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    if framework == "torch":
        def t(x):
            if np.ndim(x) == 0:
                return float(x)
            if x.dtype.name.startswith("float8"):
                return torch.from_numpy(x.view(np.uint8)).view(FP8[fmt][0])
            return torch.from_numpy(x)
        q, k, v, k_scale, v_scale, table_in = (t(x) for x in (q, k, v, k_scale, v_scale, table))
        cu_q, cu_k = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    else:
        table_in = table
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, block_table=table_in, causal=True,
                                           k_scale=k_scale, v_scale=v_scale)
    for b in range(3):
        row = table_in[b:b + 1]
        want = flashattn.flash_attn_with_kvcache(
            q[b:b + 1][None], k, v, cache_seqlens=np.array([lengths[b]], np.int32)
            if framework == "numpy" else torch.tensor([lengths[b]], dtype=torch.int32),
            block_table=row, causal=True, k_scale=k_scale, v_scale=v_scale)
        np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(want[0, 0]))
    with pytest.raises(ValueError, match="expected a block_table"):
        flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, k_scale=k_scale, v_scale=v_scale)
