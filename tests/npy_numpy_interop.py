"""NumPy interoperability of `flashattn run`.

NumPy writes q, k, v (float32 and float16, format versions 1.0 to 3.0); the tool computes
attention; NumPy loads out and lse (np.load must accept our files as they are) and compares them
with a float64 NumPy attention on the same values. NumPy-written files that the tool must refuse
(float64, int32, big-endian, Fortran order) must fail cleanly and leave no output behind.

Usage: npy_numpy_interop.py PATH/TO/flashattn
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)
EPS16 = float(np.finfo(np.float16).eps)


def attention(q, k, v, causal=False, window=(-1, -1), scale=None):
    """float64 attention with the library's mask convention (docs/design.md, "The contract")."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    _, seqlen_q, heads_q, head_dim = q.shape
    seqlen_kv, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    group = heads_q // heads_kv
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    row = np.arange(seqlen_q)[:, None]
    key = np.arange(seqlen_kv)[None, :]
    diagonal = row + seqlen_kv - seqlen_q  # bottom-right aligned
    visible = np.ones((seqlen_q, seqlen_kv), dtype=bool)
    if causal:
        visible &= key <= diagonal
    if window[0] >= 0:
        visible &= key >= diagonal - window[0]
    if window[1] >= 0:
        visible &= key <= diagonal + window[1]
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + row_max[..., 0], -np.inf)
    return out, lse


