"""What a quantized KV cache costs in accuracy: attention over an int8 / fp8 cache against the
same attention over the unquantized f32 cache (the user's question), beside the kernel's own
error against the fp64 reference on the dequantized cache (the library's contract).

    PYTHONPATH=build/ci/python python3 bench/python/kv_quant_error.py [--keys 4096] [--seed 0]

Inputs: decode rows (B = 1, Hq = 32 on Hkv = 8, D = 128) against `--keys` keys drawn N(0, 1)
("random"), and the same with 4 outlier channels of K and V scaled by 20 ("outliers", as the
channels that dominate LLM keys). Scales: int8 per row (max|x| / 127, written by the quantizer),
int8 per group of 32 dims (llama.cpp's q8_0 blocks), fp8 E4M3 and E5M2 with one scale per KV head
fitted to the head's max|x| (vLLM's per-head k_scale). Errors relative to max|out| of the f32
cache's attention; "contract" is the largest |kernel − fp64 on the dequantized cache| over
max|out|.
"""

import argparse

import ml_dtypes
import numpy as np

import flashattn

FORMATS = [("int8 per row", "int8", None), ("int8 per 32 dims", "int8", 32),
           ("fp8 e4m3 per head", "fp8_e4m3", None), ("fp8 e5m2 per head", "fp8_e5m2", None)]
LARGEST = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
NUMPY_FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def quantize(values, fmt, group):
    if fmt == "int8":
        return flashattn.quantize_kv(values, group_size=group)
    per_head = np.abs(values).max(axis=(0, 1, 3)).astype(np.float32) / np.float32(LARGEST[fmt])
    codes = np.empty(values.shape, dtype=NUMPY_FP8[fmt])
    flashattn.quantize_kv(values, codes, per_head)
    return codes, per_head


def dequantize(codes, scales):
    c = codes.astype(np.float64)
    s = np.asarray(scales, dtype=np.float64)
    if s.ndim == 1:  # per KV head
        return c * s[None, None, :, None]
    if s.ndim == 3:
        s = s[..., None]
    return (c.reshape(*c.shape[:-1], s.shape[-1], -1) * s[..., None]).reshape(c.shape)


def reference(q, k, v):
    hq, hkv = q.shape[2], k.shape[2]
    out = np.empty(q.shape)
    for h in range(hq):
        s = q[0, :, h].astype(np.float64) @ k[0, :, h // (hq // hkv)].T / np.sqrt(q.shape[3])
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[0, :, h] = p @ v[0, :, h // (hq // hkv)] / p.sum(axis=1, keepdims=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4096, help="cached keys (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    hq, hkv, d = 32, 8, 128
    print(f"{args.keys} keys, Hq {hq} on Hkv {hkv}, D {d}; errors over max|out| of the f32 cache")
    print(f"{'inputs':10} {'cache':20} {'max err':>10} {'rms err':>10} {'contract':>10}")
    for inputs in ("random", "outliers"):
        k = rng.standard_normal((1, args.keys, hkv, d)).astype(np.float32)
        v = rng.standard_normal((1, args.keys, hkv, d)).astype(np.float32)
        if inputs == "outliers":
            channels = rng.choice(d, 4, replace=False)
            k[..., channels] *= 20
            v[..., channels] *= 20
        q = rng.standard_normal((1, 1, hq, d)).astype(np.float32)
        lengths = np.array([args.keys], dtype=np.int32)
        exact = flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)
        scale = np.abs(exact).max()
        for name, fmt, group in FORMATS:
            k_codes, k_scale = quantize(k, fmt, group)
            v_codes, v_scale = quantize(v, fmt, group)
            out = flashattn.flash_attn_with_kvcache(q, k_codes, v_codes, cache_seqlens=lengths,
                                                    k_scale=k_scale, v_scale=v_scale)
            error = np.abs(out - exact)
            contract = np.abs(out - reference(q, dequantize(k_codes, k_scale),
                                              dequantize(v_codes, v_scale))).max()
            print(f"{inputs:10} {name:20} {error.max() / scale:10.2e} "
                  f"{np.sqrt((error ** 2).mean()) / scale:10.2e} {contract / scale:10.2e}")


if __name__ == "__main__":
    main()
