#!/usr/bin/env python3
"""flashattn's Python package beside PyTorch's CPU scaled_dot_product_attention, in one run.

Same inputs, same threads. Every case is verified first (the two results against each other,
within twice the derived fp32 forward bound plus one rounding of the output dtype, the same rule
as python/tests), then timed: the calls of the two libraries alternate, and the median of each is
kept. Ceilings measured in the same run on the same threads: the f32 FMA peak and, on CPUs with
AVX512-BF16, the bf16 dot peak (bench/ceilings.hpp, through the extension); f32 cases are
reported against the first, bf16 cases against the second.

    PYTHONPATH=build/release/python python3 bench/python/compare_torch.py \
        [--threads 2] [--repeats 7] [--results bench/RESULTS.md]

--results rewrites the table between the markers "<!-- compare_torch begin -->" and
"<!-- compare_torch end -->" of that file (they must be there).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time


import omp_threads  # noqa: E402  (beside this script)

omp_threads.set_from_argv()

import torch  # noqa: E402

import flashattn  # noqa: E402
import flashattn.torch as fat  # noqa: E402
from flashattn import _flashattn  # noqa: E402

U32 = 2.0 ** -24
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def visible_pairs(seqlen: int, causal: bool) -> int:
    return seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen


def forward_flops(batch, heads, seqlen, dim, causal) -> float:
    return 4.0 * batch * heads * dim * visible_pairs(seqlen, causal)


def alternate(calls, repeats: int) -> list[float]:
    """Median seconds of each call, the calls alternated round by round after one warm-up."""
    for call in calls:
        call()
    times = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def bound(q, k, v, out_dtype) -> float:
    dim, seqlen = q.shape[-1], k.shape[-2]
    mq, mk, mv = (float(t.float().abs().max()) for t in (q, k, v))
    fp32 = U32 * mv * (4 * dim ** -0.5 * dim * mq * mk + 2 * seqlen + 16)
    return 2 * fp32 + 2 * UNIT[out_dtype] * mv


def run_case(name, dtype, causal, backward, shape, repeats):
    batch, heads, seqlen, dim = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
    flops = forward_flops(batch, heads, seqlen, dim, causal) * (3.5 if backward else 1.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if backward:
        dout = torch.randn(shape).to(dtype)
        leaves = {}

        def make(fn, key):
            def call():
                ins = [t.detach().requires_grad_() for t in (q, k, v)]
                fn(*ins, is_causal=causal).backward(dout)
                leaves[key] = ins
            return call

        ours, theirs = make(fat.scaled_dot_product_attention, "ours"), make(sdpa, "torch")
        ours(), theirs()
        checks = [(leaves["ours"][i].grad, leaves["torch"][i].grad) for i in range(3)]
        # Gradients: 64 fp32 roundings per term of the longest sum a gradient element takes
        # (Sq + Skv + D terms) at the largest gradient, python/tests/test_autograd.py's floor
        # times 16 for two implementations that both round.
        largest = max(float(b.float().abs().max()) for _, b in checks)
        tol = 64 * U32 * (2 * seqlen + dim) * largest
    else:
        ours_out = fat.scaled_dot_product_attention(q, k, v, is_causal=causal)
        theirs_out = sdpa(q, k, v, is_causal=causal)
        checks = [(ours_out, theirs_out)]
        tol = bound(q, k, v, dtype)

        def ours():
            fat.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def theirs():
            sdpa(q, k, v, is_causal=causal)
    err = max(float((a.float() - b.float()).abs().max()) for a, b in checks)
    if not err <= tol:
        sys.exit(f"compare_torch: {name}: flashattn and torch differ by {err:.3g} > {tol:.3g}")
    # The same forward through flash_attn_func on [B, S, H, D] tensors of its own layout.
    calls = [ours, theirs]
    if not backward:
        qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        calls.append(lambda: flashattn.flash_attn_func(qs, ks, vs, causal=causal))
    times = alternate(calls, repeats)
    return dict(case=name, peak="bf16" if dtype == torch.bfloat16 else "f32", ours=times[0], torch=times[1],
                func=times[2] if len(times) > 2 else None, gflops=flops / times[0] / 1e9,
                torch_gflops=flops / times[1] / 1e9, error=err, tolerance=tol)


def cpu_name() -> str:
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.machine()
    return (f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family')}, "
            f"model {fields.get('model')})")


def table(rows, threads, peaks, shape) -> str:
    batch, heads, seqlen, dim = shape
    bf16_peak = f"{peaks['bf16']:.0f}" if peaks["bf16"] else "none (no AVX512-BF16)"
    lines = [
        f"{datetime.date.today()}, {cpu_name()}, {threads} threads, torch {torch.__version__}, "
        f"flashattn {flashattn.__version__}; f32 FMA peak {peaks['f32']:.0f} GFLOP/s, bf16 dot "
        f"peak {bf16_peak} (this run). Shape [B={batch}, H={heads}, S={seqlen}, D={dim}], "
        "median times; `flashattn` is flashattn.torch.scaled_dot_product_attention on torch's "
        "[B, H, S, D] tensors, `func` flash_attn_func on [B, S, H, D] ones. Each case verified "
        "against torch first.",
        "",
        "| case | flashattn ms | func ms | torch ms | flashattn / torch speed | flashattn GFLOP/s "
        "| / peak | torch GFLOP/s | max diff (tolerance) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        func = f"{r['func'] * 1e3:.1f}" if r["func"] else "–"
        lines.append(
            f"| {r['case']} | {r['ours'] * 1e3:.1f} | {func} | {r['torch'] * 1e3:.1f} | "
            f"{r['torch'] / r['ours']:.2f}× | {r['gflops']:.1f} | "
            f"{r['gflops'] / (peaks[r['peak']] or peaks['f32']):.2f} | "
            f"{r['torch_gflops']:.1f} | {r['error']:.2g} ({r['tolerance']:.2g}) |")
    return "\n".join(lines)


def update_results(path: str, text: str) -> None:
    begin, end = "<!-- compare_torch begin -->", "<!-- compare_torch end -->"
    content = open(path, encoding="utf-8").read()
    if begin not in content or end not in content:
        sys.exit(f"compare_torch: {path} has no {begin} ... {end} markers")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{begin}\n{text}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="threads of both (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each (default 7)")
    parser.add_argument("--results", help="RESULTS.md whose compare_torch table to rewrite")
    parser.add_argument("--quick", action="store_true", help="a small shape, for a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = (1, 4, 128, 64) if args.quick else (2, 32, 1024, 128)
    cases = [("f32 non-causal, forward", torch.float32, False, False),
             ("f32 causal, forward", torch.float32, True, False),
             ("bf16 non-causal, forward", torch.bfloat16, False, False),
             ("bf16 causal, forward", torch.bfloat16, True, False),
             ("f32 causal, forward + backward (autograd)", torch.float32, True, True)]
    peaks = {"f32": _flashattn.fma_peak_gflops(args.threads),
             "bf16": _flashattn.bf16_dot_peak_gflops(args.threads)}
    rows = []
    for i, (name, dtype, causal, backward) in enumerate(cases):
        print(f"compare_torch: [{i + 1}/{len(cases)}] {name}", file=sys.stderr, flush=True)
        rows.append(run_case(name, dtype, causal, backward, shape, args.repeats))
    text = table(rows, args.threads, peaks, shape)
    print(text)
    if args.results:
        update_results(args.results, text)
        print(f"compare_torch: wrote the table into {args.results}", file=sys.stderr)


if __name__ == "__main__":
    main()
