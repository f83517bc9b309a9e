"""flashattn's entry points as torch.library custom ops: torch.ops.flashattn.*.

Every torch call of the package goes through these ops, so that

- autograd comes from `register_autograd` (the backward op recomputes P block by block from the
  saved lse; it is never stored);
- `torch.compile(fullgraph=True)` sees one opaque node per call, shaped by the fake (meta)
  implementations below, instead of a Python function it cannot trace;
- the KV-cache op declares its in-place append (k_cache, v_cache) as a mutation.

Op arguments are plain: tensors (optional where the option is), then the scalar options in one
fixed order, and last dropout's p and its draw (_dropout: an int64 tensor [seed_low, seed_high,
offset], drawn by the caller from torch's generator, which the backward reuses). Inputs arrive
already checked for framework and dtype by _api; the C++ library checks the rest and raises
ValueError naming the argument. numpy callers never come here.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _api, _dropout, _flashattn

_LIB = "flashattn"


def _vector(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach().to(torch.float32).contiguous()


def _options(alibi_slopes, sinks, attn_bias, attn_mask, softmax_scale, causal, window_left,
             window_right, softcap, num_threads, dropout_p=0.0, dropout_rng=None) -> dict:
    return dict(scale=softmax_scale, causal=causal, window_left=window_left,
                window_right=window_right, softcap=softcap, alibi_slopes=_vector(alibi_slopes),
                sinks=_vector(sinks),
                attn_bias=None if attn_bias is None else _api._native(attn_bias),
                attn_mask=None if attn_mask is None else _api._native(attn_mask),
                num_threads=num_threads, **_dropout.options(dropout_p, dropout_rng))


def _empty_like(x: Tensor) -> Tensor:
    return _api._empty("torch", x.shape, x.dtype)


def _grad_output(dout: Tensor) -> Tensor:
    # Autograd may hand over an expanded gradient (stride 0 everywhere after a .sum()): any
    # strides are fine except a last dim that is not contiguous.
    return dout.contiguous() if dout.stride(-1) != 1 else dout


# --- forward and backward of flash_attn_func (and the SDPA drop-in) -----------------------------

def _fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
        attn_bias: Optional[Tensor], attn_mask: Optional[Tensor], softmax_scale: Optional[float],
        causal: bool, window_left: int, window_right: int, softcap: float, num_threads: int,
        impl: str, out_heads_first: bool, dropout_p: float = 0.0,
        dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out [B, Sq, Hq, D], lse float32 [B, Hq, Sq]); out_heads_first: out's memory is
    [B, Hq, Sq, D] (torch's SDPA layout) and a [B, Sq, Hq, D] view of it is returned."""
    options = _options(alibi_slopes, sinks, attn_bias, attn_mask, softmax_scale, causal,
                       window_left, window_right, softcap, num_threads, dropout_p, dropout_rng)
    return _api._forward_arrays("torch", q, k, v, options, impl, out_heads_first)


fwd = torch.library.custom_op(f"{_LIB}::fwd", _fwd, mutates_args=())


