"""Quantized KV caches from Python: int8 and fp8 caches with their fp32 scales
(docs/semantics.md, "Quantized KV caches"; docs/python.md, "Quantized KV caches").

Caches: torch int8, float8_e4m3fn, float8_e5m2; numpy int8, ml_dtypes float8_e4m3fn and
float8_e5m2, or uint8 bytes with cache_dtype= naming the format. fp8 caches reach the library as
their bytes (a uint8 view of the same memory: zero-copy), with the format's name beside them.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _api, _flashattn

# The library's names of the cache dtypes by torch's and ml_dtypes' dtype names.
_FORMATS = {"int8": "int8", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_NAMES = ("int8", "fp8_e4m3", "fp8_e5m2")


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def cache_format(k_cache: Any, cache_dtype: Optional[str]) -> str:
    """The library's name of a quantized cache's dtype, or "" for a float cache."""
    name = _dtype_name(k_cache)
    if cache_dtype is not None:
        if cache_dtype not in _NAMES:
            raise ValueError(f"cache_dtype: expected one of {', '.join(_NAMES)}, got {cache_dtype!r}")
        if name not in ("uint8", "int8") and _FORMATS.get(name) != cache_dtype:
            raise ValueError(f"cache_dtype: expected the bytes of {cache_dtype} codes "
                             f"(uint8), got a {name} cache")
        return cache_dtype
    if name == "uint8":
        raise ValueError("k_cache: a uint8 cache holds codes of some format: name it with "
                         "cache_dtype='int8', 'fp8_e4m3' or 'fp8_e5m2'")
    return _FORMATS.get(name, "")


def same_framework(x: Any, name: str, framework: str) -> None:
    """As _api._same_framework for a cache, whose dtype may be a quantized one."""
    if _FORMATS.get(_dtype_name(x)) or _dtype_name(x) == "uint8":
        is_torch = _api._is_torch(x)
        if (framework == "torch") != is_torch:
            kind = "torch.Tensor" if framework == "torch" else "numpy.ndarray"
            raise TypeError(f"{name}: expected a {kind}, as q is, got {type(x).__name__}")
        return
    _api._same_framework(x, name, framework)


def codes(x: Any, name: str, writable: bool) -> Any:
    """The cache's memory as the extension reads it: int8 as it is, fp8 as uint8 bytes."""
    if _api._is_torch(x):
        if not x.is_cpu:
            raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
        if _dtype_name(x).startswith("float8"):
            x = x.view(_api._torch().uint8)
    elif isinstance(x, np.ndarray):
        if x.dtype.name.startswith("float8"):
            x = x.view(np.uint8)
    else:
        raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got "
                        f"{type(x).__name__}")
    return _api._native(x, writable=writable, name=name)


def scale_view(scale: Any, name: str, cache: Any, framework: str, written: bool = False) -> Any:
    """`scale` as the library's [cache dim 0, cache dim 1, Hkv, groups] fp32 view, broadcast
    without a copy: a number or 0-d/1-element array (one scale for the tensor), [Hkv] (one per KV
    head), [dim 0, dim 1, Hkv] (one per row and head) or the full 4 dims (groups of dims)."""
    if scale is None:
        raise ValueError(f"{name}: expected fp32 scales for the {_dtype_name(cache)} cache, "
                         "got None")
    d0, d1, heads = cache.shape[0], cache.shape[1], cache.shape[2]
    # Arrays of the other framework would be copied, and int8's scales written to the copy.
    if isinstance(scale, np.ndarray) if framework == "torch" else _api._is_torch(scale):
        kind = "torch.Tensor" if framework == "torch" else "numpy.ndarray"
        raise TypeError(f"{name}: expected a number or a {kind}, as the cache is, got "
                        f"{type(scale).__name__}")
    if framework == "torch":
        torch = _api._torch()
        if not _api._is_torch(scale):
            scale = torch.tensor(scale, dtype=torch.float32)
        if scale.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32, got {scale.dtype}")
        shape = tuple(scale.shape)
    else:
        scale = np.asarray(scale) if not isinstance(scale, np.ndarray) else scale
        if scale.dtype != np.float32:
            if scale.ndim > 0 and scale.size > 1:
                raise ValueError(f"{name}: expected dtype float32, got {scale.dtype}")
            scale = scale.astype(np.float32)
        shape = scale.shape
    if len(shape) == 0 or (len(shape) == 1 and shape[0] == 1):
        full = scale.reshape(1, 1, 1, 1)
    elif shape == (heads,):
        full = scale.reshape(1, 1, heads, 1)
    elif shape == (d0, d1, heads):
        full = scale.reshape(d0, d1, heads, 1)
    elif len(shape) == 4 and shape[:3] == (d0, d1, heads):
        full = scale
    else:
        raise ValueError(f"{name}: expected a number, [{heads}] (per KV head), [{d0}, {d1}, "
                         f"{heads}] (per row) or [{d0}, {d1}, {heads}, groups], got "
                         f"{list(shape)}")
    target = (d0, d1, heads, full.shape[3])
    if framework == "torch":
        return full.expand(target)
    if written and not (full.shape == target and full.flags.writeable):
        raise ValueError(f"{name}: expected a writable float32 array with an element per row "
                         f"and group ({_dtype_name(cache)} writes the scales of the rows it "
                         f"quantizes), got {'a read-only array' if full.shape == target else list(shape)}")
    # Broadcast as numpy's own view (read-only); the library writes only per-row int8 scales.
    return full if full.shape == target else np.broadcast_to(full, target)


