"""flashattn as an attention implementation of Hugging Face transformers.

    import flashattn.transformers  # registers "flashattn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashattn")

Importing this module registers `attention_forward` with transformers' `AttentionInterface` and
`padding_mask` with its `AttentionMaskInterface`, both under the name "flashattn". The model then
hands each attention call the 2-D padding mask (or None), never a dense [B, H, Sq, Skv] one, and
the call runs on flashattn's kernels (and torch.compile sees one custom op per call):

- q, k, v arrive as [B, H, S, D] and are read in place as [B, S, H, D] views; GQA reads the KV
  heads without repeating them (transformers' `repeat_kv` is never called);
- causal attention is aligned to the bottom-right corner, which is transformers' alignment when a
  cache holds the earlier tokens; a sliding window of `sliding_window` tokens (the query's own
  included) is FlashAttention's window (sliding_window - 1, sliding_window - 1), as transformers'
  FlashAttention integration passes it;
- padding (left or right) is a boolean mask view [B, 1, Sq, L] over the 2-D mask with stride 0
  across queries (no copy); keys past the mask's length L (a StaticCache's empty tail) are cut;
- `softcap` (Gemma 2) and `s_aux` (gpt-oss's learned sinks, with their gradient) are flashattn's
  softcap and sinks; `scaling` its softmax_scale;
- continuous batching (transformers' paged generation) passes cu_seq_lens_q/k: a varlen call; its
  decode fast path passes a block table with k_cache, v_cache: the KV-cache call, which appends
  the new rows in place.

Query rows that see no key (left padding under a causal mask) give 0, where eager gives the mean
of V; both are rows the model discards. Attention dropout (training with attention_dropout > 0)
is flashattn's, its mask drawn from torch's default generator.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import _api, _dropout

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as error:  # transformers missing, or older than the attention interfaces
    import importlib.util
    found = importlib.util.find_spec("transformers")
    version = "not installed"
    if found is not None:
        import importlib.metadata
        version = importlib.metadata.version("transformers")
    raise ImportError(
        "flashattn.transformers needs transformers >= 4.56 (AttentionInterface and "
        f"AttentionMaskInterface); found {version}") from error

__all__ = ["NAME", "attention_forward", "padding_mask"]

NAME = "flashattn"


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                 kv_offset: int = 0, mask_function=None,
                 attention_mask: Optional[torch.Tensor] = None,
                 **kwargs) -> Optional[torch.Tensor]:
    """The mask transformers builds for "flashattn": the 2-D padding mask [B, <= kv_length]
    (True = a real token), or None when every token is real. The causal and sliding-window
    patterns are the kernel's own, so `mask_function` is not evaluated (as for FlashAttention).
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    # A mask without padding is dropped. Telling so reads the mask's values, which a traced
    # graph cannot branch on: while compiling the all-True mask is kept (the same result).
    if (attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling()
            and bool(attention_mask.all())):
        return None
    return attention_mask


def _window(sliding_window: Optional[int], key_length: int) -> Tuple[int, int]:
    if sliding_window is None or key_length <= sliding_window:
        return -1, -1
    return sliding_window - 1, sliding_window - 1