@fwd.register_fake
def _(q, k, v, alibi_slopes, sinks, attn_bias, attn_mask, softmax_scale, causal, window_left,
      window_right, softcap, num_threads, impl, out_heads_first, dropout_p=0.0, dropout_rng=None):
    batch, seqlen_q, heads_q, _ = q.shape
    head_dim_v = v.shape[-1]
    if out_heads_first:
        out = q.new_empty((batch, heads_q, seqlen_q, head_dim_v)).transpose(1, 2)
    else:
        out = q.new_empty((batch, seqlen_q, heads_q, head_dim_v))
    return out, q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], attn_bias: Optional[Tensor],
        attn_mask: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
        window_left: int, window_right: int, softcap: float, num_threads: int, impl: str,
        want_dsinks: bool, want_dbias: bool, dropout_p: float = 0.0,
        dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks, dbias); dsinks float32 [Hq] and dbias like attn_bias when wanted,
    else empty tensors (an op returns tensors, not None)."""
    options = _options(alibi_slopes, sinks, attn_bias, attn_mask, softmax_scale, causal,
                       window_left, window_right, softcap, num_threads, dropout_p, dropout_rng)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    dsinks = torch.empty(q.shape[2] if want_dsinks else 0, dtype=torch.float32)
    dbias = _empty_like(attn_bias) if want_dbias else torch.empty(0, dtype=q.dtype)
    _flashattn.backward(impl, _api._native(_grad_output(dout)), _api._native(q), _api._native(k),
                        _api._native(v), _api._native(out), lse, dq, dk, dv,
                        dsinks if want_dsinks else None, dbias if want_dbias else None, **options)
    return dq, dk, dv, dsinks, dbias


@bwd.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, sinks, attn_bias, attn_mask, softmax_scale, causal,
      window_left, window_right, softcap, num_threads, impl, want_dsinks, want_dbias,
      dropout_p=0.0, dropout_rng=None):
    dsinks = q.new_empty((q.shape[2] if want_dsinks else 0,), dtype=torch.float32)
    dbias = attn_bias.new_empty(attn_bias.shape) if want_dbias else q.new_empty((0,))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks, dbias)


# Positions of fwd's arguments: the tensors that can take a gradient, and the rest.
_FWD_NAMES = ("q", "k", "v", "alibi_slopes", "sinks", "attn_bias", "attn_mask", "softmax_scale",
              "causal", "window_left", "window_right", "softcap", "num_threads", "impl",
              "out_heads_first", "dropout_p", "dropout_rng")


def _save_context(ctx, args: dict, lse: Tensor, tensors: tuple, scalar_names: tuple) -> None:
    """What a forward op's backward reads: `tensors` and the dropout draw saved, the scalar
    options in order, dropout's p, the sinks' dtype; lse has no gradient."""
    ctx.save_for_backward(*tensors, args.get("dropout_rng"))
    ctx.scalars = tuple(args[name] for name in scalar_names)
    ctx.dropout_p = args.get("dropout_p", 0.0)
    ctx.sinks_dtype = None if args["sinks"] is None else args["sinks"].dtype
    ctx.mark_non_differentiable(lse)


def _fwd_setup_context(ctx, inputs, output):
    args = dict(zip(_FWD_NAMES, inputs))
    out, lse = output
    _save_context(ctx, args, lse, (args["q"], args["k"], args["v"], out, lse,
                                   args["alibi_slopes"], args["sinks"], args["attn_bias"],
                                   args["attn_mask"]), _FWD_NAMES[7:14])


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes, sinks, attn_bias, attn_mask, dropout_rng = ctx.saved_tensors
    want_dsinks = sinks is not None and ctx.needs_input_grad[4]
    want_dbias = attn_bias is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dsinks, dbias = bwd(dout, q, k, v, out, lse, alibi_slopes, sinks, attn_bias,
                                    attn_mask, *ctx.scalars, want_dsinks, want_dbias,
                                    ctx.dropout_p, dropout_rng)
    return (dq, dk, dv, None, dsinks.to(ctx.sinks_dtype) if want_dsinks else None,
            dbias if want_dbias else None) + (None,) * (len(_FWD_NAMES) - 6)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# --- varlen: packed [total, H, D] with cu_seqlens ------------------------------------------------

def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
               softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
               softcap: float, num_threads: int, impl: str, dropout_p: float = 0.0,
               dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out [total_q, Hq, D], lse float32 [Hq, total_q]); cu_seqlens int32 [B + 1]."""
    options = _options(alibi_slopes, sinks, None, None, softmax_scale, causal, window_left,
                       window_right, softcap, num_threads, dropout_p, dropout_rng)
    return _api._varlen_forward_arrays("torch", q, k, v, cu_seqlens_q, cu_seqlens_k, options,
                                       impl)