def kvcache_arguments(k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                      cache_dtype: Optional[str], framework: str, writable: bool = True) -> dict:
    """kvcache_forward's cache keywords: the caches (codes as bytes where fp8), their format and
    scales; a float cache as it is, without scales."""
    fmt = cache_format(k_cache, cache_dtype)
    if not fmt:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name}: expected None for a {_dtype_name(k_cache)} cache "
                                 "(scales belong to int8 and fp8 caches)")
        return dict(k_cache=_api._native(k_cache, writable=writable, name="k_cache"),
                    v_cache=_api._native(v_cache, writable=writable, name="v_cache"),
                    cache_dtype="", k_scale=None, v_scale=None)
    if cache_format(v_cache, cache_dtype) != fmt:
        raise ValueError(f"v_cache: expected dtype {_dtype_name(k_cache)} (as k_cache), got "
                         f"{_dtype_name(v_cache)}")
    written = writable and fmt == "int8"
    return dict(k_cache=codes(k_cache, "k_cache", writable),
                v_cache=codes(v_cache, "v_cache", writable),
                cache_dtype="" if fmt == "int8" and _dtype_name(k_cache) == "int8" else fmt,
                k_scale=scale_view(k_scale, "k_scale", k_cache, framework, written),
                v_scale=scale_view(v_scale, "v_scale", v_cache, framework, written))


def quantize_kv(values: Any, cache: Any = None, scales: Any = None, *, dtype: str = "int8",
                group_size: Optional[int] = None, cache_dtype: Optional[str] = None,
                num_threads: int = 0) -> Tuple[Any, Any]:
    """Quantizes K or V rows into a cache as appended rows are (a prefill's K or V, say).

    values [B, S, Hkv, D] float32, float16 or bfloat16 (numpy or torch). cache: the same shape,
    int8 or fp8 (torch.float8_e4m3fn / float8_e5m2, ml_dtypes' float8 types, or uint8 bytes with
    cache_dtype=), written in place; None allocates one of `dtype` ("int8", "fp8_e4m3",
    "fp8_e5m2"). scales: fp32, as flash_attn_with_kvcache's k_scale: int8 computes them
    (max|x| / 127 per row and KV head, or per group of group_size dims) and writes them into
    `scales` ([B, S, Hkv] or [B, S, Hkv, D / group_size]; None allocates them); fp8 divides by
    the scales given (a number, per KV head, per row, per group), saturating to the format's
    largest finite value. Returns (cache, scales).
    """
    framework = _api._framework(values, "values")
    if values.ndim != 4:
        raise ValueError(f"values: expected 4 dims [batch, seqlen, heads_kv, head_dim], got "
                         f"{values.ndim}")
    batch, seqlen, heads, dim = values.shape
    if cache is None:
        if dtype not in _NAMES:
            raise ValueError(f"dtype: expected one of {', '.join(_NAMES)}, got {dtype!r}")
        cache = _allocate_codes(framework, tuple(values.shape), dtype)
    fmt = cache_format(cache, cache_dtype)
    if not fmt:
        raise ValueError(f"cache: expected an int8 or fp8 cache, got {_dtype_name(cache)}")
    if scales is None:
        if fmt != "int8":
            raise ValueError(f"scales: expected the {fmt} cache's scales (fp8 divides by given "
                             "scales), got None")
        if group_size is not None and (group_size < 1 or dim % group_size):
            raise ValueError(f"group_size: expected a divisor of head_dim = {dim}, got {group_size}")
        shape = (batch, seqlen, heads) if group_size is None else (
            batch, seqlen, heads, dim // group_size)
        scales = _api._empty(framework, shape, _api._float32(framework))
    view = scale_view(scales, "scales", cache, framework, fmt == "int8")
    _flashattn.quantize_kv(_api._native(values), codes(cache, "cache", True),
                           "" if _dtype_name(cache) == "int8" else fmt, view, int(num_threads))
    return cache, scales


def _allocate_codes(framework: str, shape: Tuple[int, ...], fmt: str) -> Any:
    if framework == "torch":
        torch = _api._torch()
        dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}[fmt]
        return torch.empty(shape, dtype=dtype)
    if fmt == "int8":
        return np.empty(shape, dtype=np.int8)
    import ml_dtypes
    return np.empty(shape, dtype=ml_dtypes.float8_e4m3fn if fmt == "fp8_e4m3"
                    else ml_dtypes.float8_e5m2)
