#!/usr/bin/env python3
"""Prefill beside what users would pick instead, in one torch process, on the same inputs.

The seed shape [B=2, H=32, S=1024, D=128] (or --shape), f32 and bf16, non-causal and causal, and
--heads-kv below H for GQA. Each implementation gets the same q, k, v and the same threads:

  flashattn    flashattn.flash_attn_func on torch [B, S, H, D] tensors (the Python package)
  torch        torch.nn.functional.scaled_dot_product_attention on [B, H, S, D] (enable_gqa)
  flex         torch.compile(flex_attention) on [B, H, S, D], the causal mask as a block mask
               (enable_gqa); --no-flex leaves it out (its compilation takes a minute a case)
  openvino     OpenVINO's ScaledDotProductAttention op (opset13) alone in a model compiled for
               the CPU with INFERENCE_NUM_THREADS and INFERENCE_PRECISION_HINT = the case's dtype
               (f32 inputs, computed in bf16 where the hint says so); GQA by repeating K and V in
               the model (Broadcast over a group dim)
  onnxruntime  ONNX Runtime's MultiHeadAttention (com.microsoft; unidirectional for causal) on
               [B, S, H·D] f32; it takes neither bf16 on the CPU nor GQA (its GQA operator,
               GroupQueryAttention, is bench/peers.py's decode peer): reported so

Every output is first checked against an fp64 NumPy reference on four (batch, head) pairs:
max |out - reference| <= u · max|v| · (4 · scale · D · max|q| · max|k| + 2 · S + 16) + 2 · u ·
max|reference| with u the unit roundoff of the precision the implementation computes in (2^-24
for f32, 2^-8 for bf16: the first-order bound of tests/test_attention_vs_reference.cpp); one that
fails is marked FAILED and not timed. Then the implementations are timed alternately, round by
round (--repeats rounds after a warm-up), and the medians kept; GFLOP/s count the visible
(query, key) pairs, 4 · B · H · D per pair, read against the f32 FMA peak or the bf16 dot peak
measured in the same run on the same threads.

    PYTHONPATH=build/release/python python3 bench/python/prefill_peers.py [--threads 2]
        [--repeats 5] [--shape 2,32,1024,128] [--heads-kv 32] [--no-flex] [--quick]

Needs torch and the flashattn package; openvino, onnxruntime and onnx are optional (pip install
openvino onnxruntime onnx); a missing one is reported, not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


import omp_threads  # noqa: E402  (beside this script)

omp_threads.set_from_argv()

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashattn  # noqa: E402
from flashattn import _flashattn  # noqa: E402

UNIT = {"f32": 2.0 ** -24, "bf16": 2.0 ** -8}
TORCH_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16}
CHECKED_PAIRS = 4


def reference_heads(q, k, v, causal, pairs):
    """fp64 attention of the (b, h) pairs: {(b, h): out [S, D]} from q [B, S, H, D] and k, v
    [B, S, Hkv, D] (numpy f64)."""
    group = q.shape[2] // k.shape[2]
    scale = q.shape[3] ** -0.5
    out = {}
    for b, h in pairs:
        s = q[b, :, h] @ k[b, :, h // group].T * scale
        if causal:
            s[np.triu_indices(s.shape[0], 1)] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[(b, h)] = (p / p.sum(axis=1, keepdims=True)) @ v[b, :, h // group]
    return out


def bound(q, k, v, reference, unit):
    dim, seqlen = q.shape[3], k.shape[1]
    mq, mk, mv = (float(np.abs(x).max()) for x in (q, k, v))
    mr = max(float(np.abs(r).max()) for r in reference.values())
    return unit * mv * (4 * dim ** -0.5 * dim * mq * mk + 2 * seqlen + 16) + 2 * unit * mr


class Implementation:
    """One peer: prepare(case) returns a zero-argument call whose result is out [B, S, H, D]
    as a numpy array, or raises NotAvailable with the reason."""

    name = ""

    def version(self) -> str:
        return ""


class NotAvailable(Exception):
    pass


class Flashattn(Implementation):
    name = "flashattn"

    def version(self):
        return f"flashattn {flashattn.__version__}"

    def prepare(self, case):
        q, k, v = case["bshd"]

        def call():
            return flashattn.flash_attn_func(q, k, v, causal=case["causal"])
        return call, lambda out: out.float().numpy()


class TorchSdpa(Implementation):
    name = "torch"

    def version(self):
        return f"torch {torch.__version__}"

    def prepare(self, case):
        q, k, v = case["bhsd"]
        gqa = q.shape[1] != k.shape[1]

        def call():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=case["causal"], enable_gqa=gqa)
        return call, lambda out: out.transpose(1, 2).float().numpy()


class Flex(Implementation):
    name = "flex"

    def __init__(self):
        from torch.nn.attention import flex_attention as fa  # pylint: disable=import-outside-toplevel
        self.fa = fa
        self.compiled = torch.compile(fa.flex_attention)

    def version(self):
        return f"torch {torch.__version__} compiled flex_attention"

    def prepare(self, case):
        q, k, v = case["bhsd"]
        seqlen = q.shape[2]
        block_mask = None
        if case["causal"]:
            block_mask = self.fa.create_block_mask(lambda b, h, i, j: i >= j, None, None, seqlen,
                                                   seqlen, device="cpu")
        gqa = q.shape[1] != k.shape[1]

        def call():
            return self.compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        return call, lambda out: out.transpose(1, 2).float().numpy()


class OpenVino(Implementation):
    name = "openvino"

    def __init__(self, threads):
        import openvino as ov  # pylint: disable=import-outside-toplevel
        self.ov, self.threads, self.core = ov, threads, ov.Core()

    def version(self):
        return f"openvino {self.ov.__version__.split('-')[0]}"

    def prepare(self, case):
        from openvino import opset13 as ops  # pylint: disable=import-outside-toplevel
        q, k, v = (np.ascontiguousarray(x.float().numpy()) for x in case["bhsd"])
        batch, heads, seqlen, dim = q.shape
        heads_kv = k.shape[1]
        params = [ops.parameter(list(x.shape), self.ov.Type.f32, name=name)
                  for name, x in (("q", q), ("k", k), ("v", v))]
        keys, values = params[1], params[2]
        if heads_kv != heads:
            # [B, Hkv, S, D] -> [B, Hkv, G, S, D] -> [B, H, S, D]: each KV head for its group.
            group = heads // heads_kv
            target = ops.constant(np.array([batch, heads_kv, group, seqlen, dim], np.int64))
            merged = ops.constant(np.array([batch, heads, seqlen, dim], np.int64))
            axis = ops.constant(np.array([2], np.int64))
            keys, values = (ops.reshape(ops.broadcast(ops.unsqueeze(x, axis), target), merged,
                                        False) for x in (keys, values))
        sdpa = ops.scaled_dot_product_attention(params[0], keys, values, causal=case["causal"])
        model = self.ov.Model([sdpa], params, "sdpa")
        compiled = self.core.compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": self.threads,
            "INFERENCE_PRECISION_HINT": "bf16" if case["dtype"] == "bf16" else "f32"})
        request = compiled.create_infer_request()
        feeds = {"q": q, "k": k, "v": v}

        def call():
            return request.infer(feeds)[0]
        return call, lambda out: np.asarray(out).transpose(0, 2, 1, 3)


class OnnxRuntime(Implementation):
    name = "onnxruntime"

    def __init__(self, threads):
        import onnxruntime as ort  # pylint: disable=import-outside-toplevel
        self.ort, self.threads = ort, threads

    def version(self):
        return f"onnxruntime {self.ort.__version__}"

    def prepare(self, case):
        from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel
        if case["dtype"] != "f32":
            raise NotAvailable("its CPU MultiHeadAttention takes f32 only")
        q, k, v = case["bshd"]
        batch, seqlen, heads, dim = q.shape
        if k.shape[2] != heads:
            raise NotAvailable("its MultiHeadAttention has no GQA")
        node = helper.make_node("MultiHeadAttention", ["query", "key", "value"], ["output"],
                                domain="com.microsoft", num_heads=heads,
                                unidirectional=int(case["causal"]))
        shape = [batch, seqlen, heads * dim]
        graph = helper.make_graph(
            [node], "prefill",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
             for n in ("query", "key", "value")],
            [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = self.ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        session = self.ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
        feeds = {"query": q.numpy().reshape(shape), "key": k.numpy().reshape(shape),
                 "value": v.numpy().reshape(shape)}

        def call():
            return session.run(["output"], feeds)[0]
        return call, lambda out: out.reshape(batch, seqlen, heads, dim)


def make_case(shape, heads_kv, dtype, causal):
    batch, heads, seqlen, dim = shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen, heads, dim, generator=generator).to(TORCH_DTYPE[dtype])
    k, v = (torch.randn(batch, seqlen, heads_kv, dim, generator=generator).to(TORCH_DTYPE[dtype])
            for _ in range(2))
    case = {"dtype": dtype, "causal": causal, "bshd": (q, k, v),
            "bhsd": tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))}
    pairs = [(0, 0), (batch - 1, heads - 1), (0, heads // 2), (batch - 1, heads // 3)]
    as_f64 = [x.double().numpy() for x in (q, k, v)]
    case["pairs"] = pairs[:CHECKED_PAIRS]
    case["reference"] = reference_heads(*as_f64, causal, case["pairs"])
    case["bound_args"] = as_f64
    return case


def check(case, out):
    """max |out - reference| over the checked (batch, head) pairs, and its bound."""
    limit = bound(*case["bound_args"], case["reference"], UNIT[case["dtype"]])
    err = max(float(np.abs(out[b, :, h].astype(np.float64) - ref).max())
              for (b, h), ref in case["reference"].items())
    return err, limit


def flops(shape, causal):
    batch, heads, seqlen, dim = shape
    pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    return 4.0 * batch * heads * dim * pairs


def run(args):
    shape = tuple(args.shape)
    heads_kv = args.heads_kv or shape[1]
    impls = [Flashattn(), TorchSdpa()]
    missing = {}
    if not args.no_flex:
        try:
            impls.append(Flex())
        except ImportError as error:
            missing["flex"] = str(error)
    for name, make in (("openvino", lambda: OpenVino(args.threads)),
                       ("onnxruntime", lambda: OnnxRuntime(args.threads))):
        try:
            impls.append(make())
        except ImportError as error:
            missing[name] = f"not installed ({error})"
    peaks = {"f32": _flashattn.fma_peak_gflops(args.threads),
             "bf16": _flashattn.bf16_dot_peak_gflops(args.threads)}
    rows = []
    for dtype in ("f32", "bf16"):
        for causal in (False, True):
            label = f"{dtype} {'causal' if causal else 'non-causal'}"
            print(f"prefill_peers: {label}", file=sys.stderr, flush=True)
            case = make_case(shape, heads_kv, dtype, causal)
            calls, notes = [], {}
            for impl in impls:
                try:
                    call, to_numpy = impl.prepare(case)
                    err, limit = check(case, to_numpy(call()))
                except NotAvailable as reason:
                    notes[impl.name] = str(reason)
                    continue
                if not err <= limit:
                    notes[impl.name] = f"FAILED its check: {err:.3g} > {limit:.3g}"
                    continue
                notes[impl.name] = f"{err:.2g} ({limit:.2g})"
                calls.append((impl.name, call))
            times = {name: [] for name, _ in calls}
            for _ in range(args.repeats):
                for name, call in calls:
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(t) for name, t in times.items()}
            rows.append((label, dtype, causal, medians, notes))
    return impls, missing, peaks, rows


def report(args, impls, missing, peaks, rows):
    shape = tuple(args.shape)
    heads_kv = args.heads_kv or shape[1]
    names = [impl.name for impl in impls]
    print(f"Shape [B={shape[0]}, H={shape[1]}, Hkv={heads_kv}, S={shape[2]}, D={shape[3]}], "
          f"{args.threads} threads; f32 FMA peak {peaks['f32']:.0f} GFLOP/s, bf16 dot peak "
          f"{peaks['bf16'] or 0:.0f} (this run); "
          + "; ".join(impl.version() for impl in impls)
          + "".join(f"; {name}: {why}" for name, why in missing.items()))
    print()
    print("| case | " + " | ".join(f"{n} ms" for n in names)
          + " | flashattn GFLOP/s | / peak | over the best peer |")
    print("|---|" + "--:|" * len(names) + "--:|--:|--:|")
    for label, dtype, causal, medians, notes in rows:
        cells = [f"{medians[n] * 1e3:.1f}" if n in medians else notes.get(n, "–") for n in names]
        ours = medians.get("flashattn")
        peers = [t for n, t in medians.items() if n != "flashattn"]
        gflops = flops(shape, causal) / ours / 1e9 if ours else float("nan")
        peak = peaks[dtype] or peaks["f32"]
        best = f"{min(peers) / ours:.2f}x" if ours and peers else "–"
        print(f"| {label} | " + " | ".join(cells)
              + f" | {gflops:.1f} | {gflops / peak:.2f} | {best} |")
    print()
    print("Checked against fp64 on "
          f"{CHECKED_PAIRS} (batch, head) pairs, max error (bound): "
          + "; ".join(f"{label}: " + ", ".join(f"{n} {notes.get(n, '–')}" for n in names)
                      for label, _, _, _, notes in rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="threads of every peer (default 2)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="alternated timed rounds (default %(default)s)")
    parser.add_argument("--shape", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 32, 1024, 128], help="B,H,S,D (default the seed shape)")
    parser.add_argument("--heads-kv", type=int, default=0, help="KV heads (default H: no GQA)")
    parser.add_argument("--no-flex", action="store_true", help="leave compiled FlexAttention out")
    parser.add_argument("--quick", action="store_true", help="a small shape, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.shape = [1, 4, 128, 64]
    if len(args.shape) != 4 or min(args.shape) < 1:
        parser.error(f"--shape: expected four positive integers B,H,S,D, got {args.shape}")
    if args.heads_kv and (args.heads_kv < 1 or args.shape[1] % args.heads_kv):
        parser.error(f"--heads-kv: expected a divisor of H = {args.shape[1]}, got {args.heads_kv}")
    torch.set_num_threads(args.threads)
    report(args, *run(args))


if __name__ == "__main__":
    main()
