"""torch.nn modules over flashattn's attention.

    from flashattn.nn import MultiHeadAttention
    layer = MultiHeadAttention(hidden=512, num_heads=8, num_kv_heads=2)
    y = layer(x, causal=True)                 # x [batch, seqlen, hidden]

The layer of seed 000 (x -> Q, K, V -> attention -> merge heads -> W_O) as a torch.nn.Module:
the projections are torch.nn.Linear (torch's own BLAS, its autograd, any dtype and device torch
puts them on for the CPU), the attention is flashattn's op, so the whole layer trains with
autograd and compiles with torch.compile(fullgraph=True). Splitting and merging heads are views.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import _dropout, _torch_ops

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention with its four projections.

    hidden: the model width; num_heads query heads of head_dim = hidden // num_heads;
    num_kv_heads (default num_heads) KV heads, dividing num_heads; bias: the projections' bias;
    dropout: attention dropout in training mode (as torch.nn.MultiheadAttention's), its mask
    drawn from torch's default generator; value_head_dim (default head_dim): the head dim of V and
    of the attention output (DeepSeek's MLA: 128 beside a query/key head dim of 192). Weights as
    torch.nn.Linear (torch's [out, in]): q_proj [hidden, hidden], k_proj [num_kv_heads *
    head_dim, hidden], v_proj [num_kv_heads * value_head_dim, hidden], o_proj [hidden,
    num_heads * value_head_dim].
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 bias: bool = False, dtype: Optional[torch.dtype] = None, dropout: float = 0.0,
                 value_head_dim: Optional[int] = None):
        super().__init__()
        self.dropout = _dropout.check_p(dropout)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or hidden <= 0 or hidden % num_heads:
            raise ValueError(f"num_heads: expected a positive divisor of hidden = {hidden}, got "
                             f"{num_heads}")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a positive divisor of num_heads = "
                             f"{num_heads}, got {num_kv_heads}")
        self.hidden, self.num_heads, self.num_kv_heads = hidden, num_heads, num_kv_heads
        self.head_dim = hidden // num_heads
        self.value_head_dim = self.head_dim if value_head_dim is None else int(value_head_dim)
        if self.value_head_dim <= 0:
            raise ValueError(f"value_head_dim: expected > 0, got {self.value_head_dim}")
        self.q_proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.value_head_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(num_heads * self.value_head_dim, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None,
                causal: bool = False, window_size: tuple = (-1, -1),
                softmax_scale: Optional[float] = None) -> torch.Tensor:
        """y [batch, seqlen, hidden] from x [batch, seqlen, hidden]: self-attention, or
        cross-attention against context [batch, seqlen_kv, hidden]. causal and window_size as
        flash_attn_func (bottom-right aligned)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden:
            raise ValueError(f"x: expected [batch, seqlen, hidden = {self.hidden}], got "
                             f"{tuple(x.shape)}")
        source = x if context is None else context
        if context is not None and (context.dim() != 3 or context.shape[-1] != self.hidden
                                    or context.shape[0] != x.shape[0]):
            raise ValueError(f"context: expected [batch = {x.shape[0]}, seqlen_kv, hidden = "
                             f"{self.hidden}], got {tuple(context.shape)}")
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.num_heads, self.head_dim)
        k = self.k_proj(source).view(batch, source.shape[1], self.num_kv_heads, self.head_dim)
        v = self.v_proj(source).view(batch, source.shape[1], self.num_kv_heads,
                                     self.value_head_dim)
        left, right = window_size
        scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        dropout_p = self.dropout if self.training else 0.0
        out, _ = _torch_ops.attention(q, k, v, None, None, None, None, scale, bool(causal),
                                      int(left), int(right), 0.0, 0, "flash", False,
                                      dropout_p=dropout_p,
                                      dropout_rng=_dropout.draw("torch", dropout_p, None, 0))
        return self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.value_head_dim))
