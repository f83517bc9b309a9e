#!/usr/bin/env python3
"""What attention dropout costs (FlashAttention's API issue): the seed shape's forward and
backward with dropout_p against the same calls without it, inside a process that has torch
loaded, where users call it.

Before timing, each dropout call is checked against the standard path with the same seed (the
same mask; the test-suite checks both against the fp64 reference): forward within twice the
first-order fp32 bound of conftest.py with max|v| scaled by 1 / (1 - p), gradients within 5x
that bound's relative size times their scale (bench/backward_check.hpp's rule). Then the two
calls alternate, `--rounds` pairs, and the median of the per-pair ratios is reported, so the
shared machine's load cancels.

    PYTHONPATH=build/release/python python3 bench/python/dropout_cost.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import flashattn

U32 = 2.0 ** -24


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_order_bound(q, k, v, p) -> float:
    q, k, v = q.detach(), k.detach(), v.detach()
    dim, keys = q.shape[-1], k.shape[1]
    gain = 1.0 / (1.0 - p)
    return U32 * float(v.abs().max()) * gain * (
        4 / math.sqrt(dim) * dim * float(q.abs().max()) * float(k.abs().max()) + 2 * keys + 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dropout", type=float, default=0.17, help="FlashAttention's tests' p")
    parser.add_argument("--shape", default="2,1024,32,128", help="B,S,H,D (the seed shape)")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, seqlen, heads, dim = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, heads, dim, requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, seqlen, heads, dim)
    p = args.dropout

    def forward(dropout_p, impl="flash"):
        return flashattn.flash_attn_func(q, k, v, dropout_p, causal=args.causal,
                                         dropout_seed=1234, impl=impl)

    def gradients(dropout_p, impl="flash"):
        return torch.autograd.grad(forward(dropout_p, impl), (q, k, v), dout)

    with torch.no_grad():
        out, reference = forward(p), forward(p, "standard")
    bound = first_order_bound(q, k, v, p)
    forward_error = float((out - reference).abs().max())
    assert forward_error <= 2 * bound, f"forward: {forward_error:.3g} > {2 * bound:.3g}"
    max_v = float(v.detach().abs().max()) / (1 - p)
    relative = bound / max_v
    gradient_errors = {}
    for name, got, want in zip(("dq", "dk", "dv"), gradients(p), gradients(p, "standard")):
        scale = float(want.abs().max()) + float(dout.abs().max()) * max_v
        error = float((got - want).abs().max())
        assert error <= 5 * relative * scale, f"{name}: {error:.3g} > {5 * relative * scale:.3g}"
        gradient_errors[name] = error

    ratios = {"forward": [], "backward": []}
    times = {"forward": [], "forward_dropout": [], "backward": [], "backward_dropout": []}
    with torch.no_grad():
        forward(0.0), forward(p)
    for _ in range(args.rounds):
        with torch.no_grad():
            plain = seconds(lambda: forward(0.0))
            dropped = seconds(lambda: forward(p))
        ratios["forward"].append(dropped / plain)
        times["forward"].append(plain)
        times["forward_dropout"].append(dropped)
        out_plain, out_dropped = forward(0.0), forward(p)
        plain = seconds(lambda: torch.autograd.grad(out_plain, (q, k, v), dout))
        dropped = seconds(lambda: torch.autograd.grad(out_dropped, (q, k, v), dout))
        ratios["backward"].append(dropped / plain)
        times["backward"].append(plain)
        times["backward_dropout"].append(dropped)
    print(json.dumps({
        "shape": [batch, seqlen, heads, dim], "causal": args.causal, "dropout_p": p,
        "threads": args.threads, "rounds": args.rounds,
        "forward_error_vs_standard": forward_error, "gradient_errors_vs_standard": gradient_errors,
        "median_seconds": {name: statistics.median(t) for name, t in times.items()},
        "dropout_over_plain": {name: statistics.median(r) for name, r in ratios.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
