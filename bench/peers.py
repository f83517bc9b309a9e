#!/usr/bin/env python3
"""Decode against a KV cache, side by side with what users would pick instead.

One f32 query row per sequence (Hq = 32 query heads on Hkv = 8 KV heads, D = 128, or
--heads-q, --heads-kv and --head-dim) against a KV cache of each --cache-dtypes dtype: one
sequence of each --seqlens length, then a ragged batch of --requests sequences of lengths
log-uniform in [--min-len, --max-len] (a server's decode step; 0 requests leaves it out). On the
same inputs and the same number of threads:

  flashattn    one f32 sequence: `flashattn run` (the FlashAttention path; its JSON line gives
               the median seconds of --repeat calls after a warm-up). Otherwise the Python
               package's flash_attn_with_kvcache with the f32 q against the cache and each
               sequence's length (16-bit caches: the serving case; `pip install .` first),
               timed here
  torch        PyTorch's CPU scaled_dot_product_attention, enable_gqa=True, on contiguous
               [B, H, S, D] tensors (its own layout), all in the cache's dtype (q rounded to it:
               it takes one dtype); the batch padded to its longest sequence with a boolean mask
  onnxruntime  ONNX Runtime's GroupQueryAttention (com.microsoft) with the cache as past_key /
               past_value ([B, Hkv, S - 1, D], padded) and each sequence's last key and value as
               its new token (seqlens_k = length - 1), all in the cache's dtype; a dtype its CPU
               provider refuses is reported as such

Each output is checked against a NumPy fp64 reference from the f32 q and the cache as stored:
max |out - reference| within u · max|v| · (4 · scale · D · max|q| · max|k| + 2 · Skv + 16) +
u · max|reference|, the bound of tests/test_attention_vs_reference.cpp with u the unit roundoff
of the precision the peer computes and returns in (2^-24 for flashattn and for f32 peers, 2^-8
for bf16, 2^-11 for f16; Skv the longest sequence's length). Timed as the median of --repeat
calls after a warm-up, reported as GB/s of the K and V rows the sequences see (each once per
step, padding not counted); a peer that fails the check is marked FAILED and the run exits with
status 3. Writes <out-dir>/<date>-<host>-peers.csv. The batch's padded copies take ~8 GB at
the defaults.

  python3 bench/peers.py --flashattn build/release/tools/flashattn [--seqlens 4096,16384,65536]
                         [--cache-dtypes f32,bf16,f16] [--requests 16 --min-len 512
                         --max-len 16384] [--threads 2] [--repeat 15] [--out-dir bench/results]

Needs numpy (and ml_dtypes for bf16); torch, onnxruntime, onnx and the flashattn package are
optional (pip install torch onnxruntime onnx ml_dtypes, and pip install . for the package).
"""

import argparse
import csv
import datetime
import functools
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


# Unit roundoff of each precision a peer computes and returns in.
UNIT_ROUNDOFF = {"f32": 2.0**-24, "bf16": 2.0**-8, "f16": 2.0**-11}


def numpy_dtype(name):
    """The numpy dtype of a cache dtype name (bf16 from ml_dtypes)."""
    if name == "bf16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel
        return ml_dtypes.bfloat16
    return {"f32": np.float32, "f16": np.float16}[name]