class Interop:
    def __init__(self, cli, directory):
        self.cli = cli
        self.dir = directory
        self.failures = []

    def path(self, name):
        return os.path.join(self.dir, name)

    def check(self, condition, message):
        if not condition:
            self.failures.append(message)

    def run(self, *args):
        return subprocess.run([self.cli, "run", *args], capture_output=True, text=True, timeout=120)

    def save_inputs(self, q, k, v, version=None):
        for name, array in (("q", q), ("k", k), ("v", v)):
            with open(self.path(name + ".npy"), "wb") as file:
                np.lib.format.write_array(file, array, version=version, allow_pickle=False)

    def clean(self):
        for name in os.listdir(self.dir):
            os.remove(self.path(name))

    def expect_match(self, label, q, k, v, causal=False, window=(-1, -1), scale=None, version=None):
        """Runs the tool on NumPy-written inputs and compares with attention() in float64."""
        self.clean()
        self.save_inputs(q, k, v, version)
        args = ["--q", self.path("q.npy"), "--k", self.path("k.npy"), "--v", self.path("v.npy"),
                "--out", self.path("out.npy"), "--lse", self.path("lse.npy"), "--repeat", "1",
                "--window", f"{window[0]},{window[1]}"]
        if causal:
            args.append("--causal")
        if scale is not None:
            args += ["--scale", repr(scale)]
        completed = self.run(*args)
        if completed.returncode != 0:
            self.failures.append(f"{label}: exit {completed.returncode}: {completed.stderr}")
            return
        lines = completed.stdout.splitlines()
        self.check(len(lines) == 1, f"{label}: expected one stdout line, got {completed.stdout!r}")
        report = json.loads(lines[0])
        self.check(report["dtype"] == ("f16" if q.dtype == np.float16 else "f32"),
                   f"{label}: dtype {report['dtype']}")
        self.check(report["causal"] == causal and report["window"] == list(window),
                   f"{label}: mask fields {report}")

        out = np.load(self.path("out.npy"), allow_pickle=False)
        lse = np.load(self.path("lse.npy"), allow_pickle=False)
        self.check(out.dtype == np.float32 and out.shape == q.shape,
                   f"{label}: out {out.dtype} {out.shape}")
        batch, seqlen_q, heads_q, _ = q.shape
        self.check(lse.dtype == np.float32 and lse.shape == (batch, heads_q, seqlen_q),
                   f"{label}: lse {lse.dtype} {lse.shape}")
        with open(self.path("out.npy"), "rb") as file:
            self.check(np.lib.format.read_magic(file) == (1, 0), f"{label}: not format 1.0")
            np.lib.format.read_array_header_1_0(file)
            self.check(file.tell() % 64 == 0, f"{label}: data offset {file.tell()} not 64-aligned")

        expected_out, expected_lse = attention(q, k, v, causal, window, scale)
        max_v = float(np.abs(v.astype(np.float64)).max())
        # fp32 scores err by a few ulps of their magnitude (|scale * q.k| is a few units here);
        # the exponent turns that into the same relative error of the weights, and the output is
        # a convex combination of v rows: 16 fp32 ulps of max|v| bound it with a margin.
        out_tolerance = 16 * EPS32 * max_v
        if q.dtype == np.float16:
            # On top of that, rounding the output to f16 (half an ulp of |out| <= max|v|) and the
            # weights to f16 as the P·V operand (half an ulp of each) add up to eps16·max|v|.
            out_tolerance += EPS16 * max_v
        # lse is fp32 arithmetic on exactly representable inputs in both cases.
        masked = ~np.isfinite(expected_lse)
        largest_lse = float(np.abs(expected_lse[~masked]).max(initial=0))
        lse_tolerance = 16 * EPS32 * max(1.0, largest_lse)
        out_error = float(np.abs(out - expected_out).max(initial=0))
        self.check(out_error <= out_tolerance,
                   f"{label}: out error {out_error:.3g} > {out_tolerance:.3g}")
        self.check(np.array_equal(np.isneginf(lse), masked), f"{label}: -inf lse rows differ")
        lse_error = float(np.abs(lse[~masked] - expected_lse[~masked]).max(initial=0))
        self.check(lse_error <= lse_tolerance,
                   f"{label}: lse error {lse_error:.3g} > {lse_tolerance:.3g}")
        masked_rows = masked.transpose(0, 2, 1)  # [batch, seqlen_q, heads_q], as out
        self.check(np.all(out[masked_rows] == 0), f"{label}: fully masked rows are not zero")

    def expect_refusal(self, label, q, message):
        """q as NumPy writes it must be refused with `message`, leaving no output file."""
        self.clean()
        rng = np.random.default_rng(0)
        kv = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
        self.save_inputs(q, kv, kv)
        completed = self.run("--q", self.path("q.npy"), "--k", self.path("k.npy"), "--v",
                             self.path("v.npy"), "--out", self.path("out.npy"))
        self.check(completed.returncode != 0, f"{label}: exit 0")
        self.check(completed.stdout == "", f"{label}: stdout {completed.stdout!r}")
        stderr = completed.stderr
        self.check(stderr.startswith("flashattn: error: ") and message in stderr
                   and stderr.count("\n") == 1, f"{label}: stderr {stderr!r}")
        self.check(sorted(os.listdir(self.dir)) == ["k.npy", "q.npy", "v.npy"],
                   f"{label}: left {sorted(os.listdir(self.dir))}")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rng = np.random.default_rng(2024)

    def normal(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    with tempfile.TemporaryDirectory(prefix="flashattn_interop_") as directory:
        test = Interop(sys.argv[1], directory)
        q, k, v = normal(2, 37, 4, 24), normal(2, 53, 2, 24), normal(2, 53, 2, 24)
        test.expect_match("f32 GQA", q, k, v)
        test.expect_match("f32 causal window scale", q, k, v, causal=True, window=(8, 0), scale=0.3)
        test.expect_match("f32 format 2.0", q, k, v, causal=True, version=(2, 0))
        test.expect_match("f32 format 3.0", q, k, v, version=(3, 0))
        # seqlen_q > seqlen_kv under the causal mask: the first rows see no key at all.
        test.expect_match("f32 fully masked rows", normal(1, 12, 2, 16), normal(1, 5, 2, 16),
                          normal(1, 5, 2, 16), causal=True)
        q16 = normal(2, 29, 2, 40, dtype=np.float16)
        k16, v16 = normal(2, 31, 1, 40, dtype=np.float16), normal(2, 31, 1, 40, dtype=np.float16)
        test.expect_match("f16 MQA", q16, k16, v16)
        test.expect_match("f16 causal", q16, k16, v16, causal=True)

        q_bad = normal(1, 6, 4, 8)
        test.expect_refusal("float64", q_bad.astype(np.float64), "(float64)")
        test.expect_refusal("int32", q_bad.astype(np.int32), "(int32)")
        test.expect_refusal("big-endian", q_bad.astype(">f4"), "big-endian")
        test.expect_refusal("Fortran order", np.asfortranarray(q_bad), "fortran_order True")

    for failure in test.failures:
        print("FAIL:", failure)
    if test.failures:
        sys.exit(1)
    print("npy_numpy_interop: all checks passed")


if __name__ == "__main__":
    main()
