"""The functions of the flashattn package, on numpy arrays and torch CPU tensors.

Every tensor is handed to the C++ library where it lies, with its own strides (a [B, H, S, D]
tensor transposed to [B, S, H, D] is read in place). The one copy this layer ever makes is of
an input whose last dim is not contiguous, which the library's row kernels cannot read.
Outputs are allocated in the framework of q: a torch tensor gives torch tensors, a numpy array
numpy arrays. bf16 numpy arrays are those of ``ml_dtypes.bfloat16``.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _dropout, _flashattn

_IMPLS = ("flash", "standard", "reference")
_NUMPY_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))


def _torch():
    # torch is imported by the caller, never by us: if it is not loaded, no tensor is a torch
    # tensor, and `import flashattn` stays fast.
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


_torch_floats: Tuple[Any, ...] = ()


def _framework(x: Any, name: str) -> str:
    if _is_torch(x):
        global _torch_floats
        if not _torch_floats:
            torch = _torch()
            _torch_floats = (torch.float32, torch.float16, torch.bfloat16)
        if not x.is_cpu:
            raise ValueError(
                f"{name}: expected a CPU tensor, got one on {x.device} "
                "(flashattn has no GPU backend yet)")
        if x.dtype not in _torch_floats:
            raise ValueError(
                f"{name}: expected dtype float32, float16 or bfloat16, got {x.dtype}")
        return "torch"
    if isinstance(x, np.ndarray):
        if x.dtype not in _NUMPY_FLOATS and x.dtype.name != "bfloat16":
            raise ValueError(
                f"{name}: expected dtype float32, float16 or bfloat16 (ml_dtypes), "
                f"got {x.dtype}")
        return "numpy"
    raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got "
                    f"{type(x).__module__}.{type(x).__name__}")


def _same_framework(x: Any, name: str, framework: str) -> None:
    if _framework(x, name) != framework:
        kind = "torch.Tensor" if framework == "torch" else "numpy.ndarray"
        raise TypeError(f"{name}: expected a {kind}, as q is, got {type(x).__name__}")


def _native(x: Any, *, writable: bool = False, name: str = "") -> Any:
    """The array the extension reads (numpy arrays and torch tensors, both read in place):
    a copy of an input whose last dim is not contiguous, numpy bf16 seen as uint16."""
    if not isinstance(x, np.ndarray):  # a torch tensor, read through its attributes
        if x.dim() > 0 and x.stride(-1) != 1 and x.numel() > 0:
            if writable:
                raise ValueError(f"{name}: expected a contiguous last dim (stride 1), "
                                 f"got stride {x.stride(-1)}")
            x = x.contiguous()
        return x
    if writable and not x.flags.writeable:
        raise ValueError(f"{name}: expected a writable array, got a read-only one")
    if x.ndim > 0 and x.strides[-1] != x.itemsize and x.size > 0:
        if writable:
            raise ValueError(f"{name}: expected a contiguous last dim, got stride "
                             f"{x.strides[-1]} bytes")
        x = np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":
        x = x.view(np.uint16)
    return x


# Outputs of this many bytes or more are allocated by numpy, also for torch callers.
_NUMPY_ALLOCATED_BYTES = 4 << 20


def _empty(framework: str, shape: Sequence[int], dtype: Any) -> Any:
    """An uninitialised output. A large torch output is numpy's memory seen as a tensor: numpy
    offers its large arrays to the kernel for transparent huge pages (madvise), torch.empty does
    not, and the first write into fresh 4 KiB pages costs the seed shape's 32 MiB output ~8 ms of
    page faults against ~2 ms (bench/RESULTS.md, "Inside a PyTorch process")."""
    shape = tuple(shape)
    if framework != "torch":
        return np.empty(shape, dtype=dtype)
    torch = _torch()
    if dtype.itemsize * math.prod(shape) < _NUMPY_ALLOCATED_BYTES:
        return torch.empty(shape, dtype=dtype)
    # bf16 as uint16, which numpy has: the same bytes, viewed as bf16.
    numpy_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(dtype, np.uint16)
    return torch.from_numpy(np.empty(shape, dtype=numpy_dtype)).view(dtype)


def _float32(framework: str) -> Any:
    return _torch().float32 if framework == "torch" else np.float32


def _float_vector(x: Any, name: str) -> Any:
    """alibi_slopes and sinks: float32, contiguous."""
    if x is None:
        return None
    if _is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
        return x.detach().to(_torch().float32).contiguous()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def _int32(x: Any, name: str) -> Any:
    """cu_seqlens, cache_seqlens, block_table: int32, contiguous; other integers converted."""
    if _is_torch(x):
        torch = _torch()
        if not x.is_cpu:
            raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"{name}: expected an int32 tensor, got {x.dtype}")
        x = x.detach().cpu().numpy()
    array = np.asarray(x)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected int32 values, got dtype {array.dtype}")
    if array.size and (array.min() < -2**31 or array.max() >= 2**31):
        raise ValueError(f"{name}: values outside int32")
    return np.ascontiguousarray(array, dtype=np.int32)


def _torch_vector(x: Any, name: str) -> Any:
    """alibi_slopes and sinks for the torch ops: a CPU tensor as given (its autograd kept), or
    None; numbers and arrays become float32 tensors."""
    if x is None:
        return None
    torch = _torch()
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
        return x
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))


def _torch_int32(x: Any, name: str) -> Any:
    """cu_seqlens, cache_seqlens, block_table for the torch ops: a contiguous int32 tensor."""
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        return torch.from_numpy(_int32(x, name))
    if x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected an int32 tensor, got {x.dtype}")
    if x.dtype != torch.int32:
        # The range check reads the values: skipped while torch.compile traces (no data then).
        if (x.numel() and not torch.compiler.is_compiling()
                and (x.min() < -2**31 or x.max() >= 2**31)):
            raise ValueError(f"{name}: values outside int32")
        x = x.to(torch.int32)
    return x.contiguous()


def _scale(softmax_scale: Optional[float]) -> Optional[float]:
    return None if softmax_scale is None else float(softmax_scale)


def _mask(x: Any, name: str) -> Any:
    if x is None:
        return None
    if _is_torch(x):
        if x.dtype != _torch().bool:
            raise ValueError(f"{name}: expected a bool tensor, got {x.dtype}")
        return _native(x)
    if not isinstance(x, np.ndarray) or x.dtype != np.bool_:
        raise ValueError(f"{name}: expected a bool array")
    return _native(x)


def _bias(x: Any) -> Any:
    if x is None:
        return None
    _framework(x, "attn_bias")
    return _native(x)


def _window(window_size: Tuple[int, int]) -> Tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}")
    return int(left), int(right)


def _impl(impl: str) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl: expected one of {', '.join(_IMPLS)}, got {impl!r}")
    return impl


def _results(out, lse, return_lse: bool, return_attn_probs: bool, s_dmask=None):
    """What FlashAttention returns: out, or with return_attn_probs (out, softmax_lse, S_dmask),
    S_dmask None without dropout (FlashAttention's is then empty: it only encodes a dropout
    pattern); with return_lse (ours), (out, lse)."""
    if return_attn_probs:
        return out, lse, s_dmask
    return (out, lse) if return_lse else out


def _options(framework: str, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
             attn_bias, attn_mask, num_threads) -> dict:
    left, right = _window(window_size)
    return dict(
        scale=_scale(softmax_scale),
        causal=bool(causal),
        window_left=left,
        window_right=right,
        softcap=float(softcap),
        alibi_slopes=_float_vector(alibi_slopes, "alibi_slopes"),
        sinks=_float_vector(sinks, "sinks"),
        attn_bias=_bias(attn_bias),
        attn_mask=_mask(attn_mask, "attn_mask"),
        num_threads=int(num_threads),
    )


def _forward_arrays(framework, q, k, v, options, impl, out_heads_first=False, want_lse=True):
    """Runs the forward; returns (out, lse) in the framework of q, lse None unless wanted.
    out_heads_first: out is stored [B, H, S, D] (torch's layout, for the SDPA drop-in) and
    returned as a [B, S, H, D] view of it."""
    if q.ndim != 4:
        raise ValueError(f"q: expected 4 dims [batch, seqlen_q, heads_q, head_dim], got {q.ndim}")
    batch, seqlen_q, heads_q, _ = q.shape
    head_dim_v = v.shape[-1]  # out's: v's head dim, which may differ from q's and k's
    if out_heads_first:
        out = _empty(framework, (batch, heads_q, seqlen_q, head_dim_v), q.dtype).transpose(1, 2)
    else:
        out = _empty(framework, (batch, seqlen_q, heads_q, head_dim_v), q.dtype)
    lse = _empty(framework, (batch, heads_q, seqlen_q), _float32(framework)) if want_lse else None
    _flashattn.forward(impl, _native(q), _native(k), _native(v),
                       _native(out, writable=True, name="out"), lse, **options)
    return out, lse


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, sinks=None, attn_bias=None,
                    attn_mask=None, return_lse: bool = False, num_threads: int = 0,
                    impl: str = "flash", dropout_seed: Optional[int] = None,
                    dropout_offset: int = 0):
    """Exact attention of q [B, Sq, Hq, D] against k, v [B, Skv, Hkv, D] (Hq % Hkv == 0).

    Named and ordered as FlashAttention's ``flash_attn_func``, so code ports by changing the
    import. Tensors: numpy arrays or torch CPU tensors, float32, float16 or bfloat16, any
    strides with a contiguous last dim (others are copied). Returns ``out`` [B, Sq, Hq, D] in
    q's dtype and framework, and with ``return_lse=True`` also ``lse`` float32 [B, Hq, Sq].

    - softmax_scale: default 1/sqrt(D).
    - causal: aligned to the bottom-right corner (FlashAttention >= 2.1): row i sees key j
      iff j <= i + Skv - Sq.
    - window_size: (left, right) sliding window on the same diagonal, -1 = unbounded.
    - softcap, alibi_slopes ([Hq] or [B, Hq], float32), sinks ([Hq]), attn_bias
      ([B|1, Hq|1, Sq, Skv], float), attn_mask (same shape, bool, True = keep): the score
      modifiers of docs/semantics.md.
    - dropout_p: attention dropout as FlashAttention's (each probability kept with 1 - p and
      scaled by 1 / (1 - p); lse is the softmax's before it). The mask comes from a
      counter-based generator keyed by a seed and offset drawn from torch's default generator
      for torch tensors (torch.manual_seed reproduces it), from numpy's global one for numpy
      arrays, or given as dropout_seed (an integer in [0, 2^64)) and dropout_offset ([0, 2^32));
      the backward regenerates it. deterministic is accepted and moot (results never depend
      on the thread count, with dropout too).
    - return_attn_probs=True returns (out, lse, S_dmask) as FlashAttention does: S_dmask None
      without dropout; with dropout [B, Hq, Sq, Skv] rounded up to 128, FlashAttention's
      encoding of the probabilities (negative where dropped; a test aid, O(Sq·Skv) memory).
    - num_threads: 0 = all OpenMP threads.
    - impl: "flash" (default), "standard" (full score matrix, OpenBLAS) or "reference" (fp64).

    With torch tensors that require grad (and grad mode on), the call is recorded for
    autograd: backward runs the flash backward with the saved lse, and gives gradients for q,
    k, v, sinks and attn_bias.
    """
    want_lse = return_lse or return_attn_probs
    framework = _framework(q, "q")
    _same_framework(k, "k", framework)
    _same_framework(v, "v", framework)
    impl = _impl(impl)
    dropout_p = _dropout.check_p(dropout_p)
    rng = _dropout.draw(framework, dropout_p, dropout_seed, dropout_offset)
    if framework == "torch":
        from . import _torch_ops
        left, right = _window(window_size)
        if attn_mask is not None:
            _mask(attn_mask, "attn_mask")
        if attn_bias is not None:
            _framework(attn_bias, "attn_bias")
        out, lse = _torch_ops.attention(q, k, v, _torch_vector(alibi_slopes, "alibi_slopes"),
                                        _torch_vector(sinks, "sinks"), attn_bias, attn_mask,
                                        _scale(softmax_scale), bool(causal), left, right,
                                        float(softcap), int(num_threads), impl, False,
                                        want_lse=want_lse, dropout_p=dropout_p, dropout_rng=rng)
    else:
        options = _options(framework, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           sinks, attn_bias, attn_mask, num_threads)
        options.update(_dropout.options(dropout_p, rng))
        out, lse = _forward_arrays(framework, q, k, v, options, impl, want_lse=want_lse)
    s_dmask = None
    if return_attn_probs and dropout_p > 0.0:
        s_dmask = _dropout.s_dmask(q, k, rng, dropout_p, softmax_scale, causal,
                                   _window(window_size), float(softcap), alibi_slopes)
    return _results(out, lse, return_lse, return_attn_probs, s_dmask)


def attention_reference(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                        window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes=None, *, sinks=None, attn_bias=None, attn_mask=None,
                        return_lse: bool = False):
    """The fp64 oracle: plain loops with fp64 accumulation, rounded once to q's dtype.

    Same arguments and results as flash_attn_func; for checking your own code. No autograd.
    """
    framework = _framework(q, "q")
    _same_framework(k, "k", framework)
    _same_framework(v, "v", framework)
    options = _options(framework, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       sinks, attn_bias, attn_mask, 0)
    out, lse = _forward_arrays(framework, q, k, v, options, "reference")
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table=None, *, sinks=None,
                           return_lse: bool = False, num_threads: int = 0, impl: str = "flash",
                           dropout_seed: Optional[int] = None, dropout_offset: int = 0,
                           k_scale=None, v_scale=None, cache_dtype: Optional[str] = None):
    """Attention over a packed batch of sequences of different lengths.

    q [total_q, Hq, D], k, v [total_k, Hkv, D]: the sequences one after the other;
    cu_seqlens_q, cu_seqlens_k [B + 1] int32 offsets (0, then running totals). Each sequence
    attends to its own keys, causal mask and window aligned to its own bottom-right corner.
    Returns out [total_q, Hq, D] and, with return_lse, lse float32 [Hq, total_q]; with
    return_attn_probs, (out, lse, None) as flash_attn_func.
    max_seqlen_q and max_seqlen_k are accepted for FlashAttention compatibility and unused.
    Autograd as flash_attn_func (q, k, v, sinks). Dropout as flash_attn_func's, sequence b's
    mask that of batch entry b; S_dmask [B, Hq, max Sq, max Skv] (rounded up to 128), sequence
    b's rows and keys from 0.

    block_table (int32 [B, pages_per_sequence], FlashAttention >= 2.5): k and v are a paged
    cache [num_pages, page_size, Hkv, D] and sequence b's keys are the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages, in table order. Forward only.
    The pages may be an int8 or fp8 pool with k_scale, v_scale and cache_dtype as
    flash_attn_with_kvcache takes them (read only here).
    """
    from . import _quantized
    framework = _framework(q, "q")
    _quantized.same_framework(k, "k", framework)
    _quantized.same_framework(v, "v", framework)
    quantized = (k_scale is not None or v_scale is not None or cache_dtype is not None or
                 bool(_quantized.cache_format(k, cache_dtype)))
    if quantized and block_table is None:
        raise ValueError("k_scale, v_scale: a quantized k and v are a paged pool: expected a "
                         "block_table")
    if quantized and not _quantized.cache_format(k, cache_dtype):
        _quantized.kvcache_arguments(k, v, k_scale, v_scale, cache_dtype, framework,
                                     writable=False)  # raises, naming the scale
    impl = _impl(impl)
    dropout_p = _dropout.check_p(dropout_p)
    if dropout_p > 0.0 and block_table is not None:
        raise ValueError(f"dropout_p: expected 0 with block_table (the paged varlen call is "
                         f"serving, without dropout), got {dropout_p}")
    rng = _dropout.draw(framework, dropout_p, dropout_seed, dropout_offset)
    if framework == "torch":
        from . import _torch_ops
        left, right = _window(window_size)
        scalars = (_scale(softmax_scale), bool(causal), left, right, float(softcap),
                   int(num_threads), impl)
        cu_q = _torch_int32(cu_seqlens_q, "cu_seqlens_q")
        cu_k = _torch_int32(cu_seqlens_k, "cu_seqlens_k")
        alibi_slopes = _torch_vector(alibi_slopes, "alibi_slopes")
        sinks = _torch_vector(sinks, "sinks")
        if block_table is None:
            out, lse = _torch_ops.varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes, sinks,
                                                   *scalars, dropout_p, rng)
        else:
            torch = _torch()
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                               for t in (q, k, v, sinks)):
                raise NotImplementedError(
                    "block_table: the paged varlen call is a forward only (serving); call it "
                    "under torch.no_grad(), or pass k and v packed for a backward")
            scales = (None, None)
            if _quantized.cache_format(k, cache_dtype):
                scales = (_quantized.scale_view(k_scale, "k_scale", k, framework),
                          _quantized.scale_view(v_scale, "v_scale", v, framework))
            out, lse = _torch_ops.varlen_paged_attention(
                q, k, v, _torch_int32(block_table, "block_table"), cu_q, cu_k, alibi_slopes,
                sinks, *scalars, *scales, cache_dtype)
    else:
        cu_q = _int32(cu_seqlens_q, "cu_seqlens_q")
        cu_k = _int32(cu_seqlens_k, "cu_seqlens_k")
        table = None if block_table is None else _int32(block_table, "block_table")
        options = _options(framework, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           sinks, None, None, num_threads)
        options.update(_dropout.options(dropout_p, rng))
        out, lse = _varlen_forward_arrays(framework, q, k, v, cu_q, cu_k, options, impl, table,
                                          (k_scale, v_scale, cache_dtype))
    s_dmask = None
    if return_attn_probs and dropout_p > 0.0:
        s_dmask = _dropout.s_dmask(q, k, rng, dropout_p, softmax_scale, causal,
                                   _window(window_size), float(softcap), alibi_slopes,
                                   cu_seqlens_q, cu_seqlens_k)
    return _results(out, lse, return_lse, return_attn_probs, s_dmask)


def _varlen_forward_arrays(framework, q, k, v, cu_q, cu_k, options, impl, block_table=None,
                           quantization=(None, None, None)):
    """The varlen forward's (out, lse); with block_table, k and v are pages (a quantized pool
    with `quantization` = (k_scale, v_scale, cache_dtype))."""
    if q.ndim != 3:
        raise ValueError(f"q: expected 3 dims [total_q, heads_q, head_dim], got {q.ndim}")
    total_q, heads_q, _ = q.shape
    out = _empty(framework, (total_q, heads_q, v.shape[-1]), q.dtype)
    lse = _empty(framework, (heads_q, total_q), _float32(framework))
    outputs = (_native(out, writable=True, name="out"), _native(lse))
    if block_table is None:
        _flashattn.varlen_forward(impl, _native(q), _native(k), _native(v), cu_q, cu_k, *outputs,
                                  **options)
    else:
        if k.ndim != 4:
            raise ValueError(f"k: expected a paged cache [num_pages, page_size, heads_kv, "
                             f"head_dim] with block_table, got {k.ndim} dims")
        from . import _quantized
        cache = _quantized.kvcache_arguments(k, v, *quantization, framework, writable=False)
        _flashattn.varlen_paged_forward(impl, _native(q), cache["k_cache"], cache["v_cache"],
                                        cache["cache_dtype"], cache["k_scale"], cache["v_scale"],
                                        block_table, cu_q, cu_k, *outputs, **options)
    return out, lse


def _unpacked(packed: Any, name: str, ndim: int, count: int) -> Tuple[Any, ...]:
    """The `count` tensors stacked along dim ndim - 3 of `packed`, as views (no copy)."""
    framework = _framework(packed, name)
    shape = tuple(packed.shape)
    if len(shape) != ndim or shape[-3] != count:
        layout = {(5, 3): "[batch, seqlen, 3, heads, head_dim]",
                  (5, 2): "[batch, seqlen_k, 2, heads_k, head_dim]",
                  (4, 3): "[total, 3, heads, head_dim]",
                  (4, 2): "[total_k, 2, heads_k, head_dim]"}[(ndim, count)]
        raise ValueError(f"{name}: expected {layout}, got shape {list(shape)}")
    axis = ndim - 3
    if framework == "torch":
        return tuple(packed.select(axis, i) for i in range(count))
    return tuple(packed[(slice(None),) * axis + (i,)] for i in range(count))


def _packed_op_applies(packed: Any, kwargs: dict) -> bool:
    """Whether a packed call on torch tensors goes through the packed op (its gradient written
    into one tensor): all but those with a bias or mask, which take flash_attn_func's path."""
    return (_is_torch(packed) and kwargs.get("attn_bias") is None
            and kwargs.get("attn_mask") is None)


