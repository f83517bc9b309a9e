#!/usr/bin/env python3
"""Greedy generation with a randomly initialised Hugging Face model, one attention implementation
after another: prefill and decode tokens/s of attn_implementation="flashattn" beside "sdpa" and
"eager", with the tokens each generated compared.

    python3 examples/hf_generate.py --model llama --prompt-tokens 8192 --new-tokens 32 --dtype bf16

No weights are fetched: the model is built from a config (the family's, with the shape given on
the command line) and initialised from --seed, the same weights for every implementation. Needs
torch and transformers; flashattn from the build tree (PYTHONPATH=build/release/python) or pip.
"""

from __future__ import annotations

import argparse
import copy
import gc
import resource
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama",
                        choices=["llama", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss"],
                        help="the model family (its attention: sliding windows, softcap, sinks)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size")
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim")
    parser.add_argument("--sliding-window", type=int, default=4096,
                        help="window of the families with sliding layers")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to decode")
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    parser.add_argument("--impl", default="flashattn,sdpa",
                        help="comma-separated attn_implementations, run in this order")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "prompt_tokens",
                 "new_tokens", "batch", "vocab"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}: expected a positive number, got "
                         f"{getattr(args, name)}")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads: expected a divisor of --heads = {args.heads}, got "
                     f"{args.kv_heads}")
    return args


def make_config(args):
    import transformers as t
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                  intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.head_dim,
                  max_position_embeddings=args.prompt_tokens + args.new_tokens + 1)
    window = dict(sliding_window=args.sliding_window)
    return {
        "llama": lambda: t.LlamaConfig(**common),
        "qwen3": lambda: t.Qwen3Config(**common),
        "mistral": lambda: t.MistralConfig(**common, **window),
        "gemma2": lambda: t.Gemma2Config(**common, **window, attn_logit_softcapping=50.0,
                                         query_pre_attn_scalar=args.head_dim),
        "gemma3": lambda: t.Gemma3TextConfig(**common, **window,
                                             query_pre_attn_scalar=args.head_dim),
        "gpt_oss": lambda: t.GptOssConfig(**common, **window, num_local_experts=4,
                                          num_experts_per_tok=2),
    }[args.model]()


def run(args, config, implementation, prompt):
    """(prefill tokens/s, decode tokens/s, generated tokens) of one implementation."""
    import torch
    from transformers import DynamicCache
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = __import__("transformers").AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=implementation, dtype=dtype).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        start = time.perf_counter()
        logits = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1]
        prefill = time.perf_counter() - start
        tokens = [logits.argmax(-1, keepdim=True)]
        start = time.perf_counter()
        for step in range(args.new_tokens - 1):
            logits = model(tokens[-1], past_key_values=cache, use_cache=True).logits[:, -1]
            tokens.append(logits.argmax(-1, keepdim=True))
            print(f"\r  {implementation}: decoded {step + 2}/{args.new_tokens}", end="",
                  file=sys.stderr, flush=True)
        decode = time.perf_counter() - start
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    del model, cache
    gc.collect()
    decoded = args.batch * max(args.new_tokens - 1, 0)
    return (args.batch * args.prompt_tokens / prefill, decoded / decode if decoded else 0.0,
            torch.cat(tokens, dim=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import flashattn.transformers  # noqa: F401  (registers "flashattn")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = make_config(args)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_tokens), generator=generator)
    print(f"{args.model}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads on "
          f"{args.kv_heads} KV heads of {args.head_dim}, {args.dtype}, batch {args.batch}, "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'implementation':<16}{'prefill tok/s':>15}{'decode tok/s':>15}")
    results = {}
    for implementation in [name.strip() for name in args.impl.split(",") if name.strip()]:
        try:
            prefill, decode, tokens = run(args, config, implementation, prompt)
        except ValueError as refusal:  # e.g. Gemma 2 and gpt-oss refuse "sdpa"
            print(f"{implementation:<16}  refused by transformers: "
                  f"{str(refusal).split('. ')[0]}", flush=True)
            continue
        results[implementation] = (prefill, decode, tokens)
        print(f"{implementation:<16}{prefill:>15.1f}{decode:>15.2f}", flush=True)
    names = list(results)
    if "flashattn" in results:
        for other in names:
            if other != "flashattn":
                prefill, decode, tokens = results[other]
                same = torch.equal(tokens, results["flashattn"][2])
                print(f"flashattn / {other}: prefill {results['flashattn'][0] / prefill:.2f}x, "
                      f"decode {results['flashattn'][1] / decode:.2f}x, "
                      f"greedy tokens {'identical' if same else 'differ'}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the process: {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
