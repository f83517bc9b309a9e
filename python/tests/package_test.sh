#!/usr/bin/env bash
# The package as a user gets it: `pip wheel .` (scikit-build-core, in pip's isolated build
# environment, build requirements from PyPI), then the wheel installed into a fresh venv, where
# flashattn imports and computes one call against numpy.
# Usage: package_test.sh PYTHON SOURCE_DIR WORK_DIR VERSION (CMake's project version, which the
# wheel's name, its metadata and flashattn.__version__ must all say)
set -euo pipefail
python=$1 source_dir=$2 work=$3 version=$4
rm -rf "$work"
mkdir -p "$work"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$work/wheels" "$source_dir"
wheel=$(ls "$work"/wheels/flashattn-*.whl)
case $(basename "$wheel") in
  "flashattn-$version-"*) ;;
  *) echo "package_test: expected a wheel of version $version, got $(basename "$wheel")" >&2; exit 1 ;;
esac
echo "package_test: built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$wheel"
cd "$work"  # not the source tree, whose python/flashattn must not shadow the installed package
"$work/venv/bin/python" - "$version" <<'PY'
import importlib.metadata
import sys

import numpy as np
import flashattn

version = sys.argv[1]
assert flashattn.__version__ == version, (flashattn.__version__, version)
assert importlib.metadata.version("flashattn") == version, importlib.metadata.version("flashattn")

assert "site-packages" in flashattn.__file__, flashattn.__file__
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 9, 2, 16), dtype=np.float32) for _ in range(3))
out = flashattn.flash_attn_func(q, k, v, causal=True)
s = np.einsum("bihd,bjhd->bhij", q, k) / 4.0
s[:, :, np.triu_indices(9, 1)[0], np.triu_indices(9, 1)[1]] = -np.inf
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)
err = float(np.abs(out - ref).max())
assert err < 1e-5, err
print(f"package_test: flashattn {flashattn.__version__} from {flashattn.__file__}: max error {err:.2g}")
PY
