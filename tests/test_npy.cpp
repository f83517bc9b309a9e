// The .npy reader and writer of tools/npy.hpp: round trips, hand-made headers as NumPy and other
// writers produce them, every malformed input, and writes that must leave nothing behind.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashattn/error.hpp"
#include "npy.hpp"

namespace {

namespace fs = std::filesystem;
using flashattn::DType;
using flashattn::Error;

// A fresh directory per test, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "flashattn_npy_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

  // Names of the entries, hidden ones included, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path path_;
};

std::string read_bytes(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <class T>
std::string raw_bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// A complete file: preamble of format version `major`.0, `dict` padded with spaces to 64 bytes
// and ended by '\n' (as NumPy writes it), then `data`.
std::string npy_file(int major, const std::string& dict, const std::string& data) {
  const std::size_t preamble = major == 1 ? 10 : 12;
  const std::size_t total = (preamble + dict.size() + 1 + 63) / 64 * 64;
  const std::size_t length = total - preamble;
  std::string bytes = "\x93NUMPY";
  bytes += static_cast<char>(major);
  bytes += '\0';
  for (std::size_t i = 0; i < preamble - 8; ++i)
    bytes += static_cast<char>((length >> (8 * i)) & 0xff);
  bytes += dict;
  bytes.append(total - bytes.size() - 1, ' ');
  bytes += '\n';
  return bytes + data;
}

// The message of the flashattn::Error that `call` raises; "(no error)" when it raises none.
template <class Call>
std::string error_of(Call&& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

constexpr const char* kDict23 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";

std::string six_floats() { return raw_bytes(std::vector<float>{1, 2, 3, 4, 5, 6}); }

TEST(NpyRoundTrip, PreservesShapeAndEveryBit) {
  const TempDir dir;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  const std::vector<std::vector<std::int64_t>> shapes = {
      {}, {0}, {1}, {7}, {2, 3}, {2, 0, 3}, {3, 1, 2, 5}, {1, 1, 1, 1, 2}};
  for (const auto& shape : shapes) {
    std::int64_t count = 1;
    for (const std::int64_t dim : shape) count *= dim;
    std::vector<float> values(static_cast<std::size_t>(count));
    for (float& value : values) value = normal(rng);
    // Special values must survive bit for bit.
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                              -std::numeric_limits<float>::infinity(), -0.0f,
                              std::numeric_limits<float>::denorm_min()};
    for (std::size_t i = 0; i < std::min<std::size_t>(values.size(), 4); ++i)
      values[i] = specials[i];

    const fs::path path = dir / "a.npy";
    flashattn::npy::write_npy(path, values.data(), shape);
    const flashattn::npy::Array array = flashattn::npy::read_npy(path);
    EXPECT_EQ(array.dtype, DType::f32);
    EXPECT_EQ(array.shape, shape);
    ASSERT_EQ(array.f32.size(), values.size());
    // memcmp on the null data() of an empty vector is undefined, even for 0 bytes.
    EXPECT_TRUE(values.empty() ||
                std::memcmp(array.f32.data(), values.data(), values.size() * sizeof(float)) == 0)
        << "shape rank " << shape.size();
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"a.npy"});
}

TEST(NpyWrite, HeaderIsVersion1AlignedTo64AndEndsInNewline) {
  const TempDir dir;
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  const std::vector<std::pair<std::vector<std::int64_t>, std::string>> cases = {
      {{2, 3}, kDict23},
      {{6}, "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }"},
      {{}, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }"},
  };
  for (const auto& [shape, dict] : cases) {
    const fs::path path = dir / "h.npy";
    flashattn::npy::write_npy(path, values.data(), shape);
    const std::string bytes = read_bytes(path);
    ASSERT_GE(bytes.size(), 10u);
    EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
    const std::size_t length = static_cast<unsigned char>(bytes[8]) |
                               static_cast<std::size_t>(static_cast<unsigned char>(bytes[9])) << 8;
    const std::size_t data_offset = 10 + length;
    EXPECT_EQ(data_offset % 64, 0u);
    EXPECT_EQ(bytes[data_offset - 1], '\n');
    EXPECT_EQ(bytes.substr(10, dict.size()), dict);
    const std::size_t count = shape.empty() ? 1 : 6;  // (2, 3) and (6,) both hold six
    EXPECT_EQ(bytes.size(), data_offset + count * sizeof(float));
  }
}

TEST(NpyWrite, MakeHeaderStaysAlignedAcrossRanks) {
  for (std::size_t rank = 0; rank <= 32; ++rank) {
    const std::vector<std::int64_t> shape(rank, 123456789);
    const std::string header = flashattn::npy::make_header("<f4", shape);
    EXPECT_EQ(header.size() % 64, 0u) << "rank " << rank;
    EXPECT_EQ(header.back(), '\n');
  }
}

