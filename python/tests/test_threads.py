"""Threads in a PyTorch process (docs/python.md, "Threads"): flashattn and torch run on one OpenMP
runtime, whichever of the two is imported first, so torch.set_num_threads sets the team of
flashattn's calls too and the two never keep two pools of spinning threads on the same cores.

Each case runs in a fresh interpreter, as the import order is what is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import requires_torch

pytestmark = requires_torch

CHECK = r"""
import ctypes, sys
first, second = sys.argv[1:3]
__import__(first)
__import__(second)
import numpy as np
import torch
import flashattn
runtimes = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
assert len(runtimes) == 1, f"expected one OpenMP runtime, got {runtimes}"
omp = ctypes.CDLL(runtimes[0])
for threads in (1, 2, 3):
    torch.set_num_threads(threads)
    assert omp.omp_get_max_threads() == threads, (threads, omp.omp_get_max_threads())
    # The call runs (on that team) and gives the result of any other team size.
    q = torch.randn(2, 37, 4, 32, generator=torch.Generator().manual_seed(0))
    out = flashattn.flash_attn_func(q, q, q, causal=True)
    if threads == 1:
        expected = out
    assert torch.equal(out, expected)
print("ok", runtimes[0])
"""


@pytest.mark.parametrize("order", [("torch", "flashattn"), ("flashattn", "torch")])
def test_one_openmp_runtime_and_torch_set_num_threads_sets_our_team(order):
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run([sys.executable, "-c", CHECK, *order], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
