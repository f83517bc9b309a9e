#!/usr/bin/env bash
# llama.cpp's CPU flash attention as a peer: downloads the llama.cpp sources that PyPI's
# llama-cpp-python sdist vendors (nothing of it enters this repository), builds its
# test-backend-ops for the CPU backend, and times GGML_OP_FLASH_ATTN_EXT's perf cases (its decode
# case: D = 64, 64 query heads on 8 KV heads, 7680 keys, f16 / q8_0 / q4_0 caches), on all of
# this machine's cores. Then the same shape through `flashattn serve-bench` on f16, int8 and fp8
# caches, for the table of bench/RESULTS.md.
#
#   bench/llama_cpp_peer.sh [WORK_DIR (default /tmp/flashattn-llama)] [FLASHATTN_CLI]
set -euo pipefail
work="${1:-/tmp/flashattn-llama}"
cli="${2:-build/ci/tools/flashattn}"
version=0.3.36
mkdir -p "$work"
if [ ! -d "$work/llama_cpp_python-$version" ]; then
  python3 -m pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work"
  tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
fi
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -x "$work/build/bin/test-backend-ops" ]; then
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    > "$work/configure.log"
  cmake --build "$work/build" --target test-backend-ops -j "$(nproc)" > "$work/build.log"
fi
echo "== llama.cpp $version test-backend-ops perf -o FLASH_ATTN_EXT (CPU, $(nproc) threads)"
"$work/build/bin/test-backend-ops" perf -o FLASH_ATTN_EXT -b CPU -p 'kv=7680,nb=1,' 2>&1 |
  grep FLASH_ATTN_EXT || true
echo "== flashattn serve-bench, the same decode shape (one sequence, f32 q)"
"$cli" serve-bench --no-prefill --requests 1 --min-len 64 --max-len 64 --steps 1 \
  --heads-q 64 --heads-kv 8 --head-dim 64 --single-seqlens 7680 \
  --single-dtypes f16,int8,fp8_e4m3,fp8_e5m2 --threads "$(nproc)" --out-dir "$work" --no-plot |
  grep -E "^single  dense"
