"""The MultiHeadAttention layer from Python against the seed's formula written in numpy fp64:
Q = x W_Q + b_Q (and K, V from the context), attention per head, merge, y = att W_O + b_O."""

import numpy as np
import pytest

import flashattn
from conftest import U32, reference_attention, requires_torch, torch


def layer_fp64(layer, x, context, causal):
    hd, nh, nkv = layer.head_dim, layer.num_heads, layer.num_kv_heads
    w = {name: getattr(layer, name).astype(np.float64) for name in ("w_q", "w_k", "w_v", "w_o")}
    b = {name: getattr(layer, name).astype(np.float64) for name in ("b_q", "b_k", "b_v", "b_o")}
    ctx = x if context is None else context
    q = x @ w["w_q"] + (b["b_q"] if b["b_q"].size else 0)
    k = ctx @ w["w_k"] + (b["b_k"] if b["b_k"].size else 0)
    v = ctx @ w["w_v"] + (b["b_v"] if b["b_v"].size else 0)
    batch, sq, skv = x.shape[0], x.shape[1], ctx.shape[1]
    att, _ = reference_attention(q.reshape(batch, sq, nh, hd), k.reshape(batch, skv, nkv, hd),
                                 v.reshape(batch, skv, nkv, hd), causal=causal)
    return att.reshape(batch, sq, nh * hd) @ w["w_o"] + (b["b_o"] if b["b_o"].size else 0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_layer_matches_the_formula(rng, bias, cross):
    layer = flashattn.MultiHeadAttention(64, 8, num_kv_heads=2, bias=bias, seed=7)
    if bias:
        for name in ("b_q", "b_k", "b_v", "b_o"):
            getattr(layer, name)[:] = rng.standard_normal(getattr(layer, name).shape)
    x = rng.standard_normal((2, 37, 64), dtype=np.float32)
    context = rng.standard_normal((2, 53, 64), dtype=np.float32) if cross else None
    y = layer(x, context, causal=not cross)
    ref = layer_fp64(layer, x.astype(np.float64),
                     None if context is None else context.astype(np.float64), not cross)
    # Three fp32 products of length 64 (projections, attention's dot products, W_O) around an
    # attention whose error is of the order u32 (D + Skv): a few hundred roundings of max|y|.
    bound = 256 * U32 * (64 + 53) * np.abs(ref).max()
    assert np.abs(y - ref).max() <= bound


def test_weights_are_views_of_the_layer():
    layer = flashattn.MultiHeadAttention(16, 2)
    assert layer.w_q.shape == (16, 16) and layer.w_k.shape == (16, 16)
    layer.w_o[:] = 0.0
    assert np.all(layer.w_o == 0.0)
    y = layer(np.ones((1, 3, 16), np.float32))
    assert np.all(y == 0.0)  # W_O zero: the layer read the weights written through the view


@requires_torch
def test_torch_input_gives_torch_output():
    layer = flashattn.MultiHeadAttention(32, 4, seed=1)
    x = torch.randn(1, 5, 32)
    y = layer(x)
    assert isinstance(y, torch.Tensor)
    assert np.array_equal(y.numpy(), layer(x.numpy()))


def torch_module_from(layer):
    """flashattn.nn.MultiHeadAttention with the weights of the C++ layer `layer`."""
    from flashattn.nn import MultiHeadAttention
    module = MultiHeadAttention(layer.hidden, layer.num_heads, layer.num_kv_heads, bias=True)
    with torch.no_grad():
        for proj, name in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
            getattr(module, proj).weight.copy_(torch.from_numpy(getattr(layer, "w_" + name).T))
            bias = getattr(layer, "b_" + name)
            getattr(module, proj).bias.copy_(torch.from_numpy(bias) if bias.size else 0.0)
    return module


@requires_torch
@pytest.mark.parametrize("cross", [False, True])
def test_nn_module_matches_the_formula(rng, cross):
    layer = flashattn.MultiHeadAttention(64, 8, num_kv_heads=2, seed=3)
    module = torch_module_from(layer)
    x = rng.standard_normal((2, 37, 64), dtype=np.float32)
    context = rng.standard_normal((2, 53, 64), dtype=np.float32) if cross else None
    with torch.no_grad():
        y = module(torch.from_numpy(x), None if context is None else torch.from_numpy(context),
                   causal=not cross).numpy()
    ref = layer_fp64(layer, x.astype(np.float64),
                     None if context is None else context.astype(np.float64), not cross)
    bound = 256 * U32 * (64 + 53) * np.abs(ref).max()  # as test_layer_matches_the_formula
    assert np.abs(y - ref).max() <= bound


@requires_torch
def test_nn_module_gradients_match_torch_sdpa_composition():
    from flashattn.nn import MultiHeadAttention
    torch.manual_seed(0)
    module = MultiHeadAttention(48, 6, num_kv_heads=3, bias=True)
    x = torch.randn(2, 19, 48, requires_grad=True)
    module(x, causal=True).square().sum().backward()
    ours = {name: p.grad.clone() for name, p in module.named_parameters()}
    dx = x.grad.clone()
    module.zero_grad()
    x.grad = None

    def plain(x):  # the same layer with torch's SDPA (top-left causal = bottom-right here)
        b, s, _ = x.shape
        q = module.q_proj(x).view(b, s, 6, 8).transpose(1, 2)
        k = module.k_proj(x).view(b, s, 3, 8).transpose(1, 2)
        v = module.v_proj(x).view(b, s, 3, 8).transpose(1, 2)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)
        return module.o_proj(att.transpose(1, 2).reshape(b, s, 48))

    plain(x).square().sum().backward()
    # Both are fp32 attention backwards over 19 keys of 8 dims fed through the same fp32 Linear
    # backward: a few hundred roundings of the largest gradient at most. The scale is the
    # layer's largest gradient, not each parameter's own: k_proj.bias's gradient is 0 in exact
    # arithmetic (a shift of every key by b_k moves a row's scores by one constant), so both
    # sides hold rounding noise only.
    scale = max(parameter.grad.abs().max() for parameter in module.parameters())
    for name, parameter in module.named_parameters():
        assert (ours[name] - parameter.grad).abs().max() <= 512 * U32 * scale, name
    assert (dx - x.grad).abs().max() <= 512 * U32 * x.grad.abs().max()


