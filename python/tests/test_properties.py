"""A property test of the Python entry point: random shapes, dtypes, frameworks, layouts
(contiguous, heads-first views, sliced, padded last dims) and options, each call checked against
the numpy fp64 oracle with the derived bound of conftest.py, and its inputs checked unchanged.
FLASHATTN_PROPERTY_CASES sets the number of cases (default 150); FLASHATTN_TEST_SEED the seed."""

import os

import numpy as np
import pytest

import flashattn
from conftest import assert_close, forward_bound, ml_dtypes, reference_attention, torch

CASES = int(os.environ.get("FLASHATTN_PROPERTY_CASES", "150"))


def laid_out(rng, array, layout):
    """The same values in another memory layout: a view the library reads with its strides."""
    if layout == "heads_first":  # stored [B, H, S, D], seen as [B, S, H, D]
        return np.ascontiguousarray(array.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "padded":  # each (s, h) row padded: strides larger than the dims
        padded = np.zeros(array.shape[:-1] + (array.shape[-1] + 5,), array.dtype)
        padded[..., :array.shape[-1]] = array
        return padded[..., :array.shape[-1]]
    if layout == "sliced":  # every other sequence position of a longer buffer
        doubled = np.repeat(array, 2, axis=1)
        return doubled[:, ::2]
    return array


def convert(array, framework, dtype):
    if dtype == "bfloat16":
        if framework == "torch":
            return torch.from_numpy(np.ascontiguousarray(array)).to(torch.bfloat16)
        return array.astype(ml_dtypes.bfloat16)
    typed = array.astype(dtype)
    return torch.from_numpy(typed) if framework == "torch" else typed


def snapshot(x):
    return x.clone() if torch is not None and isinstance(x, torch.Tensor) else x.copy()


def same(a, b):
    if torch is not None and isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("case", range(CASES))
def test_random_calls_match_the_oracle(case):
    rng = np.random.default_rng(int(os.environ.get("FLASHATTN_TEST_SEED", "0")) * 100003 + case)
    frameworks = ["numpy"] + (["torch"] if torch is not None else [])
    framework = frameworks[rng.integers(len(frameworks))]
    dtypes = ["float32", "float16"] + (["bfloat16"] if ml_dtypes is not None or
                                       framework == "torch" else [])
    dtype = dtypes[rng.integers(len(dtypes))]
    heads_kv = int(rng.integers(1, 4))
    heads_q = heads_kv * int(rng.choice([1, 2, 4]))
    batch = int(rng.integers(1, 3))
    seqlen_q, seqlen_kv = (int(rng.choice([1, 2, 7, 63, 64, 65, 129, 200])) for _ in range(2))
    dim = int(rng.choice([8, 32, 40, 59, 64, 128]))
    layouts = [str(rng.choice(["contiguous", "heads_first", "padded", "sliced"]))
               for _ in range(3)]
    values = [rng.standard_normal(shape).astype(np.float32) for shape in
              ((batch, seqlen_q, heads_q, dim), (batch, seqlen_kv, heads_kv, dim),
               (batch, seqlen_kv, heads_kv, dim))]
    # Layout first (in fp32 numpy), then dtype and framework: torch keeps the strides of a
    # numpy view; a bf16 torch tensor is made contiguous by the conversion.
    q, k, v = (convert(laid_out(rng, a, layout), framework, dtype)
               for a, layout in zip(values, layouts))
    causal = bool(rng.integers(2))
    window = (-1, -1)
    if rng.integers(3) == 0:
        window = (int(rng.integers(0, 70)), int(rng.integers(-1, 10)))
    softcap = float(rng.choice([0.0, 0.0, 5.0]))
    slopes = rng.uniform(0, 0.3, heads_q).astype(np.float32) if rng.integers(4) == 0 else None
    sinks = rng.standard_normal(heads_q).astype(np.float32) if rng.integers(4) == 0 else None
    impl = str(rng.choice(["flash", "flash", "standard", "reference"]))
    threads = int(rng.choice([0, 1, 3]))
    before = [snapshot(t) for t in (q, k, v)]
    out, lse = flashattn.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                         softcap=softcap, alibi_slopes=slopes, sinks=sinks,
                                         return_lse=True, num_threads=threads, impl=impl)
    config = (f"case {case}: {framework} {dtype} B{batch} Sq{seqlen_q} Skv{seqlen_kv} "
              f"Hq{heads_q} Hkv{heads_kv} D{dim} {layouts} causal={causal} window={window} "
              f"softcap={softcap} alibi={slopes is not None} sinks={sinks is not None} {impl} "
              f"threads={threads}")
    assert all(same(a, b) for a, b in zip(before, (q, k, v))), f"{config}: an input changed"
    ref, ref_lse = reference_attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                       alibi=slopes, sinks=sinks)
    # Softcap and ALiBi add a few roundings per score on top of the plain bound.
    bound = forward_bound(q, k, v, out_dtype=dtype, ref=ref) * (4 if softcap or
                                                               slopes is not None else 1)
    finite = np.isfinite(ref_lse)
    lse_bound = bound + 8 * 2.0 ** -24 * float(np.abs(ref_lse[finite]).max(initial=0.0))
    try:
        assert_close(out, ref, bound)
        assert_close(lse, ref_lse, lse_bound, "lse")
    except AssertionError as error:
        raise AssertionError(f"{config}: {error}") from None
