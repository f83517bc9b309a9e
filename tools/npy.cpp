#include "npy.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>

#include "flashattn/dtype.hpp"
#include "flashattn/error.hpp"

namespace flashattn::npy {

// Data is copied between the file and memory without byte swapping.
static_assert(std::endian::native == std::endian::little,
              "the .npy code assumes a little-endian host");

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr std::size_t kHeaderAlignment = 64;   // NumPy pads the whole header to this many bytes
constexpr std::size_t kMaxQuotedHeader = 200;  // longest header excerpt quoted in a message

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& problem) {
  throw Error(path.string() + ": " + problem);
}

std::string errno_text(int error) { return std::strerror(error); }

std::string shape_repr(std::span<const std::int64_t> shape) {
  std::ostringstream text;
  text << '(';
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d > 0) text << ", ";
    text << shape[d];
  }
  if (shape.size() == 1) text << ',';
  text << ')';
  return text.str();
}

// Closes a file descriptor on scope exit.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly `size` bytes unless the file ends first; returns the number read.
std::size_t read_fully(const std::filesystem::path& path, int fd, void* buffer, std::size_t size) {
  auto* bytes = static_cast<char*>(buffer);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t got = ::read(fd, bytes + done, size - done);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(path, "cannot read: " + errno_text(errno));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return done;
}

// A Python literal dict as NumPy writes it, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// Accepts either quote style, any spacing, and a trailing comma in the dict and in the tuple.
struct HeaderDict {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::int64_t> shape;
};

class HeaderParser {
 public:
  HeaderParser(const std::filesystem::path& path, std::string_view text)
      : path_(path), text_(text) {}

  HeaderDict parse() {
    HeaderDict dict;
    bool seen_descr = false, seen_fortran = false, seen_shape = false;
    expect('{');
    while (true) {
      skip_spaces();
      if (peek() == '}') break;
      const std::string key = parse_string("a key");
      expect(':');
      if (key == "descr") {
        mark_seen(seen_descr, key);
        dict.descr = parse_descr();
      } else if (key == "fortran_order") {
        mark_seen(seen_fortran, key);
        dict.fortran_order = parse_bool();
      } else if (key == "shape") {
        mark_seen(seen_shape, key);
        dict.shape = parse_shape();
      } else {
        malformed("unexpected key '" + key + "' (expected 'descr', 'fortran_order', 'shape')");
      }
      skip_spaces();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != '}') malformed("expected ',' or '}'");
    }
    ++pos_;
    skip_spaces();
    if (pos_ != text_.size()) malformed("unexpected text after '}'");
    if (!seen_descr) malformed("missing key 'descr'");
    if (!seen_fortran) malformed("missing key 'fortran_order'");
    if (!seen_shape) malformed("missing key 'shape'");
    return dict;
  }

 private:
  [[noreturn]] void malformed(const std::string& problem) const {
    std::string_view quoted = text_;
    while (!quoted.empty() && (quoted.back() == ' ' || quoted.back() == '\n')) {
      quoted.remove_suffix(1);
    }
    std::string excerpt(quoted.substr(0, kMaxQuotedHeader));
    if (quoted.size() > kMaxQuotedHeader) excerpt += "...";
    fail(path_,
         "malformed header: " + problem + " at offset " + std::to_string(pos_) + " in " + excerpt);
  }

  void mark_seen(bool& seen, const std::string& key) const {
    if (seen) malformed("duplicate key '" + key + "'");
    seen = true;
  }

  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }

  void skip_spaces() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  void expect(char wanted) {
    skip_spaces();
    if (peek() != wanted) malformed(std::string("expected '") + wanted + "'");
    ++pos_;
  }

  std::string parse_string(const char* what) {
    skip_spaces();
    const char quote = peek();
    if (quote != '\'' && quote != '"') malformed(std::string("expected ") + what + " in quotes");
    const std::size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) malformed("unterminated string");
    std::string value(text_.substr(pos_ + 1, end - pos_ - 1));
    if (value.find('\\') != std::string::npos) malformed("unexpected escape in string");
    pos_ = end + 1;
    return value;
  }

  std::string parse_descr() {
    skip_spaces();
    if (peek() == '[' || peek() == '{') {
      fail(path_,
           "unsupported dtype (a structured dtype): accepted dtypes are float32 ('<f4') and "
           "float16 ('<f2')");
    }
    return parse_string("the dtype descr");
  }

  bool parse_bool() {
    skip_spaces();
    for (const auto& [word, value] :
         {std::pair{std::string_view("True"), true}, std::pair{std::string_view("False"), false}}) {
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return value;
      }
    }
    malformed("expected True or False");
  }

  std::vector<std::int64_t> parse_shape() {
    std::vector<std::int64_t> shape;
    expect('(');
    while (true) {
      skip_spaces();
      if (peek() == ')') break;
      shape.push_back(parse_dim());
      skip_spaces();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != ')') malformed("expected ',' or ')' in shape");
    }
    ++pos_;
    return shape;
  }

  std::int64_t parse_dim() {
    if (peek() == '-') malformed("expected a non-negative dimension");
    if (peek() < '0' || peek() > '9') malformed("expected an integer dimension");
    std::int64_t value = 0;
    while (peek() >= '0' && peek() <= '9') {
      if (__builtin_mul_overflow(value, 10, &value) ||
          __builtin_add_overflow(value, peek() - '0', &value)) {
        malformed("dimension overflows a 64-bit integer");
      }
      ++pos_;
    }
    if (peek() == 'L') ++pos_;  // Python 2 long literal, as old NumPy wrote it
    return value;
  }

  const std::filesystem::path& path_;
  std::string_view text_;
  std::size_t pos_ = 0;
};

