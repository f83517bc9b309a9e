"""Attention dropout's random inputs, and FlashAttention's S_dmask.

The library draws its dropout mask from a counter-based generator keyed by a 64-bit seed and a
32-bit offset (docs/semantics.md, "Dropout"): the same (seed, offset) gives the same mask in the
forward and the backward. Here they are drawn once per call:

- torch callers: from torch's default CPU generator (so ``torch.manual_seed`` reproduces a run),
  as an int64 tensor ``[seed_low, seed_high, offset]`` that the custom ops carry into the backward
  and that ``torch.compile`` traces as a random op of the graph;
- numpy callers: from numpy's global generator (``np.random.seed`` reproduces a run);
- either, when ``dropout_seed`` is given: that seed, with ``dropout_offset``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from . import _flashattn

# S_dmask encodes the probabilities as FlashAttention's kernels leave them: exp(s − m), m the
# running row maximum when a key's block is visited, the blocks (of this many keys) visited from
# the last to the first. FlashAttention's tests undo it with _get_block_size_n.
_BLOCK_KEYS = 128
_WORD = 1 << 32


def check_p(dropout_p: Any) -> float:
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a value in [0, 1) (0 = off), got {dropout_p}")
    return p


def draw(framework: str, dropout_p: float, dropout_seed: Optional[int],
         dropout_offset: int) -> Any:
    """The call's (seed, offset) as three int64 [seed_low, seed_high, offset]: a torch tensor
    for torch callers, a numpy array otherwise; None without dropout."""
    if dropout_p == 0.0:
        return None
    if dropout_seed is not None:
        seed = int(dropout_seed)
        offset = int(dropout_offset)
        if not 0 <= seed < _WORD * _WORD:
            raise ValueError(f"dropout_seed: expected an integer in [0, 2^64), got {dropout_seed}")
        if not 0 <= offset < _WORD:
            raise ValueError(f"dropout_offset: expected an integer in [0, 2^32), got "
                             f"{dropout_offset}")
        words = [seed % _WORD, seed // _WORD, offset]
        if framework == "torch":
            import torch
            return torch.tensor(words, dtype=torch.int64)
        return np.array(words, dtype=np.int64)
    if framework == "torch":
        import torch
        return torch.randint(0, _WORD, (3,), dtype=torch.int64)
    return np.random.randint(0, _WORD, size=3, dtype=np.int64)


def options(dropout_p: float, rng: Any) -> dict:
    """The extension's dropout keywords for a call with this p and draw."""
    if dropout_p == 0.0 or rng is None:
        return {}
    seed_low, seed_high, offset = (int(x) for x in rng.tolist())
    return dict(dropout_p=dropout_p, dropout_seed=seed_low + seed_high * _WORD,
                dropout_offset=offset)


def get_block_size_n(device=None, head_dim=None, is_dropout=None, is_causal=None) -> int:
    """The key-block width of S_dmask's encoding (FlashAttention's _get_block_size_n)."""
    return _BLOCK_KEYS


def _round(n: int) -> int:
    return (n + _BLOCK_KEYS - 1) // _BLOCK_KEYS * _BLOCK_KEYS


