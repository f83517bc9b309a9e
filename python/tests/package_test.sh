#!/usr/bin/env bash
# The package as a user gets it (issue 53): the sdist and the portable wheel that
# scripts/build-wheel.sh builds (`pip wheel` of the sdist against PyPI's scipy-openblas32, then
# `auditwheel repair`), checked for
#  - the sdist's name, and the wheel's name, size and manylinux tag, as `auditwheel show` reads it;
#  - installed into a fresh venv: every shared object of the package resolves its libraries
#    inside the package or among the manylinux policy's system libraries (so Debian's OpenBLAS
#    and Highway are never needed), with LD_LIBRARY_PATH unset;
#  - there, flashattn imports, runs a forward that agrees with an fp64 numpy reference, on
#    scipy-openblas's BLAS, and flashattn.__version__ and the metadata say VERSION;
#  - in a torch process (where python has torch): the package's libgomp.so.1 and torch's are one
#    OpenMP runtime and torch.set_num_threads sets flashattn's team (python/tests/test_threads.py
#    run on the installed package), in both import orders.
# Usage: package_test.sh PYTHON SOURCE_DIR WORK_DIR VERSION (CMake's project version)
set -euo pipefail
python=$1 source_dir=$2 work=$3 version=$4
rm -rf "$work/wheels" "$work/venv" "$work/target"
mkdir -p "$work"
fail() { echo "package_test: $*" >&2; exit 1; }

# The wheel, built once; CMake's build folder is kept in WORK_DIR between runs.
PYTHON=$python "$source_dir/scripts/build-wheel.sh" "$work/wheels" "$work/build" > "$work/show.txt"
cat "$work/show.txt"
[[ -s $work/wheels/flashattn-$version.tar.gz ]] || fail "no sdist flashattn-$version.tar.gz"
wheel=$(ls "$work"/wheels/flashattn-*.whl)
name=$(basename "$wheel")
[[ $name == flashattn-$version-*-manylinux_2_[0-9]*_x86_64.whl ]] ||
  fail "expected flashattn-$version-...-manylinux_2_NN_x86_64.whl, got $name"
tag=$(sed -n 's/.*following platform tag: "\([^"]*\)".*/\1/p' "$work/show.txt")
[[ $name == *"$tag.whl" && -n $tag ]] || fail "auditwheel show gives tag '$tag', the wheel is $name"
size=$(stat -c %s "$wheel")
((size <= 40 * 1024 * 1024)) || fail "$name is $size bytes, more than 40 MiB"
echo "package_test: $name, $((size / 1024)) KiB"

unset LD_LIBRARY_PATH
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$wheel"
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

# The manylinux policies' system libraries (PEP 600: glibc's, libstdc++, libgcc_s); anything else
# must come from the package itself (flashattn/ or auditwheel's flashattn.libs/).
policy='^(libc|libm|libdl|librt|libpthread|libutil|libresolv|libstdc\+\+|libgcc_s|ld-linux-x86-64|linux-vdso)\.so'
count=0
while IFS= read -r object; do
  count=$((count + 1))
  while read -r soname arrow path _; do
    [[ $arrow == "=>" ]] || continue  # the vdso and the loader's own line
    [[ $path != "not" ]] || fail "$object: $soname not found"
    [[ $path == "$site"/flashattn* || $soname =~ $policy ]] ||
      fail "$object: $soname resolves outside the package and the policy, to $path"
  done < <(ldd "$object")
done < <(find "$site"/flashattn* -name '*.so*' -type f)
((count >= 4)) || fail "expected the extension, libflashattn, OpenBLAS and libgomp, found $count"
libraries=("$site"/flashattn/libflashattn*)
[[ ${#libraries[@]} == 1 && ${libraries[0]} == */libflashattn.so ]] ||
  fail "expected one unversioned libflashattn.so, found ${libraries[*]}"
# The license, and the notices of the code the wheel ships besides ours (Random123's: Debian's
# copyright file or the downloaded sources' LICENSE, whichever the build used).
for notice in "flashattn-$version.dist-info/licenses/LICENSE" flashattn/licenses/openblas-LICENSE \
    flashattn/licenses/highway-Apache-2.0 flashattn/licenses/gcc-runtime-copyright \
    "flashattn/licenses/random123-*"; do
  compgen -G "$site/$notice" > /dev/null || fail "the installed package has no $notice"
  for file in $site/$notice; do [[ -s $file ]] || fail "$file is empty"; done
done

cd "$work"  # not the source tree, whose python/flashattn must not shadow the installed package
"$work/venv/bin/python" - "$version" "$site" <<'PY'
import importlib.metadata
import sys

import numpy as np
import flashattn
from flashattn import _flashattn

version, site = sys.argv[1:]
assert flashattn.__file__.startswith(site), flashattn.__file__
assert flashattn.__version__ == version, (flashattn.__version__, version)
assert importlib.metadata.version("flashattn") == version, importlib.metadata.version("flashattn")
assert "(scipy-openblas," in _flashattn.blas(), _flashattn.blas()

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 37, 4, 32), dtype=np.float32) for _ in range(3))
s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(32)
s[:, :, np.triu_indices(37, 1)[0], np.triu_indices(37, 1)[1]] = -np.inf
p = np.exp(s - s.max(-1, keepdims=True))
reference = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
err = 0.0
for impl in ("flash", "standard"):  # the standard path's products run on the wheel's OpenBLAS
    out = flashattn.flash_attn_func(q, k, v, causal=True, impl=impl)
    err = max(err, float(np.abs(out - reference).max()))
assert err < 1e-5, err
loaded = [line.split()[-1] for line in open("/proc/self/maps") if ".so" in line]
outside = sorted({path for path in loaded if ("openblas" in path or "hwy" in path or "gomp" in path)
                  and not path.startswith(site)})
assert not outside, f"libraries loaded from outside the package: {outside}"
print(f"package_test: flashattn {flashattn.__version__} ({_flashattn.blas()}, "
      f"{_flashattn.simd_target()}) from {flashattn.__file__}: max error {err:.2g}")
PY

# One OpenMP runtime with torch: the installed package alone on PYTHONPATH of a python that has
# torch, and the thread test of the source tree run against it.
if "$python" -c "import torch" 2>/dev/null; then
  "$python" -m pip install --quiet --no-deps --target "$work/target" "$wheel"
  PYTHONPATH=$work/target "$python" -m pytest -q -p no:cacheprovider \
    "$source_dir/python/tests/test_threads.py"
  PYTHONPATH=$work/target "$python" -c "import flashattn; print(flashattn.__file__)" |
    grep -q "^$work/target/" || fail "the thread test did not run the installed package"
else
  echo "package_test: no torch in $python; the OpenMP runtime check with torch skipped"
fi
