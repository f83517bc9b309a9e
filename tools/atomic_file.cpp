#include "atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "flashattn/error.hpp"

namespace flashattn::cli {

namespace {

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& problem) {
  throw Error(path.string() + ": " + problem);
}

}  // namespace

AtomicFile::AtomicFile(std::filesystem::path path) : path_(std::move(path)) {
  if (path_.filename().empty()) fail(path_, "cannot write: expected a file name");
  std::error_code error;
  if (std::filesystem::is_directory(path_, error)) fail(path_, "cannot write: is a directory");

  // A hidden name in the destination's directory, so that the final rename stays within one
  // file system and is atomic.
  static std::atomic<unsigned> counter{0};
  const std::filesystem::path directory =
      path_.has_parent_path() ? path_.parent_path() : std::filesystem::path(".");
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string name(1, '.');
    name += path_.filename().string();
    name += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    temp_path_ = directory / name;
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0 || errno != EEXIST) break;
  }
  if (fd_ < 0) {
    const int open_error = errno;
    temp_path_.clear();
    fail(path_, std::string("cannot write: ") + std::strerror(open_error));
  }
}

AtomicFile::~AtomicFile() {
  if (!committed_) discard();
}

void AtomicFile::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  temp_path_.clear();
}

void AtomicFile::fail_with_errno(int error) {
  discard();
  fail(path_, std::string("cannot write: ") + std::strerror(error));
}

void AtomicFile::append(const void* data, std::size_t size) {
  if (fd_ < 0) fail(path_, "cannot write: the file was already committed or discarded");
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd_, bytes, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail_with_errno(errno);
    }
    bytes += written;
    size -= static_cast<std::size_t>(written);
  }
}

void AtomicFile::commit() {
  if (fd_ < 0) fail(path_, "cannot write: the file was already committed or discarded");
  if (::close(std::exchange(fd_, -1)) != 0) fail_with_errno(errno);
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) fail_with_errno(errno);
  temp_path_.clear();
  committed_ = true;
}

}  // namespace flashattn::cli