varlen_fwd = torch.library.custom_op(f"{_LIB}::varlen_fwd", _varlen_fwd, mutates_args=())


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, softmax_scale, causal,
      window_left, window_right, softcap, num_threads, impl, dropout_p=0.0, dropout_rng=None):
    total_q, heads_q, _ = q.shape
    return (q.new_empty((total_q, heads_q, v.shape[-1])),
            q.new_empty((heads_q, total_q), dtype=torch.float32))


@torch.library.custom_op(f"{_LIB}::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor],
               sinks: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
               window_left: int, window_right: int, softcap: float, num_threads: int, impl: str,
               want_dsinks: bool, dropout_p: float = 0.0,
               dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks); dsinks float32 [Hq] when wanted, else empty."""
    options = _options(alibi_slopes, sinks, None, None, softmax_scale, causal, window_left,
                       window_right, softcap, num_threads, dropout_p, dropout_rng)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    dsinks = torch.empty(q.shape[1] if want_dsinks else 0, dtype=torch.float32)
    _flashattn.varlen_backward(impl, _api._native(_grad_output(dout)), _api._native(q),
                               _api._native(k), _api._native(v), _api._native(out), lse,
                               cu_seqlens_q, cu_seqlens_k, dq, dk, dv,
                               dsinks if want_dsinks else None, **options)
    return dq, dk, dv, dsinks


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, softmax_scale,
      causal, window_left, window_right, softcap, num_threads, impl, want_dsinks, dropout_p=0.0,
      dropout_rng=None):
    dsinks = q.new_empty((q.shape[1] if want_dsinks else 0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


_VARLEN_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "sinks",
                 "softmax_scale", "causal", "window_left", "window_right", "softcap",
                 "num_threads", "impl", "dropout_p", "dropout_rng")


def _varlen_setup_context(ctx, inputs, output):
    args = dict(zip(_VARLEN_NAMES, inputs))
    out, lse = output
    _save_context(ctx, args, lse, (args["q"], args["k"], args["v"], out, lse,
                                   args["cu_seqlens_q"], args["cu_seqlens_k"],
                                   args["alibi_slopes"], args["sinks"]), _VARLEN_NAMES[7:14])


def _varlen_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks, dropout_rng = ctx.saved_tensors
    want_dsinks = sinks is not None and ctx.needs_input_grad[6]
    dq, dk, dv, dsinks = varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks,
                                    *ctx.scalars, want_dsinks, ctx.dropout_p, dropout_rng)
    return (dq, dk, dv, None, None, None, dsinks.to(ctx.sinks_dtype) if want_dsinks else None
            ) + (None,) * (len(_VARLEN_NAMES) - 7)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def _varlen_paged_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                      cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor],
                      sinks: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                      window_left: int, window_right: int, softcap: float, num_threads: int,
                      impl: str, k_scale: Optional[Tensor] = None,
                      v_scale: Optional[Tensor] = None,
                      cache_dtype: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """varlen_fwd with K and V in pages [num_pages, page_size, Hkv, D] read through block_table
    [B, pages]; cu_seqlens_k counts each sequence's keys; an int8 or fp8 pool with its scales
    [num_pages, page_size, Hkv, groups] (broadcast views allowed). Forward only (serving)."""
    options = _options(alibi_slopes, sinks, None, None, softmax_scale, causal, window_left,
                       window_right, softcap, num_threads)
    return _api._varlen_forward_arrays("torch", q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                                       options, impl, block_table, (k_scale, v_scale, cache_dtype))


varlen_paged_fwd = torch.library.custom_op(f"{_LIB}::varlen_paged_fwd", _varlen_paged_fwd,
                                           mutates_args=())


@varlen_paged_fwd.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks,
      softmax_scale, causal, window_left, window_right, softcap, num_threads, impl, k_scale=None,
      v_scale=None, cache_dtype=None):
    total_q, heads_q, _ = q.shape
    return (q.new_empty((total_q, heads_q, v_cache.shape[-1])),
            q.new_empty((heads_q, total_q), dtype=torch.float32))


# --- packed q, k, v: FlashAttention's qkvpacked and kvpacked variants ----------------------------
#
# The forward reads the packed tensor through views; the backward writes dq, dk, dv straight into
# one gradient tensor shaped as the packed one (as FlashAttention's packed functions do), instead
# of autograd's three zero-filled full-size tensors (one per view) and their sum.

def _packed_views(q: Optional[Tensor], packed: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(q, k, v): qkv [..., 3, H, D] when q is None, else kv [..., 2, Hkv, D] beside q."""
    axis = packed.dim() - 3
    parts = tuple(packed.select(axis, i) for i in range(packed.shape[axis]))
    return parts if q is None else (q, *parts)


