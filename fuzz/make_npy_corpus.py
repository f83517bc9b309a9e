#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_npy into fuzz/corpus/npy/ with NumPy: valid files of both
accepted dtypes (float32, float16) in format versions 1.0, 2.0 and 3.0 and several ranks, plus
a few that the reader must reject (big-endian, Fortran order, int32), so that the fuzzer starts
from every branch of the header parser."""

import pathlib

import numpy as np
from numpy.lib import format as npy_format

corpus = pathlib.Path(__file__).resolve().parent / "corpus" / "npy"
corpus.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)


def save(name, array, version=(1, 0)):
    with open(corpus / name, "wb") as file:
        npy_format.write_array(file, array, version=version, allow_pickle=False)


for dtype in ("<f4", "<f2"):
    tag = "f4" if dtype == "<f4" else "f2"
    save(f"{tag}_scalar.npy", np.array(1.5, dtype=dtype))
    save(f"{tag}_empty.npy", np.zeros((0,), dtype=dtype))
    save(f"{tag}_vector.npy", rng.standard_normal(7).astype(dtype))
    save(f"{tag}_bshd.npy", rng.standard_normal((1, 3, 2, 4)).astype(dtype))
    save(f"{tag}_specials.npy", np.array([np.nan, np.inf, -np.inf, -0.0, 6e-8], dtype=dtype))
    save(f"{tag}_v2.npy", rng.standard_normal((2, 3)).astype(dtype), version=(2, 0))
    save(f"{tag}_v3.npy", rng.standard_normal((3, 1, 2)).astype(dtype), version=(3, 0))
save("rejected_big_endian.npy", np.arange(4, dtype=">f4"))
save("rejected_fortran.npy", np.asfortranarray(np.ones((2, 3), dtype="<f4")))
save("rejected_int32.npy", np.arange(6, dtype="<i4").reshape(2, 3))
