#!/usr/bin/env bash
# Installs what flashattn needs to build and test on Debian 12 (docs/design.md, "Dependencies").
# Idempotent.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

packages=(
  cmake ninja-build g++ pkg-config
  libhwy-dev              # Highway: SIMD with runtime dispatch
  libopenblas-openmp-dev  # OpenBLAS (OpenMP build) for sgemm
  libcli11-dev            # CLI parsing
  libgtest-dev            # tests
  python3 python3-numpy   # .npy interoperability test
  clang libclang-rt-dev   # sanitizer and libFuzzer runtimes for clang (tsan, fuzz presets)
  libomp-dev              # LLVM OpenMP and its ThreadSanitizer tool, Archer (tsan preset)
  libbenchmark-dev        # Google Benchmark: the flashattn_benchmark target
  gnuplot-nox             # `flashattn bench` plots
)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The python3 first on PATH may not be Debian's (pyenv, venv): give it numpy too.
if ! python3 -c "import numpy" 2>/dev/null; then
  python3 -m pip install --quiet numpy
fi