def _packed_torch(q, packed, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_attn_probs, *, sinks=None,
                  return_lse: bool = False, num_threads: int = 0, impl: str = "flash",
                  dropout_seed: Optional[int] = None, dropout_offset: int = 0):
    """A packed variant on torch tensors through _torch_ops.packed_fwd: the forward reads the
    views, the backward writes the packed gradient into one tensor."""
    from . import _torch_ops
    if q is not None:
        _same_framework(q, "q", "torch")
    impl = _impl(impl)
    dropout_p = _dropout.check_p(dropout_p)
    rng = _dropout.draw("torch", dropout_p, dropout_seed, dropout_offset)
    left, right = _window(window_size)
    varlen = cu_seqlens_q is not None
    cu_q = _torch_int32(cu_seqlens_q, "cu_seqlens_q") if varlen else None
    cu_k = _torch_int32(cu_seqlens_k, "cu_seqlens_k") if varlen else None
    out, lse = _torch_ops.packed_attention(
        q, packed, cu_q, cu_k, _torch_vector(alibi_slopes, "alibi_slopes"),
        _torch_vector(sinks, "sinks"), _scale(softmax_scale), bool(causal), left, right,
        float(softcap), int(num_threads), impl, dropout_p, rng)
    s_dmask = None
    if return_attn_probs and dropout_p > 0.0:
        axis = packed.dim() - 3
        keys = packed.select(axis, packed.shape[axis] - 2)
        queries = packed.select(axis, 0) if q is None else q
        s_dmask = _dropout.s_dmask(queries, keys, rng, dropout_p, softmax_scale, causal,
                                   (left, right), float(softcap), alibi_slopes, cu_q, cu_k)
    return _results(out, lse, return_lse, return_attn_probs, s_dmask)


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes=None,
                              deterministic: bool = False, return_attn_probs: bool = False,
                              **kwargs):
    """flash_attn_func on q, k, v stacked in one qkv [B, S, 3, H, D], as FlashAttention's: the
    three are read in place (views of qkv, no copy), and with autograd the backward writes dq,
    dk, dv straight into one gradient shaped as qkv. kwargs: flash_attn_func's keyword-only
    options (sinks, return_lse, num_threads, impl, dropout_seed, ...)."""
    q, k, v = _unpacked(qkv, "qkv", 5, 3)
    if _packed_op_applies(qkv, kwargs):
        return _packed_torch(None, qkv, None, None, dropout_p, softmax_scale, causal, window_size,
                             softcap, alibi_slopes, return_attn_probs, **kwargs)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, **kwargs)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                             return_attn_probs: bool = False, **kwargs):
    """flash_attn_func with k, v stacked in one kv [B, Skv, 2, Hkv, D] (GQA: Hq % Hkv == 0), read
    in place; with autograd the backward writes dk, dv straight into one gradient shaped as
    kv."""
    k, v = _unpacked(kv, "kv", 5, 2)
    if _packed_op_applies(kv, kwargs):
        return _packed_torch(q, kv, None, None, dropout_p, softmax_scale, causal, window_size,
                             softcap, alibi_slopes, return_attn_probs, **kwargs)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, **kwargs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen=None, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1),
                                     softcap: float = 0.0, alibi_slopes=None,
                                     deterministic: bool = False,
                                     return_attn_probs: bool = False, **kwargs):
    """flash_attn_varlen_func on qkv [total, 3, H, D] (the sequences packed one after the other,
    cu_seqlens [B + 1] for queries and keys alike), read in place."""
    q, k, v = _unpacked(qkv, "qkv", 4, 3)
    if _packed_op_applies(qkv, kwargs):
        return _packed_torch(None, qkv, cu_seqlens, cu_seqlens, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, return_attn_probs, **kwargs)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, **kwargs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                                    max_seqlen_k=None, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes=None, deterministic: bool = False,
                                    return_attn_probs: bool = False, **kwargs):
    """flash_attn_varlen_func with k, v stacked in one kv [total_k, 2, Hkv, D], read in place."""
    k, v = _unpacked(kv, "kv", 4, 2)
    if _packed_op_applies(kv, kwargs):
        return _packed_torch(q, kv, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, return_attn_probs, **kwargs)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  **kwargs)


