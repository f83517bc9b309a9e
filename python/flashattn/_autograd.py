"""torch.autograd Functions over the flash forward and backward.

The forward saves q, k, v, out and its lse; backward hands them to the library's backward (P is
recomputed block by block from lse, never stored), which writes dq, dk, dv in one pass, and
dsinks and dbias when those inputs require grad.
"""

from __future__ import annotations

import torch

from . import _api, _flashattn


def _grad_output(dout: torch.Tensor) -> torch.Tensor:
    # Autograd may hand over an expanded gradient (stride 0 everywhere after a .sum()): any
    # strides are fine except a last dim that is not contiguous.
    return dout.contiguous() if dout.stride(-1) != 1 else dout


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, attn_bias, impl, settings, out_heads_first):
        options = _api._options("torch", sinks=sinks, attn_bias=attn_bias, **settings)
        out, lse = _api._forward_arrays("torch", q, k, v, options, impl, out_heads_first)
        ctx.save_for_backward(q, k, v, out, lse, sinks, attn_bias)
        ctx.impl, ctx.settings = impl, settings
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks, attn_bias = ctx.saved_tensors
        options = _api._options("torch", sinks=sinks, attn_bias=attn_bias, **ctx.settings)
        dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        dsinks = torch.empty(q.shape[2], dtype=torch.float32) if ctx.needs_input_grad[3] else None
        dbias = _empty_like(attn_bias) if ctx.needs_input_grad[4] else None
        _flashattn.backward(ctx.impl, _api._native(_grad_output(dout)), _api._native(q),
                            _api._native(k), _api._native(v), _api._native(out), lse, dq, dk, dv,
                            dsinks, dbias, **options)
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype)
        return dq, dk, dv, dsinks, dbias, None, None, None


def attention(q, k, v, impl, *, sinks=None, attn_bias=None, out_heads_first=False, **settings):
    """(out, lse) of flash_attn_func, recorded for autograd. settings: the other options."""
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        sinks = torch.as_tensor(sinks, dtype=torch.float32)
    return _Attention.apply(q, k, v, sinks, attn_bias, impl, settings, out_heads_first)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, impl, settings):
        options = _api._options("torch", sinks=sinks, attn_bias=None, attn_mask=None, **settings)
        out, lse = _api._varlen_forward_arrays("torch", q, k, v, cu_q, cu_k, options, impl)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cu = (cu_q, cu_k)
        ctx.impl, ctx.settings = impl, settings
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        options = _api._options("torch", sinks=sinks, attn_bias=None, attn_mask=None,
                                **ctx.settings)
        dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        dsinks = torch.empty(q.shape[1], dtype=torch.float32) if ctx.needs_input_grad[3] else None
        _flashattn.varlen_backward(ctx.impl, _api._native(_grad_output(dout)), _api._native(q),
                                   _api._native(k), _api._native(v), _api._native(out), lse,
                                   ctx.cu[0], ctx.cu[1], dq, dk, dv, dsinks, **options)
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None


def varlen_attention(q, k, v, cu_q, cu_k, impl, *, sinks=None, **settings):
    """(out, lse) of flash_attn_varlen_func, recorded for autograd."""
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        sinks = torch.as_tensor(sinks, dtype=torch.float32)
    return _VarlenAttention.apply(q, k, v, sinks, cu_q, cu_k, impl, settings)
