"""One version (issue 53): flashattn.__version__ is the library's own, flashattn::version(), and
that is CMake's project version in CMakeLists.txt, the one place the version is written. The
wheel's metadata reads the same line (pyproject.toml); package_test.sh checks it there."""

from __future__ import annotations

import pathlib
import re

import flashattn
from flashattn import _flashattn


def cmake_project_version() -> str:
    cmake_lists = pathlib.Path(__file__).resolve().parents[2] / "CMakeLists.txt"
    match = re.search(r"^project\(flashattn VERSION ([0-9]+\.[0-9]+\.[0-9]+)",
                      cmake_lists.read_text(), re.MULTILINE)
    assert match, f"no 'project(flashattn VERSION x.y.z' line in {cmake_lists}"
    return match.group(1)


def test_version_is_the_cmake_project_version():
    assert flashattn.__version__ == cmake_project_version()


def test_version_comes_from_the_extension():
    # Read from the built library, not written in the Python sources.
    assert flashattn.__version__ is _flashattn.__version__
    for module in pathlib.Path(flashattn.__file__).parent.glob("*.py"):
        assert not re.search(r"__version__\s*=", module.read_text()), module


def test_build_description_names_a_simd_target_and_a_blas():
    assert _flashattn.simd_target()
    assert _flashattn.blas().startswith(("OpenBLAS ", "plain-loop sgemm"))
