"""Gradients through autograd: flash_attn_func and flash_attn_varlen_func against an fp64
attention written in torch here, and torch.autograd.gradcheck on small shapes.

Bound: the design's rule (docs/design.md, "How correctness is checked"): our fp32 error against
fp64 within 4x the error of another fp32 implementation of the same gradients (run on the same
inputs) plus a floor of 4 fp32 roundings per term of the longest sum a gradient element takes
(Sq + Skv + D terms), at the largest gradient. The other implementation is the same attention written in plain torch ops, run in fp32 (torch's own
scaled_dot_product_attention gives NaN for the rows a bottom-right causal mask empties).
"""

import math

import numpy as np
import pytest

import flashattn
from conftest import U32, requires_torch, torch

pytestmark = requires_torch


def attention_math(q, k, v, scale, causal, sinks=None, bias=None):
    """Attention in plain torch ops in the inputs' dtype, [B, S, H, D], bottom-right causal,
    GQA by repetition; a row that sees no key gives 0."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        s = s + bias
    sq, skv = q.shape[1], k.shape[1]
    visible_rows = None
    if causal:
        rows = torch.arange(sq)[:, None] + skv - sq
        masked = torch.arange(skv)[None, :] > rows
        s = s.masked_fill(masked, float("-inf"))
        visible_rows = ~masked.all(dim=-1, keepdim=True)
        s = torch.where(visible_rows, s, 0.0)
    if sinks is not None:
        sink_column = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)
        p = torch.softmax(torch.cat([s, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    if visible_rows is not None:
        p = p * visible_rows
    return torch.einsum("bhij,bjhd->bihd", p, v)


def leaves(*tensors, dtype=torch.float32):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def check_gradients(ours, torch32, truth, shape):
    sq, skv, d = shape
    for name, g, g32, g64 in zip("qkv", ours, torch32, truth):
        g, g64 = g.double(), g64.double()
        floor = 4 * U32 * (sq + skv + d) * float(g64.abs().max())
        bound = 4 * float((g32.double() - g64).abs().max()) + floor
        err = float((g - g64).abs().max())
        assert err <= bound, f"d{name}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("shape", [(1, 17, 17, 2, 2, 32), (2, 70, 129, 4, 2, 64),
                                   (1, 130, 65, 4, 1, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_gradients(shape, causal):
    torch.manual_seed(sum(shape) + causal)
    b, sq, skv, hq, hkv, d = shape
    q0, k0, v0 = torch.randn(b, sq, hq, d), torch.randn(b, skv, hkv, d), torch.randn(b, skv, hkv, d)
    dout = torch.randn(b, sq, hq, d)
    scale = 1 / math.sqrt(d)

    q, k, v = leaves(q0, k0, v0)
    flashattn.flash_attn_func(q, k, v, causal=causal).backward(dout)
    ours = [q.grad, k.grad, v.grad]

    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    attention_math(q64, k64, v64, scale, causal).backward(dout.double())
    truth = [q64.grad, k64.grad, v64.grad]

    # The same attention in plain fp32 torch ops: the other fp32 implementation.
    q32, k32, v32 = leaves(q0, k0, v0)
    attention_math(q32, k32, v32, scale, causal).backward(dout)
    check_gradients(ours, [q32.grad, k32.grad, v32.grad], truth, (sq, skv, d))


def test_sink_and_bias_gradients():
    torch.manual_seed(5)
    b, s, h, d = 2, 33, 2, 32
    q0, k0, v0 = torch.randn(b, s, h, d), torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    sinks0, bias0 = torch.randn(h), torch.randn(1, h, s, s)
    dout = torch.randn(b, s, h, d)
    q, k, v, sinks, bias = leaves(q0, k0, v0, sinks0, bias0)
    out = flashattn.flash_attn_func(q, k, v, causal=True, sinks=sinks, attn_bias=bias)
    out.backward(dout)
    q64, k64, v64, sinks64, bias64 = leaves(q0, k0, v0, sinks0, bias0, dtype=torch.float64)
    attention_math(q64, k64, v64, 1 / math.sqrt(d), True, sinks64, bias64).backward(dout.double())
    for name, g, g64 in (("dsinks", sinks.grad, sinks64.grad), ("dbias", bias.grad, bias64.grad),
                         ("dq", q.grad, q64.grad)):
        # Sums over up to B * S * S terms, each an fp32 product of rounded factors.
        bound = 8 * U32 * b * s * s * float(g64.abs().max()) + 1e-6
        err = float((g.double() - g64).abs().max())
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck's note that the inputs are not fp64
def test_gradcheck_on_a_small_shape():
    # gradcheck's finite differences in fp32: eps = 1e-2 keeps the rounding error of each
    # difference (u32 * |out| / eps ~ 1e-5) and its truncation error (eps^2 * |f'''| ~ 1e-4)
    # well inside atol.
    torch.manual_seed(3)
    q, k, v = leaves(torch.randn(1, 5, 2, 8), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8))

    def f(q, k, v):
        return flashattn.flash_attn_func(q, k, v, causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-2, atol=2e-3, rtol=1e-2,
                                    nondet_tol=0.0, fast_mode=False)


def test_lse_is_returned_and_not_differentiable():
    q, k, v = leaves(torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16))
    out, lse = flashattn.flash_attn_func(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    assert out.grad_fn is not None


def test_varlen_gradients_match_each_sequence_alone():
    torch.manual_seed(11)
    lengths = [5, 0, 64, 129]
    h, d = 2, 32
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(cu[-1])
    q0, k0, v0 = (torch.randn(total, h, d) for _ in range(3))
    dout = torch.randn(total, h, d)
    q, k, v = leaves(q0, k0, v0)
    flashattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                     causal=True).backward(dout)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if start == end:
            continue
        qs, ks, vs = leaves(q0[start:end][None], k0[start:end][None], v0[start:end][None])
        flashattn.flash_attn_func(qs, ks, vs, causal=True).backward(dout[start:end][None])
        # Each sequence alone: the same computation, bit for bit (varlen.hpp).
        assert torch.equal(q.grad[start:end], qs.grad[0])
        assert torch.equal(k.grad[start:end], ks.grad[0])
        assert torch.equal(v.grad[start:end], vs.grad[0])


def test_no_grad_mode_records_nothing():
    q = torch.randn(1, 4, 1, 8, requires_grad=True)
    with torch.no_grad():
        out = flashattn.flash_attn_func(q, q.detach(), q.detach())
    assert out.grad_fn is None and not out.requires_grad
