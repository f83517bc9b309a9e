#!/usr/bin/env python3
"""flashattn inside a PyTorch process: the seed-shape forward with and without torch imported,
and the cost of a tiny call beside torch's own SDPA.

1. The seed shape's causal f32 forward (flash_attn_func on [2, 1024, 32, 128] numpy arrays), in
   child processes that alternate: one that never imports torch, one that imports torch first (and
   calls the same function on torch tensors), and optionally (--preload-libgomp) one that imports
   torch with the system's libgomp preloaded. Each child verifies its result against the
   standard path before timing; the median over the children's medians is reported.
2. A tiny call, q, k, v of [1, 1, 1, 16] torch tensors: flash_attn_func against
   torch.nn.functional.scaled_dot_product_attention, alternated in one process, best of rounds.

    PYTHONPATH=build/release/python python3 bench/python/torch_process.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, statistics, sys, time
mode = sys.argv[1]
if mode != "numpy":
    import torch
    torch.ones(512, 512) @ torch.ones(512, 512)  # torch's own thread pool started, as in a model
import numpy as np
import flashattn
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 1024, 32, 128), dtype=np.float32) for _ in range(3))
if mode != "numpy":
    q, k, v = (torch.from_numpy(x) for x in (q, k, v))
out = flashattn.flash_attn_func(q, k, v, causal=True)
ref = flashattn.flash_attn_func(q, k, v, causal=True, impl="standard")
err = float(np.abs(np.asarray(out) - np.asarray(ref)).max())
assert err < 1e-4, f"flash and standard differ by {err}"
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    flashattn.flash_attn_func(q, k, v, causal=True)
    times.append(time.perf_counter() - start)
print(json.dumps({"median": statistics.median(times), "error": err}))
"""


def child(mode: str, calls: int, threads: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if mode == "torch+libgomp":
        env["LD_PRELOAD"] = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
    result = subprocess.run([sys.executable, "-c", CHILD, mode, str(calls)], env=env,
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"torch_process: the {mode} child failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])["median"]


def tiny_calls(threads: int, rounds: int, calls: int) -> tuple[float, float]:
    """Best-of-rounds microseconds per call: (flash_attn_func, torch SDPA)."""
    import torch
    import flashattn
    torch.set_num_threads(threads)
    q = torch.randn(1, 1, 1, 16)
    qt = q.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ours = flashattn.flash_attn_func(q, q, q)
    theirs = sdpa(qt, qt, qt).transpose(1, 2)
    assert torch.allclose(ours, theirs, atol=1e-6), "flashattn and torch differ on the tiny call"

    def per_call(fn) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    best_ours, best_theirs = float("inf"), float("inf")
    for _ in range(rounds):
        best_ours = min(best_ours, per_call(lambda: flashattn.flash_attn_func(q, q, q)))
        best_theirs = min(best_theirs, per_call(lambda: sdpa(qt, qt, qt)))
    return best_ours, best_theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="OpenMP and torch threads")
    parser.add_argument("--rounds", type=int, default=5,
                        help="child processes per mode, alternated (default 5)")
    parser.add_argument("--calls", type=int, default=9, help="timed calls per child (default 9)")
    parser.add_argument("--preload-libgomp", action="store_true",
                        help="also a torch child with the system's libgomp preloaded")
    args = parser.parse_args()
    modes = ["numpy", "torch"] + (["torch+libgomp"] if args.preload_libgomp else [])
    medians = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            print(f"\rtorch_process: round {round_ + 1}/{args.rounds}, {mode}      ", end="",
                  file=sys.stderr, flush=True)
            medians[mode].append(child(mode, args.calls, args.threads))
    print(file=sys.stderr)
    base = statistics.median(medians["numpy"])
    print(f"seed shape causal f32 forward from Python, {args.threads} threads, median of "
          f"{args.rounds} processes x {args.calls} calls:")
    for mode in modes:
        m = statistics.median(medians[mode])
        spread = f"{min(medians[mode]) * 1e3:.1f}-{max(medians[mode]) * 1e3:.1f}"
        print(f"  {mode:<14} {m * 1e3:7.2f} ms ({spread})  speed vs no torch: {base / m:.3f}x")
    ours, theirs = tiny_calls(args.threads, 7, 2000)
    print(f"tiny call [1, 1, 1, 16] torch tensors: flash_attn_func {ours:.1f} us, torch SDPA "
          f"{theirs:.1f} us, ratio {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