def reference(q, k, v, lengths):
    """fp64 attention of q [B, 1, Hq, D] against the first lengths[b] rows of k, v [B, S, Hkv, D]:
    out [B, 1, Hq, D]."""
    group = HEADS_Q // HEADS_KV
    q64 = q.astype(np.float64)
    out = np.empty_like(q64)
    for b, length in enumerate(lengths):
        k64, v64 = (x[b, :length].astype(np.float64) for x in (k, v))
        for h in range(HEADS_Q):
            scores = k64[:, h // group, :] @ q64[b, 0, h, :] / math.sqrt(HEAD_DIM)
            weights = np.exp(scores - scores.max())
            out[b, 0, h, :] = weights @ v64[:, h // group, :] / weights.sum()
    return out


def largest(x):
    """max |x| as a Python float (any of the cache dtypes)."""
    return float(np.abs(x.astype(np.float32)).max())


def tolerance(max_q, max_k, max_v, max_want, seqlen, unit_roundoff):
    """The first-order bound for the longest sequence, seqlen keys, from the operands' largest
    magnitudes."""
    scale = 1.0 / math.sqrt(HEAD_DIM)
    return unit_roundoff * max_v * (4.0 * scale * HEAD_DIM * max_q * max_k + 2.0 * seqlen + 16.0) \
        + unit_roundoff * max_want


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
    return np.load(paths["out"]), json.loads(completed.stdout)["seconds"], "flashattn"


def run_flashattn_kvcache(q, k, v, lengths, threads, repeat):
    """The package's flash_attn_with_kvcache: f32 q against the cache k, v as they are, each
    sequence its own length."""
    import flashattn  # pylint: disable=import-outside-toplevel

    cache_seqlens = np.asarray(lengths, dtype=np.int32)

    def call():
        return flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens,
                                                 num_threads=threads)

    return call(), median_seconds(call, repeat), f"flashattn {flashattn.__version__} (f32 q)"


def run_torch(q, k, v, lengths, threads, repeat):
    """SDPA with every tensor in the cache's dtype (q rounded to it), a ragged batch padded to the
    longest sequence with a boolean mask; out as f32."""
    import torch  # pylint: disable=import-outside-toplevel
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}.get(
        k.dtype, torch.bfloat16)
    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(dtype).transpose(1, 2).contiguous()
                  for x in (q, k, v))
    mask = None
    if any(length != k.shape[1] for length in lengths):
        keep = np.arange(k.shape[1])[None, :] < np.asarray(lengths)[:, None]
        mask = torch.from_numpy(keep[:, None, None, :])
    with torch.inference_mode():
        def call():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
        out = call().transpose(1, 2).float().numpy()
        return out, median_seconds(call, repeat), f"torch {torch.__version__}"


