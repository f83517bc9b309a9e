"""What appending (and quantizing) one token costs a decode step: flash_attn_with_kvcache with
one new K/V row per sequence against the same call attending to the same number of keys without
one, alternating, in a process with torch loaded.

    PYTHONPATH=build/ci/python python3 bench/python/append_cost.py [--keys 4096] [--calls 200]

B = 1, 32 query heads on 8 KV heads, D = 128, f32 q and new rows, 2 threads (torch's), for each
cache dtype: bf16, int8 (a scale per row written by the append) and fp8 E4M3 (one scale per
tensor). The appended row is written at the same position every call (cache_seqlens stays), so
both calls attend to keys + 1 keys. Prints the medians and the append's share of the step.
"""

import argparse
import statistics
import time

import torch

import flashattn


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4096, help="cached keys (default 4096)")
    parser.add_argument("--calls", type=int, default=200, help="calls of each kind (default 200)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    hq, hkv, d, cap = 32, 8, 128, args.keys + 1
    q = torch.randn(1, 1, hq, d)
    k_new, v_new = torch.randn(1, 1, hkv, d), torch.randn(1, 1, hkv, d)
    values_k, values_v = torch.randn(1, cap, hkv, d), torch.randn(1, cap, hkv, d)
    print(f"{args.keys} keys, Hq {hq} on Hkv {hkv}, D {d}, 2 threads, medians of {args.calls}")
    print(f"{'cache':10} {'attend us':>10} {'append+attend us':>17} {'append share':>13}")
    for name in ("bf16", "int8", "fp8_e4m3"):
        if name == "bf16":
            k, v = values_k.bfloat16(), values_v.bfloat16()
            scales = {}
        elif name == "int8":
            k, k_scale = flashattn.quantize_kv(values_k)
            v, v_scale = flashattn.quantize_kv(values_v)
            scales = dict(k_scale=k_scale, v_scale=v_scale)
        else:
            k = torch.empty(values_k.shape, dtype=torch.float8_e4m3fn)
            v = torch.empty_like(k)
            flashattn.quantize_kv(values_k, k, 4.0 / 448)
            flashattn.quantize_kv(values_v, v, 4.0 / 448)
            scales = dict(k_scale=4.0 / 448, v_scale=4.0 / 448)
        before = torch.tensor([args.keys], dtype=torch.int32)
        after = torch.tensor([args.keys + 1], dtype=torch.int32)
        attend = lambda: flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=after, **scales)
        append = lambda: flashattn.flash_attn_with_kvcache(q, k, v, k_new, v_new,
                                                           cache_seqlens=before, **scales)
        times = {attend: [], append: []}
        for _ in range(10):
            attend()
            append()
        for _ in range(args.calls):
            for call in (attend, append):
                start = time.perf_counter()
                call()
                times[call].append(time.perf_counter() - start)
        plain = statistics.median(times[attend]) * 1e6
        with_append = statistics.median(times[append]) * 1e6
        print(f"{name:10} {plain:10.1f} {with_append:17.1f} "
              f"{(with_append - plain) / with_append:13.1%}")


if __name__ == "__main__":
    main()
