"""The torch.library custom ops (torch.ops.flashattn.*): opcheck on each, and torch.compile with
fullgraph=True through every public entry point, against eager mode.

opcheck runs each op's schema, fake (meta) implementation, autograd registration and AOT dispatch
on real inputs; the compiled results must be those of eager mode bit for bit, as the compiled
graph calls the same kernel on the same tensors.
"""

from __future__ import annotations

import pytest

from conftest import requires_torch

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402
from flashattn import _torch_ops  # noqa: E402

pytestmark = requires_torch

SCALARS = dict(softmax_scale=None, causal=True, window_left=-1, window_right=-1, softcap=0.0,
               num_threads=0, impl="flash")


def tensors(*shapes, requires_grad=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator).requires_grad_(requires_grad)
            for shape in shapes]


@pytest.mark.parametrize("case", ["plain", "sinks_softcap_window", "bias_and_mask", "heads_first"])
def test_opcheck_forward(case):
    q, k, v = tensors((2, 7, 4, 16), (2, 9, 2, 16), (2, 9, 2, 16), requires_grad=True)
    sinks = bias = mask = None
    scalars = dict(SCALARS)
    out_heads_first = False
    if case == "sinks_softcap_window":
        sinks = torch.randn(4, requires_grad=True)
        scalars.update(softcap=5.0, window_left=3, window_right=0)
    elif case == "bias_and_mask":
        bias = torch.randn(2, 1, 7, 9, requires_grad=True)
        mask = torch.rand(1, 4, 7, 9) > 0.3
        scalars.update(causal=False)
    elif case == "heads_first":
        out_heads_first = True
    torch.library.opcheck(_torch_ops.fwd, (q, k, v, None, sinks, bias, mask, *scalars.values(),
                                           out_heads_first))


def test_opcheck_backward():
    q, k, v, dout = tensors((1, 5, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8), (1, 5, 2, 8))
    sinks = torch.randn(2)
    out, lse = _torch_ops.fwd(q, k, v, None, sinks, None, None, *SCALARS.values(), False)
    torch.library.opcheck(_torch_ops.bwd, (dout, q, k, v, out, lse, None, sinks, None, None,
                                           *SCALARS.values(), True, False))


def test_opcheck_varlen_forward_and_backward():
    q, k, v = tensors((9, 4, 16), (12, 2, 16), (12, 2, 16), requires_grad=True)
    cu_q = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 12], dtype=torch.int32)
    sinks = torch.randn(4, requires_grad=True)
    torch.library.opcheck(_torch_ops.varlen_fwd, (q, k, v, cu_q, cu_k, None, sinks,
                                                  *SCALARS.values()))
    out, lse = _torch_ops.varlen_fwd(q.detach(), k.detach(), v.detach(), cu_q, cu_k, None, None,
                                     *SCALARS.values())
    torch.library.opcheck(_torch_ops.varlen_bwd, (torch.randn_like(out), q.detach(), k.detach(),
                                                  v.detach(), out, lse, cu_q, cu_k, None, None,
                                                  *SCALARS.values(), False))


def test_opcheck_packed_forward_and_backward():
    # qkv [B, S, 3, H, D] and q beside kv [B, S, 2, Hkv, D]; then varlen's [total, 3, H, D].
    qkv, q, kv = tensors((1, 5, 3, 2, 8), (1, 5, 4, 8), (1, 7, 2, 2, 8), requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    rng = torch.tensor([3, 1, 7], dtype=torch.int64)
    torch.library.opcheck(_torch_ops.packed_fwd, (None, qkv, None, None, None, None,
                                                  *SCALARS.values(), 0.2, rng))
    torch.library.opcheck(_torch_ops.packed_fwd, (q, kv, None, None, None, sinks,
                                                  *SCALARS.values()))
    out, lse = _torch_ops.packed_fwd(q.detach(), kv.detach(), None, None, None, None,
                                     *SCALARS.values())
    torch.library.opcheck(_torch_ops.packed_bwd, (torch.randn_like(out), q.detach(), kv.detach(),
                                                  out, lse, None, None, None, None,
                                                  *SCALARS.values(), False))
    packed = tensors((9, 3, 2, 16), requires_grad=True)[0]
    cu = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    torch.library.opcheck(_torch_ops.packed_fwd, (None, packed, cu, cu, None, None,
                                                  *SCALARS.values()))


def test_packed_gradient_is_written_by_the_packed_op():
    # The packed variants' backward is packed_bwd's one tensor, equal bit for bit to autograd's
    # sum over the views of the unpacked call.
    qkv = tensors((2, 21, 3, 4, 16), requires_grad=True)[0]
    out = flashattn.flash_attn_qkvpacked_func(qkv, causal=True)
    assert "packed_fwd" in out.grad_fn.name()
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    (want,) = torch.autograd.grad(flashattn.flash_attn_func(*qkv.unbind(2), causal=True), qkv,
                                  dout)
    assert torch.equal(dqkv, want)

    def step(qkv):
        return flashattn.flash_attn_qkvpacked_func(qkv, causal=True, softcap=10.0)

    compiled = torch.compile(step, fullgraph=True)(qkv)
    assert torch.equal(torch.autograd.grad(compiled, qkv, dout)[0],
                       torch.autograd.grad(step(qkv), qkv, dout)[0])


def test_opcheck_varlen_paged_forward():
    q, k_pages, v_pages = tensors((9, 4, 16), (6, 4, 2, 16), (6, 4, 2, 16))
    cu_q = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 14], dtype=torch.int32)  # key counts 5, 2, 7: pages of 4
    table = torch.tensor([[4, 0], [5, 5], [1, 3]], dtype=torch.int32)
    torch.library.opcheck(_torch_ops.varlen_paged_fwd, (q, k_pages, v_pages, table, cu_q, cu_k,
                                                        None, None, *SCALARS.values()))


