#!/usr/bin/env python3
"""DeepSeek-shaped attention (issue 52), timed inside a torch process, against the machine's
ceilings measured in the same run (the f32 FMA peak, the bf16 dot peak: bench/ceilings.hpp).

1. Prefill on the seed shape's batch, heads and length, causal, f32 and bf16, through
   flash_attn_func: a query/key head dim of 192 with a value head dim of 128 (MLA's prefill
   heads) against 128/128, each in GFLOP/s with the FLOPs counted as (2·Dqk + 2·Dv) per visible
   (query, key) pair; the first's rate over the second's is the ratio the issue asks >= 0.9.
   And the f32 backward through autograd: its time over the forward's (asked <= 2.6).
2. MLA's absorbed decode: one query position, 128 query heads on one latent KV head of 576 dims
   whose first 512 are the values (flash_attn_with_kvcache(q, latent, latent[..., :512])), bf16,
   4k to 64k keys, dense and in pages of 64; GFLOP/s (128·(2·576 + 2·512) per key) over the bf16
   dot peak (asked >= 0.7), and against torch's scaled_dot_product_attention on the same
   latent as 128 heads of keys and values (a view, expanded; asked >= 5x).

Every case is verified before it is timed, against float64 torch math on the same inputs (for
the prefill on two heads of the timed call's output and gradients), within the derived fp32
bound of python/tests (twice it, plus a rounding of the output dtype). Timed calls alternate
with their peer and the median of each is kept.

    PYTHONPATH=build/ci/python python3 bench/python/mla_bench.py [--threads 2] [--repeats 5]
        [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys

from compare_torch import U32, UNIT, alternate, cpu_name  # sets OMP_NUM_THREADS first

import torch  # noqa: E402

import flashattn  # noqa: E402
from flashattn import _flashattn  # noqa: E402


def forward_bound(q, k, v, dtype) -> float:
    """Twice the fp32 forward bound of python/tests/conftest.py plus two roundings of dtype."""
    dim, seqlen = q.shape[-1], k.shape[-3]
    mq, mk, mv = (float(t.float().abs().max()) for t in (q, k, v))
    fp32 = U32 * mv * (4 * dim ** -0.5 * dim * mq * mk + 2 * seqlen + 16)
    return 2 * fp32 + 2 * UNIT[dtype] * mv


def attention64(q, k, v, causal):
    """[B, S, H, D] attention in float64, bottom-right causal; GQA by grouping the query heads
    (not repeating K and V: 128 copies of a 64k-key latent would not fit in memory)."""
    batch, sq, heads, dim = q.shape
    skv, heads_kv = k.shape[1], k.shape[2]
    q = q.double().view(batch, sq, heads_kv, heads // heads_kv, dim)
    s = torch.einsum("bihgd,bjhd->bhgij", q, k.double()) / math.sqrt(dim)
    if causal:
        hidden = torch.arange(skv)[None, :] > torch.arange(sq)[:, None] + skv - sq
        s = s.masked_fill(hidden, -math.inf)
    out = torch.einsum("bhgij,bjhe->bihge", torch.softmax(s, dim=-1), v.double())
    return out.reshape(batch, sq, heads, v.shape[-1])


def check(name, error, tolerance):
    if not error <= tolerance:
        sys.exit(f"mla_bench: {name}: error {error:.3g} > tolerance {tolerance:.3g}")


def prefill_call(shape, dk, dv, dtype):
    """A verified causal flash_attn_func call of head dims dk (q, k) and dv (v), and its FLOPs."""
    batch, heads, seqlen = shape
    torch.manual_seed(dk + dv)
    q, k = torch.randn(batch, seqlen, heads, dk), torch.randn(batch, seqlen, heads, dk)
    v = torch.randn(batch, seqlen, heads, dv)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    # Heads are independent: two of the timed call's heads against float64 on their inputs.
    want = attention64(q[:, :, :2], k[:, :, :2], v[:, :, :2], True)
    check(f"prefill {dk}/{dv} {dtype}", float((out[:, :, :2].double() - want).abs().max()),
          forward_bound(q[:, :, :2], k[:, :, :2], v[:, :, :2], dtype))
    pairs = batch * heads * seqlen * (seqlen + 1) // 2
    return (lambda: flashattn.flash_attn_func(q, k, v, causal=True)), (2 * dk + 2 * dv) * pairs


def backward_ratio(shape, dk, dv, repeats):
    batch, heads, seqlen = shape
    torch.manual_seed(7)
    q0, k0 = torch.randn(batch, seqlen, heads, dk), torch.randn(batch, seqlen, heads, dk)
    v0, dout = torch.randn(batch, seqlen, heads, dv), torch.randn(batch, seqlen, heads, dv)
    leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    flashattn.flash_attn_func(*leaves, causal=True).backward(dout)
    # Two heads' gradients against float64 autograd on their inputs: the floor of
    # python/tests/test_autograd.py (4 fp32 roundings per term of the longest sum) times 16.
    small = [t[:, :, :2].detach().double().requires_grad_() for t in (q0, k0, v0)]
    attention64(*small, True).backward(dout[:, :, :2].double())
    for ours, truth in zip(leaves, small):
        largest = float(truth.grad.abs().max())
        check("backward", float((ours.grad[:, :, :2].double() - truth.grad).abs().max()),
              64 * U32 * (2 * seqlen + max(dk, dv)) * largest)

    def forward():
        with torch.no_grad():
            flashattn.flash_attn_func(q0, k0, v0, causal=True)

    def both():
        ins = [t.detach().requires_grad_() for t in (q0, k0, v0)]
        flashattn.flash_attn_func(*ins, causal=True).backward(dout)

    forward_s, both_s = alternate([forward, both], repeats)
    return (both_s - forward_s) / forward_s


def mla_decode(keys, paged, repeats, peer):
    torch.manual_seed(keys)
    heads = 128
    latent = torch.randn(1, keys, 1, 576).bfloat16()
    q = torch.randn(1, 1, heads, 576).bfloat16()
    lengths = torch.tensor([keys], dtype=torch.int32)
    if paged:
        pages = keys // 64
        order = torch.randperm(pages)
        cache = torch.empty(pages, 64, 1, 576, dtype=torch.bfloat16)
        cache[order] = latent.view(pages, 64, 1, 576)
        table = order.to(torch.int32).view(1, pages)
    else:
        cache, table = latent, None

    def ours():
        return flashattn.flash_attn_with_kvcache(q, cache, cache[..., :512], cache_seqlens=lengths,
                                                 block_table=table)

    out = ours()
    want = attention64(q, latent, latent[..., :512], False)
    check(f"MLA decode {keys}", float((out.double() - want).abs().max()),
          forward_bound(q, latent, latent[..., :512], torch.bfloat16))
    calls = [ours]
    theirs_error = None
    if peer:
        # torch's SDPA on the same latent as 128 heads: expanded views, [B, H, S, E].
        query = q.transpose(1, 2)
        key = latent.transpose(1, 2).expand(1, heads, keys, 576)
        value = latent[..., :512].transpose(1, 2).expand(1, heads, keys, 512)

        def theirs():
            return torch.nn.functional.scaled_dot_product_attention(query, key, value)

        try:
            theirs_error = float((theirs().transpose(1, 2).double() - want).abs().max())
            calls.append(theirs)
        except (RuntimeError, NotImplementedError) as error:
            theirs_error = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
    times = alternate(calls, repeats)
    flops = heads * keys * (2 * 576 + 2 * 512)
    return flops / times[0] / 1e9, times, theirs_error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each (default 5)")
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = {"f32": _flashattn.fma_peak_gflops(args.threads),
             "bf16": _flashattn.bf16_dot_peak_gflops(args.threads)}
    shape = (1, 4, 256) if args.quick else (2, 32, 1024)
    print(f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}, flashattn "
          f"{flashattn.__version__}; f32 FMA peak {peaks['f32']:.0f} GFLOP/s, bf16 dot peak "
          f"{peaks['bf16'] or 0:.0f} GFLOP/s (this run)\n")
    print(f"Prefill [B={shape[0]}, H={shape[1]}, S={shape[2]}], causal, flash_attn_func; "
          "FLOPs (2·Dqk + 2·Dv) per visible pair\n")
    print("| dtype | 128/128 GFLOP/s | 192/128 GFLOP/s | ratio (>= 0.9) | 192/128 / peak |")
    print("|---|--:|--:|--:|--:|")
    for dtype, peak in ((torch.float32, peaks["f32"]), (torch.bfloat16, peaks["bf16"])):
        print(f"prefill {dtype}", file=sys.stderr, flush=True)
        (equal_call, equal_flops), (mla_call, mla_flops) = (
            prefill_call(shape, 128, 128, dtype), prefill_call(shape, 192, 128, dtype))
        equal_s, mla_s = alternate([equal_call, mla_call], args.repeats)
        equal, mla = equal_flops / equal_s / 1e9, mla_flops / mla_s / 1e9
        print(f"| {str(dtype).replace('torch.', '')} | {equal:.1f} | {mla:.1f} | "
              f"{mla / equal:.2f} | {mla / (peak or peaks['f32']):.2f} |")
    print("backward", file=sys.stderr, flush=True)
    ratio = backward_ratio(shape, 192, 128, args.repeats)
    print(f"\nf32 causal 192/128 backward / forward time: {ratio:.2f} (<= 2.6)\n")

    print("MLA absorbed decode, B=1, Sq=1, 128 query heads, one latent KV head 576/512, bf16\n")
    print("| keys | cache | flashattn ms | GFLOP/s | / bf16 peak (>= 0.7) | torch SDPA ms | "
          "flashattn / torch (>= 5) |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    for keys in ((1024, 4096) if args.quick else (4096, 16384, 65536)):
        for paged in (False, True):
            print(f"decode {keys} {'paged' if paged else 'dense'}", file=sys.stderr, flush=True)
            # torch's CPU SDPA takes E != Ev only on its math path, which repeats the latent as
            # 128 heads in memory: 0.6 GB at 4k keys, 9.7 GB at 64k. It runs at 4k keys only.
            peer = not paged and keys <= 4096
            gflops, times, theirs = mla_decode(keys, paged, args.repeats, peer=peer)
            torch_ms = (f"{times[1] * 1e3:.1f}" if len(times) > 1
                        else theirs or ("–" if paged else "not run (memory)"))
            speed = f"{times[1] / times[0]:.1f}×" if len(times) > 1 else "–"
            print(f"| {keys} | {'pages of 64' if paged else 'dense'} | {times[0] * 1e3:.2f} | "
                  f"{gflops:.0f} | {gflops / (peaks['bf16'] or peaks['f32']):.2f} | {torch_ms} | "
                  f"{speed} |")


if __name__ == "__main__":
    main()