def run_onnxruntime(q, k, v, lengths, threads, repeat):
    """GroupQueryAttention on a past of S - 1 rows (padded for shorter sequences) and each
    sequence's last row as its new token (seqlens_k = length - 1)."""
    import onnx  # pylint: disable=import-outside-toplevel
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    batch, seqlen = k.shape[0], k.shape[1]
    element = {np.dtype(np.float32): TensorProto.FLOAT,
               np.dtype(np.float16): TensorProto.FLOAT16}.get(k.dtype, TensorProto.BFLOAT16)
    q = q.astype(k.dtype)
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft", num_heads=HEADS_Q, kv_num_heads=HEADS_KV)
    graph = helper.make_graph(
        [node], "decode",
        [helper.make_tensor_value_info("query", element, [batch, 1, HEADS_Q * HEAD_DIM]),
         helper.make_tensor_value_info("key", element, [batch, 1, HEADS_KV * HEAD_DIM]),
         helper.make_tensor_value_info("value", element, [batch, 1, HEADS_KV * HEAD_DIM]),
         helper.make_tensor_value_info("past_key", element,
                                       [batch, HEADS_KV, seqlen - 1, HEAD_DIM]),
         helper.make_tensor_value_info("past_value", element,
                                       [batch, HEADS_KV, seqlen - 1, HEAD_DIM]),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
         helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("output", element, [batch, 1, HEADS_Q * HEAD_DIM]),
         helper.make_tensor_value_info("present_key", element, None),
         helper.make_tensor_value_info("present_value", element, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    last = np.asarray(lengths) - 1
    rows = np.arange(batch)
    feeds = {
        "query": q.reshape(batch, 1, -1),
        "key": k[rows, last].reshape(batch, 1, -1),
        "value": v[rows, last].reshape(batch, 1, -1),
        "past_key": np.ascontiguousarray(k[:, :-1].transpose(0, 2, 1, 3)),
        "past_value": np.ascontiguousarray(v[:, :-1].transpose(0, 2, 1, 3)),
        "seqlens_k": last.astype(np.int32),
        "total_sequence_length": np.array(seqlen, dtype=np.int32),
    }

    def call():
        return session.run(["output"], feeds)[0]

    out = call().astype(np.float32).reshape(batch, 1, HEADS_Q, HEAD_DIM)
    return out, median_seconds(call, repeat), f"onnxruntime {ort.__version__} (onnx {onnx.__version__})"


def compare(args, work, case, q, k32, v32, lengths, cache_dtype):
    """Every peer on one case (q, the cache rows k32, v32 in f32 rounded to cache_dtype, each
    sequence's length): prints a line per peer and returns the CSV rows."""
    k, v = (x.astype(numpy_dtype(cache_dtype)) for x in (k32, v32))
    want = reference(q, k, v, lengths)
    magnitudes = (largest(q), largest(k), largest(v), float(np.abs(want).max()))
    # Bytes of K and V a decode step needs: each sequence's own rows once.
    kv_bytes = 2 * int(np.sum(lengths)) * HEADS_KV * HEAD_DIM * k.dtype.itemsize
    if cache_dtype == "f32" and len(lengths) == 1:
        flash = functools.partial(run_flashattn, args.flashattn, q, k, v, args.threads,
                                  args.repeat, work)
    else:
        flash = functools.partial(run_flashattn_kvcache, q, k, v, lengths, args.threads,
                                  args.repeat)
    peers = [
        ("flashattn", flash, "f32"),
        ("torch", functools.partial(run_torch, q, k, v, lengths, args.threads, args.repeat),
         cache_dtype),
        ("onnxruntime",
         functools.partial(run_onnxruntime, q, k, v, lengths, args.threads, args.repeat),
         cache_dtype),
    ]
    rows, flash_seconds = [], None
    for name, run, precision in peers:
        print(f"peers.py: {cache_dtype} cache, {case}, {name}", file=sys.stderr)
        try:
            out, seconds, version = run()
        except ImportError as error:
            print(f"{cache_dtype:>5} {case:>15} {name:<44} not installed ({error.name})")
            continue
        except Exception as error:  # pylint: disable=broad-except
            # A peer that refuses the dtype (ONNX Runtime's CPU provider has no bf16 kernel for
            # GroupQueryAttention) is reported, not timed; flashattn failing is an error.
            if name == "flashattn":
                raise
            lines = str(error).strip().splitlines() or [type(error).__name__]
            print(f"{cache_dtype:>5} {case:>15} {name:<44} unsupported: "
                  f"{' '.join(lines[0].split())[-100:]}")
            continue
        bound = tolerance(*magnitudes, max(lengths), UNIT_ROUNDOFF[precision])
        error = float(np.abs(np.asarray(out, dtype=np.float64) - want).max())
        verified = bool(error <= bound)
        if name == "flashattn":
            flash_seconds = seconds
        gbps = kv_bytes / seconds * 1e-9
        ratio = flash_seconds / seconds if flash_seconds else float("nan")
        print(f"{cache_dtype:>5} {case:>15} {version:<44} {seconds * 1e3:>9.3f} {gbps:>8.2f} "
              f"{ratio:>12.3f}  {'verified' if verified else 'FAILED'} "
              f"(error {error:.2g}, tolerance {bound:.2g})")
        rows.append({"cache_dtype": cache_dtype, "requests": len(lengths),
                     "seqlen_kv": int(np.sum(lengths)), "longest": max(lengths), "peer": name,
                     "version": version, "seconds": f"{seconds:.6g}", "kv_gbps": f"{gbps:.3f}",
                     "speed_over_flashattn": f"{ratio:.3f}", "verified": verified,
                     "max_error": f"{error:.3g}", "tolerance": f"{bound:.3g}"})
    return rows


def main():
    # The shape every function here reads, set from the command line.
    global HEADS_Q, HEADS_KV, HEAD_DIM  # pylint: disable=global-statement
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--flashattn", default="build/release/tools/flashattn",
                        help="the flashattn binary")
    parser.add_argument("--seqlens", default="4096,16384,65536",
                        help="KV cache lengths of the single sequence")
    parser.add_argument("--cache-dtypes", default="f32,bf16,f16",
                        help="dtypes of the KV cache (f32, bf16, f16), comma-separated")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests of the ragged batch (0 = no batch)")
    parser.add_argument("--min-len", type=int, default=512, help="shortest request of the batch")
    parser.add_argument("--max-len", type=int, default=16384, help="longest request of the batch")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads, each peer")
    parser.add_argument("--repeat", type=int, default=15, help="timed calls per peer (median)")
    parser.add_argument("--heads-q", type=int, default=HEADS_Q, help="query heads")
    parser.add_argument("--heads-kv", type=int, default=HEADS_KV,
                        help="KV heads (a divisor of --heads-q)")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head dimension")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    if args.heads_q < 1 or args.heads_kv < 1 or args.heads_q % args.heads_kv or args.head_dim < 1:
        parser.error(f"--heads-q, --heads-kv, --head-dim: expected positive, --heads-kv dividing "
                     f"--heads-q, got {args.heads_q}, {args.heads_kv}, {args.head_dim}")
    HEADS_Q, HEADS_KV, HEAD_DIM = args.heads_q, args.heads_kv, args.head_dim
    try:
        seqlens = [int(x) for x in args.seqlens.split(",")] if args.seqlens else []
    except ValueError:
        parser.error(f"--seqlens: expected comma-separated integers, got '{args.seqlens}'")
    if any(s < 2 for s in seqlens):
        parser.error(f"--seqlens: expected lengths >= 2, got '{args.seqlens}'")
    cache_dtypes = args.cache_dtypes.split(",")
    if not cache_dtypes or any(d not in UNIT_ROUNDOFF for d in cache_dtypes):
        parser.error(f"--cache-dtypes: expected a comma-separated list of f32, bf16, f16, got "
                     f"'{args.cache_dtypes}'")
    if args.requests < 0:
        parser.error(f"--requests: expected >= 0, got {args.requests}")
    if not seqlens and not args.requests:
        parser.error("--seqlens, --requests: nothing to run (give lengths or requests)")
    if args.requests and not 2 <= args.min_len <= args.max_len:
        parser.error(f"--min-len, --max-len: expected 2 <= min <= max, got {args.min_len}, "
                     f"{args.max_len}")
    if args.threads < 1 or args.repeat < 1:
        parser.error("--threads and --repeat: expected >= 1")
    if seqlens and "f32" in cache_dtypes and not os.access(args.flashattn, os.X_OK):
        parser.error(f"--flashattn: no executable at {args.flashattn} (build it first)")
    if "bf16" in cache_dtypes:
        try:
            numpy_dtype("bf16")
        except ImportError:
            parser.error("--cache-dtypes bf16: needs ml_dtypes (pip install ml_dtypes, or leave "
                         "bf16 out)")

    rng = np.random.default_rng(args.seed)
    cases = [(f"Skv {seqlen}", [seqlen]) for seqlen in seqlens]
    if args.requests:
        lengths = np.exp(rng.uniform(math.log(args.min_len), math.log(args.max_len + 1),
                                     args.requests)).astype(int).clip(args.min_len, args.max_len)
        cases.append((f"{args.requests} requests", [int(x) for x in lengths]))
    rows = []
    print(f"decode, f32 q, Hq {HEADS_Q}, Hkv {HEADS_KV}, D {HEAD_DIM}, {args.threads} threads, "
          f"median of {args.repeat}; GB/s of the K and V rows each sequence sees")
    print(f"{'cache':>5} {'case':>15} {'peer':<44} {'ms':>9} {'GB/s':>8} {'speed/flash':>12}  "
          "check")
    with tempfile.TemporaryDirectory() as work:
        for case, lengths in cases:
            batch, longest = len(lengths), max(lengths)
            q = rng.standard_normal((batch, 1, HEADS_Q, HEAD_DIM), dtype=np.float32)
            # Rows past a sequence's length are padding, zero (the peers that pad read them).
            k32 = np.zeros((batch, longest, HEADS_KV, HEAD_DIM), dtype=np.float32)
            v32 = np.zeros_like(k32)
            for b, length in enumerate(lengths):
                k32[b, :length] = rng.standard_normal((length, HEADS_KV, HEAD_DIM),
                                                      dtype=np.float32)
                v32[b, :length] = rng.standard_normal((length, HEADS_KV, HEAD_DIM),
                                                      dtype=np.float32)
            for cache_dtype in cache_dtypes:
                rows += compare(args, work, case, q, k32, v32, lengths, cache_dtype)
            del k32, v32

    path = write_csv(args.out_dir, "peers",
                     {"threads": args.threads, "repeat": args.repeat, "heads_q": HEADS_Q,
                      "heads_kv": HEADS_KV, "head_dim": HEAD_DIM}, rows)
    print(f"\nwrote {os.path.abspath(path)}")
    return 0 if all(row["verified"] for row in rows) else 3


if __name__ == "__main__":
    sys.exit(main())
