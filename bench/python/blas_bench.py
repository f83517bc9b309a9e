#!/usr/bin/env python3
"""The standard path on the OpenBLAS a package carries: does it run the right kernel by itself?

OpenBLAS picks its kernel when it is loaded, from the CPU it finds, unless OPENBLAS_CORETYPE
names one. An OpenBLAS older than the CPU falls back to a slow kernel; the wheel's
(scipy-openblas32) should pick as well as a person setting OPENBLAS_CORETYPE by hand would.
For each package (a folder to put on PYTHONPATH: an installed wheel, or a build tree's
python/) and each kernel setting (automatic: both OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset;
or OPENBLAS_CORETYPE=NAME), a child process that has imported torch (where users call the
package) checks the standard path against the flash path and an fp64 reference, then measures

  - the standard path's forward on the seed shape, f32 causal [2, 1024, 32, 128] (its two
    products are full: 4·B·H·S²·D FLOPs);
  - the sgemm ceiling on those products (`sgemm_pairs_gflops`, the pairs bench/ceilings.hpp
    times) and the f32 FMA peak, in the same process.

Children alternate over rounds; the table gives medians. The figure the issue asks for is the
standard path's share of the FMA peak under the automatic choice, over the best share a setting
by hand reaches (the FMA peak does not depend on the BLAS; the sgemm ceiling does).

    python3 bench/python/blas_bench.py --package wheel=/tmp/wheel-target \\
        --package system=build/ci/python [--cores SkylakeX,Haswell,Zen] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's own thread pool started, as in a model
import numpy as np
import flashattn
from flashattn import _flashattn

threads, repeats = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
rng = np.random.default_rng(0)

# Correct first: the standard path against an fp64 reference on a small causal case, and
# against the flash path on the seed shape.
q, k, v = (rng.standard_normal((1, 67, 3, 40), dtype=np.float32) for _ in range(3))
s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(40)
s[..., np.triu_indices(67, 1)[0], np.triu_indices(67, 1)[1]] = -np.inf
p = np.exp(s - s.max(-1, keepdims=True))
reference = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
small = float(np.abs(flashattn.flash_attn_func(q, k, v, causal=True, impl="standard")
                     - reference).max())
q, k, v = (rng.standard_normal((2, 1024, 32, 128), dtype=np.float32) for _ in range(3))
standard = flashattn.flash_attn_func(q, k, v, causal=True, impl="standard")
seed = float(np.abs(standard - flashattn.flash_attn_func(q, k, v, causal=True)).max())
if not (small < 1e-5 and seed < 1e-4):
    sys.exit(f"standard path wrong: {small:.3g} against fp64, {seed:.3g} against flash")

times = []
for _ in range(repeats):
    start = time.perf_counter()
    flashattn.flash_attn_func(q, k, v, causal=True, impl="standard")
    times.append(time.perf_counter() - start)
flops = 4.0 * 2 * 32 * 1024 * 1024 * 128
print(json.dumps({
    "blas": _flashattn.blas(),
    "standard_gflops": flops / sorted(times)[len(times) // 2] / 1e9,
    "sgemm_gflops": _flashattn.sgemm_pairs_gflops(threads, 1024, 128),
    "fma_gflops": _flashattn.fma_peak_gflops(threads),
}))
"""


def run_child(package: str, core: str, threads: int, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=package, OMP_NUM_THREADS=str(threads))
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    if core != "auto":
        env["OPENBLAS_CORETYPE"] = core
    done = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(repeats)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{package} with {core}: {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", action="append", required=True, metavar="NAME=DIR",
                        help="a package to measure: a name for the table and the folder that "
                             "holds flashattn/ (repeatable)")
    parser.add_argument("--cores", default="SkylakeX,Haswell,Zen",
                        help="OPENBLAS_CORETYPE values to try by hand besides the automatic "
                             "choice (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of alternated children (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per child, median taken (default: %(default)s)")
    args = parser.parse_args()

    packages = []
    for item in args.package:
        name, sep, folder = item.partition("=")
        if not sep or not os.path.isdir(os.path.join(folder, "flashattn")):
            parser.error(f"--package: expected NAME=DIR with DIR/flashattn, got {item!r}")
        packages.append((name, os.path.abspath(folder)))
    cores = ["auto"] + [c for c in args.cores.split(",") if c]

    results: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for name, folder in packages:
            for core in cores:
                result = run_child(folder, core, args.threads, args.repeats)
                results.setdefault((name, core), []).append(result)
                print(f"round {round_index + 1}/{args.rounds} {name} {core}: standard "
                      f"{result['standard_gflops']:.1f} GFLOP/s", file=sys.stderr)

    print(f"| package | OPENBLAS_CORETYPE | BLAS | standard GFLOP/s | sgemm ceiling | FMA peak "
          f"| standard / FMA | standard / sgemm |")
    print("|---|---|---|---|---|---|---|---|")
    share = {}
    for (name, core), runs in results.items():
        med = {key: statistics.median(r[key] for r in runs)
               for key in ("standard_gflops", "sgemm_gflops", "fma_gflops")}
        share[(name, core)] = med["standard_gflops"] / med["fma_gflops"]
        print(f"| {name} | {core if core != 'auto' else '(unset)'} | {runs[0]['blas']} "
              f"| {med['standard_gflops']:.1f} | {med['sgemm_gflops']:.1f} "
              f"| {med['fma_gflops']:.1f} | {share[(name, core)]:.3f} "
              f"| {med['standard_gflops'] / med['sgemm_gflops']:.3f} |")
    print()
    for name, _ in packages:
        best_core = max(cores[1:], key=lambda c: share[(name, c)]) if len(cores) > 1 else "auto"
        print(f"{name}: automatic kernel at {share[(name, 'auto')] / share[(name, best_core)]:.3f}x "
              f"the share of the FMA peak that OPENBLAS_CORETYPE={best_core} (the best by hand) "
              f"reaches")


if __name__ == "__main__":
    main()
