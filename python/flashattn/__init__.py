"""flashattn: exact attention on the CPU (FlashAttention and the standard path), from Python.

The functions take numpy arrays or torch CPU tensors and return results in the same framework:

    from flashattn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # q, k, v: [batch, seqlen, heads, dim]

flashattn.torch.scaled_dot_product_attention is a drop-in for torch's; flashattn.nn has the
attention layer as a torch.nn.Module; importing flashattn.transformers registers
attn_implementation="flashattn" with Hugging Face transformers. torch calls go through custom ops
(torch.ops.flashattn.*), so they take autograd and torch.compile(fullgraph=True). Errors from the
library raise ValueError with its message (the argument, what was expected, what was given).
"""

from ._api import (MultiHeadAttention, attention_reference, flash_attn_func,
                   flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                   flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                   flash_attn_with_kvcache, merge_attention_states)
from ._dropout import get_block_size_n as _get_block_size_n  # S_dmask's blocks, as upstream's
from ._flashattn import __version__, visible_pairs
from ._quantized import quantize_kv

__all__ = [
    "MultiHeadAttention",
    "attention_reference",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "quantize_kv",
    "visible_pairs",
]