def _sequence_dmask(q: np.ndarray, k: np.ndarray, keep: np.ndarray, scale: float, causal: bool,
                    window: tuple, softcap: float, slopes: Optional[np.ndarray]) -> np.ndarray:
    """S_dmask [Hq, Sq, Skv] of one sequence: q [Sq, Hq, D], k [Skv, Hkv, D] fp64, keep
    [Hq, Sq, Skv]."""
    seqlen_q, heads_q, _ = q.shape
    seqlen_kv, heads_kv, _ = k.shape
    k_heads = np.repeat(k, heads_q // heads_kv, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k_heads) * scale
    if softcap > 0.0:
        scores = softcap * np.tanh(scores / softcap)
    distance = (np.arange(seqlen_q)[:, None] + seqlen_kv - seqlen_q) - np.arange(seqlen_kv)
    if slopes is not None:
        scores = scores - slopes[:, None, None] * np.abs(distance)[None]
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    visible = np.ones((seqlen_q, seqlen_kv), dtype=bool)
    if left >= 0:
        visible &= distance <= left
    if right >= 0:
        visible &= distance >= -right
    scores = np.where(visible[None], scores, -np.inf)
    blocks = max(1, math.ceil(seqlen_kv / _BLOCK_KEYS))
    padded = np.full((heads_q, seqlen_q, blocks * _BLOCK_KEYS), -np.inf)
    padded[:, :, :seqlen_kv] = scores
    block_max = padded.reshape(heads_q, seqlen_q, blocks, _BLOCK_KEYS).max(axis=-1)
    running = np.maximum.accumulate(block_max[:, :, ::-1], axis=-1)[:, :, ::-1]
    running = np.repeat(running, _BLOCK_KEYS, axis=-1)[:, :, :seqlen_kv]
    with np.errstate(invalid="ignore"):
        probabilities = np.where(np.isfinite(scores), np.exp(scores - running), 0.0)
    return np.where(keep.astype(bool), probabilities, -probabilities)


def s_dmask(q: Any, k: Any, rng: Any, dropout_p: float, softmax_scale: Optional[float],
            causal: bool, window: tuple, softcap: float, alibi_slopes: Any,
            cu_seqlens_q: Any = None, cu_seqlens_k: Any = None) -> Any:
    """FlashAttention's S_dmask of a call with dropout, for tests (return_attn_probs=True):
    [B, Hq, round(Sq), round(Skv)] in q's dtype and framework, rounded up to whole blocks; a
    dropped probability negative, padding 0. Packed q, k ([total, H, D]) with cu_seqlens give
    sequence b its rows and keys from 0. O(Sq·Skv) memory, never used by the attention calls."""
    framework = "torch" if not isinstance(q, np.ndarray) else "numpy"

    def as_f64(x):
        if x is None:
            return None
        if hasattr(x, "detach"):  # a torch tensor
            return x.detach().to("cpu").double().numpy()
        return np.asarray(x, dtype=np.float64)

    q64, k64 = as_f64(q), as_f64(k)
    slopes = as_f64(alibi_slopes)
    options_ = options(dropout_p, rng)
    head_dim = q64.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if cu_seqlens_q is None:
        sequences = [(q64[b], k64[b]) for b in range(q64.shape[0])]
    else:
        cu_q = [int(x) for x in np.asarray(as_f64(cu_seqlens_q))]
        cu_k = [int(x) for x in np.asarray(as_f64(cu_seqlens_k))]
        sequences = [(q64[cu_q[b]:cu_q[b + 1]], k64[cu_k[b]:cu_k[b + 1]])
                     for b in range(len(cu_q) - 1)]
    heads_q = q64.shape[-2]
    rows = _round(max((s[0].shape[0] for s in sequences), default=0))
    keys = _round(max((s[1].shape[0] for s in sequences), default=0))
    # In q's dtype from the start, as FlashAttention's: fp64 only one sequence at a time.
    shape = (len(sequences), heads_q, rows, keys)
    if framework == "torch":
        import torch
        result = torch.zeros(shape, dtype=q.dtype)
    else:
        result = np.zeros(shape, dtype=q.dtype)
    for b, (qb, kb) in enumerate(sequences):
        keep = np.empty((heads_q, qb.shape[0], kb.shape[0]), dtype=np.uint8)
        _flashattn.dropout_mask(options_["dropout_p"], options_["dropout_seed"],
                                options_["dropout_offset"], b, keep)
        slope = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        sequence = _sequence_dmask(qb, kb, keep, scale, causal, window, softcap, slope)
        if framework == "torch":
            sequence = torch.from_numpy(sequence)
        result[b, :, :qb.shape[0], :kb.shape[0]] = sequence
    return result
