#pragma once

// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0):
// https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
//
// Reading accepts little-endian float32 ('<f4') and float16 ('<f2') arrays in C order, of any
// rank, and numpy bool ('|b1') arrays where a mask is read. Writing produces float32 C-order
// version 1.0 files, header padded to a multiple of 64 bytes as NumPy does. Every failure raises
// flashattn::Error with a message that names the file.

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "atomic_file.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::npy {

struct Array {
  DType dtype = DType::f32;         // f32 or f16
  std::vector<std::int64_t> shape;  // empty for a 0-d array
  std::vector<float> f32;           // the elements when dtype == f32
  std::vector<std::uint16_t> f16;   // the elements' binary16 bits when dtype == f16

  std::int64_t numel() const;
  const void* data() const;
  // The elements widened to float32, whatever the stored dtype.
  std::vector<float> to_f32() const;
};

Array read_npy(const std::filesystem::path& path);

// A boolean array ('|b1', numpy's bool) in C order: one byte per element, 0 or 1.
struct BoolArray {
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> values;
};

BoolArray read_npy_bool(const std::filesystem::path& path);

// The header of a version 1.0 file (magic, version, length, dict, padding): `descr` is written
// as given, e.g. "<f4". Exposed so that tests can build files of other dtypes and layouts.
std::string make_header(std::string_view descr, std::span<const std::int64_t> shape,
                        bool fortran_order = false);

// Writes a .npy file without ever leaving a partial one behind. The constructor creates a hidden
// temporary file next to `path`, so an unwritable destination fails before any work is done;
// write() fills it and renames it over `path`. Destroyed without a successful write(), the
// writer removes the temporary file and leaves `path` untouched.
class Writer {
 public:
  explicit Writer(std::filesystem::path path);

  // Writes `data` (C order, product of `shape` elements) as float32. Call at most once.
  void write(const float* data, std::span<const std::int64_t> shape);

  const std::filesystem::path& path() const { return file_.path(); }

 private:
  cli::AtomicFile file_;
};

// Writer(path).write(data, shape).
void write_npy(const std::filesystem::path& path, const float* data,
               std::span<const std::int64_t> shape);

}  // namespace flashattn::npy