TEST(NpyRead, AcceptsHeaderVariantsOfEveryVersion) {
  const TempDir dir;
  const std::vector<std::string> dicts = {
      kDict23,
      "{ 'shape' : ( 2 , 3 , ) , 'fortran_order' : False , 'descr' : '<f4' }",
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2L, 3L)}",
      "{'descr':'<f4','fortran_order':False,'shape':(2,3),}",
  };
  for (const int major : {1, 2, 3}) {
    for (const std::string& dict : dicts) {
      const fs::path path = dir / "v.npy";
      write_bytes(path, npy_file(major, dict, six_floats()));
      const flashattn::npy::Array array = flashattn::npy::read_npy(path);
      EXPECT_EQ(array.shape, (std::vector<std::int64_t>{2, 3}))
          << "version " << major << ": " << dict;
      EXPECT_EQ(array.f32, (std::vector<float>{1, 2, 3, 4, 5, 6})) << "version " << major;
    }
  }
}

TEST(NpyRead, AcceptsRankOneAndScalarShapes) {
  const TempDir dir;
  const fs::path path = dir / "s.npy";
  write_bytes(
      path, npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }", six_floats()));
  EXPECT_EQ(flashattn::npy::read_npy(path).shape, std::vector<std::int64_t>{6});

  write_bytes(path, npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
                             raw_bytes(std::vector<float>{2.5f})));
  const flashattn::npy::Array scalar = flashattn::npy::read_npy(path);
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.f32, std::vector<float>{2.5f});
}

TEST(NpyRead, ReadsFloat16AndWidensIt) {
  const TempDir dir;
  const fs::path path = dir / "h.npy";
  // binary16 bits of 1, -2, 0.5, +inf.
  const std::vector<std::uint16_t> bits = {0x3c00, 0xc000, 0x3800, 0x7c00};
  write_bytes(path, npy_file(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 2), }",
                             raw_bytes(bits)));
  const flashattn::npy::Array array = flashattn::npy::read_npy(path);
  EXPECT_EQ(array.dtype, DType::f16);
  EXPECT_EQ(array.f16, bits);
  const std::vector<float> widened = array.to_f32();
  EXPECT_EQ(widened,
            (std::vector<float>{1.0f, -2.0f, 0.5f, std::numeric_limits<float>::infinity()}));
}

struct MalformedCase {
  const char* name;
  std::string bytes;
  std::vector<std::string> message_parts;
};

std::vector<MalformedCase> malformed_cases() {
  const std::string header23 = npy_file(1, kDict23, "");
  auto dict_file = [](const std::string& dict) { return npy_file(1, dict, six_floats()); };
  return {
      {"empty file", "", {"truncated header"}},
      {"wrong magic", "\x93NUMPX\x01\x00" + std::string(60, ' '), {"not a .npy file"}},
      {"not npy at all", "hello world, this is text", {"not a .npy file"}},
      {"cut inside the version", std::string("\x93NUMPY\x01", 7), {"truncated header"}},
      {"cut inside the length", std::string("\x93NUMPY\x01\x00\x40", 9), {"truncated header"}},
      {"cut inside the dict", header23.substr(0, 30), {"truncated header", "declares"}},
      {"version 4.0",
       std::string("\x93NUMPY\x04\x00", 8) + header23.substr(8),
       {"unsupported format version 4.0", "1.0, 2.0, 3.0"}},
      {"no opening brace",
       dict_file("'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}"),
       {"malformed header", "expected '{'"}},
      {"no closing brace",
       dict_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), "),
       {"malformed header"}},
      {"missing key",
       dict_file("{'descr': '<f4', 'fortran_order': False}"),
       {"malformed header", "missing key 'shape'"}},
      {"unknown key",
       dict_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}"),
       {"unexpected key 'x'"}},
      {"duplicate key",
       dict_file("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}"),
       {"duplicate key 'descr'"}},
      {"key not quoted",
       dict_file("{descr: '<f4', 'fortran_order': False, 'shape': (2, 3)}"),
       {"malformed header", "in quotes"}},
      {"unterminated string",
       dict_file("{'descr: <f4, fortran_order: False, shape: (2, 3)}"),
       {"malformed header"}},
      {"bad dim",
       dict_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x)}"),
       {"malformed header", "integer dimension"}},
      {"negative dim",
       dict_file("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3)}"),
       {"non-negative"}},
      {"huge dim",
       dict_file("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}"),
       {"overflows"}},
      {"shape not a tuple",
       dict_file("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}"),
       {"malformed header", "expected '('"}},
      {"fortran_order not a bool",
       dict_file("{'descr': '<f4', 'fortran_order': maybe, 'shape': (2, 3)}"),
       {"expected True or False"}},
      {"text after the dict",
       dict_file(std::string(kDict23) + " x"),
       {"unexpected text after '}'"}},
      {"float64",
       dict_file("{'descr': '<f8', 'fortran_order': False, 'shape': (3,)}"),
       {"unsupported dtype '<f8' (float64)", "float32", "float16"}},
      {"int32",
       dict_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3)}"),
       {"unsupported dtype '<i4' (int32)", "float32", "float16"}},
      // fuzz_npy findings: an item size of many digits overflowed the bit count in the message.
      {"absurd item size",
       dict_file("{'descr': '<f11111111111111', 'fortran_order': False, 'shape': (6,)}"),
       {"unsupported dtype '<f11111111111111'", "float32", "float16"}},
      {"absurd descr",
       dict_file("{'descr': '111111111111111>f2', 'fortran_order': False, 'shape': (6,)}"),
       {"unsupported dtype '111111111111111>f2'", "float32", "float16"}},
      {"structured dtype",
       dict_file("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,)}"),
       {"structured", "float32", "float16"}},
      {"big-endian float32",
       dict_file("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3)}"),
       {"big-endian", "'>f4'"}},
      {"fortran order",
       dict_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}"),
       {"fortran_order True", "C order"}},
      {"truncated data", header23 + six_floats().substr(0, 20), {"truncated data", "24", "20"}},
      {"extra data", header23 + six_floats() + "1234", {"data size mismatch", "24", "28"}},
  };
}