def _packed_fwd(q: Optional[Tensor], packed: Tensor, cu_seqlens_q: Optional[Tensor],
                cu_seqlens_k: Optional[Tensor], alibi_slopes: Optional[Tensor],
                sinks: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                window_left: int, window_right: int, softcap: float, num_threads: int, impl: str,
                dropout_p: float = 0.0,
                dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """fwd (or varlen_fwd, with cu_seqlens) of the views of the packed tensor."""
    q, k, v = _packed_views(q, packed)
    options = _options(alibi_slopes, sinks, None, None, softmax_scale, causal, window_left,
                       window_right, softcap, num_threads, dropout_p, dropout_rng)
    if cu_seqlens_q is None:
        return _api._forward_arrays("torch", q, k, v, options, impl)
    return _api._varlen_forward_arrays("torch", q, k, v, cu_seqlens_q, cu_seqlens_k, options, impl)


packed_fwd = torch.library.custom_op(f"{_LIB}::packed_fwd", _packed_fwd, mutates_args=())


@packed_fwd.register_fake
def _(q, packed, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, softmax_scale, causal,
      window_left, window_right, softcap, num_threads, impl, dropout_p=0.0, dropout_rng=None):
    query = _packed_views(q, packed)[0]
    if cu_seqlens_q is None:
        batch, seqlen_q, heads_q, _ = query.shape
        lse_shape = (batch, heads_q, seqlen_q)
    else:
        lse_shape = (query.shape[1], query.shape[0])
    return query.new_empty(query.shape), query.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::packed_bwd", mutates_args=())
def packed_bwd(dout: Tensor, q: Optional[Tensor], packed: Tensor, out: Tensor, lse: Tensor,
               cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
               alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
               softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
               softcap: float, num_threads: int, impl: str, want_dsinks: bool,
               dropout_p: float = 0.0,
               dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dpacked, dsinks): dpacked shaped as packed, holding dk, dv (and dq for qkv, dq then
    empty); dsinks float32 [Hq] when wanted, else empty."""
    options = _options(alibi_slopes, sinks, None, None, softmax_scale, causal, window_left,
                       window_right, softcap, num_threads, dropout_p, dropout_rng)
    dpacked = _empty_like(packed)
    views = _packed_views(q, packed)
    if q is None:
        dq, dk, dv = _packed_views(None, dpacked)
    else:
        dq = _empty_like(q)
        _, dk, dv = _packed_views(dq, dpacked)
    heads_q = views[0].shape[-2]
    dsinks = torch.empty(heads_q if want_dsinks else 0, dtype=torch.float32)
    grads = (dq, dk, dv, dsinks if want_dsinks else None)
    natives = [_api._native(x) for x in (_grad_output(dout), *views, out)]
    if cu_seqlens_q is None:
        _flashattn.backward(impl, *natives, lse, *grads[:3], grads[3], None, **options)
    else:
        _flashattn.varlen_backward(impl, *natives, lse, cu_seqlens_q, cu_seqlens_k, *grads,
                                   **options)
    return (torch.empty(0, dtype=dpacked.dtype) if q is None else dq), dpacked, dsinks


@packed_bwd.register_fake
def _(dout, q, packed, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, softmax_scale,
      causal, window_left, window_right, softcap, num_threads, impl, want_dsinks, dropout_p=0.0,
      dropout_rng=None):
    heads_q = _packed_views(q, packed)[0].shape[-2]
    dq = packed.new_empty((0,)) if q is None else q.new_empty(q.shape)
    dsinks = packed.new_empty((heads_q if want_dsinks else 0,), dtype=torch.float32)
    return dq, packed.new_empty(packed.shape), dsinks


_PACKED_NAMES = ("q", "packed", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "sinks",
                 "softmax_scale", "causal", "window_left", "window_right", "softcap",
                 "num_threads", "impl", "dropout_p", "dropout_rng")


def _packed_setup_context(ctx, inputs, output):
    args = dict(zip(_PACKED_NAMES, inputs))
    out, lse = output
    _save_context(ctx, args, lse, (args["q"], args["packed"], out, lse, args["cu_seqlens_q"],
                                   args["cu_seqlens_k"], args["alibi_slopes"], args["sinks"]),
                  _PACKED_NAMES[6:13])


def _packed_backward(ctx, dout, _dlse):
    q, packed, out, lse, cu_q, cu_k, alibi_slopes, sinks, dropout_rng = ctx.saved_tensors
    want_dsinks = sinks is not None and ctx.needs_input_grad[5]
    dq, dpacked, dsinks = packed_bwd(dout, q, packed, out, lse, cu_q, cu_k, alibi_slopes, sinks,
                                     *ctx.scalars, want_dsinks, ctx.dropout_p, dropout_rng)
    return ((None if q is None else dq), dpacked, None, None, None,
            dsinks.to(ctx.sinks_dtype) if want_dsinks else None) + (None,) * 9


packed_fwd.register_autograd(_packed_backward, setup_context=_packed_setup_context)


def packed_attention(q, packed, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, *scalars):
    """packed_fwd's (out, lse), as the op or directly (below); scalars as packed_fwd's."""
    rng = scalars[8] if len(scalars) > 8 else None
    call = packed_fwd if _as_op((q, packed, sinks, rng)) else _packed_fwd
    return call(q, packed, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, *scalars)


# --- KV cache: append in place, then attend -----------------------------------------------------

def _kvcache_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                block_table: Optional[Tensor], k_new: Optional[Tensor], v_new: Optional[Tensor],
                alibi_slopes: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                window_left: int, window_right: int, softcap: float, num_threads: int,
                impl: str, rotary_cos: Optional[Tensor] = None,
                rotary_sin: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                cache_batch_idx: Optional[Tensor] = None,
                rotary_interleaved: bool = True, k_scale: Optional[Tensor] = None,
                v_scale: Optional[Tensor] = None,
                cache_dtype: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """(out [B, Sq, Hq, D], lse float32 [B, Hq, Sq]); k_new, v_new are written into the caches
    at cache_seqlens (int32 [B]) first, rotated by rotary_cos, rotary_sin [seqlen_ro,
    rotary_dim / 2] when given; cache_leftpad, cache_batch_idx int32 [B] (_api's
    flash_attn_with_kvcache); a quantized cache's k_scale, v_scale [dim 0, dim 1, Hkv, groups]
    float32 (broadcast views allowed; int8 writes them). No autograd: decoding is inference."""
    from . import _quantized
    options = _options(alibi_slopes, None, None, None, softmax_scale, causal, window_left,
                       window_right, softcap, num_threads)
    batch, seqlen_q, heads_q, _ = q.shape
    out = _api._empty("torch", (batch, seqlen_q, heads_q, v_cache.shape[-1]), q.dtype)
    lse = _api._empty("torch", (batch, heads_q, seqlen_q), torch.float32)
    _flashattn.kvcache_forward(
        impl, _api._native(q), **_quantized.kvcache_arguments(
            k_cache, v_cache, k_scale, v_scale, cache_dtype, "torch"),
        cache_seqlens=cache_seqlens, block_table=block_table,
        k_new=None if k_new is None else _api._native(k_new),
        v_new=None if v_new is None else _api._native(v_new), out=out, lse=lse,
        **_api._kvcache_extras(rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad,
                               cache_batch_idx), **options)
    return out, lse


kvcache_fwd = torch.library.custom_op(f"{_LIB}::kvcache_fwd", _kvcache_fwd,
                                      mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, alibi_slopes, softmax_scale,
      causal, window_left, window_right, softcap, num_threads, impl, rotary_cos=None,
      rotary_sin=None, cache_leftpad=None, cache_batch_idx=None, rotary_interleaved=True,
      k_scale=None, v_scale=None, cache_dtype=None):
    batch, seqlen_q, heads_q, _ = q.shape
    return (q.new_empty((batch, seqlen_q, heads_q, v_cache.shape[-1])),
            q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32))


# --- the calls the package makes --------------------------------------------------------------
#
# An op's dispatch from Python costs tens of microseconds, more than a decode step's attention of
# a small model computes. So the package calls the op where it is needed, when torch.compile or
# another tracer sees the call (it is then one node of the graph; tracers hand over tensor
# subclasses such as FakeTensor) or when autograd must record it, and otherwise the op's own
# implementation directly: the same function on the same tensors, the same result bit for bit.

def _as_op(tensors) -> bool:
    if torch.compiler.is_compiling():
        return True
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not Tensor or (grad and t.requires_grad)):
            return True
    return False


def attention(q, k, v, alibi_slopes, sinks, attn_bias, attn_mask, softmax_scale, causal,
              window_left, window_right, softcap, num_threads, impl, out_heads_first,
              want_lse=True, dropout_p=0.0, dropout_rng=None):
    """fwd's (out, lse), as the op or directly (above); directly, lse is None unless wanted."""
    scalars = (softmax_scale, causal, window_left, window_right, softcap, num_threads)
    if _as_op((q, k, v, sinks, attn_bias, attn_mask, dropout_rng)):
        return fwd(q, k, v, alibi_slopes, sinks, attn_bias, attn_mask, *scalars, impl,
                   out_heads_first, dropout_p, dropout_rng)
    options = _options(alibi_slopes, sinks, attn_bias, attn_mask, *scalars, dropout_p,
                       dropout_rng)
    return _api._forward_arrays("torch", q, k, v, options, impl, out_heads_first, want_lse)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, *scalars):
    """varlen_fwd's (out, lse), as the op or directly (above); scalars as varlen_fwd's, with
    dropout's p and draw last when given."""
    rng = scalars[8] if len(scalars) > 8 else None
    call = varlen_fwd if _as_op((q, k, v, sinks, cu_seqlens_q, rng)) else _varlen_fwd
    return call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, *scalars)


def varlen_paged_attention(q, k_cache, v_cache, block_table, *rest):
    """varlen_paged_fwd's (out, lse), as the op or directly (above); it has no gradient."""
    call = varlen_paged_fwd if _as_op((q, k_cache, v_cache)) else _varlen_paged_fwd
    return call(q, k_cache, v_cache, block_table, *rest)


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, *rest):
    """kvcache_fwd's (out, lse), as the op or directly (above); it has no gradient."""
    call = kvcache_fwd if _as_op((q, k_cache, v_cache, k_new)) else _kvcache_fwd
    return call(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, *rest)


def all_ops() -> List[object]:
    """Every op of the namespace, for opcheck."""
    return [fwd, bwd, varlen_fwd, varlen_bwd, varlen_paged_fwd, kvcache_fwd, packed_fwd,
            packed_bwd]
