"""attn_implementation="flashattn" in transformers, against transformers' own "eager" attention.

Tiny randomly initialised models (2 layers, hidden 64, 4 query heads on 2 KV heads, head_dim 16)
of every family whose attention flashattn must reproduce: Llama and Qwen3 (plain causal GQA),
Mistral (a sliding window), Gemma 2 (softcap, alternating sliding layers, query_pre_attn_scalar),
Gemma 3 (sliding layers, q/k norms), gpt-oss (learned sinks, s_aux) and DeepSeek-V3 (Multi-head
Latent Attention: a query/key head dim of 24 against a value head dim of 12, which reach flashattn
as they are). The sequences are longer than the window of 8, so the window cuts keys.

Bounds. Both paths compute in fp32; eager materialises softmax(QK^T)V with torch's matmuls, we
accumulate block by block. Each attention output differs by a few fp32 roundings of a
normalised average (~1e-7 relative), and the two layers' MLPs and norms carry that to the logits
with a gain of order one: 1e-5 relative to the largest logit leaves two orders of margin and
still catches any wrong mask, window or scale (those move logits by > 1e-2). Gradients of one
training step carry the same roundings through the backward: 1e-4 relative per parameter.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is fetched, nothing may be

import pytest

from conftest import requires_torch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import flashattn.transformers  # noqa: E402,F401  (registers "flashattn")

pytestmark = requires_torch

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256)
WINDOW = 8


def _configs():
    t = transformers
    return {
        "llama": t.LlamaConfig(**COMMON),
        "qwen3": t.Qwen3Config(**COMMON),
        "mistral": t.MistralConfig(**COMMON, sliding_window=WINDOW),
        "gemma2": t.Gemma2Config(**COMMON, sliding_window=WINDOW, attn_logit_softcapping=50.0,
                                 query_pre_attn_scalar=16),
        "gemma3": t.Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=16),
        "gpt_oss": t.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                  sliding_window=WINDOW),
        "deepseek_v3": t.DeepseekV3Config(
            # MLA has its own head dims (qk_*_head_dim, v_head_dim), one KV head per query head.
            **{**{k: v for k, v in COMMON.items() if k != "head_dim"}, "num_key_value_heads": 4},
            moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12),
    }


MODELS = list(_configs())


def build(name: str, implementation: str, *, train: bool = False):
    """The model `name` with `implementation`, from the same seed (the same weights)."""
    torch.manual_seed(0)
    config = copy.deepcopy(_configs()[name])  # from_config writes the implementation into it
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=torch.float32)
    assert model.config._attn_implementation == implementation
    return model.train(train)


def relative_error(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def inputs(batch=2, seqlen=21, padding=None):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (batch, seqlen), generator=generator)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    if padding == "left":
        mask[0, :6] = 0
    elif padding == "right":
        mask[0, -6:] = 0
    return ids, mask


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_eager(name, padding):
    eager, ours = build(name, "eager"), build(name, "flashattn")
    ids, mask = inputs(padding=padding)
    kwargs = {} if padding is None else {"attention_mask": mask}
    with torch.no_grad():
        expected = eager(ids, **kwargs).logits
        actual = ours(ids, **kwargs).logits
    real = mask.bool()  # padded positions are discarded by any model; only real tokens compare
    assert relative_error(actual[real], expected[real]) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_eager(name):
    eager, ours = build(name, "eager"), build(name, "flashattn")
    ids, mask = inputs(padding="left")
    expected = eager.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    actual = ours.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_static_cache_generation_matches_eager(name):
    eager, ours = build(name, "eager"), build(name, "flashattn")
    ids, mask = inputs(padding="left")
    options = dict(attention_mask=mask, max_new_tokens=10, do_sample=False,
                   cache_implementation="static")
    assert torch.equal(ours.generate(ids, **options), eager.generate(ids, **options))


@pytest.mark.parametrize("name", MODELS)
def test_training_step_gradients_match_eager(name):
    eager, ours = build(name, "eager", train=True), build(name, "flashattn", train=True)
    ids, mask = inputs(padding="right")
    for model in (eager, ours):
        model(ids, attention_mask=mask, labels=ids).loss.backward()
    expected = dict(eager.named_parameters())
    checked = 0
    for parameter_name, parameter in ours.named_parameters():
        reference = expected[parameter_name].grad
        if reference is None or not reference.abs().max() > 0:
            continue
        assert relative_error(parameter.grad, reference) <= 1e-4, parameter_name
        checked += 1
    assert checked > 10
    if name == "gpt_oss":  # the learned sinks (s_aux) get their gradient through flashattn
        sinks = [n for n in expected if n.endswith("sinks")]
        assert sinks and all(expected[n].grad.abs().max() > 0 for n in sinks)


def test_the_model_gets_a_padding_mask_not_a_dense_one():
    seen = []
    original = flashattn.transformers.attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return original(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("flashattn", spy)
    try:
        model = build("llama", "flashattn")
        ids, mask = inputs(padding="left")
        with torch.no_grad():
            model(ids, attention_mask=mask)
            model(ids)
    finally:
        transformers.AttentionInterface.register("flashattn", original)
    assert seen == [(2, 21), (2, 21), None, None]


def test_compiled_model_fullgraph_matches_eager_mode():
    model = build("gemma2", "flashattn")
    ids, _ = inputs()
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, fullgraph=True)
        actual = compiled(ids).logits
    assert relative_error(actual, expected) <= 1e-5


def test_dropout_in_training_is_flashattns():
    # Training with attention_dropout: the call's mask comes from torch's generator, so a seed
    # reproduces a step, another seed changes it, and eval mode passes dropout 0 (as eager).
    config = copy.deepcopy(_configs()["llama"])
    config.attention_dropout = 0.3
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flashattn")
    model.train()
    ids, _ = inputs()

    def step(seed):
        model.zero_grad()
        torch.manual_seed(seed)
        loss = model(ids).logits.float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = step(1)
    again, grads_again = step(1)
    other, _ = step(2)
    assert torch.equal(loss, again)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    assert not torch.equal(loss, other)
    assert all(torch.isfinite(g).all() for g in grads)
    model.eval()
    with torch.no_grad():
        first = model(ids).logits
        assert torch.equal(first, model(ids).logits)  # no dropout in eval mode


def test_output_attentions_raises_a_clear_error():
    model = build("llama", "flashattn")
    ids, _ = inputs()
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)


def test_a_dense_mask_is_refused_by_name():
    model = build("llama", "flashattn")
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    k = v = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match=r"attention_mask: expected the 2-D padding mask"):
        flashattn.transformers.attention_forward(attention, q, k, v,
                                                 torch.ones(1, 1, 5, 5, dtype=torch.bool))


def test_transformers_flash_loader_gets_flashattn_functions():
    # transformers preloads a FlashAttention kernel for any name with "flash" in it.
    from transformers import modeling_flash_attention_utils as flash_utils
    loaded = flash_utils._lazy_imports("flashattn")
    assert loaded[:3] == (flashattn.flash_attn_func, flashattn.flash_attn_varlen_func,
                          flashattn.flash_attn_with_kvcache)


def test_continuous_batching_matches_eager_generation_one_prompt_at_a_time():
    # transformers' generate_batch runs a paged cache and packs the batch's sequences into one
    # row with cu_seq_lens: the varlen path.
    from transformers import GenerationConfig
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batched = build("llama", "flashattn").generate_batch(inputs=prompts, generation_config=config)
    eager = build("llama", "eager")
    for request_id, prompt in zip(sorted(batched), prompts):
        expected = eager.generate(torch.tensor([prompt]), generation_config=config)
        assert batched[request_id].generated_tokens == expected[0, len(prompt):].tolist()


def test_paged_decode_call_appends_and_matches_dense_attention():
    # The block-table call transformers makes on its decode fast path (CUDA only there): one
    # new token per sequence, its K/V written into the paged caches at the sequence's length.
    model = build("llama", "flashattn")
    attention = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    lengths, page_size, heads_kv, dim = [5, 11], 4, 2, 16
    k_cache = torch.randn(8, page_size, heads_kv, dim, generator=generator)
    v_cache = torch.randn(8, page_size, heads_kv, dim, generator=generator)
    block_table = torch.tensor([[6, 1, 0, 0], [3, 7, 2, 0]], dtype=torch.int32)
    q = torch.randn(1, 4, 2, dim, generator=generator)  # [1, Hq, sequences, D]
    k_new = torch.randn(1, heads_kv, 2, dim, generator=generator)
    v_new = torch.randn(1, heads_kv, 2, dim, generator=generator)
    cu_k = torch.tensor([0, lengths[0] + 1, lengths[0] + lengths[1] + 2], dtype=torch.int32)
    kwargs = dict(block_table=block_table, k_cache=k_cache, v_cache=v_cache, cu_seq_lens_k=cu_k,
                  cu_seq_lens_q=torch.tensor([0, 1, 2], dtype=torch.int32))
    out, _ = flashattn.transformers.attention_forward(attention, q, k_new, v_new, None,
                                                      scaling=0.25, **kwargs)
    assert out.shape == (1, 2, 4, dim)
    for b, length in enumerate(lengths):
        rows = torch.cat([k_cache[block_table[b]].reshape(-1, heads_kv, dim)])[:length + 1]
        assert torch.equal(rows[length], k_new[0, :, b])  # appended in place
        values = v_cache[block_table[b]].reshape(-1, heads_kv, dim)[:length + 1]
        keys = rows.repeat_interleave(2, dim=1)   # [L, Hq, D]
        values = values.repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[0, :, b], keys) * 0.25
        expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        assert relative_error(out[0, b], expected) <= 1e-5


def test_hf_generate_example_runs_and_agrees(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_generate.py"
    spec = importlib.util.spec_from_file_location("hf_generate", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--model", "gemma2", "--hidden", "64", "--heads", "4", "--kv-heads",
                         "2", "--head-dim", "16", "--vocab", "128", "--sliding-window", "8",
                         "--prompt-tokens", "20", "--new-tokens", "4", "--dtype", "f32",
                         "--impl", "flashattn,sdpa,eager"]) == 0
    printed = capsys.readouterr().out
    assert "sdpa              refused by transformers" in printed
    assert "flashattn / eager: prefill" in printed and "greedy tokens identical" in printed


def test_a_transformers_without_the_attention_interfaces_gets_a_clear_import_error(tmp_path):
    import subprocess
    import sys
    # A transformers 4.30 stand-in, first on the path: no AttentionInterface in it.
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("__version__ = '4.30.0'\n")
    (tmp_path / "transformers-4.30.0.dist-info").mkdir()
    (tmp_path / "transformers-4.30.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformers\nVersion: 4.30.0\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import flashattn\n"
            "try:\n    import flashattn.transformers\nexcept ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert ("flashattn.transformers needs transformers >= 4.56 (AttentionInterface and "
            "AttentionMaskInterface); found 4.30.0") in result.stdout
