"""Shared helpers of the Python tests: an fp64 oracle in numpy and the derived error bounds.

The oracle is written here again, independently of the library's, from the definition in
docs/semantics.md: scores in fp64, bottom-right aligned causal mask and window, GQA by head
groups, softcap, ALiBi, bias, boolean mask, sinks; a row that sees no key gives 0 and -inf.

Bounds (tests/test_attention_vs_reference.cpp derives the same rule for the C++ tests): the
first-order forward error of fp32 attention is
    u32 * max|v| * (4 * scale * D * max|q| * max|k| + 2 * Skv + 16)
(the scores' dot products of length D, then the softmax sum and P.V over Skv terms), plus one
rounding of the output to its dtype, u_dtype * max|out|. Inputs in 16 bits are exact in fp32;
the contract lets the probabilities be rounded to the input dtype as the operand of P.V (the
bf16 products do, docs/semantics.md "Precision"), which moves an output by at most
u_in * max|v| more.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

U32 = 2.0 ** -24
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}

try:
    import torch  # noqa: F401  (the torch tests skip without it)
except ImportError:  # pragma: no cover
    torch = None

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

requires_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
requires_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name (fresh inputs per test, reproducible runs)."""
    seed = int(os.environ.get("FLASHATTN_TEST_SEED", "0")) + sum(map(ord, request.node.name))
    return np.random.default_rng(seed)


def to64(x) -> np.ndarray:
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    if x.dtype.name == "bfloat16":
        return x.astype(np.float32).astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def reference_attention(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                        alibi=None, bias=None, mask=None, sinks=None, dropout=None):
    """out [B, Sq, Hq, D] and lse [B, Hq, Sq] in fp64. dropout: (keep [B, Hq, Sq, Skv] bool,
    p): the kept probabilities scaled by 1 / (1 - p) in P.V, the dropped ones 0; lse as without."""
    q, k, v = to64(q), to64(k), to64(v)
    batch, seqlen_q, heads_q, dim = q.shape
    seqlen_kv, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    rows = np.arange(seqlen_q)[:, None] + seqlen_kv - seqlen_q
    cols = np.arange(seqlen_kv)[None, :]
    if alibi is not None:
        slopes = np.asarray(alibi, np.float64)
        slopes = slopes.reshape(-1 if slopes.ndim == 2 else 1, heads_q, 1, 1)
        s = s - slopes * np.abs(rows - cols)
    visible = np.ones((seqlen_q, seqlen_kv), dtype=bool)
    if causal:
        visible &= cols <= rows
    if window[0] >= 0:
        visible &= cols >= rows - window[0]
    if window[1] >= 0:
        visible &= cols <= rows + window[1]
    keep = np.broadcast_to(visible, s.shape).copy()
    if bias is not None:
        b = np.broadcast_to(to64(bias), s.shape)
        keep &= b != -np.inf
        s = s + np.where(b == -np.inf, 0.0, b)
    if mask is not None:
        m = mask.numpy() if torch is not None and isinstance(mask, torch.Tensor) else mask
        keep &= np.broadcast_to(m, s.shape)
    s = np.where(keep, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, np.float64).reshape(1, heads_q, 1, 1)
        row_max = np.maximum(row_max, sink)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.where(keep, np.exp(s - safe_max), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - safe_max)
    weights = p
    if dropout is not None:
        kept, dropout_p = dropout
        weights = np.where(kept, p * np.float64(np.float32(1.0 / (1.0 - np.float32(dropout_p)))),
                           0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.einsum("bhij,bjhd->bihd", np.where(total > 0, weights / total, 0.0), v)
        lse = np.where(total > 0, safe_max + np.log(total), -np.inf)[..., 0]
    return out, lse


def forward_bound(q, k, v, scale=None, out_dtype="float32", ref=None) -> float:
    """The derived bound on |out - oracle| (module docstring)."""
    q64, k64, v64 = to64(q), to64(k), to64(v)
    dim, seqlen_kv = q64.shape[-1], k64.shape[-3]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    max_q, max_k, max_v = (float(np.abs(a).max(initial=0.0)) for a in (q64, k64, v64))
    bound = U32 * max_v * (4 * scale * dim * max_q * max_k + 2 * seqlen_kv + 16)
    in_dtype = dtype_name(q)
    if in_dtype != "float32":
        bound += UNIT_ROUNDOFF[in_dtype] * max_v
    largest = float(np.abs(ref).max(initial=0.0)) if ref is not None else max_v
    return bound + UNIT_ROUNDOFF[out_dtype] * largest


def dtype_name(x) -> str:
    if torch is not None and isinstance(x, torch.Tensor):
        return str(x.dtype).replace("torch.", "")
    return x.dtype.name


def assert_close(actual, expected, bound, what="out"):
    a = to64(actual)
    assert a.shape == expected.shape, f"{what}: shape {a.shape}, expected {expected.shape}"
    both_inf = np.isinf(expected) & (a == expected)
    with np.errstate(invalid="ignore"):
        err = np.where(both_inf, 0.0, np.abs(a - expected))
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    assert err.size == 0 or err.max() <= bound, (
        f"{what}: max error {err.max():.3g} > bound {bound:.3g} at {worst}: "
        f"{a[worst]} against {expected[worst]}")

