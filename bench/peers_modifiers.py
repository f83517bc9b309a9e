#!/usr/bin/env python3
"""An additive bias and a boolean mask, side by side with what users would pick instead.

Prefill without the causal mask (B = 2, H = 32, S = 1024, D = 128, f32 by default: the seed
shape), on the same inputs and the same number of threads, in three cases:

  bias       a [S, S] f32 bias, normal(0, 1), shared by every batch entry and head
  dense      a [S, S] boolean mask that keeps every key
  documents  a [S, S] boolean mask of four equal documents (block-diagonal: a quarter of the
             64 x 64 blocks kept), as packed pretraining batches use

and three implementations:

  flashattn    `flashattn run --bias / --mask` (the FlashAttention path; its JSON line gives the
               median seconds of --repeat calls after a warm-up)
  torch        PyTorch's CPU scaled_dot_product_attention with attn_mask (a float bias or a bool
               mask, [1, 1, S, S]), on contiguous [B, H, S, D] tensors (its own layout)
  onnxruntime  ONNX Runtime's MultiHeadAttention (com.microsoft) with attention_bias
               [1, 1, S, S]; a mask goes in as 0 / -1e9 (it has no boolean mask of that shape)

Each output is first checked against a NumPy fp64 reference (max |out - reference| within
2^-24 · max|v| · (4 · scale · D · max|q| · max|k| + 4 · max|bias| + 2 · S + 16), the first-order
bound of tests/test_score_modifiers.cpp); a peer that is not installed or fails the check is
reported and not timed. Timed as the median of --repeat calls after a warm-up, reported as
GFLOP/s of the unmasked problem (4 · B · H · S² · D) and as speed over flashattn's.
Writes <out-dir>/<date>-<host>-peers-modifiers.csv.

  python3 bench/peers_modifiers.py --flashattn build/release/tools/flashattn [--batch 2]
                                   [--heads 32] [--seqlen 1024] [--head-dim 128] [--threads 2]
                                   [--repeat 5] [--out-dir bench/results]

Needs numpy; torch, onnxruntime and onnx are optional (pip install torch onnxruntime onnx).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

from peers import median_seconds, write_csv  # bench/peers.py, beside this script

DOCUMENTS = 4


def reference(q, k, v, bias):
    """fp64 attention of q, k, v [B, S, H, D] with an additive [S, S] bias (-inf = masked)."""
    batch, seqlen, heads, head_dim = q.shape
    out = np.empty((batch, seqlen, heads, head_dim))
    bias64 = bias.astype(np.float64)
    for b in range(batch):
        for h in range(heads):
            q64 = q[b, :, h, :].astype(np.float64)
            k64 = k[b, :, h, :].astype(np.float64)
            v64 = v[b, :, h, :].astype(np.float64)
            logits = q64 @ k64.T / math.sqrt(head_dim) + bias64
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[b, :, h, :] = weights @ v64 / weights.sum(axis=1, keepdims=True)
    return out


def tolerance(q, k, v, bias):
    head_dim, seqlen = q.shape[3], k.shape[1]
    finite = bias[np.isfinite(bias)]
    max_bias = float(np.abs(finite).max()) if finite.size else 0.0
    return 2.0**-24 * float(np.abs(v).max()) * (
        4.0 / math.sqrt(head_dim) * head_dim * float(np.abs(q).max()) * float(np.abs(k).max())
        + 4.0 * max_bias + 2.0 * seqlen + 16.0)


def run_flashattn(binary, q, k, v, case, threads, repeat, work):
    paths = {name: os.path.join(work, name + ".npy")
             for name in ("q", "k", "v", "out", "bias", "mask")}
    for name, array in (("q", q), ("k", k), ("v", v)):
        np.save(paths[name], array)
    command = [binary, "run", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--out",
               paths["out"], "--threads", str(threads), "--repeat", str(repeat)]
    if case["bias"] is not None:
        np.save(paths["bias"], case["bias"])
        command += ["--bias", paths["bias"]]
    else:
        np.save(paths["mask"], case["mask"])
        command += ["--mask", paths["mask"]]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr.strip())
    return np.load(paths["out"]), json.loads(completed.stdout)["seconds"], "flashattn"


def run_torch(q, k, v, case, threads, repeat):
    import torch  # pylint: disable=import-outside-toplevel
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
    mask = case["bias"] if case["bias"] is not None else case["mask"]
    attn_mask = torch.from_numpy(np.ascontiguousarray(mask))[None, None]
    with torch.inference_mode():
        def call():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask)
        out = call().transpose(1, 2).numpy()
        return out, median_seconds(call, repeat), f"torch {torch.__version__}"


def run_onnxruntime(q, k, v, case, threads, repeat):
    import onnx  # pylint: disable=import-outside-toplevel
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    batch, seqlen, heads, head_dim = q.shape
    f32 = TensorProto.FLOAT
    node = helper.make_node(
        "MultiHeadAttention", ["query", "key", "value", "", "", "attention_bias"], ["output"],
        domain="com.microsoft", num_heads=heads)
    hidden = heads * head_dim
    graph = helper.make_graph(
        [node], "prefill",
        [helper.make_tensor_value_info(name, f32, [batch, seqlen, hidden])
         for name in ("query", "key", "value")]
        + [helper.make_tensor_value_info("attention_bias", f32, [1, 1, seqlen, seqlen])],
        [helper.make_tensor_value_info("output", f32, [batch, seqlen, hidden])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    bias = case["bias"] if case["bias"] is not None else np.where(case["mask"], 0.0, -1e9)
    feeds = {"query": q.reshape(batch, seqlen, -1), "key": k.reshape(batch, seqlen, -1),
             "value": v.reshape(batch, seqlen, -1),
             "attention_bias": bias.astype(np.float32)[None, None]}

    def call():
        return session.run(["output"], feeds)[0]

    out = call().reshape(batch, seqlen, heads, head_dim)
    return (out, median_seconds(call, repeat),
            f"onnxruntime {ort.__version__} (onnx {onnx.__version__})")


def cases(seqlen, rng):
    bias = rng.standard_normal((seqlen, seqlen), dtype=np.float32)
    dense = np.ones((seqlen, seqlen), dtype=bool)
    document = np.arange(seqlen) * DOCUMENTS // seqlen
    documents = document[:, None] == document[None, :]
    return [
        {"name": "bias", "bias": bias, "mask": None, "additive": bias},
        {"name": "dense", "bias": None, "mask": dense,
         "additive": np.zeros((seqlen, seqlen), dtype=np.float32)},
        {"name": "documents", "bias": None, "mask": documents,
         "additive": np.where(documents, 0.0, -np.inf).astype(np.float32)},
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--flashattn", default="build/release/tools/flashattn",
                        help="the flashattn binary")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads, each peer")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per peer (median)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    for name in ("batch", "heads", "seqlen", "head_dim", "threads", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not os.access(args.flashattn, os.X_OK):
        parser.error(f"--flashattn: no executable at {args.flashattn} (build it first)")

    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    flops = 4.0 * args.batch * args.heads * args.seqlen**2 * args.head_dim
    rows = []
    print(f"prefill with a bias or mask, f32, B {args.batch}, H {args.heads}, S {args.seqlen}, "
          f"D {args.head_dim}, not causal, {args.threads} threads, median of {args.repeat}")
    print(f"{'case':<10} {'peer':<44} {'ms':>9} {'GFLOP/s':>8} {'speed/flash':>12}  check")
    with tempfile.TemporaryDirectory() as work:
        for case in cases(args.seqlen, rng):
            print(f"peers_modifiers.py: {case['name']}: fp64 reference", file=sys.stderr)
            want = reference(q, k, v, case["additive"])
            bound = tolerance(q, k, v, case["additive"])
            flash_seconds = None
            peers = [
                ("flashattn", lambda: run_flashattn(args.flashattn, q, k, v, case, args.threads,
                                                    args.repeat, work)),
                ("torch", lambda: run_torch(q, k, v, case, args.threads, args.repeat)),
                ("onnxruntime", lambda: run_onnxruntime(q, k, v, case, args.threads,
                                                        args.repeat)),
            ]
            for name, run in peers:
                print(f"peers_modifiers.py: {case['name']}, {name}", file=sys.stderr)
                try:
                    out, seconds, version = run()
                except ImportError as error:
                    print(f"{case['name']:<10} {name:<44} not installed ({error.name})")
                    continue
                error = float(np.abs(out.astype(np.float64) - want).max())
                verified = bool(error <= bound)
                if name == "flashattn":
                    flash_seconds = seconds
                gflops = flops / seconds * 1e-9
                ratio = flash_seconds / seconds if flash_seconds else float("nan")
                print(f"{case['name']:<10} {version:<44} {seconds * 1e3:>9.2f} {gflops:>8.1f} "
                      f"{ratio:>12.3f}  {'verified' if verified else 'FAILED'} "
                      f"(error {error:.2g}, tolerance {bound:.2g})")
                rows.append({"case": case["name"], "peer": name, "version": version,
                             "seconds": f"{seconds:.6g}", "gflops": f"{gflops:.2f}",
                             "speed_over_flashattn": f"{ratio:.3f}", "verified": verified,
                             "max_error": f"{error:.3g}", "tolerance": f"{bound:.3g}"})

    path = write_csv(args.out_dir, "peers-modifiers",
                     {"threads": args.threads, "repeat": args.repeat, "batch": args.batch,
                      "heads": args.heads, "seqlen": args.seqlen, "head_dim": args.head_dim},
                     rows)
    print(f"\nwrote {os.path.abspath(path)}")
    return 0 if all(row["verified"] for row in rows) else 3


if __name__ == "__main__":
    sys.exit(main())