@requires_torch
def test_nn_module_compiles_fullgraph_and_rejects_bad_shapes():
    from flashattn.nn import MultiHeadAttention
    torch.manual_seed(0)
    module = MultiHeadAttention(32, 4, num_kv_heads=2)
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        compiled = torch.compile(module, fullgraph=True)(x, causal=True)
        expected = module(x, causal=True)
    # The attention op is the same call; inductor may fuse a projection's bias into its matmul,
    # which moves a result by a rounding or two of the output.
    assert (compiled - expected).abs().max() <= 4 * U32 * expected.abs().max()
    with pytest.raises(ValueError, match=r"x: expected \[batch, seqlen, hidden = 32\]"):
        module(torch.randn(1, 9, 16))
    with pytest.raises(ValueError, match="num_kv_heads: expected a positive divisor"):
        MultiHeadAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_heads: expected a positive divisor"):
        MultiHeadAttention(30, 4)


@requires_torch
def test_nn_module_dropout_applies_in_training_only():
    # dropout as torch.nn.MultiheadAttention's: in training mode a step is reproduced by the seed
    # and differs with another; in eval mode none. The attention of a training step is
    # flash_attn_func's with the same draw from torch's generator.
    from flashattn.nn import MultiHeadAttention
    torch.manual_seed(0)
    module = MultiHeadAttention(32, 4, num_kv_heads=2, dropout=0.4)
    x = torch.randn(2, 17, 32)
    module.train()
    torch.manual_seed(5)
    first = module(x, causal=True)
    torch.manual_seed(5)
    assert torch.equal(module(x, causal=True), first)
    assert not torch.equal(module(x, causal=True), first)
    first.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())
    module.eval()
    with torch.no_grad():
        assert torch.equal(module(x, causal=True), module(x, causal=True))
    with pytest.raises(ValueError, match=r"dropout_p: expected a value in \[0, 1\)"):
        MultiHeadAttention(32, 4, dropout=1.0)
