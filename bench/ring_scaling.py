#!/usr/bin/env python3
"""Ring attention's scaling: measured on this host, predicted for clusters.

Measures `flashattn ring` under mpirun at P = 1, 2, 3, 4 ranks on one host (one JSON line each),
then predicts with a small model what the same ring does at 8..1024 ranks for 128k..10M tokens,
and checks the model against the measured runs.

The model (docs/dist.md, "Scale on paper"): with zig-zag sharding under a causal mask every rank
does the same work, 1/P^2 of the whole per step, for P steps. One step takes

    compute  = flops / P^2 / F                       F: one rank's attention GFLOP/s
    transfer = latency + 2 (S/P) Hkv D bytes / B      B: link bandwidth (K and V of one shard)
    merge    = 3 (S/P) Hq D 4 bytes / M              M: memory bandwidth (read two states, write one)
    step     = max(compute, transfer) + merge        the transfer overlaps the compute

and the efficiency is compute / step: the fraction of the ranks' time spent attending. On this
host F is the measured single-process rate per core (ranks beyond the cores share them), B the
measured shared-memory shift rate and M the copy bandwidth given.

Usage:
  bench/ring_scaling.py --flashattn build/ci/tools/flashattn --csv bench/results/DATE-ring.csv \
      --plot bench/results/DATE-ring.png
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile


def run_ring(flashattn, ranks, shape, threads, causal, sharding):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # --bind-to none: Open MPI pins each of up to two ranks to one core, which would put a
    # single rank's threads on one core.
    command = ["mpirun", "-q", "-np", str(ranks), "--oversubscribe", "--bind-to", "none",
               flashattn, "ring",
               "--shape", ",".join(str(x) for x in shape), "--threads", str(threads),
               "--sharding", sharding]
    if causal:
        command.append("--causal")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"ring_scaling: {' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def attention_flops(seqlen, heads_q, dim, causal):
    pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    return 4.0 * pairs * heads_q * dim


def predict(ranks, seqlen, heads_q, heads_kv, dim, element_bytes, rank_gflops, link_gbs,
            latency_us, memory_gbs, causal=True):
    """Seconds of one ring call and its efficiency (compute / step time)."""
    rows = seqlen / ranks
    compute = attention_flops(seqlen, heads_q, dim, causal) / ranks**2 / (rank_gflops * 1e9)
    transfer = (latency_us * 1e-6 + 2 * rows * heads_kv * dim * element_bytes / (link_gbs * 1e9)
                if ranks > 1 else 0.0)
    merge = 3 * rows * heads_q * dim * 4 / (memory_gbs * 1e9)
    step = max(compute, transfer) + merge
    return ranks * step, compute / step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flashattn", default="build/ci/tools/flashattn")
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--memory-gbs", type=float, default=40.0,
                        help="this host's memory bandwidth for the merge term (GB/s)")
    parser.add_argument("--link-gbs", type=float, default=25.0,
                        help="the cluster's link bandwidth for the prediction (GB/s; 25 = 200 Gb/s)")
    parser.add_argument("--latency-us", type=float, default=5.0)
    parser.add_argument("--gpu-tflops", type=float, default=400.0,
                        help="a GPU rank's attention rate, for the second predicted family")
    parser.add_argument("--csv", help="write the measured and predicted rows here")
    parser.add_argument("--plot", help="write a PNG of the predicted efficiency here (gnuplot)")
    args = parser.parse_args()

    shape = (1, args.seqlen, args.heads, args.kv_heads, args.dim)
    rows = []
    measured = {}
    for ranks in args.ranks:
        threads = max(1, args.cores // ranks)
        print(f"ring_scaling: P = {ranks}, {threads} thread(s) per rank ...", file=sys.stderr)
        measured[ranks] = run_ring(args.flashattn, ranks, shape, threads, True, "zigzag")
    single = measured.get(1) or run_ring(args.flashattn, 1, shape, args.cores, True, "zigzag")
    flops = attention_flops(args.seqlen, args.heads, args.dim, True)
    core_gflops = flops / single["seconds"] / 1e9 / args.cores

    print("| ranks | seconds | GFLOP/s | compute balance (max/mean) | hidden | "
          "model seconds | measured / model |")
    print("|---|---|---|---|---|---|---|")
    for ranks, line in sorted(measured.items()):
        threads = max(1, args.cores // ranks)
        rank_gflops = core_gflops * min(args.cores, ranks * threads) / ranks
        shifts = [b / max(s, 1e-12) for b, s in zip(line["bytes_sent"],
                                                   line["transfer_seconds_alone"]) if s > 0]
        link = sum(shifts) / len(shifts) / 1e9 if shifts else 1e9
        model, _ = predict(ranks, args.seqlen, args.heads, args.kv_heads, args.dim, 4,
                           rank_gflops, link, 0.0, args.memory_gbs)
        print(f"| {ranks} | {line['seconds']:.3f} | {line['gflops']:.1f} | "
              f"{line['compute_balance']:.3f} | {line['hidden_fraction']:.3f} | {model:.3f} | "
              f"{line['seconds'] / model:.3f} |")
        rows.append(("measured", ranks, args.seqlen, line["seconds"], model,
                     line["compute_balance"], line["hidden_fraction"]))

    # (name, one rank's GFLOP/s, its memory bandwidth for the merge in GB/s): a node like this
    # host, and a GPU with HBM.
    families = [("cpu", core_gflops * args.cores, args.memory_gbs),
                ("gpu", args.gpu_tflops * 1000, 3000.0)]
    predicted = []
    for name, rank_gflops, memory_gbs in families:
        for seqlen in (131072, 1048576, 10485760):
            ranks = 8
            while ranks <= 1024:
                seconds, efficiency = predict(ranks, seqlen, args.heads, args.kv_heads, args.dim,
                                              2, rank_gflops, args.link_gbs, args.latency_us,
                                              memory_gbs)
                predicted.append((name, ranks, seqlen, seconds, efficiency))
                ranks *= 2
    print(f"\npredicted efficiency (bf16 K/V, {args.link_gbs} GB/s links, {args.latency_us} us; "
          f"cpu rank {families[0][1]:.0f} GFLOP/s, gpu rank {families[1][1] / 1000:.0f} TFLOP/s)")
    print("| rank | tokens | " + " | ".join(f"P={p}" for p in (8, 32, 128, 512, 1024)) + " |")
    print("|---|---|" + "---|" * 5)
    for name, _, _ in families:
        for seqlen in (131072, 1048576, 10485760):
            cells = [f"{e:.2f}" for n, p, s, _, e in predicted
                     if n == name and s == seqlen and p in (8, 32, 128, 512, 1024)]
            print(f"| {name} | {seqlen} | " + " | ".join(cells) + " |")

    if args.csv:
        with open(args.csv, "w") as out:
            out.write("kind,ranks,seqlen,seconds,model_seconds_or_efficiency,balance,hidden\n")
            for kind, ranks, seqlen, seconds, model, balance, hidden in rows:
                out.write(f"{kind},{ranks},{seqlen},{seconds:.6f},{model:.6f},{balance:.4f},"
                          f"{hidden:.4f}\n")
            for name, ranks, seqlen, seconds, efficiency in predicted:
                out.write(f"predicted-{name},{ranks},{seqlen},{seconds:.6f},{efficiency:.4f},,\n")
    if args.plot:
        if shutil.which("gnuplot") is None:
            sys.exit("ring_scaling: --plot needs gnuplot (apt-get install gnuplot-nox)")
        with tempfile.TemporaryDirectory() as scratch:
            series = []
            for name, _, _ in families:
                for seqlen in (131072, 1048576, 10485760):
                    path = os.path.join(scratch, f"{name}-{seqlen}.dat")
                    with open(path, "w") as data:
                        for n, p, s, _, e in predicted:
                            if n == name and s == seqlen:
                                data.write(f"{p} {e}\n")
                    label = f"{name} rank, {seqlen // 1024}k tokens"
                    series.append(f"'{path}' using 1:2 with linespoints title '{label}'")
            script = "\n".join([
                "set terminal pngcairo size 900,560",
                f"set output '{args.plot}'",
                "set logscale x 2",
                "set xlabel 'ranks'",
                "set ylabel 'efficiency (compute / step time)'",
                "set yrange [0:1.05]",
                "set key bottom left",
                f"set title 'Ring attention, predicted: causal zig-zag, Hq={args.heads}, "
                f"Hkv={args.kv_heads}, D={args.dim}, bf16 K/V, {args.link_gbs:g} GB/s links'",
                "plot " + ", ".join(series),
            ])
            subprocess.run(["gnuplot"], input=script, text=True, check=True)


if __name__ == "__main__":
    main()