def _check_kwargs(kwargs: dict) -> None:
    if kwargs.get("output_attentions", False):
        raise ValueError("output_attentions: flashattn never forms the attention probabilities; "
                         "use attn_implementation='eager' to get them")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                      cache: Any = None, **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention function signature: query [B, Hq, Sq, D], key and value
    [B, Hkv, Skv, D]; returns (out [B, Sq, Hq, D], None)."""
    from . import _torch_ops

    _check_kwargs(kwargs)
    dropout = _dropout.check_p(dropout or 0.0)
    rng = _dropout.draw("torch", dropout, None, 0)
    if cache is not None and hasattr(cache, "update") and "cu_seq_lens_k" in kwargs:
        # transformers' paged cache: an index update returns the sequences' K/V packed, a block
        # table update leaves them for the KV-cache call and puts the caches in kwargs.
        key, value = cache.update(key_states=key, value_states=value,
                                  layer_idx=module.layer_idx, kwargs=kwargs)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    batch, _, seqlen_q, _ = query.shape
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    left, right = _window(sliding_window, k.shape[1])
    softcap = 0.0 if softcap is None else float(softcap)
    scale = None if scaling is None else float(scaling)

    if kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None:
        if dropout > 0.0:
            raise ValueError(f"dropout: expected 0 in the paged KV-cache decode (inference), got "
                             f"{dropout}; call model.eval()")
        return _paged_decode(q, k, v, kwargs, s_aux, scale, is_causal, left, right, softcap), None
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        # Sequences packed along the batch's one row: [1, total, H, D] -> [total, H, D].
        out, _ = _torch_ops.varlen_attention(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]),
            _api._torch_int32(kwargs["cu_seq_lens_q"], "cu_seq_lens_q"),
            _api._torch_int32(kwargs["cu_seq_lens_k"], "cu_seq_lens_k"), None, s_aux, scale,
            bool(is_causal), left, right, softcap, 0, "flash", dropout, rng)
        return out.view(batch, -1, *out.shape[-2:]), None

    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask: expected the 2-D padding mask [batch, keys] that "
                f"flashattn.transformers.padding_mask builds, got {attention_mask.dim()} dims "
                f"{tuple(attention_mask.shape)} (was the model built with "
                f"attn_implementation='{NAME}'?)")
        length = attention_mask.shape[1]
        if length < k.shape[1]:  # a StaticCache: the keys past the mask were never written
            k, v = k[:, :length], v[:, :length]
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(torch.bool)
        mask = attention_mask[:, None, None, :].expand(batch, 1, seqlen_q, length)
    out, _ = _torch_ops.attention(q, k, v, None, s_aux, None, mask, scale, bool(is_causal), left,
                                  right, softcap, 0, "flash", False, dropout_p=dropout,
                                  dropout_rng=rng)
    return out, None


def _paged_decode(q, k_new, v_new, kwargs, s_aux, scale, is_causal, left, right, softcap):
    """The decode fast path of continuous batching: one new token per sequence, appended into
    the paged caches at position cache_seqlens[b], then attended to."""
    from . import _torch_ops

    if s_aux is not None:
        raise ValueError("s_aux: the paged KV-cache call of flashattn takes no sinks; run "
                         "continuous batching without the block-table fast path")
    cu_k = kwargs["cu_seq_lens_k"]
    # One query per sequence: [1, B, H, D] -> [B, 1, H, D]; the cache holds every key but the new.
    q, k_new, v_new = (x.reshape(-1, 1, *x.shape[2:]) for x in (q, k_new, v_new))
    sequences = q.shape[0]
    cache_seqlens = cu_k[1:sequences + 1] - cu_k[:sequences] - 1
    out, _ = _torch_ops.kvcache_attention(
        q, kwargs["k_cache"], kwargs["v_cache"],
        _api._torch_int32(cache_seqlens, "cache_seqlens"),
        _api._torch_int32(kwargs["block_table"], "block_table"), k_new, v_new, None, scale,
        bool(is_causal), left, right, softcap, 0, "flash")
    return out.view(1, -1, *out.shape[-2:])


def _serve_flash_loader() -> None:
    """transformers takes every implementation name containing "flash" for a FlashAttention
    kernel and, when a model is built, loads that kernel's flash_attn_func, varlen and KV-cache
    functions (from flash_attn, or from the `kernels` hub for other names). For "flashattn" its
    loader gets this package's functions of the same names, which keep FlashAttention's
    signatures; other names go to transformers' own loader as before."""
    from transformers import modeling_flash_attention_utils as flash_utils

    load = flash_utils._lazy_imports
    if getattr(load, "serves_flashattn", False):
        return

    def lazy_imports(implementation, *args, **kwargs):
        if implementation == NAME:
            return (_api.flash_attn_func, _api.flash_attn_varlen_func,
                    _api.flash_attn_with_kvcache, flash_utils._pad_input,
                    flash_utils._unpad_input)
        return load(implementation, *args, **kwargs)

    lazy_imports.serves_flashattn = True
    flash_utils._lazy_imports = lazy_imports


def _declare_compatible_where_listed() -> None:
    """A model class may list the FlashAttention implementations it works with
    (`_compatible_flash_implementations`, gpt-oss's learned sinks need one that has them); a
    "flash" name outside that list is replaced by the list's first entry, a hub kernel. flashattn
    has sinks, softcap and windows, so a class that keeps such a list gets "flashattn" added to it
    when a model of it is built with attn_implementation="flashattn"."""
    from transformers import PreTrainedModel

    check = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(check, "serves_flashattn", False):
        return

    def check_and_adjust(self, attn_implementation, *args, **kwargs):
        listed = getattr(type(self), "_compatible_flash_implementations", None)
        if attn_implementation == NAME and listed is not None and NAME not in listed:
            type(self)._compatible_flash_implementations = [*listed, NAME]
        return check(self, attn_implementation, *args, **kwargs)

    check_and_adjust.serves_flashattn = True
    PreTrainedModel._check_and_adjust_attn_implementation = check_and_adjust


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, padding_mask)
_serve_flash_loader()
_declare_compatible_where_listed()