def _kvcache_extras(rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad,
                    cache_batch_idx) -> dict:
    """kvcache_forward's rotary and cache-index keywords: tables as contiguous float32 (a 16-bit
    table widens exactly), indices as contiguous int32."""
    def table(x):
        if x is None:
            return None
        if _is_torch(x):
            return x.detach().to(_torch().float32).contiguous()
        return np.ascontiguousarray(np.asarray(x).astype(np.float32, copy=False))

    def index(x, name):
        if x is None:
            return None
        if _is_torch(x):
            return _torch_int32(x, name).contiguous()
        return _int32(x, name)

    return dict(rotary_cos=table(rotary_cos), rotary_sin=table(rotary_sin),
                rotary_interleaved=bool(rotary_interleaved),
                cache_leftpad=index(cache_leftpad, "cache_leftpad"),
                cache_batch_idx=index(cache_batch_idx, "cache_batch_idx"))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes=None,
                            num_splits: int = 0, return_softmax_lse: bool = False, *,
                            k_scale=None, v_scale=None, cache_dtype: Optional[str] = None,
                            num_threads: int = 0, impl: str = "flash"):
    """One step of decoding (or a chunk of prefill) against a KV cache, appending in place.

    q [B, Sq, Hq, D]. Dense cache: k_cache [B, capacity, Hkv, D], v_cache [..., Dv] (Dv may
    differ from D); paged cache (with block_table int32 [B, pages_per_sequence]): [num_pages,
    page_size, Hkv, D] (Dv). k [B, Snew, Hkv, D], v [..., Dv], when given, are written into the
    cache at cache_seqlens[b] before q attends to the first cache_seqlens[b] + Snew keys of each
    sequence (causal and window aligned to that length). cache_seqlens (int or int32 [B]) is
    read, never changed: add Snew to it yourself after the call. None means every sequence fills
    its whole capacity (no append). Caches: float32, float16 or bfloat16, and q may be float32
    with a 16-bit cache; they must be writable and have a contiguous last dim (they are written
    in place, never copied). MLA's shared latent cache: v_cache = k_cache[..., :Dv] and k
    without v, which appends each latent row once. Returns out [B, Sq, Hq, Dv] in q's dtype,
    and lse [B, Hq, Sq] with return_softmax_lse.

    As FlashAttention 2.8:
    rotary_cos, rotary_sin [seqlen_ro, rotary_dim / 2] (any float dtype, read as float32;
    rotary_dim even, <= D): with k, v given, the new keys are rotated at positions
    cache_seqlens[b] + i before they are written (the cache holds rotated keys), and q at the
    same positions when causal or windowed, else every q row at cache_seqlens[b].
    rotary_interleaved=True pairs dims (2i, 2i + 1) (GPT-J), False pairs (i, i + rotary_dim / 2)
    (GPT-NeoX); dims past rotary_dim are left as they are. Every position must be < seqlen_ro.
    cache_leftpad int32 [B] (dense caches): sequence b's keys start at row cache_leftpad[b] of
    its cache (<= cache_seqlens[b]); the masks and ALiBi count from there, rotary positions do
    not. cache_batch_idx int32 [B] (dense caches): batch entry b uses row cache_batch_idx[b] of
    k_cache, v_cache [B_cache, capacity, Hkv, D]; distinct entries when appending.
    num_splits is accepted and unused (the split follows from the shape).

    Quantized caches (docs/python.md, "Quantized KV caches"): k_cache, v_cache int8 or fp8
    (torch.float8_e4m3fn / float8_e5m2, ml_dtypes' float8 types, or uint8 bytes with
    cache_dtype="fp8_e4m3" / "fp8_e5m2" / "int8") hold codes whose values are code * scale;
    k_scale, v_scale float32: a number (per tensor), [Hkv] (per KV head), the cache's
    [dim 0, dim 1, Hkv] (per row) or [dim 0, dim 1, Hkv, groups] (per group of D / groups dims).
    New rows k, v (any float dtype) are quantized in place: int8 computes each row's scales and
    writes them into k_scale, v_scale (per row or group, writable), fp8 divides by the scales.
    """
    from . import _quantized
    framework = _framework(q, "q")
    _quantized.same_framework(k_cache, "k_cache", framework)
    _quantized.same_framework(v_cache, "v_cache", framework)
    if v is not None and k is None:
        raise ValueError("v: expected new K rows k beside the new V rows, got none")
    if k is not None:
        _same_framework(k, "k", framework)
    if v is not None:
        _same_framework(v, "v", framework)
    if q.ndim != 4:
        raise ValueError(f"q: expected 4 dims [batch, seqlen_q, heads_q, head_dim], got {q.ndim}")
    batch, seqlen_q, heads_q, _ = q.shape
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: required when appending new rows (k, v)")
        capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                    else k_cache.shape[1])
        cache_seqlens = np.full(batch, capacity, dtype=np.int64)
    elif isinstance(cache_seqlens, (int, np.integer)):
        cache_seqlens = np.full(batch, int(cache_seqlens), dtype=np.int64)
    impl = _impl(impl)
    if framework == "torch":
        from . import _torch_ops
        left, right = _window(window_size)
        table = None if block_table is None else _torch_int32(block_table, "block_table")
        quantized = _quantized.cache_format(k_cache, cache_dtype)
        scales = (None, None) if not quantized else (
            _quantized.scale_view(k_scale, "k_scale", k_cache, framework),
            _quantized.scale_view(v_scale, "v_scale", v_cache, framework))
        if not quantized and (k_scale is not None or v_scale is not None):
            _quantized.kvcache_arguments(k_cache, v_cache, k_scale, v_scale, cache_dtype,
                                         framework)  # raises, naming the scale
        out, lse = _torch_ops.kvcache_attention(
            q, k_cache, v_cache, _torch_int32(cache_seqlens, "cache_seqlens"), table, k, v,
            _torch_vector(alibi_slopes, "alibi_slopes"), _scale(softmax_scale), bool(causal),
            left, right, float(softcap), int(num_threads), impl,
            _torch_vector(rotary_cos, "rotary_cos"), _torch_vector(rotary_sin, "rotary_sin"),
            None if cache_leftpad is None else _torch_int32(cache_leftpad, "cache_leftpad"),
            None if cache_batch_idx is None else _torch_int32(cache_batch_idx, "cache_batch_idx"),
            bool(rotary_interleaved), scales[0], scales[1], cache_dtype)
    else:
        lengths = _int32(cache_seqlens, "cache_seqlens")
        table = None if block_table is None else _int32(block_table, "block_table")
        options = _options(framework, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           None, None, None, num_threads)
        out = _empty(framework, (batch, seqlen_q, heads_q, v_cache.shape[-1]), q.dtype)
        lse = _empty(framework, (batch, heads_q, seqlen_q), _float32(framework))
        _flashattn.kvcache_forward(
            impl, _native(q), **_quantized.kvcache_arguments(k_cache, v_cache, k_scale, v_scale,
                                                            cache_dtype, framework),
            cache_seqlens=lengths, block_table=table,
            k_new=None if k is None else _native(k), v_new=None if v is None else _native(v),
            out=_native(out, writable=True, name="out"), lse=_native(lse),
            **_kvcache_extras(rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad,
                              cache_batch_idx), **options)
    return (out, lse) if return_softmax_lse else out