TEST(NpyRead, EveryMalformedInputRaisesANamedError) {
  const TempDir dir;
  const fs::path path = dir / "bad.npy";
  for (const MalformedCase& bad : malformed_cases()) {
    write_bytes(path, bad.bytes);
    const std::string message = error_of([&] { flashattn::npy::read_npy(path); });
    EXPECT_NE(message.find(path.string() + ": "), std::string::npos) << bad.name << ": " << message;
    for (const std::string& part : bad.message_parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << bad.name << ": expected '" << part << "' in: " << message;
    }
  }
}

TEST(NpyRead, MissingFileAndDirectoryAreErrors) {
  const TempDir dir;
  const std::string missing = error_of([&] { flashattn::npy::read_npy(dir / "absent.npy"); });
  EXPECT_NE(missing.find("absent.npy: cannot open: No such file"), std::string::npos) << missing;
  const std::string directory = error_of([&] { flashattn::npy::read_npy(dir.path()); });
  EXPECT_NE(directory.find("not a regular file"), std::string::npos) << directory;
}

TEST(NpyWrite, UnwritablePathFailsEarlyAndLeavesNothing) {
  const TempDir dir;
  const fs::path missing = dir / "no_such_dir" / "out.npy";
  const std::string message = error_of([&] { flashattn::npy::Writer writer(missing); });
  EXPECT_NE(message.find(missing.string() + ": cannot write: No such file or directory"),
            std::string::npos)
      << message;

  fs::create_directory(dir / "taken");
  const std::string taken = error_of([&] { flashattn::npy::Writer writer(dir / "taken"); });
  EXPECT_NE(taken.find("is a directory"), std::string::npos) << taken;
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"taken"});
}

TEST(NpyWrite, WriterKeepsItsTemporaryHiddenAndRemovesItWhenUnused) {
  const TempDir dir;
  {
    const flashattn::npy::Writer writer(dir / "out.npy");
    const std::vector<std::string> during = dir.entries();
    ASSERT_EQ(during.size(), 1u);
    EXPECT_EQ(during[0].rfind(".out.npy.tmp", 0), 0u) << during[0];
  }
  EXPECT_TRUE(dir.entries().empty());
}

TEST(NpyWrite, FailedWriteKeepsTheOldFileAndRemovesTheTemporary) {
  const TempDir dir;
  const fs::path path = dir / "out.npy";
  write_bytes(path, "old contents");
  const std::vector<std::int64_t> bad_shape = {2, -1};
  const float value = 1.0f;
  EXPECT_THROW(flashattn::npy::write_npy(path, &value, bad_shape), Error);
  EXPECT_EQ(read_bytes(path), "old contents");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out.npy"});

  // A successful write replaces the old file in one rename.
  const std::vector<std::int64_t> shape = {1};
  flashattn::npy::write_npy(path, &value, shape);
  EXPECT_EQ(flashattn::npy::read_npy(path).f32, std::vector<float>{1.0f});
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out.npy"});
}

}  // namespace
