#!/usr/bin/env python3
"""Decode against a KV cache, side by side with what users would pick instead.

One query position (B = 1, Hq = 32 query heads on Hkv = 8 KV heads, D = 128, f32) against a KV
cache of each --seqlens length, on the same inputs and the same number of threads:

  flashattn    `flashattn run` (the FlashAttention path; its JSON line gives the median seconds
               of --repeat calls after a warm-up)
  torch        PyTorch's CPU scaled_dot_product_attention, enable_gqa=True, on contiguous
               [B, H, S, D] tensors (its own layout)
  onnxruntime  ONNX Runtime's GroupQueryAttention (com.microsoft) with the cache as past_key /
               past_value ([B, Hkv, S - 1, D]) and the last key and value as the new token

Each output is first checked against a NumPy fp64 reference (max |out - reference| within
2^-24 · max|v| · (4 · scale · D · max|q| · max|k| + 2 · Skv + 16), the bound of
tests/test_attention_vs_reference.cpp); a peer that is not installed or fails the check is
reported and not timed. Timed as the median of --repeat calls after a warm-up, reported as GB/s
of K and V read (each byte of the cache once per token). Writes <out-dir>/<date>-<host>-peers.csv.

  python3 bench/peers.py --flashattn build/release/tools/flashattn [--seqlens 4096,16384,65536]
                         [--threads 2] [--repeat 15] [--out-dir bench/results]

Needs numpy; torch, onnxruntime and onnx are optional (pip install torch onnxruntime onnx).
"""