@pytest.mark.parametrize("paged", [False, True])
def test_opcheck_kvcache_declares_its_append(paged):
    q, k_new, v_new = tensors((2, 1, 4, 16), (2, 1, 2, 16), (2, 1, 2, 16))
    if paged:
        k_cache, v_cache = tensors((6, 4, 2, 16), (6, 4, 2, 16), seed=1)
        table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    else:
        k_cache, v_cache = tensors((2, 12, 2, 16), (2, 12, 2, 16), seed=1)
        table = None
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    torch.library.opcheck(_torch_ops.kvcache_fwd, (q, k_cache, v_cache, lengths, table, k_new,
                                                   v_new, None, *SCALARS.values()))


def test_opcheck_kvcache_with_rotary_leftpad_and_batch_idx():
    q, k_new, v_new = tensors((2, 1, 4, 16), (2, 1, 2, 16), (2, 1, 2, 16))
    k_cache, v_cache = tensors((3, 12, 2, 16), (3, 12, 2, 16), seed=1)
    angles = torch.rand(12, 4) * 6.28
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    leftpad = torch.tensor([1, 0], dtype=torch.int32)
    batch_idx = torch.tensor([2, 0], dtype=torch.int32)
    torch.library.opcheck(_torch_ops.kvcache_fwd, (q, k_cache, v_cache, lengths, None, k_new,
                                                   v_new, None, *SCALARS.values(), angles.cos(),
                                                   angles.sin(), leftpad, batch_idx, False))


def test_fullgraph_compile_of_flash_attn_func_with_autograd():
    q, k, v, sinks = tensors((2, 33, 4, 32), (2, 40, 2, 32), (2, 40, 2, 32), (4,),
                             requires_grad=True)

    def attend(q, k, v, sinks):
        return 2.0 * flashattn.flash_attn_func(q, k, v, causal=True, softcap=20.0,
                                               window_size=(16, 0), sinks=sinks)

    # The loss is summed outside the compiled function: inductor's own reduction order would
    # move its last bit, while the graph's ops (the forward op, an exact doubling, the backward
    # op) must give eager mode's results bit for bit.
    dout = tensors((2, 33, 4, 32), seed=5)[0]
    expected = attend(q, k, v, sinks)
    expected_grads = torch.autograd.grad(expected, (q, k, v, sinks), dout)
    actual = torch.compile(attend, fullgraph=True)(q, k, v, sinks)
    grads = torch.autograd.grad(actual, (q, k, v, sinks), dout)
    assert torch.equal(actual, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.equal(grad, expected_grad)


def test_fullgraph_compile_of_varlen_and_sdpa():
    q, k, v = tensors((9, 4, 16), (12, 2, 16), (12, 2, 16))
    cu_q = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 12], dtype=torch.int32)

    def varlen(q, k, v):
        return flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 5, causal=True)

    assert torch.equal(torch.compile(varlen, fullgraph=True)(q, k, v), varlen(q, k, v))

    import flashattn.torch as fa_torch
    query, key, value = tensors((2, 4, 11, 16), (2, 2, 11, 16), (2, 2, 11, 16))

    def sdpa(query, key, value):
        return fa_torch.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                     enable_gqa=True)

    assert torch.equal(torch.compile(sdpa, fullgraph=True)(query, key, value),
                       sdpa(query, key, value))


def test_fullgraph_compile_of_a_kvcache_decode_step_appends_in_place():
    q, k_new, v_new = tensors((2, 1, 4, 16), (2, 1, 2, 16), (2, 1, 2, 16))
    caches = [tensors((2, 12, 2, 16), (2, 12, 2, 16), seed=1) for _ in range(2)]
    lengths = torch.tensor([3, 9], dtype=torch.int32)

    def step(q, k_cache, v_cache, k_new, v_new):
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                 cache_seqlens=lengths)

    expected = step(q, *caches[0], k_new, v_new)
    actual = torch.compile(step, fullgraph=True)(q, *caches[1], k_new, v_new)
    assert torch.equal(actual, expected)
    for compiled_cache, eager_cache in zip(caches[1], caches[0]):
        assert torch.equal(compiled_cache, eager_cache)  # the append happened under compile too
    assert torch.equal(caches[1][0][0, 3], k_new[0, 0])


def test_every_op_is_in_the_flashattn_namespace():
    names = {op._qualname for op in _torch_ops.all_ops()}
    assert names == {f"flashattn::{n}" for n in ("fwd", "bwd", "varlen_fwd", "varlen_bwd",
                                                  "varlen_paged_fwd", "kvcache_fwd", "packed_fwd",
                                                  "packed_bwd")}
    for name in names:
        assert hasattr(torch.ops.flashattn, name.split("::")[1])
