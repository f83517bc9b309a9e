// libFuzzer target: the .npy reader (tools/npy.hpp) on arbitrary bytes. It must either return an
// array whose shape, dtype and element count agree, or raise flashattn::Error; anything else (a
// crash, a sanitizer report, another exception, an inconsistent array) is a finding.
//
// read_npy takes a path, so the bytes go to an in-memory file (memfd) read back through
// /proc/self/fd: no disk traffic, and the reader runs exactly as it does on a real file.

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "flashattn/error.hpp"
#include "npy.hpp"

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "fuzz_npy: %s\n", what);
  std::abort();
}

int memory_file() {
  static const int fd = ::memfd_create("fuzz_npy", MFD_CLOEXEC);
  if (fd < 0) finding("memfd_create failed");
  return fd;
}

void check(const flashattn::npy::Array& array) {
  std::int64_t count = 1;
  for (const std::int64_t dim : array.shape) {
    if (dim < 0) finding("negative dimension");
    count *= dim;
  }
  if (array.numel() != count) finding("numel() disagrees with the shape");
  const auto size = static_cast<std::size_t>(count);
  if (array.dtype == flashattn::DType::f32) {
    if (array.f32.size() != size || !array.f16.empty()) finding("f32 storage of the wrong size");
  } else if (array.dtype == flashattn::DType::f16) {
    if (array.f16.size() != size || !array.f32.empty()) finding("f16 storage of the wrong size");
  } else {
    finding("dtype other than f32 and f16");
  }
  if (array.to_f32().size() != size) finding("to_f32() of the wrong size");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = memory_file();
  if (::ftruncate(fd, 0) != 0) finding("ftruncate failed");
  std::size_t written = 0;
  while (written < size) {
    const ssize_t n = ::pwrite(fd, data + written, size - written, static_cast<off_t>(written));
    if (n <= 0) finding("pwrite failed");
    written += static_cast<std::size_t>(n);
  }
  try {
    check(flashattn::npy::read_npy("/proc/self/fd/" + std::to_string(fd)));
  } catch (const flashattn::Error&) {
    // Malformed input, reported as the reader promises.
  }
  return 0;
}