import argparse
import csv
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def reference(q, k, v):
    """fp64 attention of q [1, 1, Hq, D] against k, v [1, S, Hkv, D]: out [1, 1, Hq, D]."""
    group = HEADS_Q // HEADS_KV
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out = np.empty_like(q64)
    for h in range(HEADS_Q):
        scores = k64[0, :, h // group, :] @ q64[0, 0, h, :] / math.sqrt(HEAD_DIM)
        weights = np.exp(scores - scores.max())
        out[0, 0, h, :] = weights @ v64[0, :, h // group, :] / weights.sum()
    return out


def tolerance(q, k, v, seqlen):
    scale = 1.0 / math.sqrt(HEAD_DIM)
    return 2.0**-24 * float(np.abs(v).max()) * (
        4.0 * scale * HEAD_DIM * float(np.abs(q).max()) * float(np.abs(k).max())
        + 2.0 * seqlen
        + 16.0
    )


def median_seconds(call, repeat):
    call()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_csv(out_dir, kind, common, rows):
    """<out_dir>/<date>-<host>-<kind>.csv: date, host, the `common` columns, then each row's own;
    written whole under a temporary name, then renamed. Returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    date, host = datetime.date.today().isoformat(), socket.gethostname()
    path = os.path.join(out_dir, f"{date}-{host}-{kind}.csv")
    fieldnames = ["date", "host", *common, *(rows[0] if rows else {})]
    with open(path + ".tmp", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=fieldnames)
        writer.writeheader()
        for row in rows:
            writer.writerow({"date": date, "host": host, **common, **row})
    os.replace(path + ".tmp", path)
    return path


def run_flashattn(binary, q, k, v, threads, repeat, work):
    paths = {name: os.path.join(work, name + ".npy") for name in ("q", "k", "v", "out")}
    for name, array in (("q", q), ("k", k), ("v", v)):
        np.save(paths[name], array)
    completed = subprocess.run(
        [binary, "run", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--out",
         paths["out"], "--threads", str(threads), "--repeat", str(repeat)],
        capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr.strip())
    return np.load(paths["out"]), json.loads(completed.stdout)["seconds"]


def run_torch(q, k, v, threads, repeat):
    import torch  # pylint: disable=import-outside-toplevel
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
    with torch.inference_mode():
        def call():
            return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        out = call().transpose(1, 2).numpy()
        return out, median_seconds(call, repeat), f"torch {torch.__version__}"


def run_onnxruntime(q, k, v, threads, repeat):
    import onnx  # pylint: disable=import-outside-toplevel
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    seqlen = k.shape[1]
    f32 = TensorProto.FLOAT
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft", num_heads=HEADS_Q, kv_num_heads=HEADS_KV)
    graph = helper.make_graph(
        [node], "decode",
        [helper.make_tensor_value_info("query", f32, [1, 1, HEADS_Q * HEAD_DIM]),
         helper.make_tensor_value_info("key", f32, [1, 1, HEADS_KV * HEAD_DIM]),
         helper.make_tensor_value_info("value", f32, [1, 1, HEADS_KV * HEAD_DIM]),
         helper.make_tensor_value_info("past_key", f32, [1, HEADS_KV, seqlen - 1, HEAD_DIM]),
         helper.make_tensor_value_info("past_value", f32, [1, HEADS_KV, seqlen - 1, HEAD_DIM]),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("output", f32, [1, 1, HEADS_Q * HEAD_DIM]),
         helper.make_tensor_value_info("present_key", f32, None),
         helper.make_tensor_value_info("present_value", f32, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feeds = {
        "query": q.reshape(1, 1, -1),
        "key": k[:, -1:].reshape(1, 1, -1),
        "value": v[:, -1:].reshape(1, 1, -1),
        "past_key": np.ascontiguousarray(k[:, :-1].transpose(0, 2, 1, 3)),
        "past_value": np.ascontiguousarray(v[:, :-1].transpose(0, 2, 1, 3)),
        "seqlens_k": np.array([seqlen - 1], dtype=np.int32),
        "total_sequence_length": np.array(seqlen, dtype=np.int32),
    }

    def call():
        return session.run(["output"], feeds)[0]

    out = call().reshape(1, 1, HEADS_Q, HEAD_DIM)
    return out, median_seconds(call, repeat), f"onnxruntime {ort.__version__} (onnx {onnx.__version__})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--flashattn", default="build/release/tools/flashattn",
                        help="the flashattn binary")
    parser.add_argument("--seqlens", default="4096,16384,65536", help="KV cache lengths")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads, each peer")
    parser.add_argument("--repeat", type=int, default=15, help="timed calls per peer (median)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    try:
        seqlens = [int(x) for x in args.seqlens.split(",")]
    except ValueError:
        parser.error(f"--seqlens: expected comma-separated integers, got '{args.seqlens}'")
    if any(s < 2 for s in seqlens):
        parser.error(f"--seqlens: expected lengths >= 2, got '{args.seqlens}'")
    if args.threads < 1 or args.repeat < 1:
        parser.error("--threads and --repeat: expected >= 1")
    if not os.access(args.flashattn, os.X_OK):
        parser.error(f"--flashattn: no executable at {args.flashattn} (build it first)")

    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"decode, f32, B 1, Hq {HEADS_Q}, Hkv {HEADS_KV}, D {HEAD_DIM}, {args.threads} threads,"
          f" median of {args.repeat}")
    print(f"{'Skv':>7} {'peer':<44} {'ms':>9} {'GB/s':>8} {'speed/flash':>12}  check")
    with tempfile.TemporaryDirectory() as work:
        for seqlen in seqlens:
            q = rng.standard_normal((1, 1, HEADS_Q, HEAD_DIM), dtype=np.float32)
            k = rng.standard_normal((1, seqlen, HEADS_KV, HEAD_DIM), dtype=np.float32)
            v = rng.standard_normal((1, seqlen, HEADS_KV, HEAD_DIM), dtype=np.float32)
            want = reference(q, k, v)
            bound = tolerance(q, k, v, seqlen)
            kv_bytes = k.nbytes + v.nbytes
            flash_seconds = None
            peers = [
                ("flashattn", lambda: run_flashattn(args.flashattn, q, k, v, args.threads,
                                                    args.repeat, work) + ("flashattn",)),
                ("torch", lambda: run_torch(q, k, v, args.threads, args.repeat)),
                ("onnxruntime", lambda: run_onnxruntime(q, k, v, args.threads, args.repeat)),
            ]
            for name, run in peers:
                print(f"peers.py: Skv {seqlen}, {name}", file=sys.stderr)
                try:
                    out, seconds, version = run()
                except ImportError as error:
                    print(f"{seqlen:>7} {name:<44} not installed ({error.name})")
                    continue
                error = float(np.abs(out.astype(np.float64) - want).max())
                verified = bool(error <= bound)
                if name == "flashattn":
                    flash_seconds = seconds
                gbps = kv_bytes / seconds * 1e-9
                ratio = flash_seconds / seconds if flash_seconds else float("nan")
                print(f"{seqlen:>7} {version:<44} {seconds * 1e3:>9.3f} {gbps:>8.2f} "
                      f"{ratio:>12.3f}  {'verified' if verified else 'FAILED'} "
                      f"(error {error:.2g}, tolerance {bound:.2g})")
                rows.append({"seqlen_kv": seqlen, "peer": name, "version": version,
                             "seconds": f"{seconds:.6g}", "kv_gbps": f"{gbps:.3f}",
                             "speed_over_flashattn": f"{ratio:.3f}", "verified": verified,
                             "max_error": f"{error:.3g}", "tolerance": f"{bound:.3g}"})

    path = write_csv(args.out_dir, "peers", {"threads": args.threads, "repeat": args.repeat},
                     rows)
    print(f"\nwrote {os.path.abspath(path)}")
    return 0 if all(row["verified"] for row in rows) else 3


if __name__ == "__main__":
    sys.exit(main())
