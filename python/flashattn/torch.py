"""A drop-in for torch.nn.functional.scaled_dot_product_attention on CPU tensors.

    import flashattn.torch
    out = flashattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)

Route every call of a model (a Hugging Face model with attn_implementation="sdpa", say) through
flashattn for the duration of a block:

    with flashattn.torch.sdpa_replaced():
        logits = model(input_ids).logits
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from . import _api, _dropout, _torch_ops

__all__ = ["scaled_dot_product_attention", "sdpa_replaced"]


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch's scaled_dot_product_attention, computed by flashattn, with torch's semantics.

    query [..., Hq, L, E], key and value [..., Hkv, S, E] (3 or more dims, the leading ones
    batch dims, as torch allows); float32, float16 or bfloat16 CPU tensors.
    - is_causal: torch's mask, aligned to the top-left corner (row i sees keys j <= i, also
      when L != S; flashattn's own causal is bottom-right aligned, so for L != S this builds
      the top-left mask as a boolean mask).
    - attn_mask: bool (True = take part) or float (added to the scores), broadcastable to
      [..., Hq, L, S]; not together with is_causal (as torch). A row whose keys are all masked
      gives 0 here (torch gives NaN).
    - enable_gqa: Hq a multiple of Hkv, each KV head shared by Hq / Hkv query heads.
    - dropout_p: attention dropout as torch applies it (whatever the module's training flag),
      the mask drawn from torch's default generator.
    - value's head dim Ev may differ from E (DeepSeek's MLA: E 192, Ev 128), where torch's own
      CPU kernels raise; the output is then [..., Hq, L, Ev].
    Gradients flow to query, key, value and a float attn_mask through autograd.
    The output is [..., Hq, L, Ev], contiguous, like torch's.
    """
    dropout_p = _dropout.check_p(dropout_p)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() < 3:
            raise ValueError(f"{name}: expected [..., heads, seqlen, head_dim], got "
                             f"{tensor.dim()} dims")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: not together with is_causal (as torch)")
    heads_q, seqlen_q = query.shape[-3], query.shape[-2]
    heads_kv, seqlen_kv = key.shape[-3], key.shape[-2]
    if heads_q != heads_kv and not enable_gqa:
        raise ValueError(f"key: expected {heads_q} heads as query (or enable_gqa=True), got "
                         f"{heads_kv}")
    batch_shape = query.shape[:-3]
    batch = math.prod(batch_shape)

    def seqlen_major(x: torch.Tensor) -> torch.Tensor:
        # [..., H, S, E] -> [B, S, H, E]: a view whenever the batch dims flatten to one.
        return x.reshape(batch, *x.shape[-3:]).transpose(1, 2)

    q, k, v = seqlen_major(query), seqlen_major(key), seqlen_major(value)
    causal, mask, bias = False, None, None
    if is_causal:
        if seqlen_q == seqlen_kv:
            causal = True
        else:
            mask = torch.ones(seqlen_q, seqlen_kv, dtype=torch.bool).tril()
    elif attn_mask is not None:
        full = attn_mask.expand(*batch_shape, heads_q, seqlen_q, seqlen_kv)
        full = full.reshape(batch, heads_q, seqlen_q, seqlen_kv)
        if attn_mask.dtype == torch.bool:
            mask = full
        else:
            bias = full.to(query.dtype) if full.dtype != query.dtype else full
    out, _ = _torch_ops.attention(q, k, v, None, None, bias, mask,
                                  None if scale is None else float(scale), causal, -1, -1, 0.0, 0,
                                  "flash", True, dropout_p=dropout_p,
                                  dropout_rng=_dropout.draw("torch", dropout_p, None, 0))
    return out.transpose(1, 2).reshape(*batch_shape, heads_q, seqlen_q, value.shape[-1])


@contextlib.contextmanager
def sdpa_replaced() -> Iterator[None]:
    """Within the block, torch.nn.functional.scaled_dot_product_attention is flashattn's."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