// "<i8" -> "int64". Only an item size of one or two digits gets a description: a longer one
// (as in "<f11111111111") would overflow the bit count.
std::string dtype_description(std::string_view descr) {
  if (descr.size() < 3 || descr.size() > 4) return "";
  const char kind = descr[1];
  const std::string_view digits = descr.substr(2);
  if (digits.find_first_not_of("0123456789") != std::string_view::npos) return "";
  const std::string bits = std::to_string(8 * std::stoi(std::string(digits)));
  switch (kind) {
    case 'f':
      return "float" + bits;
    case 'i':
      return "int" + bits;
    case 'u':
      return "uint" + bits;
    case 'c':
      return "complex" + bits;
    case 'b':
      return "bool";
    default:
      return "";
  }
}

DType dtype_from_descr(const std::filesystem::path& path, const std::string& descr) {
  if (descr == "<f4") return DType::f32;
  if (descr == "<f2") return DType::f16;
  if (descr == ">f4" || descr == ">f2") {
    fail(path, "big-endian data ('" + descr +
                   "') is not supported: accepted dtypes are little-endian float32 ('<f4') and "
                   "float16 ('<f2')");
  }
  const std::string description = dtype_description(descr);
  fail(path, "unsupported dtype '" + descr + "'" +
                 (description.empty() ? "" : " (" + description + ")") +
                 ": accepted dtypes are float32 ('<f4') and float16 ('<f2')");
}