def merge_attention_states(out_a, lse_a, out_b, lse_b, out_dtype=None, num_threads: int = 0):
    """The exact (out, lse) of attention over the union of two disjoint key sets.

    out_a, out_b float32 [B, S, H, D] (any strides, last dim contiguous), each normalized over
    its own keys; lse_a, lse_b float32 [B, H, S]. A side whose lse is -inf weighs 0. Returns
    (out, lse): out [B, S, H, D] in out_dtype (default float32), lse float32 [B, H, S].
    """
    framework = _framework(out_a, "out_a")
    for name, value in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _same_framework(value, name, framework)
    out = _empty(framework, out_a.shape, out_dtype or _float32(framework))
    lse = _empty(framework, tuple(lse_a.shape), _float32(framework))
    _flashattn.merge_states(_native(out_a), _native(lse_a), _native(out_b), _native(lse_b),
                            _native(out, writable=True, name="out"), _native(lse),
                            int(num_threads))
    return out, lse


class MultiHeadAttention:
    """The multi-head attention layer (seed 000): x -> Q, K, V -> attention -> merge -> W_O.

    Weights are float32 numpy arrays that view the layer's own memory, row-major [in, out] so
    that Q = x @ w_q: w_q [hidden, hidden]; w_k [hidden, num_kv_heads * head_dim]; w_v
    [hidden, num_kv_heads * value_head_dim]; w_o [num_heads * value_head_dim, hidden]
    (value_head_dim 0: head_dim, every matrix [hidden, hidden] without GQA); b_q .. b_o with
    bias=True. Write into them to load a model's weights. Initialized uniformly in
    +-1/sqrt(hidden) from `seed`.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int = 0, bias: bool = False,
                 seed: int = 0, value_head_dim: int = 0):
        self._layer = _flashattn.MultiHeadAttentionLayer(hidden, num_heads, num_kv_heads, bias,
                                                         seed, value_head_dim)

    def __getattr__(self, name: str) -> Any:
        if name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "value_head_dim", "w_q",
                    "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
            return getattr(self._layer, name)
        raise AttributeError(name)

    def __call__(self, x, context=None, causal: bool = False, impl: str = "flash",
                 num_threads: int = 0):
        """y [batch, seqlen, hidden] from x [batch, seqlen, hidden] (float32), self-attention,
        or cross-attention against context [batch, seqlen_kv, hidden]."""
        framework = _framework(x, "x")
        for name, value in (("x", x), ("context", context)):
            if value is None:
                continue
            _same_framework(value, name, framework)
            if value.dtype != _float32(framework):
                raise ValueError(f"{name}: expected dtype float32, got {value.dtype}")
        y = _empty(framework, x.shape, _float32(framework))

        def plain(a):
            if _is_torch(a):
                return a.detach().contiguous()
            return np.ascontiguousarray(a)

        self._layer.forward(plain(x), None if context is None else plain(context), y,
                            bool(causal), _impl(impl), int(num_threads))
        return y