std::uint32_t little_endian(const unsigned char* bytes, int count) {
  std::uint32_t value = 0;
  for (int i = count - 1; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

}  // namespace

std::int64_t Array::numel() const {
  std::int64_t count = 1;
  for (const std::int64_t dim : shape) count *= dim;
  return count;
}

const void* Array::data() const {
  return dtype == DType::f16 ? static_cast<const void*>(f16.data())
                             : static_cast<const void*>(f32.data());
}

std::vector<float> Array::to_f32() const {
  if (dtype == DType::f32) return f32;
  std::vector<float> widened(f16.size());
  std::transform(f16.begin(), f16.end(), widened.begin(), f32_from_f16);
  return widened;
}

namespace {

// A file's shape and data bytes: float32 or float16 for read_npy, '|b1' for read_npy_bool.
struct RawArray {
  DType dtype = DType::f32;  // floats only
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;
};

RawArray read_raw(const std::filesystem::path& path, bool booleans) {
  const FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (file.get() < 0) fail(path, "cannot open: " + errno_text(errno));
  struct stat info {};
  if (::fstat(file.get(), &info) != 0) fail(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(info.st_mode)) fail(path, "cannot read: not a regular file");
  const auto file_size = static_cast<std::uint64_t>(info.st_size);

  // Preamble: magic, major and minor version, then the header length (2 bytes in version 1.0,
  // 4 bytes in 2.0 and 3.0).
  unsigned char preamble[12] = {};
  const std::size_t got = read_fully(path, file.get(), preamble, 8);
  const std::string_view magic(reinterpret_cast<const char*>(preamble),
                               std::min<std::size_t>(got, 6));
  if (magic != kMagic.substr(0, magic.size())) {
    fail(path, "not a .npy file (it does not start with \\x93NUMPY)");
  }
  if (got < 8) {
    fail(path, "truncated header: the file has " + std::to_string(got) +
                   " bytes, fewer than the 8-byte magic and version");
  }
  const int major = preamble[6], minor = preamble[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    fail(path, "unsupported format version " + std::to_string(major) + "." + std::to_string(minor) +
                   " (supported: 1.0, 2.0, 3.0)");
  }
  const int length_bytes = major == 1 ? 2 : 4;
  if (read_fully(path, file.get(), preamble + 8, length_bytes) !=
      static_cast<std::size_t>(length_bytes)) {
    fail(path, "truncated header: the file ends inside the header length field");
  }
  const std::uint32_t header_length = little_endian(preamble + 8, length_bytes);
  const std::uint64_t data_offset = 8 + length_bytes + static_cast<std::uint64_t>(header_length);
  if (data_offset > file_size) {
    fail(path, "truncated header: it declares " + std::to_string(header_length) +
                   " bytes, the file has " + std::to_string(file_size - 8 - length_bytes) +
                   " after the preamble");
  }
  std::string header_text(header_length, '\0');
  if (read_fully(path, file.get(), header_text.data(), header_length) != header_length) {
    fail(path, "truncated header: the file ended while reading it");
  }

  HeaderDict dict = HeaderParser(path, header_text).parse();
  RawArray array;
  if (booleans && dict.descr != "|b1") {
    const std::string description = dtype_description(dict.descr);
    fail(path, "unsupported dtype '" + dict.descr + "'" +
                   (description.empty() ? "" : " (" + description + ")") +
                   ": a mask must be numpy bool ('|b1')");
  }
  if (!booleans) array.dtype = dtype_from_descr(path, dict.descr);
  if (dict.fortran_order) {
    fail(path,
         "fortran_order True is not supported: expected C order (save "
         "np.ascontiguousarray(a))");
  }
  array.shape = std::move(dict.shape);

  const std::uint64_t item_size = booleans ? 1 : dtype_size(array.dtype);
  const char* type_name = booleans ? "bool" : array.dtype == DType::f32 ? "float32" : "float16";
  std::uint64_t expected_bytes = item_size;
  for (const std::int64_t dim : array.shape) {
    if (__builtin_mul_overflow(expected_bytes, static_cast<std::uint64_t>(dim), &expected_bytes)) {
      fail(path, "shape " + shape_repr(array.shape) + " overflows a 64-bit byte count");
    }
  }
  const std::uint64_t data_bytes = file_size - data_offset;
  if (data_bytes != expected_bytes) {
    const std::string needs = "shape " + shape_repr(array.shape) + " of " + type_name + " needs " +
                              std::to_string(expected_bytes) + " data bytes, the file has " +
                              std::to_string(data_bytes);
    fail(path, (data_bytes < expected_bytes ? "truncated data: " : "data size mismatch: ") + needs);
  }

  array.bytes.resize(expected_bytes);
  if (read_fully(path, file.get(), array.bytes.data(), expected_bytes) != expected_bytes) {
    fail(path, "truncated data: the file ended while reading it");
  }
  return array;
}

}  // namespace

Array read_npy(const std::filesystem::path& path) {
  RawArray raw = read_raw(path, false);
  Array array;
  array.dtype = raw.dtype;
  array.shape = std::move(raw.shape);
  // (An empty array's vectors may hold no storage at all: memcpy must not see their null.)
  if (raw.bytes.empty()) return array;
  if (array.dtype == DType::f32) {
    array.f32.resize(raw.bytes.size() / sizeof(float));
    std::memcpy(array.f32.data(), raw.bytes.data(), raw.bytes.size());
  } else {
    array.f16.resize(raw.bytes.size() / sizeof(std::uint16_t));
    std::memcpy(array.f16.data(), raw.bytes.data(), raw.bytes.size());
  }
  return array;
}

BoolArray read_npy_bool(const std::filesystem::path& path) {
  RawArray raw = read_raw(path, true);
  for (std::size_t i = 0; i < raw.bytes.size(); ++i) {
    if (raw.bytes[i] > 1) {
      fail(path, "element " + std::to_string(i) + " is byte " + std::to_string(raw.bytes[i]) +
                     ": a numpy bool holds 0 or 1");
    }
  }
  return {std::move(raw.shape), std::move(raw.bytes)};
}

std::string make_header(std::string_view descr, std::span<const std::int64_t> shape,
                        bool fortran_order) {
  const std::string dict = "{'descr': '" + std::string(descr) +
                           "', 'fortran_order': " + (fortran_order ? "True" : "False") +
                           ", 'shape': " + shape_repr(shape) + ", }";
  // Version 1.0 stores the header length in 2 bytes; like NumPy, fall back to 2.0 beyond that.
  std::size_t preamble = 10;
  std::size_t total =
      (preamble + dict.size() + 1 + kHeaderAlignment - 1) / kHeaderAlignment * kHeaderAlignment;
  if (total - preamble > 0xffff) {
    preamble = 12;
    total =
        (preamble + dict.size() + 1 + kHeaderAlignment - 1) / kHeaderAlignment * kHeaderAlignment;
  }
  const std::size_t header_length = total - preamble;

  std::string header(kMagic);
  header += static_cast<char>(preamble == 10 ? 1 : 2);
  header += '\0';
  for (std::size_t i = 0; i < preamble - 8; ++i) {
    header += static_cast<char>((header_length >> (8 * i)) & 0xff);
  }
  header += dict;
  header.append(total - header.size() - 1, ' ');
  header += '\n';
  return header;
}

Writer::Writer(std::filesystem::path path) : file_(std::move(path)) {}

void Writer::write(const float* data, std::span<const std::int64_t> shape) {
  if (!file_.is_open()) fail(path(), "cannot write: the writer was already used");
  std::uint64_t count = 1;
  for (const std::int64_t dim : shape) {
    if (dim < 0) {
      file_.discard();
      fail(path(), "cannot write: expected non-negative dims, got shape " + shape_repr(shape));
    }
    count *= static_cast<std::uint64_t>(dim);
  }
  file_.append(make_header("<f4", shape));
  if (count > 0) file_.append(data, count * sizeof(float));
  file_.commit();
}

void write_npy(const std::filesystem::path& path, const float* data,
               std::span<const std::int64_t> shape) {
  Writer(path).write(data, shape);
}

}  // namespace flashattn::npy
